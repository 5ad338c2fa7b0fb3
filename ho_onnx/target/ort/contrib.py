"""ONNX Runtime's view of models with contrib operators: which ops it knows, the shapes of
their outputs, and whether it loads a written model.

* :func:`ort_schemas`: the ``(domain, op_type)`` ORT registers (for
  :func:`~ho_onnx.graph.check.check_standard` and :func:`refuse_unknown_ops`);
* :func:`contrib_value_types` gets the output types of contrib nodes from ORT's symbolic
  shape inference (``onnxruntime.tools.symbolic_shape_infer``), run on a copy whose weights
  are typed graph inputs, so no weight bytes are read;
* :func:`ort_check` validates a written model by ORT loading its graph (weights as inputs),
  with the ho-onnx library registered: ``onnx.checker`` cannot judge contrib ops.

ORT's training ops (:mod:`.training`) are known from ho-onnx's table whether or not the
training runtime is installed: their arity is checked, their output types come from the
table's rules, and a runtime without them validates the rest of a written model.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path

import onnx

from ...errors import ModelLoadError, UnsupportedModelError
from ...graph import bounded
from ...graph.check import check_standard, domain_name, weights_as_inputs
from ...graph.dims import free_names
from .isolate import run_isolated
from .training import runtime_trains, training_arity, with_stand_ins

_log = logging.getLogger(__name__)

_CPU_ONLY = {"CPUExecutionProvider", "AzureExecutionProvider"}


@functools.lru_cache(maxsize=1)
def ort_schemas() -> frozenset[tuple[str, str]]:
    """``(domain, op_type)`` of every operator this onnxruntime registers (empty when
    onnxruntime is not installed or does not expose its schemas)."""
    try:
        from onnxruntime.capi import _pybind_state as C
    except ImportError:
        return frozenset()
    out: set[tuple[str, str]] = set()
    if hasattr(C, "get_all_operator_schema"):
        out |= {(domain_name(s.domain), s.name) for s in C.get_all_operator_schema()}
    # get_all_opkernel_def segfaults in onnxruntime-gpu 1.31.1 (measured on an H100): ask it
    # only of CPU-only builds; every GPU kernel's op has a schema above.
    if hasattr(C, "get_all_opkernel_def") and set(C.get_available_providers()) <= _CPU_ONLY:
        out |= {(domain_name(k.domain), k.op_name) for k in C.get_all_opkernel_def()}
    return frozenset(out)


def refuse_unknown_ops(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """:func:`~ho_onnx.graph.check.check_standard` against what this onnxruntime knows:
    raises :class:`UnsupportedModelError` naming a standard-domain op neither onnx nor ORT
    defines, ``onnx.checker.ValidationError`` for a training op whose inputs or outputs do
    not fit its schema (:func:`.training.training_arity`); returns the ops onnx cannot
    check."""
    return check_standard(model, ort_schemas() or None, arity=training_arity())


# Dims ORT's symbolic shape inference invents for values it cannot size (e.g.
# ``Flatten_99_o0__d1``, ``unk__3``): not bindable by the user, so unknown.
_INVENTED_DIM = re.compile(r"(?:^|[^A-Za-z0-9_])(?:unk__\d+|[A-Za-z0-9_]*_o\d+__d\d+)"
                           r"(?:$|[^A-Za-z0-9_])")


def invented_dim(dim: str) -> bool:
    """Whether a dim expression names a dim that shape inference invented."""
    return dim.startswith("unk__") or bool(_INVENTED_DIM.search(dim))


def contrib_value_types(model: onnx.ModelProto, dims: Mapping[str, int] | None = None,
                        shapes: Mapping[str, list[int]] | None = None
                        ) -> dict[str, onnx.TypeProto]:
    """Types of the main graph's values as ORT's symbolic shape inference sees them.

    ``dims`` binds symbolic input dims by name, ``shapes`` gives whole input shapes (unnamed
    dims too). Dims it invents, and expressions other than arithmetic of names (sympy's
    ``Max(a, b)``), are cleared: unknown. Best effort: ``{}`` when
    onnxruntime's tool is missing or fails. Weight bytes are never read.

    The tool computes the values of small tensors in Python (a ``ConstantOfShape`` of
    int64 materializes its whole output: 270 bytes of model, gigabytes of memory), so it
    runs in a child forked from a worker process (:mod:`._symbolic_worker`), bounded like
    ONNX's shape inference (:func:`~ho_onnx.graph.bounded.limits`:
    ``HO_ONNX_SHAPE_INFERENCE_MEMORY`` of address space, ``0``: unbounded;
    ``HO_ONNX_SHAPE_INFERENCE_TIMEOUT`` seconds); going past either is a
    :class:`~ho_onnx.errors.ModelLoadError`.
    """
    sk, _ = with_stand_ins(weights_as_inputs(model))
    dims, shapes = dict(dims or {}), dict(shapes or {})
    weight_inputs = {t.name for t in model.graph.initializer}
    for vi in sk.graph.input:
        if vi.name in weight_inputs or not vi.type.HasField("tensor_type"):
            continue
        tt = vi.type.tensor_type
        if vi.name in shapes:
            tt.ClearField("shape")
            for v in shapes[vi.name]:
                tt.shape.dim.add().dim_value = int(v)
            continue
        for d in tt.shape.dim:
            if d.HasField("dim_param") and d.dim_param in dims:
                d.dim_value = int(dims[d.dim_param])
    status, payload = _SYMBOLIC.call(sk.SerializeToString())
    if status == bounded.NO_MEMORY:
        raise bounded.too_big(bounded.limits()[0], _SYMBOLIC.what)
    if status == bounded.DIED:
        raise ModelLoadError(f"{_SYMBOLIC.what} of the model crashed ({payload.decode()})")
    return symbolic_types(payload) if status == bounded.OK else {}


_SYMBOLIC = bounded.Worker(["-m", "ho_onnx.target.ort._symbolic_worker"],
                           "ORT's symbolic shape inference")
atexit.register(_SYMBOLIC.stop)


def symbolic_types(inferred: bytes) -> dict[str, onnx.TypeProto]:
    """The main graph's value types in a model ORT's symbolic inference wrote
    (:func:`ho_onnx.target.ort._symbolic_worker.infer`), invented dims cleared."""
    out = onnx.ModelProto.FromString(inferred)
    types: dict[str, onnx.TypeProto] = {}
    for vi in list(out.graph.value_info) + list(out.graph.output):
        tp = onnx.TypeProto()
        tp.CopyFrom(vi.type)
        if tp.HasField("tensor_type") and tp.tensor_type.HasField("shape"):
            for d in tp.tensor_type.shape.dim:
                if d.HasField("dim_param") and (invented_dim(d.dim_param)
                                                or free_names(d.dim_param) is None):
                    d.ClearField("dim_param")  # (sympy's Max(a, b), floor(...): unknown)
        types[vi.name] = tp
    return types


def ort_check(path: str | os.PathLike[str] | onnx.ModelProto, library: str | None = None, *,
              model_dir: Path | None = None, isolate: bool = True) -> list[str]:
    """Validate a finished model by ORT loading its graph, weights as typed inputs: a
    written one (``path``), or one in memory (a proto) whose weight Prefetches read data
    files in ``model_dir``.

    ``library`` (default: ho-onnx's) is registered so cache operators and their types are
    judged too. A runtime that is no training build (plain ``onnxruntime``) lacks ORT's
    training ops: it loads the model with them replaced by stand-ins of the same output
    types (:func:`.training.with_stand_ins`), so everything else is validated, and the
    training nodes only against ho-onnx's table (their arity, checked before). Returns the
    training op types left to the table (a warning is logged naming them). Raises
    :class:`UnsupportedModelError` with ORT's first line on failure (or when ORT crashes:
    it runs in a child process unless ``isolate`` is false).
    """
    in_memory = isinstance(path, onnx.ModelProto)
    name = "the rewritten model" if in_memory else repr(str(path))
    if isolate:
        stood_in = run_isolated(ort_check, path, library, model_dir=model_dir, isolate=False,
                                what=f"loading {name}")
        if stood_in:
            _log.warning("note: the written model's training ops (%s) are checked against "
                         "ho-onnx's table only: this onnxruntime does not register them "
                         "(onnxruntime-training does: the `training` extra); ORT validated "
                         "the rest", ", ".join(stood_in))
        return stood_in
    import onnxruntime as ort

    if isinstance(path, onnx.ModelProto):
        model, folder = path, Path(model_dir or ".")
    else:
        model, folder = onnx.load(str(path), load_external_data=False), Path(path).parent
    sk = weights_as_inputs(model, keep_bytes=0)
    stood_in: list[str] = []
    if not runtime_trains():
        sk, stood_in = with_stand_ins(sk)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    if library is None:
        from .runtime import library_path

        library = library_path()
    so.add_session_config_entry("ho_onnx.model_dir", str(folder.resolve()))
    so.register_custom_ops_library(library)
    try:
        ort.InferenceSession(sk.SerializeToString(), sess_options=so,
                             providers=["CPUExecutionProvider"])
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        raise UnsupportedModelError(f"onnxruntime does not load {name}: {msg}") from None
    return stood_in
