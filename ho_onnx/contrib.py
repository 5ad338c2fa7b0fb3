"""Models with ONNX Runtime contrib operators (and other custom domains): check, shapes, load.

ONNX Runtime runs operators that ``onnx`` does not know: its contrib ops (domain
``com.microsoft``, and a few it registers in the default domain, such as
``SimplifiedLayerNormalization``) and the ops of custom-op libraries. Exporters for LLM
generation (the onnxruntime-genai model builder, Optimum's ``--optimize O2``) emit them. Here:

* :func:`check_standard` runs ``onnx.checker`` on everything it can judge (graph structure,
  every node of a standard domain that onnx knows) and lets the rest through when ORT knows it
  (:func:`ort_schemas`) or the domain is a custom one; no weight bytes are read;
* :func:`contrib_value_types` gets the output types of such nodes from ORT's symbolic shape
  inference (``onnxruntime.tools.symbolic_shape_infer``), run on a copy whose weights are
  typed graph inputs (:func:`weights_as_inputs`), so no weight bytes are read either;
* :func:`ort_check` validates a written model by ORT loading its graph (weights as inputs),
  with the ho-onnx library registered: ``onnx.checker`` cannot judge contrib ops.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from .errors import UnsupportedModelError
from .shapes import free_names

# Domains whose operators onnx defines (every other domain is a custom one).
STANDARD_DOMAINS = frozenset(
    ("", "ai.onnx", "ai.onnx.ml", "ai.onnx.training", "ai.onnx.preview",
     "ai.onnx.preview.training")
)
# Where check_standard moves nodes onnx cannot judge, so the checker skips them.
UNCHECKED_DOMAIN = "ai.hyperoffload.unchecked"
# Inline initializers up to this size keep their bytes in the skeletons (shape tensors,
# axes, small constants that shape inference reads); bigger ones and external ones become
# typed graph inputs.
SKELETON_KEEP_BYTES = 4096


def _domain(d: str) -> str:
    return "" if d == "ai.onnx" else d


def _iter_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _iter_graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _iter_graphs(g)


def opset_versions(model: onnx.ModelProto) -> dict[str, int]:
    """Imported opset version per domain (``ai.onnx`` spelled ``""``)."""
    return {_domain(i.domain): i.version for i in model.opset_import}


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
        out |= {(_domain(s.domain), s.name) for s in C.get_all_operator_schema()}
    if hasattr(C, "get_all_opkernel_def"):
        out |= {(_domain(k.domain), k.op_name) for k in C.get_all_opkernel_def()}
    return frozenset(out)


def is_onnx_op(node: onnx.NodeProto, opsets: Mapping[str, int],
               functions: frozenset[tuple[str, str]] = frozenset()) -> bool:
    """Whether onnx defines ``node``'s operator at the model's opset (or the model defines
    it as a local function)."""
    domain = _domain(node.domain)
    if (domain, node.op_type) in functions:
        return True
    if domain not in STANDARD_DOMAINS:
        return False
    version = opsets.get(domain)
    if version is None:
        return False
    return bool(onnx.defs.has(node.op_type, version, domain))


def _functions(model: onnx.ModelProto) -> frozenset[tuple[str, str]]:
    return frozenset((_domain(f.domain), f.name) for f in model.functions)


def nonstandard_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Nodes (subgraphs included) whose operator onnx does not define at the model's opset."""
    opsets, funcs = opset_versions(model), _functions(model)
    return [n for g in _iter_graphs(model.graph) for n in g.node
            if not is_onnx_op(n, opsets, funcs)]


def contrib_ops(model: onnx.ModelProto, ignore: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """Distinct ``(domain, op_type)`` onnx cannot check, except those of ``ignore`` domains."""
    seen = {(_domain(n.domain), n.op_type) for n in nonstandard_nodes(model)}
    return sorted(k for k in seen if k[0] not in ignore)


def weights_as_inputs(model: onnx.ModelProto,
                      keep_bytes: int = SKELETON_KEEP_BYTES) -> onnx.ModelProto:
    """A copy of ``model`` whose external and big initializers are typed graph inputs.

    Nothing of the removed initializers is read or copied but their names, types and dims;
    small inline ones (shapes, axes) stay. Subgraphs are copied as they are.
    """
    src = model.graph
    sk = onnx.ModelProto()
    for f in ("ir_version", "producer_name", "producer_version", "domain", "model_version"):
        setattr(sk, f, getattr(model, f))
    sk.opset_import.extend(model.opset_import)
    sk.functions.extend(model.functions)
    g = sk.graph
    g.name = src.name
    g.node.extend(src.node)
    g.input.extend(src.input)
    g.output.extend(src.output)
    g.value_info.extend(src.value_info)
    g.sparse_initializer.extend(src.sparse_initializer)
    declared = {vi.name for vi in src.input}
    for t in src.initializer:
        if t.data_location != TensorProto.EXTERNAL and t.ByteSize() <= keep_bytes:
            g.initializer.append(t)
        elif t.name not in declared:
            g.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    sk.ir_version = max(sk.ir_version, 4)  # initializers need not be inputs from IR 4 on
    return sk


def check_standard(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """``onnx.checker`` on everything onnx can judge; returns the contrib ops let through.

    Nodes of a standard domain that onnx does not define at the model's opset pass when
    ORT registers them (:func:`ort_schemas`); nodes of custom domains always pass (a
    custom-op library may define them; ORT judges them when it loads the model). Raises
    ``onnx.checker.ValidationError`` for what the checker refuses, and
    :class:`UnsupportedModelError` for a standard-domain op neither onnx nor ORT knows.
    Weight bytes are never read.
    """
    sk = weights_as_inputs(model)
    opsets, funcs = opset_versions(sk), _functions(sk)
    known = ort_schemas()
    passed: set[tuple[str, str]] = set()
    for graph in _iter_graphs(sk.graph):
        for node in graph.node:
            if is_onnx_op(node, opsets, funcs):
                continue
            key = (_domain(node.domain), node.op_type)
            if key[0] in STANDARD_DOMAINS:
                if key[0] not in opsets:
                    continue  # the checker names the missing opset import
                if known and key not in known:
                    raise UnsupportedModelError(
                        f"node {node.name or node.op_type!r}: no operator {node.op_type!r} in "
                        f"domain {key[0] or 'ai.onnx'!r} (opset {opsets[key[0]]}) is known "
                        "to onnx or to onnxruntime"
                    )
                node.domain = UNCHECKED_DOMAIN
            passed.add(key)
    if UNCHECKED_DOMAIN not in opsets:
        sk.opset_import.append(helper.make_opsetid(UNCHECKED_DOMAIN, 1))
    onnx.checker.check_model(sk)
    return sorted(passed)


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
    """
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    except ImportError:
        return {}
    sk = weights_as_inputs(model)
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
    try:
        out = SymbolicShapeInference.infer_shapes(sk, int_max=2**31 - 1, auto_merge=True,
                                                  guess_output_rank=True, verbose=0)
    except Exception:  # best effort, like onnx's inference
        return {}
    if out is None:
        return {}
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


def ort_check(path: str | os.PathLike[str], library: str | None = None) -> None:
    """Validate a written model by ORT loading its graph, weights as typed inputs.

    ``library`` (default: ho-onnx's) is registered so cache operators and their types are
    judged too. Raises :class:`UnsupportedModelError` with ORT's first line on failure.
    """
    import onnxruntime as ort

    p = Path(path)
    model = onnx.load(str(p), load_external_data=False)
    sk = weights_as_inputs(model, keep_bytes=0)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    if library is None:
        from .runtime import library_path

        library = library_path()
    so.add_session_config_entry("ho_onnx.model_dir", str(p.resolve().parent))
    so.register_custom_ops_library(library)
    try:
        ort.InferenceSession(sk.SerializeToString(), sess_options=so,
                             providers=["CPUExecutionProvider"])
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        raise UnsupportedModelError(f"onnxruntime does not load {str(p)!r}: {msg}") from None
