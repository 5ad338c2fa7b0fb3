"""The planner against the proven optimum of its own plan space, on the bench decoders.

For each decoder of :func:`models.decoder.build_decoder` (fp16, batch 1, the ``h100``
preset's analytic costs) and budget (a fraction of the unmodified tensor peak, the arena
not refitted: ``arena_refits=0``), three plans of :func:`ho_onnx.schedule.planner.plan`:

* ``greedy``: the greedy selection and placement (``refine_s=0``)
* ``refined``: then the local search (``refine_s``, default 0.5 s)
* ``exact``: then CP-SAT over the same space (``exact_s``), seeded by the refined plan

and the lower bound (the solver's; ``optimal`` where it proved its plan) with each plan's
ratio to it, and planning seconds. Budgets below the smallest the planner meets are listed
as infeasible with that floor. Prints a table; ``--json`` (default
``bench/results/planner_gap.json``) writes the rows.

    python bench/planner_gap.py
    python bench/planner_gap.py --configs 2x512x512 8x1024x1024 --exact-s 60
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ho_onnx.cost import analytic_costs, load_machine  # noqa: E402
from ho_onnx.cost.model import CostModel  # noqa: E402
from ho_onnx.graph.analyse import analyse  # noqa: E402
from ho_onnx.graph.load import load_model  # noqa: E402
from ho_onnx.schedule.options import OffloadOptions  # noqa: E402
from ho_onnx.schedule.planner import InfeasibleBudgetError, plan  # noqa: E402
from ho_onnx.schedule.simulate import simulate  # noqa: E402
from models.decoder import build_decoder  # noqa: E402

CONFIGS = ["2x512x512", "2x1024x512", "4x512x1024", "4x1024x512", "8x512x512", "8x1024x1024"]


def _timed(a, opts, costs):
    t = time.perf_counter()
    p = plan(a, opts, costs, {})
    return p, time.perf_counter() - t


def run_config(cfg: str, work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    layers, hidden, seq = (int(x) for x in cfg.split("x"))
    src = work / f"d{cfg}.onnx"
    build_decoder(src, layers=layers, hidden=hidden, heads=8, vocab=args.vocab, seq=seq,
                  batch=1, dtype="float16", external_data=True)
    a = analyse(load_model(src).model, {})
    m = load_machine(args.machine)
    costs = CostModel(analytic_costs(a, m, {}).seconds, m.transfer_time)
    base = simulate(a, None, costs.compute_s, costs.transfer_time, {})
    rows = []
    for frac in args.budgets:
        row: dict[str, Any] = {"config": cfg, "layers": layers, "hidden": hidden, "seq": seq,
                               "nodes": len(a.order), "budget_frac": frac,
                               "budget_bytes": int(base.peak_bytes * frac),
                               "baseline_peak_bytes": base.peak_bytes,
                               "compute_s": float(costs.compute_s.sum())}
        opts = OffloadOptions(budget=row["budget_bytes"], arena_refits=0,
                              refine_s=args.refine_s)
        try:
            g, tg = _timed(a, OffloadOptions(budget=row["budget_bytes"], arena_refits=0,
                                             refine_s=0.0), costs)
        except InfeasibleBudgetError as e:
            rows.append(row | {"infeasible": True, "min_budget_bytes": e.min_budget})
            continue
        r, tr = _timed(a, opts, costs)
        x, tx = _timed(a, OffloadOptions(budget=row["budget_bytes"], arena_refits=0,
                                         refine_s=args.refine_s, exact_s=args.exact_s), costs)
        assert g.bound and r.bound and x.bound
        b = x.bound.seconds
        row |= {"infeasible": False, "greedy_s": g.planned.total_s,
                "refined_s": r.planned.total_s, "exact_s": x.planned.total_s,
                "bound_s": b, "bound_kind": x.bound.kind, "weak_bound_s": r.bound.seconds,
                "status": x.improved.rpartition("exact: ")[2],
                "greedy_x": g.planned.total_s / b, "refined_x": r.planned.total_s / b,
                "exact_x": x.planned.total_s / b,
                "plan_s": {"greedy": tg, "refined": tr, "exact": tx},
                "peak_bytes": {"greedy": g.planned.peak_bytes, "refined": r.planned.peak_bytes,
                               "exact": x.planned.peak_bytes}}
        rows.append(row)
    return rows


def _line(r: dict[str, Any]) -> str:
    head = f"{r['config']:>12} {r['nodes']:>5} {r['budget_frac']:>4.0%}"
    if r["infeasible"]:
        floor = r["min_budget_bytes"] / r["baseline_peak_bytes"]
        return head + f"  infeasible (floor {floor:.0%} of the peak)"
    ms = {k: r[k] * 1e3 for k in ("greedy_s", "refined_s", "exact_s", "bound_s")}
    return (head + f" {ms['greedy_s']:>8.3f} {ms['refined_s']:>8.3f} {ms['exact_s']:>8.3f} "
            f"{ms['bound_s']:>8.3f} {r['greedy_x']:>6.3f} {r['refined_x']:>6.3f} "
            f"{r['exact_x']:>6.3f} {r['plan_s']['refined']:>6.2f} {r['plan_s']['exact']:>6.2f}"
            f"  {r['status']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="+", default=CONFIGS, help="LAYERSxHIDDENxSEQ")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--machine", default="h100")
    ap.add_argument("--refine-s", type=float, default=OffloadOptions.refine_s)
    ap.add_argument("--exact-s", type=float, default=30.0)
    ap.add_argument("--json", type=Path, default=ROOT / "bench/results/planner_gap.json")
    args = ap.parse_args(argv)
    print(f"fp16 decoders, machine {args.machine}, budget = fraction of the tensor peak "
          f"(arena_refits 0); times in ms (predicted); x: ratio to the lower bound")
    print(f"{'LxHxS':>12} {'nodes':>5} {'bud':>4} {'greedy':>8} {'refined':>8} {'exact':>8} "
          f"{'bound':>8} {'g/b':>6} {'r/b':>6} {'e/b':>6} {'r s':>6} {'e s':>6}  exact")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ho_planner_gap_") as tmp:
        for cfg in args.configs:
            for r in run_config(cfg, Path(tmp), args):
                rows.append(r)
                print(_line(r), flush=True)
    ok = [r for r in rows if not r["infeasible"]]
    worst = max((r["exact_x"] for r in ok), default=float("nan"))
    print(f"worst final/bound: {worst:.3f} (goal <= 1.05); worst greedy/bound: "
          f"{max((r['greedy_x'] for r in ok), default=float('nan')):.3f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "python": platform.python_version(), "rows": rows,
        "worst_exact_x": worst}, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
