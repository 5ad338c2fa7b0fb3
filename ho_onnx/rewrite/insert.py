"""Insert the cache operators for an :class:`OffloadChoice` and write the refined order.

Works in place on the analysed ``onnx_ir`` model: new nodes are inserted around the compute
nodes, readers are rewired through the use-def chains, offloaded weights leave the
initializers. The schedule is expressed twice: as node order in the file (what ORT's
PRIORITY_BASED order follows) and as ordering inputs (``deps``) that keep it correct under
any order. See docs/design.md, "Schedule in the graph".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto

from .. import contract, kinds
from ..graph.analyse import (
    GraphAnalysis,
    TensorInfo,
    all_graphs,
    attribute_values,
    forget_source,
    subgraphs,
)
from ..graph.dtypes import ELEMENT_BITS, dtype_name
from ..graph.gcpause import gc_paused
from ..schedule.decode_cache import reloads
from ..schedule.eligibility import cuda_host_tensors
from ..schedule.expert_cache import cacheable
from ..schedule.lifetimes import stored_peak_bytes
from ..schedule.types import (
    ActivationOffload,
    DecodeCache,
    InputOffload,
    OffloadChoice,
    OutputOffload,
    Recompute,
    Speculation,
    WeightOffload,
)


@dataclass
class RewrittenModel:
    """The rewritten model and the weights whose bytes the data-placement pass still lays out.

    ``weights`` are the initializers that left the graph (their values keep the original
    external reference or inline tensor as ``const_value``); ``weight_prefetches`` the
    Prefetch nodes that read each one (their ``location``/``offset``/``length`` attributes
    are set by :func:`ho_onnx.rewrite.place.place_weight_data`).
    """

    model: ir.Model
    weights: dict[str, ir.Value] = field(default_factory=dict)
    weight_prefetches: dict[str, list[ir.Node]] = field(default_factory=dict)
    cache_nodes: int = 0


class Names:
    """Fresh value/node names that clash with nothing in any scope of ``graph``."""

    def __init__(self, graph: ir.Graph) -> None:
        used: set[str] = set()
        for g in all_graphs(graph):  # (values a node reads but nothing defines too)
            used.update(v.name for v in (*g.inputs, *g.outputs) if v.name)
            used.update(g.initializers)
            for n in g:
                used.update(v.name for v in (*n.inputs, *n.outputs) if v is not None and v.name)
                if n.name:
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


_Out = tuple[str, int, list[int | str | None] | None]  # (name, element type, shape)


@dataclass
class _Op:
    """A cache op to build: inputs by value name, outputs with their declared types."""

    op: str
    inputs: list[str]
    outputs: list[_Out]
    name: str
    attrs: list[ir.Attr]
    channel: str | None = None  # a Prefetch's copy channel
    domain: str = contract.DOMAIN  # (a speculation's MatMul, Add, TopK: the default domain)


def _token(name: str, elem_type: int) -> _Out:
    return name, elem_type, [token_elems(elem_type)]


class _Emitter:
    """Decides the cache ops of one rewrite by schedule position, then builds them."""

    def __init__(self, analysis: GraphAnalysis, names: Names) -> None:
        self.analysis = analysis
        self.names = names
        # Never an ordering input: a tensor in host memory on the CUDA EP would pull the
        # cache op to the CPU EP (ORT's CPU fallback; docs/cuda.md "Placement").
        self.host = cuda_host_tensors(analysis)
        self.sources: dict[int, str] = {}  # elem type -> name of its empty source initializer
        n = len(analysis.nodes)
        # Cache ops by the position they are written at (see :meth:`apply`).
        self.before_pf: list[list[_Op]] = [[] for _ in range(n)]
        self.before_wait: list[list[_Op]] = [[] for _ in range(n)]
        self.after: list[list[_Op]] = [[] for _ in range(n)]
        self.rename: dict[int, dict[str, str]] = {}  # position -> {old input name: new}
        self.replace: dict[int, list[int]] = {}  # position -> dims of the Shape/Size it reads
        self.weight_prefetches: dict[str, list[_Op]] = {}
        self.emitted: dict[str, str] = {}  # graph output -> new name of its producer's value
        # position of a reader replaced by an op reading the host store in place -> that op
        # (a row Gather's GatherRows, an expert MatMul's HostMatMul)
        self.rows: dict[int, _Op] = {}
        # (weight, reload) -> the empty outputs of the warm Prefetches a speculation made for
        # it, ordering inputs of its routed Prefetch (schedule.speculate)
        self.warmed: dict[tuple[str, int], list[str]] = {}
        self.spec_matmuls: list[tuple[_Op, int]] = []  # (MatMul, its position): see rewire

    def dep_before(self, pos: int, floor: int = -1) -> list[str]:
        """An output of the latest node at a position < ``pos`` (and > ``floor``)."""
        for p in range(pos - 1, floor, -1):
            for v in self.analysis.nodes[p].outputs:
                out = v.name
                t = self.analysis.tensors.get(out) if out else None
                if t is not None and t.elem_type is not None and out not in self.host:
                    return [out]
        return []

    def like(self, name: str, t: TensorInfo) -> _Out:
        """``name`` declared with ``t``'s type and the shape it has at every binding of the
        symbolic dims (it helps ORT's shape-based fusions; a bound dim written here would
        be taken by ORT as fact at every other length: ``Shape`` folded, reshapes baked
        in)."""
        assert t.elem_type is not None
        shape = self.analysis.unbound_shape(t.name)
        return name, t.elem_type, None if shape is None else list(shape)

    def source(self, elem_type: int) -> str:
        if elem_type not in self.sources:
            self.sources[elem_type] = self.names.fresh(f"ho_onnx.src.{dtype_name(elem_type)}")
        return self.sources[elem_type]

    def op(self, op: str, inputs: Iterable[str], outputs: list[_Out], node_name: str,
           *attrs: ir.Attr, channel: str | None = None, domain: str = contract.DOMAIN) -> _Op:
        return _Op(op, list(inputs), outputs, self.names.fresh(node_name), list(attrs), channel,
                   domain)

    @staticmethod
    def weight_attrs(w: WeightOffload, t: TensorInfo) -> list[ir.Attr]:
        """The attributes every op reading ``w``'s bytes carries: its shape, name and tier
        (the default tier written as none); placement adds location, offset and length."""
        assert t.shape is not None
        attrs = [ir.AttrInt64s("shape", [int(x) for x in t.shape]), ir.AttrString("name", w.name)]
        tier = kinds.tier(w.tier)
        if tier is not kinds.default_tier():
            attrs.append(ir.AttrString(contract.ATTR_TIER, tier.name))
        return attrs

    def offload_weight(self, w: WeightOffload, cache: int = 0,
                       decode: DecodeCache | None = None,
                       decode_orders: dict[tuple[str, int], int] | None = None) -> None:
        """Prefetch/Wait pairs before each data reader of ``w``; shape readers become
        constants. ``cache``: the bytes of the expert cache, recorded on each gated
        Prefetch of a cacheable ``w`` (:mod:`~ho_onnx.schedule.expert_cache`); ``decode``:
        the decode cache, recorded on each Prefetch of a ``w`` of it with its place among the
        cache's reloads (``decode_orders``, :func:`~ho_onnx.schedule.decode_cache.reloads`)."""
        decode_orders = decode_orders or {}
        t = self.analysis.tensors[w.name]
        assert t.elem_type is not None and t.shape is not None
        self.weight_prefetches.setdefault(w.name, [])
        for c in w.shape_readers:
            self.replace[c] = [int(x) for x in t.shape]
        attrs = self.weight_attrs(w, t)
        tier = kinds.tier(w.tier)
        for c in w.row_readers:  # an embedding lookup: only its rows leave the host store
            ids = self.analysis.nodes[c].inputs[1]
            assert ids is not None and ids.name
            op = self.op(contract.GATHER_ROWS, [self.source(t.elem_type), ids.name], [],
                         f"ho.rows.{w.name}.{c}", *attrs)
            self.rows[c] = op
            self.weight_prefetches[w.name].append(op)
        for c in w.host_readers:  # an expert's MatMul computed where its weight lives
            x = self.analysis.nodes[c].inputs[0]
            assert x is not None and x.name
            op = self.op(contract.HOST_MATMUL, [self.source(t.elem_type), x.name], [],
                         f"ho.host.{w.name}.{c}", *attrs)
            self.rows[c] = op
            self.weight_prefetches[w.name].append(op)
        for k, (c, s) in enumerate(zip(w.consumers, w.prefetch_at, strict=True)):
            y = self.names.fresh(f"{w.name}.ho_y{k}")
            z = self.names.fresh(f"{w.name}.ho_z{k}")
            # A routed reload reads its gate as input 1 (its emptiness skips the transfer).
            gate = [w.gates[k]] if w.gates and w.gates[k] else []
            gated = [ir.AttrInt64(contract.ATTR_GATED, 1)] if gate else []
            # (a stacked expert tensor of a MoE/QMoE op: only the experts it selects move)
            route = w.routes[k] if w.routes else None
            routes = [ir.AttrString(contract.ATTR_ROUTE, route[0]),
                      ir.AttrInt64(contract.ATTR_ROUTE_K, route[1])] if route else []
            cached = [ir.AttrInt64(contract.ATTR_EXPERT_CACHE, cache)] \
                if gate and cache and cacheable(w) else []
            if decode is not None and (w.name, k) in decode_orders:
                # (a cache that keeps nothing still joins the group to read ahead: 1 byte)
                cached = [ir.AttrInt64(contract.ATTR_EXPERT_CACHE, max(decode.capacity, 1)),
                          ir.AttrInt64(contract.ATTR_CACHE_GROUP, decode.group),
                          ir.AttrInt64(contract.ATTR_CACHE_ORDER, decode_orders[(w.name, k)])]
            # A Prefetch with only constant inputs would be folded by ORT: at the very start
            # it is ordered after a graph input.
            pf_deps = self.dep_before(s) or ([] if gate else _first_graph_input(self.analysis))
            pf_deps += self.warmed.get((w.name, k), [])
            pf = self.op(contract.PREFETCH, [self.source(t.elem_type), *gate, *pf_deps],
                         [self.like(y, t)], f"ho.prefetch.{w.name}.{k}", *attrs, *gated,
                         *routes, *cached, channel=tier.channel)
            wait = self.op(contract.WAIT, [y, *gate, *self.dep_before(c, floor=s - 1)],
                           [self.like(z, t)], f"ho.wait.{w.name}.{k}", *gated)
            self.before_pf[s].append(pf)
            self.before_wait[c].append(wait)
            self.rename.setdefault(c, {})[w.name] = z
            self.weight_prefetches[w.name].append(pf)

    def speculate(self, s: Speculation, weights: dict[str, WeightOffload], cache: int) -> None:
        """Right after the earlier router's MatMul (position ``s.after``): the next router
        applied to its input and its TopK; after ``s.issue_at``, a warm Prefetch per warmed
        reload, gated by the predicted indices; their empty outputs order the routed
        Prefetches after them."""
        a = self.analysis
        elem = a.tensors[s.router_weight].elem_type
        assert elem is not None
        base = f"ho.spec.{s.layer}"
        logits = self.names.fresh(f"{base}.logits")
        ops = [self.op("MatMul", [s.activation, s.router_weight], [(logits, elem, None)],
                       f"{base}.matmul", domain="")]
        self.spec_matmuls.append((ops[0], s.after))
        if s.bias is not None:
            biased = self.names.fresh(f"{base}.biased")
            ops.append(self.op("Add", [logits, s.bias], [(biased, elem, None)], f"{base}.bias",
                               domain=""))
            logits = biased
        k = self.names.fresh(f"{base}.k")
        ops.append(self.op("Constant", [], [(k, TensorProto.INT64, [1])], f"{base}.k",
                           ir.AttrTensor("value", ir.tensor(np.array([s.k], dtype=np.int64))),
                           domain=""))
        values, picked = self.names.fresh(f"{base}.values"), self.names.fresh(f"{base}.experts")
        ops.append(self.op("TopK", [logits, k], [(values, elem, None),
                                                 (picked, TensorProto.INT64, None)],
                           f"{base}.topk", domain=""))
        self.after[s.after].extend(ops)
        ops = []  # (the warm reads: after the earlier layer's own expert Prefetches)
        for warm in s.warms:
            w = weights[warm.weight]
            t = a.tensors[w.name]
            assert t.elem_type is not None
            y = self.names.fresh(f"{w.name}.ho_warm{warm.consumer}")
            op = self.op(contract.PREFETCH, [self.source(t.elem_type), picked],
                         [(y, t.elem_type, [0])], f"ho.warm.{w.name}.{warm.consumer}",
                         *self.weight_attrs(w, t), ir.AttrInt64(contract.ATTR_GATED, 1),
                         ir.AttrInt64(contract.ATTR_WARM, 1),
                         ir.AttrInt64(contract.ATTR_EXPERT, warm.expert),
                         ir.AttrInt64(contract.ATTR_EXPERT_CACHE, cache),
                         channel=kinds.tier(w.tier).channel)
            ops.append(op)
            self.warmed.setdefault((w.name, warm.consumer), []).append(y)
            self.weight_prefetches.setdefault(w.name, []).append(op)
        self.after[s.issue_at].extend(ops)

    def rewire_speculations(self) -> None:
        """A speculation's MatMul reads what the earlier router's MatMul reads there (the
        Wait's output when its input was offloaded and reloaded for it)."""
        for op, pos in self.spec_matmuls:
            op.inputs[0] = self.rename.get(pos, {}).get(op.inputs[0], op.inputs[0])

    def offload_activation(self, a: ActivationOffload, ring: int) -> None:
        """Store after the producer, Detach after the early uses, Prefetch/Wait before the
        late ones (``ring``: the stored peak, recorded on every Store)."""
        t = self.analysis.tensors[a.name]
        assert t.elem_type is not None
        token, token2, y, z = (self.names.fresh(f"{a.name}.ho_{s}")
                               for s in ("token", "detached", "y", "z"))
        store = self.op(contract.STORE, [a.name], [_token(token, t.elem_type)],
                        f"ho.store.{a.name}", ir.AttrInt64(contract.ATTR_HOST_BYTES, ring))
        det_deps = self.dep_before(a.last_early + 1, floor=a.producer) if a.early else []
        if det_deps and self._fused_by_ort(det_deps[0]):
            # An ordering input on a MatMul's output that only its bias Add reads keeps ORT
            # from fusing them into a Gemm (other kernels, other rounding; found in a training
            # graph). The Detach needs no edge for safety (x stays alive until its last reader
            # anyway); the file order places it.
            det_deps = []
        detach = self.op(contract.DETACH, [a.name, token, *det_deps],
                         [_token(token2, t.elem_type)], f"ho.detach.{a.name}")
        u, s = a.late[0], a.prefetch_at
        pf = self.op(contract.PREFETCH, [token2, *self.dep_before(s, floor=a.last_early)],
                     [self.like(y, t)], f"ho.prefetch.{a.name}",
                     channel=kinds.default_tier().channel)
        wait = self.op(contract.WAIT, [y, *self.dep_before(u, floor=s - 1)], [self.like(z, t)],
                       f"ho.wait.{a.name}")
        self.after[a.producer].append(store)
        self.after[a.last_early].append(detach)
        self.before_pf[s].append(pf)
        self.before_wait[u].append(wait)
        for c in a.late:
            self.rename.setdefault(c, {})[a.name] = z

    def recompute(self, r: Recompute) -> None:
        """The nodes of ``r`` run again right before its first late reader, with fresh output
        names, each reading a copy made before it or one input through a Fence ordered after
        the node before that reader (so ORT neither merges the copies with the first
        computation nor runs them early: ``r.fenced``); its late readers read the copy."""
        u = r.late[0]
        deps = self.dep_before(u)
        fence = dict(r.fenced)
        made: dict[str, str] = {}  # a cone node's output -> its copy's name
        fenced: dict[str, str] = {}  # a value read through a Fence -> the Fence's output
        for pos in r.nodes:
            node = self.analysis.nodes[pos]
            inputs = []
            for v in node.inputs:
                name = v.name if v is not None and v.name else ""
                if name in made:
                    name = made[name]
                elif name and fence.get(pos) == name:
                    if name not in fenced:
                        fenced[name] = self.names.fresh(f"{name}.ho_fenced")
                        self.before_wait[u].append(self.op(
                            contract.FENCE, [name, *deps],
                            [self.like(fenced[name], self.analysis.tensors[name])],
                            f"ho.fence.{name}"))
                    name = fenced[name]
                inputs.append(name)
            outs = list(node.outputs)
            while outs and not outs[-1].name:  # (unused trailing optional outputs)
                outs.pop()
            copies: list[_Out] = []
            for v in outs:  # (each named and typed: schedule.recompute.cone)
                made[v.name] = name = self.names.fresh(f"{v.name}.ho_recomputed")
                copies.append(self.like(name, self.analysis.tensors[v.name]))
            self.before_wait[u].append(self.op(
                node.op_type, inputs, copies, f"{node.name or node.op_type}.ho_recompute",
                *node.attributes.values(), domain=node.domain))
        for c in r.late:
            self.rename.setdefault(c, {})[r.name] = made[r.name]

    def _fused_by_ort(self, name: str) -> bool:
        """``name`` is a MatMul's output that only an Add reads (ORT fuses the two into a
        Gemm, and only while nothing else reads the product)."""
        t = self.analysis.tensors.get(name)
        if t is None or t.producer is None or len(t.consumers) != 1 or t.is_graph_output:
            return False
        return (self.analysis.nodes[t.producer].op_type == "MatMul"
                and self.analysis.nodes[t.consumers[0]].op_type == "Add")

    def offload_input(self, i: InputOffload) -> None:
        """PrefetchInput/Wait pairs before each data reader of the graph input ``i`` (its
        shape readers keep reading the input: nothing moves for them)."""
        t = self.analysis.tensors[i.name]
        for k, (c, s) in enumerate(zip(i.consumers, i.prefetch_at, strict=True)):
            y = self.names.fresh(f"{i.name}.ho_y{k}")
            z = self.names.fresh(f"{i.name}.ho_z{k}")
            pf = self.op(contract.PREFETCH_INPUT, [i.name, *self.dep_before(s)],
                         [self.like(y, t)], f"ho.prefetch.{i.name}.{k}",
                         channel=kinds.default_tier().channel)
            wait = self.op(contract.WAIT, [y, *self.dep_before(c, floor=s - 1)], [self.like(z, t)],
                           f"ho.wait.{i.name}.{k}")
            self.before_pf[s].append(pf)
            self.before_wait[c].append(wait)
            self.rename.setdefault(c, {})[i.name] = z

    def offload_output(self, o: OutputOffload) -> None:
        """An Emit of the graph output ``o``, written right after its last reader: its
        producer's value is renamed (an intermediate, freed after its last reader) and the
        Emit's output is the graph output. No ordering input: one on the last reader's
        output kept ORT from fusing that reader away (a Transpose into the attention's
        MatMul: ORT then ran the Transpose only for the Emit, 4 MiB a layer more at 4k
        context, stop 49), and the value stays alive until its last reader anyway."""
        t = self.analysis.tensors[o.name]
        dev = self.names.fresh(f"{o.name}.ho_dev")
        self.emitted[o.name] = dev
        self.after[o.last].append(self.op(contract.EMIT, [dev], [self.like(o.name, t)],
                                          f"ho.emit.{o.name}"))

    def schedule(self) -> list[tuple[int, list[_Op], list[_Op]]]:
        """The refined order: before each compute node its Prefetches, then its Waits; after
        it its Stores (start copying early), then its Detaches (end residency)."""
        touched = sorted({*self.rename, *self.replace, *self.rows, *(
            pos for ops in (self.before_pf, self.before_wait, self.after)
            for pos, at in enumerate(ops) if at)})  # positions with anything to do
        return [(pos, self.before_pf[pos] + self.before_wait[pos],
                 sorted(self.after[pos], key=lambda x: x.op != contract.STORE))
                for pos in touched]


class _Builder:
    """Builds the decided cache ops into the graph, in file order, chaining each copy
    channel's Prefetches FIFO through their ``issued`` outputs."""

    def __init__(self, em: _Emitter) -> None:
        self.em = em
        self.graph = em.analysis.model.graph
        self.values = dict(em.analysis.values)
        for elem, name in em.sources.items():  # the empty source each weight Prefetch reads
            self.values[name] = src = ir.Value(
                name=name, type=ir.TensorType(ir.DataType(elem)), shape=ir.Shape([0]),
                const_value=ir.serde.TensorProtoTensor(
                    TensorProto(name=name, data_type=elem, dims=[0])))
            self.graph.register_initializer(src)
        for out, dev in em.emitted.items():  # the producer's value stays, renamed
            v = self.values.pop(out)
            v.name = dev
            self.values[dev] = v
        self.nodes: dict[int, ir.Node] = {}  # id(_Op) -> node
        self.last_on: dict[str, ir.Node] = {}
        self.steps = em.schedule()
        ops = [o for _, before, after in self.steps for o in (*before, *after)]
        # a Prefetch with a later one on its channel gets an ``issued`` output; an Emit with
        # a cache op after it a ``done`` output, which that op reads (under ORT's DEFAULT
        # order a node nobody reads runs after the whole graph: every present held to the
        # end, 1.8x the arena on a 4-layer decoder at 4k context, stop 49)
        later: set[str] = set()
        self.chained: set[int] = set()
        self.signalled: set[int] = set()
        followed = False
        for o in reversed(ops):
            if o.channel is not None:
                if o.channel in later:
                    self.chained.add(id(o))
                later.add(o.channel)
            if o.op == contract.EMIT and followed:
                self.signalled.add(id(o))
            followed = followed or o.op != contract.EMIT
        self.done: list[ir.Value] = []  # Emits' done outputs the next cache op reads

    def value(self, name: str, elem: int, shape: list[int | str | None] | None) -> ir.Value:
        v = ir.Value(name=name, type=ir.TensorType(ir.DataType(elem)),
                     shape=None if shape is None else ir.Shape(shape))
        self.values[name] = v
        return v

    def build(self, o: _Op) -> ir.Node:
        # (an ordering input named after an emitted graph output means its producer's value)
        inputs = [self.values[self.em.emitted.get(n, n)] if n else None for n in o.inputs]
        outputs = [self.value(*spec) for spec in o.outputs]
        if o.op == contract.EMIT:
            if id(o) in self.signalled:
                name = self.em.names.fresh(f"{o.outputs[0][0]}.done")
                outputs.append(self.value(name, o.outputs[0][1], [0]))
                self.done.append(outputs[-1])
        else:
            inputs.extend(self.done)  # (before the channel's chain: that one comes last)
            self.done = []
        if o.channel is not None:
            prev = self.last_on.get(o.channel)
            if prev is not None:  # wait for the previous Prefetch on this channel
                inputs.append(prev.outputs[1])
            if id(o) in self.chained:  # a zero-size tensor produced once issued
                name = self.em.names.fresh(f"{o.outputs[0][0]}.issued")
                outputs.append(self.value(name, o.outputs[0][1], [0]))
        node = ir.Node(o.domain, o.op, inputs, o.attrs, outputs=outputs, name=o.name)
        if o.op == contract.EMIT:  # its output takes the graph output's place
            outs = self.graph.outputs
            outs[next(k for k, v in enumerate(outs) if v is inputs[0])] = outputs[0]
        if o.channel is not None:
            self.last_on[o.channel] = node
        self.nodes[id(o)] = node
        return node

    def apply(self) -> int:
        """Insert every cache op and rewire the readers; the number of nodes inserted."""
        count = 0
        for pos, before, after in self.steps:
            node = self.em.analysis.nodes[pos]
            if before:
                self.graph.insert_before(node, [self.build(o) for o in before])
            if pos in self.em.replace:
                node = self._to_constant(node, self.em.replace[pos])
            if pos in self.em.rows:
                node = self._to_rows(node, self.em.rows[pos])
                count += 1
            for i, v in enumerate(node.inputs):
                new = self.em.rename.get(pos, {}).get(v.name) if v is not None else None
                if new is not None:
                    node.replace_input_with(i, self.values[new])
            if pos in self.em.rename and any(True for _ in subgraphs(node)):
                self._rename_inside(node, self.em.rename[pos])
            if after:
                self.graph.insert_after(node, [self.build(o) for o in after])
            count += len(before) + len(after)
        return count

    def _rename_inside(self, node: ir.Node, renames: dict[str, str]) -> None:
        """Point what ``node``'s subgraphs (at any depth) read of the outer values in
        ``renames`` at their new values: a Loop/Scan body reading an offloaded weight reads
        the Wait before the node (schedule.eligibility.hoisted_readers)."""
        swap = {id(self.values[old]): self.values[new] for old, new in renames.items()}
        for top in subgraphs(node):
            for g in all_graphs(top):
                for n in g:
                    for i, v in enumerate(n.inputs):
                        if v is not None and id(v) in swap:
                            n.replace_input_with(i, swap[id(v)])
                for i, v in enumerate(g.outputs):
                    if id(v) in swap:
                        g.outputs[i] = swap[id(v)]

    def _to_rows(self, node: ir.Node, o: _Op) -> ir.Node:
        """Replace ``node`` (a Gather of an offloaded table's rows, a MatMul by an offloaded
        expert weight) by its op reading the host store in place (GatherRows: the rows
        copied out; HostMatMul: the product computed there): the same output value."""
        inputs = [self.values[n] for n in o.inputs]
        out = node.outputs[0]
        w = 0 if o.op == contract.GATHER_ROWS else 1  # the weight's input
        node.replace_input_with(w, inputs[0])  # (detach the weight before removing the node)
        # (the node's own name: a profile of the optimized model maps its time back to it)
        rows = ir.Node(contract.DOMAIN, o.op, inputs, o.attrs, num_outputs=1,
                       name=node.name or o.name)
        ir.convenience.replace_all_uses_with(out, rows.outputs[0], replace_graph_outputs=True)
        self.graph.insert_before(node, rows)
        self.graph.remove(node, safe=True)
        name = out.name
        out.name = None
        new = rows.outputs[0]
        new.name, new.type, new.shape = name, out.type, out.shape
        self.values[name or ""] = new
        self.nodes[id(o)] = rows
        return rows

    def _to_constant(self, node: ir.Node, dims: list[int]) -> ir.Node:
        """Replace ``node`` (a Shape/Size of a weight) by the Constant it computes."""
        const = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.serde.TensorProtoTensor(
            shape_constant_value(node, dims)))], num_outputs=1, name=node.name)
        old = node.outputs[0]
        name = old.name
        ir.convenience.replace_all_uses_with(old, const.outputs[0], replace_graph_outputs=True)
        self.graph.insert_before(node, const)
        self.graph.remove(node, safe=True)
        old.name = None
        new = const.outputs[0]
        new.name, new.type, new.shape = name, old.type, old.shape
        self.values[name or ""] = new
        return const


_SPENT = "insert_cache_ops"  # key in GraphAnalysis.derived: the model was rewritten


@gc_paused()
def insert_cache_ops(analysis: GraphAnalysis, choice: OffloadChoice, *,
                     reserved: Iterable[str] = ()) -> RewrittenModel:
    """Offload ``choice``'s tensors in ``analysis.model`` (in place; the analysis describes
    the model before the rewrite and is spent afterwards). ``reserved``: names no fresh
    name may take (an If branch's: those of every scope of the model it lies in)."""
    if analysis.derived.get(_SPENT):
        raise ValueError("this analysis was already used by insert_cache_ops: its model is "
                         "rewritten; analyse the model again")
    analysis.derived[_SPENT] = True
    model = analysis.model
    forget_source(model)
    names = Names(analysis.model.graph)
    names.used.update(reserved)
    em = _Emitter(analysis, names)
    by_name = {w.name: w for w in choice.weights}
    for s in choice.speculations:  # (before the weights: their Prefetches read the warms)
        em.speculate(s, by_name, choice.expert_cache)
    dc = choice.decode_cache
    orders = {r: i for i, r in enumerate(reloads(dc, choice))} if dc is not None else {}
    for w in choice.weights:
        em.offload_weight(w, choice.expert_cache, dc, orders)
    ring = stored_peak_bytes(choice)
    for a in choice.activations:
        em.offload_activation(a, ring)
    for i in choice.inputs:
        em.offload_input(i)
    for o in choice.outputs:
        em.offload_output(o)
    for r in choice.recomputes:
        em.recompute(r)
    em.rewire_speculations()
    builder = _Builder(em)
    result = RewrittenModel(model, cache_nodes=builder.apply())
    result.weight_prefetches = {name: [builder.nodes[id(o)] for o in ops]
                                for name, ops in em.weight_prefetches.items()}
    for w in choice.weights:
        result.weights[w.name] = model.graph.initializers.pop(w.name)
    if contract.DOMAIN not in model.opset_imports:
        model.opset_imports[contract.DOMAIN] = contract.OPSET_VERSION
    return result


def channel_of_tier(tier: str | None) -> str:
    """The copy channel a Prefetch's transfer queues on: its tier's (``"disk"`` for a
    disk-tier weight, ``"load"`` (host to device) for a host-tier weight or a stored
    activation); None or an unknown name: the default tier's."""
    return kinds.tier_of_attribute(tier).channel


def prefetch_channel(node: onnx.NodeProto | ir.Node) -> str:
    """:func:`channel_of_tier` of a Prefetch node (its ``tier`` attribute, default if none)."""
    if isinstance(node, ir.Node):
        tier = node.attributes.get(contract.ATTR_TIER)
        return channel_of_tier(tier.value if tier is not None else None)
    return channel_of_tier(next((a.s.decode() for a in node.attribute
                                 if a.name == contract.ATTR_TIER), None))


def shape_constant_value(node: ir.Node, dims: list[int]) -> TensorProto:
    """What ``node`` (Shape with start/end, or Size) computes from a tensor of static shape
    ``dims``: an offloaded weight's shape needs no transfer."""
    if node.op_type == "Size":
        return onnx.helper.make_tensor("value", TensorProto.INT64, [], [int(np.prod(dims))])
    attrs = attribute_values(node)
    rank = len(dims)
    start, end = int(attrs.get("start", 0)), int(attrs.get("end", rank))
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    picked = dims[start:end]
    return onnx.helper.make_tensor("value", TensorProto.INT64, [len(picked)], picked)


def _first_graph_input(analysis: GraphAnalysis) -> list[str]:
    """A graph input to order a prefetch at the very start after (keeps ORT from folding it)."""
    inits = analysis.model.graph.initializers
    for v in analysis.model.graph.inputs:
        t = analysis.tensors.get(v.name or "")
        if v.name not in inits and t is not None and t.elem_type is not None:
            return [v.name or ""]
    return []
