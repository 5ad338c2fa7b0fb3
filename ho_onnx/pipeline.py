"""``optimize``: load → analyse → choose → insert → save, with progress."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from . import __version__
from .analysis import GraphAnalysis, analyse
from .choice import OffloadChoice, OffloadPolicy, choose
from .insertion import RewrittenModel, insert_cache_ops
from .loader import LoadedModel, load_model
from .planner import Plan, PlannerOptions, plan
from .save import Progress, SaveReport, check_output_path, save_model
from .simulate import TransferTime

Log = Callable[[str], None]


@dataclass
class OptimizeResult:
    """Everything one optimize run decided and wrote, and how long each pass took."""

    analysis: GraphAnalysis
    choice: OffloadChoice
    rewritten: RewrittenModel
    report: SaveReport
    seconds: dict[str, float] = field(default_factory=dict)
    plan: Plan | None = None


@dataclass(frozen=True)
class CostSource:
    """Where the planner's times come from: a machine (preset or JSON file) and optionally
    an ORT profile of the unmodified model (``ho-onnx profile``)."""

    machine: str | os.PathLike[str] = "cpu"
    profile: str | os.PathLike[str] | None = None


def planner_inputs(analysis: GraphAnalysis, dims: Mapping[str, int], costs: CostSource
                   ) -> tuple[np.ndarray, TransferTime, str]:
    """Compute seconds per step, a transfer-time function and a description of both."""
    from .costmodel import analytic_costs, load_machine, profile_costs

    machine = load_machine(costs.machine)
    if costs.profile is not None:
        nc = profile_costs(analysis, costs.profile, machine, dims)
        what = f"profile {Path(costs.profile).name} ({nc.coverage:.0%} of nodes by name)"
    else:
        nc = analytic_costs(analysis, machine, dims)
        what = f"analytic roofline on {machine.name}"
    return nc.seconds, machine.transfer_time, f"{what}; transfers on {machine.name}"


def plan_model(model: str | os.PathLike[str] | LoadedModel, options: PlannerOptions,
               dims: Mapping[str, int] | None = None, costs: CostSource | None = None, *,
               ort_level: str | None = None, log: Log | None = None
               ) -> tuple[LoadedModel, GraphAnalysis, Plan]:
    """Load (unless given loaded) and plan ``model``; nothing is written (``ort_level``:
    plan ORT's optimized graph, made in a temporary folder)."""
    if ort_level is not None and not isinstance(model, LoadedModel):
        import tempfile

        from .ortopt import ort_optimize

        with tempfile.TemporaryDirectory(prefix="ho_onnx_ort_") as tmp:
            pre = ort_optimize(model, Path(tmp) / "model.onnx", ort_level)
            return plan_model(pre, options, dims, costs, log=log)
    dims = dict(dims or {})
    say = log or (lambda _msg: None)
    t0 = time.perf_counter()
    loaded = model if isinstance(model, LoadedModel) else load_model(model)
    analysis = analyse(loaded.model, dims)
    compute_s, transfer, what = planner_inputs(analysis, dims, costs or CostSource())
    say(f"analysed {len(analysis.order)} nodes, {len(analysis.tensors)} tensors; costs: {what} "
        f"({time.perf_counter() - t0:.2f} s)")
    t = time.perf_counter()
    p = plan(analysis, options, compute_s, transfer, dims)
    say(f"planned in {time.perf_counter() - t:.2f} s: peak {p.baseline.peak_bytes / 2**20:.1f} "
        f"-> {p.planned.peak_bytes / 2**20:.1f} MiB (budget {options.budget / 2**20:.1f} MiB)")
    return loaded, analysis, p


def plan_metadata(choice: OffloadChoice, dims: Mapping[str, int],
                  planned: Plan | None = None) -> dict[str, str]:
    """The plan as recorded in the output's ``metadata_props`` (keys prefixed ``ho_onnx.``)."""
    p = choice.policy
    extra: dict[str, str] = {}
    if planned is not None:
        extra = {
            "budget_bytes": str(planned.options.budget),
            "predicted_peak_bytes": str(planned.planned.peak_bytes),
            "baseline_peak_bytes": str(planned.baseline.peak_bytes),
            "predicted_time_s": f"{planned.planned.total_s:.6g}",
            "baseline_time_s": f"{planned.baseline.total_s:.6g}",
            "predicted_stall_s": f"{planned.planned.stall_s:.6g}",
        }
    return extra | {
        "version": __version__,
        "policy": "planner" if p is None else
        f"offload={p.what} min_bytes={p.min_bytes} min_gap={p.min_gap} "
        f"prefetch_distance={p.prefetch_distance} weight_tier={p.weight_tier}",
        "dims": ",".join(f"{k}={v}" for k, v in sorted(dims.items())),
        "offloaded_weights": str(len(choice.weights)),
        "offloaded_activations": str(len(choice.activations)),
        "offloaded_bytes": str(choice.offloaded_bytes),
        "host_bytes": str(planned.host_bytes if planned is not None else
                          sum(w.nbytes for w in choice.weights)
                          + sum(a.nbytes or 0 for a in choice.activations)),
    }


def optimize(in_path: str | os.PathLike[str], out_path: str | os.PathLike[str],
             policy: OffloadPolicy | PlannerOptions | None = None,
             dims: Mapping[str, int] | None = None, *, costs: CostSource | None = None,
             ort_level: str | None = None, log: Log | None = None,
             progress: Progress | None = None) -> OptimizeResult:
    """Rewrite ``in_path`` into ``out_path`` with cache operators (input never modified).

    ``policy`` is an explicit :class:`OffloadPolicy` (v1) or :class:`PlannerOptions` (a
    memory budget: the planner chooses, with times from ``costs``). ``ort_level``
    (``basic``/``extended``, planner only) first applies ORT's own graph optimizations and
    plans the graph ORT will run (see :mod:`ho_onnx.ortopt`).
    """
    if ort_level is not None:
        return _optimize_ort_first(in_path, out_path, policy, dims, costs, ort_level, log,
                                   progress)
    if isinstance(policy, PlannerOptions):
        return _optimize_planned(in_path, out_path, policy, dims, costs, log, progress)
    policy = policy or OffloadPolicy()
    dims = dict(dims or {})
    say = log or (lambda _msg: None)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    loaded = load_model(in_path)
    check_output_path(loaded, out_path)  # fail before any work
    seconds["load"] = time.perf_counter() - t0
    say(f"loaded {Path(in_path).name}: {len(loaded.model.graph.node)} nodes, "
        f"{len(loaded.model.graph.initializer)} initializers ({seconds['load']:.2f} s)")
    t = time.perf_counter()
    analysis = analyse(loaded.model, dims)
    seconds["analyse"] = time.perf_counter() - t
    say(f"analysed {len(analysis.tensors)} tensors ({seconds['analyse']:.2f} s)")
    t = time.perf_counter()
    choice = choose(analysis, policy, dims)
    rewritten = insert_cache_ops(analysis, choice)
    seconds["rewrite"] = time.perf_counter() - t
    say(f"offloading {len(choice.weights)} weights and {len(choice.activations)} activations "
        f"({choice.offloaded_bytes / 2**20:.1f} MiB), {rewritten.cache_nodes} cache ops "
        f"({seconds['rewrite']:.2f} s)")
    t = time.perf_counter()
    report = save_model(rewritten, loaded, out_path, progress=progress,
                        metadata=plan_metadata(choice, dims))
    seconds["save"] = time.perf_counter() - t
    say(f"wrote {report.model_path} ({seconds['save']:.2f} s)"
        + (f", copied {len(report.copied)} data file(s)" if report.copied else ""))
    return OptimizeResult(analysis, choice, rewritten, report, seconds)


def _optimize_planned(in_path: str | os.PathLike[str], out_path: str | os.PathLike[str],
                      options: PlannerOptions, dims: Mapping[str, int] | None,
                      costs: CostSource | None, log: Log | None,
                      progress: Progress | None) -> OptimizeResult:
    dims = dict(dims or {})
    say = log or (lambda _msg: None)
    t0 = time.perf_counter()
    loaded = load_model(in_path)
    check_output_path(loaded, out_path)  # fail before any work
    _, analysis, p = plan_model(loaded, options, dims, costs, log=log)
    seconds = {"plan": time.perf_counter() - t0}
    t = time.perf_counter()
    rewritten = insert_cache_ops(analysis, p.choice)
    report = save_model(rewritten, loaded, out_path, progress=progress,
                        metadata=plan_metadata(p.choice, dims, p))
    seconds["rewrite+save"] = time.perf_counter() - t
    say(f"offloading {len(p.choice.weights)} weights and {len(p.choice.activations)} "
        f"activations, {rewritten.cache_nodes} cache ops; wrote {report.model_path} "
        f"({seconds['rewrite+save']:.2f} s)")
    return OptimizeResult(analysis, p.choice, rewritten, report, seconds, p)


def _optimize_ort_first(in_path: str | os.PathLike[str], out_path: str | os.PathLike[str],
                        policy: OffloadPolicy | PlannerOptions | None,
                        dims: Mapping[str, int] | None, costs: CostSource | None,
                        ort_level: str, log: Log | None,
                        progress: Progress | None) -> OptimizeResult:
    """Apply ORT's optimizations, then optimize the graph ORT will run."""
    from .ortopt import ort_optimize

    say = log or (lambda _msg: None)
    loaded = load_model(in_path)
    check_output_path(loaded, out_path)
    # Written beside the output: its data file is what the output's initializers and
    # offloaded weights reference, so it stays; the intermediate model goes.
    out = Path(out_path)
    out.resolve().parent.mkdir(parents=True, exist_ok=True)
    pre = out.with_name(f"{out.name}.ort.onnx")
    ort_optimize(in_path, pre, ort_level)
    say(f"ORT {ort_level} optimizations applied: {len(loaded.model.graph.node)} -> "
        f"{len(onnx.load(str(pre), load_external_data=False).graph.node)} nodes")
    try:
        return optimize(pre, out_path, policy, dims, costs=costs, log=log, progress=progress)
    finally:
        pre.unlink(missing_ok=True)
