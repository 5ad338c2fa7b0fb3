"""What the planner asks of a cost model: compute seconds per step, seconds per transfer."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

# A copy direction: a registered tier's load or store link (ho_onnx.kinds: h2d, d2h, disk).
Direction = str
TransferTime = Callable[[int, Direction], float]  # (bytes, direction) -> seconds


@dataclass
class NodeCosts:
    """Compute seconds per schedule position (``seconds[pos]``, positions of
    ``GraphAnalysis.order``)."""

    seconds: np.ndarray  # float64, len(analysis.order)
    source: str  # "analytic" | "profile" | "profile run time" (profiled.device_scaled)
    coverage: float = 1.0  # fraction of nodes whose time came from the profile by name
    notes: list[str] = field(default_factory=list)
    gpu: bool = False  # compute measured on a GPU provider (loads issued ahead of the GPU)

    @property
    def total(self) -> float:
        return float(self.seconds.sum())

    def between(self, start: int, stop: int) -> float:
        """Compute seconds of positions ``start <= pos < stop``."""
        return float(self.seconds[max(start, 0):max(stop, 0)].sum())

    def cumulative(self) -> np.ndarray:
        """``c[i]`` = seconds of positions ``< i`` (length ``len(seconds) + 1``)."""
        return cumulative(self.seconds)


def cumulative(seconds: np.ndarray) -> np.ndarray:
    """Prefix sums: ``c[i]`` = seconds of positions ``< i`` (length ``len(seconds) + 1``)."""
    return np.concatenate(([0.0], np.cumsum(seconds)))


@dataclass(frozen=True)
class CostModel:
    """The planner's view of the target: ``compute_s[pos]`` seconds per schedule step,
    ``transfer_time(bytes, direction)`` seconds per copy, and where both came from.
    ``host_ahead``: loads start as the CUDA engine issues them, ahead of the GPU
    (:func:`~ho_onnx.schedule.simulate.simulate`'s ``host_ahead``), which the planner assumes
    when compute times were measured on a GPU."""

    compute_s: np.ndarray
    transfer_time: TransferTime
    description: str = ""
    host_ahead: bool = False
    # The fast tier is host memory (the CPU EP): the CPU engine copies inside the Waits and
    # Stores, on the compute stream (simulate's ``copy_in_compute``).
    copy_in_compute: bool = False
    notes: tuple[str, ...] = ()  # what the user should know of the times (a profile's gaps)
    # Seconds of the node at a position computed on the host CPU against host memory, its
    # activations copied there and back (an MoE expert's MatMul as HostMatMul); None: the
    # fast tier's compute is the host's (the CPU EP): ``compute_s`` itself.
    host_time: Callable[[int], float] | None = field(default=None, compare=False)

    def on_host_s(self, pos: int) -> float:
        """Seconds of the node at ``pos`` computed on the host (:attr:`host_time`)."""
        return float(self.compute_s[pos]) if self.host_time is None else self.host_time(pos)

    def with_host(self, positions: Iterable[int]) -> np.ndarray:
        """``compute_s`` with the nodes at ``positions`` computed on the host (HostMatMul)."""
        out = self.compute_s
        for pos in positions if self.host_time is not None else ():
            out = out.copy() if out is self.compute_s else out
            out[pos] = self.host_time(pos)
        return out

    def __post_init__(self) -> None:
        compute_s = np.asarray(self.compute_s, dtype=np.float64)
        # (every source checks its inputs; a NaN here would make every plan's times NaN)
        with np.errstate(over="ignore"):  # (a sum past float's range is the inf checked)
            total = compute_s.sum()
        if not (np.isfinite(compute_s).all() and np.isfinite(total) and (compute_s >= 0).all()):
            raise ValueError(f"compute times must be finite and >= 0 ({self.description})")
        object.__setattr__(self, "compute_s", compute_s)

    def prefix(self) -> np.ndarray:
        """:func:`cumulative` of ``compute_s``."""
        return cumulative(self.compute_s)
