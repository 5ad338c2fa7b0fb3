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
5. **Prediction**: :func:`ho_onnx.schedule.simulate.simulate` of the final schedule.
6. **ORT's arena**: the simulation counts tensors, ORT's allocation planner holds reused
   buffers longer (:mod:`.arena`, by the target's rules: ``target``). While that replayed
   arena peak exceeds the budget, the plan is made again for a budget lowered by the
   excess (``options.arena_refits`` times at most); the plan keeps the user's budget and
   records the budget it was made for and the arena it predicts.
7. **Refinement and a bound** (:mod:`.refine`, :mod:`.exact`): the chosen plan is refined
   by a local search scored by the simulator (``options.refine_s``), then solved by CP-SAT
   over the same space where asked (``options.exact_s``), both at the budget it was made
   for; every plan carries a lower bound on its space's times and the gap to it.
8. **Expert cache** (:mod:`.expert_cache`): routed MoE experts of a streamed tier get a
   cache of the bytes asked (the plan is then made for the budget less them) or, with
   ``expert_cache="auto"``, of the slack the plan leaves; the plan is timed again at the
   cache's expected hit rate.

No compute nodes are reordered (the refinement moves only cache operators). Every
candidate that stays resident gets its reason in the choice's ``skipped``. The planner's
state (the selection, fast-tier bytes per step, tiers) is local to one :func:`plan` call:
each look-ahead try builds a new :class:`_Selection` instead of undoing the last one.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Container, Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from .. import kinds
from ..cost.model import CostModel
from ..cost.source import CostSource, TimedAt
from ..errors import HoOnnxError, UnboundDimError, UnsupportedModelError
from ..graph.analyse import GraphAnalysis, TensorInfo
from ..graph.gcpause import gc_paused
from ..target.base import Fusions, Target, without_reuse
from ..target.ort.arena import ORT
from ..units import format_bytes
from .arena import arena_memory
from .eligibility import (
    OVERRIDABLE_REASON,
    Routed,
    WeightGroups,
    in_place_readers,
    ineligible,
    kind_of,
    largest_gap,
    long_gaps,
    placement_reasons,
    split_shape_readers,
    wanted,
)
from .exact import available as exact_available
from .exact import solve as exact_solve
from .expert_cache import asked, cacheable, with_cache
from .expert_cache import describe as describe_cache
from .kv import kv_choice, overlap_window
from .lifetimes import (
    Interval,
    Residency,
    Sizes,
    TensorSizes,
    host_bytes,
    memory_profile,
    peak,
    resident_intervals,
    schedule_memory,
)
from .options import OffloadOptions
from .recompute import describe as describe_recomputes
from .recompute import recompute
from .refine import MAX_WINDOW, Bound, Reload, Space, State, Store, refine, weak_bound
from .simulate import Simulation, simulate
from .speculate import describe as describe_speculation
from .speculate import resident_routers, with_speculation
from .types import (
    ActivationOffload,
    Decision,
    OffloadChoice,
    RunFacts,
    Tier,
    WeightOffload,
    host_positions,
)


class InfeasibleBudgetError(HoOnnxError):
    """The budget is below the smallest peak any plan of this planner reaches."""

    def __init__(self, message: str, min_budget: int) -> None:
        super().__init__(message)
        self.min_budget = min_budget


class Candidate(NamedTuple):  # thousands per plan: a tuple is built 3x faster
    """A tensor the planner may offload, with its uses and score (module docstring, 1)."""

    name: str
    kind: str  # a registered kind's name (ho_onnx.kinds)
    stored: bool  # its kind's ``stored``: Store/Detach, then one reload (else one per use)
    nbytes: int
    uses: tuple[int, ...]  # data readers, ascending
    shape_readers: tuple[int, ...]
    producer: int  # -1 for weights
    score: float
    span: tuple[int, int]  # baseline residency
    rows: tuple[int, ...] = ()  # readers that gather its rows (GatherRows: no reload)
    host: tuple[int, ...] = ()  # MatMuls computed on the host (HostMatMul: no reload)
    staged: bool = False  # each reload holds a staging copy too (WeightOffload.staged)


@dataclass
class Plan(Decision):
    """What the planner decided and what it predicts."""

    options: OffloadOptions
    baseline: Simulation
    planned: Simulation
    min_budget: int
    host_bytes: int  # peak bytes the slow tier holds (weights + stored activations)
    arena_bytes: int = 0  # ORT's arena peak, buffer reuse replayed (module docstring, 6)
    planned_for: int = 0  # the budget the choice was made for (lower after arena refits)
    costs: CostModel | None = field(default=None, repr=False)  # what the plan was timed by
    greedy_s: float = 0.0  # the greedy plan's predicted time (before refinement)
    refined_s: float = 0.0  # after refinement (before the exact planner)
    bound: Bound | None = None  # a lower bound on the time of every plan of its space
    improved: str = ""  # what refinement and the exact planner did
    # where the arena is OVER: the first budget above found whose plan's arena fits, and
    # that plan's predicted time (0: not over, or none found)
    arena_fits_at: int = 0
    arena_fits_at_s: float = 0.0

    @property
    def gap(self) -> float | None:
        """The predicted time's excess over the lower bound (0.05: 5% above it)."""
        return None if self.bound is None else self.bound.gap(self.planned.total_s)

    def bound_summary(self) -> str:
        """The greedy and final times against the bound, for reports and logs."""
        if self.bound is None:
            return ""
        ms = self.bound.seconds * 1e3
        return (f"lower bound {ms:,.3f} ms ({self.bound.kind}); gap {self.gap:.1%} "
                f"(greedy {self.greedy_s * 1e3:,.3f} ms; {self.improved})")

    @property
    def budget(self) -> int:
        assert self.options.budget is not None
        return self.options.budget

    @property
    def fits(self) -> bool:
        """The simulated peak and the expert cache within the budget."""
        return self.planned.peak_bytes + self.choice.expert_cache <= self.budget

    @property
    def arena_fits(self) -> bool:
        """Whether ORT's arena, as replayed, stays within the budget."""
        return self.arena_bytes <= self.budget

    def arena_summary(self) -> str:
        """ORT's predicted arena peak against the budget, for reports and logs."""
        mib = functools.partial(format_bytes, unit="MiB", digits=1)
        reuse = ("its buffer reuse" if self.options.ort_reuse
                 else "no buffer reuse: --ort-reuse off")
        line = (f"ORT arena {mib(self.arena_bytes)} predicted ({reuse} and the "
                "regions it grows replayed"
                + (", with the disk reads staged beside it)"
                   if any(w.staged for w in self.choice.weights) else ")"))
        if self.planned_for < self.budget:
            line += f", planned for {mib(self.planned_for)} to leave room for it"
        if not self.arena_fits:
            line += (f"; OVER the budget by {mib(self.arena_bytes - self.budget)}: the "
                     "smallest arena this planner reaches at this budget")
            line += (f"; a budget of {mib(self.arena_fits_at)} fits its arena "
                     f"({self.arena_fits_at_s * 1e3:,.3f} ms predicted)" if self.arena_fits_at
                     else " (raise the budget)")
        return line

    def summary(self, seconds: float) -> list[str]:
        """The predicted peak against the budget, and what the times came from."""
        mib = functools.partial(format_bytes, unit="MiB", digits=1)
        lines = [f"planned in {seconds:.2f} s: peak {mib(self.baseline.peak_bytes)} -> "
                 f"{mib(self.planned.peak_bytes)} (budget {mib(self.budget)}"
                 + (f", planned for {mib(self.planned_for)} to leave room for ORT's arena"
                    if self.planned_for < self.budget else "")
                 + ")"]  # (the arena itself: arena_summary())
        if self.bound is not None:
            lines.append(self.bound_summary())
        if cached := describe_cache(self.choice):
            lines.append(cached + " (in the budget)")
        lines += describe_speculation(self.choice)
        if recomputed := describe_recomputes(self.choice):
            lines.append(recomputed)
        if self.costs is not None:  # (found by hand: a profile's gaps went unsaid)
            lines.append(f"costs: {self.costs.description}")
            lines += [f"note: {line}" for line in self.costs.notes]
        return lines

    def metadata(self) -> dict[str, str]:
        b, p = self.baseline, self.planned
        return {
            "budget_bytes": str(self.budget),
            "predicted_peak_bytes": str(p.peak_bytes),
            "baseline_peak_bytes": str(b.peak_bytes),
            "predicted_time_s": f"{p.total_s:.6g}",
            "baseline_time_s": f"{b.total_s:.6g}",
            "predicted_stall_s": f"{p.stall_s:.6g}",
            "predicted_arena_bytes": str(self.arena_bytes),
            **({"arena_fits_at_bytes": str(self.arena_fits_at)} if self.arena_fits_at else {}),
            **({"greedy_time_s": f"{self.greedy_s:.6g}",
                "lower_bound_s": f"{self.bound.seconds:.6g}",
                "lower_bound_kind": self.bound.kind, "gap": f"{self.gap:.6g}"}
               if self.bound is not None else {}),
        } | super().metadata() | {"host_bytes": str(self.host_bytes)}


@dataclass(frozen=True)
class BudgetPlanner:
    """:class:`~ho_onnx.schedule.types.Decider` of the budget planner: ``costs`` is a
    :class:`CostModel` of the graph it will see, or a :class:`CostSource` that makes one
    for each graph; ``target``: the runtime's facts (its arena, replayed)."""

    options: OffloadOptions
    costs: CostModel | CostSource
    target: Target = ORT

    def decide(self, analysis: GraphAnalysis, dims: Mapping[str, int]) -> Plan:
        costs = self.costs if isinstance(self.costs, CostModel) else \
            self.costs.cost_model(analysis, dims)
        return plan(analysis, self.options, costs, dims, target=self.target)

    def prepared(self, run: RunFacts) -> BudgetPlanner:
        """For ``run``'s target; a range plan's times taken at the bottom of the ranges."""
        costs = self.costs
        if run.bottom is not None and isinstance(costs, CostSource):
            costs = TimedAt(costs.machine, costs.profile, run.bottom, run.bottom_dims)
        return replace(self, costs=costs, target=run.target)

    def sized(self, t: TensorInfo) -> bool:
        """Every size: the simulated peak counts every tensor."""
        return True


@dataclass(frozen=True)
class _Context:
    """What one :func:`plan` call reads and never changes."""

    analysis: GraphAnalysis
    options: OffloadOptions
    costs: CostModel
    dims: Mapping[str, int]
    candidates: list[Candidate]  # best score first
    by_name: dict[str, Candidate]
    residency: Residency  # of the unmodified schedule (resident_intervals)
    base_memory: np.ndarray  # the unmodified schedule's bytes per step
    kv: OffloadChoice  # the KV cache's offloads (schedule.kv): in every choice
    # offloaded-expert weight -> computed on the host or moved, and why (cpu_experts)
    cpu_experts: Mapping[str, str] = field(default_factory=dict)

    @property
    def budget(self) -> int:
        assert self.options.budget is not None
        return self.options.budget


@dataclass(frozen=True)
class _Selection:
    """Offloaded candidates (name -> early uses, in order of choice), the fast-tier bytes per
    step with each reload just in time, and the tier of each offloaded weight."""

    early: dict[str, tuple[int, ...]]
    mem: np.ndarray
    tiers: dict[str, Tier]

    def plus(self, c: Candidate, early: tuple[int, ...]) -> _Selection:
        """A new selection with ``c`` offloaded too (this one unchanged)."""
        mem = self.mem.copy()
        _offload(mem, c, early)
        return replace(self, early={**self.early, c.name: early}, mem=mem)


# Over 60 lines: one pass over the tensors that filters (each filter records its reason)
# and scores the two kinds; the score formulas are the module docstring's, side by side.
def _candidates(analysis: GraphAnalysis, opts: OffloadOptions, dims: Mapping[str, int],
                costs: CostModel, spans: dict[str, tuple[int, int]],
                skipped: dict[str, str], sizes: Sizes, notes: dict[str, str]
                ) -> list[Candidate]:
    """Scored candidates, best first; the others of the chosen kinds go to ``skipped``
    (``sizes``: the tensors' bytes under ``dims``); ``notes``: where each expert weight is
    computed and why (``cpu_experts``)."""
    total = float(costs.compute_s.sum()) or 1.0
    # Python floats: the same sums and differences as numpy's, without a scalar object each
    compute_s, prefix = costs.compute_s.tolist(), costs.prefix().tolist()
    min_bytes = opts.min_bytes_or_default
    groups = WeightGroups.of(analysis)
    store, load = (link.direction for link in kinds.stored_links())
    out: list[Candidate] = []
    placement = placement_reasons(analysis) | resident_routers(analysis, opts,
                                                                 opts.expert_cache != 0)
    routed = Routed.of(analysis, dims, opts)
    for name, t in analysis.tensors.items():
        kind = kind_of(t)
        if kind is None or not wanted(kind, opts):
            continue
        reason = ineligible(t, analysis) or placement.get(name) \
            or groups.companion_reason(name) or (None if name in spans else "not resident")
        nbytes = None if reason else sizes(name)  # raises UnboundDimError naming the dim
        if reason is None and nbytes is None:
            reason = "size unknown (shape inference gave no shape)"
        elif reason is None and nbytes is not None and nbytes < min_bytes:
            reason = f"{nbytes} bytes < min_bytes"
        elif nbytes == 0:  # (found by hand: --dim batch=0 was a ZeroDivisionError)
            reason = "empty (0 bytes): nothing to move"
        if reason is not None:
            skipped[name] = reason
            continue
        assert nbytes is not None
        if not kind.stored:
            own, shape_readers = split_shape_readers(analysis, t)
            rows, host, why = in_place_readers(analysis, t, opts, groups, routed, costs)
            notes.update({name: why} if why else {})
            uses = tuple(c for c in groups.data_uses(analysis, name, own)  # (with its scales
                         if c not in rows and c not in host)               # and zero points)
            nbytes = groups.nbytes(analysis, name, dims, sizes)
            share = routed.of_weight(analysis, name, uses)[1]  # (an expert: routed reloads)
            tt = costs.transfer_time(max(1, int(nbytes * share)),
                                     kinds.tier(opts.weight_tier).load.direction)
            busy = sum(compute_s[c] for c in uses)
            score = nbytes * max(total - busy, 0.0) / (tt * max(len(uses), 1))
            out.append(Candidate(name, kind.name, False, nbytes, uses, shape_readers, -1, score,
                                 spans[name], rows, host, _selected_staged(opts, costs)))
            continue
        assert t.producer is not None
        uses = tuple(sorted(t.consumers))
        idle = long_gaps(t.producer, uses, opts.min_gap)
        if not idle:
            skipped[name] = f"largest gap {largest_gap(t.producer, uses)[0]} < min_gap"
            continue
        best = max([0.0, *(prefix[e] - prefix[s + 1] for s, e in idle)])
        tt = costs.transfer_time(nbytes, store) + costs.transfer_time(nbytes, load)
        out.append(Candidate(name, kind.name, True, nbytes, uses, (), t.producer,
                             nbytes * best / tt, spans[name]))
    out.sort(key=lambda c: -c.score)
    return out


def _early_uses_if_freed_at(c: Candidate, s: int, min_gap: int) -> tuple[int, ...] | None:
    """Early uses of ``c`` offloaded so that it leaves the fast tier at step ``s`` (None: no
    offload of ``c`` frees step ``s``)."""
    if not c.stored:
        # (a weight only read in place, rows or host MatMuls, has no reload: offloading it
        # frees every step)
        return None if s in c.uses or not (c.uses or c.rows or c.host) else ()
    if s <= c.producer or s in c.uses:
        return None
    early = tuple(u for u in c.uses if u < s)
    late = [u for u in c.uses if u > s]
    last_early = early[-1] if early else c.producer
    if not late or late[0] - last_early < min_gap:
        return None
    return early


def _early_uses_at_largest_gap(c: Candidate, min_gap: int) -> tuple[int, ...] | None:
    """Early uses of ``c`` offloaded across its largest gap (None: no gap of ``min_gap``)."""
    if not c.stored:
        return ()
    gap, k = largest_gap(c.producer, c.uses)
    return tuple(c.uses[:k]) if gap >= min_gap else None


def _selected_staged(opts: OffloadOptions, costs: CostModel) -> bool:
    """Whether a weight's reloads are counted with a staging copy at selection: its tier's
    or the one ``--host-budget`` may spill it to is staged, on the CPU EP (as placement
    counts them, :func:`_staged`)."""
    tier = kinds.tier(opts.weight_tier)
    spill = kinds.spill_tier(tier) if opts.host_budget is not None else None
    return (tier.staged or (spill is not None and spill.staged)) and not costs.host_ahead


def _just_in_time_intervals(c: Candidate, early: tuple[int, ...]) -> list[Interval]:
    """Fast-tier intervals of ``c`` offloaded with every reload just before its reader (a
    staged one with its staging copy: the Wait copies out of it)."""
    if not c.stored:
        return [(u, u, c.nbytes * (2 if c.staged else 1)) for u in c.uses]
    late = [u for u in c.uses if u not in early]
    last_early = early[-1] if early else c.producer
    return [(c.producer, last_early, c.nbytes), (late[0], late[-1], c.nbytes)]


def _offload(mem: np.ndarray, c: Candidate, early: tuple[int, ...]) -> None:
    """Replace ``c``'s baseline residency in ``mem`` by its just-in-time intervals."""
    _shift(mem, c, early, +1)


def _keep_resident(mem: np.ndarray, c: Candidate, early: tuple[int, ...]) -> None:
    """Undo :func:`_offload` of ``c`` in ``mem``."""
    _shift(mem, c, early, -1)


def _shift(mem: np.ndarray, c: Candidate, early: tuple[int, ...], sign: int) -> None:
    s, e = c.span
    mem[s:e + 1] -= sign * c.nbytes
    for a, b, n in _just_in_time_intervals(c, early):
        mem[a:b + 1] += sign * n


def _first_freeing(ctx: _Context, chosen: Container[str], step: int,
                   exclude: Container[str] = frozenset()
                   ) -> tuple[Candidate, tuple[int, ...]] | None:
    """The best-scoring candidate not yet chosen whose offload frees ``step``."""
    for c in ctx.candidates:
        if c.name in chosen or c.name in exclude or not c.span[0] <= step <= c.span[1]:
            continue
        early = _early_uses_if_freed_at(c, step, ctx.options.min_gap)
        if early is not None:
            return c, early
    return None


def _why_resident(ctx: _Context, skipped: Mapping[str, str], name: str) -> str:
    """", why"" ``name`` can never leave the fast tier (its reason in ``skipped``, or a graph
    input), or "" for a candidate (found by hand: a weight that is also a graph output was
    listed as "must be resident" with no word of why, the user left to guess)."""
    if name in ctx.by_name:
        return ""
    if name in ctx.kv.skipped or any(x.name == name for x in (*ctx.kv.inputs, *ctx.kv.outputs)):
        return ", the KV cache: " + ctx.kv.skipped.get(name, "in its window")
    reason = skipped.get(name)
    if reason is None:
        return ", a graph input" if kind_of(ctx.analysis.tensors[name]) is None else ""
    return ", also a graph input" if reason == OVERRIDABLE_REASON else f", {reason}"


def _smallest_budget(ctx: _Context, base: np.ndarray, spans: dict[str, tuple[int, int]],
                     sizes: dict[str, int], skipped: Mapping[str, str]) -> tuple[int, str]:
    """Smallest budget this planner can meet (every candidate offloaded across its largest
    gap, reloads just in time), and what dominates it, each tensor with the reason it stays
    (``skipped``); ``base``: the baseline's bytes per step."""
    early = {c.name: e for c in ctx.candidates
             if (e := _early_uses_at_largest_gap(c, ctx.options.min_gap)) is not None}

    def profile(early: Mapping[str, tuple[int, ...]]) -> np.ndarray:
        change = itertools.chain.from_iterable(  # what _offload of each does to ``base``
            [(*c.span, -c.nbytes), *_just_in_time_intervals(c, early[c.name])]
            for c in ctx.candidates if c.name in early)
        return base + memory_profile(len(base), change)

    mem = profile(early)
    pos = int(mem.argmax())
    for _ in range(8):  # a staged reload at the peak holds twice the tensor: kept resident
        worse = [k for k in early if ctx.by_name[k].staged and pos in ctx.by_name[k].uses]
        trial = {k: e for k, e in early.items() if k not in worse}
        if not worse or (m := profile(trial)).max() >= mem.max():
            break  # (only while keeping them resident lowers the peak)
        early, mem, pos = trial, m, int(m.argmax())

    def still_resident(k: str) -> bool:  # at ``pos``, in its span: offloaded, still there?
        return k not in early or any(
            a <= pos <= b for a, b, _ in _just_in_time_intervals(ctx.by_name[k], early[k]))

    kv_at: dict[str, bool] = {}  # KV tensors: resident at ``pos`` only inside their windows
    for i in ctx.kv.inputs:
        kv_at[i.name] = any(p <= pos <= c for c, p in zip(i.consumers, i.prefetch_at,
                                                           strict=True))
    for o in ctx.kv.outputs:
        kv_at[o.name] = o.producer <= pos <= o.last
    alive = sorted(((sizes[k], k) for k, (s, e) in spans.items()
                    if sizes[k] and s <= pos <= e and kv_at.get(k, still_resident(k))),
                   reverse=True)
    node = ctx.analysis.node_at(pos)
    top = ", ".join(f"{k} ({format_bytes(b)}{_why_resident(ctx, skipped, k)})"
                    for b, k in alive[:4])
    what = (f"at step {pos} (node {node.name or node.op_type!r}, {node.op_type}) "
            f"{format_bytes(int(mem[pos]))} must be resident: {top}")
    # The caller's inputs and outputs (a KV cache's past and present) are often most of it,
    # in many small tensors that the four largest leave out (found by hand: 56 of an 84 MiB
    # floor went unsaid); --offload-kv moves a decoder's out.
    io = [(b, k) for b, k in alive if (t := ctx.analysis.tensors[k]).is_graph_input
          or (t.is_graph_output and not t.is_initializer)]
    if len(io) > 1 or (io and io[0] not in alive[:4]):
        kv = " (--offload-kv keeps a KV cache in host memory)" if not ctx.options.kv and any(
            ctx.analysis.tensors[k].kv_peer for _, k in io) else ""
        what += (f"; of it, {len(io)} graph inputs and outputs hold "
                 f"{format_bytes(sum(b for b, _ in io))} (the caller's: "
                 f"{', '.join(k for _, k in io[:3])}{', ...' if len(io) > 3 else ''}){kv}")
    return int(mem.max()), what


def _select(ctx: _Context, mem: np.ndarray, min_budget: int, skipped: dict[str, str]
            ) -> dict[str, tuple[int, ...]]:
    """Greedy selection at the peak step, then the trim pass (module docstring, 3); ``mem``
    (this call's own copy) ends as the fast-tier bytes of the selection."""
    chosen: dict[str, tuple[int, ...]] = {}
    while mem[s := int(mem.argmax())] > ctx.budget:
        pick = _first_freeing(ctx, chosen, s)
        if pick is None:
            raise InfeasibleBudgetError(
                f"budget {format_bytes(ctx.budget)} not reached: at step {s} "
                f"{format_bytes(int(mem[s]))} stays resident after offloading "
                f"{len(chosen)} tensors (smallest feasible estimate "
                f"{format_bytes(min_budget)}); try a larger budget", int(mem[s]))
        c, early = pick
        _offload(mem, c, early)
        chosen[c.name] = early
    top = int(mem.argmax())
    for name in reversed(list(chosen)):
        c = ctx.by_name[name]
        if _breaks_budget_at(ctx, mem, c, chosen[name], top):
            continue  # what the trial below would find, without changing ``mem`` twice
        _keep_resident(mem, c, chosen[name])
        if mem.max() <= ctx.budget:
            del chosen[name]
            skipped[name] = "not needed: the budget holds with it resident (trim pass)"
            top = int(mem.argmax())
        else:
            _offload(mem, c, chosen[name])
    return chosen


def _breaks_budget_at(ctx: _Context, mem: np.ndarray, c: Candidate, early: tuple[int, ...],
                      step: int) -> bool:
    """Whether keeping ``c`` resident (instead of offloaded with ``early``) surely breaks
    the budget: ``step`` is in its residency but in none of its just-in-time intervals, and
    ``mem`` there plus ``c`` exceeds the budget."""
    s, e = c.span
    return s <= step <= e and mem[step] + c.nbytes > ctx.budget and not any(
        a <= step <= b for a, b, _ in _just_in_time_intervals(c, early))


def _assign_tiers(ctx: _Context, early: Mapping[str, tuple[int, ...]],
                  tiers: Mapping[str, Tier]) -> dict[str, Tier]:
    """Tiers that fit ``options.host_budget``: offloaded weights of a tier in host memory
    move to the next tier that is not (:func:`~ho_onnx.kinds.spill_tier`: disk) (from
    ``tiers``, the previous assignment), those read fewest times and biggest first (each
    byte moved frees host memory for the fewest disk reads)."""
    opts = ctx.options
    out = {k: tiers.get(k, opts.weight_tier) for k in early if not ctx.by_name[k].stored}
    if opts.host_budget is None:
        return out
    acts = peak([(c.producer, c.uses[-1], c.nbytes) for c in map(ctx.by_name.get, early)
                 if c is not None and c.stored])
    if acts > opts.host_budget:
        raise InfeasibleBudgetError(
            f"host budget {format_bytes(opts.host_budget)} is below the {format_bytes(acts)} "
            "the offloaded activations need on the host at once; raise --host-budget or the "
            "device budget", acts)
    on_host = sorted(((ctx.by_name[k], spill) for k, tier in out.items()
                      if (t := kinds.tier(tier)).in_host_memory and not ctx.by_name[k].rows
                      and not ctx.by_name[k].host
                      and (spill := kinds.spill_tier(t)) is not None),
                     key=lambda cs: (len(cs[0].uses), -cs[0].nbytes))
    weights = sum(ctx.by_name[k].nbytes for k, tier in out.items()
                  if kinds.tier(tier).in_host_memory)
    for c, spill in on_host:
        if weights + acts <= opts.host_budget:
            break
        out[c.name] = spill.name
        weights -= c.nbytes
    return out


# Reason for length: one loop over the reloads in reader order whose FIFO bookkeeping
# (channel free time, last issue position) is shared by every step of the search; split,
# the pieces would pass that state around.
def _place(ctx: _Context, sel: _Selection) -> OffloadChoice:
    """Refine the Prefetch positions (module docstring, step 4) and build the choice."""
    opts, prefix = ctx.options, ctx.costs.prefix()
    mem = sel.mem.copy()
    reloads: list[tuple[int, str, int]] = []  # (reader, name, index of reload)
    for name, early in sel.early.items():
        c = ctx.by_name[name]
        if not c.stored:
            reloads.extend((u, name, k) for k, u in enumerate(c.uses))
        else:
            reloads.append((next(u for u in c.uses if u not in early), name, 0))
    reloads.sort()
    routed = Routed.of(ctx.analysis, ctx.dims, ctx.options)
    after = {name: routed.of_weight(ctx.analysis, name, ctx.by_name[name].uses)[2]
             for name in sel.early if not ctx.by_name[name].stored}
    positions: dict[tuple[str, int], int] = {}
    free = dict.fromkeys((t.load.direction for t in kinds.tiers()), 0.0)
    last_issue = dict.fromkeys(free, 0)
    home = kinds.default_tier().name  # where stored tensors wait
    for u, name, k in reloads:
        c = ctx.by_name[name]
        tier = kinds.tier(sel.tiers.get(name, home))
        direction = tier.load.direction
        held = c.nbytes * (2 if _staged(ctx, tier) and not c.stored else 1)  # (its staging)
        tt = ctx.costs.transfer_time(c.nbytes, direction)
        early = sel.early[name]
        lo = 0 if not c.stored else (early[-1] if early else c.producer) + 1
        lo = max(lo, last_issue[direction], after[name][k] if name in after else 0)
        margin = (opts.preferred_overlap - 1.0) * tt
        best_p, best_end = u, max(prefix[u], free[direction]) + tt
        p = u
        while p > lo:
            q = p - 1
            if mem[q] + held > ctx.budget or prefix[u] - prefix[q] > opts.max_overlap * tt:
                break
            p = q
            end = max(prefix[p], free[direction]) + tt
            if end < best_end:
                best_p, best_end = p, end
            if prefix[u] - end >= margin:
                break
        mem[best_p:u] += held
        positions[(name, k)] = best_p
        free[direction] = best_end
        last_issue[direction] = best_p
    return _choice(ctx, sel, positions)


def _staged(ctx: _Context, tier: kinds.StorageTier) -> bool:
    """Whether a reload from ``tier`` also holds a staging copy in the fast tier: a staged
    tier on the CPU EP (host memory is the fast tier; not under host-ahead GPU timing, where
    staging is pinned host memory)."""
    return tier.staged and not ctx.costs.host_ahead


def _choice(ctx: _Context, sel: _Selection, positions: Mapping[tuple[str, int], int]
            ) -> OffloadChoice:
    choice = OffloadChoice(decided_by="planner")
    routed = Routed.of(ctx.analysis, ctx.dims, ctx.options)
    for name, early in sel.early.items():
        c = ctx.by_name[name]
        if not c.stored:
            gates, share, _ = routed.of_weight(ctx.analysis, name, c.uses)
            choice.weights.append(WeightOffload(
                name, c.nbytes, c.uses, tuple(positions[(name, k)] for k in range(len(c.uses))),
                c.shape_readers, sel.tiers.get(name, ctx.options.weight_tier), gates, share,
                c.rows, routed.routes_of(name, c.uses), host_readers=c.host,
                staged=_staged(ctx, kinds.tier(sel.tiers.get(name, ctx.options.weight_tier)))))
            if name in ctx.cpu_experts:
                choice.cpu_experts[name] = ctx.cpu_experts[name]
        else:
            late = tuple(u for u in c.uses if u not in early)
            choice.activations.append(ActivationOffload(
                name, c.nbytes, c.producer, early, late, positions[(name, 0)]))
    WeightGroups.of(ctx.analysis).split(ctx.analysis, choice, ctx.dims)  # one per member
    choice.inputs, choice.outputs = list(ctx.kv.inputs), list(ctx.kv.outputs)
    choice.notes = list(ctx.kv.notes)
    return choice


def _blocked_by_memory(ctx: _Context, sel: _Selection, planned: Simulation,
                       tried: set[str]) -> tuple[Candidate, tuple[int, ...]] | None:
    """The tensor to offload for the worst reload whose window the budget kept closed."""
    stalled = sorted((ev for ev in planned.transfers
                      if ev.kind == "reload" and ev.stall_s > 0 and ev.issue_pos > 0),
                     key=lambda ev: -ev.stall_s)
    for ev in stalled:
        q = ev.issue_pos - 1
        if sel.mem[q] + ev.nbytes <= ctx.budget:
            continue  # not blocked by memory (the channel or the window limit is)
        pick = _first_freeing(ctx, sel.early, q, tried)
        if pick is not None:
            return pick
    return None


def _make_room(ctx: _Context, sel: _Selection, choice: OffloadChoice, planned: Simulation,
               skipped: dict[str, str]) -> tuple[OffloadChoice, Simulation]:
    """Look-ahead: a reload that stalls because its window could not open (the budget was
    full just before it) may be rescued by offloading one more tensor resident there. Try
    the best-scoring such tensor, re-place and re-simulate; keep it only if the predicted
    time drops. Bounded by ``options.max_extra`` tries and ``options.max_extra_s`` seconds."""
    t_end = time.perf_counter() + ctx.options.max_extra_s
    tried: set[str] = set()
    for _ in range(ctx.options.max_extra):
        if time.perf_counter() > t_end:
            break
        pick = _blocked_by_memory(ctx, sel, planned, tried)
        if pick is None:
            break
        c, early = pick
        tried.add(c.name)
        trial = sel.plus(c, early)
        try:
            trial = replace(trial, tiers=_assign_tiers(ctx, trial.early, sel.tiers))
        except InfeasibleBudgetError:  # the extra tensor would not fit the host budget
            skipped[c.name] = "look-ahead: offloading it would exceed the host budget"
            continue
        new_choice = _place(ctx, trial)
        new_sim = simulate(ctx.analysis, new_choice, ctx.costs.with_host(host_positions(
                               new_choice)),
                           ctx.costs.transfer_time, ctx.dims, ctx.residency, ctx.base_memory,
                           host_ahead=ctx.costs.host_ahead,
                           copy_in_compute=ctx.costs.copy_in_compute)
        if new_sim.total_s < planned.total_s - 1e-12 and new_sim.peak_bytes <= ctx.budget:
            sel, choice, planned = trial, new_choice, new_sim
            skipped.pop(c.name, None)
        else:
            skipped[c.name] = "look-ahead: offloading it did not shorten the predicted time"
    return choice, planned


@gc_paused()
def plan(analysis: GraphAnalysis, opts: OffloadOptions, costs: CostModel,
         dims: Mapping[str, int] | None = None, *, target: Target = ORT) -> Plan:
    """Plan offloads so the simulated fast-tier peak fits ``opts.budget`` (module docstring;
    ``target``: the runtime whose arena is replayed, its buffer reuse off where
    ``opts.ort_reuse`` is).

    Raises :class:`InfeasibleBudgetError` whose ``min_budget`` is a budget this planner
    meets (the smallest from the largest-gap estimate up, :func:`_met_budget`), and
    :class:`UnsupportedModelError` for a main graph without nodes (no step to simulate)."""
    if not analysis.order:  # (found by the fuzzer: an IndexError, also after ORT folded all)
        raise UnsupportedModelError("the main graph has no nodes: there is nothing to plan or "
                                    "offload under a budget")
    if not opts.ort_reuse:
        target = without_reuse(target)
    basis = _Basis.of(analysis, opts, costs, dims, target.fusions(analysis))  # (and refits)
    cache = asked(opts)
    inner = replace(opts, budget=opts.budget - cache, expert_cache=0) \
        if cache and opts.budget is not None else opts
    try:
        first = _plan(analysis, inner, costs, dims, search=True, basis=basis)
        fitted = _fit_arena(analysis, inner, costs, dims, first, basis, runtime=target)
        improved = _recomputed(analysis, costs, dims, basis,
                               _improve(analysis, inner, costs, dims, basis, fitted, target),
                               target)
    except InfeasibleBudgetError as e:
        if not cache:
            raise
        raise InfeasibleBudgetError(
            f"{e}; with the expert cache of {format_bytes(cache)} the smallest budget is "
            f"{format_bytes(e.min_budget + cache)}", e.min_budget + cache) from None
    if improved.arena_bytes > improved.budget and inner.arena_refits:
        improved = _arena_fits_at(analysis, inner, costs, dims, basis, improved, target)
        if improved.arena_fits_at:
            improved = replace(improved, arena_fits_at=improved.arena_fits_at + (cache or 0))
    return _cached(analysis, opts, costs, dims, improved, basis, cache)


def _arena_fits_at(analysis: GraphAnalysis, opts: OffloadOptions, costs: CostModel,
                   dims: Mapping[str, int] | None, basis: _Basis, p: Plan, runtime: Target,
                   tries: int = 8, seconds: float = 10.0) -> Plan:
    """``p`` (whose arena is over its budget) with a larger budget whose plan, arena refits
    included, has a replayed arena that fits it: upward, each try at the arena the last one
    reached (at least 1 % more), then halving the interval between the last budget over and
    the first that fits while it is over 1 % (the arena is not monotone in the budget: a
    budget that fits, not always the smallest); at most ``tries`` plans and about
    ``seconds``."""
    deadline = time.perf_counter() + seconds
    lo, budget, fit = p.budget, max(p.arena_bytes, p.budget + p.budget // 100), None

    def fits(b: int) -> tuple[bool, int, Plan | None]:
        at = replace(opts, budget=b)
        try:
            trial = _fit_arena(analysis, at, costs, dims,
                               _plan(analysis, at, costs, dims, search=False, basis=basis),
                               basis, runtime=runtime)
        except InfeasibleBudgetError as e:
            return False, max(b + b // 100, e.min_budget), None
        return trial.arena_bytes <= b, max(trial.arena_bytes, b + b // 100), trial

    for _ in range(tries):
        if time.perf_counter() > deadline or (fit and fit[0] - lo <= lo // 100):
            break
        b = budget if fit is None else (lo + fit[0]) // 2
        ok, after, trial = fits(b)
        if ok:
            fit = (b, trial)
        elif fit is None:
            lo, budget = b, after
        else:
            lo = b
    if fit is None:
        return p
    return replace(p, arena_fits_at=fit[0], arena_fits_at_s=fit[1].planned.total_s)


def _recomputed(analysis: GraphAnalysis, costs: CostModel, dims: Mapping[str, int] | None,
                basis: _Basis, p: Plan, runtime: Target) -> Plan:
    """``p`` with the stored activations its options have recomputed instead
    (:mod:`.recompute`: where it is faster, or wherever it fits), timed and its arena
    replayed again; the tensors' peak stays within the budget ``p`` was made for and the
    arena within the budget (or what ``p``'s already reached)."""
    if p.options.recompute == "off" or not p.choice.activations:
        return p
    dims = dict(dims or {})
    spans, sizes = basis.residency
    limit = max(p.budget, p.arena_bytes)

    def size(name: str) -> int:  # (a dim no sized tensor has may be unbound: 0, unknown)
        t = analysis.tensors.get(name)
        if name in sizes or t is None:
            return sizes.get(name, 0)
        try:
            return t.nbytes(dims) or 0
        except UnboundDimError:
            return 0

    def simulated(choice: OffloadChoice) -> Simulation:
        return simulate(analysis, choice, costs.compute_s, costs.transfer_time, dims,
                        basis.residency, basis.baseline.memory, host_ahead=costs.host_ahead,
                        copy_in_compute=costs.copy_in_compute)

    def arena(choice: OffloadChoice) -> int:
        return int(arena_memory(analysis, choice, dims, basis.residency, target=runtime).max())

    def score(choice: OffloadChoice) -> tuple[float, bool]:
        sim = simulated(choice)  # (the arena replayed only for a plan whose tensors fit)
        return sim.total_s, sim.peak_bytes <= p.planned_for and arena(choice) <= limit

    choice = recompute(analysis, p.choice, p.options.recompute, spans, size, score)
    if not choice.recomputes:
        return replace(p, choice=choice)
    planned = simulated(choice)
    bound = None if p.bound is None else Bound(min(p.bound.seconds, planned.total_s),
                                               p.bound.kind)  # (the space recomputes none)
    return replace(p, choice=choice, planned=planned, host_bytes=host_bytes(choice),
                   arena_bytes=arena(choice), bound=bound)


def _cached(analysis: GraphAnalysis, opts: OffloadOptions, costs: CostModel,
            dims: Mapping[str, int] | None, p: Plan, basis: _Basis, cache: int | None) -> Plan:
    """``p`` (planned for the budget less ``cache``) for ``opts``, with an expert cache of
    ``cache`` bytes, or (``auto``: None) of the slack it leaves under the budget (its
    tensors' peak and ORT's arena); timed again at the cache's expected hit rate
    (:mod:`~ho_onnx.schedule.expert_cache`)."""
    if not any(cacheable(w) for w in p.choice.weights):
        return replace(p, options=opts)
    if cache is None:
        assert opts.budget is not None
        cache = max(0, opts.budget - max(p.planned.peak_bytes, p.arena_bytes))
    if not with_cache(p.choice, cache).expert_cache:
        return replace(p, options=opts)
    def simulated(choice: OffloadChoice) -> Simulation:
        return simulate(analysis, choice, costs.compute_s, costs.transfer_time,
                        dict(dims or {}), basis.residency, basis.baseline.memory,
                        host_ahead=costs.host_ahead, copy_in_compute=costs.copy_in_compute)

    with_speculation(analysis, p.choice, opts.speculate_experts, costs)
    planned = simulated(p.choice)
    if opts.speculate_experts == "auto" and p.choice.speculations:
        # The layers the cost model's rule kept, checked together against the simulation
        # (which times the wrong guesses on the channel too).
        kept = list(p.choice.speculations)
        p.choice.speculations.clear()
        without = simulated(p.choice)
        if without.total_s <= planned.total_s:
            why = (f"does not pay in the simulated time: {planned.total_s * 1e3:.4g} ms with "
                   f"the speculations, {without.total_s * 1e3:.4g} ms without")
            p.choice.speculation_skipped.update(dict.fromkeys((s.layer for s in kept), why))
            planned = without
        else:
            p.choice.speculations.extend(kept)
    bound = None if p.bound is None else Bound(min(p.bound.seconds, planned.total_s),
                                               p.bound.kind)  # (the space had no cache)
    return replace(p, options=opts, planned=planned, bound=bound)


@dataclass
class _Basis:
    """What every plan of one :func:`plan` call shares, whatever its budget: the residency
    and sizes under ``dims``, the unmodified schedule's simulation, the scored candidates
    (and, on first use, by name) and the reasons the others stay resident (a plan copies
    them). Built once, never changed after."""

    residency: Residency
    baseline: Simulation
    candidates: list[Candidate]  # best score first
    skipped: dict[str, str]
    kv: OffloadChoice  # the KV cache's offloads (schedule.kv), in every plan
    start: np.ndarray  # bytes per step with only ``kv`` offloaded: where selection starts
    cpu_experts: dict[str, str] = field(default_factory=dict)  # (_Context.cpu_experts)

    @staticmethod
    def of(analysis: GraphAnalysis, opts: OffloadOptions, costs: CostModel,
           dims: Mapping[str, int] | None, fusions: Fusions | None = None) -> _Basis:
        """The basis of plans for ``opts`` (its budget is not read), the tensors as the
        runtime's ``fusions`` leave them."""
        dims = dict(dims or {})
        n = len(analysis.order)
        if costs.compute_s.shape != (n,):
            raise ValueError(f"compute_s has {costs.compute_s.shape} entries for {n} nodes")
        sizes = TensorSizes(analysis.tensors, dims)  # each size once
        residency = resident_intervals(analysis, dims, sizes, fusions)
        baseline = simulate(analysis, None, costs.compute_s, costs.transfer_time, dims,
                            residency)
        skipped: dict[str, str] = {}
        notes: dict[str, str] = {}
        cands = _candidates(analysis, opts, dims, costs, residency[0], skipped, sizes, notes)
        load = kinds.default_tier().load.direction
        kv = kv_choice(analysis, opts, dims, overlap_window(
            costs.prefix(), lambda b: costs.transfer_time(b, load), opts), sizes)
        skipped.update(kv.skipped)
        start = schedule_memory(analysis, kv, dims, residency, baseline.memory) \
            if kv.inputs or kv.outputs else baseline.memory
        return _Basis(residency, baseline, cands, skipped, kv, start, notes)

    @functools.cached_property
    def by_name(self) -> dict[str, Candidate]:
        return {c.name: c for c in self.candidates}


def _fit_arena(analysis: GraphAnalysis, opts: OffloadOptions, costs: CostModel,
               dims: Mapping[str, int] | None, first: Plan, basis: _Basis, *,
               runtime: Target) -> Plan:
    """``first``, or a plan for a lower budget whose replayed arena fits ``opts.budget``
    (module docstring, 6): the one with the smallest arena of at most ``opts.arena_refits``
    more tries, each for a budget lowered by the last excess (at least 1/256 of the budget,
    so that a few steps converge) but not below the smallest budget the planner said it
    meets."""
    budget = first.budget

    def replayed(p: Plan) -> int:
        return int(arena_memory(analysis, p.choice, dims, basis.residency,
                                target=runtime).max())

    best, arena = first, replayed(first)
    target, last, floor = budget, arena, 1
    for _ in range(opts.arena_refits):
        if arena <= budget or target <= floor:
            break
        lower = max(floor, target - max(last - budget, budget // 256))
        try:
            trial = _plan(analysis, replace(opts, budget=lower), costs, dims, search=False,
                          basis=basis)
        except InfeasibleBudgetError as e:
            floor = max(floor, e.min_budget)  # the next try is between it and ``target``
            continue
        target, last = lower, replayed(trial)
        if last < arena:
            best, arena = replace(trial, options=opts,
                                  min_budget=min(first.min_budget, trial.min_budget)), last
    return replace(best, arena_bytes=arena)


def _met_budget(analysis: GraphAnalysis, opts: OffloadOptions, costs: CostModel,
                dims: Mapping[str, int] | None, basis: _Basis, start: int, ceiling: int
                ) -> int:
    """The first budget from ``start`` up that the planner meets: the greedy selection can
    fall short of the largest-gap estimate, so each failure's resident bytes are tried next
    (a few plans at most; the unmodified peak ``ceiling`` always holds)."""
    budget = start
    for _ in range(32):
        if budget >= ceiling:
            break
        try:
            _plan(analysis, replace(opts, budget=budget), costs, dims, search=False,
                  basis=basis)
            return budget
        except InfeasibleBudgetError as e:
            budget = max(budget + 1, e.min_budget)
    return ceiling


def _plan(analysis: GraphAnalysis, opts: OffloadOptions, costs: CostModel,
          dims: Mapping[str, int] | None, search: bool, basis: _Basis) -> Plan:
    """One plan for ``opts.budget`` (module docstring, 1-5) on ``basis``, what the plans of
    one :func:`plan` call share (:func:`plan` pauses gc for all of them)."""
    if opts.budget is None:
        raise ValueError("the planner needs options with a budget")
    dims = dict(dims or {})
    spans, sizes = residency = basis.residency
    baseline = basis.baseline
    skipped = dict(basis.skipped)
    cands = basis.candidates
    ctx = _Context(analysis, opts, costs, dims, cands, basis.by_name, residency,
                   baseline.memory, basis.kv, basis.cpu_experts)
    mem = basis.start.copy()
    start_peak = int(mem.max(initial=0))
    if start_peak > ctx.budget:
        min_budget, what = _smallest_budget(ctx, basis.start, spans, sizes, skipped)
        met = functools.partial(_met_budget, analysis, opts, costs, dims, basis,
                                ceiling=start_peak)
        if ctx.budget < min_budget:
            least = met(min_budget) if search else min_budget
            raise InfeasibleBudgetError(
                f"budget {format_bytes(ctx.budget)} is below the smallest feasible budget "
                f"{format_bytes(least)} ({least} bytes): {what}", least)
        try:
            early = _select(ctx, mem, min_budget, skipped)
        except InfeasibleBudgetError as e:
            if not search:
                raise
            least = met(e.min_budget)
            raise InfeasibleBudgetError(f"{e}; the smallest budget this planner meets is "
                                        f"{format_bytes(least)} ({least} bytes)", least) from None
    else:
        min_budget, early = start_peak, {}
    sel = _Selection(early, mem, {})
    sel = replace(sel, tiers=_assign_tiers(ctx, sel.early, {}))
    choice = _place(ctx, sel)
    planned = simulate(analysis, choice, costs.with_host(host_positions(choice)),
                       costs.transfer_time, dims, residency, baseline.memory,
                       host_ahead=costs.host_ahead,
                       copy_in_compute=costs.copy_in_compute)
    choice, planned = _make_room(ctx, sel, choice, planned, skipped)
    offloaded = {x.name for x in [*choice.weights, *choice.activations]}
    for c in cands:
        if c.name not in skipped and c.name not in offloaded:
            skipped[c.name] = ("the model fits the budget" if not early else
                               "not needed: the greedy selection met the budget without it")
    choice.skipped = skipped
    if planned.peak_bytes > ctx.budget:  # the planner's own invariant
        raise AssertionError(f"plan peak {planned.peak_bytes} > budget {ctx.budget}")
    return Plan(choice, opts, baseline, planned, min_budget, host_bytes(choice),
                planned_for=ctx.budget, costs=costs)


def _reloads(ctx: _Context, c: Candidate, early: tuple[int, ...], tier: Tier,
             rank: int, seed: Mapping[tuple[str, int], int]) -> tuple[Reload, ...]:
    """The reloads of ``c`` offloaded with ``early`` (:mod:`.refine`: its space), each
    window as the greedy placement bounds it, widened to hold ``seed``'s position."""
    prefix, opts = ctx.costs.prefix(), ctx.options
    routed = Routed.of(ctx.analysis, ctx.dims, opts)
    if c.stored:
        readers, after = (next(u for u in c.uses if u not in early),), ((early[-1] if early
                                                                        else c.producer) + 1,)
        share, d = 1.0, kinds.default_tier().load.direction
    else:
        readers = c.uses
        _, share, after = routed.of_weight(ctx.analysis, c.name, c.uses)
        d = kinds.tier(tier).load.direction
    moved = c.nbytes if share >= 1.0 else int(c.nbytes * share)
    tt = ctx.costs.transfer_time(moved, d)
    out = []
    for k, u in enumerate(readers):
        lo = max(after[k], u - MAX_WINDOW,
                 int(np.searchsorted(prefix, prefix[u] - opts.max_overlap * tt)))
        lo = min(lo, seed.get((c.name, k), u), u)
        out.append(Reload((c.name, k), u, lo, c.nbytes, d, tt,
                          (int(c.stored), rank, k)))
    return tuple(out)


def _space(ctx: _Context, choice: OffloadChoice, start: np.ndarray
           ) -> tuple[Space, State, dict[str, str]]:
    """The space refinement and the exact planner search around ``choice`` (:mod:`.refine`:
    the greedy's early uses, the others' largest gaps), ``choice`` as a state of it, and
    the candidate each simulated tensor belongs to (a group's members: its primary)."""
    groups = WeightGroups.of(ctx.analysis)
    seed, tiers = _state_of(choice, groups)
    pool = ctx.candidates if ctx.options.host_budget is None else [  # (tiers fixed)
        ctx.by_name[k] for k in seed.early]
    early = {c.name: e for c in pool if (e := seed.early.get(c.name, _early_uses_at_largest_gap(
        c, ctx.options.min_gap))) is not None}
    rank = {k: i for i, k in enumerate(sorted(early, key=lambda k: (
        ctx.by_name[k].stored, ctx.by_name[k].producer, ctx.by_name[k].uses[:1], k)))}
    store, _ = kinds.stored_links()
    space = Space(
        ctx.budget, ctx.costs.compute_s, start, early,
        {k: _reloads(ctx, ctx.by_name[k], e, tiers.get(k, ctx.options.weight_tier), rank[k],
                     seed.positions) for k, e in early.items()},
        {k: Store(c.producer, e[-1] if e else c.producer, store.direction,
                  ctx.costs.transfer_time(c.nbytes, store.direction))
         for k, e in early.items() if (c := ctx.by_name[k]).stored},
        {k: ((*ctx.by_name[k].span, -ctx.by_name[k].nbytes),
             *_just_in_time_intervals(ctx.by_name[k], e)) for k, e in early.items()},
        lambda s: _choice(ctx, _Selection(dict(sorted(s.early.items(), key=lambda kv: rank[
            kv[0]])), ctx.base_memory, tiers), s.positions),
        lambda ch: simulate(ctx.analysis, ch, ctx.costs.with_host(host_positions(ch)),
                            ctx.costs.transfer_time, ctx.dims, ctx.residency,
                            ctx.base_memory, host_ahead=ctx.costs.host_ahead,
                           copy_in_compute=ctx.costs.copy_in_compute),
        _unmodelled(ctx, groups), place=functools.partial(_replace_all, ctx, start, tiers))
    by_tensor = {m: p for p, ms in groups.members.items() for m in ms} | {k: k for k in early}
    return space, seed, by_tensor


def _state_of(choice: OffloadChoice, groups: WeightGroups) -> tuple[State, dict[str, Tier]]:
    """``choice`` as a state of its space (:mod:`.refine`) and its weights' tiers."""
    out = State({}, {})
    tiers: dict[str, Tier] = {}
    for w in choice.weights:
        name = groups.primary_of.get(w.name, w.name)
        out.early[name], tiers[name] = (), w.tier
        out.positions.update(((name, k), p) for k, p in enumerate(w.prefetch_at))
    for a in choice.activations:
        out.early[a.name] = a.early
        out.positions[(a.name, 0)] = a.prefetch_at
    return out, tiers


def _replace_all(ctx: _Context, start: np.ndarray, tiers: Mapping[str, Tier],
                 early: Mapping[str, tuple[int, ...]]) -> dict[tuple[str, int], int]:
    """Every reload of the selection ``early`` placed by :func:`_place` (step 4)."""
    mem = start.copy()
    for k, e in early.items():
        _offload(mem, ctx.by_name[k], e)
    sel = _Selection(dict(early), mem, {k: tiers.get(k, ctx.options.weight_tier)
                                        for k in early if not ctx.by_name[k].stored})
    return _state_of(_place(ctx, sel), WeightGroups.of(ctx.analysis))[0].positions


def _unmodelled(ctx: _Context, groups: WeightGroups) -> tuple[str, ...]:
    """What the exact planner's model leaves out of the simulator here (then it is not run)."""
    why = []
    if ctx.kv.inputs or ctx.kv.outputs:
        why.append("the KV cache's copies")
    if groups.members:
        why.append("weight groups (each member timed apart)")
    if Routed.of(ctx.analysis, ctx.dims, ctx.options).gates:
        why.append("routed expert weights")
    if ctx.costs.host_ahead:
        why.append("host-ahead load timing")
    if ctx.costs.copy_in_compute:
        why.append("copies inside the Waits and Stores (the CPU engine)")
    if _staged(ctx, kinds.tier(ctx.options.weight_tier)):
        why.append("the staging copies of a staged tier")
    return tuple(why)


def _improve(analysis: GraphAnalysis, opts: OffloadOptions, costs: CostModel,
             dims: Mapping[str, int] | None, basis: _Basis, best: Plan, runtime: Target
             ) -> Plan:
    """``best`` refined, then solved exactly where asked and possible (:mod:`.refine`,
    :mod:`.exact`), at the budget it was made for, with its lower bound; a result whose
    replayed arena exceeds both the budget and ``best``'s is not kept."""
    ctx = _Context(analysis, replace(opts, budget=best.planned_for), costs, dict(dims or {}),
                   basis.candidates, basis.by_name, basis.residency, basis.baseline.memory,
                   basis.kv, basis.cpu_experts)
    space, seed, by_tensor = _space(ctx, best.choice, basis.start)
    greedy = best.planned.total_s
    start = space.score(seed)
    if start is None:  # (ties the insertion order breaks the other way: not in the space)
        return replace(best, greedy_s=greedy, refined_s=greedy,
                       bound=Bound(min(weak_bound(space).seconds, greedy), "weak"),
                       improved="greedy plan outside the search space: kept")
    got = refine(space, seed, start, opts.refine_s, by_tensor)
    state, sim = got.state, got.sim
    how = [f"refined: {got.moves} moves of {got.tries} tried in {got.seconds:.2f} s "
           f"({got.stopped})"]
    bound, refined = weak_bound(space), min(sim.total_s, greedy)
    state, sim, bound = _solve(space, state, sim, bound, opts, how)
    bound = Bound(min(bound.seconds, greedy, sim.total_s), bound.kind)
    out = replace(best, greedy_s=greedy, refined_s=refined, bound=bound,
                  improved="; ".join(how))
    if sim.total_s >= greedy:
        return out
    choice = space.build(state)
    choice.skipped = {k: v for k, v in best.choice.skipped.items() if k not in state.early}
    choice.skipped.update({k: "refinement: shorter predicted time with it resident"
                           for k in seed.early if k not in state.early})
    arena = int(arena_memory(analysis, choice, dims, basis.residency, target=runtime).max())
    if opts.arena_refits and arena > max(best.budget, best.arena_bytes):
        return replace(out, improved=out.improved + "; not kept: its arena is larger")
    return replace(out, choice=choice, planned=sim, host_bytes=host_bytes(choice),
                   arena_bytes=arena)


def _solve(space: Space, state: State, sim: Simulation, bound: Bound, opts: OffloadOptions,
           how: list[str]) -> tuple[State, Simulation, Bound]:
    """The exact planner on ``space`` from ``state`` where ``opts`` asks and it can run
    (why not, or what it did, appended to ``how``); its plan only where shorter."""
    n = len(space.compute_s)
    why = ("exact_s 0" if opts.exact_s <= 0 else
           f"{n} nodes > exact_nodes {opts.exact_nodes}" if n > opts.exact_nodes else
           "ortools missing (the exact extra)" if not exact_available() else
           "the plan is at the weak bound" if sim.total_s <= bound.seconds * (1 + 1e-9) else
           ", ".join(space.fixed))
    if why:
        how.append(f"exact: not run ({why})")
        return state, sim, bound
    got = exact_solve(space, state, opts.exact_s)
    how.append(f"exact: {got.status} in {got.seconds:.2f} s")
    if got.bound.seconds > bound.seconds:
        bound = got.bound
    found = space.score(got.state) if got.state is not None else None
    if found is not None and found.total_s < sim.total_s:
        return got.state, found, bound
    return state, sim, bound
