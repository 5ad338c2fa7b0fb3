"""Element types and tensor sizes (graph.dtypes)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto

from ho_onnx.graph.dtypes import MAX_TENSOR_BYTES, capped_nbytes, capped_numel


def test_capped_sizes():
    """One place for the byte count of a model's declared shape: exact up to 1 PiB, None past
    it (300 dims of 2**62 made a ~5,600-digit count) or for a negative dim."""
    assert capped_nbytes(TensorProto.FLOAT, [2, 3]) == 24
    assert capped_nbytes(TensorProto.INT4, [3]) == 2  # packed
    assert capped_nbytes(TensorProto.FLOAT, [2**62] * 300 + [0]) == 0  # empty
    assert capped_nbytes(TensorProto.FLOAT, [2**62] * 300) is None
    assert capped_nbytes(TensorProto.UINT8, [MAX_TENSOR_BYTES]) == MAX_TENSOR_BYTES
    assert capped_nbytes(TensorProto.UINT8, [MAX_TENSOR_BYTES + 1]) is None
    assert capped_nbytes(TensorProto.FLOAT, [4, -4]) is None  # (was -64 bytes)


def _numel_by_definition(dims: list[int]) -> int | None:
    """capped_numel as its docstring defines it, computed the slow way."""
    if any(d < 0 for d in dims):
        return None
    numel = math.prod(dims)
    return numel if numel == 0 or numel <= MAX_TENSOR_BYTES << 3 else None


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.integers(-2, 3), st.integers(0, 2**62)), max_size=12))
def test_capped_numel_matches_its_definition(dims: list[int]):
    """One pass over the dims (a negative one anywhere: None; a zero one anywhere: 0, even
    past the cap; else the product while it stays under the cap)."""
    assert capped_numel(dims) == _numel_by_definition(dims)
    assert capped_numel(iter(dims)) == _numel_by_definition(dims)  # any iterable, once
