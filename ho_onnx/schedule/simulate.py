"""Simulate a schedule: fast-tier memory per step and time with FIFO copy channels.

A schedule is the analysis' node order plus the transfers of an :class:`OffloadChoice`.
Memory is counted per compute position (a tensor occupies the fast tier from the step that
allocates it through its last reader, inclusive). Time follows the order the rewritten
graph executes in under PRIORITY_BASED: before compute step ``i`` the Prefetches issued
there start, then the Waits there block; after step ``i`` the Stores there start, then the
Detaches there block; a recomputed activation's nodes run again right before its first late
reader (their compute added to that step's). Each direction is one FIFO channel: a transfer
starts when it is issued and its channel is free (a reload also not before its store
finished), and takes ``latency + bytes / bandwidth``. Oversubscription therefore shows as stall.

``host_ahead=True`` times loads as the CUDA engine issues them instead (an estimate for
reports; the planner uses the default): ORT's host thread runs ahead of the GPU, so a
Prefetch is issued long before the GPU reaches it, and its copy waits only for its channel
and for the device staging buffer it lands in. Staging buffers are reused by size, oldest
released first, each after the Wait's copy that last read it (``DeviceStaging`` in
``csrc/cuda/cuda_engine.cc``); a run starts with as many free buffers of each size as it
holds at once. Disk loads keep the default timing.

``copy_in_compute=True`` times the CPU engine (the fast tier is host memory, the CPU EP):
every copy into or out of ORT's memory runs inside a Wait's or a Store's Compute, on the
compute stream (``csrc/cpu_engine.cc``, the transfer lifetime rule). A load from host memory
(the host tier, a stored activation, a caller's input) is then a copy at its Wait, a store
a copy at its Store, both stalling the run for their whole time; a disk read still runs on
its channel from its Prefetch, and its Wait then copies the bytes out of staging at the
host tier's load rate (memcpy).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from .. import kinds
from ..cost.model import Direction, TransferTime
from ..graph.analyse import GraphAnalysis
from .lifetimes import Residency, schedule_memory
from .speculate import PRIOR
from .types import OffloadChoice


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
    waited: bool = True  # False: a speculation's wrong guesses (they only hold the channel)


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


_AtPosition = dict[int, list[TransferEvent]]  # position -> its transfers (few have any)


def _by_position(events: list[TransferEvent], n: int
                 ) -> tuple[_AtPosition, _AtPosition, _AtPosition, _AtPosition]:
    """The reloads' issues and waits, and the stores' issues and detaches, by position in
    the ``n`` steps of the schedule (an :class:`IndexError` names an event outside them)."""
    loads_at: _AtPosition = {}
    waits_at: _AtPosition = {}
    stores_after: _AtPosition = {}
    detach_after: _AtPosition = {}
    for ev in events:
        if not (0 <= ev.issue_pos < n and 0 <= ev.wait_pos < n):
            raise IndexError(f"{ev.tensor}: {ev.kind} at ({ev.issue_pos}, {ev.wait_pos}), "
                             f"outside the {n} steps of the schedule")
        if ev.kind == "reload":
            loads_at.setdefault(ev.issue_pos, []).append(ev)
            waits_at.setdefault(ev.wait_pos, []).append(ev)
        else:
            stores_after.setdefault(ev.issue_pos, []).append(ev)
            detach_after.setdefault(ev.wait_pos, []).append(ev)
    return loads_at, waits_at, stores_after, detach_after


def simulate(analysis: GraphAnalysis, choice: OffloadChoice | None, compute_s: np.ndarray,
             transfer_time: TransferTime, dims: Mapping[str, int] | None = None,
             residency: Residency | None = None, base_memory: np.ndarray | None = None,
             *, host_ahead: bool = False, copy_in_compute: bool = False) -> Simulation:
    """Predict time (with FIFO channels) and memory of the schedule of ``choice``
    (``residency``: the unmodified schedule's, when the caller already has it;
    ``base_memory``: that schedule's bytes per step, when known too; ``host_ahead``: loads
    timed as the CUDA engine issues them; ``copy_in_compute``: as the CPU engine copies,
    module docstring)."""
    n = len(analysis.order)
    events = _events(choice)
    loads_at, waits_at, stores_after, detach_after = _by_position(events, n)
    stored = {ev.tensor: ev for ev in events if ev.kind == "store"}
    # the loads out of host memory (the stored tensors' too: they wait in the default tier):
    # through the CUDA engine's device staging buffers; the CPU engine's copy in the Wait
    staged = kinds.host_loads()
    staging = _staging_pool(n, loads_at, waits_at, staged) if host_ahead else None
    # (the CPU engine: loads out of host memory are the Wait's copy, nothing runs before)
    in_wait = staged if copy_in_compute else frozenset()
    memcpy = kinds.default_tier().load.direction  # (a copy out of host memory)
    free = dict.fromkeys((link.direction for link in kinds.links()), 0.0)
    now = 0.0
    starts = np.zeros(n)
    compute_s = _with_recomputes(choice, np.asarray(compute_s, dtype=np.float64))
    seconds = compute_s.tolist()  # the same floats, without a numpy scalar per step
    for i in range(n):
        for ev in loads_at.get(i, ()):
            if ev.direction in in_wait:
                continue  # (timed at its Wait)
            ready = now
            if staging is not None and ev.direction in staged:
                ready = staging[ev.nbytes].popleft()  # its buffer's last Wait copy
            if ev.tensor in stored:  # a stored tensor's reload: after its store
                ready = max(ready, stored[ev.tensor].end_s)
            ev.start_s = max(ready, free[ev.direction])
            ev.end_s = ev.start_s + transfer_time(ev.nbytes, ev.direction)
            free[ev.direction] = ev.end_s
        for ev in (e for e in waits_at.get(i, ()) if e.waited):
            now = _wait(ev, now, transfer_time, in_wait, memcpy if copy_in_compute else None)
        if staging is not None:
            for ev in waits_at.get(i, ()):
                if ev.direction in staged and ev.waited:
                    staging[ev.nbytes].append(now)  # the Wait copies out: buffer free then
        starts[i] = now
        now += seconds[i]
        for ev in stores_after.get(i, ()):
            ev.start_s = max(now, free[ev.direction])
            ev.end_s = ev.start_s + transfer_time(ev.nbytes, ev.direction)
            free[ev.direction] = ev.end_s
            if copy_in_compute:  # (the Store's copy into the library's pool, in its Compute)
                ev.stall_s = ev.end_s - now
                now = ev.end_s
        for ev in detach_after.get(i, ()):
            if ev.end_s > now:
                ev.stall_s = ev.end_s - now
                now = ev.end_s
    return Simulation(compute_s, starts,
                      schedule_memory(analysis, choice, dims, residency, base_memory), now,
                      events)


def _with_recomputes(choice: OffloadChoice | None, compute_s: np.ndarray) -> np.ndarray:
    """``compute_s`` with each recomputed activation's nodes run again right before its
    first late reader (their compute added to that step's; a copy when there is any)."""
    if choice is None or not choice.recomputes:
        return compute_s
    out = compute_s.copy()
    for r in choice.recomputes:
        out[r.late[0]] += float(compute_s[list(r.nodes)].sum())
    return out


def _wait(ev: TransferEvent, now: float, transfer_time: TransferTime,
          in_wait: frozenset[str], memcpy: Direction | None) -> float:
    """The Wait of load ``ev`` at ``now``: the compute stream waits for the load to land, or,
    ``in_wait`` (the CPU engine's loads out of host memory), does the copy itself; with
    ``memcpy`` (the CPU engine) a load read elsewhere is then copied out of its staging at
    that rate. Returns when the compute stream goes on; ``ev``'s stall is set."""
    if ev.direction in in_wait:  # the copy itself, on the compute stream
        ev.start_s = now
        ev.end_s = now + transfer_time(ev.nbytes, ev.direction)
        ev.stall_s = ev.end_s - now
        return ev.end_s
    if ev.end_s > now:
        ev.stall_s = ev.end_s - now
        now = ev.end_s
    if memcpy is not None:  # (a disk read: then its copy out of staging)
        copy = transfer_time(ev.nbytes, memcpy)
        ev.stall_s += copy
        now += copy
    return now


def _staging_pool(n: int, loads_at: Mapping[int, list[TransferEvent]],
                  waits_at: Mapping[int, list[TransferEvent]], staged: frozenset[str]
                  ) -> dict[int, deque[float]]:
    """Per size, the ready times of the free device staging buffers at the start of a run:
    as many as the run holds at once (taken at a Prefetch, given back at its Wait, in the
    order the host issues them), all free (the last run's copies are done)."""
    held: dict[int, int] = {}
    most: dict[int, int] = {}
    for i in range(n):
        for ev in loads_at.get(i, ()):
            if ev.direction in staged and ev.waited:
                held[ev.nbytes] = held.get(ev.nbytes, 0) + 1
                most[ev.nbytes] = max(most.get(ev.nbytes, 0), held[ev.nbytes])
        for ev in waits_at.get(i, ()):
            if ev.direction in staged and ev.waited:
                held[ev.nbytes] -= 1
    return {b: deque([0.0] * k) for b, k in most.items()}


def _weight_events(choice: OffloadChoice) -> list[TransferEvent]:
    """Each weight reload of ``choice``: its expected bytes, issued at its Prefetch; a
    speculated one (:mod:`.speculate`) in three parts."""
    events: list[TransferEvent] = []
    warmed = {(w.weight, w.consumer): s.issue_at + 1 for s in choice.speculations
              for w in s.warms}
    for w in choice.weights:
        d: Direction = kinds.tier(w.tier).load.direction
        # (routed: the expected share moved; cached: less what the expert cache serves, a
        # copy out of host memory not timed here)
        share = w.fraction * (1.0 - w.hit)
        moved = w.nbytes if share >= 1.0 else int(w.nbytes * share)
        for k, (c, p) in enumerate(zip(w.consumers, w.prefetch_at, strict=True)):
            early = warmed.get((w.name, k))
            if early is None or early > p:
                events.append(TransferEvent(w.name, "reload", d, moved, p, c))
                continue
            # Speculated (schedule.speculate): a layer early, as many bytes as the layer's
            # own misses, right with probability PRIOR; the rest read at its own Prefetch,
            # behind the wrong guesses on the channel.
            right = int(moved * PRIOR)
            events += [TransferEvent(w.name, "reload", d, right, early, c),
                       TransferEvent(w.name, "reload", d, moved - right, early, c, waited=False),
                       TransferEvent(w.name, "reload", d, moved - right, p, c)]
    return events


def _events(choice: OffloadChoice | None) -> list[TransferEvent]:
    """The transfers of ``choice``, not yet timed: each weight reload, and each activation's
    store then reload."""
    events: list[TransferEvent] = []
    if choice is None:
        return events
    events += _weight_events(choice)
    store, load = kinds.stored_links()
    # The KV cache: a past copied in from the caller's host memory before each reader; a
    # present copied out right after its last reader, the compute waiting for it (on the
    # CUDA EP ORT's copy to host memory before the Emit runs on the compute stream).
    for i in choice.inputs:
        events.extend(TransferEvent(i.name, "reload", load.direction, i.nbytes, p, c)
                      for c, p in zip(i.consumers, i.prefetch_at, strict=True))
    for o in choice.outputs:
        events.append(TransferEvent(o.name, "store", store.direction, o.nbytes, o.last, o.last))
    for a in choice.activations:
        b = a.nbytes or 0
        events.append(TransferEvent(a.name, "store", store.direction, b, a.producer,
                                    a.last_early))
        events.append(TransferEvent(a.name, "reload", load.direction, b, a.prefetch_at,
                                    a.late[0]))
    return events
