"""``optimize`` and ``plan_model``: load → analyse → decide → insert → annotate → place data
→ save, with progress and the time of each step. The steps between load and save are the
``onnx_ir`` passes of :mod:`ho_onnx.rewrite.passes`, run in place on the loaded model."""

from __future__ import annotations

import functools
import os
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import onnx_ir as ir

from .. import contract
from ..cost.source import CostSource
from ..errors import Log, quiet
from ..graph.analyse import GraphAnalysis, tool_proto
from ..graph.dims import (
    DimPoints,
    DimRanges,
    bind_points,
    bind_ranges,
    context_named_as_new_tokens,
    dims_from_shapes,
    format_ranges,
    ranged_inputs,
    unused_in_model,
    unused_note,
)
from ..graph.load import LoadedModel, load_model
from ..graph.save import (
    OutputFiles,
    Progress,
    SaveReport,
    check_output_path,
    new_folders,
    output_folder,
    save_model,
)
from ..schedule.decode_cache import describe as describe_decode_cache
from ..schedule.eligibility import OVERRIDABLE_REASON
from ..schedule.options import OffloadOptions
from ..schedule.planner import BudgetPlanner, Plan
from ..schedule.policy import ExplicitPolicy
from ..schedule.types import (
    Decider,
    Decision,
    DecodeCache,
    OffloadChoice,
    RunFacts,
    host_positions,
)
from ..target.base import without_reuse
from ..target.ort.arena import ORT
from ..units import format_bytes
from .insert import RewrittenModel
from .passes import (
    ANALYSIS,
    CONTRIB,
    DECISION,
    OUTPUT_FILES,
    REWRITTEN,
    analysis_steps,
    rewrite_steps,
    run_steps,
)


@dataclass
class OptimizeResult:
    """Everything one optimize run decided and wrote, and how long each step took."""

    analysis: GraphAnalysis
    decision: Decision
    rewritten: RewrittenModel
    report: SaveReport
    seconds: dict[str, float] = field(default_factory=dict)
    # A range plan at the bottom of its ranges, its named points and the top (range_points).
    points: dict[str, PointFigures] = field(default_factory=dict)

    @property
    def choice(self) -> OffloadChoice:
        return self.decision.choice

    @property
    def plan(self) -> Plan | None:
        """The planner's decision and predictions (None for the explicit policy)."""
        return self.decision if isinstance(self.decision, Plan) else None


def _analysed_at(dims: Mapping[str, int], shapes: Mapping[str, Sequence[int]] | None,
                 model: ir.Model) -> GraphAnalysis:
    """``model`` analysed again at ``dims`` (the loaded model, or a copy of it split in
    blocks: the nodes the same as in its analysis, in the same order; the types of the ops
    only ORT knows from ORT's inference)."""
    from ..graph.analyse import analyse
    from ..target.ort.contrib import contrib_value_types, refuse_unknown_ops

    contrib = refuse_unknown_ops(tool_proto(model))
    return analyse(model, dims, shapes={k: list(v) for k, v in (shapes or {}).items()},
                   more_types=contrib_value_types if contrib else None)


def _run_facts(loaded: LoadedModel, dims: Mapping[str, int], ranges: DimRanges,
               shapes: Mapping[str, Sequence[int]] | None,
               points: Mapping[str, Mapping[str, int]] | None = None) -> RunFacts:
    """What a decider is handed for this run: ORT's facts and, for a range plan, the model
    analysed where its times are taken: at its first named point (``points``, bound by
    :func:`~ho_onnx.graph.dims.bind_points`), else at the bottom of the ranges."""
    if not ranges:
        return RunFacts(ORT)
    at = {**dims, **(next(iter(points.values())) if points else
                     {k: lo for k, (lo, _) in ranges.items()})}
    return RunFacts(ORT, functools.partial(_analysed_at, at, shapes), at)


def decider_for(options: OffloadOptions, costs: CostSource | None = None) -> Decider:
    """The budget planner when ``options`` has a budget, else the explicit policy."""
    if options.budget is not None:
        return BudgetPlanner(options, costs or CostSource())
    return ExplicitPolicy(options)


class _Steps:
    """Times and logs the steps of one run."""

    def __init__(self, log: Log | None) -> None:
        self.say = log or quiet
        self.seconds: dict[str, float] = {}

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - t


@contextmanager
def _ort_optimized_beside(in_path: str | os.PathLike[str], out: Path, ort_level: str
                          ) -> Iterator[Path]:
    """ORT's ``ort_level`` optimization of ``in_path``, written beside the output ``out``: its
    data file is what the output's initializers and offloaded weights reference, so it stays
    (unless the block fails); the intermediate model is removed on exit."""
    from ..target.ort.optimize import ort_optimize

    with new_folders(output_folder(out)):
        pre = out.with_name(f"{out.name}.ort.onnx")
        try:
            yield ort_optimize(in_path, pre, ort_level)
        except BaseException:  # the output was not written: its data file goes too
            pre.with_name(f"{pre.name}.data").unlink(missing_ok=True)
            raise
        finally:
            pre.unlink(missing_ok=True)


def _load_ort_optimized(model: str | os.PathLike[str], ort_level: str) -> LoadedModel:
    """ORT's ``ort_level`` optimization of ``model``, loaded; written in a temporary folder
    that lives as long as the returned model (:attr:`LoadedModel.keepalive`)."""
    from ..target.ort.optimize import ort_optimize

    tmp = tempfile.TemporaryDirectory(prefix="ho_onnx_ort_")
    loaded = load_model(ort_optimize(model, Path(tmp.name) / "model.onnx", ort_level))
    loaded.keepalive = tmp
    return loaded


def plan_model(model: str | os.PathLike[str] | LoadedModel, options: OffloadOptions,
               dims: Mapping[str, int] | None = None, costs: CostSource | None = None, *,
               ort_level: str | None = None, log: Log | None = None,
               shapes: Mapping[str, Sequence[int]] | None = None,
               dim_ranges: DimRanges | None = None, dim_points: DimPoints | None = None
               ) -> tuple[LoadedModel, GraphAnalysis, Plan]:
    """Load (unless given loaded) and plan ``model`` under ``options.budget``; nothing is
    written. ``ort_level``: plan ORT's optimized graph (made in a temporary folder that
    lives as long as the returned model). ``shapes``: whole input shapes (``--shape``).
    ``dim_ranges``, ``dim_points``: planned at the top of each range and timed at the first
    named point, as :func:`optimize` does."""
    points = bind_points(dim_points, dim_ranges)
    dims = bind_ranges(dims or {}, dim_ranges)
    steps = _Steps(log)
    if isinstance(model, LoadedModel):
        loaded = model
    elif ort_level is not None:
        loaded = _load_ort_optimized(model, ort_level)
    else:
        loaded = load_model(model)
    if dim_ranges:
        ranged_inputs(loaded.model, dim_ranges)  # (a range no input has: refused here too)
    analysis, decision = _decide(loaded, BudgetPlanner(options, costs or CostSource()), dims,
                                 steps, shapes,
                                 _run_facts(loaded, dims, dim_ranges or {}, shapes, points))
    assert isinstance(decision, Plan)
    return loaded, analysis, decision


@dataclass(frozen=True)
class PointFigures:
    """A range plan at one binding of its ranged dims: the fast-tier peaks of the unmodified
    model and of the plan, the plan's predicted seconds (None without a cost source), ORT's
    replayed arena under the plan, and the bytes its decode cache keeps and reads ahead
    there (counted in ``planned``; :mod:`~ho_onnx.schedule.decode_cache`)."""

    dims: dict[str, int]
    unmodified: int
    planned: int
    seconds: float | None = None
    arena: int | None = None
    cache: int = 0
    ahead: int = 0


def range_points(loaded: LoadedModel, choice: OffloadChoice, dims: Mapping[str, int],
                 ranges: DimRanges, shapes: Mapping[str, Sequence[int]] | None = None,
                 points: DimPoints | None = None, costs: CostSource | None = None,
                 budget: int | None = None, reuse: bool = True) -> dict[str, PointFigures]:
    """``choice`` (a range plan's, made at the top of ``ranges``) at the bottom of every
    range, at each named point (``points``) and at the top, in that order: each binding
    analysed again (shapes inferred there), its peaks, with ``budget`` ORT's replayed arena,
    and with ``costs`` its simulated time (a decode step's per-token time at a decode point);
    ``reuse``: ORT's buffer reuse on in the sessions (``OffloadOptions.ort_reuse``).

    With ``budget`` (the plan's), first decides its decode cache (sets
    ``choice.decode_cache``, or ``decode_cache_skipped``): each point is then timed with the
    reloads its room keeps served by the cache, and its peak counts those bytes."""
    from ..schedule import decode_cache
    from ..schedule.arena import arena_memory
    from ..schedule.lifetimes import peaks_at, resized_choice

    top = bind_ranges(dims, ranges)
    where = {"bottom": {k: lo for k, (lo, _) in ranges.items()},
             **bind_points(points, ranges), "top": {k: hi for k, (_, hi) in ranges.items()}}
    seen = {}
    for name, point in where.items():
        at = {**top, **point}
        a = _analysed_at(at, shapes, loaded.model)
        unmodified, planned = peaks_at(a, choice, at)
        arena = None if budget is None else int(  # (the room of the decode cache needs it)
            arena_memory(a, resized_choice(a, choice, at), at,
                         target=ORT if reuse else without_reuse(ORT)).max(initial=0))
        seen[name] = (point, at, a, unmodified, planned, arena)
    split: dict[str, tuple[int, int]] = {}
    if budget is not None:
        rooms = [(name, {k: at[k] for k in ranges}, budget - max(planned, arena or 0))
                 for name, (_, at, _, _, planned, arena) in seen.items()]
        found = decode_cache.decide(choice, rooms)
        if isinstance(found, str):
            choice.decode_cache, choice.decode_cache_skipped = None, found
        else:
            choice.decode_cache, choice.decode_cache_skipped = _split_rooms(
                found, choice, seen, costs), ""
            split = {name: (kept, ahead) for name, _, kept, ahead in
                     choice.decode_cache.points}

    out = {}
    for name, (point, at, a, unmodified, planned, arena) in seen.items():
        kept, ahead = split.get(name, (0, 0))
        timed = choice if not (kept or ahead) else decode_cache.timed(
            choice, choice.decode_cache, kept, ahead)  # type: ignore[arg-type]
        out[name] = PointFigures(dict(point), unmodified, planned + kept + ahead,
                                 _seconds(costs, a, at, timed) if costs is not None else None,
                                 arena, kept, ahead)
    return out


def _seconds(costs: CostSource, a: GraphAnalysis, at: Mapping[str, int],
             choice: OffloadChoice) -> float:
    """``choice``'s simulated seconds on ``a`` (one binding) with ``costs``."""
    from ..schedule.simulate import simulate

    cm = costs.cost_model(a, at)
    return simulate(a, choice, cm.with_host(host_positions(choice)), cm.transfer_time, at,
                    host_ahead=cm.host_ahead, copy_in_compute=cm.copy_in_compute).total_s


def _split_rooms(cache: DecodeCache, choice: OffloadChoice,
                 seen: Mapping[str, tuple], costs: CostSource | None) -> DecodeCache:
    """``cache`` with each point's room split between weights kept and reads ahead
    (:func:`~ho_onnx.schedule.decode_cache.splits`) the way the point's simulation is
    fastest (all kept without a cost source)."""
    from ..schedule import decode_cache

    points = []
    for name, at_dims, room, _ in cache.points:
        best, best_s = (room, 0), None
        if costs is not None and room > 0:
            _, at, a, _, _, _ = seen[name]
            for kept, ahead in decode_cache.splits(cache, choice, room):
                s = _seconds(costs, a, at, decode_cache.timed(choice, cache, kept, ahead))
                if best_s is None or s < best_s * 0.99:  # (a split must win by 1 %)
                    best, best_s = (kept, ahead), s
        points.append((name, at_dims, *best))
    return decode_cache.with_points(cache, choice, points)


def format_points(figures: Mapping[str, PointFigures]) -> str:
    """``bottom (seq=1,past=0): peak 1.2 MiB (unmodified 3.4 MiB), 0.52 ms; ...``: the
    metadata ``ho_onnx.range_points`` and ``plan``'s line."""
    return "; ".join(
        f"{name} ({','.join(f'{k}={v}' for k, v in sorted(f.dims.items()))}): peak "
        f"{format_bytes(f.planned, 'MiB', 2)} (unmodified {format_bytes(f.unmodified, 'MiB', 2)})"
        + (f", {f.seconds * 1e3:.3g} ms" if f.seconds is not None else "")
        + (f", decode cache {format_bytes(f.cache, 'MiB', 2)}" if f.cache else "")
        + (f" + {format_bytes(f.ahead, 'MiB', 2)} read ahead" if f.ahead else "")
        for name, f in figures.items())


def _decide(loaded: LoadedModel, decider: Decider, dims: Mapping[str, int], steps: _Steps,
            shapes: Mapping[str, Sequence[int]] | None, run: RunFacts
            ) -> tuple[GraphAnalysis, Decision]:
    shapes = {k: list(v) for k, v in (shapes or {}).items()}
    dims = dims_from_shapes(loaded.model, shapes, dims)
    check, analyse_step, *decide = analysis_steps(decider, dims, shapes=shapes, run=run)
    with steps.step("analyse"):
        run_steps(loaded.model, check, analyse_step)  # ops onnx cannot check: ORT must know them
        contrib = loaded.model.meta[CONTRIB]
        analysis: GraphAnalysis = loaded.model.meta[ANALYSIS]
    steps.say(f"analysed {len(analysis.order)} nodes, {len(analysis.tensors)} tensors "
              f"({steps.seconds['analyse']:.2f} s)"
              + (f"; ORT ops onnx cannot check: {', '.join(op for _, op in contrib)}"
                 if contrib else ""))
    if dims:  # (not an error: a script may pass one set of dims to several models)
        unused, used = unused_in_model(loaded.model, dims, (
            d for t in analysis.tensors.values() for d in t.symbolic_dims()))
        if unused:
            steps.say("note: " + unused_note(unused, used))
    with steps.step("decide"):
        run_steps(loaded.model, *decide)  # (blocks first: the analysis may be made anew)
        decision: Decision = loaded.model.meta[DECISION]
        analysis = loaded.model.meta[ANALYSIS]
    for line in decision.summary(steps.seconds["decide"]):
        steps.say(line)
    note = _overridable_note(analysis, decision.choice, dims)
    for line in ([note] if note else []) + [f"note: {n}" for n in decision.choice.notes]:
        steps.say(line)
    return analysis, decision


def _overridable_note(analysis: GraphAnalysis, choice: OffloadChoice,
                     dims: Mapping[str, int]) -> str | None:
    """What to do about weights that stayed resident because they are graph inputs too
    (found by hand: a model exported with its weights as inputs offloaded nothing, and said
    why only in the output's metadata)."""
    names = [n for n, why in choice.skipped.items() if why == OVERRIDABLE_REASON]
    if not names:
        return None
    size = sum(analysis.tensors[n].nbytes(dims) or 0 for n in names)
    return (f"note: {len(names)} weights ({format_bytes(size)}) stay resident: "
            "they are also graph inputs, which a caller may feed; if none does, take them out "
            "of the inputs (onnxruntime's tools/python/remove_initializer_from_input.py; "
            "torch.onnx.export(..., keep_initializers_as_inputs=False))")


def _say_rewrite(steps: _Steps, c: OffloadChoice, rewritten: RewrittenModel,
                 ranges: DimRanges, guarded: bool) -> None:
    kv = (f", the KV cache ({len(c.inputs)} past, {len(c.outputs)} present: "
          f"{format_bytes(c.kv_bytes, 'MiB', 1)}) in the caller's host memory"
          if c.inputs or c.outputs else "")
    steps.say(f"offloading {len(c.weights)} weights and {len(c.activations)} activations "
              f"({format_bytes(c.offloaded_bytes, 'MiB', 1)}){kv}, {rewritten.cache_nodes} "
              f"cache ops ({steps.seconds['rewrite']:.2f} s)")
    if ranges:
        steps.say(f"planned for {format_ranges(ranges)} (at the top of each range); "
                  + ("the inputs are guarded: a run outside is refused"
                     if rewritten.cache_nodes and guarded else
                     "nothing offloaded: the ranges are recorded, not enforced"))


def _load_for(in_path: str | os.PathLike[str], out_path: str | os.PathLike[str],
              ort_level: str | None, stack: ExitStack, steps: _Steps) -> LoadedModel:
    """``in_path`` loaded for :func:`optimize` (``ort_level``: ORT's optimization of it,
    written beside the output, removed when ``stack`` closes), the output path checked
    before any work."""
    with steps.step("load"):
        loaded = load_model(in_path)
        check_output_path(loaded, out_path)  # fail before any work
        if ort_level is not None:
            n_before = len(loaded.model.graph)
            pre = stack.enter_context(_ort_optimized_beside(in_path, Path(out_path), ort_level))
            loaded = load_model(pre)
            check_output_path(loaded, out_path)
            steps.say(f"ORT {ort_level} optimizations applied: {n_before} -> "
                      f"{len(loaded.model.graph)} nodes")
    steps.say(f"loaded {loaded.path.name}: {len(loaded.model.graph)} nodes, "
              f"{len(loaded.model.graph.initializers)} initializers "
              f"({steps.seconds['load']:.2f} s)")
    if loaded.training_info:  # (onnx_ir does not read it; found by hand)
        steps.say(f"note: the model's training_info ({loaded.training_info} entries) is not "
                  "written to the output: the rewritten graph is for inference")
    return loaded


def optimize(in_path: str | os.PathLike[str], out_path: str | os.PathLike[str],
             options: OffloadOptions | Decider | None = None,
             dims: Mapping[str, int] | None = None, *, costs: CostSource | None = None,
             ort_level: str | None = None, log: Log | None = None,
             progress: Progress | None = None,
             shapes: Mapping[str, Sequence[int]] | None = None,
             dim_ranges: DimRanges | None = None,
             dim_points: DimPoints | None = None) -> OptimizeResult:
    """Rewrite ``in_path`` into ``out_path`` with cache operators (input never modified).

    ``dim_ranges`` (``{"seq": (1, 2048)}``): one plan for every value of each range, made at
    its top (the worst case for memory), recorded in the model, and enforced by the library
    at every run (a ``Guard`` per graph input with a ranged dim refuses a run outside); its
    times, and so its prefetch windows, taken at the first of ``dim_points`` (named points of
    the ranges, ``{"decode": {"seq": 1, "past": 4095}}``, TensorRT's optimization profiles),
    else at the bottom of the ranges. Its peaks and times at the bottom, at each point and at
    the top are recorded (``ho_onnx.range_points``) and in the result's ``points``.

    ``options`` select the decider (:func:`decider_for`: the budget planner, with times from
    ``costs``, when they have a budget; else the explicit policy), or are a
    :class:`~ho_onnx.schedule.types.Decider` itself. ``ort_level`` (``basic``/``extended``)
    first applies ORT's own graph optimizations and decides on the graph ORT will run (see
    :mod:`ho_onnx.target.ort.optimize`); its data file is written beside the output.
    """
    options = options if options is not None else OffloadOptions()
    decider = decider_for(options, costs) if isinstance(options, OffloadOptions) else options
    ranges = dict(dim_ranges or {})
    points = bind_points(dim_points, ranges)
    dims = bind_ranges(dims or {}, ranges)
    steps = _Steps(log)
    with ExitStack() as stack:
        loaded = _load_for(in_path, out_path, ort_level, stack, steps)
        checks = ranged_inputs(loaded.model, ranges) if ranges else {}
        analysis, decision = _decide(loaded, decider, dims, steps, shapes,
                                     _run_facts(loaded, dims, ranges, shapes, points))
        figures = _say_points(steps, loaded, decision, dims, ranges, shapes, points, decider)
        with steps.step("rewrite"):
            run_steps(loaded.model, *rewrite_steps(
                dims, loaded.base_dir, Path(out_path), checks=checks, ranges=ranges,
                metadata=_metadata(figures, decider)))
            rewritten: RewrittenModel = loaded.model.meta[REWRITTEN]
            files: OutputFiles = loaded.model.meta[OUTPUT_FILES]
        _say_rewrite(steps, decision.choice, rewritten, ranges, guarded=bool(checks))
        for warning in context_named_as_new_tokens(loaded.model, ranges) if checks else ():
            steps.say(f"warning: {warning}")
        with steps.step("save"):
            report = save_model(files, loaded, out_path, progress=progress)
    steps.say(f"wrote {report.model_path} ({steps.seconds['save']:.2f} s)"
              + (f", copied {len(report.copied)} data file(s)" if report.copied else ""))
    return OptimizeResult(analysis, decision, rewritten, report, steps.seconds, figures)


def _say_points(steps: _Steps, loaded: LoadedModel, decision: Decision, dims: Mapping[str, int],
                ranges: DimRanges, shapes: Mapping[str, Sequence[int]] | None,
                points: DimPoints, decider: Decider) -> dict[str, PointFigures]:
    """A range plan's figures at its ends and named points (:func:`range_points`, timed by
    the decider's own cost source, if it has one), logged; nothing without ranges."""
    if not ranges:
        return {}
    costs = getattr(decider, "costs", None)
    options = getattr(decider, "options", None)
    figures = range_points(loaded, decision.choice, dims, ranges, shapes, points,
                           costs if isinstance(costs, CostSource) else None,
                           cache_budget(options), getattr(options, "ort_reuse", True))
    steps.say("over the ranges: " + format_points(figures))
    if decision.choice.decode_cache is not None:
        steps.say(describe_decode_cache(decision.choice.decode_cache))
    return figures


def _metadata(figures: Mapping[str, PointFigures], decider: Decider) -> dict[str, str] | None:
    """The run's entries of the output's metadata beside the plan's: the range plan's
    figures at its points, and the buffer reuse the plan counted when it is off
    (``ho_onnx.ort_reuse``, which ho-onnx's sessions read: :func:`ort_reuse_of`)."""
    out = {"range_points": format_points(figures)} if figures else {}
    if not getattr(getattr(decider, "options", None), "ort_reuse", True):
        out[contract.META_ORT_REUSE] = "0"
    return out or None


def cache_budget(options: OffloadOptions | None) -> int | None:
    """The budget a range plan's decode cache is decided under (:func:`range_points`), or
    None where there is none (no budget, or ``decode_cache`` off)."""
    if not isinstance(options, OffloadOptions) or not options.decode_cache:
        return None
    return options.budget
