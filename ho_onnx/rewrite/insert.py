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

from .. import contract
from ..graph.analyse import GraphAnalysis, TensorInfo
from ..graph.dtypes import ELEMENT_BITS, dtype_name
from ..graph.protos import graph_shell, iter_graphs
from ..schedule.eligibility import cuda_host_tensors
from ..schedule.lifetimes import stored_peak_bytes
from ..schedule.types import ActivationOffload, OffloadChoice, WeightOffload


@dataclass
class RewrittenModel:
    """The rewritten model and the weights whose bytes the data-placement pass still lays out.

    ``weights`` are the initializers that left the graph (with their original data
    reference or inline bytes); ``weight_prefetches`` the positions in ``model.graph.node``
    of the Prefetch nodes that read each one (their ``location``/``offset``/``length``/
    ``base_dir`` attributes are set by :func:`ho_onnx.rewrite.place.place_weight_data`).
    """

    model: onnx.ModelProto
    weights: dict[str, TensorProto] = field(default_factory=dict)
    weight_prefetches: dict[str, list[int]] = field(default_factory=dict)
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
    return (128 + ELEMENT_BITS[elem_type] - 1) // ELEMENT_BITS[elem_type]


class _Emitter:
    """Builds the cache nodes of one rewrite."""

    def __init__(self, analysis: GraphAnalysis, names: _Names) -> None:
        self.analysis = analysis
        self.names = names
        # Never an ordering input: a tensor in host memory on the CUDA EP would pull the
        # cache op to the CPU EP (ORT's CPU fallback; docs/cuda.md "Placement").
        self.host = cuda_host_tensors(analysis)
        self.value_info: list[onnx.ValueInfoProto] = []
        self.sources: dict[int, str] = {}  # elem type -> name of its empty source initializer
        self.new_initializers: list[TensorProto] = []
        n = len(analysis.order)
        # Cache nodes by the position they are written at (see :meth:`schedule`).
        self.before_pf: list[list[onnx.NodeProto]] = [[] for _ in range(n)]
        self.before_wait: list[list[onnx.NodeProto]] = [[] for _ in range(n)]
        self.after: list[list[onnx.NodeProto]] = [[] for _ in range(n)]
        self.rename: dict[int, dict[str, str]] = {}  # position -> {old input name: new}
        self.replace: dict[int, onnx.NodeProto] = {}  # position -> node that takes its place
        self.weight_prefetches: dict[str, list[onnx.NodeProto]] = {}
        self.elem_types: dict[str, int] = {}  # of the values declared with :meth:`like`

    def dep_before(self, pos: int, floor: int = -1) -> list[str]:
        """An output of the latest node at a position < ``pos`` (and > ``floor``)."""
        for p in range(pos - 1, floor, -1):
            for out in self.analysis.node_at(p).output:
                t = self.analysis.tensors.get(out)
                if out and t is not None and t.elem_type is not None and out not in self.host:
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
        self.elem_types[name] = t.elem_type
        shape = None if t.shape is None else [d if d is not None else None for d in t.shape]
        self.value_info.append(helper.make_tensor_value_info(name, t.elem_type, shape))

    def node(self, op: str, inputs: Iterable[str], outputs: list[str], node_name: str,
             **attrs: object) -> onnx.NodeProto:
        node = helper.make_node(op, list(inputs), outputs, name=self.names.fresh(node_name),
                                domain=contract.DOMAIN)
        for k, v in attrs.items():  # lists are ints (a scalar weight's shape is empty)
            node.attribute.append(helper.make_attribute(
                k, v, attr_type=onnx.AttributeProto.INTS if isinstance(v, list) else None))
        return node

    def schedule(self) -> list[onnx.NodeProto]:
        """The refined order: before each compute node its Prefetches, then its Waits; after
        it its Stores (start copying early), then its Detaches (end residency)."""
        nodes: list[onnx.NodeProto] = []
        for pos in range(len(self.analysis.order)):
            nodes.extend(self.before_pf[pos])
            nodes.extend(self.before_wait[pos])
            node = onnx.NodeProto()
            node.CopyFrom(self.replace.get(pos, self.analysis.node_at(pos)))
            for i, name in enumerate(node.input):
                if name in self.rename.get(pos, {}):
                    node.input[i] = self.rename[pos][name]
            nodes.append(node)
            nodes.extend(sorted(self.after[pos], key=lambda x: x.op_type != contract.STORE))
        return nodes

    def chain_channels(self, nodes: list[onnx.NodeProto]) -> None:
        """Each Prefetch on a channel waits for the previous one's ``issued`` output (a
        zero-size tensor): the issue order is the file's, FIFO per channel as the simulator
        assumes, under any execution order (docs/design.md, "Schedule in the graph")."""
        last: dict[str, onnx.NodeProto] = {}
        for node in nodes:
            if node.domain != contract.DOMAIN or node.op_type != contract.PREFETCH:
                continue
            channel = prefetch_channel(node)
            prev = last.get(channel)
            if prev is not None:
                if len(prev.output) < 2:
                    issued = self.names.fresh(f"{prev.output[0]}.issued")
                    prev.output.append(issued)
                    elem = self.elem_types[prev.output[0]]
                    self.value_info.append(helper.make_tensor_value_info(issued, elem, [0]))
                node.input.append(prev.output[1])
            last[channel] = node

    def offload_weight(self, w: WeightOffload) -> None:
        """Prefetch/Wait pairs before each data reader of ``w``; shape readers become
        constants."""
        t = self.analysis.tensors[w.name]
        assert t.elem_type is not None and t.shape is not None
        self.weight_prefetches[w.name] = []
        for c in w.shape_readers:
            self.replace[c] = shape_constant(self.analysis.node_at(c), [int(x) for x in t.shape])
        for k, (c, s) in enumerate(zip(w.consumers, w.prefetch_at, strict=True)):
            y = self.names.fresh(f"{w.name}.ho_y{k}")
            z = self.names.fresh(f"{w.name}.ho_z{k}")
            # A Prefetch with only constant inputs would be folded by ORT: at the very start
            # it is ordered after a graph input.
            pf_deps = self.dep_before(s) or _first_graph_input(self.analysis)
            attrs: dict[str, object] = {"shape": [int(x) for x in t.shape], "name": w.name}
            if w.tier != "host":
                attrs[contract.ATTR_TIER] = w.tier
            pf = self.node(contract.PREFETCH, [self.source(t.elem_type), *pf_deps], [y],
                           f"ho.prefetch.{w.name}.{k}", **attrs)
            wait = self.node(contract.WAIT, [y, *self.dep_before(c, floor=s - 1)], [z],
                             f"ho.wait.{w.name}.{k}")
            self.before_pf[s].append(pf)
            self.before_wait[c].append(wait)
            self.like(y, t)
            self.like(z, t)
            self.rename.setdefault(c, {})[w.name] = z
            self.weight_prefetches[w.name].append(pf)

    def offload_activation(self, a: ActivationOffload, ring: int) -> None:
        """Store after the producer, Detach after the early uses, Prefetch/Wait before the
        late ones (``ring``: the stored peak, recorded on every Store)."""
        t = self.analysis.tensors[a.name]
        assert t.elem_type is not None
        token, token2, y, z = (self.names.fresh(f"{a.name}.ho_{s}")
                               for s in ("token", "detached", "y", "z"))
        store = self.node(contract.STORE, [a.name], [token], f"ho.store.{a.name}",
                          **{contract.ATTR_HOST_BYTES: ring})
        det_deps = self.dep_before(a.last_early + 1, floor=a.producer) if a.early else []
        detach = self.node(contract.DETACH, [a.name, token, *det_deps], [token2],
                           f"ho.detach.{a.name}")
        u, s = a.late[0], a.prefetch_at
        pf = self.node(contract.PREFETCH, [token2, *self.dep_before(s, floor=a.last_early)], [y],
                       f"ho.prefetch.{a.name}")
        wait = self.node(contract.WAIT, [y, *self.dep_before(u, floor=s - 1)], [z],
                         f"ho.wait.{a.name}")
        self.after[a.producer].append(store)
        self.after[a.last_early].append(detach)
        self.before_pf[s].append(pf)
        self.before_wait[u].append(wait)
        for name in (token, token2):
            self.value_info.append(
                helper.make_tensor_value_info(name, t.elem_type, [token_elems(t.elem_type)]))
        self.like(y, t)
        self.like(z, t)
        for c in a.late:
            self.rename.setdefault(c, {})[a.name] = z


def insert_cache_ops(analysis: GraphAnalysis, choice: OffloadChoice) -> RewrittenModel:
    """A new model in which ``choice``'s tensors are offloaded (``analysis.model`` unchanged)."""
    src = analysis.model
    model = _model_without_graph(src)
    model.graph.CopyFrom(graph_shell(src.graph))
    em = _Emitter(analysis, _Names(src))
    for w in choice.weights:
        em.offload_weight(w)
    ring = stored_peak_bytes(choice)
    for a in choice.activations:
        em.offload_activation(a, ring)
    new_nodes = em.schedule()
    em.chain_channels(new_nodes)
    result = RewrittenModel(model, cache_nodes=len(new_nodes) - len(analysis.order))
    index = {id(node): i for i, node in enumerate(new_nodes)}
    result.weight_prefetches = {name: [index[id(pf)] for pf in pfs]
                                for name, pfs in em.weight_prefetches.items()}
    g = model.graph
    g.node.extend(new_nodes)
    offloaded = {w.name for w in choice.weights}
    for init in src.graph.initializer:
        if init.name in offloaded:
            result.weights[init.name] = init
        else:
            g.initializer.append(init)
    g.initializer.extend(em.new_initializers)
    g.value_info.extend(v for v in src.graph.value_info if v.name not in offloaded)
    g.value_info.extend(em.value_info)
    if not any(o.domain == contract.DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(contract.DOMAIN, contract.OPSET_VERSION))
    return result


def prefetch_channel(node: onnx.NodeProto) -> str:
    """The copy channel a Prefetch's transfer queues on: ``"disk"`` for a disk-tier weight,
    ``"load"`` (host to device) for a host-tier weight or a stored activation."""
    for a in node.attribute:
        if a.name == contract.ATTR_TIER and a.s.decode() == "disk":
            return "disk"
    return "load"


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
