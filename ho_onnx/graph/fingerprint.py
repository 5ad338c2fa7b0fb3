"""The data-file fingerprint recorded on weight Prefetch nodes (docs/design.md, "Weight
locations"): the library refuses a data file whose size or fingerprint differs, so a model
never reads another optimization's weights. Reads at most 17 blocks of 4 KiB."""

from __future__ import annotations

import os
import struct

import numpy as np

PREFIX = "fnv1a64s16:"
_BLOCK = 4096
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK = 0xFFFFFFFFFFFFFFFF


_POWERS = np.cumprod(np.full(1, _FNV_PRIME, np.uint64))


def _powers(n: int) -> np.ndarray:
    """P^1 .. P^n mod 2**64 (kept: a fingerprint hashes at most ~70 KB)."""
    global _POWERS
    if _POWERS.size < n:
        _POWERS = np.cumprod(np.full(max(n, 17 * (_BLOCK + 8) + 8), _FNV_PRIME, np.uint64))
    return _POWERS[:n]


def _prefix_xor(bits: np.ndarray) -> np.ndarray:
    """``out[i] = bits[0] ^ ... ^ bits[i]`` of 0/1 bytes (length a multiple of 64), on 64-bit
    words: a prefix XOR within each word by shifts, then the parity of the words before."""
    w = np.packbits(bits, bitorder="little").view("<u8").copy()
    for s in (1, 2, 4, 8, 16, 32):
        w ^= w << np.uint64(s)
    before = np.bitwise_xor.accumulate(w >> np.uint64(63))  # parity of words 0..j
    w[1:] ^= np.uint64(0) - before[:-1]  # all ones after an odd number of set bits
    return np.unpackbits(w.view(np.uint8), bitorder="little")


def _fnv1a(h: int, data: bytes) -> int:
    """FNV-1a 64 of ``data`` from state ``h`` (``h = (h ^ byte) * PRIME mod 2**64`` per byte),
    vectorised: a byte loop in Python costs ~7 ms per fingerprint, this ~1 ms.

    The XOR changes only the state's low byte ``l``, so each step adds
    ``d = (l ^ byte) - l`` before multiplying: ``h_n = h_0·P^n + Σ d_i·P^(n-i)`` (mod 2**64),
    one wrapping dot product once every ``l_i`` is known. The low bytes follow their own
    recurrence ``l' = ((l ^ byte) * 0xB3) & 0xFF`` (the low byte of a product depends on the
    low bytes only), solved a bit at a time: bit k of ``l'`` is bit k of ``l ^ byte`` XOR bit
    k of ``((l ^ byte) mod 2**k) * 0xB3`` (the prime's low byte is odd), so with the bits
    below k known it is a prefix XOR.
    """
    n = len(data)
    if n == 0:
        return h
    c = np.zeros(n + (-n) % 64, np.uint8)  # padded for _prefix_xor; the pad is never used
    c[:n] = np.frombuffer(data, np.uint8)
    low = np.zeros_like(c)  # the state's low byte before each data byte
    for k in range(8):
        x = (low ^ c) & ((1 << k) - 1)
        flip = np.empty_like(c)  # bit k of l_i: h's, XOR the flips of bytes 0..i-1
        flip[0] = (h >> k) & 1
        flip[1:] = ((c[:-1] >> k) ^ ((x[:-1].astype(np.uint16) * (_FNV_PRIME & 0xFF)) >> k)) & 1
        low |= _prefix_xor(flip) << k
    d = (low[:n] ^ c[:n]).astype(np.int64) - low[:n].astype(np.int64)
    powers = _powers(n)[n - 1::-1]  # P^n .. P^1 (wrapping)
    total = int(np.sum(d.astype(np.uint64) * powers, dtype=np.uint64))
    return (h * pow(_FNV_PRIME, n, 1 << 64) + total) & _MASK


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
    return f"{PREFIX}{_fnv1a(_FNV_OFFSET, b''.join(parts)):016x}"
