"""The CUDA engine on CUDAExecutionProvider: outputs, stream ordering, concurrency, memory.

Every test here needs an NVIDIA GPU, a CUDA build of the library and onnxruntime-gpu; each
is marked ``gpu`` and skipped with the reason otherwise (``scripts/gpu_run.sh`` runs them on
a GPU machine). The fault hooks (``_ops_testing.set_debug``) make a missing event edge visible
instead of rare: ``poison`` fills every Prefetch output with 0xFF before its copy, ``delay_us``
spins the copy streams before each copy, ``compute_delay_us`` spins the compute stream at
each Prefetch, and one ``skip_*`` flag per ordering edge removes exactly that edge
(docs/cuda.md, "The hazards").

Every test asserts something a CPU fallback would fail: the cache ops ran on the CUDA EP
(``ops_cuda`` grew by the number of cache ops each run executes and ``ops_cpu`` did not),
and the bytes the CUDA engine copied (``cuda_bytes_h2d`` / ``cuda_bytes_d2h``) are what the
plan moves. The CPU engine never touches those counters (test_engine_cpu.py checks that).
"""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from native_util import testing_ops, write_moving_failure_model
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException
from threads import run_threads

from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.target.ort import runtime
from models.decoder import build_decoder

_ops = runtime._ops()
_testing = testing_ops()  # the fault hooks (a testing build: native_util.testing_ops)
CUDA_EP = "CUDAExecutionProvider"


def _skip_reason() -> str | None:
    if not _ops.build_info()["cuda_compiled"]:
        return "ho_onnx was built without CUDA (no nvcc at build time)"
    if CUDA_EP not in ort.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)"
    if _ops.cuda_device_count() == 0:
        return "no CUDA device (or no driver)"
    return None


_REASON = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

PROVIDERS = [(CUDA_EP, {"device_id": 0}), "CPUExecutionProvider"]
DIMS = {"batch": 2, "seq": 16}
VOCAB = 256
FORCE_ALL = OffloadOptions(min_bytes=0, min_gap=1, prefetch_distance=2)


@pytest.fixture(autouse=True)
def _no_debug_hooks():
    _testing.set_debug()
    _ops.set_trace()
    yield
    _testing.set_debug()
    _ops.set_trace()
    gc.collect()


def _session(path, *, optimized: bool, order: str = "priority", host_bytes: int | None = None,
             sample_arena: bool = False):
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    so.execution_order = (ort.ExecutionOrder.PRIORITY_BASED if order == "priority"
                          else ort.ExecutionOrder.DEFAULT)
    if optimized:
        so.add_session_config_entry("ho_onnx.model_dir", os.path.dirname(os.path.abspath(path)))
        if host_bytes is not None:
            so.add_session_config_entry("ho_onnx.host_bytes", str(host_bytes))
        if sample_arena:  # every Wait samples ORT's arena into the ort_arena_* gauges
            so.add_session_config_entry("ho_onnx.sample_arena", "1")
        so.register_custom_ops_library(runtime.library_path())  # reads the entries above
    return ort.InferenceSession(str(path), sess_options=so, providers=PROVIDERS)


def _feeds(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, VOCAB, (DIMS["batch"], DIMS["seq"]), dtype=np.int64)}


def _optimized_decoder(folder, layers: int, options: OffloadOptions):
    """(original, optimized, optimize's result) of a decoder of ``layers`` layers."""
    src = folder / "dec.onnx"
    build_decoder(src, layers=layers, hidden=128, heads=4, vocab=VOCAB, external_data=True)
    opt = folder / "dec.ho.onnx"
    return src, opt, optimize(src, opt, options, DIMS)


def _stored_by_the_cpu_engine(opt) -> int:
    """Bytes one run of ``opt`` stores on the CPU EP (the CPU engine runs the same plan).
    The plan's sizes are not enough: a tensor whose length shape inference cannot bind
    (``Range`` of a computed limit) has no ``nbytes`` there, but is stored all the same."""
    so = ort.SessionOptions()
    so.add_session_config_entry("ho_onnx.model_dir", str(opt.parent))
    so.register_custom_ops_library(runtime.library_path())
    s = ort.InferenceSession(str(opt), sess_options=so, providers=["CPUExecutionProvider"])
    before = _ops.counters()
    s.run(None, _feeds(0))
    after = _ops.counters()
    assert after["ops_cuda"] == before["ops_cuda"]
    return after["bytes_stored"] - before["bytes_stored"]


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """(original, optimized with weights and activations offloaded, stored bytes per run)."""
    src, opt, r = _optimized_decoder(tmp_path_factory.mktemp("dec"), 3, FORCE_ALL)
    assert r.choice.weights and r.choice.activations
    stored = _stored_by_the_cpu_engine(opt)
    assert stored >= sum(a.nbytes or 0 for a in r.choice.activations) > 0
    return src, opt, stored


@pytest.fixture(scope="module")
def decoder_weights(tmp_path_factory):
    """(original, optimized with every weight streamed and no activation offloaded, 0)."""
    src, opt, r = _optimized_decoder(tmp_path_factory.mktemp("dec_w"), 3,
                                     OffloadOptions(activations=False, min_bytes=0,
                                                    prefetch_distance=2))
    assert r.choice.weights and not r.choice.activations
    return src, opt, 0


@pytest.fixture(scope="module")
def decoder_disk(tmp_path_factory):
    src, opt, _ = _optimized_decoder(
        tmp_path_factory.mktemp("dec_disk"), 2,
        OffloadOptions(activations=False, min_bytes=0, weight_tier="disk"))
    return src, opt


def _cache_ops(path) -> dict[str, int]:
    """Cache ops of each kind in the optimized model."""
    import onnx

    from ho_onnx import contract

    m = onnx.load(str(path), load_external_data=False)
    n: dict[str, int] = {}
    for node in m.graph.node:
        if node.domain == contract.DOMAIN:
            n[node.op_type] = n.get(node.op_type, 0) + 1
    return n


class _OnCuda:
    """Counters around some runs: asserts every cache op ran on the CUDA EP but the host-only
    ones (``contract.CPU_ONLY``: the embedding's GatherRows here), which ran on the CPU EP, and
    the CUDA engine copied the bytes the plan moves. A run that failed (set
    ``failed``) stops early: then only "some cache ops ran, all on CUDA"."""

    def __init__(self, path, runs: int):
        from ho_onnx import contract

        ops = _cache_ops(path)
        # (Emit, GatherRows, HostMatMul have host memory out: registered for the CPU EP alone)
        self.host_ops = sum(n for k, n in ops.items() if k in contract.CPU_ONLY)
        self.ops = sum(ops.values()) - self.host_ops
        self.runs = runs
        self.failed = 0
        assert self.ops > 0

    def __enter__(self):
        self.before = _ops.counters()
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            return
        self.after = c = _ops.counters()
        self.delta = d = {k: c[k] - self.before[k] for k in c}
        if self.failed:
            assert d["ops_cpu"] <= self.runs * self.host_ops and d["ops_cuda"] > 0, d
            return
        assert d["ops_cuda"] == self.runs * self.ops, (d["ops_cuda"], self.runs, self.ops)
        assert d["ops_cpu"] == self.runs * self.host_ops, (d["ops_cpu"], self.host_ops)
        # Every byte loaded went host -> device through the CUDA engine; every byte stored
        # device -> host; every Wait copied its bytes out of staging on the compute stream.
        assert d["cuda_bytes_h2d"] == d["bytes_loaded"] > 0, d
        assert d["cuda_bytes_d2h"] == d["bytes_stored"], d
        assert d["cuda_bytes_d2d"] == d["cuda_bytes_h2d"], d


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.allclose(a, b, rtol=1e-3, atol=1e-4))


# ---- outputs -------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["priority", "default"])
def test_decoder_matches_original(decoder, order):
    src, opt, stored = decoder
    ref = _session(src, optimized=False, order=order)
    s = _session(opt, optimized=True, order=order, sample_arena=True)
    with _OnCuda(opt, runs=3) as oc:
        for seed in range(3):
            (a,) = ref.run(None, _feeds(seed))
            (b,) = s.run(None, _feeds(seed))
            np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-4)
    # The plan's stored activations, every run, device -> host.
    assert oc.delta["cuda_bytes_d2h"] == 3 * stored
    if tuple(int(p) for p in ort.__version__.split(".")[:2]) >= (1, 23):
        # ORT's CUDA arena, sampled at the last Wait (AllocatorGetStats): the Waits ran on
        # CUDA, so this is the device arena; it holds at least the largest offloaded weight
        # in flight and at most the card.
        c = oc.after
        _, total = _ops.cuda_mem_info(0)
        assert 0 < c["ort_arena_in_use"] <= c["ort_arena_max_in_use"]
        assert c["ort_arena_max_in_use"] <= c["ort_arena_total_allocated"] <= total


def test_decoder_bit_exact_on_cuda_at_basic_level(decoder):
    """Same kernels on both sides at ORT's basic level: the offloaded run is bit-exact."""
    src, opt, _ = decoder

    def sess(path, optimized):
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
        if optimized:
            so.add_session_config_entry("ho_onnx.model_dir", str(opt.parent))
            so.register_custom_ops_library(runtime.library_path())
        return ort.InferenceSession(str(path), sess_options=so, providers=PROVIDERS)

    a = sess(src, False).run(None, _feeds(5))[0]
    s = sess(opt, True)
    with _OnCuda(opt, runs=1):
        b = s.run(None, _feeds(5))[0]
    np.testing.assert_array_equal(b, a)


def test_host_bytes_entry_sizes_the_ring(decoder):
    src, opt, stored = decoder
    before = _ops.counters()["ring_segments"]
    s = _session(opt, optimized=True, host_bytes=stored)
    ref = _session(src, optimized=False)
    # Reserved at session creation: one segment for a whole run.
    assert _ops.counters()["ring_segments"] == before + 1
    with _OnCuda(opt, runs=5):
        for seed in range(5):
            np.testing.assert_allclose(s.run(None, _feeds(seed))[0],
                                       ref.run(None, _feeds(seed))[0], rtol=1e-3, atol=1e-4)
    assert _ops.counters()["ring_segments"] == before + 1  # sequential runs never grow it


def test_disk_tier_matches_original(decoder_disk):
    src, opt = decoder_disk
    ref = _session(src, optimized=False)
    s = _session(opt, optimized=True)
    with _OnCuda(opt, runs=3) as oc:
        for seed in range(3):
            np.testing.assert_allclose(s.run(None, _feeds(seed))[0],
                                       ref.run(None, _feeds(seed))[0], rtol=1e-3, atol=1e-4)
    # Every weight byte read from the file went to the device through the CUDA engine, but
    # the embedding rows the GatherRows read (host-only ops: their rows reach the device by
    # ORT's own copy). H200 stop 46: 5,228,544 read = 5,154,816 H2D + 73,728 gathered.
    assert oc.delta["bytes_gathered"] > 0
    assert oc.delta["bytes_read_disk"] - oc.delta["bytes_gathered"] == \
        oc.delta["cuda_bytes_h2d"] > 0


def test_disk_read_error_names_the_node(tmp_path):
    src = tmp_path / "dec.onnx"
    build_decoder(src, layers=1, hidden=64, heads=4, vocab=VOCAB, external_data=True)
    opt = tmp_path / "dec.disk.onnx"
    optimize(src, opt, OffloadOptions(activations=False, min_bytes=0, weight_tier="disk"), DIMS)
    s = _session(opt, optimized=True)
    # Each data file cut after the embedding tables (read by GatherRows on the CPU EP, first
    # in the run), so that the Prefetches' reads past the cut fail, in a Wait on CUDA.
    ends: dict[str, int] = {}
    for node in onnx.load(str(opt), load_external_data=False).graph.node:
        a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
        if node.op_type == "GatherRows":
            loc = a["location"].decode()
            ends[loc] = max(ends.get(loc, 0), a["offset"] + a["length"])
    reads = [(a["location"].decode(), a["offset"] + a["length"])
             for node in onnx.load(str(opt), load_external_data=False).graph.node
             if node.op_type == "Prefetch"
             for a in [{x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}]
             if a.get("tier") == b"disk"]
    assert any(end > ends.get(loc, 0) for loc, end in reads), (reads, ends)
    for p in tmp_path.iterdir():
        if p.name.endswith(".data"):
            os.truncate(p, ends.get(p.name, 0))
    before = _ops.counters()
    with pytest.raises(Exception, match=r"ho_onnx Wait \(node '[^']+'\): transfer failed"):
        s.run(None, _feeds(0))
    after = _ops.counters()
    # The Prefetches that issued the reads ran on the CUDA EP, the failing Wait too (on the
    # CPU EP: the GatherRows alone).
    assert after["ops_cuda"] > before["ops_cuda"]
    assert after["ops_cpu"] - before["ops_cpu"] <= 2


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_export_matches_original(tmp_path_factory, arch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from models.hf_export import export_hf

    d = tmp_path_factory.mktemp(arch)
    src = export_hf(arch, d / f"{arch}.onnx", layers=2, hidden=64, heads=4, vocab=VOCAB,
                    seq=16, external_data=True)
    opt = d / f"{arch}.ho.onnx"
    r = optimize(src, opt, FORCE_ALL, DIMS)
    assert r.choice.weights and r.choice.activations
    ref = _session(src, optimized=False)
    s = _session(opt, optimized=True)
    names = [i.name for i in ref.get_inputs()]
    oc = _OnCuda(opt, runs=3)
    oc.__enter__()
    for seed in range(3):
        feeds = {k: v for k, v in _feeds(seed).items() if k in names}
        for n in names:
            if n not in feeds:  # e.g. attention_mask
                feeds[n] = np.ones((DIMS["batch"], DIMS["seq"]), np.int64)
        for a, b in zip(ref.run(None, feeds), s.run(None, feeds), strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-4)
    oc.__exit__(None, None, None)  # every cache op ran on CUDA: no chain split to the CPU


def test_issued_chain_stays_on_cuda(tmp_path):
    """Prefetch's `issued` output ([0] device tensor) as the next Prefetch's ordering input
    (the FIFO chain): every op of the chain, the reload included, runs on the CUDA EP, the
    outputs are bit-exact, and the poisoned, slowed copies are still waited for."""
    import onnx
    from onnx import TensorProto, helper

    from ho_onnx import contract

    n, numel = 4, 1 << 16
    rng = np.random.default_rng(11)
    w = rng.random(n * numel).astype(np.float32)
    w.tofile(tmp_path / "w.bin")
    size = 4 * numel

    def node(op, ins, outs, **attrs):
        nd = helper.make_node(op, ins, outs, domain=contract.DOMAIN)
        nd.attribute.extend(helper.make_attribute(k, v) for k, v in sorted(attrs.items()))
        return nd

    nodes, outs, prev = [], [], None
    for i in range(n):
        nodes.append(node("Prefetch", ["s0"] + ([prev] if prev else []), [f"y{i}", f"i{i}"],
                          location="w.bin", offset=i * size, length=size, shape=[numel],
                          name=f"W{i}"))
        nodes.append(node("Wait", [f"y{i}"], [f"w{i}"]))
        outs.append(helper.make_tensor_value_info(f"w{i}", TensorProto.FLOAT, None))
        prev = f"i{i}"
    nodes += [node("Store", ["x"], ["t"]), node("Detach", ["x", "t"], ["t2"]),
              node("Prefetch", ["t2", prev], ["ry", "ri"]), node("Wait", ["ry"], ["rz"])]
    outs.append(helper.make_tensor_value_info("rz", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [numel])], outs,
        [helper.make_tensor("s0", TensorProto.FLOAT, [0], [])])
    m = helper.make_model(graph, ir_version=10, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid(contract.DOMAIN, 1)])
    path = tmp_path / "chain.onnx"
    onnx.save(m, str(path))
    s = _session(path, optimized=True)
    x = rng.random(numel).astype(np.float32)
    _testing.set_debug(poison=True, delay_us=5_000)
    with _OnCuda(path, runs=3) as oc:
        for _ in range(3):
            res = s.run(None, {"x": x})
            for i in range(n):
                assert res[i].tobytes() == w[i * numel:(i + 1) * numel].tobytes()
            assert res[n].tobytes() == x.tobytes()
    assert oc.delta["cuda_bytes_h2d"] == 3 * (n + 1) * size


# ---- stream ordering -------------------------------------------------------------------------

class _BusyDevice:
    """Keeps the GPU busy from a second thread: a torch matmul loop when torch has CUDA,
    else a second ORT session on the CUDA EP running the original model."""

    def __init__(self, src):
        self.stop = threading.Event()
        self.iters = 0
        try:
            import torch

            use_torch = torch.cuda.is_available()
        except ImportError:
            use_torch = False
        self.kind = "torch" if use_torch else "ort"
        self.thread = threading.Thread(target=self._torch if use_torch else self._ort,
                                       args=(src,), daemon=True)

    def _torch(self, _src):
        import torch

        a = torch.randn(4096, 4096, device="cuda")
        while not self.stop.is_set():
            for _ in range(8):
                a = torch.tanh(a @ a * 1e-3)
            torch.cuda.synchronize()
            self.iters += 1

    def _ort(self, src):
        s = _session(src, optimized=False)
        while not self.stop.is_set():
            s.run(None, _feeds(self.iters))
            self.iters += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=60)


def _mismatches(src, opt, runs: int, seed0: int = 0, broken: bool = False) -> int:
    """Runs of ``opt`` whose output differs from the original's. ``broken``: a deliberately
    broken variant, whose wrong bytes may also reach a shape (ORT then fails the run: that
    counts as a mismatch too)."""
    ref = _session(src, optimized=False)
    s = _session(opt, optimized=True)
    bad = 0
    with _OnCuda(opt, runs=runs) as oc:  # a broken variant that ran on the CPU proves nothing
        for i in range(runs):
            f = _feeds(seed0 + i)
            try:
                got = s.run(None, f)[0]
            except (Fail, InvalidArgument, RuntimeException):
                if not broken:
                    raise
                oc.failed += 1
                continue
            if not _close(got, ref.run(None, f)[0]):
                bad += 1
    del s
    gc.collect()
    time.sleep(0.2)  # copies of a deliberately broken run may still land
    return bad + oc.failed


@pytest.mark.slow
def test_stress_with_a_busy_device(decoder):
    src, opt, _ = decoder
    _testing.set_debug(poison=True)  # an unordered read sees 0xFF (NaN), not stale data
    with _BusyDevice(src):
        assert _mismatches(src, opt, runs=300) == 0


def _assert_hazard(decoder, skip: str, **debug: object) -> None:
    """With the hazard edge ``skip`` removed (and ``debug`` slowing one side) outputs are
    wrong; with it kept, under the same slowing, they are right."""
    src, opt, _ = decoder
    _testing.set_debug(**debug, **{skip: True})
    assert _mismatches(src, opt, runs=3, broken=True) >= 1
    _testing.set_debug(**debug)
    assert _mismatches(src, opt, runs=3) == 0


def test_without_the_wait_event_outputs_are_wrong(decoder):
    """HAZARD (c) alone: Wait's cudaStreamWaitEvent is what orders its staging -> z copy
    after the load. Slow loads, staging poisoned between uses: without the edge the copy
    reads 0xFF. (The copy itself still runs: only the edge is removed.)"""
    _assert_hazard(decoder, "skip_wait_event", poison=True, delay_us=20_000)


def test_without_the_staging_fence_outputs_are_wrong(decoder_weights):
    """HAZARD (a) alone: a load waits for the fence of its device staging buffer (the
    Wait's copy out of it on the compute stream) before overwriting it. A slow compute
    stream: without the fence, the next load of a same-size weight overwrites the staging
    buffer before the queued device-to-device copy of the previous Wait read it.
    Weights only: in a plan that also stores activations, the load channel (FIFO) is held
    behind loads of stored tensors, which wait for the compute stream, so no load can
    overtake a Wait's copy and even the broken variant is right (measured on an H100)."""
    _assert_hazard(decoder_weights, "skip_staging_fence", poison=True, compute_delay_us=5_000)


def test_without_the_detach_event_outputs_are_wrong(decoder):
    """HAZARD (b) alone: Detach keeps the stored tensor's block from ORT until the
    device-to-host copy read it. With slow store copies and no wait, later kernels
    overwrite it first."""
    _assert_hazard(decoder, "skip_detach_wait", delay_us=20_000)


def test_without_the_store_start_event_outputs_are_wrong(decoder):
    """HAZARD (d) alone: a Store's device-to-host copy waits for the compute stream (the
    kernels that write x). A slow compute stream: without the edge the copy reads x before
    it was written (last run's values, other inputs: wrong)."""
    _assert_hazard(decoder, "skip_store_start", compute_delay_us=5_000)


def test_concurrent_runs(decoder):
    src, opt, _ = decoder
    ref = _session(src, optimized=False)
    s = _session(opt, optimized=True)
    _testing.set_debug(poison=True)
    refs = {i: ref.run(None, _feeds(i))[0] for i in range(40)}
    errors: list[str] = []
    oc = _OnCuda(opt, runs=4 * 25)
    oc.__enter__()

    def worker(k: int) -> None:
        for j in range(25):
            i = (k * 7 + j) % 40
            out = s.run(None, _feeds(i))[0]
            if not _close(out, refs[i]):
                errors.append(f"thread {k} run {j} (input {i})")

    run_threads(worker, 4)
    assert not errors, errors[:5]
    oc.__exit__(None, None, None)


def test_failed_runs_hold_only_their_own_store(tmp_path):
    """Failed runs of growing lengths (a Reshape fails between every cache op and its
    completion; the scenario of test_native_safety.py's CPU test): each holds only its own
    store until the next run starts (run tracking, run_records.h), the good run after them
    is exact and leaves the pinned pool as it found it. Before run tracking a failed run's
    store stayed until a later Store got its token's address; this fails without it
    whenever ORT gives the failed runs' tokens different addresses."""
    path, w = write_moving_failure_model(tmp_path)
    so = ort.SessionOptions()
    so.log_severity_level = 4  # expected failures: keep the log quiet
    so.add_session_config_entry("ho_onnx.model_dir", str(tmp_path))
    so.register_custom_ops_library(runtime.library_path())
    s = ort.InferenceSession(str(path), sess_options=so, providers=PROVIDERS)
    c0 = _ops.counters()
    base = c0["host_pool_bytes_in_use"]
    for i in range(30):
        n = 1024 + 256 * i
        with pytest.raises(Exception, match=r"(?i)reshape"):
            s.run(None, {"x": np.ones(n, np.float32), "shp": np.array([5], np.int64)})
        assert _ops.counters()["host_pool_bytes_in_use"] - base == 4 * n, i
    x = np.linspace(-2, 2, 5000, dtype=np.float32)
    z, wz = s.run(None, {"x": x, "shp": np.array([4], np.int64)})
    np.testing.assert_array_equal(z, np.maximum(x, 0))
    np.testing.assert_array_equal(wz, w)
    c1 = _ops.counters()
    assert c1["host_pool_bytes_in_use"] == base
    # The cache ops ran on the CUDA engine: its copies, none of the CPU engine's ops.
    assert c1["ops_cpu"] == c0["ops_cpu"] and c1["ops_cuda"] > c0["ops_cuda"]
    assert c1["cuda_bytes_d2h"] - c0["cuda_bytes_d2h"] >= 4 * (1024 + 5000)


# ---- memory --------------------------------------------------------------------------------

def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_thousand_runs_stable_memory(decoder):
    src, opt, stored = decoder
    s = _session(opt, optimized=True, host_bytes=stored)
    ref = _session(src, optimized=False)
    want = ref.run(None, _feeds(0))[0]
    for _ in range(50):  # warm-up: ORT's arena, the event pool, the ring
        s.run(None, _feeds(0))
    gc.collect()
    free0, _ = _ops.cuda_mem_info(0)
    rss0 = _rss()
    c0 = _ops.counters()
    with _OnCuda(opt, runs=1000):
        for _ in range(1000):
            out = s.run(None, _feeds(0))[0]
    assert _close(out, want)
    gc.collect()
    free1, _ = _ops.cuda_mem_info(0)
    rss1 = _rss()
    c1 = _ops.counters()
    assert abs(free1 - free0) <= 32 << 20, (free0, free1)
    assert rss1 - rss0 <= 64 << 20, (rss0, rss1)
    # Nothing created or pinned per run.
    assert c1["cuda_events_created"] == c0["cuda_events_created"]
    assert c1["pinned_allocs"] == c0["pinned_allocs"]
    assert c1["pinned_bytes"] == c0["pinned_bytes"]
    assert c1["ring_segments"] == c0["ring_segments"]


def test_pinned_weights_within_1_1x(decoder):
    _src, opt, _ = decoder
    gc.collect()
    p0 = _ops.counters()["pinned_bytes"]
    h0 = _ops.counters()["host_store_bytes"]
    c0_allocs = _ops.counters()["pinned_allocs"]
    s = _session(opt, optimized=True)
    c = _ops.counters()
    weights = c["host_store_bytes"] - h0
    assert weights > 0
    with _OnCuda(opt, runs=1) as oc:  # the pinned weights are what the CUDA engine loads
        s.run(None, _feeds(0))
    assert oc.delta["cuda_bytes_h2d"] >= weights
    # Small test weights: beyond the 1.07x of the packing, one partly filled 4 MiB chunk and
    # the data file's partly filled slab of medium weights (host_logic.h: WeightPacker; its
    # first slab is 4 MiB, the second 8 MiB). H200 stop 46: 8,716,288 pinned for 3,166,720.
    assert c["pinned_bytes"] - p0 <= 1.07 * weights + (4 << 20) + (8 << 20)
    # A chunk, a slab or two, a large weight's block, the ring: not a block per weight.
    assert c["pinned_allocs"] - c0_allocs <= 6 < _cache_ops(opt)["Prefetch"]
    del s


def test_pinned_weights_of_a_dropped_version_are_unpinned(decoder, decoder_weights):
    """Issue 34 item 2 on the CUDA engine: a version's pinned weights go with its last
    session (after the copy streams are drained), while another session keeps the engine;
    before, every version stayed pinned for the engine's life."""
    _src, opt, _ = decoder
    _src2, opt2, _ = decoder_weights
    keeper = _session(opt, optimized=True)
    keeper.run(None, _feeds(0))
    gc.collect()
    c0 = _ops.counters()
    for _ in range(3):
        s = _session(opt2, optimized=True)
        with _OnCuda(opt2, runs=1):
            s.run(None, _feeds(1))
        assert _ops.counters()["host_store_bytes"] > c0["host_store_bytes"]
        del s
        gc.collect()
        c = _ops.counters()
        assert c["host_store_bytes"] == c0["host_store_bytes"]
        assert c["pinned_bytes"] <= c0["pinned_bytes"] + (4 << 20)  # (a current chunk)
    keeper.run(None, _feeds(2))  # the keeper's own weights are untouched
    del keeper


def test_range_planned_model_is_guarded_on_cuda(tmp_path):
    """Issue 36: the Guard of a range-planned model runs on the CUDA EP (reading only its
    input's shape: the data is device memory), every cache op with it; inside the range
    the outputs match the original at both ends, outside the run is refused."""
    src = tmp_path / "dec.onnx"
    build_decoder(src, layers=2, hidden=128, heads=4, vocab=VOCAB, external_data=True,
                  max_positions=64)
    opt = tmp_path / "dec.ho.onnx"
    optimize(src, opt, FORCE_ALL, {"batch": 2}, dim_ranges={"seq": (1, 32)})
    assert _cache_ops(opt).get("Guard") == 1
    ref, s = _session(src, optimized=False), _session(opt, optimized=True)
    rng = np.random.default_rng(0)
    for seq in (1, 32):
        ids = rng.integers(0, VOCAB, (2, seq), dtype=np.int64)
        with _OnCuda(opt, runs=1):
            (b,) = s.run(None, {"input_ids": ids})
        np.testing.assert_allclose(b, ref.run(None, {"input_ids": ids})[0], rtol=1e-3,
                                   atol=1e-4)
    with pytest.raises(InvalidArgument, match=r"dim 'seq' is 33, outside the range 1\.\.32"):
        s.run(None, {"input_ids": np.zeros((2, 33), np.int64)})


# ---- calibration and timing --------------------------------------------------------------------

def test_calibrate():
    r = _ops.cuda_calibrate(64 << 20)
    assert r["h2d_bw"] > 1e9 and r["d2h_bw"] > 1e9, r
    assert r["device_name"]


def test_transfer_times_match_bytes_loaded(decoder):
    _src, opt, _ = decoder
    s = _session(opt, optimized=True)
    s.run(None, _feeds(0))
    _ops.cuda_transfer_times(reset=True)
    _ops.set_trace(cuda_timing=True)
    c0 = _ops.counters()
    b0, h2d0, d2h0 = c0["bytes_loaded"], c0["cuda_bytes_h2d"], c0["cuda_bytes_d2h"]
    s.run(None, _feeds(1))
    _ops.set_trace()
    t = _ops.cuda_transfer_times(reset=True)
    c = _ops.counters()
    assert t["h2d_bytes"] == c["bytes_loaded"] - b0 == c["cuda_bytes_h2d"] - h2d0
    assert t["d2h_bytes"] == c["cuda_bytes_d2h"] - d2h0 > 0
    assert t["h2d_s"] > 0



def test_kv_cache_in_host_memory_generates_the_same_tokens_on_cuda(tmp_path):
    """Issue 36 item 2 on the CUDA EP: each past KV reaches the device through PrefetchInput
    (its input in host memory: ORT hands over the caller's buffer, the CUDA engine copies
    it), each present leaves through Emit (the one op on the CPU EP, by design); greedy
    tokens equal the unmodified model's on the same provider."""
    from ho_onnx import contract
    from ho_onnx.target.ort.generate import greedy, kv_layout

    src = tmp_path / "dec.onnx"
    build_decoder(src, layers=2, hidden=128, heads=4, vocab=VOCAB, external_data=True,
                  max_positions=256, kv_cache=True, std=0.2)
    opt = tmp_path / "dec.ho.onnx"
    optimize(src, opt, OffloadOptions(kv=True, min_bytes=0, min_gap=1, prefetch_distance=2),
             {"batch": 1}, dim_ranges={"seq": (1, 16), "past": (0, 64)})
    ops = _cache_ops(opt)
    assert ops[contract.PREFETCH_INPUT] == 4 and ops[contract.EMIT] == 4
    ref = ort.InferenceSession(str(src), providers=PROVIDERS)
    assert ref.get_providers()[0] == CUDA_EP
    want = greedy(ref, kv_layout(src), [3, 1, 4, 1, 5], 40)
    assert len(set(want)) > 3, want
    s = runtime.InferenceSession(opt, providers=PROVIDERS)
    c0 = _ops.counters()
    got = greedy(s, kv_layout(opt), [3, 1, 4, 1, 5], 40)
    c = _ops.counters()
    assert got == want
    host = sum(n for k, n in ops.items() if k in contract.CPU_ONLY)  # Emits, GatherRows
    per_run = sum(ops.values()) - host
    assert c["ops_cpu"] - c0["ops_cpu"] == 40 * host  # the host-only ops alone
    assert c["ops_cuda"] - c0["ops_cuda"] == 40 * per_run
    # every decode step copied its pasts in: K and V of 2 layers, 4 heads x 32, pasts 5..43
    past_bytes = sum(2 * 2 * 128 * 4 * p for p in range(5, 44))
    assert c["cuda_bytes_h2d"] - c0["cuda_bytes_h2d"] >= past_bytes


def test_generation_loop_cache_buffers_on_cuda(tmp_path):
    """The generation loop's own cache (generate.KvBuffers) on a CUDA machine: host buffers
    pinned by the library (counted in pinned_bytes), a cache on the device, a chunked prefill
    with the device arena shrunk between chunks: the same greedy tokens as the CPU EP's."""
    from ho_onnx.target.ort.generate import KvBuffers, greedy, kv_layout

    src = tmp_path / "dec.onnx"
    build_decoder(src, layers=2, hidden=128, heads=4, vocab=VOCAB, external_data=True,
                  max_positions=256, kv_cache=True, std=0.2)
    layout = kv_layout(src)
    p0 = _ops.counters()["pinned_bytes"]
    host = KvBuffers(layout, 64)
    assert host.pinned and _ops.counters()["pinned_bytes"] > p0
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    s = ort.InferenceSession(str(src), providers=runtime.with_cuda_arena(PROVIDERS))
    assert s.get_providers()[0] == CUDA_EP
    want = greedy(s, layout, prompt, 30, chunk=4)  # (the CPU tests check it against run())
    assert len(set(want)) > 3, want
    for device in ("cpu", "cuda"):
        assert greedy(s, layout, prompt, 30, chunk=4, device=device,
                      shrink_arenas="gpu:0") == want, device


@pytest.mark.parametrize("y_is_output", [False, True])
def test_fence_on_cuda(tmp_path, y_is_output):
    """The Fence on the CUDA EP (a recomputed activation's: schedule/recompute.py): aliased
    to its input for an intermediate, a device copy on the compute stream where ORT gives the
    output its own buffer (a graph output); the kernel ran on CUDA, not the CPU EP."""
    import onnx.parser

    outs = "float[4096] out, float[4096] y" if y_is_output else "float[4096] out"
    m = onnx.parser.parse_model(f"""
    <ir_version: 10, opset_import: ["" : 21, "ai.hyperoffload" : 1]>
    g (float[4096] x) => ({outs}) {{
      a = Neg(x)
      b = Neg(a)
      y = ai.hyperoffload.Fence(a, b)
      out = Add(y, b)
    }}
    """)
    path = tmp_path / "fence.onnx"
    onnx.save(m, str(path))
    sess = _session(path, optimized=True)
    assert sess.get_providers()[0] == CUDA_EP
    x = np.random.default_rng(3).standard_normal(4096).astype(np.float32)
    before = _ops.counters()
    res = sess.run(None, {"x": x})
    after = _ops.counters()
    np.testing.assert_array_equal(res[0], -x + x)
    if y_is_output:
        np.testing.assert_array_equal(res[1], -x)
    assert after["ops_cuda"] - before["ops_cuda"] == 1
    assert after["ops_cpu"] == before["ops_cpu"]
    assert (after["alias_copies"] > before["alias_copies"]) == y_is_output


def test_loop_body_planned_per_iteration_on_cuda(tmp_path):
    """A Loop body planned per iteration (issue 38 item 4; its cache ops marked
    ``iteration`` = 1) on the CUDA EP: each iteration reloads the body's offloaded weights
    host -> device and its records live for that iteration (the CUDA engine's RunRecords);
    with poisoned Prefetch outputs and slow copies (a missing wait would show), outputs match
    the unmodified model on CUDA at several trip counts, and every cache op ran on CUDA."""
    from graphs import LOOP_LAYERS, LOOP_N, text_model

    n = LOOP_N
    src = tmp_path / "layers.onnx"
    onnx.save(text_model(LOOP_LAYERS, **{f"W{k}": (n, n) for k in range(6)}), str(src))
    opt = tmp_path / "o" / "layers.ho.onnx"
    optimize(src, opt, OffloadOptions(budget=8 * n * n * 4, min_bytes=0, activations=False))
    m = onnx.load(str(opt), load_external_data=False)
    loop = next(x for x in m.graph.node if x.op_type == "Loop")
    body = [x for x in loop.attribute[0].g.node if x.domain == "ai.hyperoffload"]
    main = [x for x in m.graph.node if x.domain == "ai.hyperoffload"]
    loads = sum(x.op_type == "Prefetch" for x in body)
    assert loads and all(any(a.name == "iteration" and a.i == 1 for a in x.attribute)
                         for x in body)
    ref = _session(src, optimized=False)
    s = _session(opt, optimized=True)
    x = np.random.default_rng(5).standard_normal((n, n)).astype(np.float32)
    _testing.set_debug(poison=True, delay_us=200)
    for trips in (0, 1, 4):
        feeds = {"x": x, "n": np.array(trips, np.int64)}
        before = _ops.counters()
        got = s.run(None, feeds)[0]
        after = _ops.counters()
        np.testing.assert_allclose(got, ref.run(None, feeds)[0], rtol=1e-3, atol=1e-4)
        assert after["ops_cpu"] == before["ops_cpu"]
        assert after["ops_cuda"] - before["ops_cuda"] == len(main) + len(body) * trips
        assert after["cuda_bytes_h2d"] - before["cuda_bytes_h2d"] >= loads * trips * n * n * 4
