"""Child process of the failure-class tests (test_native_safety.py): a scenario that may
crash the process on a broken library runs here, and the parent checks the exit status.

    python tests/native_child.py interleave --arena 0 --order default --tier host

Prints one JSON line {"good": n, "bad": n, "wrong": n, "pool_in_use": bytes} and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from native_util import N, ops, session, session_options, testing_ops, write_failure_model


def interleave(args: argparse.Namespace) -> dict:
    """Failing and good runs interleaved on one session from several threads."""
    with tempfile.TemporaryDirectory() as tmp:
        path, w = write_failure_model(Path(tmp), args.tier, N,
                                      with_wait=not args.no_wait,
                                      with_detach=not args.no_detach)
        so = session_options(Path(tmp), arena=bool(args.arena), order=args.order)
        sess = session(path, so)
        testing_ops().set_debug(delay_us=args.delay_us)
        stats = {"good": 0, "bad": 0, "wrong": 0, "other": 0}
        lock = threading.Lock()

        def worker(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for i in range(args.runs):
                x = rng.standard_normal(N).astype(np.float32)
                bad = (i + seed) % 2 == 0
                idx = np.array([100 if bad else 1], np.int64)
                try:
                    (out,) = sess.run(None, {"x": x, "idx": idx})
                except Exception as e:  # the failing Gather
                    with lock:
                        stats["bad" if (bad and "Gather" in str(e)) or "indices" in str(e)
                              else "other"] += 1
                    continue
                ok = np.array_equal(out, np.maximum(x, 0) + w)
                with lock:
                    stats["good" if ok and not bad else "wrong"] += 1

        pool = [threading.Thread(target=worker, args=(k,)) for k in range(args.threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        testing_ops().set_debug()
        # Python's join() returns before the thread's C++ thread-locals are destroyed (which
        # is when the engine learns that the thread's runs are over): give them a moment.
        time.sleep(0.3)
        # every thread's last run was good or bad; one more good run per thread releases
        # what a failed run left (its records belong to that thread's earlier run)
        def final() -> None:
            x = np.ones(N, np.float32)
            sess.run(None, {"x": x, "idx": np.array([1], np.int64)})

        pool = [threading.Thread(target=final) for _ in range(args.threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        stats["pool_in_use"] = ops().counters()["host_pool_bytes_in_use"]
        return stats


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["interleave"])
    ap.add_argument("--arena", type=int, default=1)
    ap.add_argument("--order", default="priority")
    ap.add_argument("--tier", default="host")
    ap.add_argument("--threads", type=int, default=3)
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--delay-us", type=int, default=3000)
    ap.add_argument("--no-wait", action="store_true")
    ap.add_argument("--no-detach", action="store_true")
    args = ap.parse_args()
    print(json.dumps(interleave(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
