"""Process memory over a long decode (stop 50): does a generation loop's memory stay flat?

A decode step asks ORT's arena for a KV cache one position longer than the last step's. An
arena grown by what is requested (ho-onnx's shared CPU arena, ``cpu_arena="as_requested"``)
keeps a region for every request larger than what it holds free, so unless it is shrunk
after every run it grows with every step; ORT's own arena grows by powers of two, whose free
chunks serve the next, slightly larger request. Each row is a child process running a
prefill of ``--ctx`` tokens (in ``--chunk``-token runs) and ``--steps`` decode steps of
``models.decoder``'s decoder (Optimum's cache layout, random weights), in one of two loops:

* ``numpy``: as Optimum's ``ORTModelForCausalLM`` runs on the CPU: ``session.run`` with the
  past as numpy inputs, the presents ORT allocated fed back as the next past;
* ``greedy``: ``ho_onnx.target.ort.generate``'s loop (the cache in ``KvBuffers``; ORT's
  arenas grown by what is requested shrunk after every run unless ``--no-shrink`` rows).

Models: the unmodified decoder (onnxruntime's own session), every weight offloaded
(``weights``), the KV cache offloaded (``kv``; one range plan each). Arenas: ``auto`` (the
default: ORT's own for a model with symbolic input dims) and ``as_requested``. Reported per
row: RSS after the prefill and after the decode (MiB), its growth per step (KiB), decode
tokens/s. Prints a table; ``--json`` writes every number.

    python bench/decode_memory.py [--layers 8] [--hidden 256] [--ctx 2048] [--steps 255]
        [--chunk 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
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


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _numpy_loop(sess: Any, layout: Any, prompt: list[int], chunk: int, steps: int,
                on_prefill: Any) -> None:
    """Optimum's way: numpy pasts in, the presents ORT allocated fed back."""
    from ho_onnx.target.ort.generate import empty_pasts, run_numpy

    past, token = empty_pasts(layout), 0
    for lo in range(0, len(prompt), chunk):
        token, past = run_numpy(sess, layout, past, prompt[lo:lo + chunk])
    on_prefill()
    for _ in range(steps):
        token, past = run_numpy(sess, layout, past, [token])


def _greedy_loop(sess: Any, layout: Any, prompt: list[int], chunk: int, steps: int,
                 on_prefill: Any, shrink: bool) -> None:
    from ho_onnx.target.ort.generate import (
        KvBuffers,
        _step,
        grown_as_requested,
        prefill,
        shrink_options,
    )

    opts = shrink_options(grown_as_requested(sess)) if shrink else None
    cache = KvBuffers(layout, len(prompt) + steps + 1)
    binding = sess.io_binding()
    token = prefill(sess, binding, layout, cache, prompt, chunk, opts)
    on_prefill()
    for _ in range(steps):
        token = _step(sess, binding, layout, cache, [token], opts)


def child(cfg: dict[str, Any]) -> None:
    """One row: print one JSON line."""
    import numpy as np
    import onnxruntime as ort

    import ho_onnx
    from ho_onnx.target.ort.generate import kv_layout

    if cfg["model_kind"] == "unmodified":
        sess = ort.InferenceSession(cfg["model"], providers=["CPUExecutionProvider"])
    else:
        sess = ho_onnx.InferenceSession(cfg["model"], cpu_arena=cfg["arena"])
    layout = kv_layout(cfg["model"])
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, cfg["vocab"], cfg["ctx"])]
    mark: dict[str, float] = {}

    def on_prefill() -> None:
        mark["rss"], mark["t"] = _rss_mib(), time.perf_counter()

    if cfg["loop"] == "numpy":
        _numpy_loop(sess, layout, prompt, cfg["chunk"], cfg["steps"], on_prefill)
    else:
        _greedy_loop(sess, layout, prompt, cfg["chunk"], cfg["steps"], on_prefill,
                     cfg["shrink"])
    dt = time.perf_counter() - mark["t"]
    end = _rss_mib()
    print(json.dumps({"rss_prefill_mib": mark["rss"], "rss_end_mib": end,
                      "growth_kib_per_step": (end - mark["rss"]) * 1024 / cfg["steps"],
                      "tok_s": cfg["steps"] / dt}), flush=True)


def prepare(work: Path, a: argparse.Namespace) -> dict[str, Path]:
    """The decoder and its two optimized versions (one range plan each)."""
    from ho_onnx import OffloadOptions, optimize
    from models.decoder import build_decoder_once

    top = a.ctx + a.steps + a.chunk
    src, _ = build_decoder_once(work, {
        "layers": a.layers, "hidden": a.hidden, "heads": 4, "kv_heads": 4,
        "ffn": 4 * a.hidden, "vocab": a.vocab, "dtype": "float32", "seq": "seq",
        "batch": "batch", "kv_cache": True, "cache_layout": "optimum", "past": "past",
        "max_positions": top})
    ranges = {"batch": (1, 1), "seq": (1, a.chunk), "past": (0, a.ctx + a.steps)}
    out = {"unmodified": src}
    for kind, opts in (("weights", OffloadOptions(activations=False)),
                       ("kv", OffloadOptions(kv=True, weights=False, activations=False))):
        out[kind] = src.with_name(f"decoder.{kind}.onnx")
        if not out[kind].exists():
            optimize(src, out[kind], opts, {}, dim_ranges=ranges)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=255)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--workdir")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.child:
        child(json.loads(a.child))
        return 0
    work = Path(a.workdir or tempfile.mkdtemp(prefix="ho_decode_memory_"))
    models = prepare(work, a)
    rows: list[dict[str, Any]] = []
    plan = [("unmodified", "numpy", "ort", True), ("unmodified", "greedy", "ort", True)]
    for kind in ("weights", "kv"):
        for loop in ("numpy", "greedy"):
            for arena in ("auto", "as_requested"):
                plan.append((kind, loop, arena, True))
        plan.append((kind, "greedy", "as_requested", False))
    print(f"{'model':<11}{'loop':<8}{'arena':<14}{'shrink':<8}{'RSS prefill':>12}"
          f"{'RSS end':>9}{'KiB/step':>10}{'tok/s':>8}")
    for kind, loop, arena, shrink in plan:
        cfg = {"model": str(models[kind]), "model_kind": kind, "loop": loop, "arena": arena,
               "shrink": shrink, "ctx": a.ctx, "steps": a.steps, "chunk": a.chunk,
               "vocab": a.vocab}
        p = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)],
                           capture_output=True, text=True, timeout=3600)
        row = {k: v for k, v in cfg.items() if k != "model"}
        if p.returncode != 0:
            row["error"] = (p.stderr.strip().splitlines() or ["?"])[-1][:200]
            print(f"{kind:<11}{loop:<8}{arena:<14}{shrink!s:<8}  error: {row['error']}")
        else:
            row.update(json.loads(p.stdout.strip().splitlines()[-1]))
            print(f"{kind:<11}{loop:<8}{arena:<14}{(shrink if loop == 'greedy' else '-')!s:<8}"
                  f"{row['rss_prefill_mib']:>12.0f}{row['rss_end_mib']:>9.0f}"
                  f"{row['growth_kib_per_step']:>10.0f}{row['tok_s']:>8.1f}", flush=True)
        rows.append(row)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
