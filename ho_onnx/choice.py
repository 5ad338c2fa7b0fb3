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

    def __post_init__(self) -> None:
        if self.what not in ("weights", "activations", "all", "none"):
            raise ValueError(f"offload must be weights|activations|all|none, not {self.what!r}")
        for name in ("min_bytes", "min_gap", "prefetch_distance"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


@dataclass(frozen=True)
class WeightOffload:
    """An initializer reloaded once before each consumer node that reads its data.

    ``shape_readers`` (Shape/Size nodes) read only its static shape: the insertion pass
    replaces them with constants, so they cost no transfer.
    """

    name: str
    nbytes: int
    consumers: tuple[int, ...]
    shape_readers: tuple[int, ...] = ()


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


@dataclass
class OffloadChoice:
    """The tensors to offload, and why the others stay."""

    policy: OffloadPolicy
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
            choice.weights.append(WeightOffload(name, nbytes, data, shape_readers))
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
        choice.activations.append(
            ActivationOffload(
                name, nbytes, t.producer, tuple(t.consumers[:k]), tuple(t.consumers[k:])
            )
        )
    return choice
