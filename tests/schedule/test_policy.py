"""The explicit policy (schedule.policy) and the eligibility rules it applies."""

from __future__ import annotations

import pytest
from graphs import chain_model

from ho_onnx.errors import UnboundDimError
from ho_onnx.graph.analyse import analyse
from ho_onnx.schedule.eligibility import largest_gap
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.schedule.policy import choose


def test_unbound_dim_is_named():
    a = analyse(chain_model())
    with pytest.raises(UnboundDimError, match=r"'N'.*--dim N="):
        a.tensors["h1"].nbytes({})
    # min_bytes > 0 needs the size of every activation candidate
    with pytest.raises(UnboundDimError, match="'N'"):
        choose(a, OffloadOptions(weights=False, min_bytes=1, min_gap=1))
    # ... but forced offload of everything does not
    c = choose(a, OffloadOptions(weights=False, min_bytes=0, min_gap=1))
    assert {x.name for x in c.activations} >= {"h1", "h2"}


def test_largest_gap():
    assert largest_gap(0, [1, 5]) == (4, 1)
    assert largest_gap(0, [3, 4]) == (3, 0)
    assert largest_gap(2, [3]) == (1, 0)


def test_choice_policy():
    a = analyse(chain_model(), {"N": 4})
    c = choose(a, OffloadOptions(min_bytes=0, min_gap=3))
    assert {w.name for w in c.weights} == {"W1", "W2"}
    assert [x.name for x in c.activations] == ["h1"]  # the only gap >= 3
    h1 = c.activations[0]
    assert (h1.producer, h1.early, h1.late) == (0, (1,), (5,))
    assert c.skipped["y"] == "graph output"
    c = choose(a, OffloadOptions(activations=False, min_bytes=2000))
    assert [w.name for w in c.weights] == []  # 1024 bytes each
    assert choose(a, OffloadOptions(weights=False, activations=False)).weights == []


def test_both_deciders_fit_the_decision_seam():
    """The explicit policy and the budget planner are Deciders: same call, a Decision whose
    metadata names the decider; options select which one the pipeline uses."""
    from ho_onnx.cost.source import CostSource
    from ho_onnx.rewrite.pipeline import decider_for
    from ho_onnx.schedule.planner import BudgetPlanner, Plan
    from ho_onnx.schedule.policy import ExplicitPolicy
    from ho_onnx.schedule.types import Decision

    a = analyse(chain_model(), {"N": 4})
    explicit = decider_for(OffloadOptions(min_bytes=0, min_gap=3))
    assert isinstance(explicit, ExplicitPolicy)
    d = explicit.decide(a, {"N": 4})
    assert type(d) is Decision and d.choice == choose(a, explicit.options, {"N": 4})
    assert d.metadata()["policy"].startswith("offload=all min_bytes=0 min_gap=3")
    planner = decider_for(OffloadOptions(budget=1 << 30), CostSource())
    assert isinstance(planner, BudgetPlanner)
    p = planner.decide(a, {"N": 4})
    assert isinstance(p, Plan) and p.metadata()["policy"] == "planner"
    assert p.metadata()["budget_bytes"] == str(1 << 30) and not p.choice.weights
