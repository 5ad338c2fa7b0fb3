"""Training activation offload on the CPU: ORT's training API on the unmodified artifacts vs
the ho-onnx-optimized ones, side by side (issue 39).

Runs in the training environment (``.venv-training``: scripts/setup_training.sh). For each
model (the 6x1024 MLP at batch 512, a transformer block at ``--seq`` tokens) it writes
``generate_artifacts``' artifacts (AdamW, cross-entropy), plans the training graph under a
budget the planner must offload for (tests/training/train_models.py: ``offload_budget``)
and trains both through ``onnxruntime.training.api`` (Module with ho-onnx's session options,
the eval model alongside, an Optimizer step per batch), each configuration in its own child
process, rounds interleaved (A B A B) so machine noise hits both alike, with ORT's CPU arena
on (its default) and off. Per row: the planner's fast-tier peak, the process's peak RSS
growth over the training steps (VmHWM minus the RSS once Module and Optimizer exist), the
library's host pool, their difference (what ORT's own buffers added: the fast tier), the
median step time, and whether the losses and parameters equal the unmodified run's. On the
CPU both tiers are host RAM, so the RSS itself shows no saving (stored activations move from
ORT's buffers to the library's host pool in the same RAM); with the arena on, its growth in
doubling extents rounds the fast tier's peak, with it off (each tensor its own mmap'd block)
the peak follows the live tensors (glibc's mmap threshold fixed at 64 KiB for those runs:
``MALLOC_MMAP_THRESHOLD_``, so freed blocks go back to the system instead of raising the
threshold). ORT 1.19 has no allocator statistics for the library to read.

    .venv-training/bin/python bench/train_offload.py [--steps 20] [--rounds 2] [--seq 512]
        [--threads 0] [--json out/train_offload.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "training"))  # (the models the tests train)

import numpy as np  # noqa: E402
import train_models as tm  # noqa: E402


def _vm_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def child(args: argparse.Namespace) -> None:
    """One configuration's training run; prints its numbers as JSON."""
    import onnxruntime as ort

    from ho_onnx.target.ort import runtime

    folder, model = Path(args.folder), Path(args.model)
    data = [(np.load(folder / "data" / f"x{i}.npy"), np.load(folder / "data" / f"y{i}.npy"))
            for i in range(args.steps)]

    def options(path: Path) -> ort.SessionOptions:
        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
        so.enable_cpu_mem_arena = args.arena == "on"
        return runtime.session_options(path, base=so)

    marks: dict[str, object] = {}

    def ready() -> None:
        marks["rss_ready"] = _vm_bytes("VmRSS")
        marks["before"] = runtime.counters()

    def trained() -> None:
        marks["after"] = runtime.counters()  # (before the sessions go, and their pool)
        marks["vm_hwm"] = _vm_bytes("VmHWM")

    run = tm.train(folder, model, data, options, ready, trained)
    before, after = marks["before"], marks["after"]
    assert isinstance(before, dict) and isinstance(after, dict)
    np.save(args.params_out, run.params)
    losses, secs, rss_ready = run.losses, run.step_s, marks["rss_ready"]
    json.dump({"losses": losses, "step_s": secs, "rss_ready": rss_ready,
               "vm_hwm": marks["vm_hwm"],
               "host_pool_bytes_reserved": after["host_pool_bytes_reserved"],
               "bytes_stored_per_step": (after["bytes_stored"] - before["bytes_stored"])
               / max(1, len(data)),
               "wait_ms_per_step": (after["wait_ns"] - before["wait_ns"]) / 1e6
               / max(1, len(data))}, sys.stdout)


def run_child(folder: Path, model: Path, args: argparse.Namespace, params_out: Path,
              arena: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--folder", str(folder), "--model", str(model),
           "--steps", str(args.steps), "--threads", str(args.threads),
           "--params-out", str(params_out), "--arena", arena]
    env = dict(os.environ)
    if arena == "off":
        env["MALLOC_MMAP_THRESHOLD_"] = str(64 << 10)
    with tempfile.TemporaryFile("w+") as err:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, check=False,
                           env=env)
        if r.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"child failed ({r.returncode}) on {model}:\n{err.read()[-3000:]}")
    return json.loads(r.stdout)


def prepare(name: str, work: Path, args: argparse.Namespace) -> dict:
    """Artifacts, the optimized training model, the batches; the plan's numbers."""
    from ho_onnx import OffloadOptions, optimize

    model, classes = ((tm.mlp(layers=6, hidden=1024, batch=512), 10) if name == "mlp"
                      else (tm.block(batch=args.batch, seq=args.seq), 32))
    folder = tm.artifacts(model, work / name)
    (folder / "data").mkdir(exist_ok=True)
    for i, (x, y) in enumerate(tm.batches(model, args.steps, classes)):
        np.save(folder / "data" / f"x{i}.npy", x)
        np.save(folder / "data" / f"y{i}.npy", y)
    src = folder / "training_model.onnx"
    budget = tm.offload_budget(src)
    res = optimize(src, folder / "training_model.ho.onnx", OffloadOptions(budget=budget))
    a, plan = res.analysis, res.plan
    assert plan is not None
    loss = next(p for p in range(len(a.order))
                if a.node_at(p).op_type == "SoftmaxCrossEntropyLoss")
    return {"folder": folder, "budget": budget,
            "baseline_peak": plan.baseline.peak_bytes, "planned_peak": plan.planned.peak_bytes,
            "predicted_arena": plan.arena_bytes,
            "predicted_time_ratio": plan.planned.total_s / plan.baseline.total_s,
            "offloaded": [{"name": x.name, "bytes": x.nbytes, "producer": x.producer,
                           "reload_for": list(x.late), "across_loss": x.producer < loss < x.late[0]}
                          for x in res.choice.activations]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2, help="the block's batch")
    ap.add_argument("--seq", type=int, default=512, help="the block's sequence length")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: ORT's)")
    ap.add_argument("--models", default="mlp,block")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--params-out", help=argparse.SUPPRESS)
    ap.add_argument("--arena", default="on", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="ho_train_") as tmp:
        work = args.workdir or Path(tmp)
        rows = []
        for name in args.models.split(","):
            prep = prepare(name, work, args)
            folder = prep["folder"]
            configs = [(kind, model, arena) for arena in ("on", "off")
                       for kind, model in (("original", "training_model.onnx"),
                                           ("ho-onnx", "training_model.ho.onnx"))]
            runs: dict[tuple[str, str], list[dict]] = {(k, a): [] for k, _, a in configs}
            params: dict[tuple[str, str], np.ndarray] = {}
            for _ in range(args.rounds):
                for kind, model, arena in configs:
                    out = work / f"{name}_{kind}_{arena}_params.npy"
                    runs[kind, arena].append(run_child(folder, folder / model, args, out,
                                                       arena))
                    params[kind, arena] = np.load(out)
            for (kind, arena), rs in runs.items():
                ref, ref_params = runs["original", arena][0], params["original", arena]
                steps = [s for r in rs for s in r["step_s"][1:]]  # (the first step warms up)
                growth = max(r["vm_hwm"] - r["rss_ready"] for r in rs)
                host = max(r["host_pool_bytes_reserved"] for r in rs)
                rows.append({
                    "model": name, "config": kind, "arena": arena, "steps": args.steps,
                    "rounds": args.rounds, "step_ms_median": 1e3 * statistics.median(steps),
                    "rss_growth": growth, "host_pool_bytes_reserved": host,
                    "ort_buffers_peak": growth - host,
                    "bytes_stored_per_step": rs[0]["bytes_stored_per_step"],
                    "wait_ms_per_step": statistics.median(r["wait_ms_per_step"] for r in rs),
                    "losses_equal": all(r["losses"] == ref["losses"] for r in rs),
                    "params_equal": bool(np.array_equal(params[kind, arena], ref_params)),
                    "params_rel_diff": float(np.linalg.norm(params[kind, arena] - ref_params)
                                             / np.linalg.norm(ref_params)),
                    "planned_peak": prep["baseline_peak" if kind == "original"
                                         else "planned_peak"],
                    "budget": prep["budget"], "predicted_arena": prep["predicted_arena"],
                    "predicted_time_ratio": prep["predicted_time_ratio"],
                    "offloaded": prep["offloaded"] if kind == "ho-onnx" else [],
                    "first_loss": ref["losses"][0], "last_loss": ref["losses"][-1]})
    mib = 1 << 20
    print(f"{'model':<6} {'config':<9} {'arena':<5} {'planned':>8} {'RSS grow':>9} "
          f"{'host':>6} {'ORT':>6} {'step ms':>8} {'x':>6} {'loss=':>6} {'params=':>8}")
    base = {(r["model"], r["arena"]): r["step_ms_median"] for r in rows
            if r["config"] == "original"}
    for r in rows:
        same = "True" if r["params_equal"] else f"{r['params_rel_diff']:.1e}"
        print(f"{r['model']:<6} {r['config']:<9} {r['arena']:<5} {r['planned_peak'] / mib:8.1f} "
              f"{r['rss_growth'] / mib:9.1f} {r['host_pool_bytes_reserved'] / mib:6.1f} "
              f"{r['ort_buffers_peak'] / mib:6.1f} {r['step_ms_median']:8.1f} "
              f"{r['step_ms_median'] / base[r['model'], r['arena']]:6.3f} "
              f"{r['losses_equal']!s:>6} {same:>8}")
    print("MiB. planned: the planner's fast-tier peak; RSS grow: peak RSS over the steps minus "
          "RSS before them; host: the library's host pool; ORT: their difference (ORT's "
          "buffers); loss=/params=: against the unmodified run (params: relative norm of the "
          "difference where not equal)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "onnxruntime": ort.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
