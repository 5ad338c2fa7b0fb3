"""Speculative expert reads (issue 37, item 3): the next MoE layer's router applied to this
layer's router input predicts which experts it will pick (mixtral-offloading's trick: the
residual stream changes little from one layer to the next), and the reads of their weights
into the expert cache start then, a layer early; the layer's own routed Prefetches find
them in the cache (:mod:`.expert_cache`), read or still being read.

What is inserted per speculated layer (:mod:`ho_onnx.rewrite.insert`): right after the
earlier router's MatMul, ``MatMul(its input, the next router's weight)`` (plus the next
router's bias), a ``TopK`` of the next router's ``k``, and per cached expert weight of the
next layer a *warm* Prefetch (attribute ``warm``) gated by those indices: when they hold its
expert's column it starts the read into the cache; its output is empty and orders the
weight's routed Prefetch after it. Nothing waits for a warm read; the outputs are the
unmodified model's whatever the prediction (the real router decides what is computed).

Decided per layer, each skip with its reason (``choice.speculation_skipped``): it needs a
routed layer before it, routers that are a MatMul by a resident weight (plus a bias), cached
reloads of unrolled experts (one weight per expert: the cache's entries) and a cache that
holds both layers' selections for one token (a decode step's; else the warmed entries are
evicted before use).
The warm Prefetches are issued after the earlier layer's own expert Prefetches (the channel
is FIFO: before them they would delay the experts being computed; the simulation showed it).
``auto`` then asks the cost model: with the compute ``G`` between that point and the layer's
router, and ``R`` the time to read the layer's expected misses, a speculation
right with probability ``p`` ends the layer's reads ``p R`` earlier when ``G >= R`` and
``G - (1 - p) R`` earlier otherwise (the wrong guesses queue ahead on the disk channel), so
it pays when ``G > (1 - p) R`` (and ``R > 0``: a cache expected to serve every reload leaves
nothing to gain); ``p`` is :data:`PRIOR` (the graph cannot say how well the
routers agree; the library counts it: ``warm_hits / warm_reads``). The plan's simulated time
counts it (``schedule.simulate``: the right guesses issued early, the wrong ones holding the
channel), and the budget planner keeps ``auto``'s speculations only where that time falls.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from .. import kinds
from ..cost.model import CostModel
from ..graph import moe
from ..graph.analyse import GraphAnalysis
from ..units import format_bytes
from .expert_cache import cacheable
from .options import OffloadOptions
from .types import OffloadChoice, Speculation, Warm, WeightOffload

#: The probability a predicted expert is one the layer's router picks, assumed by ``auto``.
PRIOR = 0.5

#: Why a router weight stays resident (:func:`resident_routers`).
ROUTER_REASON = ("the router of a MoE layer whose experts may be read a layer early with it "
                 "(speculation; --speculate-experts off lets it go)")


def resident_routers(a: GraphAnalysis, options: OffloadOptions, cache: bool) -> dict[str, str]:
    """Router weights (and biases) kept resident, with :data:`ROUTER_REASON`, so that their
    layer can be speculated: an offloaded router cannot be applied a layer early (it is read
    before its own reload). Every MoE layer's but the first, of unrolled experts, where a
    speculation may happen: not ``off``, ``cache`` (an expert cache is possible) and expert
    weights on a streamed tier. Routers are small ([hidden, experts]): the budget planner
    counts them like any resident weight."""
    if options.speculate_experts == "off" or not cache \
            or kinds.tier(options.weight_tier).in_host_memory:
        return {}
    out: dict[str, str] = {}
    for layer in moe.find_experts(a)[1:]:
        src = moe.router_source(a, layer) if layer.form == "unrolled" else "stacked"
        if isinstance(src, str):
            continue
        out |= {n: ROUTER_REASON for n in (src.weight, src.bias) if n is not None}
    return out


def with_speculation(a: GraphAnalysis, choice: OffloadChoice, mode: str,
                     costs: CostModel | None = None) -> OffloadChoice:
    """``choice`` with its :class:`Speculation` s and the reasons for the layers left out
    (in place; returned). ``mode``: ``off``, ``on`` or ``auto`` (needs ``costs``)."""
    choice.speculations.clear()
    choice.speculation_skipped.clear()
    if mode == "off":
        return choice
    layers = moe.find_experts(a)
    if len(layers) < 2:
        return choice
    by_name = {w.name: w for w in choice.weights}
    for prev, layer in itertools.pairwise(layers):
        spec = _speculation(a, choice, prev, layer, by_name)
        if isinstance(spec, str):
            choice.speculation_skipped[layer.node] = spec
            continue
        why = None if mode == "on" else _pays(spec, by_name, costs)
        if why:
            choice.speculation_skipped[layer.node] = why
        else:
            choice.speculations.append(spec)
    return choice


def _speculation(a: GraphAnalysis, choice: OffloadChoice, prev: moe.MoELayer,
                 layer: moe.MoELayer, by_name: Mapping[str, WeightOffload]) -> Speculation | str:
    """The speculation of ``layer`` from ``prev``'s router input, or why there is none."""
    if not choice.expert_cache:
        return "no expert cache (a speculation reads into it)"
    if layer.form != "unrolled":
        return f"{layer.form} experts (the cache keeps whole weights: one per expert)"
    if layer.top_k is None:
        return "its router's k is not a constant"
    src, dst = moe.router_source(a, prev), moe.router_source(a, layer)
    if isinstance(src, str):
        return f"the layer before: {src}"
    if isinstance(dst, str):
        return dst
    if dst.weight in by_name or (dst.bias is not None and dst.bias in by_name):
        return "its router's weight is offloaded (read before its own reload)"
    warms = []
    for expert in layer.experts:
        for name in expert.weights:
            w = by_name.get(name)
            if w is None or not cacheable(w):
                continue
            for k, gate in enumerate(w.gates):
                column = moe.gate_column(a, gate) if gate else None
                if column is not None and 0 <= column < len(layer.experts):
                    warms.append(Warm(name, k, column))
    if not warms:
        return "none of its experts' weights is a cached reload with a known router column"
    need = _selection(layer, by_name) + _selection(prev, by_name)
    if choice.expert_cache < need:
        return (f"the expert cache ({format_bytes(choice.expert_cache)}) holds less than "
                f"both layers' selections for one token ({format_bytes(need)})")
    # Issued after the earlier layer's own expert Prefetches (FIFO on the channel: before
    # them a warm read would delay the experts being computed now).
    issue_at = max([src.position, *(max(w.prefetch_at) for e in prev.experts
                                    for n in e.weights
                                    if (w := by_name.get(n)) is not None and w.prefetch_at)])
    if issue_at >= dst.topk:
        return "the layer before reads its experts up to this layer's router: nothing to " \
               "start early"
    return Speculation(layer.node, dst.topk, src.position, src.activation, dst.weight, dst.bias,
                       layer.top_k, tuple(warms), issue_at)


def _selection(layer: moe.MoELayer, by_name: Mapping[str, WeightOffload]) -> int:
    """Bytes of ``layer``'s cached expert weights one token selects (its router's k of its
    experts: a decode step's selection, where speculation matters; a prefill selects more)."""
    share = (layer.top_k or len(layer.experts)) / len(layer.experts)
    return int(share * sum(w.nbytes for e in layer.experts for n in e.weights
                           if (w := by_name.get(n)) is not None and cacheable(w)))


def _pays(spec: Speculation, by_name: Mapping[str, WeightOffload],
          costs: CostModel | None) -> str | None:
    """None when the cost model says ``spec`` pays (module docstring), else why not."""
    if costs is None:
        return "auto speculates where the budget planner's cost model says it pays " \
               "(--budget); 'on' speculates anyway"
    gap = float(sum(costs.compute_s[spec.issue_at + 1:spec.topk]))
    misses = {(w.weight, w.consumer) for w in spec.warms}
    read = 0.0
    for name, _k in misses:
        w = by_name[name]
        read += costs.transfer_time(w.nbytes * w.fraction * (1.0 - w.hit),
                                    kinds.tier(w.tier).load.direction)
    if read <= 0:
        return "nothing to gain: the expert cache is expected to serve every reload"
    if gap > (1.0 - PRIOR) * read:
        return None
    return (f"does not pay: {gap * 1e3:.3g} ms of compute from the earlier router hide less "
            f"than {1.0 - PRIOR:.0%} of the {read * 1e3:.3g} ms its expected misses take "
            "to read")


def describe(choice: OffloadChoice) -> list[str]:
    """Plan report lines: the layers speculated, and why the others were not (none: no
    layer was considered)."""
    lines = []
    if choice.speculations:
        reads = sum(len(s.warms) for s in choice.speculations)
        n = len(choice.speculations)
        lines.append(f"speculation: the experts of {n} MoE layer{'s' if n != 1 else ''} read "
                     f"into the expert cache a layer early ({reads} warm reads, on the next "
                     "router's pick; counters warm_reads, warm_hits)")
    counts: dict[str, int] = {}
    for why in choice.speculation_skipped.values():
        counts[why] = counts.get(why, 0) + 1
    lines += [f"no speculation: {n} layer{'s' if n != 1 else ''}: {why}"
              for why, n in counts.items()]
    return lines
