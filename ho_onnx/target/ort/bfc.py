"""ORT's BFC arena replayed: the bytes it holds in use at each step for a run's buffers.

ORT's arena (``onnxruntime/core/framework/bfc_arena.cc``, the CPU and CUDA EPs' allocator)
does not hand out exactly what a buffer needs:

* every request is rounded up to 256 bytes;
* it takes the smallest free chunk that fits (ties: the lowest address), and splits it
  only when the chunk is at least twice the request or would waste 128 MiB or more
  (``FindChunkPtr``): a 9 MiB free chunk serves an 8 MiB request whole, and all 9 MiB count
  as in use (``MaxInUse``) until it is freed;
* with no free chunk that fits it grows by a region (below), and a freed chunk coalesces
  only with its free neighbours in the same region.

Replayed from an empty arena, this is ORT's ``MaxInUse`` to the byte where a session's
arena grows by what is requested and every run asks for the same sizes: the arena ho-onnx
gives a model whose inputs all have fixed shapes (``runtime.arena_for``;
``tests/schedule/test_ort_reuse.py``).

What the process holds is the arena's regions (:func:`held`): grown when no free chunk fits,
by exactly the request (``kSameAsRequested``) or by the next power of two of a region size
that starts at 1 MiB and doubles (``kNextPowerOfTwo``, ORT's default), and kept until a
shrink. A region's memory is mapped lazily on the CPU, so there only its bytes up to the
end of the last request it served are touched.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

_MIN = 256
_MAX_DEAD = 128 << 20  # max_dead_bytes_per_chunk's default
_GAP = 1 << 64  # between two regions' addresses (never adjacent: never coalesced)
_INITIAL = 1 << 20  # initial_chunk_size_bytes' default


class _Chunk:
    __slots__ = ("addr", "next", "prev", "size", "used")

    def __init__(self, addr: int, size: int) -> None:
        self.addr, self.size, self.used = addr, size, False
        self.prev: _Chunk | None = None
        self.next: _Chunk | None = None


class _Arena:
    """The arena's free chunks by (size, address), the bytes in use, and its regions: their
    sizes (``reserved``) and their bytes up to the furthest end of a request each served
    (``touched``: the pages a CPU process has written; a region is mapped lazily)."""

    def __init__(self, grow: str = "as_requested") -> None:
        self.free: list[tuple[int, int]] = []
        self.chunk: dict[tuple[int, int], _Chunk] = {}
        self.in_use = 0
        self.regions = 0
        self.grow = grow
        self.curr = _INITIAL  # curr_region_allocation_bytes_ (kNextPowerOfTwo)
        self.reserved = 0
        self.touched = 0
        self.top: dict[int, int] = {}  # region index -> its touched bytes

    def _extend(self, r: int) -> None:
        """``Extend``: a region of exactly ``r`` (kSameAsRequested), or of the next power
        of two of the growing region size (kNextPowerOfTwo), which doubles at each
        extension that did not have to raise it."""
        size = r
        if self.grow == "power_of_two":
            raised = False
            while r > self.curr:
                self.curr *= 2
                raised = True
            size = self.curr
            if not raised:
                self.curr *= 2
        self.regions += 1
        self.reserved += size
        self.top[self.regions] = 0
        self._add(_Chunk(self.regions * _GAP, size))

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
        if i == len(self.free):
            self._extend(r)
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
        region, end = divmod(c.addr + r, _GAP)  # (the request's bytes are those written)
        if end > self.top[region]:
            self.touched += end - self.top[region]
            self.top[region] = end
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


def _replay(buffers: Sequence[tuple[int, int, int]], steps: int, arena: _Arena, runs: int,
            measure: str) -> np.ndarray:
    """``buffers`` allocated and freed step by step in ``arena``, run after run until a run
    grows no region or ``runs`` ran; ``arena``'s attribute ``measure`` after each step's
    allocations, in the last run."""
    born: list[list[int]] = [[] for _ in range(steps)]
    dies: list[list[int]] = [[] for _ in range(steps)]
    for j, (s, e, b) in enumerate(buffers):
        if b > 0:
            born[s].append(j)
            dies[e].append(j)
    out = np.zeros(steps, dtype=np.int64)
    for _ in range(runs):
        before = arena.regions
        chunks: dict[int, _Chunk] = {}
        for p in range(steps):
            for j in born[p]:
                chunks[j] = arena.alloc(buffers[j][2])
            out[p] = getattr(arena, measure)
            for j in dies[p]:
                arena.release(chunks.pop(j))
        if arena.regions == before:
            break
    return out


def in_use(buffers: Sequence[tuple[int, int, int]], steps: int) -> np.ndarray:
    """Bytes ORT's arena holds in use at each of ``steps`` steps for ``buffers``
    (``(start, end, bytes)``: allocated at ``start`` before that step's frees, freed after
    ``end``), from an empty arena: the peak of each step, its allocations made."""
    return _replay(buffers, steps, _Arena(), 1, "in_use")


def held(buffers: Sequence[tuple[int, int, int]], steps: int, grow: str = "as_requested",
         *, touched: bool = False, runs: int = 3) -> np.ndarray:
    """Bytes ORT's arena holds at each of ``steps`` steps for ``buffers`` (as
    :func:`in_use`): its regions (``touched``: only their bytes up to the end of the last
    request each served), replayed run after run in one arena as a session keeps it (no
    region is given back without a shrink), until a run grows none or ``runs`` ran; the
    profile of the last run. ``grow``: "as_requested" (kSameAsRequested) or
    "power_of_two" (kNextPowerOfTwo, ORT's default)."""
    return _replay(buffers, steps, _Arena(grow), runs, "touched" if touched else "reserved")
