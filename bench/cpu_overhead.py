"""Cost of the cache operators on the CPU EP: original vs optimized decoders, side by side.

On the CPU both tiers are host RAM, so this measures what the engine adds (thread hand-off,
copies, waits), not a memory saving. Rows: the unmodified model, weights offloaded,
weights and activations offloaded. Runs are interleaved (A B C A B C ...) so machine noise
hits every row alike; the table reports medians and ratios to the original.

    python bench/cpu_overhead.py --layers 12 --hidden 512 --seq 128 \
        --runs 20 --json out/cpu_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onnx

from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.options import OffloadOptions, offload_kinds
from ho_onnx.target.ort import runtime
from ho_onnx.target.ort.verify import make_session as _make_session
from ho_onnx.target.ort.verify import random_inputs
from models.decoder import add_shape_args, build_decoder

_THREADS = 0


def make_session(path, *, optimized, providers, prepacking):  # type: ignore[no-untyped-def]
    """verify.make_session, with --threads intra-op threads."""
    if not _THREADS:
        return _make_session(path, optimized=optimized, providers=providers,
                             prepacking=prepacking)
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = _THREADS
    if not prepacking:
        so.add_session_config_entry("session.disable_prepacking", "1")
    if optimized:
        so = runtime.session_options(path, base=so)
    else:
        so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    return ort.InferenceSession(str(path), sess_options=so, providers=providers)



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(ap, layers=12, hidden=512, heads=8, seq=128)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--prefetch-distance", type=int, default=2)
    ap.add_argument("--no-prepacking", action="store_true",
                    help="disable ORT's weight pre-packing in every session (isolates the "
                         "engine's own cost from the loss of pre-packed constant weights)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--threads", type=int, default=0,
                    help="ORT intra-op threads in every session (0: ORT's default)")
    ap.add_argument("--ops", action="append", default=[], metavar="LABEL=PATH",
                    help="also run the optimized rows with another build of the library "
                         "(e.g. an older commit's _ops .so), labelled LABEL; its counters "
                         "are not visible here ('MiB moved' shows -)")
    args = ap.parse_args(argv)
    global _THREADS
    _THREADS = args.threads
    dims = {"batch": args.batch, "seq": args.seq}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "dec.onnx"
        build_decoder(src, layers=args.layers, hidden=args.hidden, heads=args.heads,
                      vocab=512, external_data=True)
        rows = {"original": (src, None)}
        for name, offload in (("weights", "weights"), ("weights+activations", "all")):
            out = Path(tmp) / f"{name}.onnx"
            pol = OffloadOptions(**offload_kinds(offload), min_bytes=64 << 10, min_gap=2,
                                 prefetch_distance=args.prefetch_distance)
            r = optimize(src, out, pol, dims)
            rows[name] = (out, r)
        feeds = random_inputs(onnx.load(str(src), load_external_data=False), dims,
                              int_high=512)
        sessions = {k: make_session(p, optimized=r is not None,
                                    providers=["CPUExecutionProvider"],
                                    prepacking=not args.no_prepacking)
                    for k, (p, r) in rows.items()}
        own_library = runtime.library_path
        foreign: set[str] = set()
        for spec in args.ops:
            label, lib = spec.split("=", 1)
            runtime.library_path = lambda lib=lib: str(Path(lib).resolve())  # type: ignore[assignment]
            try:
                for k, (p, r) in list(rows.items()):
                    if r is None or "[" in k:
                        continue
                    name = f"{k} [{label}]"
                    sessions[name] = make_session(p, optimized=True,
                                                  providers=["CPUExecutionProvider"],
                                                  prepacking=not args.no_prepacking)
                    rows[name] = (p, r)
                    foreign.add(name)
            finally:
                runtime.library_path = own_library  # type: ignore[assignment]
        times: dict[str, list[float]] = {k: [] for k in rows}
        waits: dict[str, list[float]] = {k: [] for k in rows}
        moved: dict[str, int] = {}
        for s in sessions.values():  # warm-up
            s.run(None, feeds)
        for _ in range(args.runs):
            for k, s in sessions.items():
                runtime.reset_counters()
                t = time.perf_counter()
                s.run(None, feeds)
                times[k].append(time.perf_counter() - t)
                c = runtime.counters()
                waits[k].append(c["wait_ns"] / 1e9)
                moved[k] = c["bytes_loaded"] + c["bytes_stored"]
    base = statistics.median(times["original"])
    results = []
    print(f"decoder {args.layers}x{args.hidden}, batch {args.batch}, seq {args.seq}, "
          f"{args.runs} interleaved runs, intra-op threads {args.threads or 'default'} "
          f"(CPU EP, pre-packing "
          f"{'off' if args.no_prepacking else 'on'})")
    print(f"{'model':<32}{'offloaded':>10}{'MiB moved/run':>15}{'median ms':>11}"
          f"{'ratio':>8}{'wait ms':>9}")
    for k, (_, r) in rows.items():
        med = statistics.median(times[k])
        n = 0 if r is None else len(r.choice.weights) + len(r.choice.activations)
        if k in foreign:
            moved[k] = -1
        row = {"model": k, "offloaded_tensors": n, "bytes_moved_per_run": moved[k],
               "median_s": med, "ratio_to_original": med / base,
               "median_wait_s": statistics.median(waits[k]), "runs_s": times[k]}
        results.append(row)
        mib = "-" if k in foreign else f"{moved[k] / 2**20:.1f}"
        wait = "-" if k in foreign else f"{row['median_wait_s'] * 1e3:.2f}"
        print(f"{k:<32}{n:>10}{mib:>15}{med * 1e3:>11.2f}{med / base:>8.3f}{wait:>9}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": vars(args) | {"json": str(args.json)},
                                         "rows": results}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
