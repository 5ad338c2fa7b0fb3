"""Analyses of the main graph of an ``onnx_ir`` model: topological order, tensor types and
sizes, lifetimes.

Positions are indices into ``GraphAnalysis.nodes`` (the schedule the rewriter refines).
Uses come from ``onnx_ir``'s use-def chains. Subgraphs (If/Loop/Scan bodies) are reached
through them: a value a subgraph reads from the outer scope is recorded as an *implicit*
use of the main-graph node that owns the subgraph, and the main graph's plan never offloads
such tensors (If branches are planned as graphs of their own: ``rewrite/branches.py``).
Types come from ONNX shape inference on a weightless copy, run bounded in memory and time
(:mod:`.bounded`); the model's own value types are not changed (the dims bound for the
analysis are not the model's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx
import onnx_ir as ir
from onnx import TensorProto

from ..errors import ModelLoadError, UnsupportedModelError
from .bounded import start_infer_shapes
from .dims import check_bindings, check_table_reads, eval_dim, shape_text
from .dtypes import ELEMENT_BITS, capped_nbytes, dtype_name
from .gcpause import gc_paused
from .kv import pair_kv

Dim = int | str | None  # a value, a symbolic name, or unknown
# No tensor is larger: sums of the sizes of many tensors stay within int64 (numpy arrays).


@dataclass
class TensorInfo:
    """What the analyses know of one value of the main graph."""

    name: str
    elem_type: int | None = None  # None: not a tensor, or unknown
    shape: tuple[Dim, ...] | None = None  # None: unknown rank
    is_initializer: bool = False
    is_graph_input: bool = False
    is_graph_output: bool = False
    producer: int | None = None  # position of the producing node
    consumers: list[int] = field(default_factory=list)  # positions, ascending, one per node
    implicit_consumers: list[int] = field(default_factory=list)  # nodes whose subgraphs read it
    # Past KV input <-> the present KV output it pairs with (.kv.pair_kv), else None.
    kv_peer: str | None = None

    @property
    def fixed_size_type(self) -> bool:
        return self.elem_type in ELEMENT_BITS

    def symbolic_dims(self) -> list[str]:
        return [d for d in (self.shape or ()) if isinstance(d, str)]

    def nbytes(self, dims: Mapping[str, int] | None = None) -> int | None:
        """Bytes of this tensor, symbolic dims taken from ``dims``.

        None when the type or rank is unknown or a dim has no name; raises
        :class:`UnboundDimError` naming a symbolic dim that ``dims`` does not bind.
        """
        if not self.fixed_size_type or self.shape is None:
            return None
        sizes = []
        for d in self.shape:
            if isinstance(d, str):
                d = eval_dim(d, dims or {}, self.name)
            if d is None or d < 0:  # unknown, or not a size
                return None
            sizes.append(d)
        assert self.elem_type is not None
        nbytes = capped_nbytes(self.elem_type, sizes)
        if nbytes is None:
            raise UnsupportedModelError(
                f"tensor {self.name!r} would have over 1 PiB (shape "
                f"{shape_text(self.shape)}): check its shape and the --dim values")
        return nbytes


_UNBOUND = "unbound_types"  # key in GraphAnalysis.derived


@dataclass
class GraphAnalysis:
    """Order, tensors and lifetimes of a model's main graph."""

    model: ir.Model
    nodes: list[ir.Node]  # the main graph's nodes in schedule order (positions)
    tensors: dict[str, TensorInfo]
    # Values of the main graph by name (inputs, initializers, node outputs).
    values: dict[str, ir.Value] = field(default_factory=dict, repr=False)
    # Position -> index of the node in the file as loaded (differs when it was not sorted).
    order: list[int] = field(default_factory=list, repr=False)
    # Every graph nested in the main graph -> the main-graph node that holds it.
    owners: dict[ir.Graph, ir.Node] = field(default_factory=dict, repr=False)
    # Facts later passes derive from this analysis once and share (e.g. the CUDA placement).
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # The value types shape inference gives with no dim bound (None: nothing was bound, so
    # ``tensors`` already hold them); asked once, by :meth:`unbound_shape`.
    unbound_types: Callable[[], Mapping[str, onnx.TypeProto]] | None = field(
        default=None, repr=False, compare=False)

    def node_at(self, pos: int) -> ir.Node:
        return self.nodes[pos]

    def unbound_shape(self, name: str) -> tuple[Dim, ...] | None:
        """The shape of ``name`` that holds at every binding of the symbolic dims: what a
        rewritten model may declare. ``tensors[name].shape`` is its shape at the dims bound
        for the analysis (``seq`` = 64 gives ``64``); written into the model, ORT would take
        it as fact (``Shape`` folded to it, reshapes baked in: wrong answers at other
        lengths). Each dim is the bound one where shape inference without the binding
        gives the same number, the model's own symbolic name where it gives one, else
        unknown; None (no shape) when that inference does not know the rank."""
        t = self.tensors[name]
        bound = t.shape
        if self.unbound_types is None or bound is None or t.is_initializer:
            return bound
        if _UNBOUND not in self.derived:
            self.derived[_UNBOUND] = self.unbound_types()
        tp = self.derived[_UNBOUND].get(name)
        shape = _shape_of(tp)[1] if tp is not None else None
        if shape is None or len(shape) != len(bound):
            return None
        return tuple(u if isinstance(u, str) or u == b else None
                     for u, b in zip(shape, bound, strict=True))

    def last_use(self, name: str) -> int | None:
        t = self.tensors[name]
        uses = t.consumers + t.implicit_consumers
        return max(uses) if uses else None


def input_names(node: ir.Node) -> list[str]:
    """Names of ``node``'s inputs, ``""`` for an omitted optional one (as in a NodeProto)."""
    return [v.name or "" if v is not None else "" for v in node.inputs]


def output_names(node: ir.Node) -> list[str]:
    return [v.name or "" for v in node.outputs]


# A node's attributes are an ``onnx_ir`` ``Attributes``, a ``collections.UserDict``: walking
# it goes through Python-level ``__iter__``/``__getitem__``; these per-node walks read its
# plain ``dict`` (``UserDict.data``), 2-3x faster over a whole graph.
_GRAPH, _GRAPHS = ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS


def attribute_values(node: ir.Node) -> dict[str, Any]:
    """Attribute name -> Python value (ints, floats, strings, lists; tensors as ir tensors)."""
    return {k: a.value for k, a in node.attributes.data.items()}


def subgraphs(node: ir.Node) -> Iterator[ir.Graph]:
    """The graphs ``node``'s attributes hold (If branches, Loop/Scan bodies), not nested."""
    for attr in node.attributes.data.values():
        if attr.type is _GRAPH:
            yield attr.value
        elif attr.type is _GRAPHS:
            yield from attr.value


def subgraph_owners(graph: ir.Graph) -> dict[ir.Graph, ir.Node]:
    """Every graph nested in ``graph``'s nodes (at any depth) -> the node of ``graph`` that
    holds it. Each graph is walked once: its own nodes' subgraphs go on the stack (found by
    hand: walking each popped graph recursively visited a graph at depth d 2^d times, and a
    4 KB model of 30 nested Ifs kept ``inspect`` and ``optimize`` busy for hours)."""
    owners: dict[ir.Graph, ir.Node] = {}
    for node in graph:
        if not node.attributes.data:
            continue
        stack = list(subgraphs(node))
        while stack:
            g = stack.pop()
            owners[g] = node
            stack.extend(s for n in g for s in subgraphs(n))
    return owners


def all_graphs(graph: ir.Graph) -> list[ir.Graph]:
    """``graph`` and every graph nested in it."""
    return [graph, *subgraph_owners(graph)]


def outer_reads(graph: ir.Graph, owners: Mapping[ir.Graph, ir.Node]) -> Iterator[
        tuple[ir.Value, ir.Node]]:
    """(value of the main graph, main-graph node whose subgraph reads it): a use inside a
    subgraph, or a subgraph output that is an outer value."""
    for g, owner in owners.items():
        for node in g:
            for v in node.inputs:
                if v is not None and _defined_in(v, graph):
                    yield v, owner
        for v in g.outputs:
            if _defined_in(v, graph):
                yield v, owner


def _defined_in(v: ir.Value, graph: ir.Graph) -> bool:
    producer = v.producer()
    if producer is not None:
        return producer.graph is graph
    return v.graph is graph


def is_sorted(graph: ir.Graph, owners: Mapping[ir.Graph, ir.Node] | None = None) -> bool:
    """Whether every node of ``graph`` comes after the producers of what it (and its
    subgraphs) reads (``owners``: :func:`subgraph_owners` of ``graph`` when known)."""
    seen: set[ir.Node] = set()
    reads: dict[ir.Node, list[ir.Value]] = {}
    for v, owner in outer_reads(graph, subgraph_owners(graph) if owners is None else owners):
        reads.setdefault(owner, []).append(v)
    for node in graph:
        for v in (*node.inputs, *reads.get(node, ())):
            p = v.producer() if v is not None else None
            if p is not None and p.graph is graph and p not in seen:
                return False
        seen.add(node)
    return True


def sort_graph(graph: ir.Graph, owners: Mapping[ir.Graph, ir.Node] | None = None) -> list[int]:
    """Sort ``graph`` topologically in place (``onnx_ir``'s stable sort) unless it already
    is; the file index of each node in the new order."""
    index = {node: i for i, node in enumerate(graph)}
    if is_sorted(graph, owners):
        return list(range(len(index)))
    try:
        graph.sort()
    except ValueError:
        raise ModelLoadError("the graph has a cycle: no topological order exists") from None
    return [index[node] for node in graph]


# Initializers larger than this keep only their dims in the shape-inference skeleton.
_SKELETON_KEEP_BYTES = 4096


def _skeleton(model: onnx.ModelProto, dims: Mapping[str, int],
              shapes: Mapping[str, Sequence[int]] | None = None) -> onnx.ModelProto:
    """A cheap copy for shape inference: big initializers without bytes, inputs bound
    (``shapes``: whole input shapes)."""
    sk = onnx.ModelProto()
    if model.ByteSize() < (64 << 20):
        sk.CopyFrom(model)
    else:
        _copy_without_big_data(model, sk)
    for t in sk.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL or t.ByteSize() > _SKELETON_KEEP_BYTES:
            _strip(t)
    for vi in sk.graph.input:
        if shapes and vi.name in shapes and vi.type.HasField("tensor_type"):
            vi.type.tensor_type.ClearField("shape")
            for v in shapes[vi.name]:
                vi.type.tensor_type.shape.dim.add().dim_value = int(v)
        elif vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            for d in vi.type.tensor_type.shape.dim:
                if d.HasField("dim_param") and d.dim_param in dims:
                    d.dim_value = dims[d.dim_param]
    return sk


def _strip(t: TensorProto) -> None:
    for f in ("raw_data", "float_data", "int32_data", "int64_data", "double_data",
              "uint64_data", "string_data"):
        t.ClearField(f)
    del t.external_data[:]
    t.data_location = TensorProto.EXTERNAL
    e = t.external_data.add()
    e.key, e.value = "location", "__ho_onnx_stripped__"


def _copy_without_big_data(model: onnx.ModelProto, sk: onnx.ModelProto) -> None:
    graph = model.graph
    big = [t for t in graph.initializer if t.ByteSize() > _SKELETON_KEEP_BYTES]
    saved = []
    for t in big:  # move the payload out, copy, move it back: no second copy of the bytes
        holder = TensorProto()
        holder.CopyFrom(t)
        _strip(t)
        saved.append((t, holder))
    try:
        sk.CopyFrom(model)
    finally:
        for t, holder in saved:
            t.CopyFrom(holder)


# ``model.meta`` key of the file as loaded (graph.load), kept while no pass changed the graph.
SOURCE_PROTO = "ho_onnx.source_proto"


def tool_proto(model: ir.Model) -> onnx.ModelProto:
    """``model`` as a proto, for a tool that reads one (onnx's shape inference and checker,
    ORT's inference): the file as loaded while the graph is as loaded (``meta[SOURCE_PROTO]``,
    dropped by the first pass that changes it: :func:`forget_source`), else a weightless
    serialisation (:func:`_weightless_proto`)."""
    proto = model.meta.get(SOURCE_PROTO)
    return proto if proto is not None else _weightless_proto(model)


def forget_source(model: ir.Model) -> None:
    """The graph of ``model`` changes: :func:`tool_proto` serialises it from now on."""
    model.meta.pop(SOURCE_PROTO, None)


def _weightless_proto(model: ir.Model) -> onnx.ModelProto:
    """``model`` as a proto without the bytes of its big inline initializers (external ones
    serialise as references): what shape inference and ORT's tools read."""
    graph = model.graph
    held: list[tuple[ir.Value, ir.TensorProtocol]] = []
    for v in graph.initializers.values():
        t = v.const_value
        if t is not None and not isinstance(t, ir.ExternalTensor) and t.nbytes > (
                _SKELETON_KEEP_BYTES):
            held.append((v, t))
            v.const_value = ir.ExternalTensor("__ho_onnx_stripped__", 0, t.nbytes, t.dtype,
                                              shape=t.shape, name=v.name)
    try:
        return ir.to_proto(model)
    finally:
        for v, t in held:
            v.const_value = t


def _shape_of(tp: onnx.TypeProto) -> tuple[int | None, tuple[Dim, ...] | None]:
    if not tp.HasField("tensor_type"):
        return None, None
    tt = tp.tensor_type
    elem = tt.elem_type or None
    if not tt.HasField("shape"):
        return elem, None
    shape: list[Dim] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            shape.append(d.dim_value)
        elif d.HasField("dim_param") and d.dim_param and not d.dim_param.startswith("unk__"):
            shape.append(d.dim_param)  # (unk__N: invented by shape inference, not bindable)
        else:
            shape.append(None)
    return elem, tuple(shape)


def _ir_shape_of(v: ir.Value) -> tuple[int | None, tuple[Dim, ...] | None]:
    """Declared element type and shape of a graph input."""
    if not isinstance(v.type, ir.TensorType):
        return None, None
    elem = int(v.type.dtype) or None
    if v.shape is None:
        return elem, None
    shape: list[Dim] = []
    for d in v.shape:
        if isinstance(d, int):
            shape.append(d)
        else:
            name = d.value if isinstance(d, ir.SymbolicDim) else None
            shape.append(name if name and not name.startswith("unk__") else None)
    return elem, tuple(shape)


# Another source of value types (ORT's symbolic shape inference for contrib ops):
# (model, dims, whole input shapes) -> types by value name.
TypeSource = Callable[[onnx.ModelProto, Mapping[str, int], Mapping[str, Sequence[int]]],
                      Mapping[str, onnx.TypeProto]]


def _named(d: onnx.TensorShapeProto.Dimension) -> bool:
    """A dim with a value or a name of the model's (onnx's invented ``unk__N`` tell nothing:
    counted as known, a type ``[256, unk__0]`` kept a fully known ``[256, 256]`` out)."""
    return d.HasField("dim_value") or (bool(d.dim_param)
                                       and not d.dim_param.startswith("unk__"))


def _known(tp: onnx.TypeProto | None) -> int:
    """How much a type tells: -1 nothing, else the number of dims with a value or name."""
    if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return -1
    return sum(1 for d in tp.tensor_type.shape.dim if _named(d))


def _value_types(inferred: onnx.ModelProto, proto: onnx.ModelProto, dims: Mapping[str, int],
                 shapes: Mapping[str, Sequence[int]], more_types: TypeSource | None
                 ) -> dict[str, onnx.TypeProto]:
    """Types of the main graph's values by name: ONNX shape inference's (``inferred``),
    refined by ``more_types`` where it tells more."""
    types: dict[str, onnx.TypeProto] = {}
    for vi in (*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input):
        types[vi.name] = vi.type
    if more_types is not None:
        outputs = [o for n in proto.graph.node for o in n.output if o]
        if any(_known(types.get(o)) < 0 or any(
                not _named(d) for d in types[o].tensor_type.shape.dim) for o in outputs):
            for name, tp in more_types(proto, dims, shapes).items():
                if _known(tp) > _known(types.get(name)):
                    types[name] = tp
    return types


def _tensor_infos(graph: ir.Graph, nodes: Sequence[ir.Node],
                  owners: Mapping[ir.Graph, ir.Node]
                  ) -> tuple[dict[str, TensorInfo], dict[str, ir.Value]]:
    """Roles, producers and uses of the main graph's values, from the use-def chains."""
    tensors: dict[str, TensorInfo] = {}
    values: dict[str, ir.Value] = {}

    def info(v: ir.Value) -> TensorInfo:
        name = v.name or ""
        t = tensors.get(name)
        if t is None:
            t = tensors[name] = TensorInfo(name)
            values[name] = v
        return t

    for v in graph.inputs:
        info(v).is_graph_input = True
    for v in graph.initializers.values():
        t = info(v)
        t.is_initializer = True
        if v.const_value is not None:
            t.elem_type = int(v.const_value.dtype)
            t.shape = tuple(int(d) for d in v.const_value.shape)
    for v in graph.outputs:
        info(v).is_graph_output = True
    position = {node: pos for pos, node in enumerate(nodes)}
    for pos, node in enumerate(nodes):
        for v in node.inputs:  # (a name nothing defines still gets an entry)
            if v is not None and v.name and v.name not in tensors:
                info(v)
        for v in node.outputs:
            if v.name:
                info(v).producer = pos
    for v in list(values.values()):
        t = tensors[v.name or ""]
        t.consumers = sorted({position[u.node] for u in v.uses() if u.node in position})
    for v, owner in outer_reads(graph, owners):
        t = info(v)
        if position[owner] not in t.implicit_consumers:
            t.implicit_consumers.append(position[owner])
    for t in tensors.values():
        t.implicit_consumers.sort()
    return tensors, values


@gc_paused()
def analyse(model: ir.Model | onnx.ModelProto, dims: Mapping[str, int] | None = None, *,
            shapes: Mapping[str, Sequence[int]] | None = None,
            more_types: TypeSource | None = None) -> GraphAnalysis:
    """Run the analyses on ``model`` (an ``onnx_ir`` model; a proto is converted). The main
    graph is sorted topologically in place when it is not; nothing else changes.

    ``dims`` binds symbolic dims, ``shapes`` gives whole input shapes. Shape inference reads
    :func:`tool_proto`. ``more_types`` is asked when onnx's inference leaves a node output
    unknown or partly known (contrib ops): its types win where they tell more."""
    check_bindings(dims, shapes)
    if isinstance(model, onnx.ModelProto):
        proto, model = model, ir.from_proto(model)
    else:
        proto = tool_proto(model)
    dims = dict(dims or {})
    shapes = dict(shapes or {})
    graph = model.graph
    # bounded (.bounded): the worker infers on a weightless skeleton while this sorts and
    # walks the graph (started first: the sort and the walk are what it overlaps)
    pending = start_infer_shapes(_skeleton(proto, dims, shapes))
    try:
        owners = subgraph_owners(graph)  # (sorting keeps every node in its graph)
        order = sort_graph(graph, owners)
        nodes = list(graph)
        tensors, values = _tensor_infos(graph, nodes, owners)
    except BaseException:
        pending.cancel()
        raise
    types = _value_types(pending.result(), proto, dims, shapes, more_types)
    parsed: dict[bytes, tuple[int | None, tuple[Dim, ...] | None]] = {}  # few distinct types
    for name, t in tensors.items():
        if not t.is_initializer and name in types:
            tp = types[name]
            key = tp.SerializeToString()
            if key not in parsed:
                parsed[key] = _shape_of(tp)
            t.elem_type, t.shape = parsed[key]
    for v in graph.inputs:  # declared input types (unbound dims stay symbolic)
        t = tensors[v.name or ""]
        if not t.is_initializer:
            elem, shape = _ir_shape_of(v)
            if elem is not None:
                t.elem_type = elem
            if shape is not None and t.shape is None:
                t.shape = shape
    pair_kv(nodes, tensors)
    unbound = None
    if dims or shapes:  # (nothing bound: ``types`` hold at every binding already)
        unbound = functools.partial(_unbound_types, proto, more_types)
        check_table_reads(nodes, lambda name: t.shape if (t := tensors.get(name)) else None,
                          dims)
    return GraphAnalysis(model=model, nodes=nodes, tensors=tensors, values=values, order=order,
                         owners=owners, unbound_types=unbound)


def _unbound_types(proto: onnx.ModelProto, more_types: TypeSource | None
                   ) -> dict[str, onnx.TypeProto]:
    """The main graph's value types with no dim bound (see :meth:`GraphAnalysis.unbound_shape`)."""
    inferred = start_infer_shapes(_skeleton(proto, {}, {})).result()
    return _value_types(inferred, proto, {}, {}, more_types)


def describe(t: TensorInfo) -> str:
    """``FLOAT[batch,seq,64]`` style description."""
    ty = dtype_name(t.elem_type) if t.elem_type else "?"
    if t.shape is None:
        return f"{ty}[?]"
    return f"{ty}[{','.join('?' if d is None else str(d) for d in t.shape)}]"
