"""``optimize`` and ``plan_model``: load → analyse → decide → insert → annotate → place data
→ save, with progress and the time of each step. The steps between load and save are the
``onnx_ir`` passes of :mod:`ho_onnx.rewrite.passes`, run in place on the loaded model."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..contract import DOMAIN
from ..cost.model import CostModel
from ..cost.source import CostSource
from ..errors import HoOnnxError, Log, OutputPathError, quiet
from ..graph.analyse import GraphAnalysis
from ..graph.check import contrib_ops
from ..graph.dims import (
    DimRanges,
    bind_ranges,
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
from ..schedule.eligibility import OVERRIDABLE_REASON
from ..schedule.options import OffloadOptions
from ..schedule.planner import BudgetPlanner, Plan
from ..schedule.policy import ExplicitPolicy
from ..schedule.types import Decider, Decision, OffloadChoice
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

    @property
    def choice(self) -> OffloadChoice:
        return self.decision.choice

    @property
    def plan(self) -> Plan | None:
        """The planner's decision and predictions (None for the explicit policy)."""
        return self.decision if isinstance(self.decision, Plan) else None


@dataclass(frozen=True)
class _TimedAtBottom(CostSource):
    """A range plan's times, taken at the bottom of every range (issue 36): memory is
    planned at the top, where it is largest, and prefetch windows are sized where compute
    is smallest (a decode step), so they hide the copies there and, with more compute
    between the same nodes, everywhere above. The model is analysed again at the bottom
    (``range_peaks`` does the same); the nodes are the same, in the same order."""

    loaded: LoadedModel | None = None
    bottom: Mapping[str, int] = field(default_factory=dict)
    shapes: Mapping[str, Sequence[int]] = field(default_factory=dict)

    def cost_model(self, analysis: GraphAnalysis, dims: Mapping[str, int]) -> CostModel:
        from ..graph.analyse import analyse
        from ..target.ort.contrib import contrib_value_types, refuse_unknown_ops

        assert self.loaded is not None
        contrib = refuse_unknown_ops(self.loaded.proto)
        loaded = analysis.model is self.loaded.model  # (else a copy split in blocks)
        a = analyse(analysis.model, self.bottom, shapes=dict(self.shapes),
                    proto=self.loaded.proto if loaded else None,
                    more_types=contrib_value_types if contrib else None)
        if len(a.order) != len(analysis.order):  # (never expected: the same graph)
            return super().cost_model(analysis, dims)
        cm = super().cost_model(a, self.bottom)
        at = ",".join(f"{k}={v}" for k, v in sorted(self.bottom.items()))
        return replace(cm, description=cm.description + f"; timed at the bottom of the ranges "
                       f"({at}: windows sized where compute is least)")


def _timed_at_bottom(decider: Decider, loaded: LoadedModel, dims: Mapping[str, int],
                     ranges: DimRanges, shapes: Mapping[str, Sequence[int]] | None) -> Decider:
    """``decider``, a budget planner of a range plan timed at the bottom of the ranges."""
    if not ranges or not isinstance(decider, BudgetPlanner) \
            or not isinstance(decider.costs, CostSource):
        return decider
    bottom = {**dims, **{k: lo for k, (lo, _) in ranges.items()}}
    timed = _TimedAtBottom(decider.costs.machine, decider.costs.profile, loaded, bottom,
                           {k: list(v) for k, v in (shapes or {}).items()})
    return replace(decider, costs=timed)


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
               dim_ranges: DimRanges | None = None
               ) -> tuple[LoadedModel, GraphAnalysis, Plan]:
    """Load (unless given loaded) and plan ``model`` under ``options.budget``; nothing is
    written. ``ort_level``: plan ORT's optimized graph (made in a temporary folder that
    lives as long as the returned model). ``shapes``: whole input shapes (``--shape``).
    ``dim_ranges``: planned at the top of each range, as :func:`optimize` does."""
    dims = bind_ranges(dims or {}, dim_ranges)
    steps = _Steps(log)
    if isinstance(model, LoadedModel):
        loaded = model
    elif ort_level is not None:
        loaded = _load_ort_optimized(model, ort_level)
    else:
        loaded = load_model(model)
    if dim_ranges:
        ranged_inputs(loaded.proto, dim_ranges)  # (a range no input has: refused here too)
    planner = _timed_at_bottom(BudgetPlanner(options, costs or CostSource()), loaded, dims,
                               dim_ranges or {}, shapes)
    analysis, decision = _decide(loaded, planner, dims,
                                 steps, shapes)
    assert isinstance(decision, Plan)
    return loaded, analysis, decision


def range_peaks(loaded: LoadedModel, plan: Plan, dims: Mapping[str, int],
                ranges: DimRanges, shapes: Mapping[str, Sequence[int]] | None = None
                ) -> dict[str, tuple[int, int]]:
    """``{"bottom": (unmodified, planned), "top": (...)}``: fast-tier peaks of ``plan``
    (made by :func:`plan_model` with ``ranges``, at their top) at the bottom of every range
    and at the top. The bottom is analysed again (shapes inferred at that binding)."""
    from ..graph.analyse import analyse
    from ..schedule.lifetimes import peaks_at
    from ..target.ort.contrib import contrib_value_types, refuse_unknown_ops

    bottom = {**bind_ranges(dims, ranges), **{k: lo for k, (lo, _) in ranges.items()}}
    shapes = {k: list(v) for k, v in (shapes or {}).items()}
    contrib = refuse_unknown_ops(loaded.proto)
    a = analyse(loaded.model, bottom, shapes=shapes, proto=loaded.proto,
                more_types=contrib_value_types if contrib else None)
    return {"bottom": peaks_at(a, plan.choice, bottom),
            "top": (plan.baseline.peak_bytes, plan.planned.peak_bytes)}


def _ort_validate(path: Path) -> None:
    """ORT loads the written model (with contrib ops, ``onnx.checker`` cannot judge it)."""
    from ..target.ort.contrib import ort_check

    try:
        ort_check(path)
    except HoOnnxError as e:
        raise OutputPathError(f"the rewritten model does not load in onnxruntime: {e}") from e


def _decide(loaded: LoadedModel, decider: Decider, dims: Mapping[str, int], steps: _Steps,
            shapes: Mapping[str, Sequence[int]] | None = None
            ) -> tuple[GraphAnalysis, Decision]:
    shapes = {k: list(v) for k, v in (shapes or {}).items()}
    dims = dims_from_shapes(loaded.proto, shapes, dims)
    check, analyse_step, *decide = analysis_steps(decider, dims, shapes=shapes,
                                                  proto=loaded.proto)
    with steps.step("analyse"):
        run_steps(loaded.model, check, analyse_step)  # ops onnx cannot check: ORT must know them
        contrib = loaded.model.meta[CONTRIB]
        analysis: GraphAnalysis = loaded.model.meta[ANALYSIS]
    steps.say(f"analysed {len(analysis.order)} nodes, {len(analysis.tensors)} tensors "
              f"({steps.seconds['analyse']:.2f} s)"
              + (f"; ORT ops onnx cannot check: {', '.join(op for _, op in contrib)}"
                 if contrib else ""))
    if dims:  # (not an error: a script may pass one set of dims to several models)
        unused, used = unused_in_model(loaded.proto, dims, (
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


def optimize(in_path: str | os.PathLike[str], out_path: str | os.PathLike[str],
             options: OffloadOptions | Decider | None = None,
             dims: Mapping[str, int] | None = None, *, costs: CostSource | None = None,
             ort_level: str | None = None, log: Log | None = None,
             progress: Progress | None = None,
             shapes: Mapping[str, Sequence[int]] | None = None,
             dim_ranges: DimRanges | None = None) -> OptimizeResult:
    """Rewrite ``in_path`` into ``out_path`` with cache operators (input never modified).

    ``dim_ranges`` (``{"seq": (1, 2048)}``): one plan for every value of each range, made at
    its top (the worst case for memory), recorded in the model, and enforced by the library
    at every run (a ``Guard`` per graph input with a ranged dim refuses a run outside).

    ``options`` select the decider (:func:`decider_for`: the budget planner, with times from
    ``costs``, when they have a budget; else the explicit policy), or are a
    :class:`~ho_onnx.schedule.types.Decider` itself. ``ort_level`` (``basic``/``extended``)
    first applies ORT's own graph optimizations and decides on the graph ORT will run (see
    :mod:`ho_onnx.target.ort.optimize`); its data file is written beside the output.
    """
    options = options if options is not None else OffloadOptions()
    decider = decider_for(options, costs) if isinstance(options, OffloadOptions) else options
    ranges = dict(dim_ranges or {})
    dims = bind_ranges(dims or {}, ranges)
    steps = _Steps(log)
    with ExitStack() as stack:
        with steps.step("load"):
            loaded = load_model(in_path)
            check_output_path(loaded, out_path)  # fail before any work
            if ort_level is not None:
                n_before = len(loaded.proto.graph.node)
                pre = stack.enter_context(
                    _ort_optimized_beside(in_path, Path(out_path), ort_level))
                loaded = load_model(pre)
                check_output_path(loaded, out_path)
                steps.say(f"ORT {ort_level} optimizations applied: {n_before} -> "
                          f"{len(loaded.model.graph)} nodes")
        steps.say(f"loaded {loaded.path.name}: {len(loaded.model.graph)} nodes, "
                  f"{len(loaded.model.graph.initializers)} initializers "
                  f"({steps.seconds['load']:.2f} s)")
        if loaded.proto.training_info:  # (onnx_ir does not read it; found by hand)
            steps.say(f"note: the model's training_info ({len(loaded.proto.training_info)} "
                      "entries) is not written to the output: the rewritten graph is for "
                      "inference")
        checks = ranged_inputs(loaded.proto, ranges) if ranges else {}
        decider = _timed_at_bottom(decider, loaded, dims, ranges, shapes)
        analysis, decision = _decide(loaded, decider, dims, steps, shapes)
        with steps.step("rewrite"):
            run_steps(loaded.model, *rewrite_steps(dims, loaded.base_dir, Path(out_path),
                                                   checks=checks, ranges=ranges))
            rewritten: RewrittenModel = loaded.model.meta[REWRITTEN]
            files: OutputFiles = loaded.model.meta[OUTPUT_FILES]
        _say_rewrite(steps, decision.choice, rewritten, ranges, guarded=bool(checks))
        with steps.step("save"):
            report = save_model(files, loaded, out_path, progress=progress,
                                validate=_ort_validate if contrib_ops(
                                    files.model, ignore=(DOMAIN,)) else None)
    steps.say(f"wrote {report.model_path} ({steps.seconds['save']:.2f} s)"
              + (f", copied {len(report.copied)} data file(s)" if report.copied else ""))
    return OptimizeResult(analysis, decision, rewritten, report, steps.seconds)
