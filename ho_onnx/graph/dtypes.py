"""Element types: bits per element, names, and the bytes of a dense tensor."""

from __future__ import annotations

import math
from collections.abc import Iterable

import onnx_ir as ir
from onnx import TensorProto

# Bits per element (``onnx_ir``'s) of the fixed-size tensor types the op library registers
# ops for (csrc/common.cc): STRING and UNDEFINED have no width; types newer than ONNX 1.18's
# FLOAT4E2M1 (FLOAT8E8M0, 2- and 6-bit types) have no kernels in the runtimes supported.
ELEMENT_BITS: dict[int, int] = {int(t): t.bitwidth for t in (
    ir.DataType.FLOAT, ir.DataType.UINT8, ir.DataType.INT8, ir.DataType.UINT16,
    ir.DataType.INT16, ir.DataType.INT32, ir.DataType.INT64, ir.DataType.BOOL,
    ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.UINT32, ir.DataType.UINT64,
    ir.DataType.COMPLEX64, ir.DataType.COMPLEX128, ir.DataType.BFLOAT16,
    ir.DataType.FLOAT8E4M3FN, ir.DataType.FLOAT8E4M3FNUZ, ir.DataType.FLOAT8E5M2,
    ir.DataType.FLOAT8E5M2FNUZ, ir.DataType.UINT4, ir.DataType.INT4, ir.DataType.FLOAT4E2M1,
)}


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


# No tensor is bigger; a model's dims can claim any size (300 dims of 2**62: a byte count
# of ~5,600 digits, past what Python turns into text).
MAX_TENSOR_BYTES = 1 << 50  # 1 PiB


def capped_numel(dims: Iterable[int]) -> int | None:
    """The element count of shape ``dims``, or None when a dim is negative or the count is
    over what :data:`MAX_TENSOR_BYTES` holds of 1-bit elements (the product stops growing
    there; a zero dim anywhere is an empty tensor)."""
    numel, zero, over = 1, False, False
    for d in dims:  # (one pass: this runs for every tensor a cost or size is asked of)
        if d < 0:
            return None
        if d == 0:
            zero = True
        elif not over:
            numel *= d
            over = numel > _MAX_NUMEL
    return 0 if zero else None if over else numel


_MAX_NUMEL = MAX_TENSOR_BYTES << 3


def capped_nbytes(elem_type: int, dims: Iterable[int]) -> int | None:
    """:func:`dense_nbytes` of ``dims``, or None when a dim is negative or the size is over
    :data:`MAX_TENSOR_BYTES` (:func:`capped_numel`)."""
    numel = capped_numel(dims)
    if numel is None:
        return None
    nbytes = tensor_nbytes(elem_type, numel)
    return nbytes if nbytes <= MAX_TENSOR_BYTES else None
