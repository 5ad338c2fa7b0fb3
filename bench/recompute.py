"""Recomputation against storing (issue 38, item 5): the same budget planned with
``recompute`` off, auto and on, predicted on the CPU (or ``--machine``) and the H100 preset,
and run on this CPU or, ``--device cuda``, on a GPU (a larger decoder there).

The model is ``models.decoder``'s GQA decoder with Optimum's cache layout, planned for a
prefill chunk over a history (``--seq`` new tokens, ``--past`` cached), activations only
(``weights=False``: the weights stay resident, so every row runs ORT's kernels on the same
bytes as the unmodified model and its outputs must be bit-exact with it). The budget is
``--fraction`` of the unmodified tensor peak, or the smallest budget the activations alone
can meet where that is higher. Per row: what the planner stored and what it
recomputed, its predicted time and peak; on the CPU (``--runs`` timed runs after one warm-up,
each row in a fresh session with its own arena, ``cpu_arena="ort"``): the median run time,
ORT's arena ``MaxInUse`` (sampled by the library at every Wait: a row without a Wait
reports none) and the bytes the library stored per run. Prints a table; ``--json`` writes
every number.

    python bench/recompute.py [--fraction 0.7] [--runs 5] [--json out.json]
    python bench/recompute.py --device cuda --machine h100 --json out.json   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MIB = 1 << 20
CUDA_EP = "CUDAExecutionProvider"
# The decoder per device: small enough for this 2-core VM; on a GPU large enough that the
# stored activations' copies over the link show (8 MiB to 32 MiB each).
CFGS = {
    "cpu": {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 1024, "vocab": 8192,
            "seq": 512, "past": 2048},
    "cuda": {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 4, "ffn": 4096,
             "vocab": 32000, "seq": 1024, "past": 4096},
}


def build(work: Path, cfg: dict[str, int]) -> Path:
    """The decoder (random weights, seeded), once per folder and configuration."""
    from models.decoder import build_decoder

    path = work / f"decoder_{cfg['layers']}x{cfg['hidden']}.onnx"
    if not path.exists():
        build_decoder(str(path), **{k: cfg[k] for k in ("layers", "hidden", "heads",
                                                         "kv_heads", "ffn", "vocab")},
                      kv_cache=True, cache_layout="optimum", seq="seq",
                      max_positions=cfg["seq"] + cfg["past"], external_data=True)
    return path


def feeds(path: Path, dims: dict[str, int], vocab: int) -> dict[str, Any]:
    """Seeded inputs at ``dims``: token ids and a past cache."""
    import numpy as np
    import onnx

    rng = np.random.default_rng(0)
    out: dict[str, Any] = {}
    for vi in onnx.load(str(path), load_external_data=False).graph.input:
        shape = [d.dim_value or dims[d.dim_param] for d in vi.type.tensor_type.shape.dim]
        if vi.type.tensor_type.elem_type == onnx.TensorProto.INT64:
            out[vi.name] = rng.integers(0, vocab, shape, dtype=np.int64)
        else:
            out[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return out


def measure(path: Path, x: dict[str, Any], runs: int, optimized: bool, device: str
            ) -> dict[str, Any]:
    """Median run time, ORT's arena MaxInUse (library-sampled) and bytes stored per run; on
    CUDA refused unless the session runs on CUDAExecutionProvider."""
    import onnxruntime as ort

    from ho_onnx import _ops
    from ho_onnx.contract import CONFIG_SAMPLE_ARENA
    from ho_onnx.target.ort import runtime

    providers = [CUDA_EP] if device == "cuda" else ["CPUExecutionProvider"]
    so = ort.SessionOptions()
    so.add_session_config_entry(CONFIG_SAMPLE_ARENA, "1")
    sess = runtime.InferenceSession(str(path), sess_options=so, cpu_arena="ort",
                                    providers=providers) if optimized \
        else ort.InferenceSession(str(path), providers=providers)
    if device == "cuda" and sess.get_providers()[0] != CUDA_EP:
        raise SystemExit(f"recompute: the session runs on {sess.get_providers()}, not {CUDA_EP}")
    out = sess.run(None, x)
    _ops.reset_counters()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, x)
        times.append(time.perf_counter() - t0)
    c = _ops.counters()
    return {"run_s": statistics.median(times), "runs_s": times,
            "arena_max_in_use": c["ort_arena_max_in_use"] if c["ort_arena_max_in_use"] >= 0
            else None, "stored_bytes_per_run": c["bytes_stored"] // runs,
            "outputs": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=sorted(CFGS), default="cpu",
                    help="where the rows run (cuda: CUDAExecutionProvider, checked)")
    ap.add_argument("--machine", default=None,
                    help="the measured rows' cost model (default: cpu, or h100 with --device "
                         "cuda; a file from `ho-onnx calibrate`); h100 is also planned")
    ap.add_argument("--fraction", type=float, default=0.7)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--past", type=int, default=None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--workdir")
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    import numpy as np

    from ho_onnx import OffloadOptions, optimize
    from ho_onnx.cost.source import CostSource
    from ho_onnx.rewrite.pipeline import plan_model
    from ho_onnx.schedule.planner import InfeasibleBudgetError

    cfg = dict(CFGS[a.device], **{k: v for k, v in (("seq", a.seq), ("past", a.past))
                                   if v is not None})
    measured = a.machine or ("h100" if a.device == "cuda" else "cpu")
    work = Path(a.workdir or tempfile.mkdtemp(prefix="ho_recompute_"))
    work.mkdir(parents=True, exist_ok=True)
    src = build(work, cfg)
    dims = {"batch": 1, "seq": cfg["seq"], "past": cfg["past"]}
    x = feeds(src, dims, cfg["vocab"])
    ref = measure(src, x, a.runs, optimized=False, device=a.device)
    rows: list[dict[str, Any]] = []
    for machine in dict.fromkeys((measured, "h100")):
        costs = CostSource(machine)
        base = plan_model(src, OffloadOptions(budget=1 << 40), dims, costs)[2].baseline
        budget = int(base.peak_bytes * a.fraction)
        try:
            plan_model(src, OffloadOptions(budget=budget, weights=False, recompute="off"),
                       dims, costs)
        except InfeasibleBudgetError as e:  # (below what the activations alone can free)
            budget = int(e.min_budget)
        for mode in ("off", "auto", "on"):
            opts = OffloadOptions(budget=budget, weights=False, recompute=mode)
            _, an, p = plan_model(src, opts, dims, costs)
            c = p.choice
            row: dict[str, Any] = {
                "machine": machine, "recompute": mode, "budget_bytes": budget,
                "baseline_s": base.total_s, "predicted_s": p.planned.total_s,
                "predicted_peak_bytes": p.planned.peak_bytes, "arena_bytes": p.arena_bytes,
                "host_bytes": p.host_bytes,
                "stored": [s.name for s in c.activations],
                "recomputed": [{"name": r.name, "nodes": [an.nodes[i].op_type for i in r.nodes],
                                "bytes": r.nbytes} for r in c.recomputes],
                "recompute_skipped": dict(c.recompute_skipped)}
            if machine == measured:
                dst = work / f"{Path(machine).stem}_{mode}" / "model.onnx"
                optimize(src, dst, opts, dims, costs=costs)
                got = measure(dst, x, a.runs, optimized=True, device=a.device)
                row["exact"] = all(np.array_equal(g, r) for g, r in zip(
                    got.pop("outputs"), ref["outputs"], strict=True))
                row.update(got)
            rows.append(row)
    ref.pop("outputs")
    doc = {"device": a.device, "config": cfg, "dims": dims, "fraction": a.fraction,
           "runs": a.runs, "unmodified": ref, "rows": rows}
    print(f"{'machine':<8}{'recompute':<10}{'stored':>7}{'recomp.':>8}{'pred ms':>10}"
          f"{'x base':>8}{'host MiB':>9}{'run ms':>9}{'arena MiB':>10}  exact")
    for r in rows:
        run = f"{r['run_s'] * 1e3:9.1f}" if "run_s" in r else f"{'-':>9}"
        arena = f"{r['arena_max_in_use'] / MIB:10.1f}" if r.get("arena_max_in_use") else \
            f"{'-':>10}"
        print(f"{Path(r['machine']).stem[:8]:<8}{r['recompute']:<10}{len(r['stored']):>7}"
              f"{len(r['recomputed']):>8}{r['predicted_s'] * 1e3:10.3f}"
              f"{r['predicted_s'] / r['baseline_s']:8.3f}{r['host_bytes'] / MIB:9.2f}"
              f"{run}{arena}  {r.get('exact', '-')}")
    print(f"unmodified ({a.device}): {ref['run_s'] * 1e3:.1f} ms")
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if all(r.get("exact", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
