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


@dataclass
class ModelSummary:
    """Cache ops of a model, in schedule order."""

    nodes: int
    compute_nodes: int
    cache_ops: dict[str, int]
    transfers: list[Transfer] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    # Where the CUDA EP would run the cache ops (ORT's CPU fallback replayed): cache ops per
    # provider, and every chain whose ops would not all run on CUDA.
    cuda_placement: dict[str, int] = field(default_factory=dict)
    split_chains: list[str] = field(default_factory=list)
    # Cache ops ONNX Runtime would refuse (a damaged model): "name (op): why".
    defects: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def summarize(path: str | os.PathLike[str]) -> ModelSummary:
    """Read ``path`` (no weight bytes) and list its transfers."""
    model = load_model(path, check=False, allow_cache_ops=True).model
    g = model.graph
    counts = {op: 0 for op in contract.ALL_OPS}
    compute_before: list[int] = []  # compute nodes strictly before each step
    n_compute = 0
    for node in g:
        compute_before.append(n_compute)
        if node.domain == contract.DOMAIN:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
        else:
            n_compute += 1
    step = {n: i for i, n in enumerate(g)}
    summary = ModelSummary(len(step), n_compute, counts, metadata={
        k: v for k, v in model.metadata_props.items() if k.startswith(contract.META_PREFIX)})
    damaged = {node: why for node in g if node.domain == contract.DOMAIN
               and (why := cache_op_defect(node)) is not None}
    summary.defects = [f"{n.name or '?'!r} ({n.op_type}): {why}" for n, why in damaged.items()]
    for node in g:
        if node.domain != contract.DOMAIN or node.op_type != contract.WAIT or node in damaged:
            continue
        pf = node.inputs[0].producer()
        if pf is None or pf.op_type not in contract.PREFETCHES or pf.domain != contract.DOMAIN or \
                pf in damaged:
            continue
        tensor, kind, nbytes, source, tier = _source(pf)
        i, j = step[pf], step[node]
        summary.transfers.append(Transfer(tensor, kind, nbytes, i, j,
                                          compute_before[j] - compute_before[i], source, tier,
                                          _routing(pf)))
    placement = split_chains(model)
    summary.cuda_placement = {k.removesuffix("ExecutionProvider"): v
                              for k, v in sorted(placement.per_provider.items())}
    summary.split_chains = [c.describe() for c in placement.split]
    return summary


def _source(pf: ir.Node) -> tuple[str, str, int | None, str, str]:
    """(tensor, kind, bytes, source, tier) of the transfer a Prefetch starts."""
    a = attribute_values(pf)
    if contract.ATTR_LOCATION in a:
        source = f"{a[contract.ATTR_LOCATION]}@{a.get(contract.ATTR_OFFSET, 0)}"
        length = a.get(contract.ATTR_LENGTH)  # (a model may carry any type here: unknown)
        nbytes = length if isinstance(length, int) and length >= 0 else None
        tier = kinds.tier_of_attribute(a.get(contract.ATTR_TIER)).name
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
             + ", ".join(f"{v} {k}" for k, v in s.cache_ops.items())]
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
    total = 0
    for t, name in zip(s.transfers, names, strict=True):
        total += t.nbytes or 0
        nb = "?" if t.nbytes is None else f"{t.nbytes:,}"
        lines.append(f"{name[:w]:<{w}}  {t.kind:<10} {t.tier:<4} {nb:>12}  {t.prefetch_step:>8} "
                     f"{t.wait_step:>6} {t.window_nodes:>6}  {printable(t.source, cell=True)}"
                     + (f" (routed: {printable(t.routed, cell=True)})" if t.routed else ""))
    lines.append(f"{len(s.transfers)} transfers per run, {total:,} bytes reloaded per run")
    return "\n".join(lines)


__all__ = ["ModelSummary", "Transfer", "dtype_name", "format_summary", "summarize"]
