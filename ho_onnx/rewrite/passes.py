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
  ``meta[OUTPUT_FILES]`` (:class:`~ho_onnx.graph.save.OutputFiles`, what the save writes).

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
from typing import Any

import onnx
import onnx_ir as ir

from .. import contract
from ..errors import UnboundDimError
from ..graph.analyse import GraphAnalysis, TypeSource, analyse
from ..graph.dims import DimRanges, bind_ranges, format_ranges, ranged_inputs, require_dims
from ..graph.save import OutputFiles, data_stamps
from ..schedule.planner import BudgetPlanner
from ..schedule.types import Decider, Decision
from .annotate import annotate, plan_metadata
from .blocks import choose_blocks
from .guard import insert_guards
from .insert import RewrittenModel, insert_cache_ops
from .invariants import check_schedule
from .place import place_weight_data

CONTRIB = "ho_onnx.contrib"
ANALYSIS = "ho_onnx.analysis"
DECISION = "ho_onnx.decision"
SPLITS = "ho_onnx.splits"
REWRITTEN = "ho_onnx.rewritten"
OUTPUT_FILES = "ho_onnx.output_files"


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


def _need(model: ir.Model, key: str, producer: str) -> Any:
    if key not in model.meta:
        raise ir.passes.PreconditionError(f"{key} missing: run {producer} first")
    return model.meta[key]


class CheckOpsPass(ir.passes.InPlacePass):
    """Refuse a standard-domain op neither onnx nor this onnxruntime defines (and a training
    op whose inputs or outputs do not fit its schema); ``meta[CONTRIB]``: the ops only ORT
    knows, whose types :class:`AnalysePass` then asks ORT's inference for. ``proto``: the
    model as loaded (else serialised from the model, weights left external)."""

    def __init__(self, proto: onnx.ModelProto | None = None) -> None:
        super().__init__()
        self.proto = proto

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from ..target.ort.contrib import refuse_unknown_ops

        model.meta[CONTRIB] = refuse_unknown_ops(
            self.proto if self.proto is not None else ir.to_proto(model))
        return ir.passes.PassResult(model, modified=False)


class AnalysePass(ir.passes.InPlacePass):
    """Analyse the main graph (sorted topologically in place when it is not); the types of
    the ops only ORT knows (``meta[CONTRIB]``, :class:`CheckOpsPass`) from ORT's inference."""

    def __init__(self, dims: Mapping[str, int] | None = None, *,
                 shapes: Mapping[str, Sequence[int]] | None = None,
                 more_types: TypeSource | None = None,
                 proto: onnx.ModelProto | None = None) -> None:
        super().__init__()
        self.dims, self.shapes = dict(dims or {}), dict(shapes or {})
        self.more_types, self.proto = more_types, proto

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        more = self.more_types
        if more is None and model.meta.get(CONTRIB):
            from ..target.ort.contrib import contrib_value_types

            more = contrib_value_types
        a = analyse(model, self.dims, shapes=self.shapes, more_types=more, proto=self.proto)
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
                 columns: bool = True) -> None:
        super().__init__()
        self.decider, self.dims, self.shapes = decider, dict(dims or {}), dict(shapes or {})
        self.columns = columns

    def requires(self, model: ir.Model) -> None:
        _need(model, ANALYSIS, "AnalysePass")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        model.meta.pop(SPLITS, None)  # (an earlier run's)
        if not isinstance(self.decider, BudgetPlanner):
            return ir.passes.PassResult(model, modified=False)
        more = None
        if model.meta.get(CONTRIB):
            from ..target.ort.contrib import contrib_value_types as more

        def reanalyse(m: ir.Model) -> GraphAnalysis:
            return analyse(m, self.dims, shapes=self.shapes, more_types=more)

        try:
            new, splits = choose_blocks(model.meta[ANALYSIS], self.decider, self.dims,
                                        reanalyse, self.columns)
        except UnboundDimError:  # (DecidePass names every unbound dim at once)
            return ir.passes.PassResult(model, modified=False)
        model.meta[SPLITS] = splits
        if new is not None:
            model.meta[ANALYSIS] = new
        return ir.passes.PassResult(model, modified=new is not None)


class DecidePass(ir.passes.InPlacePass):
    """Decide what to offload (changes nothing in the graph). First, every symbolic dim of
    the tensors whose sizes the decider needs (``Decider.sized``) must be bound: one error
    names all that ``dims`` lacks (and, with the model's ``proto``, the names of ``dims``
    it does not use: likely misspellings)."""

    def __init__(self, decider: Decider, dims: Mapping[str, int] | None = None, *,
                 proto: onnx.ModelProto | None = None) -> None:
        super().__init__()
        self.decider, self.dims, self.proto = decider, dict(dims or {}), proto

    def requires(self, model: ir.Model) -> None:
        _need(model, ANALYSIS, "AnalysePass")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        analysis: GraphAnalysis = model.meta[ANALYSIS]
        require_dims((d for t in analysis.tensors.values() if self.decider.sized(t)
                      for d in t.symbolic_dims()), self.dims, model=self.proto)
        model.meta[DECISION] = self.decider.decide(analysis, self.dims)
        model.meta[DECISION].choice.splits = list(model.meta.get(SPLITS, ()))
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
        n = insert_guards(model, self.checks, self.ranges)
        model.meta[REWRITTEN].cache_nodes += n
        return ir.passes.PassResult(model, modified=n > 0)


class AnnotatePass(ir.passes.InPlacePass):
    """Record the decision (and ``dims``, and the ``ranges`` planned for) in
    ``metadata_props``."""

    def __init__(self, dims: Mapping[str, int] | None = None,
                 ranges: DimRanges | None = None) -> None:
        super().__init__()
        self.dims, self.ranges = dict(dims or {}), dict(ranges or {})

    def requires(self, model: ir.Model) -> None:
        _need(model, DECISION, "DecidePass")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        decision: Decision = model.meta[DECISION]
        meta = plan_metadata(decision, self.dims)
        if self.ranges:
            meta["dim_ranges"] = format_ranges(self.ranges)
        annotate(model, meta)
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


def analysis_steps(decider: Decider, dims: Mapping[str, int], *,
                   shapes: Mapping[str, Sequence[int]] | None = None,
                   proto: onnx.ModelProto | None = None,
                   columns: bool = True) -> list[ir.passes.PassBase]:
    """The steps before the cache ops: check the ops, analyse, stream large weights in
    blocks where that pays (the graph's only change here; ``columns``: also blocks that
    are no byte range of the weight's file, written with the data), decide (``proto``: the
    model as loaded, read instead of a serialisation)."""
    return [CheckOpsPass(proto), AnalysePass(dims, shapes=shapes, proto=proto),
            SplitWeightsPass(decider, dims, shapes=shapes, columns=columns),
            DecidePass(decider, dims, proto=proto)]


def rewrite_steps(dims: Mapping[str, int], base_dir: Path, out_path: Path, *,
                  checks: Mapping[str, Sequence[tuple[int, str]]] | None = None,
                  ranges: DimRanges | None = None) -> list[ir.passes.PassBase]:
    """The steps that rewrite the decided model: insert, guard the ranges (``checks``:
    :func:`~ho_onnx.graph.dims.ranged_inputs`), verify, annotate, place the weights' bytes
    for an output at ``out_path``."""
    return [InsertPass(), GuardPass(checks or {}, ranges or {}), VerifySchedulePass(),
            AnnotatePass(dims, ranges), PlaceDataPass(base_dir, out_path)]


def rewrite_passes(decider: Decider, dims: Mapping[str, int], base_dir: Path, out_path: Path,
                   *, shapes: Mapping[str, Sequence[int]] | None = None,
                   proto: onnx.ModelProto | None = None,
                   checks: Mapping[str, Sequence[tuple[int, str]]] | None = None,
                   ranges: DimRanges | None = None) -> list[ir.passes.PassBase]:
    """Every step of one rewrite, in order: :func:`analysis_steps`, then
    :func:`rewrite_steps`."""
    return [*analysis_steps(decider, dims, shapes=shapes, proto=proto),
            *rewrite_steps(dims, base_dir, out_path, checks=checks, ranges=ranges)]


class OffloadPass(ir.passes.FunctionalPass):
    """Offload the tensors ``decider`` chooses (symbolic dims bound by ``dims``; ``ranges``:
    one plan for every value of each range, guarded, as ``ho_onnx.optimize`` makes): the
    pipeline's own steps (:func:`analysis_steps`, :func:`rewrite_steps`) on a copy of the
    model. What it does not do is write: ORT's validation of a model with contrib ops runs
    when the pipeline saves one.

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
        if not (choice.weights or choice.activations or choice.inputs or choice.outputs):
            return ir.passes.PassResult(work, modified=False)
        base_dir = _external_base_dir(work, {w.name for w in choice.weights})
        checks = ranged_inputs(ir.to_proto(work), self.ranges) if self.ranges else {}
        run_steps(work, *rewrite_steps(self.dims, base_dir, base_dir / "model.onnx",
                                       checks=checks, ranges=self.ranges))
        files: OutputFiles = work.meta[OUTPUT_FILES]
        assert files.sidecar is None  # every offloaded weight is external (checked above)
        nodes = list(work.graph)
        for positions, size, fp in data_stamps(files.stamps, lambda loc: base_dir / loc):
            for i in positions:
                nodes[i].attributes[contract.ATTR_DATA_SIZE] = ir.AttrInt64(
                    contract.ATTR_DATA_SIZE, size)
                nodes[i].attributes[contract.ATTR_DATA_FINGERPRINT] = ir.AttrString(
                    contract.ATTR_DATA_FINGERPRINT, fp)
        for key in (CONTRIB, ANALYSIS, SPLITS, DECISION, REWRITTEN, OUTPUT_FILES):
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
