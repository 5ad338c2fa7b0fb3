"""Describe what an optimized model offloads: transfers, bytes, windows, recorded plan."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import onnx_ir as ir

from .. import contract, kinds
from ..errors import printable
from ..graph.analyse import attribute_values, input_names
from ..graph.dtypes import ELEMENT_BITS, capped_nbytes, dtype_name
from ..graph.load import load_model
from ..target.ort.placement import cache_op_defect, split_chains


@dataclass
class Transfer:
    """One reload: a Prefetch and its Wait, with the schedule steps between them."""

    tensor: str
    kind: str  # a registered kind's name (ho_onnx.kinds): "weight" | "activation"
    nbytes: int | None
    prefetch_step: int
    wait_step: int
    window_nodes: int  # compute nodes between prefetch and wait
    source: str  # "file@offset" for weights, the Store node for activations
    # Where it waits between uses, a registered tier's name: "host" (the library's store or
    # pool) or "disk" (a weight read from its data file at every Prefetch); found missing:
    # the table did not say.
    tier: str = kinds.HOST.name
    # What decides whether it moves (MoE experts): "" always; "gated" only when a token was
    # routed to its expert; "softmax top-2 of 8" (the MoE/QMoE op's rule, k and E): only the
    # slices of the experts the op selects.
    routed: str = ""
    # The graph it runs in: "" the main graph, else the subgraph (an If branch, a Loop/Scan
    # body: "Loop 'name' body"); its steps are that graph's.
    graph: str = ""
    per_iteration: bool = False  # in a Loop/Scan body: at every iteration (attribute)


@dataclass
class ModelSummary:
    """Cache ops of a model, in schedule order."""

    nodes: int
    compute_nodes: int
    cache_ops: dict[str, int]  # in every graph (the main graph's and its subgraphs')
    transfers: list[Transfer] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    # Where the CUDA EP would run the cache ops (ORT's CPU fallback replayed): cache ops per
    # provider, and every chain whose ops would not all run on CUDA.
    cuda_placement: dict[str, int] = field(default_factory=dict)
    split_chains: list[str] = field(default_factory=list)
    # Cache ops ONNX Runtime would refuse (a damaged model): "name (op): why".
    defects: list[str] = field(default_factory=list)
    # Cache ops inside subgraphs (If branches, Loop/Scan bodies), by subgraph.
    subgraph_cache_ops: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _graphs(main: ir.Graph) -> list[tuple[str, ir.Graph, bool]]:
    """(label, graph, inside a Loop/Scan body) of ``main`` ("") and every subgraph in it,
    each once, a parent before its subgraphs."""
    out, stack = [], [("", main, False)]
    while stack:
        label, g, in_body = stack.pop()
        out.append((label, g, in_body))
        for node in g:
            for attr in node.attributes.values():
                if attr.type is ir.AttributeType.GRAPH:
                    subs = [(attr.name, attr.value)]
                elif attr.type is ir.AttributeType.GRAPHS:
                    subs = [(f"{attr.name}[{k}]", s) for k, s in enumerate(attr.value)]
                else:
                    continue
                name = f"{node.op_type} {printable(node.name or '<unnamed>')!r}"
                stack.extend((f"{label + ' > ' if label else ''}{name} {a}", s,
                              in_body or node.op_type in ("Loop", "Scan"))
                             for a, s in reversed(subs))
    return out


def summarize(path: str | os.PathLike[str]) -> ModelSummary:
    """Read ``path`` (no weight bytes) and list its transfers (every graph's)."""
    model = load_model(path, check=False, allow_cache_ops=True).model
    counts = {op: 0 for op in contract.ALL_OPS}
    summary = ModelSummary(len(model.graph), 0, counts, metadata={
        k: v for k, v in model.metadata_props.items() if k.startswith(contract.META_PREFIX)})
    for label, g, in_body in _graphs(model.graph):
        _summarize_graph(summary, label, g, in_body)
    placement = split_chains(model)
    summary.cuda_placement = {k.removesuffix("ExecutionProvider"): v
                              for k, v in sorted(placement.per_provider.items())}
    summary.split_chains = [c.describe() for c in placement.split]
    return summary


def _summarize_graph(summary: ModelSummary, label: str, g: ir.Graph, in_body: bool) -> None:
    """Add ``g``'s cache ops, defects and transfers (``label``: the subgraph, "" main)."""
    compute_before: list[int] = []  # compute nodes strictly before each step
    n_compute = ops = 0
    for node in g:
        compute_before.append(n_compute)
        if node.domain == contract.DOMAIN:
            summary.cache_ops[node.op_type] = summary.cache_ops.get(node.op_type, 0) + 1
            ops += 1
        else:
            n_compute += 1
    if not label:
        summary.compute_nodes = n_compute
    elif ops:
        summary.subgraph_cache_ops[label] = ops
    step = {n: i for i, n in enumerate(g)}
    damaged = {node: why for node in g if node.domain == contract.DOMAIN
               and (why := cache_op_defect(node)) is not None}
    where = f" in {label}" if label else ""
    summary.defects += [f"{n.name or '?'!r} ({n.op_type}){where}: {why}"
                        for n, why in damaged.items()]
    for node in g:
        if node.domain != contract.DOMAIN or node.op_type != contract.WAIT or node in damaged:
            continue
        pf = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
        if pf is None or pf.op_type not in contract.PREFETCHES or pf.domain != contract.DOMAIN or \
                pf in damaged or pf not in step:
            continue
        tensor, kind, nbytes, source, tier = _source(pf)
        i, j = step[pf], step[node]
        summary.transfers.append(Transfer(tensor, kind, nbytes, i, j,
                                          compute_before[j] - compute_before[i], source, tier,
                                          _routing(pf), label, in_body))


def _source(pf: ir.Node) -> tuple[str, str, int | None, str, str]:
    """(tensor, kind, bytes, source, tier) of the transfer a Prefetch starts."""
    a = attribute_values(pf)
    if contract.ATTR_LOCATION in a:
        source = f"{a[contract.ATTR_LOCATION]}@{a.get(contract.ATTR_OFFSET, 0)}"
        length = a.get(contract.ATTR_LENGTH)  # (a model may carry any type here: unknown)
        nbytes = length if isinstance(length, int) and length >= 0 else None
        tier = kinds.tier_of_attribute(a.get(contract.ATTR_TIER)).name
        if contract.ATTR_CACHE_GROUP in a:  # (kept or read ahead where a run leaves room)
            source += " [decode cache]"
        # (the model does not say which kind that is not stored: every one reads like this)
        return str(a.get(contract.ATTR_NAME, "")), kinds.WEIGHT.name, nbytes, source, tier
    y = pf.outputs[0]
    nbytes = None
    if isinstance(y.type, ir.TensorType) and int(y.type.dtype) in ELEMENT_BITS and (
            y.shape is not None and all(isinstance(d, int) for d in y.shape)):
        nbytes = capped_nbytes(int(y.type.dtype), [int(d) for d in y.shape])
    if pf.op_type == contract.PREFETCH_INPUT:  # the caller's host memory (the KV cache)
        tensor = (pf.inputs[0].name or "?") if pf.inputs and pf.inputs[0] is not None else "?"
        return tensor, kinds.KV.name, nbytes, "graph input", "caller"
    det = pf.inputs[0].producer() if pf.inputs and pf.inputs[0] is not None else None
    names = input_names(det) if det is not None else []
    tensor = names[0] if names and names[0] else "?"
    source = (det.name or "") if det is not None else "?"
    return tensor, kinds.ACTIVATION.name, nbytes, source, kinds.default_tier().name


def _routing(pf: ir.Node) -> str:
    """:attr:`Transfer.routed` of the reload ``pf`` starts."""
    a = attribute_values(pf)
    if a.get(contract.ATTR_GATED) != 1:
        return ""
    if contract.ATTR_ROUTE not in a:
        warmed = any(v is not None and (p := v.producer()) is not None
                     and attribute_values(p).get(contract.ATTR_WARM) == 1 for v in pf.inputs)
        return "gated, speculated a layer early" if warmed else "gated"
    shape = a.get(contract.ATTR_SHAPE)
    experts = shape[0] if isinstance(shape, list | tuple) and shape else "?"
    return f"{a[contract.ATTR_ROUTE]} top-{a.get(contract.ATTR_ROUTE_K, '?')} of {experts}"


def format_summary(s: ModelSummary) -> str:
    """A human-readable table of :func:`summarize`'s result."""
    lines = [f"{s.nodes} nodes: {s.compute_nodes} compute, "
             + ", ".join(f"{v} {k}" for k, v in s.cache_ops.items())
             + (" (of them in subgraphs: " + ", ".join(
                 f"{v} in {printable(k, cell=True)}" for k, v in s.subgraph_cache_ops.items())
                + ")" if s.subgraph_cache_ops else "")]
    if s.metadata:
        lines.append("plan: " + "; ".join(f"{k.removeprefix(contract.META_PREFIX)}={v}"
                                          for k, v in sorted(s.metadata.items())))
    if s.cuda_placement:
        per = ", ".join(f"{v} on {k}" for k, v in s.cuda_placement.items())
        verdict = ("every chain on one provider" if not s.split_chains
                   else f"{len(s.split_chains)} SPLIT chain(s): the CUDA engine would fail")
        lines.append(f"under the CUDA EP (ORT's CPU fallback replayed): cache ops {per}; "
                     f"{verdict}")
        lines += [f"  split: {c}" for c in s.split_chains[:20]]
    if s.defects:
        lines.append(f"{len(s.defects)} cache op(s) ONNX Runtime would refuse (a damaged "
                     "model?):")
        lines += [f"  {d}" for d in s.defects[:20]]
    if not s.transfers:
        lines.append("no transfers: nothing is offloaded")
        return "\n".join(lines)
    names = [printable(t.tensor, cell=True) for t in s.transfers]
    w = min(max(6, *map(len, names)), 48)
    lines.append(f"{'tensor':<{w}}  {'kind':<10} {'tier':<4} {'bytes':>12}  {'prefetch':>8} "
                 f"{'wait':>6} {'window':>6}  source")
    total = looped = looped_bytes = 0
    for t, name in zip(s.transfers, names, strict=True):
        total += 0 if t.per_iteration else t.nbytes or 0
        looped += t.per_iteration
        looped_bytes += (t.nbytes or 0) if t.per_iteration else 0
        nb = "?" if t.nbytes is None else f"{t.nbytes:,}"
        lines.append(f"{name[:w]:<{w}}  {t.kind:<10} {t.tier:<4} {nb:>12}  {t.prefetch_step:>8} "
                     f"{t.wait_step:>6} {t.window_nodes:>6}  {printable(t.source, cell=True)}"
                     + (f" (routed: {printable(t.routed, cell=True)})" if t.routed else "")
                     + (f" [{printable(t.graph, cell=True)}"
                        + (", every iteration]" if t.per_iteration else "]") if t.graph else ""))
    lines.append(f"{len(s.transfers) - looped} transfers per run, {total:,} bytes reloaded "
                 "per run" + (f"; {looped} more at every iteration of a Loop/Scan body "
                              f"({looped_bytes:,} bytes an iteration)" if looped else ""))
    return "\n".join(lines)


__all__ = ["ModelSummary", "Transfer", "dtype_name", "format_summary", "summarize"]
