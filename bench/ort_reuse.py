"""ORT's buffer reuse against the arena it holds, and what a plan without it buys (issue 38,
item 2: "the arena must be planned for ... break the buffer reuse that holds it").

ORT's allocation planner gives a freed buffer to a later value of the same shape and keeps
it allocated across the gap between the two; on fixed-shape decoders that held the arena at
1.26-1.54x the tensor peak (H100, nothing offloaded). ``OffloadOptions.ort_reuse=False``
(``--ort-reuse off``) plans for sessions with ORT's ``enable_mem_reuse`` off, which
ho-onnx's sessions then set from the model's record.

For each fixed-shape decoder (``models.decoder``, batch 1, CPU EP, ho-onnx's session and
arena, pre-packing off as in the hard-limit bench), each in its own process:

* ``resident``: the unmodified model (a ``Fence`` on the ids samples ORT's arena statistics:
  the regions it grew, ``TotalAllocated``, and the chunks in use at most, ``MaxInUse``),
  with ORT's buffer reuse on and off: the replayed arena (``bfc.held`` of the buffers the
  replay gives, with and without reuse), the measured one, the tensors' peak, and the
  median time of a run;
* ``plan B%``: the model optimized for ``B`` % of its resident peak (weights + arena) with
  reuse on and off (``arena_refits`` at its default, so each plan is fitted to its own
  arena): bytes offloaded, predicted time, replayed and measured arena, measured time, and
  the outputs compared with the unmodified model's: bit-exact, or within ``verify``'s
  tolerance (atol 1e-5, rtol 1e-4) where ORT fuses a MatMul with its constant bias in the
  unmodified model only (a weight offloaded is no constant; ``verify`` shows both are
  bit-exact with ORT's optimizations off).

    python bench/ort_reuse.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MIB = 1 << 20
CONFIGS = ("2x512x512", "4x512x512", "4x512x1024")

_CHILD = r"""
import json, sys, time, numpy as np, onnxruntime as ort
from ho_onnx import _ops
from ho_onnx.contract import CONFIG_SAMPLE_ARENA
from ho_onnx.target.ort import runtime
path, reuse, ref = sys.argv[1], sys.argv[2], sys.argv[5]
seq, runs = int(sys.argv[3]), int(sys.argv[4])
so = ort.SessionOptions()
so.add_session_config_entry(CONFIG_SAMPLE_ARENA, "1")
so.add_session_config_entry("session.disable_prepacking", "1")
# ("model-on"/"model-off": as the model's plan records, which must be that)
s = runtime.InferenceSession(path, sess_options=so, providers=["CPUExecutionProvider"],
                             buffer_reuse=None if reuse.startswith("model") else reuse == "on")
assert s.get_session_options().enable_mem_reuse is reuse.endswith("on"), reuse
feeds = {"input_ids": (np.arange(seq, dtype=np.int64) % 97)[None, :]}
_ops.set_trace(arena_trace=True)
out = s.run(None, feeds)[0].copy()  # (a copy: the returned array may hold an arena chunk)
_ops.arena_trace()
times = []
for _ in range(runs):
    t = time.perf_counter()
    s.run(None, feeds)
    times.append(time.perf_counter() - t)
trace = _ops.arena_trace()
exact = None
if ref != "-":  # (bit-exact, else within verify's tolerance: ORT's fusions differ)
    want = np.load(ref)
    exact = "bit-exact" if np.array_equal(out, want) else (
        f"within tol ({np.abs(out - want).max():.1e})"
        if np.allclose(out, want, atol=1e-5, rtol=1e-4) else "MISMATCH")
else:
    np.save(path + ".ref.npy", out)
t = trace[0] if trace else {"total_allocated": -1, "max_in_use": -1}  # (no Wait: no sample)
print(json.dumps({"total_allocated": t["total_allocated"], "max_in_use": t["max_in_use"],
                  "ms": float(np.median(times)) * 1e3, "exact": exact}))
"""


def measure(path: Path, reuse: bool, seq: int, runs: int, ref: Path | None,
            recorded: bool = False) -> dict[str, Any]:
    """ORT's arena statistics over a whole run and the median run time, in a process of its
    own (ho-onnx's arena for fixed shapes is the process's); ``recorded``: the session's
    reuse as the model records it, checked to be ``reuse``."""
    mode = ("model-" if recorded else "") + ("on" if reuse else "off")
    p = subprocess.run([sys.executable, "-c", _CHILD, str(path), mode,
                        str(seq), str(runs), str(ref) if ref else "-"],
                       capture_output=True, text=True, timeout=1800, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{path.name} ({'reuse' if reuse else 'no reuse'}): "
                           f"{p.stderr.strip().splitlines()[-1] if p.stderr else p.returncode}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def fenced(src: Path, out: Path, seq: int) -> Path:
    """``src`` with a Fence on its ids (a graph output of its own): it samples ORT's arena
    statistics and changes no other value."""
    import onnx
    from onnx import helper

    from ho_onnx import contract

    m = onnx.load(str(src), load_external_data=False)
    m.graph.node.append(helper.make_node(contract.FENCE, ["input_ids", "input_ids"],
                                         ["ho_bench.fenced_ids"], domain=contract.DOMAIN))
    m.graph.output.append(helper.make_tensor_value_info("ho_bench.fenced_ids",
                                                        onnx.TensorProto.INT64, [1, seq]))
    m.opset_import.append(helper.make_opsetid(contract.DOMAIN, 1))
    onnx.save(m, str(out))
    return out


def target(reuse: bool) -> Any:
    from ho_onnx.target.ort.arena import ORT, ORT_NO_REUSE

    return ORT if reuse else ORT_NO_REUSE


def replayed(path: Path, reuse: bool) -> int:
    """The arena the replay gives the unmodified model (ho-onnx's for fixed shapes: regions
    grown as requested), without what it holds beside it (initializers, folded values)."""
    import onnx

    from ho_onnx.graph.analyse import analyse
    from ho_onnx.schedule.arena import arena_buffer_intervals, arena_memory

    a = analyse(onnx.load(str(path), load_external_data=False))
    _, static = arena_buffer_intervals(a, None, target=target(reuse))
    return int(arena_memory(a, None, target=target(reuse)).max()) - static


def one(cfg: str, work: Path, budgets: list[int], runs: int) -> list[dict[str, Any]]:
    import onnx

    from ho_onnx.graph.analyse import analyse
    from ho_onnx.rewrite.pipeline import optimize
    from ho_onnx.schedule.arena import arena_buffer_intervals
    from ho_onnx.schedule.lifetimes import schedule_memory
    from ho_onnx.schedule.options import OffloadOptions
    from models.decoder import build_decoder

    layers, hidden, seq = (int(x) for x in cfg.split("x"))
    src = work / f"dec_{cfg}.onnx"
    build_decoder(src, external_data=True, layers=layers, hidden=hidden, heads=hidden // 64,
                  vocab=4096, seq=seq, batch=1, max_positions=seq)
    a = analyse(onnx.load(str(src), load_external_data=False))
    weights = sum(t.nbytes() or 0 for t in a.tensors.values() if t.is_initializer)
    tensors = int(schedule_memory(a, None).max()) - weights
    base = fenced(src, work / f"dec_{cfg}.fenced.onnx", seq)
    ref = Path(str(base) + ".ref.npy")
    rows = []
    resident = {}
    for reuse in (True, False):
        m = measure(base, reuse, seq, runs, None if reuse else ref)
        resident[reuse] = m
        rows.append({"config": cfg, "row": "resident", "reuse": reuse,
                     "tensor_peak": tensors, "replayed": replayed(src, reuse),
                     "regions": m["total_allocated"], "max_in_use": m["max_in_use"],
                     "ms": m["ms"], "exact": m["exact"], "offloaded": 0,
                     "predicted_s": None})
    peak = weights + max(r["regions"] for r in rows)
    for pct in budgets:
        for reuse in (True, False):
            out = work / f"dec_{cfg}_{pct}_{'on' if reuse else 'off'}.onnx"
            r = optimize(src, out, OffloadOptions(budget=peak * pct // 100, ort_reuse=reuse))
            plan = r.decision
            m = measure(out, reuse, seq, runs, ref, recorded=True)
            _, static = arena_buffer_intervals(r.analysis, r.choice, target=target(reuse))
            rows.append({"config": cfg, "row": f"plan {pct}%", "reuse": reuse,
                         "budget": plan.budget, "tensor_peak": tensors,
                         "replayed": plan.arena_bytes - static,
                         "regions": m["total_allocated"],
                         "max_in_use": m["max_in_use"], "ms": m["ms"], "exact": m["exact"],
                         "offloaded": r.choice.offloaded_bytes,
                         "predicted_s": plan.planned.total_s, "arena_fits": plan.arena_fits})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    mib = lambda b: "-" if b is None or b < 0 else f"{b / MIB:.1f}"  # noqa: E731
    lines = ["| decoder L×H×S | row | ORT reuse | tensors | replayed arena | ORT regions | "
             "ORT in use | offloaded | predicted ms | ms/run | exact |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        pred = "-" if r["predicted_s"] is None else f"{r['predicted_s'] * 1e3:.1f}"
        lines.append(f"| {r['config']} | {r['row']} | {'on' if r['reuse'] else 'off'} | "
                     f"{mib(r['tensor_peak'])} | {mib(r['replayed'])} | {mib(r['regions'])} | "
                     f"{mib(r['max_in_use'])} | {mib(r['offloaded'])} | {pred} | "
                     f"{r['ms']:.1f} | {r['exact'] or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="decoders as LAYERSxHIDDENxSEQ, comma-separated")
    ap.add_argument("--budgets", default="60", help="plan budgets, %% of the resident peak")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per row (median)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ho_ort_reuse_") as tmp:
        for cfg in args.configs.split(","):
            print(f"{cfg} ...", file=sys.stderr, flush=True)
            rows += one(cfg, Path(tmp), [int(b) for b in args.budgets.split(",") if b],
                        args.runs)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    bad = [r for r in rows if r["exact"] == "MISMATCH"]
    if bad:
        print(f"OUTPUTS DIFFER from the unmodified model in {len(bad)} rows", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
