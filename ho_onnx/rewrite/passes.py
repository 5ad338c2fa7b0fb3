"""The rewrite as one ``onnx_ir`` pass, composable in an ``onnx_ir.passes.PassManager``.

:class:`OffloadPass` is functional (``onnx_ir.passes.FunctionalPass``): it returns a new
model in which the decider's tensors are offloaded and leaves its input untouched. It runs
analyse → decide → insert → annotate → place on a proto that carries the external-data
references but never the weight bytes (``onnx_ir`` loads external data lazily, and
serialising an external tensor writes only its reference), so it is as cheap on a 10 GiB
model as :func:`ho_onnx.rewrite.pipeline.optimize`.

Precondition: every offloaded weight is in external data (an ``onnx_ir.ExternalTensor``,
as ``onnx_ir.load`` gives for a model saved with external data): an inline weight has no
file for its Prefetch to read; :func:`~ho_onnx.rewrite.pipeline.optimize` writes such
weights to a sidecar. Postcondition: the result loads in ORT next to the input's data files
(write it into the same folder).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import onnx_ir as ir

from ..graph.analyse import analyse
from ..graph.save import stamp_data_files
from ..schedule.types import Decider
from .annotate import annotate, plan_metadata
from .insert import insert_cache_ops
from .place import place_weight_data


class OffloadPass(ir.passes.FunctionalPass):
    """Offload the tensors ``decider`` chooses (symbolic dims bound by ``dims``)."""

    def __init__(self, decider: Decider, dims: Mapping[str, int] | None = None) -> None:
        super().__init__()
        self.decider = decider
        self.dims = dict(dims or {})

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        proto = ir.serde.serialize_model(model)  # external tensors: references only
        analysis = analyse(proto, self.dims)
        decision = self.decider.decide(analysis, self.dims)
        if not decision.choice.weights and not decision.choice.activations:
            return ir.passes.PassResult(model.clone(), modified=False)
        base_dirs = _external_base_dirs(model, {w.name for w in decision.choice.weights})
        rewritten = insert_cache_ops(analysis, decision.choice)
        annotate(rewritten.model, plan_metadata(decision, self.dims))
        base_dir = next(iter(base_dirs), Path("."))
        files = place_weight_data(rewritten, base_dir, base_dir / "model.onnx")
        assert files.sidecar is None  # every offloaded weight is external (checked above)
        stamp_data_files(rewritten.model, files.stamps, lambda loc: base_dir / loc)
        result = ir.serde.deserialize_model(rewritten.model)
        for value in result.graph.initializers.values():  # data files resolve as before
            if isinstance(value.const_value, ir.ExternalTensor):
                value.const_value.base_dir = base_dir
        return ir.passes.PassResult(result, modified=True)


def _external_base_dirs(model: ir.Model, names: set[str]) -> set[Path]:
    """The folders the offloaded weights' data files are relative to (one, in practice);
    raises :class:`onnx_ir.passes.PreconditionError` naming an inline one."""
    dirs: set[Path] = set()
    for name in sorted(names):
        tensor = model.graph.initializers[name].const_value
        if not isinstance(tensor, ir.ExternalTensor):
            raise ir.passes.PreconditionError(
                f"offloaded weight {name!r} is not in external data: save the model with "
                "external data first, or use ho_onnx.optimize (it writes a sidecar)")
        dirs.add(Path(tensor.base_dir or ".").resolve())
    if len(dirs) > 1:
        raise ir.passes.PreconditionError(
            f"offloaded weights' data files lie in several folders: {sorted(map(str, dirs))}")
    return dirs
