"""After the greedy: the plan space it searches, a local search in it, and a lower bound.

**The space** (:class:`Space`, built by the planner): each candidate has one set of early uses
(the greedy's for those it chose, its largest gap for the others); an offloaded candidate
has one reload per late reader whose Prefetch position lies in a window (after its early
uses, at most ``max_overlap`` copy-times of compute before its reader, at most
:data:`MAX_WINDOW` positions). Copies on one channel are FIFO in reader order: issue
positions never go backwards, and where the insertion order would put a later reader's
reload first at the same position, the later one is issued strictly later (:attr:`Reload.
event`). The exact planner (:mod:`.exact`) solves over the same space.

**Refinement** (:func:`refine`): from the greedy plan, moves scored by the simulator, each
kept when it shortens the predicted time and the simulated peak stays within the budget:
a stalled reload's Prefetch issued earlier (halving steps toward its window's start), an
offloaded tensor kept resident (drop), one more offloaded where a stalled reload's window
was closed by the budget (add), and the two at once (swap), each also with every Prefetch
placed anew by the greedy's placement; after a set move its positions descend (up to 32
tries) before it is judged. It stops when a round finds nothing or at its deadline
(``options.refine_s``) or after :func:`tries_for` scored points, whichever comes first:
the count, a function of the graph's size, is what bounds it on a machine that is not
overloaded, so a plan does not depend on the machine's load (each simulation costs
O(nodes): about 0.4 s of them at 150 nodes, 1 s at 10,000 on a 2-core VM).

**The weak bound** (:func:`weak_bound`): no plan runs faster than its compute, nor than the
reload time that frees the step the budget is most exceeded at (a fractional knapsack of
the candidates resident there by seconds per byte freed, on the load channels in parallel).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from .simulate import Simulation
from .types import OffloadChoice

#: Most Prefetch positions a reload's window holds (the latest ones before its reader).
MAX_WINDOW = 48


def tries_for(nodes: int) -> int:
    """Scored points a refinement of a graph of ``nodes`` nodes may try: about the same
    simulated work at every size (a simulation is O(nodes)), 4,000 at most, 64 at least."""
    return max(64, min(4000, 2_000_000 // max(nodes, 1)))

Key = tuple[str, int]  # (candidate, index of its reload)


@dataclass(frozen=True)
class Reload:
    """One reload a candidate needs when offloaded: issued at a position in
    ``[lo, reader]`` (its window), timed ``seconds`` on ``direction``; ``event``: its rank in
    the insertion (and simulation) order among reloads issued at one position."""

    key: Key
    reader: int
    lo: int
    nbytes: int
    direction: str
    seconds: float
    event: tuple[int, int, int]


@dataclass(frozen=True)
class Store:
    """An activation's store after ``producer``, detached after ``last_early``."""

    producer: int
    last_early: int
    direction: str
    seconds: float


@dataclass
class State:
    """A point of the space: offloaded candidates (with their early uses) and positions."""

    early: dict[str, tuple[int, ...]]
    positions: dict[Key, int]

    def copy(self) -> State:
        return State(dict(self.early), dict(self.positions))


@dataclass(frozen=True)
class Space:
    """What refinement and the exact planner may choose (module docstring)."""

    budget: int
    compute_s: np.ndarray
    start: np.ndarray  # fast-tier bytes per step with nothing offloaded (the KV cache aside)
    early: Mapping[str, tuple[int, ...]]  # each candidate's one early set
    reloads: Mapping[str, tuple[Reload, ...]]
    stores: Mapping[str, Store]  # activations
    change: Mapping[str, tuple[tuple[int, int, int], ...]]  # offloaded, reloads just in time
    build: Callable[[State], OffloadChoice]
    simulate: Callable[[OffloadChoice], Simulation]
    fixed: tuple[str, ...] = ()  # why the exact planner cannot model it ("" none)
    # the greedy's placement of every reload of a selection (None: positions kept)
    place: Callable[[Mapping[str, tuple[int, ...]]], dict[Key, int]] | None = None
    order: dict[str, list[Reload]] = field(default_factory=dict)  # per channel, reader order

    def __post_init__(self) -> None:
        chans: dict[str, list[Reload]] = {}
        for rs in self.reloads.values():
            for r in rs:
                chans.setdefault(r.direction, []).append(r)
        for rs in chans.values():
            rs.sort(key=lambda r: (r.reader, r.event))
        self.order.update(chans)

    def freed(self, name: str, q: int) -> int:
        """Bytes offloading ``name`` (reloads just in time) frees at step ``q``."""
        return -sum(n for a, b, n in self.change[name] if a <= q <= b)

    def in_order(self, s: State) -> bool:
        """Whether ``s``'s positions are FIFO in reader order (module docstring)."""
        for rs in self.order.values():
            last: Reload | None = None
            for r in rs:
                if r.key[0] not in s.early:
                    continue
                p = s.positions[r.key]
                if not r.lo <= p <= r.reader:
                    return False
                if last is not None:
                    q = s.positions[last.key]
                    if p < q or (p == q and r.event < last.event):
                        return False
                last = r
        return True

    def score(self, s: State) -> Simulation | None:
        """The simulation of ``s``, or None where it leaves the space or breaks the budget."""
        if not self.in_order(s):
            return None
        sim = self.simulate(self.build(s))
        return sim if sim.peak_bytes <= self.budget else None

    def with_offload(self, s: State, name: str) -> State:
        """``s`` with ``name`` offloaded too, each reload at the latest position that
        keeps the FIFO order (its reader, or just before the next reload issued)."""
        t = s.copy()
        t.early[name] = self.early[name]
        for r in self.reloads[name]:
            t.positions[r.key] = r.reader
        for r in self.reloads[name]:
            nxt = [t.positions[x.key] for x in self.order[r.direction]
                   if x.key[0] in t.early and x.key[0] != name and
                   (x.reader, x.event) > (r.reader, r.event)]
            if nxt and min(nxt) < r.reader:
                t.positions[r.key] = max(r.lo, min(nxt) - 1)
        return t


@dataclass
class Refined:
    """The refinement's result: the state, its simulation, and what it did."""

    state: State
    sim: Simulation
    moves: int = 0
    tries: int = 0
    seconds: float = 0.0
    stopped: str = "no move shortens the time"


def _position_moves(space: Space, s: State, sim: Simulation, by_tensor: Mapping[str, str]
                    ) -> list[State]:
    """Each stalled reload issued earlier (halving steps toward its window's start)."""
    out = []
    stalled = sorted((ev for ev in sim.transfers if ev.kind == "reload" and ev.stall_s > 0),
                     key=lambda ev: -ev.stall_s)
    for ev in stalled:
        name = by_tensor.get(ev.tensor)
        if name is None or name not in s.early:
            continue
        r = next((r for r in space.reloads[name] if r.reader == ev.wait_pos), None)
        if r is None:
            continue
        p = s.positions[r.key]
        step = max(1, (p - r.lo) // 2)
        while step >= 1 and p - step >= r.lo:
            t = s.copy()
            t.positions[r.key] = p - step
            out.append(t)
            step //= 2
    return out


def _set_moves(space: Space, s: State, sim: Simulation) -> list[State]:
    """Drops of offloaded candidates whose reloads stall most, adds of candidates resident
    where a stalled reload's window closed, and each pair of the two (swaps)."""
    stall: dict[str, float] = {}
    for ev in sim.transfers:
        if ev.kind == "reload" and ev.stall_s > 0:
            stall[ev.tensor] = stall.get(ev.tensor, 0.0) + ev.stall_s
    drops = sorted((k for k in s.early if k in space.reloads),
                   key=lambda k: -stall.get(k, 0.0))[:4]
    blocked = {ev.issue_pos - 1 for ev in sim.transfers
               if ev.kind == "reload" and ev.stall_s > 0 and ev.issue_pos > 0}
    adds = [k for k in space.change if k not in s.early and any(
        space.freed(k, q) > 0 for q in blocked)][:8]
    out = []
    for d in drops:
        t = s.copy()
        del t.early[d]
        for r in space.reloads[d]:
            del t.positions[r.key]
        out.append(t)
    out += [space.with_offload(s, a) for a in adds]
    out += [space.with_offload(t, a) for t in out[:len(drops)] for a in adds]
    if space.place is not None:  # each again with every Prefetch placed anew, greedily
        out += [State(t.early, space.place(t.early)) for t in out]
    return out


class _Search:
    """One refinement's clock and counts, and its best point so far."""

    def __init__(self, space: Space, seed: State, sim: Simulation, seconds: float,
                 by_tensor: Mapping[str, str]) -> None:
        self.space, self.by_tensor = space, by_tensor
        self.t0, self.seconds = time.perf_counter(), seconds
        self.most = tries_for(len(space.compute_s))
        self.best = Refined(seed, sim)

    def late(self) -> bool:
        return self.best.tries >= self.most or time.perf_counter() - self.t0 > self.seconds

    def descend(self, s: State, sim: Simulation, most: int) -> tuple[State, Simulation]:
        """Position moves from ``s`` while one shortens the time (``most`` tries at most)."""
        tries = 0
        while tries < most and not self.late():
            for t in _position_moves(self.space, s, sim, self.by_tensor):
                tries += 1
                self.best.tries += 1
                got = self.space.score(t)
                if got is not None and got.total_s < sim.total_s * (1 - 1e-9):
                    s, sim = t, got
                    break
                if tries >= most or self.late():
                    return s, sim
            else:
                return s, sim
        return s, sim

    def step(self) -> bool:
        """One improving move from the best point (a set move, then its positions
        descended), or False when none is found."""
        b = self.best
        for t in _set_moves(self.space, b.state, b.sim):
            if self.late():
                return False
            b.tries += 1
            got = self.space.score(t)
            if got is None:
                continue
            t, got = self.descend(t, got, 32)
            if got.total_s < b.sim.total_s * (1 - 1e-9):
                b.state, b.sim = t, got
                b.moves += 1
                return True
        return False


def refine(space: Space, seed: State, sim: Simulation, seconds: float,
           by_tensor: Mapping[str, str]) -> Refined:
    """Local search from ``seed`` (simulated as ``sim``) for at most ``seconds`` (module
    docstring); ``by_tensor``: the candidate each simulated tensor name belongs to."""
    if seconds <= 0:
        return Refined(seed, sim, stopped="off (refine_s 0)")
    run = _Search(space, seed, sim, seconds, by_tensor)
    b = run.best
    state, got = run.descend(seed, sim, 1 << 30)
    if got.total_s < b.sim.total_s * (1 - 1e-9):
        b.state, b.sim, b.moves = state, got, b.moves + 1
    while run.step():
        pass
    b.seconds = time.perf_counter() - run.t0
    if b.tries >= run.most:
        b.stopped = f"{run.most} tries"
    elif run.late():
        b.stopped = f"deadline ({seconds:g} s)"
    return b


@dataclass(frozen=True)
class Bound:
    """A lower bound on the predicted time of every plan in the space: ``kind`` says which
    (``weak``: module docstring; ``exact``: the CP-SAT bound over the space)."""

    seconds: float
    kind: str

    def gap(self, t: float) -> float:
        """``t``'s excess over the bound, as a fraction of the bound."""
        return t / self.seconds - 1.0 if self.seconds > 0 else 0.0


def weak_bound(space: Space, fixed_load_s: float = 0.0) -> Bound:
    """max(total compute, reload seconds that free the most exceeded step) (module
    docstring); ``fixed_load_s``: copies every plan makes (a KV cache's)."""
    compute = float(np.sum(space.compute_s))
    excess = space.start - space.budget
    worst = np.argsort(-excess)[:8]
    best = 0.0
    chans = max(1, len(space.order))
    for q in worst.tolist():
        need = float(excess[q])
        if need <= 0:
            break
        offers = []  # (seconds per byte freed, bytes freed)
        for name in space.change:
            if (freed := space.freed(name, q)) > 0:
                cost = sum(r.seconds for r in space.reloads[name])
                offers.append((cost / freed, freed))
        offers.sort()
        cost = 0.0
        for per, freed in offers:
            take = min(freed, need)
            cost += per * take
            need -= take
            if need <= 0:
                break
        best = max(best, cost / chans)
    return Bound(max(compute, fixed_load_s / chans + best), "weak")
