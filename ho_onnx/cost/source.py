"""Where a plan's times come from: a machine and optionally an ORT profile, as one
:class:`~ho_onnx.cost.model.CostModel`."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import onnx_ir as ir

from ..graph.analyse import GraphAnalysis
from ..target.ort.profile import ProfileError, read_profile
from .analytic import analytic_costs, host_node_time
from .machine import Machine, load_machine
from .model import CostModel
from .profiled import DEVICE_SCALED, profile_costs


@dataclass(frozen=True)
class CostSource:
    """Where the planner's times come from: a machine (preset or JSON file) and optionally
    an ORT profile of the unmodified model (``ho-onnx profile``)."""

    machine: str | os.PathLike[str] = "cpu"
    profile: str | os.PathLike[str] | None = None

    @functools.cached_property
    def _files(self) -> tuple[Machine, dict[str, Any] | None]:
        """The machine and the profile, each file read and checked once (a CLI run reads
        them before the model, :meth:`check`, and plans with them after)."""
        return (load_machine(self.machine),
                read_profile(self.profile) if self.profile is not None else None)

    def check(self) -> None:
        """Read the machine and the profile now, so that a missing or bad file fails before
        a model is analysed (was: after, seconds into a large model)."""
        self._files  # noqa: B018 (read for its errors; kept for cost_model)

    def cost_model(self, analysis: GraphAnalysis, dims: Mapping[str, int]) -> CostModel:
        """Compute seconds per step of ``analysis`` and transfer times, with a description."""
        machine, profile = self._files
        if profile is not None and self.profile is not None:
            nc = profile_costs(analysis, profile, machine, dims)
            if nc.gpu and machine.name.startswith("cpu"):
                raise ProfileError(
                    f"profile {str(self.profile)!r} was taken on a GPU provider but the "
                    f"machine is {machine.name!r}, whose copy rates are a CPU's: pass the "
                    "GPU's machine (--machine h100, or a file from `ho-onnx calibrate`)")
            if nc.source == DEVICE_SCALED:
                what = (f"analytic roofline on {machine.name} scaled to the run time of "
                        f"profile {Path(self.profile).name}")
            else:
                what = f"profile {Path(self.profile).name} ({nc.coverage:.0%} of nodes by name)"
        else:
            nc = analytic_costs(analysis, machine, dims)
            what = f"analytic roofline on {machine.name}"
        # Compute measured on a GPU: loads are timed as the CUDA engine issues them.
        host = None if not machine.host_flops or not machine.host_mem_bw else \
            functools.partial(host_node_time, analysis, machine, dict(dims))
        # (no host of its own: the fast tier's compute is the host's, the CPU EP, whose
        # engine copies inside the Waits and Stores)
        in_compute = host is None and not nc.gpu
        return CostModel(nc.seconds, machine.transfer_time,
                         f"{what}; transfers on {machine.name}"
                         + ("; loads issued ahead of the GPU" if nc.gpu else "")
                         + ("; copies inside the Waits and Stores (the CPU engine)"
                            if in_compute else ""),
                         host_ahead=nc.gpu, copy_in_compute=in_compute,
                         notes=tuple(nc.notes), host_time=host)


@dataclass(frozen=True)
class TimedAt(CostSource):
    """A plan's times taken on another analysis of the same graph: ``analysed(model)``, the
    analysed model analysed again at ``dims`` (a range plan's, at the bottom of every range,
    issue 36: memory is planned at the top, where it is largest, and prefetch windows are
    sized where compute is smallest, a decode step, so they hide the copies there and, with
    more compute between the same nodes, everywhere above; the loaded model, or a copy of it
    split in blocks, ``rewrite/blocks.py``). The nodes must be the same, in the same order."""

    analysed: Callable[[ir.Model], GraphAnalysis] | None = None
    dims: Mapping[str, int] = field(default_factory=dict)

    def cost_model(self, analysis: GraphAnalysis, dims: Mapping[str, int]) -> CostModel:
        a = self.analysed(analysis.model) if self.analysed is not None else analysis
        if len(a.order) != len(analysis.order):  # (never expected: the same graph)
            return super().cost_model(analysis, dims)
        cm = super().cost_model(a, self.dims)
        at = ",".join(f"{k}={v}" for k, v in sorted(self.dims.items()))
        return replace(cm, description=cm.description + f"; timed at the bottom of the ranges "
                       f"({at}: windows sized where compute is least)")
