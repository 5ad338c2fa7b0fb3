"""The data-file fingerprint (graph.fingerprint) against FNV-1a written byte by byte; the
native library's agreement is tested in tests/test_native_safety.py."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from ho_onnx.graph.fingerprint import _FNV_OFFSET, _fnv1a, data_fingerprint, sample_offsets

PRIME, MASK = 0x100000001B3, (1 << 64) - 1


def bytewise(h: int, data: bytes) -> int:
    for c in data:
        h = ((h ^ c) * PRIME) & MASK
    return h


@pytest.mark.parametrize("n", [0, 1, 2, 7, 63, 64, 65, 255, 256, 4096, 70_000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorised_fnv1a_equals_the_byte_loop(n, seed):
    rng = np.random.default_rng(seed * 1000 + n)
    data = rng.integers(0, 256, n, np.uint8).tobytes()
    for h in (_FNV_OFFSET, int(rng.integers(0, 1 << 63)) * 2 + 1, 0, MASK):
        assert _fnv1a(h, data) == bytewise(h, data)


def test_known_vectors():
    """Published FNV-1a 64 values (the reference's test suite)."""
    assert _fnv1a(_FNV_OFFSET, b"") == 0xCBF29CE484222325
    assert _fnv1a(_FNV_OFFSET, b"a") == 0xAF63DC4C8601EC8C
    assert _fnv1a(_FNV_OFFSET, b"foobar") == 0x85944171F73967E8


@pytest.mark.parametrize("size", [0, 5, 4096, 4097, 100_003])
def test_file_fingerprint_is_fnv_over_size_offsets_and_blocks(tmp_path, size):
    data = np.random.default_rng(size).integers(0, 256, size, np.uint8).tobytes()
    p = tmp_path / "w.bin"
    p.write_bytes(data)
    h = bytewise(_FNV_OFFSET, struct.pack("<Q", size))
    for o in sample_offsets(size):
        h = bytewise(bytewise(h, struct.pack("<Q", o)), data[o:o + 4096])
    assert data_fingerprint(p) == f"fnv1a64s16:{h:016x}"
