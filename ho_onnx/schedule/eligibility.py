"""Which tensors may be offloaded at all, and the facts both deciders read from their uses:
the shape-only readers of a weight and the gaps between an activation's uses."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import onnx

from .. import contract, kinds
from ..cost.model import CostModel
from ..graph.analyse import GraphAnalysis, TensorInfo
from ..graph.dtypes import ELEMENT_BITS
from ..kinds import TensorKind
from ..target.ort.costs import weight_groups
from ..target.ort.facts import UNSUPPORTED_REASON, UNSUPPORTED_TYPES, reads_only_shape
from ..target.ort.placement import (
    HOST_INPUT_REASON,
    HOST_TENSOR_REASON,
    host_input_reads,
    predict_cuda_placement,
)
from .lifetimes import Sizes
from .options import OffloadOptions
from .types import OffloadChoice, WeightOffload

if TYPE_CHECKING:
    from ..graph.moe import MoELayer

# The selection rule of each ORT contrib op (contract.ROUTE_*; csrc/routing.h).
_ROUTE_RULES = {"MoE": contract.ROUTE_SOFTMAX, "QMoE": contract.ROUTE_TOPK}


def kind_of(t: TensorInfo) -> TensorKind | None:
    """The registered kind a decider chooses ``t`` as (:func:`ho_onnx.kinds.kind_of` without
    the fixed kinds: a weight is an initializer, an activation a node output), or None (a
    graph input: the caller owns its memory; the KV cache is :mod:`.kv`'s)."""
    return kinds.kind_of(t, fixed=False)


def wanted(kind: TensorKind | None, options: OffloadOptions) -> bool:
    """Whether ``options`` let tensors of ``kind`` be offloaded (its option field; a kind
    whose field the options lack is never offloaded)."""
    return kind is not None and bool(getattr(options, kind.option, False))


OVERRIDABLE_REASON = "initializer that is also a graph input (overridable)"


#: Ops whose subgraph (a Loop's or a Scan's body) may read an offloaded weight from the outer
#: scope: the body runs inside the node's own step of the schedule, so one reload before the
#: node serves every iteration (the node is that reload's reader).
HOISTED_OPS = frozenset(("Loop", "Scan"))


def hoisted_readers(analysis: GraphAnalysis, t: TensorInfo) -> tuple[int, ...]:
    """The Loop/Scan nodes whose bodies read the initializer ``t`` from the outer scope, when
    no other subgraph reads it (an If's branches are planned apart, rewrite/branches.py) and
    none reads it as an input too; else ()."""
    if not t.is_initializer or not t.implicit_consumers:
        return ()
    nodes = analysis.nodes
    if any(c in t.consumers or nodes[c].op_type not in HOISTED_OPS
           or nodes[c].domain not in ("", "ai.onnx") for c in t.implicit_consumers):
        return ()
    return tuple(t.implicit_consumers)


def ineligible(t: TensorInfo, analysis: GraphAnalysis | None = None) -> str | None:
    """Why ``t`` can never be offloaded, or None when it can (``analysis``: its model's, to
    tell the subgraphs that may read an offloaded weight: :func:`hoisted_readers`)."""
    if t.is_initializer and t.is_graph_input:
        return OVERRIDABLE_REASON
    if not t.fixed_size_type:
        return "not a tensor of a fixed-size element type (strings, sequences, unknown type)"
    if t.elem_type in UNSUPPORTED_TYPES:
        return UNSUPPORTED_REASON
    if t.is_graph_output:
        return "graph output"
    if t.implicit_consumers and not (analysis is not None and hoisted_readers(analysis, t)):
        return "read by a subgraph (If/Loop/Scan) from the outer scope"
    if not t.consumers and not t.implicit_consumers:
        return "no consumers"
    return None


def element_types(analysis: GraphAnalysis) -> dict[str, int]:
    """Element type of every value the analysis typed."""
    return {n: t.elem_type for n, t in analysis.tensors.items() if t.elem_type is not None}


def cuda_host_tensors(analysis: GraphAnalysis) -> frozenset[str]:
    """Values that live in host memory when the model runs on the CUDA EP (ORT's CPU
    fallback replayed, ``target/ort/placement.py``); computed once per analysis."""
    if "cuda_host_tensors" not in analysis.derived:
        analysis.derived["cuda_host_tensors"] = predict_cuda_placement(
            analysis.model, element_types(analysis)).host_tensors
    return analysis.derived["cuda_host_tensors"]


def placement_reasons(analysis: GraphAnalysis) -> dict[str, str]:
    """Tensors that stay resident for the CUDA EP, with the reason: those in host memory
    there (every cache-op chain runs on one provider) and those a CUDA kernel reads in host
    memory. One optimized model runs on either provider, so this holds for every target."""
    reasons = dict.fromkeys(host_input_reads(analysis.nodes), HOST_INPUT_REASON)
    return reasons | dict.fromkeys(cuda_host_tensors(analysis), HOST_TENSOR_REASON)


def _routed_share(analysis: GraphAnalysis, logits: str, k: int, e: int,
                  dims: Mapping[str, int]) -> float:
    """``1 - (1 - k/E) ** T``: the expected share of ``E`` experts that ``T`` tokens (the rows
    of the router value ``logits`` under ``dims``), each routed to ``k``, select; 1.0 when
    ``T`` is unknown."""
    try:
        nbytes = analysis.tensors[logits].nbytes(dims) or 0
    except Exception:  # unbound dims: every reload may move
        nbytes = 0
    bits = ELEMENT_BITS.get(analysis.tensors[logits].elem_type or 0, 0)
    tokens = nbytes * 8 // bits // e if bits else 0
    return 1.0 - (1.0 - min(k, e) / e) ** tokens if tokens else 1.0


def split_shape_readers(analysis: GraphAnalysis, t: TensorInfo
                        ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(data readers, shape-only readers) of ``t``: Shape/Size need no transfer; the
    Loop/Scan nodes whose bodies read an offloadable weight are data readers
    (:func:`hoisted_readers`)."""
    nodes = analysis.nodes
    shape = tuple(c for c in t.consumers if reads_only_shape(nodes[c]))
    data = tuple(c for c in t.consumers if c not in shape)
    hoisted = hoisted_readers(analysis, t)
    return (tuple(sorted({*data, *hoisted})) if hoisted else data), shape


def row_readers(analysis: GraphAnalysis, t: TensorInfo, tier: str) -> tuple[int, ...]:
    """Readers of the weight ``t`` that gather rows of it (a default-domain ``Gather`` on axis
    0 with int64 indices: an embedding lookup): they become ``GatherRows``, which copies only
    the selected rows out of the host store, or reads them from the data file on the disk
    tier (so the table never enters the fast tier). Only for a table of known shape; any
    registered ``tier`` (both the library's read rows)."""
    kinds.tier(tier)  # (a registered one)
    if not t.is_initializer or not t.shape \
            or not all(isinstance(d, int) and d > 0 for d in t.shape) \
            or ELEMENT_BITS.get(t.elem_type or 0, 0) < 8:  # (rows of whole bytes only)
        return ()
    out = []
    for c in t.consumers:
        node = analysis.nodes[c]
        ins = [v.name if v is not None else None for v in node.inputs]
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(ins) != 2 \
                or ins[0] != t.name or ins[1] == t.name:
            continue
        axis = node.attributes.get("axis")
        ids = analysis.tensors.get(ins[1] or "")
        if (axis is None or axis.value == 0) and ids is not None \
                and ids.elem_type == onnx.TensorProto.INT64:
            out.append(c)
    return tuple(out)


def matmul_readers(analysis: GraphAnalysis, t: TensorInfo, tier: str) -> tuple[int, ...]:
    """Readers of the weight ``t`` that ``HostMatMul`` can compute from the host store: a
    default-domain ``MatMul`` with ``t`` (2-D, of known shape, float32) as its second input
    and an activation as its first; only for a weight waiting in the host store (``tier``)."""
    if kinds.tier(tier) is not kinds.HOST or not t.is_initializer or not t.shape \
            or len(t.shape) != 2 or not all(isinstance(d, int) and d > 0 for d in t.shape) \
            or t.elem_type != onnx.TensorProto.FLOAT:
        return ()
    out = []
    for c in t.consumers:
        node = analysis.nodes[c]
        ins = [v.name if v is not None else None for v in node.inputs]
        if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and len(ins) == 2 \
                and ins[1] == t.name and ins[0] != t.name:
            out.append(c)
    return tuple(out)


def cpu_expert_readers(analysis: GraphAnalysis, t: TensorInfo, options: OffloadOptions,
                       routed: Routed, costs: CostModel | None = None
                       ) -> tuple[tuple[int, ...], str]:
    """(readers of ``t`` computed on the host, why) under ``options.cpu_experts``: the routed
    expert MatMuls (:func:`matmul_readers` gated by :class:`Routed`); ``all``: each, ``auto``:
    each whose host time (``costs.on_host_s``: the host's roofline and the activations'
    copies; on the CPU EP the same kernel on the same memory) is at most moving the weight
    and computing on the device. ``((), "")`` for a weight that is no routed expert's."""
    if options.cpu_experts == "off":
        return (), ""
    readers = [c for c in matmul_readers(analysis, t, options.weight_tier)
               if routed.gates.get((t.name, c))]
    if not readers:
        return (), ""
    if options.cpu_experts == "all" or costs is None:
        return tuple(readers), "computed on the host (cpu_experts=all)"
    nbytes = t.nbytes() or 0
    move = costs.transfer_time(nbytes, kinds.default_tier().load.direction)
    host = {c: costs.on_host_s(c) for c in readers}
    chosen = tuple(c for c in readers if host[c] <= float(costs.compute_s[c]) + move)
    us = sum(host.values()) * 1e6 / len(readers)
    dev = (sum(float(costs.compute_s[c]) for c in readers) / len(readers) + move) * 1e6
    where = "computed on the host" if chosen else "moved"
    return chosen, (f"{where} (cpu_experts=auto): {us:.1f} us a MatMul on the host against "
                    f"{dev:.1f} us moving the weight and computing on the device")


def in_place_readers(analysis: GraphAnalysis, t: TensorInfo, options: OffloadOptions,
                     groups: WeightGroups, routed: Routed, costs: CostModel | None = None
                     ) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """(row readers, host MatMul readers, why the latter) of the weight ``t``: the readers
    that read it in place from the host store (:func:`row_readers`,
    :func:`cpu_expert_readers`), none for a member of a weight group."""
    if t.name in groups.members:
        return (), (), ""
    host, why = cpu_expert_readers(analysis, t, options, routed, costs)
    return row_readers(analysis, t, options.weight_tier), host, why


def largest_gap(producer: int, uses: Sequence[int]) -> tuple[int, int]:
    """(gap length, number of uses before it) over producer→u1→u2...; first of equal gaps
    (``(-1, 0)`` without uses)."""
    best, best_k, prev = -1, 0, producer
    for k, u in enumerate(uses):
        if u - prev > best:
            best, best_k = u - prev, k
        prev = u
    return best, best_k


def long_gaps(producer: int, uses: Sequence[int], min_gap: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each gap producer→u1→u2... at least ``min_gap`` long."""
    out: list[tuple[int, int]] = []
    prev = producer
    for u in uses:
        if u - prev >= min_gap:
            out.append((prev, u))
        prev = u
    return out


@dataclass(frozen=True)
class WeightGroups:
    """Initializers that are offloaded and reloaded as one unit (a MatMulNBits packed weight
    with its scales and zero points: :func:`~ho_onnx.target.ort.costs.weight_groups`)."""

    members: dict[str, tuple[str, ...]]  # primary -> all members, primary first
    primary_of: dict[str, str]  # companion -> primary

    @classmethod
    def of(cls, analysis: GraphAnalysis) -> WeightGroups:
        """The groups of ``analysis``' model; computed once per analysis."""
        if "weight_groups" not in analysis.derived:
            members = {g[0]: g for g in weight_groups(analysis.model.graph)}
            analysis.derived["weight_groups"] = cls(
                members, {m: p for p, g in members.items() for m in g[1:]})
        return analysis.derived["weight_groups"]

    def companion_reason(self, name: str) -> str | None:
        """Why a companion is never a candidate of its own."""
        p = self.primary_of.get(name)
        return None if p is None else f"moves together with {p!r}"

    def data_uses(self, analysis: GraphAnalysis, primary: str,
                  own: Sequence[int] | None = None) -> tuple[int, ...]:
        """Data readers of every member of ``primary``'s group, ascending (``own``: those
        of ``primary`` itself, when the caller has split its readers already)."""
        uses: set[int] = set()
        for m in self.members.get(primary, (primary,)):
            uses.update(own if m == primary and own is not None else
                        split_shape_readers(analysis, analysis.tensors[m])[0])
        return tuple(sorted(uses))

    def nbytes(self, analysis: GraphAnalysis, primary: str,
               dims: Mapping[str, int] | None = None, sizes: Sizes | None = None) -> int:
        """Bytes of ``primary``'s group (``sizes``: the tensors' bytes under ``dims``, when
        the caller has them)."""
        size = sizes or (lambda m: analysis.tensors[m].nbytes(dims))
        return sum(size(m) or 0 for m in self.members.get(primary, (primary,)))

    def split(self, analysis: GraphAnalysis, choice: OffloadChoice,
              dims: Mapping[str, int] | None = None) -> None:
        """Replace each offloaded primary (decided over its group's uses and bytes) by one
        :class:`WeightOffload` per member: its own data readers, each reloaded where the
        group's reload for that reader was placed (in place)."""
        out: list[WeightOffload] = []
        for w in choice.weights:
            if w.name not in self.members:
                out.append(w)
                continue
            at = dict(zip(w.consumers, w.prefetch_at, strict=True))
            for m in self.members[w.name]:
                t = analysis.tensors[m]
                data, shape = split_shape_readers(analysis, t)
                out.append(WeightOffload(m, t.nbytes(dims) or 0, data,
                                         tuple(at[u] for u in data), shape, w.tier))
        choice.weights[:] = out


@dataclass(frozen=True)
class Routed:
    """The reloads an MoE router decides: for each expert weight, per data reader, the gate
    whose emptiness skips that reload (:func:`~ho_onnx.graph.moe.empty_gate`), and the
    expected share of reloads that move: ``1 - (1 - k/E) ** T`` for ``T`` tokens each routed
    to ``k`` of ``E`` experts (uniformly: at decode ``k/E``, at a long prefill nearly 1). For
    ORT's MoE/QMoE contrib ops the gate is the op's router input and the reload moves only the
    selected experts' slices of the stacked tensor (``routes``: the op's selection rule and
    ``k``); the share is then the expected share of the tensor's bytes that move."""

    gates: dict[tuple[str, int], str]  # (weight, reader position) -> gate value
    fraction: dict[str, float]  # expert weight -> expected share of its reloads that move
    # expert weight -> (its router's TopK node, the router column of its expert), where the
    # gate says (reports and checks against the router's own output)
    expert_of: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)
    # (stacked weight, MoE/QMoE reader) -> (selection rule: contract.ROUTE_*, the op's k)
    routes: dict[tuple[str, int], tuple[str, int]] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, analysis: GraphAnalysis, dims: Mapping[str, int] | None = None,
           options: OffloadOptions | None = None) -> Routed:
        """The routed reloads of ``analysis``' model under ``dims``; once per analysis and
        dims (none when ``options.routed`` is off)."""
        if options is not None and not options.routed:
            return cls({}, {}, {})
        key = ("routed", tuple(sorted((dims or {}).items())))
        if key not in analysis.derived:
            analysis.derived[key] = cls._find(analysis, dims or {})
        return analysis.derived[key]

    @classmethod
    def _find(cls, analysis: GraphAnalysis, dims: Mapping[str, int]) -> Routed:
        from ..graph.moe import empty_gate, find_experts, gate_column

        host = cuda_host_tensors(analysis)
        out = cls({}, {}, {})
        for layer in find_experts(analysis):
            if not layer.top_k or not layer.experts:
                continue
            share = _routed_share(analysis, layer.router_logits, layer.top_k,
                                  len(layer.experts), dims)
            if layer.form == "contrib":
                out._contrib(analysis, layer, share, host)
            if layer.stacked:
                continue  # (a stacked tensor read whole by a Gather: no per-expert reload)
            for expert in layer.experts:
                for w in expert.weights:
                    found = {c: g for c in split_shape_readers(analysis, analysis.tensors[w])[0]
                             if (g := empty_gate(analysis, c, host)) is not None}
                    if found:
                        out.gates.update(((w, c), g) for c, g in found.items())
                        out.fraction[w] = share
                        column = gate_column(analysis, next(iter(found.values())))
                        if column is not None:
                            out.expert_of[w] = (layer.node, column)
        return out

    def _contrib(self, analysis: GraphAnalysis, layer: MoELayer, share: float,
                 host: frozenset[str]) -> None:
        """The routed reloads of a MoE/QMoE node's stacked expert tensors: gated by its router
        input (a device value on the CUDA EP, a [tokens, E] tensor of static E), read by the
        op alone; not with the sparse mixer (another selection rule)."""
        from ..graph.analyse import attribute_values

        router = analysis.tensors[layer.router_logits]
        e, k = len(layer.experts), layer.top_k
        if (router.name in host or not router.shape or len(router.shape) != 2
                or router.shape[1] != e or k is None or k < 1):
            return
        for w in layer.experts[0].weights:
            for c in split_shape_readers(analysis, analysis.tensors[w])[0]:
                node = analysis.nodes[c]
                attrs = attribute_values(node)
                if (node.domain != "com.microsoft" or node.op_type not in _ROUTE_RULES
                        or attrs.get("use_sparse_mixer", 0) == 1
                        or node.inputs[1] is None or node.inputs[1].name != router.name):
                    continue
                self.gates[(w, c)] = router.name
                self.routes[(w, c)] = (_ROUTE_RULES[node.op_type], k)
                self.fraction[w] = share

    def routes_of(self, name: str, uses: Sequence[int]) -> tuple[tuple[str, int] | None, ...]:
        """Per reader of ``name``: the contrib op's (selection rule, k) when that reload moves
        only the selected experts' slices, else None; () when none does."""
        got = tuple(self.routes.get((name, u)) for u in uses)
        return got if any(got) else ()

    def of_weight(self, analysis: GraphAnalysis, name: str, uses: Sequence[int]
                  ) -> tuple[tuple[str, ...], float, tuple[int, ...]]:
        """(gate per reader, expected share moved, earliest issue position per reader: after
        its gate) of the weight ``name`` read at ``uses``; ``((), 1.0, zeros)`` when nothing
        routes it."""
        gates = tuple(self.gates.get((name, u), "") for u in uses)
        if not any(gates):
            return (), 1.0, (0,) * len(uses)
        after = tuple(0 if not g or (p := analysis.tensors[g].producer) is None else p + 1
                      for g in gates)  # (a gate that is a graph input: from the start)
        return gates, self.fraction.get(name, 1.0), after
