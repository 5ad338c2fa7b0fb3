"""The budget planner: which tensors leave the fast tier, and when each transfer starts.

1. **Candidates**: initializers and activations (with a gap of at least ``min_gap`` steps)
   of at least ``min_bytes``. Each gets the HyperOffload multi-factor score
   ``bytes × seconds off-device / (transfer seconds × transfers)``: big, long-idle, rarely
   read tensors on a fast link first.
2. **Feasibility**: the peak with every candidate offloaded and every reload issued just
   before its reader is the smallest budget this planner can meet; a budget below it fails
   before anything is written, naming that budget and the step and tensors that dominate it.
3. **Selection** (greedy, re-simulating memory after every decision): while the simulated
   peak exceeds the budget, offload the best-scoring candidate that is resident at the peak
   step and would not be after offloading (an activation is split around that step). Then a
   trim pass drops, latest first, every offload the budget does not need.
4. **Execution-order refinement**: each reload's Prefetch position ``p`` minimises
   ``cost(p) = max(0, C_trans − C_overlap(p)) + α · residency(p)`` with ``α → 0+``: the
   latest position whose predicted completion leaves ``(preferred_overlap − 1) × C_trans`` of
   slack before its reader, never opening the window more than ``max_overlap × C_trans``
   of compute early, never where the window would break the budget. Copies on one channel
   are FIFO: reloads are placed in reader order, issue positions never go backwards, and a
   reload cannot start before the channel is free (so oversubscription shows as stall).
   Stores start right after the producer; Detaches sit right after the last early reader.
   Look-ahead: a reload still stalling because the budget was full where its window would
   open gets one more tensor offloaded there, kept only if the re-simulated time drops.
5. **Prediction**: :func:`ho_onnx.simulate.simulate` of the final schedule.

No compute nodes are reordered (the refinement moves only cache operators).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .analysis import GraphAnalysis
from .choice import (
    ActivationOffload,
    OffloadChoice,
    Tier,
    WeightOffload,
    _ineligible,
    reads_only_shape,
)
from .errors import HoOnnxError
from .simulate import Simulation, TransferTime, memory_profile, resident_intervals, simulate


class InfeasibleBudgetError(HoOnnxError):
    """The budget is below the smallest peak any plan of this planner reaches."""

    def __init__(self, message: str, min_budget: int) -> None:
        super().__init__(message)
        self.min_budget = min_budget


@dataclass(frozen=True)
class PlannerOptions:
    """Options of :func:`plan` (overlap ratios as in XLA's memory-space assignment)."""

    budget: int
    min_bytes: int = 64 << 10
    min_gap: int = 2
    preferred_overlap: float = 1.5
    max_overlap: float = 10.0
    weight_tier: Tier = "host"
    weights: bool = True
    activations: bool = True
    max_extra: int = 64  # look-ahead tries to rescue stalled reloads (see _make_room)
    max_extra_s: float = 2.0
    host_budget: int | None = None  # slow-tier (host) bytes; offloaded weights beyond go to disk

    def __post_init__(self) -> None:
        if self.budget <= 0:
            raise ValueError("budget must be positive")
        if self.preferred_overlap < 1 or self.max_overlap < self.preferred_overlap:
            raise ValueError("need 1 <= preferred_overlap <= max_overlap")


@dataclass
class _Cand:
    name: str
    kind: str  # "weight" | "activation"
    nbytes: int
    uses: list[int]  # data readers, ascending
    shape_readers: tuple[int, ...]
    producer: int
    score: float
    span: tuple[int, int]  # baseline residency
    tier: Tier = "host"


@dataclass
class Plan:
    """What the planner decided and what it predicts."""

    choice: OffloadChoice
    options: PlannerOptions
    baseline: Simulation
    planned: Simulation
    min_budget: int
    host_bytes: int  # peak bytes the slow tier holds (weights + stored activations)

    @property
    def fits(self) -> bool:
        return self.planned.peak_bytes <= self.options.budget


def _fmt(b: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= k:
            return f"{b / k:.2f} {unit}"
    return f"{int(b)} B"


@dataclass
class _State:
    mem: np.ndarray
    chosen: dict[str, tuple[int, ...]] = field(default_factory=dict)  # name -> early uses
    order: list[str] = field(default_factory=list)


def _candidates(analysis: GraphAnalysis, opts: PlannerOptions, dims: Mapping[str, int],
                compute_s: np.ndarray, transfer_time: TransferTime,
                spans: dict[str, tuple[int, int]]) -> list[_Cand]:
    total = float(compute_s.sum()) or 1.0
    prefix = np.concatenate([[0.0], np.cumsum(compute_s)])
    out: list[_Cand] = []
    for name, t in analysis.tensors.items():
        if name not in spans or _ineligible(t) is not None:
            continue
        if t.is_initializer:
            if not opts.weights or t.is_graph_input:
                continue
        elif t.producer is None or not opts.activations:
            continue
        nbytes = t.nbytes(dims)  # raises UnboundDimError naming the dim
        if nbytes is None or nbytes < opts.min_bytes:
            continue
        if t.is_initializer:
            shape_readers = tuple(c for c in t.consumers if reads_only_shape(analysis.node_at(c)))
            uses = [c for c in t.consumers if c not in shape_readers]
            tt = transfer_time(nbytes, "disk" if opts.weight_tier == "disk" else "h2d")
            busy = sum(float(compute_s[c]) for c in uses)
            score = nbytes * max(total - busy, 0.0) / (tt * max(len(uses), 1))
            out.append(_Cand(name, "weight", nbytes, uses, shape_readers, -1, score, spans[name],
                             opts.weight_tier))
        else:
            assert t.producer is not None
            uses = sorted(t.consumers)
            prev, best = t.producer, 0.0
            gap_steps = 0
            for u in uses:
                if u - prev >= opts.min_gap:
                    best = max(best, float(prefix[u] - prefix[prev + 1]))
                    gap_steps = max(gap_steps, u - prev)
                prev = u
            if gap_steps < opts.min_gap:
                continue
            tt = transfer_time(nbytes, "d2h") + transfer_time(nbytes, "h2d")
            out.append(_Cand(name, "activation", nbytes, uses, (), t.producer,
                             nbytes * best / tt, spans[name]))
    out.sort(key=lambda c: -c.score)
    return out


def _split(c: _Cand, s: int, min_gap: int) -> tuple[int, ...] | None:
    """Early uses if ``c`` offloaded around step ``s`` leaves the fast tier at ``s``."""
    if c.kind == "weight":
        return None if s in c.uses or not c.uses else ()
    if s <= c.producer or s in c.uses:
        return None
    early = tuple(u for u in c.uses if u < s)
    late = [u for u in c.uses if u > s]
    last_early = early[-1] if early else c.producer
    if not late or late[0] - last_early < min_gap:
        return None
    return early


def _minimal(c: _Cand, early: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Fast-tier intervals of ``c`` offloaded with every reload just before its reader."""
    if c.kind == "weight":
        return [(u, u, c.nbytes) for u in c.uses]
    late = [u for u in c.uses if u not in early]
    last_early = early[-1] if early else c.producer
    return [(c.producer, last_early, c.nbytes), (late[0], late[-1], c.nbytes)]


def _apply(mem: np.ndarray, c: _Cand, early: tuple[int, ...], sign: int) -> None:
    s, e = c.span
    mem[s:e + 1] -= sign * c.nbytes
    for a, b, n in _minimal(c, early):
        mem[a:b + 1] += sign * n


def _largest_gap_split(c: _Cand, min_gap: int) -> tuple[int, ...] | None:
    if c.kind == "weight":
        return ()
    prev, best, k_best = c.producer, -1, -1
    for k, u in enumerate(c.uses):
        if u - prev >= min_gap and u - prev > best:
            best, k_best = u - prev, k
        prev = u
    return None if k_best < 0 else tuple(c.uses[:k_best])


def _infeasible(analysis: GraphAnalysis, cands: list[_Cand], spans: dict[str, tuple[int, int]],
                sizes: dict[str, int], opts: PlannerOptions) -> tuple[int, str]:
    """Smallest budget this planner can meet, and what dominates it."""
    n = len(analysis.order)
    mem = memory_profile(n, [(s, e, sizes[k]) for k, (s, e) in spans.items()])
    moved: dict[str, list[tuple[int, int, int]]] = {}
    for c in cands:
        early = _largest_gap_split(c, opts.min_gap)
        if early is None:
            continue
        _apply(mem, c, early, +1)
        moved[c.name] = _minimal(c, early)
    pos = int(mem.argmax())
    alive = []
    for k, (s, e) in spans.items():
        ivs = moved.get(k, [(s, e, sizes[k])])
        if any(a <= pos <= b for a, b, _ in ivs) and sizes[k]:
            alive.append((sizes[k], k))
    alive.sort(reverse=True)
    node = analysis.node_at(pos)
    top = ", ".join(f"{k} ({_fmt(b)})" for b, k in alive[:4])
    what = (f"at step {pos} (node {node.name or node.op_type!r}, {node.op_type}) "
            f"{_fmt(int(mem[pos]))} must be resident: {top}")
    return int(mem.max()), what


def _place(analysis: GraphAnalysis, cands: dict[str, _Cand], state: _State,
           opts: PlannerOptions, compute_s: np.ndarray, transfer_time: TransferTime
           ) -> OffloadChoice:
    """Refine the Prefetch positions (module docstring, step 4) and build the choice."""
    prefix = np.concatenate([[0.0], np.cumsum(compute_s)])
    mem = state.mem.copy()
    budget = opts.budget
    reloads: list[tuple[int, str, int]] = []  # (reader, name, index of reload)
    for name in state.order:
        c = cands[name]
        if c.kind == "weight":
            reloads.extend((u, name, k) for k, u in enumerate(c.uses))
        else:
            early = state.chosen[name]
            late = [u for u in c.uses if u not in early]
            reloads.append((late[0], name, 0))
    reloads.sort()
    positions: dict[tuple[str, int], int] = {}
    free = {"h2d": 0.0, "disk": 0.0}
    last_issue = {"h2d": 0, "disk": 0}
    for u, name, k in reloads:
        c = cands[name]
        direction = "disk" if c.kind == "weight" and c.tier == "disk" else "h2d"
        tt = transfer_time(c.nbytes, direction)  # type: ignore[arg-type]
        if c.kind == "weight":
            lo = 0
        else:
            early = state.chosen[name]
            lo = (early[-1] if early else c.producer) + 1
        lo = max(lo, last_issue[direction])
        deadline = prefix[u]
        margin = (opts.preferred_overlap - 1.0) * tt
        best_p, best_end = u, max(prefix[u], free[direction]) + tt
        p = u
        while p > lo:
            q = p - 1
            if mem[q] + c.nbytes > budget or deadline - prefix[q] > opts.max_overlap * tt:
                break
            p = q
            end = max(prefix[p], free[direction]) + tt
            if end < best_end:
                best_p, best_end = p, end
            if deadline - end >= margin:
                break
        mem[best_p:u] += c.nbytes
        positions[(name, k)] = best_p
        free[direction] = best_end
        last_issue[direction] = best_p
    choice = OffloadChoice(policy=None)
    for name in state.order:
        c = cands[name]
        if c.kind == "weight":
            choice.weights.append(WeightOffload(
                name, c.nbytes, tuple(c.uses),
                tuple(positions[(name, k)] for k in range(len(c.uses))),
                c.shape_readers, c.tier))
        else:
            early = state.chosen[name]
            late = tuple(u for u in c.uses if u not in early)
            choice.activations.append(ActivationOffload(
                name, c.nbytes, c.producer, early, late, positions[(name, 0)]))
    return choice


def _host_peak(cands: dict[str, _Cand], state: _State, n: int) -> tuple[int, int]:
    """(host-tier weight bytes, peak bytes of stored activations) of the current choice."""
    weights = sum(cands[k].nbytes for k in state.order
                  if cands[k].kind == "weight" and cands[k].tier == "host")
    acts = []
    for k in state.order:
        c = cands[k]
        if c.kind == "activation":
            acts.append((c.producer, c.uses[-1], c.nbytes))
    return weights, int(memory_profile(n, acts).max(initial=0)) if acts else 0


def _assign_tiers(cands: dict[str, _Cand], state: _State, opts: PlannerOptions, n: int) -> None:
    """Fit ``opts.host_budget``: offloaded weights move to the disk tier, those read fewest
    times and biggest first (each byte moved frees host memory for the fewest disk reads)."""
    if opts.host_budget is None:
        return
    weights, acts = _host_peak(cands, state, n)
    if acts > opts.host_budget:
        raise InfeasibleBudgetError(
            f"host budget {_fmt(opts.host_budget)} is below the {_fmt(acts)} the offloaded "
            "activations need on the host at once; raise --host-budget or the device budget",
            acts)
    order = sorted((cands[k] for k in state.order
                    if cands[k].kind == "weight" and cands[k].tier == "host"),
                   key=lambda c: (len(c.uses), -c.nbytes))
    for c in order:
        if weights + acts <= opts.host_budget:
            break
        c.tier = "disk"
        weights -= c.nbytes


def _make_room(analysis: GraphAnalysis, cand_list: list[_Cand], cands: dict[str, _Cand],
               state: _State, opts: PlannerOptions, compute_s: np.ndarray,
               transfer_time: TransferTime, dims: Mapping[str, int], choice: OffloadChoice,
               planned: Simulation) -> tuple[OffloadChoice, Simulation]:
    """Look-ahead: a reload that stalls because its window could not open (the budget was
    full just before it) may be rescued by offloading one more tensor resident there. Try
    the best-scoring such tensor, re-place and re-simulate; keep it only if the predicted
    time drops. Bounded by ``opts.max_extra`` tries and ``opts.max_extra_s`` seconds."""
    t_end = time.perf_counter() + opts.max_extra_s
    tried: set[str] = set()
    for _ in range(opts.max_extra):
        if time.perf_counter() > t_end:
            break
        stalled = sorted((ev for ev in planned.transfers
                          if ev.kind == "reload" and ev.stall_s > 0 and ev.issue_pos > 0),
                         key=lambda ev: -ev.stall_s)
        pick = None
        for ev in stalled:
            q = ev.issue_pos - 1
            if state.mem[q] + ev.nbytes <= opts.budget:
                continue  # not blocked by memory (the channel or the window limit is)
            for c in cand_list:
                if c.name in state.chosen or c.name in tried or not c.span[0] <= q <= c.span[1]:
                    continue
                early = _split(c, q, opts.min_gap)
                if early is not None:
                    pick = (c, early)
                    break
            if pick is not None:
                break
        if pick is None:
            break
        c, early = pick
        tried.add(c.name)
        _apply(state.mem, c, early, +1)
        state.chosen[c.name] = early
        state.order.append(c.name)
        tiers = {k: x.tier for k, x in cands.items()}
        try:
            _assign_tiers(cands, state, opts, len(analysis.order))
        except InfeasibleBudgetError:  # the extra tensor would not fit the host budget
            _apply(state.mem, c, early, -1)
            del state.chosen[c.name]
            state.order.remove(c.name)
            continue
        new_choice = _place(analysis, cands, state, opts, compute_s, transfer_time)
        new_sim = simulate(analysis, new_choice, compute_s, transfer_time, dims)
        if new_sim.total_s < planned.total_s - 1e-12 and new_sim.peak_bytes <= opts.budget:
            choice, planned = new_choice, new_sim
        else:
            _apply(state.mem, c, early, -1)
            del state.chosen[c.name]
            state.order.remove(c.name)
            for k, tier in tiers.items():
                cands[k].tier = tier
    return choice, planned


def plan(analysis: GraphAnalysis, opts: PlannerOptions, compute_s: np.ndarray,
         transfer_time: TransferTime, dims: Mapping[str, int] | None = None) -> Plan:
    """Plan offloads so the simulated fast-tier peak fits ``opts.budget`` (module docstring)."""
    dims = dict(dims or {})
    compute_s = np.asarray(compute_s, dtype=np.float64)
    n = len(analysis.order)
    if compute_s.shape != (n,):
        raise ValueError(f"compute_s has {compute_s.shape} entries for {n} nodes")
    spans, sizes = resident_intervals(analysis, dims)
    baseline = simulate(analysis, None, compute_s, transfer_time, dims)
    cand_list = _candidates(analysis, opts, dims, compute_s, transfer_time, spans)
    cands = {c.name: c for c in cand_list}
    state = _State(mem=baseline.memory.copy())
    if baseline.peak_bytes > opts.budget:
        min_budget, what = _infeasible(analysis, cand_list, spans, sizes, opts)
        if opts.budget < min_budget:
            raise InfeasibleBudgetError(
                f"budget {_fmt(opts.budget)} is below the smallest feasible budget "
                f"{_fmt(min_budget)} ({min_budget} bytes): {what}", min_budget)
        while state.mem.max() > opts.budget:
            s = int(state.mem.argmax())
            pick = None
            for c in cand_list:
                if c.name in state.chosen or not c.span[0] <= s <= c.span[1]:
                    continue
                early = _split(c, s, opts.min_gap)
                if early is not None:
                    pick = (c, early)
                    break
            if pick is None:
                raise InfeasibleBudgetError(
                    f"budget {_fmt(opts.budget)} not reached: at step {s} "
                    f"{_fmt(int(state.mem[s]))} stays resident after offloading "
                    f"{len(state.chosen)} tensors (smallest feasible estimate "
                    f"{_fmt(min_budget)}); try a larger budget", int(state.mem[s]))
            c, early = pick
            _apply(state.mem, c, early, +1)
            state.chosen[c.name] = early
            state.order.append(c.name)
        for name in reversed(list(state.order)):  # trim what the budget does not need
            c = cands[name]
            _apply(state.mem, c, state.chosen[name], -1)
            if state.mem.max() <= opts.budget:
                del state.chosen[name]
                state.order.remove(name)
            else:
                _apply(state.mem, c, state.chosen[name], +1)
    else:
        min_budget = baseline.peak_bytes
    _assign_tiers(cands, state, opts, n)
    choice = _place(analysis, cands, state, opts, compute_s, transfer_time)
    planned = simulate(analysis, choice, compute_s, transfer_time, dims)
    choice, planned = _make_room(analysis, cand_list, cands, state, opts, compute_s,
                                 transfer_time, dims, choice, planned)
    host = memory_profile(n, [(a.producer, max(a.late), a.nbytes or 0)
                              for a in choice.activations])
    host_bytes = sum(w.nbytes for w in choice.weights if w.tier == "host") + int(
        host.max(initial=0))
    if planned.peak_bytes > opts.budget:  # the planner's own invariant
        raise AssertionError(f"plan peak {planned.peak_bytes} > budget {opts.budget}")
    return Plan(choice, opts, baseline, planned, min_budget, host_bytes)
