"""GPU offload benchmark: a decoder whose weights are several GB, side by side on one GPU.

Rows (each measured in its own process, so ORT's arena and the CUDA context start clean):

* ``baseline``   the unmodified model on CUDAExecutionProvider;
* ``ho 75%/50%/25%``  ho-onnx planned for 75/50/25 % of the baseline's predicted peak;
* ``ho 2 layers``  a budget of the activations plus two transformer blocks of weights (weight
  streaming);
* ``ort partition N%``  ORT's own answer for a model that does not fit: the CUDA EP's
  capacity-aware partitioning (session config ``session.resource_cuda_partitioning_settings``
  = ``"<memory limit in KiB>,"``, ORT >= 1.22) at the budget of the ``ho N%`` row; the nodes
  past the limit go to CPUExecutionProvider;
* ``accelerate``  the same architecture in torch with ``accelerate.cpu_offload`` (when torch
  with CUDA and accelerate are installed).

ORT rows run as each is run by default: the baseline and ORT's partitioning with ORT's memory
patterns on, the ho rows through ``ho_onnx``'s session helper, which turns them off
(``--mem-pattern both`` measures every row both ways, side by side).

Per row: measured peak device memory (``cudaMemGetInfo`` polled every millisecond in a thread,
through ``ho_onnx._ops.cuda_mem_info``: used bytes above those used before the session was
made) next to ORT's CUDA arena as ORT reports it (``MaxInUse`` / ``InUse`` /
``TotalAllocated`` of ``AllocatorGetStats``, sampled by the library at every Wait into the
``ort_arena_*`` counters, ``ho_onnx.sample_arena=1``: onnxruntime >= 1.23, optimized rows
only), median latency, ratio
to the baseline, the host-to-device bytes per run and the rate
the copies achieved (GPU time of the engine's copies, ``_ops.cuda_transfer_times``) next to
the calibrated pinned rate (``_ops.cuda_calibrate``), and the planner's predicted peak and
time. Prints a table and writes JSON.

    python bench/gpu_offload.py --json out.json            # ~4 GB fp16 decoder
    python bench/gpu_offload.py --layers 4 --hidden 1024   # quick

It needs an NVIDIA GPU, a CUDA build of ho_onnx and onnxruntime-gpu; elsewhere it stops at
once with the reason (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CUDA_EP = "CUDAExecutionProvider"
MIB = 1 << 20


def preflight() -> str | None:
    """Why this benchmark cannot run here, or None."""
    try:
        from ho_onnx import _ops
    except ImportError as e:
        return f"the ho_onnx native library is not built ({e})"
    if not _ops.build_info()["cuda_compiled"]:
        return "ho_onnx was built without CUDA (nvcc was not found at build time)"
    import onnxruntime as ort

    if CUDA_EP not in ort.get_available_providers():
        return (f"onnxruntime {ort.__version__} has no {CUDA_EP} (the CPU build is "
                "installed; install onnxruntime-gpu)")
    if _ops.cuda_device_count() == 0:
        return "no CUDA device is visible (no GPU or no driver)"
    return None


# ---- measurement in a child process ------------------------------------------------------------

class MemPoller:
    """Peak device bytes in use (cudaMemGetInfo), sampled every `period` seconds."""

    def __init__(self, device: int = 0, period: float = 0.001):
        from ho_onnx import _ops

        self._ops, self.device, self.period = _ops, device, period
        free, self.total = _ops.cuda_mem_info(device)
        self.used0 = self.total - free
        self.peak = self.used0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            free, _ = self._ops.cuda_mem_info(self.device)
            self.peak = max(self.peak, self.total - free)
            time.sleep(self.period)

    def __enter__(self) -> MemPoller:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        free, _ = self._ops.cuda_mem_info(self.device)
        self.peak = max(self.peak, self.total - free)

    @property
    def peak_bytes(self) -> int:
        return self.peak - self.used0


PARTITION_KEY = "session.resource_cuda_partitioning_settings"


def measure_onnx(model: str, optimized: bool, runs: int, feeds_path: str,
                 partition_kib: int = 0, mem_pattern: bool = True) -> dict:
    import numpy as np
    import onnxruntime as ort

    from ho_onnx import _ops
    from ho_onnx.contract import CONFIG_SAMPLE_ARENA
    from ho_onnx.target.ort import runtime

    feeds = dict(np.load(feeds_path))
    providers = [(CUDA_EP, {"device_id": 0, "arena_extend_strategy": "kSameAsRequested"})]
    _ops.cuda_mem_info(0)  # the CUDA context exists before the first sample
    with MemPoller() as mem:
        if optimized:
            # ho_onnx.sample_arena=1: every Wait samples ORT's arena (the arena columns).
            so = ort.SessionOptions()
            so.add_session_config_entry(CONFIG_SAMPLE_ARENA, "1")
            s = runtime.InferenceSession(model, sess_options=so, providers=providers,
                                         memory_patterns=mem_pattern)
        else:
            so = ort.SessionOptions()
            so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
            so.enable_mem_pattern = mem_pattern
            if partition_kib:
                # ORT's capacity-aware partitioning: CUDA takes nodes in topological order
                # until the limit, the rest go to the CPU EP (no stats file: ORT estimates).
                so.add_session_config_entry(PARTITION_KEY, f"{partition_kib},")
                providers = [*providers, "CPUExecutionProvider"]
            s = ort.InferenceSession(model, sess_options=so, providers=providers)
        t0 = time.perf_counter()
        s.run(None, feeds)  # warm-up (cuBLAS handles, the ring, the event pool)
        first_s = time.perf_counter() - t0
        _ops.reset_counters()
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            s.run(None, feeds)
            times.append(time.perf_counter() - t0)
    c = _ops.counters()
    out = {
        "peak_device_bytes": mem.peak_bytes,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "first_run_s": first_s,
        "h2d_bytes_per_run": c["bytes_loaded"] // max(1, runs),
        "d2h_bytes_per_run": c["bytes_stored"] // max(1, runs),
        "pinned_host_bytes": c["pinned_bytes"],
        # Which EP ran the cache ops (a CPU fallback shows as ops_cpu > 0), and what the
        # CUDA engine itself copied.
        "cache_ops_cuda_per_run": c["ops_cuda"] // max(1, runs),
        "cache_ops_cpu_per_run": c["ops_cpu"] // max(1, runs),
        "cuda_h2d_bytes_per_run": c["cuda_bytes_h2d"] // max(1, runs),
        # ORT's CUDA arena at the last Wait (None: no Wait ran, or onnxruntime < 1.23).
        "ort_arena_max_in_use": c["ort_arena_max_in_use"] if c["ort_arena_max_in_use"] >= 0
        else None,
        "ort_arena_in_use": c["ort_arena_in_use"] if c["ort_arena_in_use"] >= 0 else None,
        "ort_arena_total_allocated": c["ort_arena_total_allocated"]
        if c["ort_arena_total_allocated"] >= 0 else None,
        "providers": s.get_providers(),
    }
    if optimized:
        # One more run with timing events around every copy: the copies' own GPU time.
        _ops.cuda_transfer_times(reset=True)
        _ops.set_trace(cuda_timing=True)
        s.run(None, feeds)
        _ops.set_trace()
        t = _ops.cuda_transfer_times(reset=True)
        out["h2d_copy_s"] = t["h2d_s"]
        out["h2d_achieved_bw"] = t["h2d_bytes"] / t["h2d_s"] if t["h2d_s"] > 0 else None
        out["d2h_achieved_bw"] = t["d2h_bytes"] / t["d2h_s"] if t["d2h_s"] > 0 else None
    return out


def measure_accelerate(cfg: dict, runs: int) -> dict:
    import torch
    from accelerate import cpu_offload
    from torch import nn

    from ho_onnx import _ops

    h, heads, ffn, vocab = cfg["hidden"], cfg["heads"], 4 * cfg["hidden"], cfg["vocab"]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.fc1, self.fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln_1(x)).split(h, dim=-1)
            q, k, v = (z.view(b, t, heads, h // heads).transpose(1, 2) for z in (q, k, v))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln_2(x))))

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, h), nn.Embedding(cfg["seq"], h)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg["layers"]))
            self.ln_f, self.head = nn.LayerNorm(h), nn.Linear(h, vocab, bias=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln_f(x))

    dtype = torch.float16 if cfg["dtype"] == "float16" else torch.float32
    with torch.device("meta"):
        model = Decoder()
    model = model.to_empty(device="cpu").to(dtype).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    _ops.cuda_mem_info(0)
    torch.cuda.init()
    ids = torch.randint(0, vocab, (cfg["batch"], cfg["seq"]), device="cuda")
    with MemPoller() as mem:
        cpu_offload(model, execution_device=torch.device("cuda:0"))
        with torch.inference_mode():
            model(ids)
            torch.cuda.synchronize()
            times = []
            for _ in range(runs):
                t0 = time.perf_counter()
                model(ids)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
    return {"peak_device_bytes": mem.peak_bytes, "median_s": statistics.median(times),
            "min_s": min(times), "torch_max_allocated": torch.cuda.max_memory_allocated()}


def child(args: argparse.Namespace) -> int:
    if args.child == "onnx":
        res = measure_onnx(args.model, args.optimized, args.runs, args.feeds,
                           args.partition_kib, args.mem_pattern == "on")
    else:
        res = measure_accelerate(json.loads(args.cfg), args.runs)
    print("RESULT " + json.dumps(res), flush=True)
    return 0


def run_child(argv: list[str], timeout: float) -> dict:
    p = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True,
                       timeout=timeout)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (p.stderr or p.stdout).strip().splitlines()[-5:]
    return {"error": f"exit {p.returncode}: " + " | ".join(tail)}


# ---- the benchmark -------------------------------------------------------------------------------

def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from models.decoder import add_shape_args

    add_shape_args(ap, layers=24, hidden=2560, heads=20, seq=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--budgets", default="0.75,0.5,0.25",
                    help="fractions of the baseline's predicted peak")
    ap.add_argument("--machine", default="h100",
                    help="cost-model machine: preset name or a calibration JSON file")
    ap.add_argument("--workdir", default=None, help="where the models go (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--no-accelerate", action="store_true")
    ap.add_argument("--ort-partition", default="0.5",
                    help="fractions of the baseline's predicted peak at which ORT's own CUDA "
                         "memory-limited partitioning is measured ('' for none)")
    ap.add_argument("--partition-runs", type=int, default=2,
                    help="timed runs of the ORT partitioning rows (their CPU part is slow)")
    ap.add_argument("--mem-pattern", choices=["auto", "on", "off", "both"], default="auto",
                    help="ORT's memory patterns (SessionOptions.enable_mem_pattern) in the "
                         "baseline and ho rows: 'auto' as each is run by default (ORT: on; "
                         "ho_onnx's session helper: off); 'both': each row twice, side by side")
    ap.add_argument("--ort-reuse", choices=["on", "off", "both"], default="on",
                    help="ORT's buffer reuse the ho rows are planned for and run with "
                         "(OffloadOptions.ort_reuse; the model records it and ho-onnx's "
                         "session sets it): 'both': each ho row twice, side by side")
    ap.add_argument("--profile-costs", action="store_true",
                    help="plan with compute measured on the device: ORT's profile of the "
                         "unmodified model on the CUDA EP (ho-onnx profile), which also times "
                         "loads as the CUDA engine issues them; default: the analytic model")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per measured row")
    ap.add_argument("--child", choices=["onnx", "accelerate"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--optimized", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--feeds", help=argparse.SUPPRESS)
    ap.add_argument("--cfg", help=argparse.SUPPRESS)
    ap.add_argument("--partition-kib", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    why = preflight()
    if why is not None:
        print(f"gpu_offload: cannot run here: {why}. This benchmark needs an NVIDIA GPU, "
              "ho_onnx built with CUDA and onnxruntime-gpu (see scripts/gpu_run.sh).",
              file=sys.stderr)
        return 2
    if args.child:
        return child(args)

    import numpy as np

    from ho_onnx import _ops
    from ho_onnx.rewrite.pipeline import CostSource, optimize, plan_model
    from ho_onnx.schedule.arena import arena_memory
    from ho_onnx.schedule.options import OffloadOptions
    from ho_onnx.schedule.simulate import simulate
    from models.decoder import build_decoder_once, decoder_config_bytes

    cfg = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab", "seq", "batch",
                                         "dtype")}
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ho_gpu_offload_"))
    work.mkdir(parents=True, exist_ok=True)
    cal = _ops.cuda_calibrate(256 * MIB)
    print(f"device: {cal['device_name']}; pinned copies: H2D {cal['h2d_bw'] / 1e9:.1f} GB/s, "
          f"D2H {cal['d2h_bw'] / 1e9:.1f} GB/s", flush=True)

    sizes = decoder_config_bytes(layers=args.layers, hidden=args.hidden, heads=args.heads,
                                 vocab=args.vocab, seq=args.seq, max_positions=args.seq,
                                 dtype=args.dtype)
    t0 = time.perf_counter()
    src, built = build_decoder_once(work, cfg)
    if built:
        print(f"built {src} ({sizes['total_bytes'] / 2**30:.2f} GiB of weights) in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    feeds = work / "feeds.npz"
    rng = np.random.default_rng(0)
    np.savez(feeds, input_ids=rng.integers(0, args.vocab, (args.batch, args.seq),
                                           dtype=np.int64))

    costs = CostSource(machine=args.machine)
    if args.profile_costs:
        # The planner's compute from the device: ORT's profile of the unmodified model on
        # the CUDA EP (its run time; node times there are launch times), loads timed as the
        # engine issues them (cost.profiled.device_scaled, CostModel.host_ahead).
        from ho_onnx.target.ort.profile import profile_model

        t0 = time.perf_counter()
        prof = work / "decoder.profile.json"
        r = profile_model(src, prof, providers=[CUDA_EP], runs=10, warmup=2)
        print(f"profiled the baseline on {r['provider']} in {time.perf_counter() - t0:.0f} s: "
              f"run {r['total_median_s'] * 1e3:.1f} ms, node times: {r['time_basis']}",
              flush=True)
        costs = CostSource(machine=args.machine, profile=prof)
    _, base_analysis, base_plan = plan_model(src, OffloadOptions(budget=1 << 62), costs=costs)
    base_peak = base_plan.baseline.peak_bytes
    acts = max(0, base_peak - sizes["total_bytes"])
    rows: list[dict] = []

    def save(done: bool) -> None:
        # After every row: a call that runs out of time still brings back what it measured.
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"config": cfg, "weight_bytes": sizes["total_bytes"], "calibration": cal,
                 "machine": str(args.machine), "profile_costs": args.profile_costs,
                 "rows": rows, "complete": done,
                 "onnxruntime": __import__("onnxruntime").__version__}, indent=2) + "\n")

    def host_ahead_s(analysis, plan) -> float:
        """The plan's time with loads timed as the CUDA engine issues them (simulate's
        ``host_ahead``; the planner's own prediction is ``predicted_s``)."""
        cm = costs.cost_model(analysis, {})
        return simulate(analysis, plan.choice, cm.compute_s, cm.transfer_time,
                        host_ahead=True).total_s

    def measure(name: str, model: Path, optimized: bool, plan=None, budget=None,
                partition: bool = False, host_s: float | None = None) -> None:
        if partition or args.mem_pattern == "auto":
            patterns = ["off" if optimized else "on"]
        else:
            patterns = ["on", "off"] if args.mem_pattern == "both" else [args.mem_pattern]
        for pattern in patterns:
            label = name + (" no-pattern" if pattern == "off" and len(patterns) > 1 else "")
            print(f"measuring {label} ...", flush=True)
            extra = ["--optimized"] if optimized else []
            if partition:
                extra = ["--partition-kib", str(max(1, budget >> 10))]
            runs = args.partition_runs if partition else args.runs
            res = run_child(["--child", "onnx", "--model", str(model), "--feeds", str(feeds),
                             "--runs", str(runs), "--mem-pattern", pattern, *extra],
                            args.timeout)
            row = {"name": label, "budget_bytes": budget, "mem_pattern": pattern == "on", **res}
            if plan is not None:
                row["predicted_peak_bytes"] = plan.planned.peak_bytes
                row["predicted_arena_bytes"] = plan.arena_bytes  # (the planner's replay)
                row["predicted_s"] = plan.planned.total_s
                row["predicted_s_host_ahead"] = host_s
                row["plan_fits"] = plan.fits
            rows.append(row)
            save(False)

    measure("baseline", src, False)
    for row in rows:
        row["predicted_peak_bytes"] = base_peak
        row["predicted_arena_bytes"] = int(arena_memory(base_analysis).max())
        row["predicted_s"] = row["predicted_s_host_ahead"] = base_plan.baseline.total_s

    budgets = [(f"ho {float(f):.0%}", int(float(f) * base_peak))
               for f in args.budgets.split(",") if f.strip()]
    two = acts + 2 * sizes["per_layer_bytes"] + max(sizes["embedding_bytes"],
                                                    sizes["head_bytes"])
    budgets.append(("ho 2 layers", two))
    reuses = [True, False] if args.ort_reuse == "both" else [args.ort_reuse == "on"]
    for (name, budget), reuse in ((b, x) for b in budgets for x in reuses):
        label = name + ("" if reuse else " no-reuse")
        out = work / f"decoder.{name.split()[-1].replace('%', 'pct')}" \
                     f"{'' if reuse else '.noreuse'}.onnx"
        try:
            r = optimize(src, out, OffloadOptions(budget=budget, ort_reuse=reuse), costs=costs)
        except Exception as e:  # the planner refuses an impossible budget: say so
            rows.append({"name": label, "budget_bytes": budget, "error": f"plan: {e}"})
            continue
        first = len(rows)
        measure(label, out, True, r.plan, budget, host_s=host_ahead_s(r.analysis, r.plan))
        for row in rows[first:]:
            row["ort_reuse"] = reuse

    for f in (x for x in args.ort_partition.split(",") if x.strip()):
        measure(f"ort partition {float(f):.0%}", src, False, budget=int(float(f) * base_peak),
                partition=True)

    if not args.no_accelerate:
        try:
            import accelerate  # noqa: F401
            import torch

            ok = torch.cuda.is_available()
        except ImportError:
            ok = False
        if ok:
            print("measuring accelerate cpu_offload ...", flush=True)
            res = run_child(["--child", "accelerate", "--cfg", json.dumps(cfg), "--runs",
                             str(max(3, args.runs // 2))], args.timeout)
            rows.append({"name": "accelerate cpu_offload", **res})
        else:
            rows.append({"name": "accelerate cpu_offload",
                         "error": "torch with CUDA and accelerate are not installed"})

    # Calibrate again after the rows: on the H100 one process measured 45.1 GB/s and another
    # 54.9 GB/s on the same machine (docs/benchmarks.md); the fraction below uses the better.
    cal2 = _ops.cuda_calibrate(256 * MIB)
    cal["h2d_bw_runs"] = [cal["h2d_bw"], cal2["h2d_bw"]]
    cal["d2h_bw_runs"] = [cal["d2h_bw"], cal2["d2h_bw"]]
    cal["h2d_bw"], cal["d2h_bw"] = max(cal["h2d_bw_runs"]), max(cal["d2h_bw_runs"])
    print(f"pinned copies after the rows: H2D {cal2['h2d_bw'] / 1e9:.1f} GB/s, "
          f"D2H {cal2['d2h_bw'] / 1e9:.1f} GB/s (the better of the two is used)", flush=True)
    base_s = rows[0].get("median_s")
    for r in rows:
        if base_s and r.get("median_s"):
            r["ratio_to_baseline"] = r["median_s"] / base_s
        if r.get("h2d_achieved_bw"):
            r["h2d_fraction_of_calibrated"] = r["h2d_achieved_bw"] / cal["h2d_bw"]

    hdr = (f"{'row':<24}{'budget GiB':>11}{'peak GiB':>10}{'arena max':>10}{'arena tot':>10}"
           f"{'pred GiB':>10}{'pred ORT':>10}{'median ms':>11}"
           f"{'pred ms':>9}{'pred host':>10}{'x base':>8}{'H2D GB/run':>11}{'H2D GB/s':>10}"
           f"{'of cal':>8}")
    print()
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<24}  {r['error'][:100]}")
            continue
        med = r.get("median_s")
        bw = r.get("h2d_achieved_bw")
        print(f"{r['name']:<24}{_gb(r.get('budget_bytes')):>11}{_gb(r['peak_device_bytes']):>10}"
              f"{_gb(r.get('ort_arena_max_in_use')):>10}"
              f"{_gb(r.get('ort_arena_total_allocated')):>10}"
              f"{_gb(r.get('predicted_peak_bytes')):>10}"
              f"{_gb(r.get('predicted_arena_bytes')):>10}"
              f"{(med or 0) * 1e3:>11.1f}"
              f"{(r['predicted_s'] * 1e3 if r.get('predicted_s') else float('nan')):>9.1f}"
              f"{(r.get('predicted_s_host_ahead') or float('nan')) * 1e3:>10.1f}"
              f"{r.get('ratio_to_baseline', float('nan')):>8.2f}"
              f"{r.get('h2d_bytes_per_run', 0) / 1e9:>11.2f}"
              f"{(bw or 0) / 1e9:>10.1f}"
              f"{r.get('h2d_fraction_of_calibrated', float('nan')):>8.0%}")
    print("\npeak = device bytes in use above those used before the session (cudaMemGetInfo, "
          "1 ms polling); arena max / tot = ORT's CUDA arena MaxInUse / TotalAllocated at the "
          "last Wait (AllocatorGetStats); pred = the planner's simulated tensor peak and time; "
          "pred ORT = the arena ORT's buffer reuse needs (target/ort/arena.py); pred host = "
          "the plan's time with loads timed as the CUDA engine issues them (simulate's "
          "host_ahead).")
    if args.json:
        save(True)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
