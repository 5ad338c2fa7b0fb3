"""The data-file fingerprint (graph.fingerprint): the library's FNV-1a (what the rewriter
uses) and the pure-Python fallback against published vectors and each other, the file
fingerprint against FNV-1a written out here; the native library's verification of stamped
files is tested in tests/test_native_safety.py."""

from __future__ import annotations

import struct
import sys

import numpy as np
import pytest

import ho_onnx
from ho_onnx import _ops
from ho_onnx.graph import fingerprint
from ho_onnx.graph.fingerprint import _FNV_OFFSET, data_fingerprint, fnv1a_bytewise, sample_offsets

PRIME, MASK = 0x100000001B3, (1 << 64) - 1
IMPLEMENTATIONS = [pytest.param(_ops.fnv1a64, id="native"),
                   pytest.param(fnv1a_bytewise, id="python")]


def bytewise(h: int, data: bytes) -> int:
    for c in data:
        h = ((h ^ c) * PRIME) & MASK
    return h


def test_the_rewriter_hashes_with_the_library():
    assert fingerprint._fnv1a() is _ops.fnv1a64


@pytest.mark.parametrize("fnv1a", IMPLEMENTATIONS)
def test_known_vectors(fnv1a):
    """Published FNV-1a 64 values (the reference's test suite)."""
    assert fnv1a(_FNV_OFFSET, b"") == 0xCBF29CE484222325
    assert fnv1a(_FNV_OFFSET, b"a") == 0xAF63DC4C8601EC8C
    assert fnv1a(_FNV_OFFSET, b"foobar") == 0x85944171F73967E8


@pytest.mark.parametrize("n", [0, 1, 2, 7, 64, 255, 4096, 70_000])
def test_native_and_python_agree_from_any_state(n):
    rng = np.random.default_rng(n)
    data = rng.integers(0, 256, n, np.uint8).tobytes()
    for h in (_FNV_OFFSET, int(rng.integers(0, 1 << 63)) * 2 + 1, 0, MASK):
        assert _ops.fnv1a64(h, data) == fnv1a_bytewise(h, data)
    assert _ops.fnv1a64(_FNV_OFFSET, memoryview(data)) == fnv1a_bytewise(_FNV_OFFSET, data)


def test_native_hash_refuses_what_is_not_bytes():
    with pytest.raises(TypeError):
        _ops.fnv1a64(_FNV_OFFSET, np.zeros(4, np.float32))
    with pytest.raises(TypeError):
        _ops.fnv1a64(-1, b"x")


@pytest.mark.parametrize("size", [0, 5, 4096, 4097, 100_003])
def test_file_fingerprint_is_fnv_over_size_offsets_and_blocks(tmp_path, size):
    data = np.random.default_rng(size).integers(0, 256, size, np.uint8).tobytes()
    p = tmp_path / "w.bin"
    p.write_bytes(data)
    h = bytewise(_FNV_OFFSET, struct.pack("<Q", size))
    for o in sample_offsets(size):
        h = bytewise(bytewise(h, struct.pack("<Q", o)), data[o:o + 4096])
    assert data_fingerprint(p) == f"fnv1a64s16:{h:016x}"


def test_without_the_compiled_module_the_fingerprint_is_the_same(tmp_path, monkeypatch):
    p = tmp_path / "w.bin"
    p.write_bytes(np.random.default_rng(7).integers(0, 256, 50_000, np.uint8).tobytes())
    native = data_fingerprint(p)
    monkeypatch.setitem(sys.modules, "ho_onnx._ops", None)  # import fails
    monkeypatch.delattr(ho_onnx, "_ops")
    fingerprint._fnv1a.cache_clear()
    try:
        assert fingerprint._fnv1a() is fnv1a_bytewise
        assert data_fingerprint(p) == native
    finally:
        fingerprint._fnv1a.cache_clear()
