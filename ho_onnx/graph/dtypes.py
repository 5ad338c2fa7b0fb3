"""Element types: bits per element, names, and the bytes of a dense tensor."""

from __future__ import annotations

import math
from collections.abc import Iterable

from onnx import TensorProto

# Bits per element of every fixed-size ONNX tensor type (STRING and UNDEFINED excluded).
ELEMENT_BITS: dict[int, int] = {
    TensorProto.FLOAT: 32,
    TensorProto.UINT8: 8,
    TensorProto.INT8: 8,
    TensorProto.UINT16: 16,
    TensorProto.INT16: 16,
    TensorProto.INT32: 32,
    TensorProto.INT64: 64,
    TensorProto.BOOL: 8,
    TensorProto.FLOAT16: 16,
    TensorProto.DOUBLE: 64,
    TensorProto.UINT32: 32,
    TensorProto.UINT64: 64,
    TensorProto.COMPLEX64: 64,
    TensorProto.COMPLEX128: 128,
    TensorProto.BFLOAT16: 16,
    TensorProto.FLOAT8E4M3FN: 8,
    TensorProto.FLOAT8E4M3FNUZ: 8,
    TensorProto.FLOAT8E5M2: 8,
    TensorProto.FLOAT8E5M2FNUZ: 8,
    TensorProto.UINT4: 4,
    TensorProto.INT4: 4,
    TensorProto.FLOAT4E2M1: 4,
}


def dtype_name(elem_type: int) -> str:
    """ONNX name of an element type (``FLOAT``, ``INT64``...)."""
    try:
        return TensorProto.DataType.Name(elem_type)
    except ValueError:
        return f"<unknown type {elem_type}>"


def tensor_nbytes(elem_type: int, numel: int) -> int:
    """Bytes of a dense tensor of ``numel`` elements (sub-byte types are packed)."""
    bits = ELEMENT_BITS[elem_type]
    return (numel * bits + 7) // 8


def dense_nbytes(elem_type: int, dims: Iterable[int]) -> int:
    """Bytes of a dense tensor of shape ``dims`` (``elem_type`` must be fixed-size)."""
    return tensor_nbytes(elem_type, math.prod(dims))
