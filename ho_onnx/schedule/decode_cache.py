"""The decode cache (issue 36, item 3): streamed weights (``--weight-tier disk``) of a range
plan that the library keeps across runs wherever a run's dims leave room under the budget.

A range plan (``--dim seq=1..512 --dim past=0..4095``) holds its budget at the top of the
ranges, where a prefill's activations fill it; a decode step (``seq`` = 1) needs far less,
and without a cache it reads every offloaded weight from the file again. The plan's peak at
each point of the ranges (the bottom, each named point, the top: ``range_points``) is
known, so the room a run leaves is known from its dims: the budget less the larger of the
plan's tensor peak and ORT's replayed arena there.

* **What it keeps**: the streamed weights (a tier outside host memory; routed experts have
  the expert cache instead) in the order their first reloads are issued, as many as the
  point with the most room holds. A run keeps at most what the point covering its dims
  leaves (the point with the most room among those whose every ranged dim is at least the
  run's: peaks only grow with the dims); a run no named point covers keeps what the top
  leaves (usually nothing).
* **How the library does it** (``csrc/expert_cache.h``, ``kernel.cc``): the weights'
  Prefetches go through the data file's cache (attributes ``expert_cache``, the capacity,
  and ``cache_group``); each run's Guards narrow the points the run may use from its dims
  and limit the group's caches to those bytes at once (a prefill empties it before its
  activations are allocated). A miss is read as streamed and kept only where it fits (no
  eviction: the weights of a step are read in the same order every step, where LRU would
  evict each before its next use); a hit copies the kept bytes, nothing is read.
* **Cost model**: at each point, the reloads of the weights its room holds are hits (the
  steady state of consecutive runs there; the first run after a prefill reads them); its
  peak is the plan's plus that room.

Concurrent runs share the cache: the latest run's Guards set the limit, so two runs at
different points hold at most the larger room (memory for two runs is beyond a one-run
budget anyway). On the CUDA EP the cache is not built (the CUDA engine streams every load).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import replace

from .. import kinds
from ..units import format_bytes
from .types import DecodeCache, OffloadChoice, WeightOffload

# A point of a range plan for the cache: its name, the value of every ranged dim there, and
# the room its plan leaves under the budget (bytes, may be negative).
Room = tuple[str, Mapping[str, int], int]


def candidates(choice: OffloadChoice) -> list[WeightOffload]:
    """The weights the decode cache may keep: reloaded from a streamed tier, not routed (the
    expert cache serves those), by their first reload."""
    return sorted((w for w in choice.weights if w.consumers and not any(w.gates)
                   and not kinds.tier(w.tier).in_host_memory),
                  key=lambda w: min(w.prefetch_at))


def decide(choice: OffloadChoice, rooms: Sequence[Room]) -> DecodeCache | str:
    """The decode cache of ``choice`` given each point's room, or why there is none."""
    cands = candidates(choice)
    if not cands:
        return ("no weight is reloaded from a streamed tier (--weight-tier disk): a cache "
                "would copy host memory to host memory")
    best = max((r for _, _, r in rooms), default=0)
    if best <= 0:
        return "no point of the ranges leaves room under the budget"
    kept: list[WeightOffload] = []
    total = 0
    for w in cands:
        if total + w.nbytes > best:
            break
        kept.append(w)
        total += w.nbytes
    if not kept:
        return (f"the most room a point leaves ({format_bytes(best)}) holds none of the "
                f"streamed weights (the first is {format_bytes(cands[0].nbytes)})")
    points = tuple((name, tuple(sorted(at.items())), max(0, min(total, room)))
                   for name, at, room in rooms)
    key = repr((tuple((w.name, w.nbytes) for w in kept), points)).encode()
    group = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & (2**63 - 1) or 1
    return DecodeCache(group, tuple(w.name for w in kept), total, points)


def kept_at(cache: DecodeCache, choice: OffloadChoice, room: int) -> set[str]:
    """The cache's weights a run with ``room`` bytes keeps (those that fit, by first
    reload)."""
    sizes = {w.name: w.nbytes for w in choice.weights}
    out: set[str] = set()
    total = 0
    for name in cache.weights:
        if total + sizes[name] > room:
            break
        out.add(name)
        total += sizes[name]
    return out


def with_hits(choice: OffloadChoice, hits: set[str]) -> OffloadChoice:
    """A copy of ``choice`` whose reloads of ``hits`` are all served by the cache."""
    return replace(choice, weights=[replace(w, hit=1.0) if w.name in hits else w
                                    for w in choice.weights])


def describe(cache: DecodeCache) -> str:
    """``decode cache: 3 weights (12.0 MiB) kept across runs; decode: 12.0 MiB, top: 0 B``"""
    return (f"decode cache: {len(cache.weights)} weights ({format_bytes(cache.capacity)}) kept "
            "across runs where a run's dims leave room; " + ", ".join(
                f"{name}: {format_bytes(b)}" for name, _, b in cache.points))


def guard_rows(cache: DecodeCache, dims: Sequence[str]) -> tuple[list[int], list[int]]:
    """A Guard's ``cache_points`` (the value of each of its ``dims`` at each point, row by
    row) and ``cache_bytes`` (each point's)."""
    rows: list[int] = []
    for _, at, _ in cache.points:
        values = dict(at)
        rows += [values[d] for d in dims]
    return rows, [b for _, _, b in cache.points]


def rooms_of(points: Mapping[str, tuple[Mapping[str, int], int]], budget: int) -> list[Room]:
    """Each point's room: the budget less its peak (``points``: name -> (dims, peak))."""
    return [(name, at, budget - peak) for name, (at, peak) in points.items()]
