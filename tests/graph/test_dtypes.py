"""Element types and tensor sizes (graph.dtypes)."""

from __future__ import annotations

from onnx import TensorProto

from ho_onnx.graph.dtypes import MAX_TENSOR_BYTES, capped_nbytes


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
