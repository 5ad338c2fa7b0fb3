"""A bounded serving soak (issue 34): ho-onnx as a server uses it, checked against the
unmodified model, with everything it holds back at its baseline afterwards.

Threads serve requests (``run``, or ``run_async`` on sessions of their own) for the same
optimized model folders (weights on the host tier and on the disk tier, activations
stored): a fresh session per request, one kept per thread or one shared by all, lengths
that change from request to request, and requests that fail in the middle of a run (an
out-of-range index read after the activations were stored). Meanwhile the model is
re-optimized in place, into the same output, from a second version with other weights (a
hot swap). Every good request's outputs must equal the unmodified model's of the version
its session opened (bit-exact: the same kernels, ORT's optimizations and pre-packing off),
a failing one must fail with ORT's index error, and a session opened during a swap may only
be refused with a clear error (never run the other version's bytes). At the end, with every
session gone: the host pool holds nothing, the host store no weight, no engine is alive,
the process has its baseline descriptors and registrations, and malloc's bytes in use are
within 8 MiB of the baseline (RSS is reported: it keeps memory malloc holds free). Before
that, with the long-lived sessions still open, the requests' stores and the swapped
versions' weights must already be gone.

    .venv/bin/python tests/serving_soak.py --seconds 600 --threads 8   # longer, by hand

Prints one JSON line (the counts) and exits 0, or 1 naming what broke.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
from onnx import numpy_helper

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import onnxruntime as ort  # noqa: E402

import ho_onnx  # noqa: E402
from ho_onnx.schedule.options import OffloadOptions  # noqa: E402
from ho_onnx.target.ort import runtime  # noqa: E402

# h1 and h2 are used early and late: stored across the gap. The index of ``g`` depends on h6
# (times zero), so a bad ``idx`` fails the run after the Stores, never before them.
MODEL = """
<ir_version: 8, opset_import: ["" : 17]>
soak (float[batch, seq, 32] x, int64[1] idx) => (float[batch, seq, 32] y) {
  h1 = MatMul(x, W1)
  h2 = Relu(h1)
  h3 = MatMul(h2, W2)
  h4 = Sigmoid(h3)
  h5 = MatMul(h4, W3)
  h6 = Tanh(h5)
  m = ReduceMin<keepdims = 0>(h6)
  m0 = Mul(m, zero)
  k = Cast<to = 7>(m0)
  i = Add(idx, k)
  g = Gather(table, i)
  h7 = Add(h6, h1)
  h8 = Mul(h7, h2)
  y = Add(h8, g)
}
"""
GOOD, BAD = np.array([2], np.int64), np.array([40], np.int64)
OPTIONS = {"host": OffloadOptions(min_bytes=0, min_gap=1, prefetch_distance=2),
           "disk": OffloadOptions(min_bytes=0, min_gap=1, prefetch_distance=2,
                                  weight_tier="disk")}


def source_model(version: int) -> onnx.ModelProto:
    m = onnx.parser.parse_model(MODEL)
    rng = np.random.default_rng(version)
    for name in ("W1", "W2", "W3"):
        w = (rng.standard_normal((32, 32)) * 0.3).astype(np.float32)
        m.graph.initializer.append(numpy_helper.from_array(w, name))
    m.graph.initializer.append(numpy_helper.from_array(np.zeros((), np.float32), "zero"))
    m.graph.initializer.append(numpy_helper.from_array(
        np.arange(4, dtype=np.float32) + version, "table"))
    onnx.helper.set_model_props(m, {"soak_version": str(version)})
    onnx.checker.check_model(m)
    return m


def _options() -> ort.SessionOptions:
    """The same kernels in both models: no graph optimizations, no pre-packing (an
    offloaded weight is not a constant ORT can pre-pack; README, "Correctness")."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.add_session_config_entry("session.disable_prepacking", "1")
    so.log_severity_level = 4
    return so


def _plain(path: Path) -> ort.InferenceSession:
    so = _options()
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _heap_in_use() -> int | None:
    """Bytes malloc has handed out and not had back, over all its arenas (glibc's
    malloc_info), or None elsewhere. The leak measure: RSS also counts freed memory malloc
    keeps (measured: sessions made per request and run with ``run_async`` from 4 threads,
    plain ORT as well as ho-onnx, grew RSS by 100+ MB in 30 s while this stayed within
    0.1 MB)."""
    import ctypes
    import re

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.open_memstream.restype = ctypes.c_void_p
    except (OSError, AttributeError):
        return None
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    try:
        if libc.malloc_info(0, ctypes.c_void_p(stream)) != 0:
            return None
    finally:
        libc.fclose(ctypes.c_void_p(stream))
    xml = ctypes.string_at(buf, size.value).decode()
    libc.free(buf)
    total = xml[xml.rindex("</heap>"):]  # (the totals over every arena)
    free = sum(int(n) for n in re.findall(
        r'<total type="(?:fast|rest)" count="\d+" size="(\d+)"', total))
    current = int(re.search(r'<system type="current" size="(\d+)"', total).group(1))
    mmapped = int(re.search(r'<total type="mmap" count="\d+" size="(\d+)"', total).group(1))
    return current - free + mmapped


class Soak:
    def __init__(self, work: Path, seconds: float, threads: int, seed: int) -> None:
        self.work, self.seconds, self.threads = work, seconds, threads
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts = {"good": 0, "failed_as_asked": 0, "refused_during_swap": 0, "swaps": 0,
                       "fresh_sessions": 0}
        self.errors: list[str] = []
        self.keepers: dict[str, ort.InferenceSession] = {}
        self.refs: dict[int, ort.InferenceSession] = {}
        self.folders = {tier: work / tier for tier in OPTIONS}
        for v in (0, 1):
            src = work / f"src{v}.onnx"
            onnx.save(source_model(v), str(src))
            self.refs[v] = _plain(src)
        for tier, folder in self.folders.items():
            folder.mkdir()
            ho_onnx.optimize(work / "src0.onnx", folder / "model.onnx", OPTIONS[tier],
                             {"batch": 1, "seq": 8})

    def session(self, tier: str) -> ort.InferenceSession:
        return ho_onnx.InferenceSession(self.folders[tier] / "model.onnx",
                                        sess_options=_options())

    @staticmethod
    def infer(sess: ort.InferenceSession, feeds: dict, r: random.Random, shared: bool) -> list:
        """``sess.run``, or (not on a ``shared`` session) ``run_async`` waited for: ORT's
        thread pool runs it, and a failed one's records wait for that pool thread's next
        run of the session or the session's end (README, "What a server may rely on")."""
        if shared or r.random() < 0.7:
            return sess.run(None, feeds)
        done = threading.Event()
        box: list = []

        def callback(outputs: list, _: object, error: str) -> None:
            box.append(outputs if not error else RuntimeError(error))
            done.set()

        sess.run_async(None, feeds, callback, None)
        if not done.wait(60):
            raise AssertionError("run_async never called back")
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    def check(self, sess: ort.InferenceSession, r: random.Random, shared: bool = False) -> None:
        version = int(sess.get_modelmeta().custom_metadata_map["soak_version"])
        x = np.asarray([r.gauss(0, 1) for _ in range(32 * r.randint(1, 6) * r.randint(1, 40))],
                       np.float32).reshape(-1, 32)
        x = x.reshape(1, -1, 32) if r.random() < 0.5 else x.reshape(x.shape[0], 1, 32)
        if r.random() < 0.3:
            try:
                self.infer(sess, {"x": x, "idx": BAD}, r, shared)
            except Exception as e:
                if "indices" not in str(e) and "Gather" not in str(e):
                    raise AssertionError(f"a failing request failed otherwise: {e}") from None
                self.count("failed_as_asked")
                return
            raise AssertionError("a request with a bad index succeeded")
        (y,) = self.infer(sess, {"x": x, "idx": GOOD}, r, shared)
        (ref,) = self.refs[version].run(None, {"x": x, "idx": GOOD})
        if not np.array_equal(y, ref):
            raise AssertionError(f"WRONG ANSWER (version {version}, shape {x.shape}): max "
                                 f"abs {float(np.abs(y - ref).max()):.3g}")
        self.count("good")

    def count(self, key: str) -> None:
        with self.lock:
            self.counts[key] += 1

    def worker(self, k: int, deadline: float) -> None:
        r = random.Random(self.rng.random() + k)
        kept: dict[str, ort.InferenceSession] = {}
        try:
            while time.monotonic() < deadline:
                tier = r.choice(list(OPTIONS))
                shared = r.random() < 0.1  # the long-lived session, shared by every thread
                try:
                    if shared:
                        sess = self.keepers[tier]
                    elif r.random() < 0.6 or tier not in kept:
                        sess = self.session(tier)
                        self.count("fresh_sessions")
                        if r.random() < 0.3:
                            kept[tier] = sess
                    else:
                        sess = kept[tier]
                except Exception as e:
                    if "fingerprint" in str(e) or "bytes but the model" in str(e) or (
                            "No such file" in str(e)):
                        self.count("refused_during_swap")  # a swap was under way: clear
                        continue
                    raise
                self.check(sess, r, shared)
        except BaseException as e:
            with self.lock:
                self.errors.append(f"thread {k}: {type(e).__name__}: {e}")

    def swapper(self, deadline: float) -> None:
        v = 0
        try:
            while time.monotonic() < deadline - 0.5:
                time.sleep(0.3)
                v = 1 - v
                for tier, folder in self.folders.items():
                    ho_onnx.optimize(self.work / f"src{v}.onnx", folder / "model.onnx",
                                     OPTIONS[tier], {"batch": 1, "seq": 8})
                self.count("swaps")
        except BaseException as e:
            with self.lock:
                self.errors.append(f"swapper: {type(e).__name__}: {e}")

    def run(self) -> dict:
        deadline = time.monotonic() + self.seconds
        ts = [threading.Thread(target=self.worker, args=(k, deadline))
              for k in range(self.threads)]
        ts.append(threading.Thread(target=self.swapper, args=(deadline,)))
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return self.counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ho_soak_") as tmp:
        work = Path(tmp)
        # warm-up: imports, the library, ORT's own allocations, one session of each tier
        soak = Soak(work, args.seconds, args.threads, args.seed)
        for tier in OPTIONS:
            soak.check(soak.session(tier), random.Random(1))
        gc.collect()
        base = {"fds": _fds(), "rss": _rss(), "heap": _heap_in_use(), **runtime.counters()}
        soak.keepers = {tier: soak.session(tier) for tier in OPTIONS}
        kept_store = runtime.counters()["host_store_bytes"]  # the keepers' weights
        counts = soak.run()
        errors = soak.errors
        gc.collect()
        for keeper in soak.keepers.values():  # (a call after the workers' threads ended
            soak.check(keeper, random.Random(2), shared=True)  # releases what they left)
        del keeper
        # Every request's session is gone; the long-lived ones keep the engines: what the
        # requests left must be gone already (failed requests' stores, swapped versions'
        # weights), not only when the engine goes.
        c = runtime.counters()
        for name, ok in {"host_pool_bytes_in_use (long-lived sessions open)":
                         c["host_pool_bytes_in_use"] == 0,
                         "host_store_bytes (long-lived sessions open)":
                         c["host_store_bytes"] == kept_store}.items():
            if not ok:
                errors.append(f"not released while the engine lives: {name}: "
                              f"{c['host_pool_bytes_in_use']} in use, "
                              f"{c['host_store_bytes']} stored (keepers' {kept_store})")
        soak.keepers.clear()
        gc.collect()
        c = runtime.counters()
        after = {"fds": _fds(), "rss": _rss(), "heap": _heap_in_use(), **c}
        rss_growth = after["rss"] - base["rss"]
        checks = {
            "host_pool_bytes_in_use": c["host_pool_bytes_in_use"] == 0,
            "host_store_bytes": c["host_store_bytes"] == 0,
            "engines_alive": c["engines_alive"] == 0,
            "disk_files_open": c.get("disk_files_open", 0) == 0,
            "registrations_held": c.get("registrations_held", 0)
            <= base.get("registrations_held", 0),
            "fds": after["fds"] <= base["fds"],
            # malloc's bytes in use where it tells them, else RSS (which holds freed memory)
            "heap" if base["heap"] is not None else "rss":
            (after["heap"] - base["heap"] < (8 << 20)) if base["heap"] is not None
            else rss_growth < (512 << 20),
        }
        for name, ok in checks.items():
            if not ok:
                errors.append(f"not back to baseline: {name} (before {base.get(name)}, after "
                              f"{after.get(name)})")
        if counts["good"] == 0 or counts["failed_as_asked"] == 0 or counts["swaps"] == 0:
            errors.append(f"the soak did not exercise every path: {counts}")
        heap = None if base["heap"] is None else after["heap"] - base["heap"]
        print(json.dumps({**counts, "rss_growth": rss_growth, "heap_growth": heap,
                          "errors": errors}))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
