"""The decode cache (issue 36, item 3): decode steps of one range plan on the disk tier with
and without the streamed weights kept across runs, against the unmodified model.

One model (``models.decoder``, random weights, fp32, a KV cache in Optimum's layout), one
range plan (``seq`` 1..``--chunk``, ``past`` 0..context + new tokens; a named point
``decode``: seq 1 at the top of the past range) under a budget that is ``--fraction`` of the
unmodified model's peak at the top of the ranges, weights on the disk tier (read from the
data file with O_DIRECT at every reload), with ``--offload-kv`` the KV cache in host memory.
Rows, each in its own process, one after the other, ``--rounds`` times interleaved:

* ``ort``: onnxruntime on the unmodified model (everything resident);
* ``ho disk``: the plan with ``decode_cache=False`` (every reload read from the file);
* ``ho disk + cache``: the same plan with the decode cache (the weights the decode point's
  room keeps, and the reads ahead the planner gives part of that room to).

Per row: time to first token (the prompt prefilled in chunks), decode tokens/s over
``--new-tokens`` steps, bytes read from the file per decode step (the library's counters),
the cache's bytes after the last step, the predicted per-token time at the decode point (the
plan's simulation, ``ho_onnx.range_points``), and whether the greedy tokens are the unmodified
model's, and the child process's peak RSS (the library's cache is on top of what ORT's arena
keeps from the prefill: the cache is opt-in). Prints a table; ``--json`` writes every
number.

    python bench/decode_cache.py [--layers 4] [--hidden 512] [--context 1024] [--chunk 256]
        [--new-tokens 32] [--fraction 0.5] [--offload-kv] [--machine cpu|FILE] [--rounds 3]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MIB = 1 << 20
ROWS = ("ort", "ho disk", "ho disk + cache")


def _ranges(args: argparse.Namespace) -> tuple[dict, dict]:
    top = args.context + args.new_tokens
    return ({"batch": (1, 1), "seq": (1, args.chunk), "past": (0, top)},
            {"decode": {"seq": 1, "past": top}})


def prepare(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The model and its two plans (with and without the cache); what the plans predict."""
    from ho_onnx.cost.source import CostSource
    from ho_onnx.rewrite.pipeline import optimize, range_points
    from ho_onnx.schedule.options import OffloadOptions
    from models.decoder import build_decoder

    src = work / "dec.onnx"
    build_decoder(src, external_data=True, kv_cache=True, layers=args.layers,
                  hidden=args.hidden, heads=args.heads, vocab=args.vocab,
                  max_positions=args.context + args.new_tokens + args.chunk)
    ranges, points = _ranges(args)
    from ho_onnx.graph.load import load_model

    loaded = load_model(src)
    from ho_onnx.schedule.types import OffloadChoice

    top = range_points(loaded, OffloadChoice(), {}, ranges, None, points)["top"]
    budget = int(top.unmodified * args.fraction)
    out: dict[str, Any] = {"budget": budget, "unmodified_peak": top.unmodified, "plans": {}}
    for row, cache in (("ho disk", False), ("ho disk + cache", True)):
        path = work / f"{'cache' if cache else 'plain'}.ho.onnx"
        r = optimize(src, path, OffloadOptions(budget=budget, weight_tier="disk",
                                               decode_cache=cache, kv=args.offload_kv),
                     {}, dim_ranges=ranges, dim_points=points,
                     costs=CostSource(machine=args.machine))
        dc = r.choice.decode_cache
        out["plans"][row] = {
            "path": str(path), "offloaded_bytes": r.choice.offloaded_bytes,
            "predicted_token_s": r.points["decode"].seconds,
            "predicted_prefill_s": r.points["top"].seconds,
            "cache_at_decode": r.points["decode"].cache,
            "ahead_at_decode": r.points["decode"].ahead,
            "cache_weights": len(dc.weights) if dc else 0,
            "cache_skipped": r.choice.decode_cache_skipped}
    out["src"] = str(src)
    return out


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One row: prefill the prompt, then ``--new-tokens`` decode steps, timed."""
    import numpy as np
    import onnxruntime as ort

    from ho_onnx import InferenceSession, counters, reset_counters
    from ho_onnx.target.ort.generate import KvBuffers, _step, kv_layout, prefill, shrink_options

    path = Path(args.model)
    sess = (ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            if args.row == "ort" else InferenceSession(path))
    layout = kv_layout(path)
    prompt = [int(x) for x in np.random.default_rng(7).integers(1, args.vocab, args.context)]
    cache = KvBuffers(layout, len(prompt) + args.new_tokens, device="cpu")
    binding = sess.io_binding()
    shrink = shrink_options("cpu:0") if args.row != "ort" else None
    reset_counters()
    t0 = time.perf_counter()
    tokens = [prefill(sess, binding, layout, cache, prompt, args.chunk, shrink)]
    ttft = time.perf_counter() - t0
    after_prefill = counters()["bytes_read_disk"]
    t1 = time.perf_counter()
    for _ in range(args.new_tokens - 1):
        tokens.append(_step(sess, binding, layout, cache, [tokens[-1]], shrink))
    decode = time.perf_counter() - t1
    c = counters()
    steps = max(1, args.new_tokens - 1)
    import resource

    return {"ttft_s": ttft, "token_s": decode / steps, "tokens": tokens,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "read_per_step": (c["bytes_read_disk"] - after_prefill) / steps,
            "cache_bytes": c["expert_cache_bytes"]}


def _run_row(args: argparse.Namespace, row: str, model: str) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", row, "--model", model,
            *(f"--{k.replace('_', '-')}={getattr(args, k)}"
              for k in ("context", "chunk", "new_tokens", "vocab"))]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, check=False)
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout).strip().splitlines()[-1][:300]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--machine", default="cpu",
                    help="the plans' machine: a preset or a file from `ho-onnx calibrate`")
    ap.add_argument("--offload-kv", action="store_true",
                    help="the KV cache in host memory too (OffloadOptions.kv)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", choices=ROWS, dest="row", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.row:
        print(json.dumps(child(args)))
        return 0
    with tempfile.TemporaryDirectory(prefix="ho_decode_cache_") as tmp:
        t0 = time.perf_counter()
        info = prepare(args, Path(tmp))
        print(f"prepared in {time.perf_counter() - t0:.1f} s: budget "
              f"{info['budget'] / MIB:.1f} MiB ({args.fraction:.0%} of the unmodified peak "
              f"{info['unmodified_peak'] / MIB:.1f} MiB at the top of the ranges)", flush=True)
        models = {"ort": info["src"], **{k: v["path"] for k, v in info["plans"].items()}}
        runs: dict[str, list[dict[str, Any]]] = {r: [] for r in ROWS}
        for k in range(args.rounds):
            for row in ROWS:
                runs[row].append(_run_row(args, row, models[row]))
                print(f"round {k + 1} {row}: {runs[row][-1].get('error') or 'done'}",
                      flush=True)
    rows = summarize(runs, info)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "info": info,
                                               "runs": runs, "rows": rows}, indent=1))
    return 0 if all(r["tokens"] in ("reference", "= ort") for r in rows) else 1


def summarize(runs: dict[str, list[dict[str, Any]]], info: dict[str, Any]
              ) -> list[dict[str, Any]]:
    """Medians per row, tokens compared with the unmodified model's."""
    ref = next((r["tokens"] for r in runs["ort"] if "tokens" in r), None)
    rows = []
    for row, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        plan = info["plans"].get(row, {})
        med = {k: statistics.median(r[k] for r in ok) if ok else None
               for k in ("ttft_s", "token_s", "read_per_step", "cache_bytes", "peak_rss")}
        rows.append({"row": row, **med, "errors": [r["error"] for r in rs if "error" in r],
                     "predicted_token_s": plan.get("predicted_token_s"),
                     "cache_at_decode": plan.get("cache_at_decode"),
                     "ahead_at_decode": plan.get("ahead_at_decode"),
                     "tokens": "reference" if row == "ort" else (
                         "= ort" if ok and all(r["tokens"] == ref for r in ok) else "DIFFER")})
    base = rows[0]["token_s"]
    for r in rows:
        r["x_ort"] = base / r["token_s"] if base and r["token_s"] else None
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    def f(x: float | None, scale: float = 1.0, fmt: str = "{:.3g}") -> str:
        return "-" if x is None else fmt.format(x * scale)

    print("| row | TTFT s | ms/token | tok/s × ort | MiB read/step | cache MiB | "
          "plan: kept / ahead MiB | predicted ms/token | peak RSS MiB | tokens |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---|")
    for r in rows:
        print(f"| {r['row']} | {f(r['ttft_s'])} | {f(r['token_s'], 1e3)} | "
              f"{f(r['x_ort'], fmt='{:.2f}')} | {f(r['read_per_step'], 1 / MIB, '{:.1f}')} | "
              f"{f(r['cache_bytes'], 1 / MIB, '{:.1f}')} | "
              f"{f(r['cache_at_decode'], 1 / MIB, '{:.1f}')} / "
              f"{f(r['ahead_at_decode'], 1 / MIB, '{:.1f}')} | "
              f"{f(r['predicted_token_s'], 1e3)} | {f(r['peak_rss'], 1 / MIB, '{:.0f}')} | "
              f"{r['tokens']} |")


if __name__ == "__main__":
    raise SystemExit(main())
