"""The rewrite as ``onnx_ir`` passes: one per step, each with the pass signature
``(ir.Model) -> ir.passes.PassResult``, composable in an ``onnx_ir.passes.PassManager``.

The steps are in-place passes that hand their results to the next through ``model.meta``
(never serialised):

* :class:`CheckOpsPass` -- refuses ops neither onnx nor this onnxruntime knows;
  ``meta[CONTRIB]``: the ones only ORT knows (their types come from ORT's inference);
* :class:`AnalysePass` -- sorts the main graph if needed; ``meta[ANALYSIS]``
  (:class:`~ho_onnx.graph.analyse.GraphAnalysis`);
* :class:`SplitWeightsPass` -- streams large MatMul/Gemm weights
  in blocks where the budget planner predicts it pays (the model split, ``meta[ANALYSIS]``
  made anew); ``meta[SPLITS]``;
* :class:`DecidePass` -- runs a :class:`~ho_onnx.schedule.types.Decider`; ``meta[DECISION]``;
* :class:`InsertPass` -- inserts the cache ops; ``meta[REWRITTEN]``
  (:class:`~ho_onnx.rewrite.insert.RewrittenModel`); the analysis is spent afterwards;
* :class:`VerifySchedulePass` -- checks the schedule invariants the insertion promises
  (:mod:`~ho_onnx.rewrite.invariants`; always run after it: one walk of the graph);
* :class:`AnnotatePass` -- records the decision in ``metadata_props``;
* :class:`PlaceDataPass` -- finishes each weight Prefetch with where its bytes are;
  ``meta[OUTPUT_FILES]`` (:class:`~ho_onnx.graph.save.OutputFiles`, what the save writes);
* :class:`ValidatePass` -- the target's check of the finished model: run by the save on the
  written file, or here, in memory, when the data files are already in place.

Each checks its precondition (the results it reads) and raises
``onnx_ir.passes.PreconditionError`` naming the pass that must run first.
:func:`analysis_steps` and :func:`rewrite_steps` are the one composition: the pipeline
(``ho_onnx.optimize``) runs them with its logging between, and :class:`OffloadPass` runs the
same lists as one functional pass (the input stays untouched).
None reads weight bytes: ``onnx_ir`` keeps external data on disk.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import onnx
import onnx_ir as ir

from .. import contract
from ..errors import HoOnnxError, OutputPathError, UnboundDimError
from ..graph.analyse import GraphAnalysis, TypeSource, analyse, tool_proto
from ..graph.check import contrib_ops
from ..graph.dims import DimRanges, bind_ranges, format_ranges, ranged_inputs, require_dims
from ..graph.save import OutputFiles, stamp_data_files, to_written_proto
from ..schedule.lifetimes import host_bytes
from ..schedule.options import OffloadOptions
from ..schedule.types import Decider, Decision, RunFacts
from ..target.ort.arena import ORT
from .annotate import annotate, plan_metadata
from .blocks import choose_blocks
from .branches import InsertBranchesPass, PlanBranchesPass, ReportBranchesPass
from .guard import insert_guards
from .insert import RewrittenModel, insert_cache_ops
from .invariants import check_schedule
from .meta import ANALYSIS, BRANCHES, CONTRIB, DECISION, OUTPUT_FILES, REWRITTEN, SPLITS
from .meta import need as _need
from .place import place_weight_data


def run_steps(model: ir.Model, *steps: ir.passes.PassBase) -> None:
    """Run ``steps`` in order on ``model`` (an ``onnx_ir.passes.Sequential``), failing with
    the error a step raised, not the ``PassError`` that wraps it: its message is the one a
    user acts on (was: "An error occurred when running the '<...PlaceDataPass object at
    0x...>' pass", for an output whose sidecar would overwrite the input's data file), and
    a caller catching :class:`~ho_onnx.errors.HoOnnxError` gets it."""
    try:
        ir.passes.Sequential(*steps)(model)
    except ir.passes.PassError as e:
        cause: BaseException = e
        while isinstance(cause, ir.passes.PassError) and cause.__cause__ is not None:
            cause = cause.__cause__
        if cause is e:
            raise
        raise cause from None


class CheckOpsPass(ir.passes.InPlacePass):
    """Refuse a standard-domain op neither onnx nor this onnxruntime defines (and a training
    op whose inputs or outputs do not fit its schema); ``meta[CONTRIB]``: the ops only ORT
    knows, whose types :class:`AnalysePass` then asks ORT's inference for. The checker reads
    :func:`~ho_onnx.graph.analyse.tool_proto`."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from ..target.ort.contrib import refuse_unknown_ops

        model.meta[CONTRIB] = refuse_unknown_ops(tool_proto(model))
        return ir.passes.PassResult(model, modified=False)


class AnalysePass(ir.passes.InPlacePass):
    """Analyse the main graph (sorted topologically in place when it is not); the types of
    the ops only ORT knows (``meta[CONTRIB]``, :class:`CheckOpsPass`) from ORT's inference."""

    def __init__(self, dims: Mapping[str, int] | None = None, *,
                 shapes: Mapping[str, Sequence[int]] | None = None,
                 more_types: TypeSource | None = None) -> None:
        super().__init__()
        self.dims, self.shapes = dict(dims or {}), dict(shapes or {})
        self.more_types = more_types

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        more = self.more_types
        if more is None and model.meta.get(CONTRIB):
            from ..target.ort.contrib import contrib_value_types

            more = contrib_value_types
        a = analyse(model, self.dims, shapes=self.shapes, more_types=more)
        model.meta[ANALYSIS] = a
        return ir.passes.PassResult(model, modified=a.order != sorted(a.order))


class SplitWeightsPass(ir.passes.InPlacePass):
    """Stream large weights in blocks before the decision (:func:`~ho_onnx.rewrite.blocks.
    choose_blocks`), when the decider is the budget planner: the model is split in place and
    ``meta[ANALYSIS]`` replaced by the new model's analysis; ``meta[SPLITS]``: what was
    split or kept whole, which :class:`DecidePass` records in the choice (``columns``: also
    blocks that are no byte range of the weight's file, written with the data)."""

    def __init__(self, decider: Decider, dims: Mapping[str, int] | None = None, *,
                 shapes: Mapping[str, Sequence[int]] | None = None,
                 columns: bool = True, run: RunFacts | None = None) -> None:
        super().__init__()
        self.decider, self.dims, self.shapes = decider, dict(dims or {}), dict(shapes or {})
        self.columns = columns
        self.run = run if run is not None else RunFacts(ORT)

    def requires(self, model: ir.Model) -> None:
        _need(model, ANALYSIS, "AnalysePass")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        model.meta.pop(SPLITS, None)  # (an earlier run's)
        options = getattr(self.decider, "options", None)  # (a Decider declares none)
        if not isinstance(options, OffloadOptions) or options.budget is None:
            return ir.passes.PassResult(model, modified=False)  # (no budget: nothing to fit)
        more = None
        if model.meta.get(CONTRIB):
            from ..target.ort.contrib import contrib_value_types as more

        def reanalyse(m: ir.Model) -> GraphAnalysis:
            return analyse(m, self.dims, shapes=self.shapes, more_types=more)

        try:  # (the trials timed as DecidePass will time the plan: a range plan's bottom)
            prepare = getattr(self.decider, "prepared", None)  # (optional in the protocol)
            decider = self.decider if prepare is None else prepare(self.run)
            new, splits = choose_blocks(model.meta[ANALYSIS], decider, self.dims, reanalyse,
                                        self.columns)
        except UnboundDimError:  # (DecidePass names every unbound dim at once)
            return ir.passes.PassResult(model, modified=False)
        model.meta[SPLITS] = splits
        if new is not None:
            model.meta[ANALYSIS] = new
        return ir.passes.PassResult(model, modified=new is not None)


class DecidePass(ir.passes.InPlacePass):
    """Decide what to offload (changes nothing in the graph). First, every symbolic dim of
    the tensors whose sizes the decider needs (``Decider.sized``) must be bound: one error
    names all that ``dims`` lacks (and the names of ``dims`` the model does not use: likely
    misspellings). The decider is handed ``run`` (``Decider.prepared``; by default ORT's
    facts) when it takes it."""

    def __init__(self, decider: Decider, dims: Mapping[str, int] | None = None, *,
                 run: RunFacts | None = None) -> None:
        super().__init__()
        self.decider, self.dims = decider, dict(dims or {})
        self.run = run if run is not None else RunFacts(ORT)

    def requires(self, model: ir.Model) -> None:
        _need(model, ANALYSIS, "AnalysePass")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        analysis: GraphAnalysis = model.meta[ANALYSIS]
        require_dims((d for t in analysis.tensors.values() if self.decider.sized(t)
                      for d in t.symbolic_dims()), self.dims, model=model)
        prepare = getattr(self.decider, "prepared", None)  # (optional in the protocol)
        decider = self.decider if prepare is None else prepare(self.run)
        decision = model.meta[DECISION] = decider.decide(analysis, self.dims)
        decision.choice.splits = list(model.meta.get(SPLITS, ()))
        if decision.choice.splits and isinstance(getattr(decision, "host_bytes", None), int):
            decision.host_bytes = host_bytes(decision.choice)  # (a table's blocks share it)
        return ir.passes.PassResult(model, modified=False)


class InsertPass(ir.passes.InPlacePass):
    """Insert the cache ops of the decision."""

    def requires(self, model: ir.Model) -> None:
        _need(model, ANALYSIS, "AnalysePass")
        _need(model, DECISION, "DecidePass")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        analysis: GraphAnalysis = model.meta[ANALYSIS]
        rewritten = insert_cache_ops(analysis, model.meta[DECISION].choice)
        model.meta[REWRITTEN] = rewritten
        return ir.passes.PassResult(model, modified=rewritten.cache_nodes > 0)

    def ensures(self, model: ir.Model) -> None:
        if contract.DOMAIN not in model.opset_imports:
            raise ir.passes.PostconditionError(f"no {contract.DOMAIN} opset import")


class VerifySchedulePass(ir.passes.InPlacePass):
    """Check the rewritten graph's schedule (:func:`~ho_onnx.rewrite.invariants.
    check_schedule`: raises :class:`~ho_onnx.errors.ScheduleError` naming the first node
    that breaks an invariant); changes nothing."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        check_schedule(model)
        return ir.passes.PassResult(model, modified=False)


class GuardPass(ir.passes.InPlacePass):
    """Insert the Guards of a range-planned model (``checks``: the ranged dims of each graph
    input, :func:`~ho_onnx.graph.dims.ranged_inputs`), after the cache ops."""

    def __init__(self, checks: Mapping[str, Sequence[tuple[int, str]]],
                 ranges: DimRanges) -> None:
        super().__init__()
        self.checks, self.ranges = dict(checks), dict(ranges)

    def requires(self, model: ir.Model) -> None:
        _need(model, REWRITTEN, "InsertPass")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        decision = model.meta.get(DECISION)
        n = insert_guards(model, self.checks, self.ranges,
                          decision.choice.decode_cache if decision is not None else None)
        model.meta[REWRITTEN].cache_nodes += n
        return ir.passes.PassResult(model, modified=n > 0)


class AnnotatePass(ir.passes.InPlacePass):
    """Record the decision (and ``dims``, the ``ranges`` planned for, and ``more``: the
    pipeline's own entries, such as a range plan's figures at its ends and named points) in
    ``metadata_props``."""

    def __init__(self, dims: Mapping[str, int] | None = None,
                 ranges: DimRanges | None = None, more: Mapping[str, str] | None = None
                 ) -> None:
        super().__init__()
        self.dims, self.ranges = dict(dims or {}), dict(ranges or {})
        self.more = dict(more or {})

    def requires(self, model: ir.Model) -> None:
        _need(model, DECISION, "DecidePass")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        decision: Decision = model.meta[DECISION]
        meta = plan_metadata(decision, self.dims)
        if self.ranges:
            meta["dim_ranges"] = format_ranges(self.ranges)
        annotate(model, meta | self.more)
        return ir.passes.PassResult(model, modified=True)


class PlaceDataPass(ir.passes.InPlacePass):
    """Finish each weight Prefetch with its bytes' file, offset and length for an output
    written to ``out_path`` (``base_dir``: the folder external locations are relative to)."""

    def __init__(self, base_dir: Path, out_path: Path) -> None:
        super().__init__()
        self.base_dir, self.out_path = Path(base_dir), Path(out_path)

    def requires(self, model: ir.Model) -> None:
        _need(model, REWRITTEN, "InsertPass")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        rewritten: RewrittenModel = model.meta[REWRITTEN]
        model.meta[OUTPUT_FILES] = place_weight_data(rewritten, self.base_dir, self.out_path)
        return ir.passes.PassResult(model, modified=bool(rewritten.weight_prefetches))


class ValidatePass(ir.passes.InPlacePass):
    """Pick the target's check of the finished model (``OutputFiles.validate``): ORT loading
    it, with the cache ops' library, when it has operators onnx cannot check (ORT's contrib
    ops), else ``onnx.checker``. The save runs it on the written file before renaming it
    into place: the library opens each weight Prefetch's data file when ORT loads the model,
    and a sidecar exists only once written. With ``data_dir`` (the data files already where
    the model reads them, as :class:`OffloadPass` leaves them) the Prefetches are stamped
    (:func:`~ho_onnx.graph.save.stamp_data_files`) and the model checked here, in memory."""

    def __init__(self, data_dir: Path | None = None) -> None:
        super().__init__()
        self.data_dir = None if data_dir is None else Path(data_dir)

    def requires(self, model: ir.Model) -> None:
        _need(model, OUTPUT_FILES, "PlaceDataPass")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        files: OutputFiles = model.meta[OUTPUT_FILES]
        if contrib_ops(model, ignore=(contract.DOMAIN,)):
            files.validate = ort_validation
        if self.data_dir is None:
            return ir.passes.PassResult(model, modified=False)
        data_dir = self.data_dir
        stamp_data_files(files.stamps, lambda loc: data_dir / loc)
        files.validate(to_written_proto(model), data_dir)
        return ir.passes.PassResult(model, modified=bool(files.stamps))


def ort_validation(finished: Path | onnx.ModelProto, data_dir: Path) -> None:
    """ORT loads the finished model, its weights' data files in ``data_dir`` (a
    :data:`~ho_onnx.graph.save.Validation`: ``onnx.checker`` cannot judge contrib ops)."""
    from ..target.ort.contrib import ort_check

    try:  # (a written file: its own folder)
        ort_check(finished, model_dir=data_dir if isinstance(finished, onnx.ModelProto)
                  else None)
    except HoOnnxError as e:
        raise OutputPathError(f"the rewritten model does not load in onnxruntime: {e}") from e


def analysis_steps(decider: Decider, dims: Mapping[str, int], *,
                   shapes: Mapping[str, Sequence[int]] | None = None,
                   run: RunFacts | None = None,
                   columns: bool = True) -> list[ir.passes.PassBase]:
    """The steps before the cache ops: check the ops, analyse, stream large weights in
    blocks where that pays (the graph's only change here; ``columns``: also blocks that are
    no byte range of the weight's file, written with the data), decide (the If branches
    first, :mod:`.branches`; ``run``: what the decider is handed, :class:`DecidePass`)."""
    return [CheckOpsPass(), AnalysePass(dims, shapes=shapes),
            SplitWeightsPass(decider, dims, shapes=shapes, columns=columns, run=run),
            PlanBranchesPass(decider, dims, shapes=shapes, run=run),
            DecidePass(decider, dims, run=run), ReportBranchesPass()]


def rewrite_steps(dims: Mapping[str, int], base_dir: Path, out_path: Path, *,
                  checks: Mapping[str, Sequence[tuple[int, str]]] | None = None,
                  ranges: DimRanges | None = None,
                  data_dir: Path | None = None,
                  metadata: Mapping[str, str] | None = None) -> list[ir.passes.PassBase]:
    """The steps that rewrite the decided model: insert, guard the ranges (``checks``:
    :func:`~ho_onnx.graph.dims.ranged_inputs`), verify, annotate (``metadata``: more
    entries, :class:`AnnotatePass`), place the weights' bytes for an output at
    ``out_path``, validate (``data_dir``: :class:`ValidatePass`)."""
    return [InsertPass(), InsertBranchesPass(), GuardPass(checks or {}, ranges or {}),
            VerifySchedulePass(), AnnotatePass(dims, ranges, metadata),
            PlaceDataPass(base_dir, out_path), ValidatePass(data_dir)]


def rewrite_passes(decider: Decider, dims: Mapping[str, int], base_dir: Path, out_path: Path,
                   *, shapes: Mapping[str, Sequence[int]] | None = None,
                   checks: Mapping[str, Sequence[tuple[int, str]]] | None = None,
                   ranges: DimRanges | None = None) -> list[ir.passes.PassBase]:
    """Every step of one rewrite, in order: :func:`analysis_steps`, then
    :func:`rewrite_steps`."""
    return [*analysis_steps(decider, dims, shapes=shapes),
            *rewrite_steps(dims, base_dir, out_path, checks=checks, ranges=ranges)]


class OffloadPass(ir.passes.FunctionalPass):
    """Offload the tensors ``decider`` chooses (symbolic dims bound by ``dims``; ``ranges``:
    one plan for every value of each range, guarded, as ``ho_onnx.optimize`` makes): the
    pipeline's own steps (:func:`analysis_steps`, :func:`rewrite_steps`) on a copy of the
    model, validated in memory against the input's data files (:class:`ValidatePass`); it
    writes nothing.

    Precondition: every offloaded weight is in external data (an ``onnx_ir.ExternalTensor``,
    as ``onnx_ir.load`` gives for a model saved with external data): an inline weight has
    no file for its Prefetch to read; :func:`~ho_onnx.rewrite.pipeline.optimize` writes
    such weights to a sidecar. Postcondition: the result loads in ORT next to the input's
    data files (write it into the same folder)."""

    def __init__(self, decider: Decider, dims: Mapping[str, int] | None = None, *,
                 ranges: DimRanges | None = None) -> None:
        super().__init__()
        self.decider = decider
        self.ranges = dict(ranges or {})
        self.dims = bind_ranges(dims or {}, self.ranges)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        work = model.clone()
        # (blocks only as byte ranges of the weights' own files: nothing here writes data)
        run_steps(work, *analysis_steps(self.decider, self.dims, columns=False))
        choice = work.meta[DECISION].choice
        inner = [w.name for b in work.meta.get(BRANCHES, ([], {}))[0] if b.decision
                 for w in b.decision.choice.weights]
        if not (choice.weights or choice.activations or choice.inputs or choice.outputs
                or inner):
            return ir.passes.PassResult(work, modified=False)
        base_dir = _external_base_dir(work, {w.name for w in choice.weights} | {
            n for n in inner if n in work.graph.initializers})
        checks = ranged_inputs(work, self.ranges) if self.ranges else {}
        run_steps(work, *rewrite_steps(self.dims, base_dir, base_dir / "model.onnx",
                                       checks=checks, ranges=self.ranges, data_dir=base_dir))
        assert work.meta[OUTPUT_FILES].sidecar is None  # every offloaded weight is external
        for key in (CONTRIB, ANALYSIS, SPLITS, DECISION, REWRITTEN, OUTPUT_FILES, BRANCHES):
            work.meta.pop(key, None)
        return ir.passes.PassResult(work, modified=True)


def _external_base_dir(model: ir.Model, names: set[str]) -> Path:
    """The folder the offloaded weights' data files are relative to; raises
    :class:`onnx_ir.passes.PreconditionError` naming an inline one."""
    rewritten_weights = {n: model.graph.initializers[n].const_value for n in sorted(names)}
    dirs: set[Path] = set()
    for name, tensor in rewritten_weights.items():
        if not isinstance(tensor, ir.ExternalTensor):
            raise ir.passes.PreconditionError(
                f"offloaded weight {name!r} is not in external data: save the model with "
                "external data first, or use ho_onnx.optimize (it writes a sidecar)")
        dirs.add(Path(tensor.base_dir or ".").resolve())
    if len(dirs) > 1:
        raise ir.passes.PreconditionError(
            f"offloaded weights' data files lie in several folders: {sorted(map(str, dirs))}")
    return next(iter(dirs), Path(".").resolve())
