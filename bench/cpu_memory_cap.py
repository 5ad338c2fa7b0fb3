"""CPU under a hard memory limit (issue 38): ho-onnx's disk tier against onnxruntime.

A GPT-style decoder (models/decoder.py, float32, no KV cache) runs a prefill (``--seq``
tokens) and decode-sized steps (one token) in child processes, each inside a memory cgroup
(cgroup v1, ``/sys/fs/cgroup/memory``) whose limit is the plan's budget plus a runtime
allowance measured first (the peak of a child that loads onnxruntime and the op library and
runs a tiny model). The page cache is dropped before each child; configurations are
interleaved over ``--rounds``. Rows:

* ``ort``: onnxruntime's CPU session on the unmodified model with pre-packing off (ORT
  memory-maps the external data; under pressure the kernel drops and re-reads its pages);
* ``ho F``: the model optimized with ``--weight-tier disk --offload weights`` for a budget of
  ``F`` of its weight bytes, run by ``ho_onnx.InferenceSession`` (pre-packing on: the
  project's own helper's default); ``ho F -pp`` (``--no-prepack-rows``): the same with
  pre-packing off.

Each child reports its step times and the cgroup's peak (``memory.max_usage_in_bytes``);
a child killed by the limit is reported as ``OOM``. Prints a table; ``--json`` writes every
number. Needs root and a writable cgroup v1 memory hierarchy (else it says so and exits 2).

    python bench/cpu_memory_cap.py [--preset cpu|quick] [--fractions 0.25,0.15]
        [--rounds 2] [--seq 256] [--steps 3] [--workdir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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

CGROUP = Path("/sys/fs/cgroup/memory")
MIB = 1 << 20
PRESETS: dict[str, dict[str, Any]] = {
    # the decoder: 11 layers, hidden 2048, vocabulary 32,000 (2.75 GB of fp32)
    "cpu": {"layers": 11, "hidden": 2048, "heads": 16, "vocab": 32000},
    "small": {"layers": 6, "hidden": 1024, "heads": 16, "vocab": 32000},
    "quick": {"layers": 2, "hidden": 256, "heads": 4, "vocab": 4096},
}


# ---- child ---------------------------------------------------------------------------------


def child(cfg: dict[str, Any]) -> None:
    """Run one configuration; print one JSON line (times in seconds)."""
    import numpy as np
    import onnxruntime as ort

    so = ort.SessionOptions()
    t0 = time.perf_counter()
    if cfg["ho"]:
        from ho_onnx import InferenceSession

        if not cfg.get("prepack", True):
            so.add_session_config_entry("session.disable_prepacking", "1")
        sess = InferenceSession(cfg["model"], sess_options=so,
                                cpu_arena=cfg.get("cpu_arena", "auto"))
    else:
        so.add_session_config_entry("session.disable_prepacking", "1")
        sess = ort.InferenceSession(cfg["model"], so, providers=["CPUExecutionProvider"])
    out: dict[str, Any] = {"session_s": time.perf_counter() - t0}
    for what, seq, n in (("prefill", cfg["seq"], 1), ("decode", 1, cfg["steps"])):
        ids = {"input_ids": (np.arange(seq, dtype=np.int64)[None] * 7) % 1000}
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            sess.run(None, ids)
            times.append(time.perf_counter() - t0)
        out[what + "_s"] = min(times)
    print(json.dumps(out), flush=True)


# ---- parent --------------------------------------------------------------------------------


class Cgroup:
    """One memory cgroup (v1) with a limit; removed on exit."""

    def __init__(self, limit: int | None) -> None:
        self.path = CGROUP / f"ho_cap_{os.getpid()}_{time.monotonic_ns()}"
        self.path.mkdir()
        if limit is not None:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))

    def enter(self) -> None:  # (in the child, before exec)
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def close(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def run_child(cfg: dict[str, Any], limit: int | None) -> dict[str, Any]:
    """``cfg`` in a child inside a cgroup limited to ``limit`` bytes (None: no limit)."""
    drop_page_cache()
    cg = Cgroup(limit)
    try:
        p = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)],
                           preexec_fn=cg.enter, capture_output=True, text=True, timeout=3600)
        row: dict[str, Any] = {"peak_bytes": cg.peak(), "limit_bytes": limit}
    finally:
        cg.close()
    if p.returncode == -signal.SIGKILL:
        row["result"] = "OOM"
    elif p.returncode != 0:
        row["result"] = "error: " + (p.stderr.strip().splitlines() or ["?"])[-1][:200]
    else:
        row.update(json.loads(p.stdout.strip().splitlines()[-1]), result="ok")
    return row


def allowance(work: Path) -> int:
    """The runtime's own bytes: peak of a child running a tiny model with the library."""
    import onnx

    from models.decoder import build_decoder

    tiny = work / "tiny.onnx"
    onnx.save_model(build_decoder(layers=1, hidden=32, heads=2, vocab=64), str(tiny))
    row = run_child({"model": str(tiny), "ho": True, "seq": 8, "steps": 1}, None)
    return int(row["peak_bytes"])


def prepare(work: Path, preset: dict[str, Any], fractions: list[float], seq: int
            ) -> tuple[Path, int, dict[float, tuple[Path, int]]]:
    """The decoder, its weight bytes, and per fraction the optimized model and budget."""
    from ho_onnx import OffloadOptions, optimize
    from models.decoder import build_decoder_once

    src, _ = build_decoder_once(work / "decoder", dict(preset, seq="seq", batch=1,
                                                       dtype="float32", max_positions=seq))
    weights = sum(f.stat().st_size for f in src.parent.glob("*.data"))
    out: dict[float, tuple[Path, int]] = {}
    for f in fractions:
        budget = int(weights * f)
        dst = work / f"ho{f:g}" / "model.onnx"
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            optimize(src, dst, OffloadOptions(budget=budget, activations=False,
                                              weight_tier="disk"), {"seq": seq})
        out[f] = (dst, budget)
    return src, weights, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--fractions", default="0.25,0.15")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--workdir")
    ap.add_argument("--json")
    ap.add_argument("--cpu-arena", choices=("auto", "as_requested", "ort"), default="auto",
                    help="the ho rows' CPU arena (ho_onnx.InferenceSession's cpu_arena; "
                         "auto: the one the plan counted)")
    ap.add_argument("--no-prepack-rows", action="store_true",
                    help="also run each ho row with ORT's pre-packing off ('ho F -pp'): the "
                         "resident weights stay mapped file pages the kernel can reclaim")
    a = ap.parse_args(argv)
    if a.child:
        child(json.loads(a.child))
        return 0
    if os.geteuid() != 0 or not os.access(CGROUP, os.W_OK):
        print(f"cpu_memory_cap: needs root and a writable {CGROUP} (cgroup v1)", file=sys.stderr)
        return 2
    fractions = [float(x) for x in a.fractions.split(",")]
    work = Path(a.workdir or tempfile.mkdtemp(prefix="ho_cap_"))
    src, weights, models = prepare(work, PRESETS[a.preset], fractions, a.seq)
    allow = allowance(work)
    print(f"weights {weights / MIB:.0f} MiB; runtime allowance {allow / MIB:.0f} MiB", flush=True)
    rows: list[dict[str, Any]] = []
    for r in range(a.rounds):
        for f in fractions:
            path, budget = models[f]
            limit = budget + allow
            configs = [(f"ort {f:g}", src, False, True), (f"ho {f:g}", path, True, True)]
            if a.no_prepack_rows:
                configs.append((f"ho {f:g} -pp", path, True, False))
            for name, model, ho, prepack in configs:
                row = run_child({"model": str(model), "ho": ho, "seq": a.seq,
                                 "steps": a.steps, "prepack": prepack,
                                 "cpu_arena": a.cpu_arena}, limit)
                row.update(name=name, fraction=f, budget_bytes=budget, round=r)
                rows.append(row)
                print(f"  round {r} {name:<9} limit {limit / MIB:7.0f} MiB: {row['result']:<5}"
                      f" peak {row['peak_bytes'] / MIB:7.0f} MiB" + (
                          f" prefill {row['prefill_s']:.3f} s decode {row['decode_s']:.3f} s"
                          if row["result"] == "ok" else ""), flush=True)
    doc = {"preset": a.preset, "config": PRESETS[a.preset], "seq": a.seq,
           "weights_bytes": weights, "allowance_bytes": allow, "rows": rows}
    print_table(doc)
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def print_table(doc: dict[str, Any]) -> None:
    print(f"\n{'row':<10}{'limit MiB':>10}{'peak MiB':>10}{'prefill s':>11}{'decode s':>10}"
          "  result")
    names = list(dict.fromkeys(r["name"] for r in doc["rows"]))
    for name in names:
        rs = [r for r in doc["rows"] if r["name"] == name]
        ok = [r for r in rs if r["result"] == "ok"]

        def med(k: str, ok: list[dict[str, Any]] = ok) -> str:
            return f"{statistics.median(r[k] for r in ok):.3f}" if ok else "-"
        print(f"{name:<10}{rs[0]['limit_bytes'] / MIB:>10.0f}"
              f"{max(r['peak_bytes'] for r in rs) / MIB:>10.0f}{med('prefill_s'):>11}"
              f"{med('decode_s'):>10}  {', '.join(sorted({r['result'] for r in rs}))}")


if __name__ == "__main__":
    sys.exit(main())
