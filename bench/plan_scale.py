"""How planning time grows with the graph: decoders of increasing depth, phase by phase.

Issue 3's target: planning a 10,000-node graph takes under 10 s and grows near-linearly
with node count. A :func:`models.decoder.build_decoder` layer is ~31 nodes, so 10,000
nodes is 322 layers (10,008 nodes). The models are written with external data (no weight
bytes are read while planning) and a small hidden size: planning cost depends on the node
count, not on tensor sizes.

Phases, each timed on its own (best of ``--repeat``):

* ``load+analyse``: :func:`ho_onnx.graph.load.load_model` + :func:`ho_onnx.graph.analyse.analyse`
* ``costs``: :func:`ho_onnx.cost.analytic.analytic_costs` on the ``cpu`` preset
* ``plan``: :func:`ho_onnx.schedule.planner.plan` at ``--frac`` of the baseline peak (so the
  planner has real work: many offloads, a full placement pass and two simulations), with
  up to ``--arena-refits`` more plans while ORT's replayed arena exceeds the budget
* ``insert``: :func:`ho_onnx.rewrite.insert.insert_cache_ops` (in place, on a fresh analysis
  each repetition)
* ``verify``: :func:`ho_onnx.rewrite.invariants.check_schedule` on the rewritten model (the
  check production runs after every insertion)
* ``save``: :func:`ho_onnx.rewrite.place.place_weight_data` + :func:`ho_onnx.graph.save.save_model`
  (the ``onnx_ir`` model serialised and written; the data file is linked/copied)

Prints a table (layers, nodes, seconds per phase, total, µs per node), a least-squares fit
of total seconds against nodes (slope, intercept, and the exponent ``b`` of
``t ∝ nodes^b`` from a log-log fit: ``b ≈ 1`` is linear) and the predicted time at 10,000
nodes; ``--json PATH`` writes the same figures. ``--profile N`` runs cProfile over the
phases of the N-layer model and prints the hottest functions.

    python bench/plan_scale.py                      # 10 20 40 80 161 322 644 layers
    python bench/plan_scale.py --layers 80 322 --json plan_scale.json
    python bench/plan_scale.py --layers 322 --profile 322
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import platform
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ho_onnx.cost import analytic_costs, load_machine  # noqa: E402
from ho_onnx.cost.model import CostModel  # noqa: E402
from ho_onnx.graph.analyse import analyse  # noqa: E402
from ho_onnx.graph.load import load_model  # noqa: E402
from ho_onnx.graph.save import save_model  # noqa: E402
from ho_onnx.rewrite.insert import insert_cache_ops  # noqa: E402
from ho_onnx.rewrite.invariants import check_schedule  # noqa: E402
from ho_onnx.rewrite.place import place_weight_data  # noqa: E402
from ho_onnx.schedule.options import OffloadOptions  # noqa: E402
from ho_onnx.schedule.planner import Plan, plan  # noqa: E402
from ho_onnx.schedule.simulate import simulate  # noqa: E402
from models.decoder import build_decoder  # noqa: E402

PHASES = ("load+analyse", "costs", "plan", "insert", "verify", "save")
TARGET_NODES = 10_000
TARGET_S = 10.0


def _best(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    best, out = math.inf, None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def run_one(layers: int, work: Path, args: argparse.Namespace,
            profiler: cProfile.Profile | None = None) -> dict[str, Any]:
    src = work / f"dec{layers}.onnx"
    build_decoder(src, layers=layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab,
                  external_data=True)
    dims = {"batch": args.batch, "seq": args.seq}
    machine = load_machine(args.machine)
    sec: dict[str, float] = {}
    if profiler is not None:
        profiler.enable()

    def load_analyse():
        loaded = load_model(src)
        return loaded, analyse(loaded.model, dims)

    sec["load+analyse"], (loaded, a) = _best(load_analyse, args.repeat)
    sec["costs"], nc = _best(lambda: analytic_costs(a, machine, dims), args.repeat)
    compute_s, tt = nc.seconds, machine.transfer_time
    base = simulate(a, None, compute_s, tt, dims)
    opts = OffloadOptions(budget=max(1, int(base.peak_bytes * args.frac)), min_bytes=args.min_bytes,
                          arena_refits=args.arena_refits, refine_s=args.refine_s)
    sec["plan"], p = _best(lambda: plan(a, opts, CostModel(compute_s, tt), dims), args.repeat)
    assert isinstance(p, Plan)
    # insertion works in place: each repetition rewrites a freshly loaded and analysed model
    fresh = [load_analyse() for _ in range(args.repeat)]
    it = iter(fresh)
    sec["insert"], rw = _best(lambda: insert_cache_ops(next(it)[1], p.choice), args.repeat)
    sec["verify"], _ = _best(lambda: check_schedule(rw.model), args.repeat)
    loaded = fresh[-1][0]
    out = work / f"dec{layers}.ho.onnx"
    sec["save"], _ = _best(lambda: save_model(place_weight_data(rw, loaded.base_dir, out),
                                              loaded, out), args.repeat)
    if profiler is not None:
        profiler.disable()
    n = len(a.order)
    total = sum(sec.values())
    return {
        "layers": layers, "nodes": n, "tensors": len(a.tensors), "seconds": sec,
        "total_s": total, "us_per_node": total / n * 1e6,
        "budget_bytes": opts.budget, "baseline_peak_bytes": base.peak_bytes,
        "planned_peak_bytes": p.planned.peak_bytes, "arena_refits": args.arena_refits,
        "predicted_arena_bytes": p.arena_bytes, "planned_for_bytes": p.planned_for,
        "refine": p.improved, "greedy_s": p.greedy_s, "planned_s": p.planned.total_s,
        "offloaded_weights": len(p.choice.weights),
        "offloaded_activations": len(p.choice.activations),
        "transfers": len(p.planned.transfers), "cache_nodes": rw.cache_nodes,
    }


def fit(rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], float]) -> dict[str, float]:
    """Least squares ``t = slope·n + intercept`` and log-log exponent ``b`` of ``t ∝ n^b``."""
    n = np.array([r["nodes"] for r in rows], dtype=np.float64)
    t = np.array([key(r) for r in rows], dtype=np.float64)
    slope, icpt = np.polyfit(n, t, 1) if len(n) > 1 else (t[0] / n[0], 0.0)
    ok = t > 0
    b = float(np.polyfit(np.log(n[ok]), np.log(t[ok]), 1)[0]) if ok.sum() > 1 else 1.0
    # local exponent between the two largest graphs (what the next doubling will cost)
    b_top = float(math.log(t[-1] / t[-2]) / math.log(n[-1] / n[-2])) if len(n) > 1 and \
        t[-2] > 0 and n[-1] != n[-2] else b
    return {"slope_s_per_node": float(slope), "intercept_s": float(icpt), "exponent": b,
            "exponent_top": b_top, "at_10k_s": float(slope * TARGET_NODES + icpt)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[10, 20, 40, 80, 161, 322, 644])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--frac", type=float, default=0.5,
                    help="budget as a fraction of the baseline peak (default 0.5)")
    ap.add_argument("--min-bytes", type=int, default=0,
                    help="planner min_bytes (default 0: every tensor is a candidate)")
    ap.add_argument("--arena-refits", type=int, default=OffloadOptions.arena_refits,
                    help="plans again while ORT's replayed arena exceeds the budget, at most "
                         "this many times (default %(default)s; 0: the tensor count only, as "
                         "the planner before it, for side-by-side runs with older trees)")
    ap.add_argument("--refine-s", type=float, default=OffloadOptions.refine_s,
                    help="seconds of refinement after the greedy (default %(default)s; 0: off)")
    ap.add_argument("--machine", default="cpu")
    ap.add_argument("--repeat", type=int, default=3, help="best of N per phase (default 3)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--profile", type=int, metavar="LAYERS",
                    help="cProfile the phases of this many layers and print the top functions")
    args = ap.parse_args(argv)

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ho_plan_scale_") as tmp:
        work = Path(tmp)
        hdr = (f"{'layers':>6} {'nodes':>6} " + " ".join(f"{p:>12}" for p in PHASES)
               + f" {'total s':>8} {'us/node':>8} {'offloads':>8} {'transfers':>9}")
        print(f"decoder hidden={args.hidden} seq={args.seq}, budget {args.frac:.0%} of "
              f"baseline peak, machine {args.machine}; seconds per phase")
        print(hdr)
        for layers in sorted(args.layers):
            r = run_one(layers, work, args)
            rows.append(r)
            print(f"{r['layers']:>6} {r['nodes']:>6} "
                  + " ".join(f"{r['seconds'][p]:>12.3f}" for p in PHASES)
                  + f" {r['total_s']:>8.3f} {r['us_per_node']:>8.1f} "
                  f"{r['offloaded_weights'] + r['offloaded_activations']:>8} "
                  f"{r['transfers']:>9}", flush=True)
        f_total = fit(rows, lambda r: r["total_s"])
        f_plan = fit(rows, lambda r: r["seconds"]["plan"])
        print(f"\ntotal: {f_total['slope_s_per_node'] * 1e6:.1f} us/node + "
              f"{f_total['intercept_s']:.3f} s; t ~ nodes^{f_total['exponent']:.2f} "
              f"(largest step: ^{f_total['exponent_top']:.2f}); "
              f"predicted at {TARGET_NODES:,} nodes: {f_total['at_10k_s']:.2f} s")
        print(f"plan:  {f_plan['slope_s_per_node'] * 1e6:.1f} us/node + "
              f"{f_plan['intercept_s']:.3f} s; t ~ nodes^{f_plan['exponent']:.2f} "
              f"(largest step: ^{f_plan['exponent_top']:.2f})")
        big = [r for r in rows if r["nodes"] >= TARGET_NODES]
        at10k = big[0]["total_s"] if big else f_total["at_10k_s"]
        linear = f_total["exponent"] < 1.25 and f_total["exponent_top"] < 1.35
        verdict = {
            "under_10s_at_10k": bool(at10k < TARGET_S),
            "measured_at_10k": bool(big),
            "seconds_at_10k": at10k,
            "near_linear": bool(linear),
        }
        print(f"verdict: {'measured' if big else 'extrapolated'} {at10k:.2f} s at "
              f"{big[0]['nodes'] if big else TARGET_NODES:,} nodes "
              f"({'under' if verdict['under_10s_at_10k'] else 'OVER'} {TARGET_S:.0f} s); "
              f"growth {'near-linear' if linear else 'SUPER-LINEAR'}")

        if args.profile:
            prof = cProfile.Profile()
            run_one(args.profile, work, args, prof)
            s = io.StringIO()
            st = pstats.Stats(prof, stream=s).sort_stats("cumulative")
            st.print_stats(25)
            st.sort_stats("tottime").print_stats(15)
            print(s.getvalue())

    if args.json:
        args.json.write_text(json.dumps({
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "python": platform.python_version(), "machine": platform.machine(),
            "rows": rows, "fit_total": f_total, "fit_plan": f_plan, "verdict": verdict,
        }, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
