"""Check a model with ``onnx.checker`` where onnx can judge it, and let the rest through.

Runtimes run operators that ``onnx`` does not define: ONNX Runtime's contrib ops (domain
``com.microsoft``, and a few it registers in the default domain, such as
``SimplifiedLayerNormalization``) and the ops of custom-op libraries. :func:`check_standard`
runs the checker on a copy where those nodes are moved to a domain it skips; graph
structure and every node onnx defines are still checked. No weight bytes are read
(:func:`weights_as_inputs`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import onnx
import onnx_ir as ir
from onnx import TensorProto, helper

from ..errors import UnsupportedModelError
from .dims import shape_text
from .dtypes import ELEMENT_BITS, capped_nbytes, tensor_nbytes
from .protos import graph_shell, iter_graphs

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


def domain_name(d: str) -> str:
    return "" if d == "ai.onnx" else d


def opset_versions(model: onnx.ModelProto) -> dict[str, int]:
    """Imported opset version per domain (``ai.onnx`` spelled ``""``)."""
    return {domain_name(i.domain): i.version for i in model.opset_import}


def is_onnx_op(node: onnx.NodeProto | ir.Node, opsets: Mapping[str, int],
               functions: frozenset[tuple[str, str]] = frozenset()) -> bool:
    """Whether onnx defines ``node``'s operator at the model's opset (or the model defines
    it as a local function)."""
    domain = domain_name(node.domain)
    if (domain, node.op_type) in functions:
        return True
    if domain not in STANDARD_DOMAINS:
        return False
    version = opsets.get(domain)
    if version is None:
        return False
    return _onnx_defines(node.op_type, version, domain)


@functools.lru_cache(maxsize=4096)
def _onnx_defines(op_type: str, version: int, domain: str) -> bool:
    """``onnx.defs.has``, remembered (a schema lookup per node was a fifth of the checks of a
    decoder; a model names few distinct operators)."""
    return bool(onnx.defs.has(op_type, version, domain))


def _functions(model: onnx.ModelProto) -> frozenset[tuple[str, str]]:
    return frozenset((domain_name(f.domain), f.name) for f in model.functions)


def contrib_ops(model: ir.Model, ignore: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """Distinct ``(domain, op_type)`` of ``model`` (subgraphs included) that onnx cannot
    check, except those of ``ignore`` domains."""
    opsets = {domain_name(d): v for d, v in model.opset_imports.items()}
    funcs = frozenset((domain_name(d), name) for d, name, _ in model.functions)
    seen = {(domain_name(n.domain), n.op_type) for n in ir.traversal.RecursiveGraphIterator(
        model.graph) if not is_onnx_op(n, opsets, funcs)}
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
    sk.graph.CopyFrom(graph_shell(src))
    g = sk.graph
    g.node.extend(src.node)
    g.value_info.extend(src.value_info)
    declared = {vi.name for vi in src.input}
    types: dict[tuple[int, tuple[int, ...]], onnx.TypeProto] = {}  # (a few distinct ones)
    for t in src.initializer:
        if t.data_location != TensorProto.EXTERNAL and t.ByteSize() <= keep_bytes:
            g.initializer.append(t)
        elif t.name not in declared:
            key = (t.data_type, tuple(t.dims))
            tp = types.get(key)
            if tp is None:
                tp = types[key] = helper.make_tensor_type_proto(t.data_type, list(t.dims))
            vi = g.input.add()
            vi.name = t.name
            vi.type.CopyFrom(tp)
    sk.ir_version = max(sk.ir_version, 4)  # initializers need not be inputs from IR 4 on
    return sk


def check_attribute_types(nodes: Iterable[onnx.NodeProto]) -> None:
    """Raise ``onnx.checker.ValidationError`` for a node attribute without a type: onnx's
    checker does not look at the attributes of custom-domain nodes (and does not run for
    ``inspect``), and onnx_ir reads such a model but cannot write it (found by the fuzzer:
    ``inspect`` failed with a SerdeError; also in a model function's body). A sparse tensor
    attribute (a Constant's ``sparse_value``) is valid, but onnx_ir cannot read it (found by
    hand: "Error calling _deserialize_graph with: g"): an :class:`UnsupportedModelError`."""
    for node in nodes:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.UNDEFINED:
                raise onnx.checker.ValidationError(
                    f"attribute {a.name!r} of node {node.name or node.op_type!r} has no type")
            why = tensor_data_error(a.t) if a.type == onnx.AttributeProto.TENSOR else None
            if why:  # (a Constant's value: what onnx_ir would fail to read)
                raise onnx.checker.ValidationError(
                    f"attribute {a.name!r} of node {node.name or node.op_type!r}: {why}")
            if a.type in _SPARSE:
                raise UnsupportedModelError(
                    f"attribute {a.name!r} of node {node.name or node.op_type!r} holds a "
                    "sparse tensor: not supported (ho-onnx cannot read it yet); store it as a "
                    "dense tensor (a Constant's 'value')")


_SPARSE = (onnx.AttributeProto.SPARSE_TENSOR, onnx.AttributeProto.SPARSE_TENSORS)


def size_error(t: TensorProto) -> str | None:
    """Why numeric tensor ``t``'s shape is no size (a negative dim, over 1 PiB), or None."""
    if t.data_type not in ELEMENT_BITS or capped_nbytes(t.data_type, t.dims) is not None:
        return None
    size = "has a negative dim" if any(d < 0 for d in t.dims) else "would take over 1 PiB"
    return f"its type and shape {shape_text(list(t.dims))} {size}"


def tensor_data_error(t: TensorProto) -> str | None:
    """Why inline numeric tensor ``t``'s data cannot be what its type and shape say, or None
    (found by the optimize fuzzer: ``onnx.checker`` lets these through, ORT refuses them; a
    weight of shape ``[-1, 2**62]`` was planned and failed in onnx_ir's writer, typed values
    half the shape needs "cannot reshape"). Its shape must be a size and its typed field hold
    as many values as the shape needs (two per complex element; sub-byte types packed). No
    weight byte is read: ``raw_data``'s length is checked where it is copied (reading it
    copies the bytes, ~130 ms per 200 MB; :func:`~ho_onnx.graph.save.save_model`)."""
    if t.data_location == TensorProto.EXTERNAL or t.data_type not in ELEMENT_BITS:
        return None
    why = size_error(t)
    if why or t.HasField("raw_data"):
        return why
    field = helper.tensor_dtype_to_field(t.data_type)
    n = math.prod(t.dims)
    need = (2 * n if t.data_type in (TensorProto.COMPLEX64, TensorProto.COMPLEX128)
            else tensor_nbytes(t.data_type, n) if ELEMENT_BITS[t.data_type] < 8 else n)
    have = len(getattr(t, field))
    return None if have == need else (f"holds {have} values in {field}, its type and shape "
                                      f"{shape_text(list(t.dims))} need {need}")


@dataclass(frozen=True)
class NodeArity:
    """How many inputs and outputs (positions, optional ones included) an operator that onnx
    does not define takes: ``(fewest, most)`` each."""

    inputs: tuple[int, int]
    outputs: tuple[int, int]


def _arity_error(node: onnx.NodeProto, arity: NodeArity) -> str | None:
    """Why ``node`` does not fit ``arity`` (a required position left empty counts), or None."""
    for what, names, (lo, hi) in (("inputs", node.input, arity.inputs),
                                  ("outputs", node.output, arity.outputs)):
        if not lo <= len(names) <= hi:
            return f"takes {lo} to {hi} {what}, has {len(names)}"
        empty = [i for i, name in enumerate(names[:lo]) if not name]
        if empty:
            return f"has no name for its required {what[:-1]} {empty[0]}"
    return None


def check_standard(model: onnx.ModelProto, known: Collection[tuple[str, str]] | None = None,
                   graphs: Sequence[onnx.GraphProto] | None = None,
                   arity: Mapping[tuple[str, str], NodeArity] | None = None
                   ) -> list[tuple[str, str]]:
    """``onnx.checker`` on everything onnx can judge; returns the ``(domain, op_type)`` it let
    through.

    A node of a standard domain that onnx does not define at the model's opset passes when
    ``known`` (the runtime's operators, e.g. ORT's contrib ops registered in the default
    domain) has it, or always when ``known`` is None; nodes of custom domains always pass (a
    custom-op library may define them: the runtime judges them when it loads the model).
    ``arity`` gives the input and output counts of operators onnx does not define (ORT's
    training ops): a node of one that does not fit them is a ``ValidationError`` too.
    Raises ``onnx.checker.ValidationError`` for what the checker refuses, and
    :class:`UnsupportedModelError` for a standard-domain op neither onnx nor ``known`` has.
    Weight bytes are never read. ``graphs``: ``iter_graphs(model.graph)`` when known.
    """
    opsets, funcs = opset_versions(model), _functions(model)
    graphs = list(iter_graphs(model.graph)) if graphs is None else graphs
    unknown = [(i, j) for i, g in enumerate(graphs) for j, node in enumerate(g.node)
               if not is_onnx_op(node, opsets, funcs)]
    sk = weights_as_inputs(model)
    sk_graphs = list(iter_graphs(sk.graph)) if unknown else []  # (the same graphs, copied)
    passed: set[tuple[str, str]] = set()
    for i, j in unknown:
        node = sk_graphs[i].node[j]
        key = (domain_name(node.domain), node.op_type)
        rule = arity.get(key) if arity else None
        why = _arity_error(node, rule) if rule is not None else None
        if why:
            raise onnx.checker.ValidationError(
                f"node {node.name or node.op_type!r}: {key[0]}:{node.op_type} {why}")
        if key[0] in STANDARD_DOMAINS:
            if key[0] not in opsets:
                continue  # the checker names the missing opset import
            if known is not None and key not in known:
                raise UnsupportedModelError(
                    f"node {node.name or node.op_type!r}: no operator {node.op_type!r} in "
                    f"domain {key[0] or 'ai.onnx'!r} (opset {opsets[key[0]]}) is known "
                    "to onnx or to the runtime"
                )
            node.domain = UNCHECKED_DOMAIN
        passed.add(key)
    if UNCHECKED_DOMAIN not in opsets:
        sk.opset_import.append(helper.make_opsetid(UNCHECKED_DOMAIN, 1))
    onnx.checker.check_model(sk)
    return sorted(passed)
