"""The decode cache (issue 36, item 3; opt-in, ``--decode-cache``): streamed weights
(``--weight-tier disk``) of a range plan that the library keeps across runs, or reads ahead,
wherever a run's dims leave room under the budget.

A range plan (``--dim seq=1..512 --dim past=0..4095``) holds its budget at the top of the
ranges, where a prefill's activations fill it; a decode step (``seq`` = 1) needs far less,
and without a cache it reads every offloaded weight from the file again. The plan's peak at
each point of the ranges (the bottom, each named point, the top: ``range_points``) is
known, so the room a run leaves is known from its dims: the budget less the larger of the
plan's tensor peak and ORT's replayed arena there.

* **What it does with a point's room**, split by the point's simulation (:func:`splits`,
  :func:`timed`): *kept*, the streamed weights (a tier outside host memory; routed experts
  have the expert cache instead) in the order their first reloads are issued, each that
  still fits; *read ahead*, each Prefetch of the cache starts the next reloads' reads that
  fit, wrapping around to the next run's first. A run uses the split of the point covering
  its dims with the most room (among those whose every ranged dim is at least the run's:
  peaks only grow with the dims); a run no named point covers uses the top's (usually
  nothing).
* **How the library does it** (``csrc/expert_cache.h``, ``cpu_engine.cc``, ``kernel.cc``):
  every reload's Prefetch carries the plan's group (``cache_group``), its place among the
  group's reloads (``cache_order``) and the capacity (``expert_cache``); the group has one
  cache whatever file its weights are in; each run's Guards narrow the points the run may
  use from its dims and the last one limits the cache and the reads ahead to that point's
  bytes at once (a prefill empties both before its activations are allocated). A miss is
  kept only where it fits (no eviction: the weights of a step are read in the same order
  every step, where LRU would evict each before its next use); a hit copies the kept
  bytes; a read ahead is taken only by the weight it was read for.
* **Cost model**: at each point, the reloads of the weights kept there are hits (the steady
  state of consecutive runs there; the first run after a prefill reads them), the others
  issued as early as the reads ahead allow; its peak is the plan's plus that room.

Opt-in because the room is the plan's, not the process's: ORT's CPU arena keeps what a
prefill allocated, so the cache can come on top of it (docs/benchmarks.md). Concurrent runs
share the cache: the latest run's Guards set the limit, so two runs at different points hold
at most the larger room (memory for two runs is beyond a one-run budget anyway). On the
CUDA EP the cache is not built (the CUDA engine streams every load).
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


def reloads(cache: DecodeCache, choice: OffloadChoice) -> list[tuple[str, int]]:
    """The cache's reloads ``(weight, consumer index)`` in the order their Prefetches run
    (by position): a Prefetch's ``cache_order`` is its index here."""
    by_name = {w.name: w for w in choice.weights}
    return sorted(((n, k) for n in cache.weights for k in range(len(by_name[n].consumers))),
                  key=lambda r: (by_name[r[0]].prefetch_at[r[1]], by_name[r[0]].consumers[r[1]]))


def decide(choice: OffloadChoice, rooms: Sequence[Room]) -> DecodeCache | str:
    """The decode cache of ``choice`` given each point's room (all kept, none read ahead:
    the pipeline then weighs :func:`splits` by simulation), or why there is none."""
    cands = candidates(choice)
    if not cands:
        return ("no weight of the main graph is reloaded from a streamed tier (--weight-tier "
                "disk: a cache of the host tier would copy host memory to host memory; weights "
                "planned inside If branches or Loop bodies are not cached)")
    best = max((r for _, _, r in rooms), default=0)
    if best <= 0:
        return "no point of the ranges leaves room under the budget"
    if best < min(w.nbytes for w in cands):
        return (f"the most room a point leaves ({format_bytes(best)}) holds none of the "
                f"streamed weights (the smallest is {format_bytes(min(w.nbytes for w in cands))})")
    total = sum(w.nbytes for w in cands)
    points = tuple((name, tuple(sorted(at.items())), max(0, min(total, room)), 0)
                   for name, at, room in rooms)
    key = repr((tuple((w.name, w.nbytes) for w in cands), points)).encode()
    group = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & (2**63 - 1) or 1
    cache = DecodeCache(group, tuple(w.name for w in cands), 0, points)
    return with_points(cache, choice, points)


def with_points(cache: DecodeCache, choice: OffloadChoice,
                points: Sequence[tuple[str, tuple[tuple[str, int], ...], int, int]]
                ) -> DecodeCache:
    """``cache`` with ``points`` (name, dims, room to keep, ahead), each point's room to keep
    cut to the bytes of the weights it keeps (the library fills the same ones under either);
    its capacity the most any point keeps."""
    points = [(name, at, _kept_bytes(cache, choice, kept), ahead)
              for name, at, kept, ahead in points]
    cap = max((kept for _, _, kept, _ in points), default=0)
    return replace(cache, capacity=cap, points=tuple(points))


def kept_at(cache: DecodeCache, choice: OffloadChoice, room: int) -> set[str]:
    """The cache's weights a run with ``room`` bytes keeps: each that still fits, in the
    order of their first reloads (the library keeps a miss only where it fits)."""
    sizes = {w.name: w.nbytes for w in choice.weights}
    out: set[str] = set()
    total = 0
    for name in cache.weights:
        if total + sizes[name] <= room:
            out.add(name)
            total += sizes[name]
    return out


def _kept_bytes(cache: DecodeCache, choice: OffloadChoice, room: int) -> int:
    sizes = {w.name: w.nbytes for w in choice.weights}
    return sum(sizes[n] for n in kept_at(cache, choice, room))


def splits(cache: DecodeCache, choice: OffloadChoice, room: int) -> list[tuple[int, int]]:
    """The ways to use ``room`` the planner weighs ``(kept, ahead)``: all kept, or one, two or
    four of the largest reload read ahead and the rest kept."""
    largest = max(w.nbytes for w in choice.weights if w.name in cache.weights)
    out = [(room, 0)]
    for n in (1, 2, 4):
        ahead = min(room, n * largest)
        if (room - ahead, ahead) not in out:
            out.append((room - ahead, ahead))
    return out


def timed(choice: OffloadChoice, cache: DecodeCache, kept: int, ahead: int) -> OffloadChoice:
    """A copy of ``choice`` as a run with ``kept`` and ``ahead`` bytes runs it (for the
    simulation of that point): the reloads of the kept weights are hits, and each other
    reload of the cache is issued at the earliest Prefetch of the cache whose later reads,
    up to it, fit ``ahead`` (the library reads ahead at every one; none fitting: at the
    start of the run, read during the previous one)."""
    hits = kept_at(cache, choice, kept)
    by_name = {w.name: w for w in choice.weights}
    order = reloads(cache, choice)
    issue: dict[tuple[str, int], int] = {}
    for i, (n, k) in enumerate(order if ahead > 0 else ()):
        window = by_name[n].nbytes  # (the cache's reads after Prefetch j, up to this one)
        if n in hits or window > ahead:
            continue
        j = i - 1
        while j >= 0:
            extra = 0 if order[j][0] in hits else by_name[order[j][0]].nbytes
            if window + extra > ahead:
                break
            window += extra
            j -= 1
        at = 0 if j < 0 else by_name[order[j][0]].prefetch_at[order[j][1]]
        issue[(n, k)] = min(at, by_name[n].prefetch_at[k])
    return replace(choice, weights=[
        replace(w, hit=1.0) if w.name in hits else
        replace(w, prefetch_at=tuple(issue.get((w.name, k), p)
                                     for k, p in enumerate(w.prefetch_at)))
        if any((w.name, k) in issue for k in range(len(w.consumers))) else w
        for w in choice.weights])


def describe(cache: DecodeCache) -> str:
    """``decode cache: 3 weights (12.0 MiB) kept across runs; decode: 12.0 MiB kept, ...``"""
    return (f"decode cache: up to {format_bytes(cache.capacity)} of {len(cache.weights)} "
            "streamed weights kept across runs, and reads ahead, where a run's dims leave "
            "room; " + ", ".join(
                f"{name}: {format_bytes(kept)} kept" + (
                    f" + {format_bytes(ahead)} read ahead" if ahead else "")
                for name, _, kept, ahead in cache.points))


def guard_rows(cache: DecodeCache, dims: Sequence[str]) -> tuple[list[int], list[int], list[int]]:
    """A Guard's ``cache_points`` (the value of each of its ``dims`` at each point, row by
    row), ``cache_bytes`` and ``cache_ahead`` (each point's)."""
    rows: list[int] = []
    for _, at, _, _ in cache.points:
        values = dict(at)
        rows += [values[d] for d in dims]
    return rows, [b for _, _, b, _ in cache.points], [a for _, _, _, a in cache.points]
