"""The CPU engine behind the cache operators: asynchrony, concurrency, lifetime, memory.

Graphs are written by hand in ONNX text and run in ORT on the CPU.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest
from native_util import testing_ops
from threads import run_threads

from ho_onnx import contract
from ho_onnx.target.ort import runtime

D = contract.DOMAIN
OPSETS = f'["" : 21, "{D}" : 1]'
N = 256  # elements of W and x
ORDERS = ["default", "priority"]


pytestmark = pytest.mark.usefixtures("no_debug_hooks")


def _weight(tmp_path) -> np.ndarray:
    w = (np.arange(N, dtype=np.float32) - 100.0) / 7.0
    with open(tmp_path / "weights.bin", "wb") as f:
        f.write(b"\0" * 16)
        w.tofile(f)
    return w


def _model(tmp_path, body: str, outputs: str = f"float[{N}] out", n: int = N) -> str:
    text = f"""
    <ir_version: 10, opset_import: {OPSETS}>
    g (float[{n}] x) => ({outputs}) <float[0] s0 = {{}}> {{
      {body}
    }}
    """
    path = os.path.join(str(tmp_path), "model.onnx")
    onnx.save(onnx.parser.parse_model(text), path)
    return path


WEIGHT = (
    f'{D}.Prefetch<location = "weights.bin", offset = 16, length = {4 * N}, '
    f'shape = [{N}], name = "W">'
)

# The proper schedule: every consumer reads the Wait output.
PROPER = f"""
      wy = {WEIGHT}(s0)
      t = {D}.Store(x)
      h = Mul(x, x)
      t2 = {D}.Detach(x, t, h)
      y = {D}.Prefetch(t2, wy)
      w = {D}.Wait(wy, h)
      z = {D}.Wait(y, w)
      zw = Mul(z, w)
      out = Add(zw, h)
"""


def _expected(x, w):
    return x * w + x * x


# --------------------------------------------------------------------------------------------
# A missing Wait is caught (and the test can fail)


@pytest.mark.parametrize("order", ORDERS)
def test_consumer_reading_prefetch_output_sees_garbage(tmp_path, order):
    _weight(tmp_path)
    # `bad` reads the Prefetch output before its Wait ran: a race the hooks make visible.
    body = f"""
      wy = {WEIGHT}(s0)
      bad = Add(wy, x)
      w = {D}.Wait(wy, bad)
      out = Add(w, x)
    """
    path = _model(tmp_path, body, f"float[{N}] out, float[{N}] bad")
    sess = runtime.InferenceSession(path, execution_order=order)
    x = np.ones(N, np.float32)
    testing_ops().set_debug(delay_us=20000, poison=True)
    out, bad = sess.run(None, {"x": x})
    np.testing.assert_array_equal(out, _weight(tmp_path) + x)
    assert np.isnan(bad).all()  # 0xFF bytes: the transfer had not landed


@pytest.mark.parametrize("order", ORDERS)
def test_proper_schedule_is_right_with_slow_transfers(tmp_path, order):
    w = _weight(tmp_path)
    sess = runtime.InferenceSession(_model(tmp_path, PROPER), execution_order=order)
    x = np.random.default_rng(0).random(N).astype(np.float32)
    testing_ops().set_debug(delay_us=20000, poison=True)
    for _ in range(3):
        (out,) = sess.run(None, {"x": x})
        np.testing.assert_array_equal(out, _expected(x, w))


@pytest.mark.parametrize("order", ORDERS)
def test_skip_wait_breaks_the_proper_schedule(tmp_path, order):
    w = _weight(tmp_path)
    sess = runtime.InferenceSession(_model(tmp_path, PROPER), execution_order=order)
    x = np.random.default_rng(0).random(N).astype(np.float32)
    testing_ops().set_debug(delay_us=20000, poison=True, skip_wait=True)
    (out,) = sess.run(None, {"x": x})
    testing_ops().set_debug()
    time.sleep(0.1)
    # a skipped Wait cancels its transfer (nothing lands late), so consumers read the poison
    assert np.isnan(out).all()
    # the engine recovers: stale transfers are waited for by the next Prefetch of a buffer
    for _ in range(3):
        (out,) = sess.run(None, {"x": x})
        np.testing.assert_array_equal(out, _expected(x, w))


def test_unwaited_transfers_are_cancelled_with_the_engine(tmp_path, young_heap):
    """A graph without its Waits leaves transfers queued; destroying the session drops them
    (they would write into ORT's freed buffers) instead of running them."""
    _weight(tmp_path)
    k = 10
    body = "\n".join(f"wy{i} = {WEIGHT}(s0)\n r{i} = ReduceSum(wy{i})" for i in range(k))
    sums = ", ".join(f"r{i}" for i in range(k))
    body += f"\n out = Sum({sums})"
    sess = runtime.InferenceSession(_model(tmp_path, body, "float out"))
    gc.collect()
    alive = runtime.counters()["engines_alive"]
    testing_ops().set_debug(delay_us=50_000, poison=True)
    (out,) = sess.run(None, {"x": np.ones(N, np.float32)})
    assert np.isnan(out)
    t0 = time.perf_counter()
    del sess
    gc.collect()
    assert time.perf_counter() - t0 < 0.3  # not k * 50 ms: queued transfers were dropped
    assert runtime.counters()["engines_alive"] == alive - 1


# --------------------------------------------------------------------------------------------
# Concurrent runs on one session; exact counters


@pytest.mark.parametrize("order", ORDERS)
def test_concurrent_runs(tmp_path, order):
    w = _weight(tmp_path)
    sess = runtime.InferenceSession(_model(tmp_path, PROPER), execution_order=order)
    threads, runs = 4, 50
    errors: list[BaseException] = []
    runtime.reset_counters()

    def worker(k: int) -> None:
        rng = np.random.default_rng(k)
        try:
            for _ in range(runs):
                x = rng.random(N).astype(np.float32) * (k + 1)
                (out,) = sess.run(None, {"x": x})
                np.testing.assert_array_equal(out, _expected(x, w))
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    run_threads(worker, threads)
    assert not errors, errors[0]
    c = runtime.counters()
    total = threads * runs
    assert c["bytes_loaded"] == total * 2 * 4 * N  # W and the stored x come back each run
    assert c["bytes_stored"] == total * 4 * N
    assert c["prefetches"] == total * 2
    assert c["stores"] == total
    assert c["waits"] == total * 3  # two Waits and a Detach
    assert c["host_pool_bytes_in_use"] == 0


def test_parallel_executor_concurrent(tmp_path):
    w = _weight(tmp_path)
    so = ort.SessionOptions()
    so.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    sess = runtime.InferenceSession(_model(tmp_path, PROPER), sess_options=so)
    x = np.random.default_rng(3).random(N).astype(np.float32)
    for _ in range(20):
        (out,) = sess.run(None, {"x": x})
        np.testing.assert_array_equal(out, _expected(x, w))


# --------------------------------------------------------------------------------------------
# Engine lifetime


def test_engine_lifetime(tmp_path):
    _weight(tmp_path)
    path = _model(tmp_path, PROPER)
    gc.collect()
    base = runtime.counters()
    s1 = runtime.InferenceSession(path)
    s2 = runtime.InferenceSession(path)
    c = runtime.counters()
    # one engine per library configuration (issue 9: registrations are shared, so creating
    # and destroying sessions retains nothing): the two sessions share it, and its weights
    assert c["engines_alive"] == base["engines_alive"] + 1
    assert c["host_store_bytes"] == base["host_store_bytes"] + 4 * N
    so = runtime.session_options(path)
    s3 = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    s4 = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    assert runtime.counters()["engines_alive"] == base["engines_alive"] + 1
    # another configuration: another engine
    so5 = ort.SessionOptions()
    so5.add_session_config_entry("ho_onnx.model_dir", str(tmp_path))
    so5.add_session_config_entry("ho_onnx.host_pool_limit_bytes", str(1 << 30))
    so5.register_custom_ops_library(runtime.library_path())
    s5 = ort.InferenceSession(path, so5, providers=["CPUExecutionProvider"])
    assert runtime.counters()["engines_alive"] == base["engines_alive"] + 2
    del s5, so5
    gc.collect()
    x = np.ones(N, np.float32)
    for s in (s1, s2, s3, s4):
        s.run(None, {"x": x})
    del s1, s2, s3
    gc.collect()
    assert runtime.counters()["engines_alive"] == base["engines_alive"] + 1
    s4.run(None, {"x": x})
    del s4, s, so
    gc.collect()
    c = runtime.counters()
    assert c["engines_alive"] == base["engines_alive"]
    assert c["host_store_bytes"] == base["host_store_bytes"]
    assert c["host_pool_bytes_reserved"] == base["host_pool_bytes_reserved"]


# --------------------------------------------------------------------------------------------
# Stable memory


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.slow
def test_memory_is_stable(tmp_path):
    w = _weight(tmp_path)
    n = 64 * 1024  # 256 KiB stored per run
    body = f"""
      t = {D}.Store(x)
      h = Mul(x, x)
      t2 = {D}.Detach(x, t, h)
      wy = {WEIGHT}(s0)
      y = {D}.Prefetch(t2, wy)
      w = {D}.Wait(wy, h)
      z = {D}.Wait(y, w)
      s = ReduceSum(w)
      zs = Mul(z, s)
      out = Add(zs, h)
    """
    sess = runtime.InferenceSession(_model(tmp_path, body, f"float[{n}] out", n=n))
    x = np.random.default_rng(0).random(n).astype(np.float32)
    expected = x * w.sum(dtype=np.float32) + x * x
    for _ in range(20):
        sess.run(None, {"x": x})
    rss0 = _rss_bytes()
    reserved0 = runtime.counters()["host_pool_bytes_reserved"]
    for _ in range(300):
        (out,) = sess.run(None, {"x": x})
        assert runtime.counters()["host_pool_bytes_in_use"] == 0
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert runtime.counters()["host_pool_bytes_reserved"] == reserved0  # buffers reused
    if "libasan" not in os.environ.get("LD_PRELOAD", ""):  # ASan's quarantine holds freed memory
        assert _rss_bytes() - rss0 < 4 * 1024 * 1024


# --------------------------------------------------------------------------------------------
# Per-provider counters: what tells a CUDA run from a CPU fallback (test_cuda_engine.py)

CUDA_ONLY = ("ops_cuda", "cuda_bytes_h2d", "cuda_bytes_d2h", "cuda_bytes_d2d")


@pytest.mark.parametrize("order", ORDERS)
def test_cpu_engine_counts_ops_cpu_and_never_the_cuda_counters(tmp_path, order):
    w = _weight(tmp_path)
    sess = runtime.InferenceSession(_model(tmp_path, PROPER), execution_order=order)
    x = np.random.default_rng(1).random(N).astype(np.float32)
    before = runtime.counters()
    runs = 3
    for _ in range(runs):
        (out,) = sess.run(None, {"x": x})
        np.testing.assert_array_equal(out, _expected(x, w))
    after = runtime.counters()
    cache_ops = PROPER.count(f"{D}.")  # Prefetch x2, Store, Detach, Wait x2
    assert cache_ops == 6
    assert after["ops_cpu"] - before["ops_cpu"] == runs * cache_ops
    for name in CUDA_ONLY:
        assert after[name] == before[name], name
    # bytes the CPU engine moved: W and x loaded, x stored, every run
    assert after["bytes_loaded"] - before["bytes_loaded"] == runs * 2 * 4 * N


def test_failed_compute_is_not_counted(tmp_path):
    body = f"""
      w = {D}.Wait(x)
      out = Add(w, x)
    """
    sess = runtime.InferenceSession(_model(tmp_path, body), execution_order="priority")
    before = runtime.counters()["ops_cpu"]
    with pytest.raises(Exception, match="no transfer pending"):
        sess.run(None, {"x": np.ones(N, np.float32)})
    assert runtime.counters()["ops_cpu"] == before


def test_reset_counters_resets_the_per_provider_counters(tmp_path):
    w = _weight(tmp_path)
    sess = runtime.InferenceSession(_model(tmp_path, PROPER))
    x = np.ones(N, np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], _expected(x, w))
    assert runtime.counters()["ops_cpu"] > 0
    runtime.reset_counters()
    c = runtime.counters()
    assert c["ops_cpu"] == 0 and c["ops_cuda"] == 0 and c["cuda_bytes_h2d"] == 0


def test_session_creation_times_the_kernels_and_the_weight_loads(tmp_path):
    """kernel_create_ns / weight_load_ns (where a session's creation goes: the GPU session
    of stop 45 spent 25-30 s creating each MoE session) grow with every session made, are
    left alone by reset_counters and by runs, and loading is part of creating."""
    _weight(tmp_path)
    runtime.reset_counters()
    c0 = runtime.counters()
    sess = runtime.InferenceSession(_model(tmp_path, PROPER))
    c1 = runtime.counters()
    made, loaded = (c1[k] - c0[k] for k in ("kernel_create_ns", "weight_load_ns"))
    assert 0 < loaded <= made
    runtime.reset_counters()
    sess.run(None, {"x": np.ones(N, np.float32)})
    c2 = runtime.counters()
    assert (c2["kernel_create_ns"], c2["weight_load_ns"]) == (c1["kernel_create_ns"],
                                                              c1["weight_load_ns"])


# --------------------------------------------------------------------------------------------
# ORT's arena as measured: AllocatorGetStats (ORT API 23) sampled at every Wait


def _one_weight_model(tmp_path, n: int) -> str:
    np.arange(n, dtype=np.float32).tofile(tmp_path / f"w{n}.bin")
    text = f"""
    <ir_version: 10, opset_import: {OPSETS}>
    g (float[{n}] x) => (float[{n}] out) <float[0] s0 = {{}}> {{
      wy = {D}.Prefetch<location = "w{n}.bin", offset = 0, length = {4 * n}, shape = [{n}],
                        name = "W">(s0)
      w = {D}.Wait(wy)
      out = Add(w, x)
    }}
    """
    path = os.path.join(str(tmp_path), f"m{n}.onnx")
    onnx.save(onnx.parser.parse_model(text), path)
    return path


def _sampling_options(on: bool) -> ort.SessionOptions | None:
    """Session options with arena sampling on (``ho_onnx.sample_arena=1``); None: default."""
    if not on:
        return None
    so = ort.SessionOptions()
    so.add_session_config_entry(contract.CONFIG_SAMPLE_ARENA, "1")
    return so


def _arena_gauges() -> tuple[int, int, int]:
    c = runtime.counters()
    return c["ort_arena_in_use"], c["ort_arena_max_in_use"], c["ort_arena_total_allocated"]


def test_wait_samples_the_cpu_arena(tmp_path):
    if tuple(int(p) for p in ort.__version__.split(".")[:2]) < (1, 23):
        pytest.skip("AllocatorGetStats needs onnxruntime >= 1.23")
    big, small = 2 << 20, 1 << 10  # elements: an 8 MiB and a 4 KiB weight
    for n in (big, small):  # (each session's own arena: the shared one is the process's)
        sess = runtime.InferenceSession(_one_weight_model(tmp_path, n), cpu_arena="ort",
                                        sess_options=_sampling_options(True))
        x = np.ones(n, np.float32)
        out = sess.run(None, {"x": x})[0]
        np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32) + 1)
        c = runtime.counters()
        in_use, peak, total = (c["ort_arena_in_use"], c["ort_arena_max_in_use"],
                               c["ort_arena_total_allocated"])
        # At the Wait the Prefetch output (4n bytes) is live in this session's CPU arena.
        assert in_use >= 4 * n, (n, in_use)
        assert total >= peak >= in_use, (total, peak, in_use)
        if n == small:
            # sampled at this session's Wait, not left over from the big one
            assert in_use < 4 * big, in_use
        del sess


def test_the_shared_cpu_arena_grows_by_what_is_requested(tmp_path):
    """ho-onnx's sessions share one CPU arena grown by what is requested: it holds what was in
    use, where ORT's own arena (grown by powers of two) holds more. Each in a fresh process
    (the shared arena is the process's). Both exact."""
    if tuple(int(p) for p in ort.__version__.split(".")[:2]) < (1, 23):
        pytest.skip("AllocatorGetStats needs onnxruntime >= 1.23")
    model = _one_weight_model(tmp_path, 3 << 20)  # a 12 MiB weight
    code = (
        "import sys, numpy as np; from ho_onnx.target.ort import runtime as r; "
        "import onnxruntime as ort; so = ort.SessionOptions(); "
        "so.add_session_config_entry('ho_onnx.sample_arena', '1'); "
        f"s = r.InferenceSession({str(model)!r}, cpu_arena=sys.argv[1], sess_options=so); "
        "n = 3 << 20; out = s.run(None, {'x': np.ones(n, np.float32)})[0]; "
        "assert (out == np.arange(n, dtype=np.float32) + 1).all(); c = r.counters(); "
        "print(r._config(s.get_session_options(), 'session.use_env_allocators') or '0', "
        "c['ort_arena_max_in_use'], c['ort_arena_total_allocated'])")
    got = {}
    for arena in ("ort", "as_requested"):
        p = subprocess.run([sys.executable, "-c", code, arena], capture_output=True, text=True,
                           check=True)
        env, peak, total = p.stdout.split()
        got[arena] = (env, int(peak), int(total))
    assert got["as_requested"][0] == "1" and got["ort"][0] == "0", got
    _, peak, total = got["as_requested"]
    assert peak <= total <= peak + (1 << 20), got  # (within a MiB of what was in use)
    assert got["ort"][2] >= total + (2 << 20), got  # (16 MiB for 12: a power of two)
    with pytest.raises(ValueError, match="cpu_arena"):
        runtime.session_options(None, cpu_arena="big")


def test_the_arena_grows_as_requested_only_for_fixed_input_shapes(tmp_path):
    """``cpu_arena="auto"`` (the default): the shared arena grown by what is requested for a
    model whose every input has a fixed shape (its runs ask for the same sizes), ORT's own
    for one with a symbolic dim (a decode loop asks for more at every step: stop 50), for
    an unreadable model and without one; the CUDA EP's options follow."""
    fixed = _one_weight_model(tmp_path, 16)
    symbolic = os.path.join(str(tmp_path), "sym.onnx")
    onnx.save(onnx.parser.parse_model(f"""
    <ir_version: 10, opset_import: {OPSETS}>
    g (float[N] x) => (float[N] out) {{ out = Neg(x) }}
    """), symbolic)
    assert runtime.arena_for(fixed) == "as_requested"
    assert runtime.arena_for(Path(fixed).read_bytes()) == "as_requested"
    assert runtime.arena_for(symbolic) == runtime.arena_for(None) == "ort"
    assert runtime.arena_for(b"not a model") == "ort"
    env = "session.use_env_allocators"
    assert runtime._config(runtime.InferenceSession(fixed).get_session_options(), env) == "1"
    assert runtime._config(runtime.InferenceSession(symbolic).get_session_options(), env) != "1"
    assert runtime._config(runtime.session_options(symbolic, cpu_arena="as_requested"),
                           env) == "1"
    assert runtime.with_cuda_arena(["CUDAExecutionProvider"], as_requested=False) == [
        ("CUDAExecutionProvider", {})]
    with pytest.raises(ValueError, match="cpu_arena"):
        runtime.InferenceSession(fixed, cpu_arena="big")


def test_arena_is_not_sampled_by_default(tmp_path):
    """Without ho_onnx.sample_arena=1 no Wait samples the arena (a per-Wait cost): the gauges
    keep what an earlier sampled session left (-1 when none ran in this process)."""
    big, small = 2 << 20, 1 << 10  # elements: an 8 MiB and a 4 KiB weight

    def run(n: int, sample: bool) -> None:
        sess = runtime.InferenceSession(_one_weight_model(tmp_path, n),
                                        sess_options=_sampling_options(sample))
        out = sess.run(None, {"x": np.ones(n, np.float32)})[0]
        np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32) + 1)

    if tuple(int(p) for p in ort.__version__.split(".")[:2]) >= (1, 23):
        run(big, sample=True)  # the gauges now hold the big weight (in use >= 4 * big)
        assert _arena_gauges()[0] >= 4 * big
    before = _arena_gauges()
    run(small, sample=False)  # a sample here would show in use < 4 * big
    assert _arena_gauges() == before


def test_bad_sample_arena_entry_is_refused(tmp_path):
    so = ort.SessionOptions()
    so.add_session_config_entry(contract.CONFIG_SAMPLE_ARENA, "yes")
    with pytest.raises(Exception, match=r"ho_onnx\.sample_arena.*0 or 1"):
        runtime.InferenceSession(_one_weight_model(tmp_path, 16), sess_options=so)


def test_set_debug_names_one_flag_per_edge():
    ops = testing_ops()
    for flag in ("skip_staging_fence", "skip_detach_wait", "skip_wait_event", "skip_store_start"):
        ops.set_debug(**{flag: True})  # accepted (CUDA engine only)
    ops.set_debug()
    with pytest.raises(TypeError, match="unknown hook 'skip_order'"):
        ops.set_debug(skip_order=True)  # removed: it named two edges at once

