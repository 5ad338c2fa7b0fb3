"""Analyses of the main graph: topological order, tensor types and sizes, lifetimes.

Positions are indices into ``GraphAnalysis.order`` (the schedule the rewriter refines).
Subgraphs (If/Loop/Scan bodies) are not entered: a name they read from the outer scope is
recorded as an *implicit* use of the node that owns them, and such tensors are never
offloaded.
"""

from __future__ import annotations

import ast
import heapq
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx
from onnx import TensorProto

from ..errors import ModelLoadError, UnboundDimError, UnsupportedModelError
from .bounded import infer_shapes
from .dtypes import ELEMENT_BITS, dtype_name, tensor_nbytes

Dim = int | str | None  # a value, a symbolic name, or unknown
# No tensor is larger: sums of the sizes of many tensors stay within int64 (numpy arrays).
MAX_TENSOR_BYTES = 1 << 50  # 1 PiB


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
        numel = 1
        for d in self.shape:
            if isinstance(d, str):
                d = eval_dim(d, dims or {}, self.name)
            if d is None or d < 0:  # unknown, or not a size
                return None
            numel *= d
        assert self.elem_type is not None
        nbytes = tensor_nbytes(self.elem_type, numel)
        if nbytes > MAX_TENSOR_BYTES:
            raise UnsupportedModelError(f"tensor {self.name!r} would have {nbytes} bytes "
                                        "(over 1 PiB): check its shape and the --dim values")
        return nbytes


_DIM_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
            ast.FloorDiv: operator.floordiv, ast.Div: operator.floordiv, ast.Mod: operator.mod}


def eval_dim(dim: str, dims: Mapping[str, int], tensor: str = "?") -> int:
    """Value of a symbolic dim: a bound name, or an arithmetic expression of bound names
    (exporters write dims such as ``seq + 1`` or ``2*batch``).

    Raises :class:`UnboundDimError` naming the first name without a value.
    """
    if dim in dims:
        return int(dims[dim])
    try:
        tree = ast.parse(dim, mode="eval")
    except SyntaxError:
        tree = None

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in dims:
                raise UnboundDimError(
                    f"tensor {tensor!r} has symbolic dimension {node.id!r}"
                    + (f" (in {dim!r})" if node.id != dim else "")
                    + f" with no value: pass --dim {node.id}=N"
                )
            return int(dims[node.id])
        if isinstance(node, ast.BinOp) and type(node.op) in _DIM_OPS:
            return _DIM_OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(dim)

    if tree is not None:
        try:
            return ev(tree)
        except (ValueError, ZeroDivisionError):
            pass
    raise UnboundDimError(
        f"tensor {tensor!r} has symbolic dimension {dim!r} with no value: pass --dim {dim}=N"
    )


@dataclass
class GraphAnalysis:
    """Order, tensors and lifetimes of a model's main graph."""

    model: onnx.ModelProto
    order: list[int]  # node indices of model.graph.node in schedule order
    tensors: dict[str, TensorInfo]
    # Facts later passes derive from this analysis once and share (e.g. the CUDA placement).
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def nodes(self) -> list[onnx.NodeProto]:
        return [self.model.graph.node[i] for i in self.order]

    def node_at(self, pos: int) -> onnx.NodeProto:
        return self.model.graph.node[self.order[pos]]

    def last_use(self, name: str) -> int | None:
        t = self.tensors[name]
        uses = t.consumers + t.implicit_consumers
        return max(uses) if uses else None


def subgraph_outer_names(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs read from enclosing scopes."""
    names: set[str] = set()
    for attr in node.attribute:
        graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for g in graphs:
            names |= _free_names(g)
    return names


def _free_names(graph: onnx.GraphProto) -> set[str]:
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.values.name for t in graph.sparse_initializer}
    free: set[str] = set()
    for node in graph.node:
        for name in node.input:
            if name and name not in defined:
                free.add(name)
        free |= {n for n in subgraph_outer_names(node) if n not in defined}
        defined.update(o for o in node.output if o)
    free |= {o.name for o in graph.output if o.name not in defined}
    return free


def kahn_order(deps: list[set[int]]) -> list[int]:
    """Kahn's algorithm over nodes ``0..n-1`` (``deps[i]``: the nodes ``i`` needs first),
    lowest index first among the ready ones; shorter than ``n`` when there is a cycle."""
    users: dict[int, list[int]] = {}
    for i, d in enumerate(deps):
        for j in d:
            users.setdefault(j, []).append(i)
    indeg = [len(d) for d in deps]
    heap = [i for i, k in enumerate(indeg) if k == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        i = heapq.heappop(heap)
        order.append(i)
        for u in users.get(i, ()):
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(heap, u)
    return order


def topological_order(graph: onnx.GraphProto) -> list[int]:
    """The file's node order if it is topological, else a stable Kahn order."""
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    available |= {t.values.name for t in graph.sparse_initializer}
    available.add("")
    needs = [
        [n for n in list(node.input) + sorted(subgraph_outer_names(node)) if n]
        for node in graph.node
    ]
    produced_by = {o: i for i, node in enumerate(graph.node) for o in node.output if o}
    ok = True
    seen = set(available)
    for i, node in enumerate(graph.node):
        if any(n not in seen and n in produced_by for n in needs[i]):
            ok = False
            break
        seen.update(node.output)
    if ok:
        return list(range(len(graph.node)))
    order = kahn_order([{produced_by[n] for n in needs[i] if n in produced_by}
                        for i in range(len(needs))])
    if len(order) != len(graph.node):
        raise ModelLoadError("the graph has a cycle: no topological order exists")
    return order


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


# Another source of value types (ORT's symbolic shape inference for contrib ops):
# (model, dims, whole input shapes) -> types by value name.
TypeSource = Callable[[onnx.ModelProto, Mapping[str, int], Mapping[str, Sequence[int]]],
                      Mapping[str, onnx.TypeProto]]


def _known(tp: onnx.TypeProto | None) -> int:
    """How much a type tells: -1 nothing, else the number of dims with a value or name."""
    if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return -1
    return sum(1 for d in tp.tensor_type.shape.dim if d.HasField("dim_value") or d.dim_param)


def analyse(model: onnx.ModelProto, dims: Mapping[str, int] | None = None, *,
            shapes: Mapping[str, Sequence[int]] | None = None,
            more_types: TypeSource | None = None) -> GraphAnalysis:
    """Run the analyses on ``model`` (not modified); ``dims`` binds symbolic dims,
    ``shapes`` gives whole input shapes. ``more_types`` is asked when onnx's inference
    leaves a node output unknown or partly known (contrib ops): its types win where they
    tell more."""
    dims = dict(dims or {})
    shapes = dict(shapes or {})
    graph = model.graph
    order = topological_order(graph)
    sk = _skeleton(model, dims, shapes)
    inferred = infer_shapes(sk)  # best effort, bounded in memory and time (.bounded)
    types: dict[str, onnx.TypeProto] = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output) + list(
        inferred.graph.input
    ):
        types[vi.name] = vi.type
    if more_types is not None:
        outputs = [o for n in graph.node for o in n.output if o]
        if any(_known(types.get(o)) < 0 or any(
                not (d.HasField("dim_value") or d.dim_param)
                for d in types[o].tensor_type.shape.dim) for o in outputs):
            for name, tp in more_types(model, dims, shapes).items():
                if _known(tp) > _known(types.get(name)):
                    types[name] = tp

    tensors: dict[str, TensorInfo] = {}

    def info(name: str) -> TensorInfo:
        if name not in tensors:
            tensors[name] = TensorInfo(name)
        return tensors[name]

    for vi in graph.input:
        t = info(vi.name)
        t.is_graph_input = True
    for init in graph.initializer:
        t = info(init.name)
        t.is_initializer = True
        t.elem_type = init.data_type
        t.shape = tuple(int(d) for d in init.dims)
    for vi in graph.output:
        info(vi.name).is_graph_output = True
    for pos, idx in enumerate(order):
        node = graph.node[idx]
        for name in dict.fromkeys(n for n in node.input if n):
            info(name).consumers.append(pos)
        for name in subgraph_outer_names(node):
            info(name).implicit_consumers.append(pos)
        for name in node.output:
            if name:
                info(name).producer = pos
    for name, t in tensors.items():
        if t.is_initializer:
            continue
        if name in types:
            elem, shape = _shape_of(types[name])
            t.elem_type, t.shape = elem, shape
    for vi in graph.input:  # declared input types (unbound dims stay symbolic)
        t = tensors[vi.name]
        if not t.is_initializer:
            elem, shape = _shape_of(vi.type)
            if elem is not None:
                t.elem_type = elem
            if shape is not None and t.shape is None:
                t.shape = shape
    return GraphAnalysis(model=model, order=order, tensors=tensors)


def describe(t: TensorInfo) -> str:
    """``FLOAT[batch,seq,64]`` style description."""
    ty = dtype_name(t.elem_type) if t.elem_type else "?"
    if t.shape is None:
        return f"{ty}[?]"
    return f"{ty}[{','.join('?' if d is None else str(d) for d in t.shape)}]"
