"""Insert the cache operators for an :class:`OffloadChoice` and write the refined order.

The schedule is expressed twice: as node order in the file (what ORT's PRIORITY_BASED
order follows) and as ordering inputs (``deps``) that keep it correct under any order.
See docs/design.md, "Schedule in the graph".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from . import ops
from .analysis import GraphAnalysis, TensorInfo
from .choice import OffloadChoice
from .loader import dtype_name, iter_graphs


@dataclass
class RewrittenModel:
    """The rewritten model and what the save pass still has to place.

    ``weights`` are the initializers that left the graph (with their original data
    reference or inline bytes); ``weight_prefetches`` the names of the Prefetch nodes that
    read each one, whose ``location``/``offset``/``length``/``base_dir`` attributes the save
    pass sets.
    """

    model: onnx.ModelProto
    weights: dict[str, TensorProto] = field(default_factory=dict)
    weight_prefetches: dict[str, list[str]] = field(default_factory=dict)
    cache_nodes: int = 0


class _Names:
    """Fresh tensor/node names that clash with nothing in any scope."""

    def __init__(self, model: onnx.ModelProto) -> None:
        used: set[str] = set()
        for g in iter_graphs(model.graph):
            used.update(i.name for i in g.input)
            used.update(o.name for o in g.output)
            used.update(t.name for t in g.initializer)
            used.update(v.name for v in g.value_info)
            for n in g.node:
                used.update(n.input)
                used.update(n.output)
                used.add(n.name)
        self.used = used

    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.used:
            k += 1
            name = f"{base}.{k}"
        self.used.add(name)
        return name


def token_elems(elem_type: int) -> int:
    """Elements of a 16-byte token of element type ``elem_type``."""
    from .loader import ELEMENT_BITS

    return (128 + ELEMENT_BITS[elem_type] - 1) // ELEMENT_BITS[elem_type]


class _Emitter:
    """Builds the cache nodes of one rewrite."""

    def __init__(self, analysis: GraphAnalysis, names: _Names) -> None:
        self.analysis = analysis
        self.names = names
        self.value_info: list[onnx.ValueInfoProto] = []
        self.sources: dict[int, str] = {}  # elem type -> name of its empty source initializer
        self.new_initializers: list[TensorProto] = []

    def dep_before(self, pos: int, floor: int = -1) -> list[str]:
        """An output of the latest node at a position < ``pos`` (and > ``floor``)."""
        for p in range(pos - 1, floor, -1):
            for out in self.analysis.node_at(p).output:
                t = self.analysis.tensors.get(out)
                if out and t is not None and t.elem_type is not None:
                    return [out]
        return []

    def source(self, elem_type: int) -> str:
        if elem_type not in self.sources:
            name = self.names.fresh(f"ho_onnx.src.{dtype_name(elem_type)}")
            t = TensorProto(name=name, data_type=elem_type, dims=[0])
            self.new_initializers.append(t)
            self.sources[elem_type] = name
        return self.sources[elem_type]

    def like(self, name: str, t: TensorInfo) -> None:
        """Declare ``name`` with ``t``'s type and shape (helps ORT's shape-based fusions)."""
        assert t.elem_type is not None
        shape = None if t.shape is None else [d if d is not None else None for d in t.shape]
        self.value_info.append(helper.make_tensor_value_info(name, t.elem_type, shape))

    def node(self, op: str, inputs: Iterable[str], outputs: list[str], node_name: str,
             **attrs: object) -> onnx.NodeProto:
        node = helper.make_node(op, list(inputs), outputs, name=self.names.fresh(node_name),
                                domain=ops.DOMAIN)
        for k, v in attrs.items():  # lists are ints (a scalar weight's shape is empty)
            node.attribute.append(helper.make_attribute(
                k, v, attr_type=onnx.AttributeProto.INTS if isinstance(v, list) else None))
        return node


def insert_cache_ops(analysis: GraphAnalysis, choice: OffloadChoice) -> RewrittenModel:
    """A new model in which ``choice``'s tensors are offloaded (``analysis.model`` unchanged)."""
    src = analysis.model
    model = _model_without_graph(src)
    model.graph.CopyFrom(_graph_without_nodes_and_inits(src.graph))

    names = _Names(src)
    em = _Emitter(analysis, names)
    n = len(analysis.order)
    before_pf: list[list[onnx.NodeProto]] = [[] for _ in range(n)]
    before_wait: list[list[onnx.NodeProto]] = [[] for _ in range(n)]
    after: list[list[onnx.NodeProto]] = [[] for _ in range(n)]
    rename: dict[int, dict[str, str]] = {}  # position -> {old input name: new}
    replace: dict[int, onnx.NodeProto] = {}  # position -> node that takes its place
    result = RewrittenModel(model)
    offloaded = {w.name for w in choice.weights}

    for w in choice.weights:
        t = analysis.tensors[w.name]
        assert t.elem_type is not None and t.shape is not None
        result.weight_prefetches[w.name] = []
        for c in w.shape_readers:
            replace[c] = shape_constant(analysis.node_at(c), [int(x) for x in t.shape])
        for k, (c, s) in enumerate(zip(w.consumers, w.prefetch_at, strict=True)):
            y = names.fresh(f"{w.name}.ho_y{k}")
            z = names.fresh(f"{w.name}.ho_z{k}")
            pf_deps = em.dep_before(s) or _first_graph_input(analysis)
            attrs: dict[str, object] = {"shape": [int(x) for x in t.shape], "name": w.name}
            if w.tier != "host":
                attrs[ops.ATTR_TIER] = w.tier
            pf = em.node(ops.PREFETCH, [em.source(t.elem_type), *pf_deps], [y],
                         f"ho.prefetch.{w.name}.{k}", **attrs)
            wait = em.node(ops.WAIT, [y, *em.dep_before(c, floor=s - 1)], [z],
                           f"ho.wait.{w.name}.{k}")
            before_pf[s].append(pf)
            before_wait[c].append(wait)
            em.like(y, t)
            em.like(z, t)
            rename.setdefault(c, {})[w.name] = z
            result.weight_prefetches[w.name].append(pf.name)

    ring = stored_peak_bytes(choice)
    for a in choice.activations:
        t = analysis.tensors[a.name]
        assert t.elem_type is not None
        token = names.fresh(f"{a.name}.ho_token")
        token2 = names.fresh(f"{a.name}.ho_detached")
        y = names.fresh(f"{a.name}.ho_y")
        z = names.fresh(f"{a.name}.ho_z")
        store = em.node(ops.STORE, [a.name], [token], f"ho.store.{a.name}",
                        **{ops.ATTR_HOST_BYTES: ring})
        last_early = a.last_early
        det_deps = em.dep_before(last_early + 1, floor=a.producer) if a.early else []
        detach = em.node(ops.DETACH, [a.name, token, *det_deps], [token2],
                         f"ho.detach.{a.name}")
        u, s = a.late[0], a.prefetch_at
        pf = em.node(ops.PREFETCH, [token2, *em.dep_before(s, floor=last_early)], [y],
                     f"ho.prefetch.{a.name}")
        wait = em.node(ops.WAIT, [y, *em.dep_before(u, floor=s - 1)], [z],
                       f"ho.wait.{a.name}")
        after[a.producer].append(store)
        after[last_early].append(detach)
        before_pf[s].append(pf)
        before_wait[u].append(wait)
        for name in (token, token2):
            em.value_info.append(
                helper.make_tensor_value_info(name, t.elem_type, [token_elems(t.elem_type)])
            )
        em.like(y, t)
        em.like(z, t)
        for c in a.late:
            rename.setdefault(c, {})[a.name] = z

    new_nodes: list[onnx.NodeProto] = []
    for pos in range(n):
        new_nodes.extend(before_pf[pos])
        new_nodes.extend(before_wait[pos])
        node = onnx.NodeProto()
        node.CopyFrom(replace.get(pos, analysis.node_at(pos)))
        for i, name in enumerate(node.input):
            if name in rename.get(pos, {}):
                node.input[i] = rename[pos][name]
        new_nodes.append(node)
        # Stores first (start copying early), detaches after (end residency).
        new_nodes.extend(sorted(after[pos], key=lambda x: x.op_type != ops.STORE))

    g = model.graph
    g.node.extend(new_nodes)
    for init in src.graph.initializer:
        if init.name in offloaded:
            result.weights[init.name] = init
        else:
            g.initializer.append(init)
    g.initializer.extend(em.new_initializers)
    g.value_info.extend(v for v in src.graph.value_info if v.name not in offloaded)
    g.value_info.extend(em.value_info)
    if not any(o.domain == ops.DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(ops.DOMAIN, ops.OPSET_VERSION))
    result.cache_nodes = len(new_nodes) - n
    return result


def stored_peak_bytes(choice: OffloadChoice) -> int:
    """Most bytes of stored activations held at once (each from its producer to its last
    late reader); unknown sizes count 0."""
    events: list[tuple[int, int]] = []
    for a in choice.activations:
        events.append((a.producer, a.nbytes or 0))
        events.append((max(a.late) + 1, -(a.nbytes or 0)))
    peak = cur = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        cur += delta
        peak = max(peak, cur)
    return peak


def shape_constant(node: onnx.NodeProto, dims: list[int]) -> onnx.NodeProto:
    """A Constant node with what ``node`` (Shape with start/end, or Size) computes from a
    tensor of static shape ``dims``: an offloaded weight's shape needs no transfer."""
    if node.op_type == "Size":
        value = helper.make_tensor("value", TensorProto.INT64, [], [int(np.prod(dims))])
    else:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        rank = len(dims)
        start, end = int(attrs.get("start", 0)), int(attrs.get("end", rank))
        start = min(max(start + rank if start < 0 else start, 0), rank)
        end = min(max(end + rank if end < 0 else end, 0), rank)
        picked = dims[start:end]
        value = helper.make_tensor("value", TensorProto.INT64, [len(picked)], picked)
    return helper.make_node("Constant", [], list(node.output), name=node.name, value=value)


def _first_graph_input(analysis: GraphAnalysis) -> list[str]:
    """A graph input to order a prefetch at the very start after (keeps ORT from folding it)."""
    inits = {t.name for t in analysis.model.graph.initializer}
    for vi in analysis.model.graph.input:
        t = analysis.tensors.get(vi.name)
        if vi.name not in inits and t is not None and t.elem_type is not None:
            return [vi.name]
    return []


def _model_without_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every top-level field of ``model`` but its graph."""
    m = onnx.ModelProto()
    for fd, value in model.ListFields():
        if fd.name == "graph":
            continue
        if fd.is_repeated:
            getattr(m, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(m, fd.name).CopyFrom(value)
        else:
            setattr(m, fd.name, value)
    return m


def _graph_without_nodes_and_inits(graph: onnx.GraphProto) -> onnx.GraphProto:
    g = onnx.GraphProto()
    g.name = graph.name
    g.doc_string = graph.doc_string
    g.input.extend(graph.input)
    g.output.extend(graph.output)
    g.sparse_initializer.extend(graph.sparse_initializer)
    g.metadata_props.extend(graph.metadata_props)
    g.quantization_annotation.extend(graph.quantization_annotation)
    return g
