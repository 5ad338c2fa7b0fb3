"""OffloadOptions: the one options vocabulary checks what it is given."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ho_onnx.schedule.options import MIN_BYTES_BUDGET, MIN_BYTES_EXPLICIT, OffloadOptions


def test_sizes_may_be_written_as_text_and_stay_bytes():
    o = OffloadOptions(budget="8GiB", host_budget="1.5GiB", min_bytes="64KiB")
    assert (o.budget, o.host_budget, o.min_bytes) == (8 << 30, 3 << 29, 64 << 10)
    assert OffloadOptions(budget=np.int64(4096)).budget == 4096
    assert type(OffloadOptions(budget=np.int64(4096)).budget) is int


@pytest.mark.parametrize(("kw", "said"), [
    ({"budget": 1.5}, "budget must be a whole number, not 1.5"),
    ({"budget": 4.0}, "budget must be a whole number, not 4.0"),
    ({"budget": math.nan}, "budget must be a whole number, not nan"),
    ({"budget": True}, "budget must be a whole number, not True"),
    ({"budget": "8 lots"}, "budget: '8 lots' is not a size"),
    ({"budget": -5}, "budget must be positive, not -5"),
    ({"min_gap": 2.5}, "min_gap must be a whole number, not 2.5"),
    ({"min_bytes": -1}, "min_bytes must be >= 0, not -1"),
    ({"arena_refits": -1}, "arena_refits must be >= 0, not -1"),
    ({"budget": 1, "prefetch_distance": 3}, "prefetch_distance=3 is for the explicit policy"),
    ({"budget": 1, "prefetch_distance": 2}, "prefetch_distance=2 is for the explicit policy"),
    ({"host_budget": 1}, "host_budget needs a budget"),
    ({"max_extra_s": math.nan}, "max_extra_s must be a number, not nan"),
    ({"max_extra_s": -1.0}, "max_extra_s must be >= 0"),
    ({"weights": 1}, "weights must be True or False, not 1"),
    ({"weight_tier": "ssd"}, "weight_tier must be host|disk, not 'ssd'"),
])
def test_bad_values_are_one_clear_error(kw, said):
    """Found by hand: a NaN or fractional budget was accepted (NaN compares false with
    every peak), '8GiB' was a TypeError about '<='."""
    with pytest.raises(ValueError) as e:
        OffloadOptions(**kw)
    assert str(e.value).startswith(said), str(e.value)


def test_defaults():
    assert OffloadOptions().min_bytes_or_default == MIN_BYTES_EXPLICIT
    assert OffloadOptions(budget=1).min_bytes_or_default == MIN_BYTES_BUDGET
    assert OffloadOptions(max_extra_s=math.inf).max_extra_s == math.inf  # no time limit


def test_prefetch_distance_is_the_explicit_policys():
    """A distance given with a budget is refused above (was: ignored without a word, the
    CLI alone refusing it); the default is no distance given, also through
    ``dataclasses.replace`` (the planner's refits lower the budget so) and for the explicit
    policy handed options with a budget, which ignores the budget."""
    from dataclasses import replace

    from graphs import chain_model

    from ho_onnx.graph.analyse import analyse
    from ho_onnx.schedule.options import PREFETCH_DISTANCE
    from ho_onnx.schedule.policy import ExplicitPolicy

    assert OffloadOptions().prefetch_distance == PREFETCH_DISTANCE
    assert OffloadOptions(prefetch_distance=0).prefetch_distance == 0
    planned = replace(OffloadOptions(), budget=1 << 30)
    assert replace(planned, budget=1 << 20).prefetch_distance == PREFETCH_DISTANCE
    with pytest.raises(ValueError, match="prefetch_distance=3 is for the explicit policy"):
        replace(OffloadOptions(prefetch_distance=3), budget=1 << 30)
    d = ExplicitPolicy(replace(planned, min_bytes=0, min_gap=1)).decide(analyse(chain_model()),
                                                                        {"N": 2})
    assert d.choice.weights
