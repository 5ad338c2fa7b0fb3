"""ORT's BFC arena replayed: the bytes it holds in use at each step for a run's buffers.

ORT's arena (``onnxruntime/core/framework/bfc_arena.cc``, the CPU and CUDA EPs' allocator)
does not hand out exactly what a buffer needs:

* every request is rounded up to 256 bytes;
* it takes the smallest free chunk that fits (ties: the lowest address), and splits it
  only when the chunk is at least twice the request or would waste 128 MiB or more
  (``FindChunkPtr``): a 9 MiB free chunk serves an 8 MiB request whole, and all 9 MiB count
  as in use (``MaxInUse``) until it is freed;
* with no free chunk that fits it grows by a region of exactly the request
  (``kSameAsRequested``), and a freed chunk coalesces only with its free neighbours in the
  same region.

Replayed from an empty arena, this is ORT's ``MaxInUse`` to the byte where a session's
arena grows by what is requested and every run asks for the same sizes: the arena ho-onnx
gives a model whose inputs all have fixed shapes (``runtime.arena_for``;
``tests/schedule/test_ort_reuse.py``). A model with symbolic dims gets ORT's own arena,
grown by powers of two and carried from run to run (prefill chunks, then decode steps of
growing context): replayed from empty, that arena's chunks over-counted an 8-layer decoder's
8k-context run by 41 % (64.9 MiB against 46.1: its steady state comes from the runs before),
so there the buffers' bytes are counted as they are (:mod:`.arena`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

_MIN = 256
_MAX_DEAD = 128 << 20  # max_dead_bytes_per_chunk's default
_GAP = 1 << 40  # between two regions' addresses (never adjacent: never coalesced)


class _Chunk:
    __slots__ = ("addr", "next", "prev", "size", "used")

    def __init__(self, addr: int, size: int) -> None:
        self.addr, self.size, self.used = addr, size, False
        self.prev: _Chunk | None = None
        self.next: _Chunk | None = None


class _Arena:
    """The arena's free chunks by (size, address) and the bytes in use."""

    def __init__(self) -> None:
        self.free: list[tuple[int, int]] = []
        self.chunk: dict[tuple[int, int], _Chunk] = {}
        self.in_use = 0
        self.regions = 0

    def _add(self, c: _Chunk) -> None:
        key = (c.size, c.addr)
        bisect.insort(self.free, key)
        self.chunk[key] = c

    def _take(self, c: _Chunk) -> None:
        key = (c.size, c.addr)
        del self.free[bisect.bisect_left(self.free, key)]
        del self.chunk[key]

    def alloc(self, nbytes: int) -> _Chunk:
        r = -(-nbytes // _MIN) * _MIN
        i = bisect.bisect_left(self.free, (r, -1))
        if i == len(self.free):  # Extend: a region of exactly the request
            self.regions += 1
            self._add(_Chunk(self.regions * _GAP, r))
            i = bisect.bisect_left(self.free, (r, -1))
        c = self.chunk[self.free[i]]
        self._take(c)
        if c.size >= 2 * r or c.size - r >= _MAX_DEAD:  # SplitChunk
            rest = _Chunk(c.addr + r, c.size - r)
            rest.prev, rest.next = c, c.next
            if c.next is not None:
                c.next.prev = rest
            c.next, c.size = rest, r
            self._add(rest)
        c.used = True
        self.in_use += c.size
        return c

    def release(self, c: _Chunk) -> None:
        c.used = False
        self.in_use -= c.size
        nxt = c.next
        if nxt is not None and not nxt.used:  # FreeAndMaybeCoalesce
            self._take(nxt)
            c.size, c.next = c.size + nxt.size, nxt.next
            if nxt.next is not None:
                nxt.next.prev = c
        prev = c.prev
        if prev is not None and not prev.used:
            self._take(prev)
            prev.size, prev.next = prev.size + c.size, c.next
            if c.next is not None:
                c.next.prev = prev
            c = prev
        self._add(c)


def in_use(buffers: Sequence[tuple[int, int, int]], steps: int) -> np.ndarray:
    """Bytes ORT's arena holds in use at each of ``steps`` steps for ``buffers``
    (``(start, end, bytes)``: allocated at ``start`` before that step's frees, freed after
    ``end``), from an empty arena: the peak of each step, its allocations made."""
    born: list[list[int]] = [[] for _ in range(steps)]
    dies: list[list[int]] = [[] for _ in range(steps)]
    for j, (s, e, b) in enumerate(buffers):
        if b > 0:
            born[s].append(j)
            dies[e].append(j)
    arena = _Arena()
    held: dict[int, _Chunk] = {}
    out = np.zeros(steps, dtype=np.int64)
    for p in range(steps):
        for j in born[p]:
            held[j] = arena.alloc(buffers[j][2])
        out[p] = arena.in_use
        for j in dies[p]:
            arena.release(held.pop(j))
    return out
