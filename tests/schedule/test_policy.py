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


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_recorded_host_bytes_mean_the_same_for_both_deciders(tier):
    """``host_bytes`` in the metadata is the slow tier's peak (host-tier weights + stored
    peak) for the explicit policy as for the planner (was: every offloaded byte, disk-tier
    weights included, and activations summed, not their peak)."""
    from ho_onnx.schedule.lifetimes import host_bytes, stored_peak_bytes
    from ho_onnx.schedule.policy import ExplicitPolicy

    a = analyse(chain_model(), {"N": 4})
    d = ExplicitPolicy(OffloadOptions(min_bytes=0, min_gap=1, weight_tier=tier)).decide(
        a, {"N": 4})
    assert d.choice.weights and d.choice.activations
    weights = 0 if tier == "disk" else sum(w.nbytes for w in d.choice.weights)
    assert int(d.metadata()["host_bytes"]) == host_bytes(d.choice) \
        == weights + stored_peak_bytes(d.choice) < d.choice.offloaded_bytes


HOST_READS = """
host_reads (float[4, 6] x) => (float[6, 2] y, float[6, 2] z) {
  r = Reshape(x, shape)
  m = MatMul(r, W)
  y, z = Split<axis = 1>(m, sizes)
}
"""


def test_tensors_a_cuda_kernel_reads_in_host_memory_stay_resident(tmp_path):
    """Reshape's shape and Split's sizes: offloaded, they would come back to the device and
    ORT would copy them to the host again with a stream sync. Both deciders keep them (W
    is offloaded, forced), and the rewritten model computes the same outputs in ORT."""
    import numpy as np
    import onnxruntime as ort
    from graphs import save, text_model

    from ho_onnx.cost.model import CostModel
    from ho_onnx.rewrite.pipeline import optimize
    from ho_onnx.schedule.planner import plan
    from ho_onnx.target.ort import runtime
    from ho_onnx.target.ort.placement import HOST_INPUT_REASON

    m = text_model(HOST_READS, W=(4, 4), shape=np.array([6, 4], np.int64),
                   sizes=np.array([2, 2], np.int64))
    a = analyse(m)
    c = choose(a, OffloadOptions(min_bytes=0, min_gap=1))
    assert [w.name for w in c.weights] == ["W"]
    assert c.skipped["shape"] == c.skipped["sizes"] == HOST_INPUT_REASON
    costs = CostModel(np.full(len(a.order), 1e-3), lambda nbytes, direction: nbytes / 1e9)
    p = plan(a, OffloadOptions(budget=1 << 30, min_bytes=0, arena_refits=0), costs)
    assert p.choice.skipped["shape"] == p.choice.skipped["sizes"] == HOST_INPUT_REASON

    src = save(m, tmp_path / "m.onnx")
    out = tmp_path / "m.ho.onnx"
    r = optimize(src, out, OffloadOptions(min_bytes=0, min_gap=1))
    assert [w.name for w in r.decision.choice.weights] == ["W"]
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    so = ort.SessionOptions()  # the same kernels in both (no fusions, no packed W)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.add_session_config_entry("session.disable_prepacking", "1")
    want = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})
    got = runtime.InferenceSession(str(out), sess_options=so,
                                   providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_external_shape_initializers_stay_eligible(tmp_path):
    """In external data ORT's shape inference cannot read Reshape's shape (such a model
    does not load in ORT as it is): those stay candidates, and reloading them is what lets
    the rewritten model load."""
    import numpy as np
    from graphs import save, text_model

    from ho_onnx.graph.load import load_model

    m = text_model(HOST_READS, W=(4, 4), shape=np.array([6, 4], np.int64),
                   sizes=np.array([2, 2], np.int64))
    loaded = load_model(save(m, tmp_path / "m.onnx", external=True))
    c = choose(analyse(loaded.model), OffloadOptions(min_bytes=0, min_gap=1))
    assert {w.name for w in c.weights} == {"W", "shape", "sizes"}
