"""Random feeds for the tools that run models (target/ort/session.random_inputs)."""

from __future__ import annotations

import numpy as np
import pytest

from ho_onnx.errors import UnsupportedModelError
from ho_onnx.target.ort.session import numpy_max_ndim, random_inputs
from tests.graphs import text_model


def test_feeds_follow_dims_and_types():
    m = text_model("g (float[N,3] x, int64[2] ids) => (float[N,3] y) { y = Identity (x) }")
    feeds = random_inputs(m, {"N": 4}, int_high=5)
    assert feeds["x"].shape == (4, 3) and feeds["x"].dtype == np.float32
    assert feeds["ids"].dtype == np.int64 and set(feeds["ids"]) <= set(range(5))


def test_a_negative_dim_is_refused_in_words():
    m = text_model("g (float[N,3] x) => (float[N,3] y) { y = Identity (x) }")
    m.graph.input[0].type.tensor_type.shape.dim[1].dim_value = -1
    with pytest.raises(UnsupportedModelError, match=r"declares the shape \[2, -1\]"):
        random_inputs(m, {"N": 2})


def test_a_feed_larger_than_memory_is_refused_before_allocating():
    m = text_model("g (float[N,3] x) => (float[N,3] y) { y = Identity (x) }")
    with pytest.raises(UnsupportedModelError, match="more than this machine's memory"):
        random_inputs(m, {"N": 2**40})
    # 300 dims of 2**62 (found by tests/optimize_fuzz.py): was an unexpected OverflowError
    # while formatting the size; the message stays short
    dims = m.graph.input[0].type.tensor_type.shape.dim
    for _ in range(300):
        dims.add().dim_value = 2**62
    with pytest.raises(UnsupportedModelError, match=r"\(302 dims\) needs at least 2\^") as e:
        random_inputs(m, {"N": 2})
    assert len(str(e.value)) < 400


def test_more_dims_than_numpy_holds_are_refused_in_words():
    """An empty input of rank 302 (found by tests/optimize_fuzz.py, seed 158: numpy's
    "maximum supported dimension" ValueError escaped verify); numpy's own limit applies,
    whatever the element type (strings too), and the rank numpy holds still gets data."""
    for ty in ("float", "string"):
        m = text_model(f"g ({ty}[N,3] x) => ({ty}[N,3] y) {{ y = Identity (x) }}")
        dims = m.graph.input[0].type.tensor_type.shape.dim
        for _ in range(300):
            dims.add().dim_value = 2
        with pytest.raises(UnsupportedModelError, match=r"'x' has 302 dimensions, more"):
            random_inputs(m, {"N": 0})
        del dims[numpy_max_ndim():]
        for d in dims[2:]:
            d.dim_value = 1
        assert random_inputs(m, {"N": 0})["x"].ndim == numpy_max_ndim()
        del dims[3:]
        dims[2].dim_value = 2**62  # empty, but numpy cannot index 3 * 2**62 of the others
        with pytest.raises(UnsupportedModelError, match=r"is empty, but numpy cannot index"):
            random_inputs(m, {"N": 0})


def test_integer_feeds_never_wrap_past_their_type():
    """--int-high past a type's range (found by hand: int8 ids drawn from [0, 1000) wrapped to
    negative values; uint64 with a high past int64 was an unexpected ValueError): each type
    is drawn from [0, min(int_high, its end))."""
    m = text_model("g (int8[64] a, uint8[64] b, int32[64] c, uint64[64] d) => (int8[64] y) "
                   "{ y = Identity (a) }")
    feeds = random_inputs(m, {}, int_high=(1 << 63) - 1)
    for name, end in (("a", 128), ("b", 256), ("c", 1 << 31), ("d", 1 << 63)):
        v = feeds[name].astype(np.float64)
        assert v.min() >= 0 and v.max() < end, name
    assert feeds["a"].max() > 64  # drawn over the type's whole range, not clipped at 0
