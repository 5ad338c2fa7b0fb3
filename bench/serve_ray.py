"""Ray Serve on this machine: the same deployment of the unmodified and the optimized decoder.

Both applications run at once (``--replicas`` CPU replicas each, one run at a time per
replica, ``--threads`` intra-op threads); ``--clients`` HTTP clients send requests in
alternating rounds (A B A B ...) so machine noise hits both alike. Every answer is compared
with the unmodified model run locally at the same ORT level (prepacking off in both): the
table counts answers that are not bit-equal and the largest difference. At ``--opt-level
disable`` they must all be equal; above it ORT fuses the unmodified model's constant
weights (not the optimized model's offloaded ones), so the last bits may differ. Prints a
table (throughput, latency percentiles) and writes JSON.

    python bench/serve_ray.py --layers 4 --hidden 256 --seq 64 --requests 400 \
        --opt-level all --json bench/results/serve_ray_cpu_all.json
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import onnxruntime as ort

from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.target.ort.ray_serve import deployment, pack, replica_stats, unpack
from ho_onnx.target.ort.session import ort_opt_level
from models.decoder import add_shape_args, build_decoder

VOCAB = 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _round(url: str, feeds: list[dict[str, np.ndarray]], want: list[np.ndarray],
           clients: int) -> tuple[list[float], float, int, float]:
    """Send every feed once (``clients`` at a time): latencies (s), wall time, answers not
    bit-equal to ``want``, the largest absolute difference."""
    lat: list[float] = []
    bad = [0]
    worst = [0.0]
    nxt = [0]
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(feeds):
                return
            req = urllib.request.Request(url, data=pack(feeds[i]), method="POST")
            t0 = time.perf_counter()
            with urllib.request.urlopen(req, timeout=120) as r:
                out = unpack(r.read())
            dt = time.perf_counter() - t0
            with lock:
                lat.append(dt)
                bad[0] += not np.array_equal(out["logits"], want[i])
                worst[0] = max(worst[0], float(np.abs(out["logits"] - want[i]).max()))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat, time.perf_counter() - t0, bad[0], worst[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(ap, layers=4, hidden=256, heads=4, seq=64)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per replica")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=400, help="per model, over all rounds")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--opt-level", choices=["disable", "basic", "extended", "all"],
                    default="all", help="ORT graph optimization level of every session")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import ray
    from ray import serve

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "decoder.onnx"
        build_decoder(src, layers=args.layers, hidden=args.hidden, heads=args.heads,
                      vocab=VOCAB, seq=args.seq, batch=args.batch, external_data=True)
        opt = Path(tmp) / "opt" / "decoder.ho.onnx"
        r = optimize(src, opt, OffloadOptions(activations=False, min_bytes=0))
        rng = np.random.default_rng(0)
        feeds = [{"input_ids": rng.integers(0, VOCAB, (args.batch, args.seq), dtype=np.int64)}
                 for _ in range(16)]
        so = ort.SessionOptions()
        so.add_session_config_entry("session.disable_prepacking", "1")
        so.intra_op_num_threads = args.threads
        so.graph_optimization_level = ort_opt_level(args.opt_level)
        ref = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
        want = [ref.run(None, f)[0] for f in feeds]
        del ref
        port = _free_port()
        ray.init(num_cpus=2 * args.replicas * args.threads + 1, include_dashboard=False,
                 log_to_driver=False, object_store_memory=80 << 20)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            urls = {}
            for label, path, optimized in (("unmodified", src, False),
                                           ("optimized", opt, True)):
                serve.run(deployment(path, optimized=optimized, replicas=args.replicas,
                                     threads=args.threads, opt_level=args.opt_level,
                                     name=label),
                          name=label, route_prefix=f"/{label}")
                urls[label] = f"http://127.0.0.1:{port}/{label}"
            per_round = max(1, args.requests // args.rounds)
            work = [feeds[i % len(feeds)] for i in range(per_round)]
            wants = [want[i % len(feeds)] for i in range(per_round)]
            for url in urls.values():  # warm-up: every replica's first runs
                _round(url, work[: 4 * args.replicas], wants[: 4 * args.replicas],
                       args.clients)
            res: dict[str, dict[str, list[float] | float | int]] = {
                k: {"lat": [], "wall": 0.0, "bad": 0, "max_diff": 0.0} for k in urls}
            for _ in range(args.rounds):
                for label, url in urls.items():
                    lat, wall, bad, worst = _round(url, work, wants, args.clients)
                    res[label]["lat"] += lat  # type: ignore[operator]
                    res[label]["wall"] += wall  # type: ignore[operator]
                    res[label]["bad"] += bad  # type: ignore[operator]
                    res[label]["max_diff"] = max(res[label]["max_diff"], worst)  # type: ignore[type-var]
            stats = replica_stats(urls["optimized"], tries=8 * args.replicas)
        finally:
            serve.shutdown()
            ray.shutdown()

    rows = []
    for label, v in res.items():
        lat = sorted(v["lat"])  # type: ignore[arg-type]
        n = len(lat)
        rows.append({
            "model": label, "requests": n, "not_bit_equal": v["bad"],
            "max_abs_diff": v["max_diff"],
            "req_per_s": n / v["wall"],  # type: ignore[operator]
            "p50_ms": 1e3 * statistics.median(lat),
            "p95_ms": 1e3 * lat[min(n - 1, int(0.95 * n))],
            "p99_ms": 1e3 * lat[min(n - 1, int(0.99 * n))],
        })
    base = rows[0]
    print(f"decoder layers={args.layers} hidden={args.hidden} seq={args.seq} "
          f"batch={args.batch}; ORT level {args.opt_level}; {args.replicas} replicas x "
          f"{args.threads} thread(s), "
          f"{args.clients} clients, {len(r.choice.weights)} weights offloaded "
          f"({r.choice.offloaded_bytes:,} bytes)")
    print(f"{'model':<11}{'requests':>9}{'!=':>5}{'max diff':>10}{'req/s':>8}{'p50 ms':>8}"
          f"{'p95 ms':>8}{'p99 ms':>8}{'x req/s':>8}")
    for row in rows:
        print(f"{row['model']:<11}{row['requests']:>9}{row['not_bit_equal']:>5}"
              f"{row['max_abs_diff']:>10.2e}"
              f"{row['req_per_s']:>8.1f}{row['p50_ms']:>8.1f}{row['p95_ms']:>8.1f}"
              f"{row['p99_ms']:>8.1f}{row['req_per_s'] / base['req_per_s']:>8.3f}")
    for pid, c in sorted(stats.items()):
        print(f"optimized replica pid {pid}: host store {c['host_store_bytes']:,} bytes, "
              f"{c['prefetches']} prefetches")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "config": vars(args), "offloaded_bytes": r.choice.offloaded_bytes,
            "rows": rows, "replicas": {str(k): v for k, v in stats.items()},
        }, indent=2) + "\n")
    # Served answers must be what the same session gives locally: the unmodified model's
    # always, the optimized model's too where ORT fuses nothing (--opt-level disable).
    must_equal = rows if args.opt_level == "disable" else rows[:1]
    return 1 if any(row["not_bit_equal"] for row in must_equal) else 0


if __name__ == "__main__":
    sys.exit(main())
