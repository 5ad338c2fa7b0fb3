"""CPU disk tier: ORT on the unmodified model vs ho-onnx with every weight read from disk.

A GPT-style decoder with ~2.2 GB of float32 weights in one external-data file
(models/decoder.py) runs a prefill (default batch 1 x 384 tokens) in three configurations,
each in its own child process so that peak RSS comes from the OS (os.wait4's ru_maxrss of
that child):

* ``ort``: onnxruntime's own CPU session on the unmodified model (it reads the external data
  once, at session creation, and keeps every weight resident);
* ``ho-disk D=<d>``: the model rewritten with ``OffloadOptions(activations=False, min_bytes=1<<16,
  prefetch_distance=d, weight_tier="disk")``: every weight of 64 KiB or more stays in the
  data file and is read just in time (O_DIRECT, background I/O threads), ``d`` compute nodes
  ahead of its consumer; two read-ahead depths.

The disk's reference rate is ``ho_onnx.target.ort.calibrate.measure_file_read`` on the same
data file (O_DIRECT, 8 MiB sequential reads). Prints a table; ``--json PATH`` writes every number.

    python bench/cpu_disk_tier.py [--workdir DIR] [--runs 3] [--rounds 2]
        [--distances 8,16] [--json out.json]
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _vm_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


# --------------------------------------------------------------------------------------------
# Child: one configuration, one process


def _load_ops(path: str) -> None:
    """Use another build of the library (``--ops``): load it as ho_onnx._ops."""
    import importlib.util

    import ho_onnx

    spec = importlib.util.spec_from_file_location("ho_onnx._ops", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ho_onnx._ops"] = mod
    spec.loader.exec_module(mod)
    ho_onnx._ops = mod  # type: ignore[attr-defined]


def child(args: argparse.Namespace) -> None:
    import numpy as np
    import onnxruntime as ort

    if args.child_ops:
        _load_ops(args.child_ops)
    from ho_onnx.target.ort import runtime

    t0 = time.perf_counter()
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    if args.child == "ort":
        so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
        sess = ort.InferenceSession(args.model, sess_options=so,
                                    providers=["CPUExecutionProvider"])
    else:
        sess = runtime.InferenceSession(args.model, sess_options=so)
    create_s = time.perf_counter() - t0
    rss_after_create = _vm_kb("VmRSS") * 1024
    ids = np.random.default_rng(0).integers(0, 128, (args.batch, args.seq), dtype=np.int64)
    feeds = {"input_ids": ids}
    c = runtime.counters
    lat, per_run = [], []
    for i in range(args.warmup + args.runs):
        before = c()
        t = time.perf_counter()
        sess.run(None, feeds)
        dt = time.perf_counter() - t
        after = c()
        if i >= args.warmup:
            lat.append(dt)
            per_run.append({k: after[k] - before[k] for k in (
                "bytes_read_disk", "disk_read_ns", "wait_ns", "waits", "bytes_loaded",
                "disk_direct_reads", "disk_buffered_reads")})
    json.dump({"create_s": create_s, "latencies_s": lat, "per_run": per_run,
               "rss_after_create": rss_after_create,
               "vm_hwm": _vm_kb("VmHWM") * 1024,
               "host_store_bytes": c()["host_store_bytes"]}, sys.stdout)


def run_child(kind: str, model: Path, args: argparse.Namespace, ops: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--model", str(model),
           "--batch", str(args.batch), "--seq", str(args.seq), "--runs", str(args.runs),
           "--warmup", str(args.warmup), "--threads", str(args.threads)]
    if ops:
        cmd += ["--child-ops", ops]
    with tempfile.TemporaryFile("w+") as err:
        # not communicate(): it reaps the child, and wait4 must, for the child's rusage
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        assert proc.stdout is not None
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"{kind} child failed ({proc.returncode}):\n{err.read()}")
    r = json.loads(out)
    r["peak_rss"] = usage.ru_maxrss * 1024  # KiB on Linux
    return r


# --------------------------------------------------------------------------------------------
# Parent


def build(args: argparse.Namespace) -> Path:
    from models.decoder import build_decoder

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"dec_l{args.layers}_h{args.hidden}.onnx"
    if not (src.exists() and Path(str(src) + ".data").exists()):
        print(f"building {src.name} ...", flush=True)
        t = time.perf_counter()
        build_decoder(src, layers=args.layers, hidden=args.hidden, heads=args.heads,
                      external_data=True)
        print(f"  {time.perf_counter() - t:.1f} s", flush=True)
    return src


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default=os.environ.get("HO_BENCH_DIR", "/tmp/ho_disk_bench"))
    p.add_argument("--layers", type=int, default=11)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=384)
    p.add_argument("--runs", type=int, default=3, help="timed runs per child process")
    p.add_argument("--rounds", type=int, default=2,
                   help="child processes per configuration, interleaved")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="ORT intra-op threads (0: ORT's)")
    p.add_argument("--distances", default="8,16")
    p.add_argument("--json", default=None)
    p.add_argument("--ops", action="append", default=[], metavar="LABEL=PATH",
                   help="also run every ho-disk config with another build of the library "
                        "(e.g. an older commit's _ops .so), labelled LABEL")
    p.add_argument("--child-ops", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0

    import onnxruntime as ort

    from ho_onnx.rewrite.pipeline import optimize
    from ho_onnx.schedule.options import OffloadOptions
    from ho_onnx.target.ort import calibrate, runtime

    src = build(args)
    data = Path(str(src) + ".data")
    total_weights = data.stat().st_size
    distances = [int(d) for d in args.distances.split(",")]
    models = {}
    for d in distances:
        out = src.with_name(f"{src.stem}.disk_d{d}.onnx")
        r = optimize(src, out, OffloadOptions(activations=False, min_bytes=1 << 16,
                                              prefetch_distance=d, weight_tier="disk"),
                     {"batch": args.batch, "seq": args.seq})
        models[d] = (out, sum(w.nbytes * len(w.consumers) for w in r.choice.weights))

    io_threads = int(os.environ.get("HO_ONNX_IO_THREADS", "2"))

    def calibrate_now() -> dict[str, float]:
        return {f"threads={t}": calibrate.measure_file_read(data, block=8 << 20, direct=True,
                                                           threads=t)
                for t in sorted({1, io_threads})}

    print(f"calibrating: O_DIRECT sequential 8 MiB reads of {data.name} ...", flush=True)
    load0 = os.getloadavg()
    cal_before = calibrate_now()

    configs = [("ort", "ort", src, None)] + [
        (f"ho-disk D={d}", "ho", models[d][0], d) for d in distances]
    ops_of: dict[str, str] = {}
    for spec in args.ops:
        olabel, lib = spec.split("=", 1)
        for d in distances:
            configs.append((f"ho-disk D={d} [{olabel}]", "ho", models[d][0], d))
            ops_of[configs[-1][0]] = str(Path(lib).resolve())
    children: dict[str, list[dict]] = {c[0]: [] for c in configs}
    for rnd in range(args.rounds):  # interleaved: a noisy neighbour hits every config
        for label, kind, model, _d in configs:
            print(f"round {rnd + 1}/{args.rounds}: {label} ...", flush=True)
            children[label].append(run_child(kind, model, args, ops_of.get(label)))
    cal_after = calibrate_now()
    load1 = os.getloadavg()
    # the engine's parallelism: reads overlap on io_threads threads
    cal = (cal_before[f"threads={io_threads}"] + cal_after[f"threads={io_threads}"]) / 2

    results = []
    for label, kind, _model, d in configs:
        ch = children[label]
        r: dict = {"label": label, "distance": d, "children": ch,
                   "latencies_s": [x for c in ch for x in c["latencies_s"]],
                   "create_s": statistics.median(c["create_s"] for c in ch),
                   "peak_rss": max(c["peak_rss"] for c in ch)}
        r["median_s"] = statistics.median(r["latencies_s"])
        if kind == "ho":
            pr = [x for c in ch for x in c["per_run"]]
            r["disk_bytes_per_run"] = statistics.median(x["bytes_read_disk"] for x in pr)
            r["plan_bytes_per_run"] = models[d][1]
            r["run_rate"] = r["disk_bytes_per_run"] / r["median_s"]
            busy = statistics.median(x["disk_read_ns"] for x in pr) / 1e9
            r["disk_busy_s"] = busy
            r["busy_rate"] = r["disk_bytes_per_run"] / busy if busy else 0.0
            r["wait_s"] = statistics.median(x["wait_ns"] for x in pr) / 1e9
            r["host_store_bytes"] = max(c["host_store_bytes"] for c in ch)
        results.append(r)

    base = results[0]
    rows = []
    hdr = ("config", "create s", "median s", "x ORT", "peak RSS MiB", "RSS/ORT",
           "read/run GB", "read GB/s (run)", "GB/s (busy)", "busy/cal", "wait s")
    for r in results:
        ho = r["label"] != "ort"
        rows.append((
            r["label"], f"{r['create_s']:.2f}", f"{r['median_s']:.3f}",
            f"{r['median_s'] / base['median_s']:.2f}", f"{r['peak_rss'] / 2**20:.0f}",
            f"{r['peak_rss'] / base['peak_rss']:.2f}",
            f"{r['disk_bytes_per_run'] / 1e9:.2f}" if ho else "-",
            f"{r['run_rate'] / 1e9:.2f}" if ho else "-",
            f"{r['busy_rate'] / 1e9:.2f}" if ho else "-",
            f"{r['busy_rate'] / cal:.2f}" if ho else "-",
            f"{r['wait_s']:.3f}" if ho else "-"))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(hdr)]
    print()
    print(f"model {src.name}: {total_weights / 1e9:.2f} GB of weights in external data; "
          f"batch {args.batch} x seq {args.seq}; {args.runs} runs (+{args.warmup} warm-up)")
    print("calibrated O_DIRECT read rate (GB/s): before "
          + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in cal_before.items()) + "; after "
          + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in cal_after.items())
          + f"; busy/cal uses {cal / 1e9:.2f} (threads={io_threads}, mean)")
    print(f"load average before {load0[0]:.2f}, after {load1[0]:.2f} (2 cores shared)")
    print(" | ".join(h.ljust(w) for h, w in zip(hdr, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))

    if args.json:
        doc = {
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": platform.python_version(), "onnxruntime": ort.__version__,
                        "ho_onnx": runtime.build_info()["version"],
                        "io_threads": io_threads,
                        "disk_chunk_kb": os.environ.get("HO_ONNX_DISK_CHUNK_KB", "8192")},
            "model": {"path": str(src), "layers": args.layers, "hidden": args.hidden,
                      "heads": args.heads, "weight_bytes": total_weights},
            "shape": {"batch": args.batch, "seq": args.seq},
            "calibrated_read_Bps": cal, "calibrated_before_Bps": cal_before,
            "calibrated_after_Bps": cal_after, "loadavg_before": load0, "loadavg_after": load1,
            "results": results,
        }
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
