"""Human and machine views of a :class:`~ho_onnx.schedule.planner.Plan`."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ..errors import printable
from ..graph.moe import MoELayer
from ..schedule.planner import Plan
from ..schedule.simulate import Simulation
from ..schedule.types import OffloadChoice, WeightOffload
from ..units import format_bytes


def _mib(b: float) -> str:
    return format_bytes(b, "MiB", 1)


def transfer_rows(plan: Plan, analysis_names: list[str]) -> list[dict[str, Any]]:
    """One row per simulated transfer, in issue order."""
    rows = []
    sim = plan.planned
    for ev in sorted(sim.transfers, key=lambda e: (e.start_s, e.issue_pos)):
        window = float(sim.compute_s[ev.issue_pos:ev.wait_pos].sum()) if ev.kind == "reload" \
            else float(sim.compute_s[ev.issue_pos + 1:ev.wait_pos + 1].sum())
        rows.append({
            "tensor": ev.tensor, "kind": ev.kind, "direction": ev.direction,
            "bytes": ev.nbytes, "issue_step": ev.issue_pos, "wait_step": ev.wait_pos,
            "issue_node": analysis_names[ev.issue_pos], "wait_node": analysis_names[ev.wait_pos],
            "window_s": window, "transfer_s": ev.end_s - ev.start_s,
            "start_s": ev.start_s, "end_s": ev.end_s, "stall_s": ev.stall_s,
        })
    return rows


def _sim_dict(sim: Simulation) -> dict[str, Any]:
    return {"peak_bytes": sim.peak_bytes, "peak_step": sim.peak_pos, "time_s": sim.total_s,
            "stall_s": sim.stall_s, "compute_s": float(sim.compute_s.sum())}


def _recompute_dict(c: OffloadChoice, analysis_names: list[str]) -> dict[str, Any]:
    """The stored activations computed again before their late readers
    (schedule/recompute), and why each other stored one was not."""
    return {"recomputes": [{"name": r.name, "bytes": r.nbytes, "producer": r.producer,
                            "early": list(r.early), "late": list(r.late),
                            "nodes": [analysis_names[p] for p in r.nodes],
                            "transient_bytes": r.transient} for r in c.recomputes],
            "recompute_skipped": dict(c.recompute_skipped)}


def _caches_dict(c: OffloadChoice) -> dict[str, Any]:
    """The expert cache (schedule/expert_cache.py; in the budget), the next MoE layer's
    experts read into it a layer early (schedule/speculate), and the streamed weights kept
    across runs where a run's dims leave room (a range plan's: schedule/decode_cache), or
    why none."""
    d = c.decode_cache
    return {"expert_cache_bytes": c.expert_cache,
            "speculations": [{"layer": s.layer, "after": s.after, "issue_at": s.issue_at,
                              "k": s.k, "warms": [{"weight": w.weight, "reload": w.consumer,
                                                   "expert": w.expert} for w in s.warms]}
                             for s in c.speculations],
            "speculation_skipped": dict(c.speculation_skipped),
            "decode_cache": None if d is None else {
                "weights": list(d.weights), "capacity_bytes": d.capacity,
                "points": [{"name": n, "dims": dict(at), "kept_bytes": b, "ahead_bytes": a}
                           for n, at, b, a in d.points]},
            "decode_cache_skipped": c.decode_cache_skipped or None}


def plan_to_dict(plan: Plan, analysis_names: list[str], *, steps: bool = False
                 ) -> dict[str, Any]:
    """The plan as JSON-ready data (``steps``: the simulator's per-step trace too)."""
    c = plan.choice
    d: dict[str, Any] = {
        "budget_bytes": plan.budget,
        "min_budget_bytes": plan.min_budget,
        "fits": plan.fits,
        "arena_bytes": plan.arena_bytes, "arena_fits": plan.arena_fits,
        "arena_fits_at_bytes": plan.arena_fits_at or None,  # (where OVER: a budget that fits)
        "planned_for_bytes": plan.planned_for,
        "host_bytes": plan.host_bytes,
        # a lower bound on the time of every plan of the planner's space, and which one
        "lower_bound": None if plan.bound is None else {
            "time_s": plan.bound.seconds, "kind": plan.bound.kind, "gap": plan.gap,
            "greedy_time_s": plan.greedy_s, "refined_time_s": plan.refined_s,
            "search": plan.improved},
        **_caches_dict(c),  # (the expert cache, its speculations, the decode cache)
        **_recompute_dict(c, analysis_names),  # (recomputes, recompute_skipped)
        "before": _sim_dict(plan.baseline),
        "after": _sim_dict(plan.planned),
        "offloaded": {
            "weights": [_weight_dict(w) for w in c.weights],
            "activations": [{"name": a.name, "bytes": a.nbytes, "producer": a.producer,
                             "early": list(a.early), "late": list(a.late),
                             "prefetch_at": a.prefetch_at} for a in c.activations],
            # the KV cache in the caller's host memory (--offload-kv)
            "kv_inputs": [{"name": i.name, "bytes": i.nbytes, "readers": list(i.consumers),
                           "prefetch_at": list(i.prefetch_at), "present": i.peer}
                          for i in c.inputs],
            "kv_outputs": [{"name": o.name, "bytes": o.nbytes, "producer": o.producer,
                            "emitted_after": o.last} for o in c.outputs],
        },
        "transfers": transfer_rows(plan, analysis_names),
        "skipped": dict(c.skipped),  # why each other tensor of the chosen kinds stayed
        # offloaded expert weights (--cpu-experts): computed on the host or moved, and why
        "cpu_experts": dict(c.cpu_experts),
        # weights streamed in blocks (or kept whole), and why (rewrite/blocks.py)
        "splits": [{"name": s.name, "bytes": s.nbytes, "blocks": list(s.blocks),
                    "reason": s.reason} for s in c.splits],
        "costs": None if plan.costs is None else {
            "description": plan.costs.description, "notes": list(plan.costs.notes)},
    }
    if plan.parts:  # the If branches' own plans
        d["branches"] = {label: plan_to_dict(part, names) for label, part, names in plan.parts
                         if isinstance(part, Plan)}
    if steps:
        d["steps"] = [{"step": i, "node": analysis_names[i],
                       "start_s": float(plan.planned.step_start_s[i]),
                       "compute_s": float(plan.planned.compute_s[i]),
                       "bytes_after": int(plan.planned.memory[i]),
                       "bytes_before": int(plan.baseline.memory[i])}
                      for i in range(len(analysis_names))]
    return d


def _weight_dict(w: WeightOffload) -> dict[str, Any]:
    """One offloaded weight as JSON-ready data (plan_to_dict)."""
    return {"name": w.name, "bytes": w.nbytes, "readers": list(w.consumers),
            "prefetch_at": list(w.prefetch_at), "tier": w.tier,
            # routed (MoE experts): each reader's gate, the expected share moved
            "gates": list(w.gates), "fraction": w.fraction,
            # (stacked experts of a MoE/QMoE op: [rule, k] where only the selected experts'
            # slices move)
            "routes": [list(r) if r else None for r in w.routes],
            "hit": w.hit,  # the expert cache's expected share of those
            "row_readers": list(w.row_readers),  # (GatherRows)
            "host_readers": list(w.host_readers)}  # (HostMatMul)


def _routed_summary(weights: Sequence[WeightOffload]) -> str:
    """What of the offloaded weights the routers decide (MoE experts), or ""."""
    gated = sum(1 for w in weights if w.gates and not w.routes)
    stacked = sum(1 for w in weights if w.routes)
    parts = ([f"{gated} expert weights routed (moved only when the router picks their "
              "expert)"] if gated else [])
    parts += ([f"{stacked} stacked expert tensors routed (only the slices of the experts "
               "the MoE op selects move)"] if stacked else [])
    return "".join(f"; {p}" for p in parts)


def _skipped_summary(skipped: dict[str, str], top: int = 3) -> list[str]:
    """One line: how many tensors stayed resident, and the commonest reasons (each cut
    before its first parenthesis or colon, numbers made ``N`` so alike reasons count
    together; ``--json`` has them whole)."""
    if not skipped:
        return []
    counts = Counter(re.sub(r"\d+", "N", re.split(r" \(|: ", why)[0])
                     for why in skipped.values())
    common = "; ".join(f"{n}x {printable(why)}" for why, n in counts.most_common(top))
    more = f"; {len(counts) - top} other reasons" if len(counts) > top else ""
    return [f"resident: {len(skipped)} other tensors ({common}{more}; --json: each one's)"]


def _cpu_experts_summary(cpu_experts: dict[str, str]) -> list[str]:
    """One line: the offloaded expert weights computed on the host and those moved
    (``--cpu-experts``; ``--json``: each one's reason, with the times it compared)."""
    if not cpu_experts:
        return []
    host = sum(why.startswith("computed on the host") for why in cpu_experts.values())
    return [f"experts: {host} expert weights computed on the host (HostMatMul), "
            f"{len(cpu_experts) - host} moved (--json cpu_experts: each one's reason)"]


def _splits_summary(plan: Plan) -> list[str]:
    """A line per reason: the weights streamed in blocks or kept whole for it (``--json``:
    each one's)."""
    groups: dict[str, list[str]] = {}
    for s in plan.choice.splits:
        groups.setdefault(s.reason, []).append(
            f"{printable(s.name)} ({format_bytes(s.nbytes)}"
            + (f" in {len(s.blocks)} blocks)" if s.blocks else ")"))
    return [f"blocks: {', '.join(names)}: {printable(why)}" for why, names in groups.items()]


def _parts_summary(plan: Plan) -> str:
    """What the subgraphs planned apart offload, for the main graph's ``offloaded:`` line
    (its counts are the main graph's own)."""
    weights = {w.name: w.nbytes for _, part, _ in plan.parts for w in part.choice.weights}
    acts = sum(len(part.choice.activations) for _, part, _ in plan.parts)
    if not weights and not acts:
        return ""
    return (f"; in the subgraphs planned apart (below): {len(weights)} weights "
            f"({_mib(sum(weights.values()))}), {acts} activations")


def format_plan(plan: Plan, analysis_names: list[str], *, max_rows: int = 40) -> str:
    """The table ``ho-onnx plan`` prints."""
    b, a = plan.baseline, plan.planned
    c = plan.choice
    lines = [
        f"budget {_mib(plan.budget)}   smallest feasible {_mib(plan.min_budget)}",
        f"peak   {_mib(b.peak_bytes)} -> {_mib(a.peak_bytes)} "
        f"(step {a.peak_pos}: {analysis_names[a.peak_pos] if analysis_names else '-'})",
        f"time   {b.total_s * 1e3:,.3f} ms -> {a.total_s * 1e3:,.3f} ms predicted "
        f"(stall {a.stall_s * 1e3:,.3f} ms, x{a.total_s / b.total_s if b.total_s else 1:.3f})",
        f"offloaded: {len(c.weights)} weights ({_mib(sum(w.nbytes for w in c.weights))}), "
        f"{len(c.activations)} activations "
        f"({_mib(sum(x.nbytes or 0 for x in c.activations))}); host holds up to "
        f"{_mib(plan.host_bytes)}"
        + (f"; the KV cache in the caller's host memory ({len(c.inputs)} past, "
           f"{len(c.outputs)} present, {_mib(c.kv_bytes)})" if c.inputs or c.outputs else "")
        + (f"; {len(c.recomputes)} recomputed instead "
           f"({_mib(sum(r.nbytes for r in c.recomputes))})" if c.recomputes else "")
        + _routed_summary(c.weights) + _parts_summary(plan),
        *([f"bound  {plan.bound_summary()}"] if plan.bound is not None else []),
        *_skipped_summary(c.skipped),
        *_cpu_experts_summary(c.cpu_experts),
        *_splits_summary(plan),
        plan.arena_summary(),
    ]
    rows = transfer_rows(plan, analysis_names)
    if rows:
        names = [printable(r["tensor"], cell=True) for r in rows[:max_rows]]
        w = min(max(len(n) for n in names), 40)
        lines.append(f"{'tensor':<{w}} {'kind':<7} {'dir':<4} {'bytes':>12} {'window':>13} "
                     f"{'window ms':>9} {'copy ms':>8} {'stall ms':>8}")
        for r, name in zip(rows, names, strict=False):
            lines.append(
                f"{name[:w]:<{w}} {r['kind']:<7} {r['direction']:<4} {r['bytes']:>12,} "
                f"{r['issue_step']:>6}->{r['wait_step']:<6} {r['window_s'] * 1e3:>9.3f} "
                f"{r['transfer_s'] * 1e3:>8.3f} {r['stall_s'] * 1e3:>8.3f}")
        if len(rows) > max_rows:
            lines.append(f"... {len(rows) - max_rows} more transfers (--json for all)")
    elif not plan.parts:
        lines.append("nothing to offload: the model fits the budget")
    for label, part, names in plan.parts:  # each If branch, planned as a graph of its own
        if isinstance(part, Plan):
            lines.append(f"{label} (its own plan, {len(names)} nodes):")
            lines += ["  " + line for line in format_plan(part, names,
                                                           max_rows=max_rows).splitlines()]
    return "\n".join(lines)


def moe_to_dict(layers: tuple[MoELayer, ...]) -> dict[str, Any] | None:
    """The ``moe`` field of ``plan --json``: the MoE layers found (None: none)."""
    if not layers:
        return None
    return {"layers": [x.as_dict() for x in layers],
            "experts": sum(len(x.experts) for x in layers),
            "bytes": sum(x.nbytes for x in layers),
            "per_token_bytes": sum(x.per_token_bytes or 0 for x in layers)}


def format_moe(layers: tuple[MoELayer, ...]) -> str:
    """One line of what ``plan`` recognised as a mixture of experts ("" when none)."""
    if not layers:
        return ""
    per_layer = sorted({len(x.experts) for x in layers})
    ks = sorted({x.top_k for x in layers}, key=lambda k: (k is None, k))
    forms = sorted({x.form for x in layers})
    per_token = sum(x.per_token_bytes or 0 for x in layers)
    return (f"mixture of experts: {len(layers)} layers, "
            f"{'/'.join(map(str, per_layer))} experts, "
            f"top-k {'/'.join('?' if k is None else str(k) for k in ks)}, "
            f"{format_bytes(sum(x.nbytes for x in layers))} of expert weights "
            f"({format_bytes(per_token)} per token at top-k; {', '.join(forms)})")
