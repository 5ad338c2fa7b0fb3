"""Which tensors leave the fast tier (v1: an explicit policy; the budget planner replaces it).

The result, an :class:`OffloadChoice`, is all the insertion pass needs: for each weight the
consumer nodes that reload it, for each activation the uses before and after its gap.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import onnx

from .analysis import GraphAnalysis, TensorInfo
from .errors import UnboundDimError

OffloadWhat = Literal["weights", "activations", "all", "none"]


@dataclass(frozen=True)
class OffloadPolicy:
    """Options of the v1 choice.

    ``min_bytes``: smaller tensors stay resident. ``min_gap``: an activation is offloaded
    across its largest gap only if that gap spans at least this many schedule steps.
    ``prefetch_distance``: compute nodes between a Prefetch and its Wait.
    """

    what: OffloadWhat = "all"
    min_bytes: int = 1 << 20
    min_gap: int = 2
    prefetch_distance: int = 2
    weight_tier: Tier = "host"

    def __post_init__(self) -> None:
        if self.what not in ("weights", "activations", "all", "none"):
            raise ValueError(f"offload must be weights|activations|all|none, not {self.what!r}")
        if self.weight_tier not in ("host", "disk"):
            raise ValueError(f"weight_tier must be host|disk, not {self.weight_tier!r}")
        for name in ("min_bytes", "min_gap", "prefetch_distance"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


Tier = Literal["host", "disk"]


@dataclass(frozen=True)
class WeightOffload:
    """An initializer reloaded once before each consumer node that reads its data.

    ``prefetch_at[k]`` is the schedule position before which the reload for
    ``consumers[k]`` is issued (``<= consumers[k]``; the Wait sits right before the consumer).
    ``shape_readers`` (Shape/Size nodes) read only its static shape: the insertion pass
    replaces them with constants, so they cost no transfer. ``tier``: where the bytes wait
    between uses (the library's host store, or read from the data file each time).
    """

    name: str
    nbytes: int
    consumers: tuple[int, ...]
    prefetch_at: tuple[int, ...]
    shape_readers: tuple[int, ...] = ()
    tier: Tier = "host"

    def __post_init__(self) -> None:
        if len(self.prefetch_at) != len(self.consumers) or any(
            not 0 <= p <= c for p, c in zip(self.prefetch_at, self.consumers, strict=True)
        ):
            raise ValueError(f"{self.name}: prefetch positions {self.prefetch_at} do not fit "
                             f"consumers {self.consumers}")


SHAPE_OPS = ("Shape", "Size")


def reads_only_shape(node: onnx.NodeProto) -> bool:
    """A default-domain Shape or Size node: it needs its input's shape, not its data."""
    return node.op_type in SHAPE_OPS and node.domain in ("", "ai.onnx")


@dataclass(frozen=True)
class ActivationOffload:
    """An activation stored after ``producer``, detached after ``early``, reloaded for ``late``."""

    name: str
    nbytes: int | None  # None: symbolic size (only with min_bytes == 0)
    producer: int
    early: tuple[int, ...]
    late: tuple[int, ...]
    prefetch_at: int  # position before which the reload is issued: after early, <= late[0]

    @property
    def last_early(self) -> int:
        """Position after which the Detach ends the first residency."""
        return max(self.early) if self.early else self.producer

    def __post_init__(self) -> None:
        if not self.late or not self.last_early < self.prefetch_at <= self.late[0]:
            raise ValueError(f"{self.name}: prefetch position {self.prefetch_at} is not in "
                             f"({self.last_early}, {self.late[:1]}]")


@dataclass
class OffloadChoice:
    """The tensors to offload, and why the others stay (``policy``: None when a planner
    made the choice)."""

    policy: OffloadPolicy | None = None
    weights: list[WeightOffload] = field(default_factory=list)
    activations: list[ActivationOffload] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def offloaded_bytes(self) -> int:
        return sum(w.nbytes for w in self.weights) + sum(
            a.nbytes or 0 for a in self.activations
        )


# ORT 1.31 cannot register kernels for complex tensors (session creation fails).
UNSUPPORTED_TYPES = (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128)


def _ineligible(t: TensorInfo) -> str | None:
    if not t.fixed_size_type:
        return "not a tensor of a fixed-size element type (strings, sequences, unknown type)"
    if t.elem_type in UNSUPPORTED_TYPES:
        return "complex tensors cannot be offloaded (ORT has no custom-op support for them)"
    if t.is_graph_output:
        return "graph output"
    if t.implicit_consumers:
        return "read by a subgraph (If/Loop/Scan) from the outer scope"
    if not t.consumers:
        return "no consumers"
    return None


def largest_gap(producer: int, uses: list[int]) -> tuple[int, int]:
    """(gap length, number of uses before it) over producer→u1→u2...; first of equal gaps."""
    best, best_k = -1, 0
    prev = producer
    for k, u in enumerate(uses):
        if u - prev > best:
            best, best_k = u - prev, k
        prev = u
    return best, best_k


def choose(
    analysis: GraphAnalysis, policy: OffloadPolicy, dims: Mapping[str, int] | None = None
) -> OffloadChoice:
    """Apply ``policy`` to every tensor of the main graph."""
    choice = OffloadChoice(policy)
    want_w = policy.what in ("weights", "all")
    want_a = policy.what in ("activations", "all")
    for name, t in analysis.tensors.items():
        if t.is_initializer:
            if not want_w:
                continue
            if t.is_graph_input:
                choice.skipped[name] = "initializer that is also a graph input (overridable)"
                continue
        elif t.producer is not None:
            if not want_a:
                continue
        else:
            continue  # graph inputs: the caller owns their memory
        reason = _ineligible(t)
        if reason:
            choice.skipped[name] = reason
            continue
        if t.is_initializer:
            nbytes = t.nbytes(dims)
            assert nbytes is not None
            if nbytes < policy.min_bytes:
                choice.skipped[name] = f"{nbytes} bytes < min_bytes"
                continue
            shape_readers = tuple(c for c in t.consumers
                                  if reads_only_shape(analysis.node_at(c)))
            data = tuple(c for c in t.consumers if c not in shape_readers)
            d = policy.prefetch_distance
            choice.weights.append(WeightOffload(name, nbytes, data,
                                                tuple(max(0, c - d) for c in data),
                                                shape_readers, policy.weight_tier))
            continue
        assert t.producer is not None
        gap, k = largest_gap(t.producer, t.consumers)
        if gap < max(policy.min_gap, 1):
            choice.skipped[name] = f"largest gap {gap} < min_gap"
            continue
        try:
            nbytes = t.nbytes(dims)
        except UnboundDimError:
            if policy.min_bytes > 0:
                raise
            nbytes = None
        if nbytes is None and policy.min_bytes > 0:
            choice.skipped[name] = "size unknown (shape inference gave no shape)"
            continue
        if nbytes is not None and nbytes < policy.min_bytes:
            choice.skipped[name] = f"{nbytes} bytes < min_bytes"
            continue
        early, late = tuple(t.consumers[:k]), tuple(t.consumers[k:])
        last_early = max(early) if early else t.producer
        choice.activations.append(
            ActivationOffload(name, nbytes, t.producer, early, late,
                              max(last_early + 1, late[0] - policy.prefetch_distance))
        )
    return choice
