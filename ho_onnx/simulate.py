"""Simulate a schedule: fast-tier memory per step and time with FIFO copy channels.

A schedule is the analysis' node order plus the transfers of an :class:`OffloadChoice`.
Memory is counted per compute position (a tensor occupies the fast tier from the step that
allocates it through its last reader, inclusive). Time follows the order the rewritten
graph executes in under PRIORITY_BASED: before compute step ``i`` the Prefetches issued
there start, then the Waits there block; after step ``i`` the Stores there start, then the
Detaches there block. Each direction is one FIFO channel: a transfer starts when it is
issued and its channel is free (a reload also not before its store finished), and takes
``latency + bytes / bandwidth``. Oversubscription therefore shows as stall.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from .analysis import GraphAnalysis
from .choice import OffloadChoice

Direction = Literal["h2d", "d2h", "disk"]
TransferTime = Callable[[int, Direction], float]  # (bytes, direction) -> seconds


def resident_intervals(analysis: GraphAnalysis, dims: Mapping[str, int] | None = None
                       ) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """Fast-tier interval (first, last position, inclusive) and bytes of every tensor of the
    unmodified schedule. Initializers live for the whole run, graph inputs from the start,
    graph outputs to the end. Tensors of unknown size count 0 bytes (see ``unknown``)."""
    n = len(analysis.order)
    spans: dict[str, tuple[int, int]] = {}
    sizes: dict[str, int] = {}
    for name, t in analysis.tensors.items():
        uses = t.consumers + t.implicit_consumers
        if t.is_initializer:
            if not uses:
                continue  # ORT drops unused initializers
            span = (0, n - 1)
        elif t.producer is not None:
            span = (t.producer, n - 1 if t.is_graph_output else max(uses, default=t.producer))
        elif t.is_graph_input:
            span = (0, n - 1 if t.is_graph_output else max(uses, default=0))
        else:
            continue
        try:
            size = t.nbytes(dims)
        except Exception:  # unbound dims are reported by the planner where they matter
            size = None
        sizes[name] = size or 0
        spans[name] = span
    return spans, sizes


def memory_profile(n: int, intervals: list[tuple[int, int, int]]) -> np.ndarray:
    """Bytes resident at each of ``n`` positions given (start, end, bytes) intervals."""
    delta = np.zeros(n + 1, dtype=np.int64)
    for s, e, b in intervals:
        delta[s] += b
        delta[e + 1] -= b
    return np.cumsum(delta[:n])


def offloaded_intervals(choice: OffloadChoice) -> tuple[set[str], list[tuple[int, int, int]]]:
    """Names whose baseline residency an offload replaces, and their new intervals."""
    names: set[str] = set()
    out: list[tuple[int, int, int]] = []
    for w in choice.weights:
        names.add(w.name)
        out.extend((p, c, w.nbytes) for c, p in zip(w.consumers, w.prefetch_at, strict=True))
    for a in choice.activations:
        names.add(a.name)
        b = a.nbytes or 0
        out.append((a.producer, a.last_early, b))
        out.append((a.prefetch_at, max(a.late), b))
    return names, out


def schedule_memory(analysis: GraphAnalysis, choice: OffloadChoice | None,
                    dims: Mapping[str, int] | None = None) -> np.ndarray:
    """Fast-tier bytes per position of the schedule with ``choice``'s offloads."""
    spans, sizes = resident_intervals(analysis, dims)
    moved, extra = offloaded_intervals(choice) if choice else (set(), [])
    base = [(s, e, sizes[k]) for k, (s, e) in spans.items() if k not in moved]
    return memory_profile(len(analysis.order), base + extra)


@dataclass
class TransferEvent:
    """One simulated transfer."""

    tensor: str
    kind: Literal["reload", "store"]
    direction: Direction
    nbytes: int
    issue_pos: int  # Prefetch: before this step; Store: after this step
    wait_pos: int  # Wait: before this step; Detach: after this step
    start_s: float = 0.0
    end_s: float = 0.0
    stall_s: float = 0.0  # time the compute stream waited for it


@dataclass
class Simulation:
    """Predicted time, memory and per-step trace of one schedule."""

    compute_s: np.ndarray  # per step
    step_start_s: np.ndarray  # when each compute step starts
    memory: np.ndarray  # fast-tier bytes per step
    total_s: float  # end of the run, stalls included
    transfers: list[TransferEvent] = field(default_factory=list)

    @property
    def stall_s(self) -> float:
        return float(sum(t.stall_s for t in self.transfers))

    @property
    def peak_bytes(self) -> int:
        return int(self.memory.max()) if len(self.memory) else 0

    @property
    def peak_pos(self) -> int:
        return int(self.memory.argmax()) if len(self.memory) else 0


def simulate(analysis: GraphAnalysis, choice: OffloadChoice | None, compute_s: np.ndarray,
             transfer_time: TransferTime, dims: Mapping[str, int] | None = None) -> Simulation:
    """Predict time (with FIFO channels) and memory of the schedule of ``choice``."""
    n = len(analysis.order)
    events: list[TransferEvent] = []
    loads_at: list[list[TransferEvent]] = [[] for _ in range(n)]
    waits_at: list[list[TransferEvent]] = [[] for _ in range(n)]
    stores_after: list[list[TransferEvent]] = [[] for _ in range(n)]
    detach_after: list[list[TransferEvent]] = [[] for _ in range(n)]
    store_of: dict[str, TransferEvent] = {}
    if choice is not None:
        for w in choice.weights:
            d: Direction = "disk" if w.tier == "disk" else "h2d"
            for c, p in zip(w.consumers, w.prefetch_at, strict=True):
                ev = TransferEvent(w.name, "reload", d, w.nbytes, p, c)
                events.append(ev)
        for a in choice.activations:
            b = a.nbytes or 0
            st = TransferEvent(a.name, "store", "d2h", b, a.producer, a.last_early)
            ld = TransferEvent(a.name, "reload", "h2d", b, a.prefetch_at, a.late[0])
            store_of[a.name] = st
            events.extend((st, ld))
    for ev in events:
        if ev.kind == "reload":
            loads_at[ev.issue_pos].append(ev)
            waits_at[ev.wait_pos].append(ev)
        else:
            stores_after[ev.issue_pos].append(ev)
            detach_after[ev.wait_pos].append(ev)
    free = {"h2d": 0.0, "d2h": 0.0, "disk": 0.0}
    now = 0.0
    starts = np.zeros(n)
    for i in range(n):
        for ev in loads_at[i]:
            ready = now
            if ev.tensor in store_of and ev.kind == "reload" and ev.direction == "h2d":
                ready = max(ready, store_of[ev.tensor].end_s)
            ev.start_s = max(ready, free[ev.direction])
            ev.end_s = ev.start_s + transfer_time(ev.nbytes, ev.direction)
            free[ev.direction] = ev.end_s
        for ev in waits_at[i]:
            if ev.end_s > now:
                ev.stall_s = ev.end_s - now
                now = ev.end_s
        starts[i] = now
        now += float(compute_s[i])
        for ev in stores_after[i]:
            ev.start_s = max(now, free["d2h"])
            ev.end_s = ev.start_s + transfer_time(ev.nbytes, "d2h")
            free["d2h"] = ev.end_s
        for ev in detach_after[i]:
            if ev.end_s > now:
                ev.stall_s = ev.end_s - now
                now = ev.end_s
    return Simulation(np.asarray(compute_s, dtype=np.float64), starts,
                      schedule_memory(analysis, choice, dims), now, events)
