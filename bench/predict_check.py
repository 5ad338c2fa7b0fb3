"""The planner's predicted times against a GPU run of ``bench/gpu_offload.py``, recomputed here.

For every ``ho`` row of a ``gpu_offload`` JSON the same model is planned again (no GPU needed:
planning reads no weight bytes, but the decoder is built once, with its weights) under three
timings, and each prediction is set beside the measured median:

* ``analytic``: the analytic roofline on the machine file, default timing (what the bench's
  ``pred ms`` showed);
* ``host-ahead``: the same plan with loads timed as the CUDA engine issues them
  (``simulate(host_ahead=True)``, the bench's ``pred host``);
* ``GPU run time``: what planning from ``ho-onnx profile`` on the CUDA EP gives
  (``cost.profiled.device_scaled``: analytic node times scaled to the profile's run time,
  host-ahead timing), with the run time taken from the JSON's measured baseline, which is
  what such a profile records if ORT's profiler adds nothing to a run.

    python bench/predict_check.py bench/results/gpu_offload_h100_prefill2048_mempattern.json \\
        --machine bench/results/machine_h100_4.json --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_json", help="a bench/gpu_offload.py JSON (rows measured on a GPU)")
    ap.add_argument("--machine", required=True, help="the machine file of that run")
    ap.add_argument("--workdir", default=None, help="where the decoder goes (default: temp)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    from ho_onnx.cost.source import CostSource
    from ho_onnx.rewrite.pipeline import plan_model
    from ho_onnx.schedule.options import OffloadOptions
    from ho_onnx.schedule.simulate import simulate
    from ho_onnx.target.ort.profile import PROFILE_FORMAT
    from models.decoder import build_decoder_once

    run = json.loads(Path(args.bench_json).read_text())
    cfg, rows = run["config"], run["rows"]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ho_predict_check_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"the decoder of {args.bench_json} in {work} (built unless there) ...", flush=True)
    src, _ = build_decoder_once(work, cfg)
    base_s = rows[0]["median_s"]
    profile = work / "gpu_run_time.profile.json"
    profile.write_text(json.dumps({
        "format": PROFILE_FORMAT, "version": 1, "provider": "CUDAExecutionProvider",
        "time_basis": "host", "opt_level": "all", "total_median_s": base_s, "nodes": {}}))
    analytic = CostSource(machine=args.machine)
    measured_gpu = CostSource(machine=args.machine, profile=profile)

    out = []
    for r in rows:
        if not r["name"].startswith("ho") or "median_s" not in r:
            continue
        opts = OffloadOptions(budget=r["budget_bytes"])
        _, a, p = plan_model(src, opts, costs=analytic)
        cm = analytic.cost_model(a, {})
        host = simulate(a, p.choice, cm.compute_s, cm.transfer_time, host_ahead=True).total_s
        _, _, q = plan_model(src, opts, costs=measured_gpu)
        same = [(w.name, w.consumers) for w in p.choice.weights] == \
            [(w.name, w.consumers) for w in q.choice.weights]
        out.append({"name": r["name"], "measured_s": r["median_s"],
                    "analytic_s": p.planned.total_s, "host_ahead_s": host,
                    "gpu_run_time_s": q.planned.total_s, "same_plan": same})
    print(f"\nmeasured baseline {base_s * 1e3:.1f} ms (the GPU run time column's profile)\n")
    print(f"{'row':<26}{'measured ms':>12}{'analytic':>16}{'host-ahead':>16}"
          f"{'GPU run time':>16}  same plan")
    for o in out:
        m = o["measured_s"]
        cells = "".join(f"{o[k] * 1e3:>8.1f} ({o[k] / m - 1:+4.0%})"
                        for k in ("analytic_s", "host_ahead_s", "gpu_run_time_s"))
        print(f"{o['name']:<26}{m * 1e3:>12.1f}{cells}  {'yes' if o['same_plan'] else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"bench_json": args.bench_json,
                                               "machine": args.machine, "rows": out},
                                              indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
