"""The data-file fingerprint recorded on weight Prefetch nodes (docs/design.md, "Weight
locations"): the library refuses a data file whose size or fingerprint differs, so a model
never reads another optimization's weights. Reads at most 17 blocks of 4 KiB."""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Callable

PREFIX = "fnv1a64s16:"
_BLOCK = 4096
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK = 0xFFFFFFFFFFFFFFFF


def fnv1a_bytewise(h: int, data: bytes) -> int:
    """FNV-1a 64 of ``data`` from state ``h``, a byte at a time (``h = (h ^ byte) * PRIME
    mod 2**64``): ~7 ms for a fingerprint's ~70 KB, where the compiled module is missing."""
    for c in data:
        h = ((h ^ c) * _FNV_PRIME) & _MASK
    return h


@functools.cache
def _fnv1a() -> Callable[[int, bytes], int]:
    """The library's own FNV-1a (``ho_onnx._ops.fnv1a64``, csrc/fnv1a.h: ~0.1 ms a
    fingerprint), or :func:`fnv1a_bytewise` when the compiled module cannot be imported."""
    try:
        from .. import _ops
    except (ImportError, RuntimeError):  # (RuntimeError: a library of another C API)
        return fnv1a_bytewise
    return _ops.fnv1a64


def sample_offsets(size: int) -> list[int]:
    """Ascending, without duplicates: ``(size * k) // 16`` for k in 0..15 and
    ``max(0, size - 4096)``; offsets at or past the end only for an empty file."""
    offsets = sorted({(size * k) // 16 for k in range(16)} | {max(0, size - _BLOCK)})
    return [o for o in offsets if o < size or size == 0]


def data_fingerprint(path: str | os.PathLike[str]) -> str:
    """``"fnv1a64s16:"`` + 16 hex digits: FNV-1a 64 over the size (8 bytes LE), then for
    each sampled offset ``o`` (:func:`sample_offsets`), ``o`` (8 bytes LE) and the
    ``min(4096, size - o)`` bytes at ``o``. Not cryptographic: it tells files apart."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        parts = [struct.pack("<Q", size)]
        for o in sample_offsets(size):
            parts += [struct.pack("<Q", o), os.pread(f.fileno(), min(_BLOCK, size - o), o)]
    return f"{PREFIX}{_fnv1a()(_FNV_OFFSET, b''.join(parts)):016x}"
