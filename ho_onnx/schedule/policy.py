"""The explicit policy: offload every eligible tensor of the chosen kinds and sizes, each
reload issued a fixed number of compute nodes before its reader (v1's rewriter)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import UnboundDimError
from ..graph.analyse import GraphAnalysis, TensorInfo
from .eligibility import (
    Routed,
    WeightGroups,
    in_place_readers,
    ineligible,
    kind_of,
    largest_gap,
    placement_reasons,
    split_shape_readers,
    wanted,
)
from .expert_cache import asked, with_cache
from .kv import distance_window, kv_choice
from .options import OffloadOptions
from .speculate import resident_routers, with_speculation
from .types import ActivationOffload, Decision, OffloadChoice, RunFacts, WeightOffload


@dataclass(frozen=True)
class ExplicitPolicy:
    """:class:`~ho_onnx.schedule.types.Decider` of the explicit policy (``options.budget``
    is ignored; ``prefetch_distance`` places every reload)."""

    options: OffloadOptions = field(default_factory=OffloadOptions)

    def decide(self, analysis: GraphAnalysis, dims: Mapping[str, int]) -> Decision:
        return Decision(choose(analysis, self.options, dims))

    def sized(self, t: TensorInfo) -> bool:
        """Activations' sizes, when activations may go and ``min_bytes`` compares them."""
        return (not t.is_initializer and self.options.activations
                and bool(self.options.min_bytes_or_default)) or (
                    self.options.kv and t.kv_peer is not None)

    def prepared(self, run: RunFacts) -> ExplicitPolicy:
        """Itself: the options say what moves; no target fact changes that."""
        return self


def describe(options: OffloadOptions) -> str:
    """The options of an explicit choice as recorded in the output's metadata."""
    o = options
    return (f"offload={o.offloads}{' kv' if o.kv else ''} min_bytes={o.min_bytes_or_default} "
            f"min_gap={o.min_gap} "
            f"prefetch_distance={o.prefetch_distance} weight_tier={o.weight_tier}"
            + (f" cpu_experts={o.cpu_experts}" if o.cpu_experts != "off" else "")
            + (f" expert_cache={o.expert_cache}" if asked(o) else "")
            + (f" speculate_experts={o.speculate_experts}"
               if asked(o) and o.speculate_experts != "auto" else ""))


def choose(analysis: GraphAnalysis, options: OffloadOptions,
           dims: Mapping[str, int] | None = None) -> OffloadChoice:
    """Apply the explicit policy to every tensor of the main graph; every candidate of the
    chosen kinds that stays resident gets its reason in ``skipped``."""
    choice = OffloadChoice(describe(options))
    placement = placement_reasons(analysis) | resident_routers(analysis, options,
                                                                 bool(asked(options)))
    groups = WeightGroups.of(analysis)
    for name, t in analysis.tensors.items():
        kind = kind_of(t)
        if kind is None or not wanted(kind, options):
            continue
        reason = ineligible(t, analysis) or placement.get(name) or (
            _activation(t, options, dims, choice) if kind.stored else
            groups.companion_reason(name) or _weight(analysis, t, options, dims, choice, groups))
        if reason:
            choice.skipped[name] = reason
    groups.split(analysis, choice, dims)
    kv = kv_choice(analysis, options, dims or {}, distance_window(options.prefetch_distance))
    choice.inputs, choice.outputs = kv.inputs, kv.outputs
    choice.skipped.update(kv.skipped)
    choice.notes += kv.notes
    if cache := asked(options):  # (auto: none, there is no budget's slack)
        with_cache(choice, cache)
        with_speculation(analysis, choice, options.speculate_experts)
    return choice


def _weight(analysis: GraphAnalysis, t: TensorInfo, options: OffloadOptions,
            dims: Mapping[str, int] | None, choice: OffloadChoice,
            groups: WeightGroups) -> str | None:
    nbytes = groups.nbytes(analysis, t.name, dims)  # with its scales and zero points
    if nbytes < options.min_bytes_or_default:
        return f"{nbytes} bytes < min_bytes"
    own, shape_readers = split_shape_readers(analysis, t)
    routed = Routed.of(analysis, dims, options)
    rows, host, why = in_place_readers(analysis, t, options, groups, routed)
    choice.cpu_experts.update({t.name: why} if why else {})
    data = tuple(c for c in groups.data_uses(analysis, t.name, own)
                 if c not in rows and c not in host)
    d = options.prefetch_distance
    gates, share, after = routed.of_weight(analysis, t.name, data)
    choice.weights.append(WeightOffload(
        t.name, nbytes, data, tuple(max(a, c - d, 0) for c, a in zip(data, after, strict=True)),
        shape_readers, options.weight_tier, gates, share, rows, routed.routes_of(t.name, data),
        host_readers=host))
    return None


def _activation(t: TensorInfo, options: OffloadOptions, dims: Mapping[str, int] | None,
                choice: OffloadChoice) -> str | None:
    assert t.producer is not None
    min_bytes = options.min_bytes_or_default
    gap, k = largest_gap(t.producer, t.consumers)
    if gap < max(options.min_gap, 1):
        return f"largest gap {gap} < min_gap"
    try:
        nbytes = t.nbytes(dims)
    except UnboundDimError:
        if min_bytes > 0:
            raise
        nbytes = None
    if nbytes is None and min_bytes > 0:
        return "size unknown (shape inference gave no shape)"
    if nbytes is not None and nbytes < min_bytes:
        return f"{nbytes} bytes < min_bytes"
    early, late = tuple(t.consumers[:k]), tuple(t.consumers[k:])
    last_early = max(early) if early else t.producer
    choice.activations.append(ActivationOffload(
        t.name, nbytes, t.producer, early, late,
        max(last_early + 1, late[0] - options.prefetch_distance)))
    return None
