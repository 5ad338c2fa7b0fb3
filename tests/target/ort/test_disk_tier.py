"""The disk tier: weights read from their external-data file at every Prefetch (CPU EP).

Evidence that the tier really streams from the file: the counters (bytes_read_disk equals
the disk-tier weight bytes per run, nothing enters the host store), a data file rewritten
after session creation changes the disk tier's output but not the host tier's, and a file
truncated after session creation gives a runtime error from the Wait naming the weight.
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import pytest
from native_util import testing_ops
from onnx import TensorProto, helper
from threads import run_threads

from ho_onnx import contract, kinds
from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.target.ort import runtime
from ho_onnx.target.ort.verify import make_session, random_inputs, verify
from models.decoder import build_decoder

D = contract.DOMAIN
ORDERS = ["priority", "default"]
DIMS = {"batch": 2, "seq": 5}


pytestmark = pytest.mark.usefixtures("no_debug_hooks")


def _c() -> dict[str, int]:
    return runtime.counters()


# --------------------------------------------------------------------------------------------
# Hand-written graphs: out = Wait(Prefetch<tier="disk">) + x


def _node(op: str, inputs: list[str], outputs: list[str], **attrs) -> onnx.NodeProto:
    node = helper.make_node(op, inputs, outputs, domain=D)
    node.attribute.extend(helper.make_attribute(k, v) for k, v in sorted(attrs.items()))
    return node


def _model(directory: Path, *, n: int, location: str = "w.bin", offset: int = 0,
           length: int | None = None, tier: str | None = "disk", name: str = "layer.weight",
           copies: int = 1, file_name: str = "model.onnx", expert_cache: int | None = None
           ) -> str:
    """`copies` Prefetch/Wait pairs of the same weight, summed with x."""
    attrs: dict[str, object] = dict(location=location, offset=offset,
                                    length=4 * n if length is None else length, shape=[n],
                                    name=name)
    if tier is not None:
        attrs["tier"] = tier
    if expert_cache is not None:
        attrs[contract.ATTR_EXPERT_CACHE] = expert_cache
    nodes, acc = [], "x"
    for i in range(copies):
        nodes += [_node("Prefetch", ["s0"], [f"wy{i}"], **attrs),
                  _node("Wait", [f"wy{i}"], [f"w{i}"]),
                  helper.make_node("Add", [acc, f"w{i}"], [f"a{i}"])]
        acc = f"a{i}"
    nodes.append(helper.make_node("Identity", [acc], ["out"]))
    return _save(directory / file_name, nodes, n)


def _save(path: Path, nodes: list[onnx.NodeProto], n: int,
          extra_inputs: tuple[onnx.ValueInfoProto, ...] = ()) -> str:
    """A model of ``nodes`` reading x [n] (and ``extra_inputs``) and the empty source s0,
    writing out [n], saved at ``path``."""
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n]), *extra_inputs],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [n])],
        [helper.make_tensor("s0", TensorProto.FLOAT, [0], [])])
    model = helper.make_model(graph, ir_version=10, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid(D, 1)])
    onnx.save(model, str(path))
    return str(path)


def _data(directory: Path, n: int, offset: int, seed: int = 0, tail: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    with open(directory / "w.bin", "wb") as f:
        f.write(b"\x7f" * offset)
        w.tofile(f)
        f.write(b"\x7f" * tail)
    return w


@pytest.mark.parametrize(("n", "offset", "tail"), [
    (16, 0, 0),          # tiny, at the start, file ends unaligned
    (1000, 100, 7),      # unaligned offset and length
    (4096, 4096, 0),     # block-aligned offset and length, ends at EOF
    (70_000, 4093, 3),   # several blocks, unaligned both sides
])
@pytest.mark.parametrize("order", ORDERS)
def test_disk_weight_exact_and_counted(tmp_path, n, offset, tail, order):
    w = _data(tmp_path, n, offset, tail=tail)
    gc.collect()
    store0 = _c()["host_store_bytes"]
    runtime.reset_counters()
    sess = runtime.InferenceSession(_model(tmp_path, n=n, offset=offset, copies=2),
                                    execution_order=order)
    c = _c()
    assert c["host_store_bytes"] == store0  # validated only: nothing loaded at creation
    assert c["bytes_read_disk"] == 0
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    for run in range(1, 4):
        (out,) = sess.run(None, {"x": x})
        np.testing.assert_array_equal(out, (x + w) + w)
        c = _c()
        assert c["bytes_read_disk"] == run * 2 * 4 * n  # every Prefetch reads the file
        assert c["bytes_loaded"] == run * 2 * 4 * n
        assert c["host_store_bytes"] == store0
    assert c["disk_read_ns"] > 0
    assert c["disk_direct_reads"] + c["disk_buffered_reads"] >= 6
    # Staging holds a read only while it is in flight: nothing between runs (was: kept idle,
    # up to a run's worth), at most the two reads the schedule overlaps during one. (Its
    # last reference may be the I/O thread's job, dropped a moment after the Wait.)
    deadline = time.monotonic() + 5
    while _c()["disk_staging_bytes"] and time.monotonic() < deadline:
        time.sleep(0.001)
    c = _c()
    assert c["disk_staging_bytes"] == 0
    assert 4 * n <= c["disk_staging_peak"] <= 2 * 4 * n + 2 * 4096


def test_disk_tier_reads_the_file_every_run_host_tier_does_not(tmp_path):
    n = 256
    w = _data(tmp_path, n, 64)
    disk = runtime.InferenceSession(_model(tmp_path, n=n, offset=64))
    host = runtime.InferenceSession(_model(tmp_path, n=n, offset=64, tier=None,
                                           file_name="host.onnx"))
    x = np.zeros(n, np.float32)
    np.testing.assert_array_equal(disk.run(None, {"x": x})[0], w)
    np.testing.assert_array_equal(host.run(None, {"x": x})[0], w)
    w2 = _data(tmp_path, n, 64, seed=5)  # rewritten in place, same size
    np.testing.assert_array_equal(disk.run(None, {"x": x})[0], w2)
    np.testing.assert_array_equal(host.run(None, {"x": x})[0], w)  # read at creation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(location="../../etc/passwd"), "escapes the model directory"),
        (dict(location="sub/../../model/w.bin"), "escapes the model directory"),
        (dict(location="/etc/passwd"), "must be relative"),
        (dict(location="link.bin"), "symbolic links"),
        (dict(offset=64), "past the end"),
        (dict(offset=1 << 40), "past the end"),
        (dict(offset=-1), "negative offset"),
        (dict(length=60), "does not match shape"),
        (dict(location="missing.bin"), "does not exist"),
        (dict(location="sub"), "not a regular file"),
        (dict(tier="flash"), "unknown tier 'flash'"),
    ],
)
def test_hostile_or_bad_disk_weights_refused_at_creation(hostile_model_dir, kwargs, message):
    model_dir = hostile_model_dir
    runtime.reset_counters()
    with pytest.raises(Exception, match=message) as info:
        runtime.InferenceSession(_model(model_dir, n=16, **kwargs))
    assert "layer.weight" in str(info.value)
    assert _c()["bytes_read_disk"] == 0
    # the process is fine and a good model still loads and runs afterwards
    sess = runtime.InferenceSession(_model(model_dir, n=16, file_name="good.onnx"))
    assert sess.run(None, {"x": np.zeros(16, np.float32)})[0].shape == (16,)


@pytest.mark.parametrize("order", ORDERS)
def test_the_expert_cache_reads_a_weight_once_then_serves_it(tmp_path, order):
    """Attribute expert_cache: the first Prefetch misses and reads the file, every later one
    (the second reader, later runs) is a hit served from the cache's copy; exact."""
    n = 1000
    w = _data(tmp_path, n, 100, tail=7)
    runtime.reset_counters()
    sess = runtime.InferenceSession(_model(tmp_path, n=n, offset=100, copies=2,
                                           expert_cache=8 * n), execution_order=order)
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    for run in range(1, 4):
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], (x + w) + w)
        c = _c()
        assert c["bytes_read_disk"] == 4 * n  # once, in the first run
        assert (c["expert_cache_misses"], c["expert_cache_hits"]) == (1, 2 * run - 1)
        assert c["bytes_expert_cache_hit"] == (2 * run - 1) * 4 * n
        assert c["bytes_loaded"] == run * 2 * 4 * n  # (every reload still lands in ORT's)
    assert _c()["expert_cache_bytes"] >= 4 * n
    del sess
    gc.collect()
    assert _c()["expert_cache_bytes"] == 0  # (the cache went with its last kernel)


def test_an_expert_cache_smaller_than_the_weight_keeps_nothing(tmp_path):
    n = 256
    w = _data(tmp_path, n, 0)
    runtime.reset_counters()
    sess = runtime.InferenceSession(_model(tmp_path, n=n, copies=2, expert_cache=4 * n - 1))
    host = runtime.InferenceSession(_model(tmp_path, n=n, tier=None, expert_cache=4 * n,
                                           file_name="host.onnx"))
    x = np.zeros(n, np.float32)
    for run in range(1, 3):
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], w + w)
        np.testing.assert_array_equal(host.run(None, {"x": x})[0], w)
        c = _c()
        assert c["bytes_read_disk"] == run * 2 * 4 * n
        assert (c["expert_cache_misses"], c["expert_cache_hits"]) == (2 * run, 0)


def test_an_expert_cache_shared_by_threads_evicts_under_readers_exactly(tmp_path):
    """Four models reading four weights of one data file share its expert cache (room for
    two): four threads run them at once, so entries are evicted while other runs copy out of
    them (held by shared_ptr); every output stays exact."""
    import threading

    n, k = 4096, 4
    w = _data(tmp_path, n * k, 0)
    sessions = [runtime.InferenceSession(_model(tmp_path, n=n, offset=4 * n * i, copies=2,
                                                expert_cache=8 * n, name=f"e{i}",
                                                file_name=f"m{i}.onnx")) for i in range(k)]
    x = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    errors: list[BaseException] = []
    # Every thread runs once per round: four weights through a cache with room for two miss
    # again in every round (without the rounds a fast machine can run the threads one after
    # the other: each weight would miss once, nothing would be evicted under a reader).
    rounds = threading.Barrier(k)

    def work(i: int) -> None:
        try:
            want = (x + w[i * n:(i + 1) * n]) + w[i * n:(i + 1) * n]
            for _ in range(60):
                rounds.wait(timeout=60)
                np.testing.assert_array_equal(sessions[i].run(None, {"x": x})[0], want)
        except BaseException as e:  # (reported by the main thread)
            rounds.abort()  # (the others stop waiting for this one)
            errors.append(e)

    runtime.reset_counters()
    held0 = _c()["expert_cache_bytes"]  # (a gauge: any other live cache's bytes)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    c = _c()
    assert c["expert_cache_hits"] > 0 and c["expert_cache_misses"] > 2 * k
    assert 0 < c["expert_cache_bytes"] - held0 <= 8 * n


def test_a_negative_expert_cache_is_refused_at_creation(tmp_path):
    _data(tmp_path, 16, 0)
    with pytest.raises(Exception, match="negative expert_cache -1") as info:
        runtime.InferenceSession(_model(tmp_path, n=16, expert_cache=-1))
    assert "layer.weight" in str(info.value)


def test_the_librarys_tier_registry_is_the_python_one(tmp_path):
    """csrc/tiers.cc has an entry of the same name for every tier of ho_onnx/kinds.py, and
    moves it as ``in_host_memory`` says (read into the host store at session creation, or
    read from its source at every run); an unknown name is refused naming exactly those."""
    n = 1024
    w = _data(tmp_path, n, 0)
    x = np.zeros(n, np.float32)
    for t in kinds.tiers():
        store0 = _c()["host_store_bytes"]
        sess = runtime.InferenceSession(_model(tmp_path, n=n, tier=t.name,
                                               file_name=f"{t.name}.onnx"))
        held = _c()["host_store_bytes"] - store0
        runtime.reset_counters()
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], w)
        read = _c()["bytes_read_disk"]
        assert (held, read) == ((4 * n, 0) if t.in_host_memory else (0, 4 * n)), t.name
        del sess
    with pytest.raises(Exception, match="unknown tier 'flash'") as info:
        runtime.InferenceSession(_model(tmp_path, n=n, tier="flash", file_name="flash.onnx"))
    listed = re.search(r"unknown tier 'flash' \(([^)]*)\)", str(info.value))
    assert listed is not None, str(info.value)
    assert re.split(r", | or ", listed.group(1)) == list(kinds.tier_names())


def test_truncated_before_creation_is_refused(tmp_path):
    n = 1000
    _data(tmp_path, n, 100)
    os.truncate(tmp_path / "w.bin", 100 + 4 * n - 1)
    with pytest.raises(Exception, match="past the end") as info:
        runtime.InferenceSession(_model(tmp_path, n=n, offset=100))
    assert "layer.weight" in str(info.value)


@pytest.mark.parametrize("cut", [0, 4096, 100 + 4 * 5000 - 1])
def test_truncated_after_creation_is_a_runtime_error(tmp_path, cut):
    n = 5000
    w = _data(tmp_path, n, 100)
    sess = runtime.InferenceSession(_model(tmp_path, n=n, offset=100, copies=2))
    x = np.zeros(n, np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], 2 * w)
    os.truncate(tmp_path / "w.bin", cut)
    for _ in range(2):  # the error repeats; nothing stale, no crash
        with pytest.raises(Exception, match="unexpected end of file") as info:
            sess.run(None, {"x": x})
        msg = str(info.value)
        assert "Wait" in msg and "layer.weight" in msg and "w.bin" in msg
        assert f"now {cut} bytes" in msg
    # the file comes back: the same session reads it again
    w2 = _data(tmp_path, n, 100, seed=3)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], 2 * w2)


# --------------------------------------------------------------------------------------------
# Wait semantics on the disk channel (the hooks make a missing wait visible)


def test_waits_matter_on_the_disk_channel(tmp_path):
    n = 3000
    w = _data(tmp_path, n, 4)
    sess = runtime.InferenceSession(_model(tmp_path, n=n, offset=4, copies=3))
    x = np.ones(n, np.float32)
    testing_ops().set_debug(delay_us=20_000, poison=True)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], ((x + w) + w) + w)
    testing_ops().set_debug(delay_us=20_000, poison=True, skip_wait=True)
    assert np.isnan(sess.run(None, {"x": x})[0]).all()  # the transfer never landed
    testing_ops().set_debug()
    time.sleep(0.1)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], ((x + w) + w) + w)


def test_concurrent_runs_on_one_session(tmp_path):
    n = 20_000
    w = _data(tmp_path, n, 12)
    sess = runtime.InferenceSession(_model(tmp_path, n=n, offset=12, copies=3))
    errors: list[BaseException] = []
    runtime.reset_counters()

    def worker(k: int) -> None:
        try:
            x = np.full(n, float(k), np.float32)
            for _ in range(15):
                np.testing.assert_array_equal(sess.run(None, {"x": x})[0], ((x + w) + w) + w)
        except BaseException as e:
            errors.append(e)

    run_threads(worker, 3)
    assert not errors, errors[0]
    assert _c()["bytes_read_disk"] == 3 * 15 * 3 * 4 * n


def test_unwaited_disk_reads_are_dropped_with_the_engine(tmp_path, young_heap):
    n = 64
    _data(tmp_path, n, 0)
    k = 10
    attrs = dict(location="w.bin", offset=0, length=4 * n, shape=[n], name="W", tier="disk")
    nodes = []
    for i in range(k):
        nodes += [_node("Prefetch", ["s0"], [f"wy{i}"], **attrs),
                  helper.make_node("ReduceSum", [f"wy{i}"], [f"r{i}"])]
    nodes.append(helper.make_node("Sum", [f"r{i}" for i in range(k)], ["out"]))
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info(
        "out", TensorProto.FLOAT, [])], [helper.make_tensor("s0", TensorProto.FLOAT, [0], [])])
    model = helper.make_model(graph, ir_version=10, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid(D, 1)])
    onnx.save(model, str(tmp_path / "m.onnx"))
    sess = runtime.InferenceSession(str(tmp_path / "m.onnx"))
    gc.collect()
    alive = _c()["engines_alive"]
    testing_ops().set_debug(delay_us=50_000, poison=True)
    (out,) = sess.run(None, {})
    assert np.isnan(out)
    t0 = time.perf_counter()
    del sess
    gc.collect()
    assert time.perf_counter() - t0 < 0.4  # queued reads were dropped, not run
    assert _c()["engines_alive"] == alive - 1


# --------------------------------------------------------------------------------------------
# The rewriter's disk tier on the decoder: bit-exact against the unmodified model


def _decoder(tmp: Path, **kw) -> Path:
    path = tmp / "dec.onnx"
    build_decoder(path, external_data=True, **kw)
    return path


@pytest.mark.parametrize("order", ORDERS)
def test_decoder_all_weights_on_disk_bit_exact(tmp_path, order):
    src = _decoder(tmp_path, layers=2, hidden=64, heads=4)
    out = tmp_path / "dec.ho.onnx"
    r = optimize(src, out, OffloadOptions(activations=False, min_bytes=0, prefetch_distance=2,
                                          weight_tier="disk"), DIMS)
    n_init = len(onnx.load(str(src), load_external_data=False).graph.initializer)
    assert len(r.choice.weights) == n_init and all(w.tier == "disk" for w in r.choice.weights)
    pf = [nd for nd in onnx.load(str(out), load_external_data=False).graph.node
          if nd.op_type == "Prefetch"]
    assert pf and all(helper.get_attribute_value(
        next(a for a in nd.attribute if a.name == "tier")) == b"disk" for nd in pf)
    per_run = sum(w.nbytes * len(w.consumers) for w in r.choice.weights)

    # in this process: the library under test (HO_ONNX_TEST_OPS: the sanitizer build) runs it
    rep = verify(src, out, dims=DIMS, runs=2, execution_order=order, opt_level="disable",
                 isolate=False)
    assert rep.exact, rep.outputs

    gc.collect()
    store0 = _c()["host_store_bytes"]
    sess = make_session(out, optimized=True, providers=["CPUExecutionProvider"],
                        execution_order=order, opt_level="disable")
    assert _c()["host_store_bytes"] == store0
    base = make_session(src, optimized=False, providers=["CPUExecutionProvider"],
                        execution_order=order, opt_level="disable")
    feeds = random_inputs(onnx.load(str(src), load_external_data=False), DIMS, seed=4)
    runtime.reset_counters()
    for run in range(1, 3):
        got = sess.run(None, feeds)
        for a, b in zip(got, base.run(None, feeds), strict=True):
            np.testing.assert_array_equal(a, b)
        # (and the embedding's rows, read from the file by its GatherRows)
        assert _c()["bytes_read_disk"] == run * per_run + _c()["bytes_gathered"]
    assert _c()["bytes_gathered"] > 0
    assert _c()["host_store_bytes"] == store0


# --------------------------------------------------------------------------------------------
# Other I/O configurations need a fresh process (read once from the environment)

_CHILD = r"""
import sys, numpy as np
sys.path[:0] = sys.argv[1].split(':')  # (this folder, and tests/ for threads)
from pathlib import Path
import test_disk_tier as t
from ho_onnx.target.ort import runtime
d = Path(sys.argv[2])
n, off = 300_000, 4093
w = t._data(d, n, off, tail=5)
runtime.reset_counters()
sess = runtime.InferenceSession(t._model(d, n=n, offset=off, copies=2))
x = np.ones(n, np.float32)
for _ in range(2):
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], (x + w) + w)
c = runtime.counters()
assert c["bytes_read_disk"] == 2 * 2 * 4 * n, c
print(c["disk_direct_reads"], c["disk_buffered_reads"])
"""


@pytest.mark.parametrize(("env", "direct"), [
    ({"HO_ONNX_DISK_CHUNK_KB": "64", "HO_ONNX_IO_THREADS": "3"}, True),  # ~19 chunks/transfer
    ({"HO_ONNX_DISK_DIRECT": "0", "HO_ONNX_IO_THREADS": "1"}, False),    # page-cache fallback
])
def test_chunked_and_buffered_configurations(tmp_path, env, direct):
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, f"{Path(__file__).parent}:{Path(__file__).parents[2]}",
         str(tmp_path)],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    n_direct, n_buffered = map(int, proc.stdout.split())
    if direct:
        assert n_direct >= 4 * 19 and n_buffered == 0
    else:
        assert n_direct == 0 and n_buffered >= 4


_SPLIT_CHILD = r"""
import sys, numpy as np
sys.path[:0] = sys.argv[1].split(':')
from pathlib import Path
import test_disk_tier as t
from ho_onnx.target.ort import runtime
d = Path(sys.argv[2])
n = 1 << 20  # one 4 MiB weight, block-aligned: each chunk is one buffered pread
w = t._data(d, n, 0)
sess = runtime.InferenceSession(t._model(d, n=n))
x = np.ones(n, np.float32)
runtime.reset_counters()
np.testing.assert_array_equal(sess.run(None, {"x": x})[0], x + w)
c = runtime.counters()
assert c["bytes_read_disk"] == 4 * n, c
print(c["disk_buffered_reads"])
"""


@pytest.mark.parametrize(("threads", "chunks"), [(1, 1), (2, 2), (4, 4), (8, 4)])
def test_a_lone_read_is_split_over_the_io_threads(tmp_path, threads, chunks):
    """A read that waits alone (a decode step's cache miss) keeps every I/O thread busy: its
    chunk is its share of the threads (never below 1 MiB), not one 8 MiB job on one thread."""
    env = {**os.environ, "HO_ONNX_DISK_DIRECT": "0", "HO_ONNX_IO_THREADS": str(threads)}
    env.pop("HO_ONNX_DISK_CHUNK_KB", None)
    proc = subprocess.run(
        [sys.executable, "-c", _SPLIT_CHILD,
         f"{Path(__file__).parent}:{Path(__file__).parents[2]}", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.split()[-1]) == chunks


# --------------------------------------------------------------------------------------------
# Speculation: a warm Prefetch starts a weight's read into the expert cache (issue 37 item 3)


def _warm_model(directory: Path, *, n: int, expert: int = 3, cache: int | None = None,
                file_name: str = "warm.onnx", idx_type: int = TensorProto.INT64,
                offset: int = 0, name: str = "expert.weight", **warm_attrs) -> str:
    """out = x + w, where w's routed Prefetch is ordered after a warm Prefetch of w gated by
    the int64 input `idx` (the predicted experts); both through the expert cache."""
    base: dict[str, object] = dict(location="w.bin", offset=offset, length=4 * n, shape=[n],
                                   name=name, tier="disk",
                                   expert_cache=8 * n if cache is None else cache)
    warm = {**base, "gated": 1, "warm": 1, "expert": expert, **warm_attrs}
    warm = {k: v for k, v in warm.items() if v is not None}
    nodes = [_node("Prefetch", ["s0", "idx"], ["warmed"], **warm),
             _node("Prefetch", ["s0", "warmed"], ["wy"], **base),
             _node("Wait", ["wy"], ["w"]),
             helper.make_node("Add", ["x", "w"], ["out"])]
    return _save(directory / file_name, nodes, n,
                 (helper.make_tensor_value_info("idx", idx_type, [None]),))


@pytest.mark.parametrize("order", ORDERS)
def test_a_warm_prefetch_reads_the_predicted_expert_once_for_its_reload(tmp_path, order):
    """Predicted (idx holds its expert): the warm Prefetch reads the weight into the cache
    and the routed one is served from it (one read, a warm hit); not predicted: nothing is
    warmed and the routed one reads it (a miss). Exact either way; the warm's output is
    empty."""
    n = 5000
    w = _data(tmp_path, n, 0)
    x = np.random.default_rng(4).standard_normal(n).astype(np.float32)
    sess = runtime.InferenceSession(_warm_model(tmp_path, n=n), execution_order=order)
    runtime.reset_counters()
    np.testing.assert_array_equal(sess.run(None, {"x": x, "idx": np.array([7, 3], np.int64)})[0],
                                  x + w)
    c = _c()
    assert (c["warm_reads"], c["bytes_warm_read"], c["warm_hits"], c["warm_present"]) == (
        1, 4 * n, 1, 0)
    assert (c["expert_cache_hits"], c["expert_cache_misses"], c["bytes_read_disk"]) == (
        1, 0, 4 * n)
    # held now: predicted again, nothing is read (present), the reload hits
    runtime.reset_counters()
    np.testing.assert_array_equal(sess.run(None, {"x": x, "idx": np.array([3], np.int64)})[0],
                                  x + w)
    c = _c()
    assert (c["warm_reads"], c["warm_present"], c["warm_hits"], c["bytes_read_disk"]) == (
        0, 1, 0, 0)
    del sess
    gc.collect()  # (the cache goes with its last kernel)
    sess = runtime.InferenceSession(_warm_model(tmp_path, n=n, file_name="w2.onnx"))
    runtime.reset_counters()
    for idx in (np.array([0, 1], np.int64), np.zeros(0, np.int64)):  # not predicted, or none
        np.testing.assert_array_equal(sess.run(None, {"x": x, "idx": idx})[0], x + w)
    c = _c()
    assert (c["warm_reads"], c["warm_hits"], c["expert_cache_misses"], c["expert_cache_hits"],
            c["bytes_read_disk"]) == (0, 0, 1, 1, 4 * n)


def test_a_warmed_reload_waits_for_the_speculative_read(tmp_path):
    """The routed Prefetch finds the entry the warm one is still reading (every transfer
    delayed 20 ms, Prefetch outputs poisoned): its Wait waits for that read, the output is
    exact; with the hook that skips the Wait's waiting it is not (the test sees a missing
    wait)."""
    n = 3000
    w = _data(tmp_path, n, 0)
    x = np.ones(n, np.float32)
    idx = np.array([3], np.int64)
    try:
        testing_ops().set_debug(delay_us=20_000, poison=True)
        sess = runtime.InferenceSession(_warm_model(tmp_path, n=n))
        np.testing.assert_array_equal(sess.run(None, {"x": x, "idx": idx})[0], x + w)
        assert _c()["warm_hits"] >= 1
        del sess
        gc.collect()
        testing_ops().set_debug(delay_us=20_000, poison=True, skip_wait=True)
        sess = runtime.InferenceSession(_warm_model(tmp_path, n=n, file_name="w2.onnx"))
        assert np.isnan(sess.run(None, {"x": x, "idx": idx})[0]).all()
    finally:
        testing_ops().set_debug()
        time.sleep(0.1)


@pytest.mark.parametrize(("attrs", "message"), [
    (dict(gated=None), "a warm Prefetch needs warm = 1, gated = 1"),
    (dict(expert=-1), "expert >= 0"),
    (dict(expert=None), "expert >= 0"),
    (dict(warm=2), "a warm Prefetch needs warm = 1"),
    (dict(tier=None), "a streamed tier"),
    (dict(route="topk", route_k=1), "no route"),
])
def test_a_malformed_warm_prefetch_is_refused_at_creation(tmp_path, attrs, message):
    _data(tmp_path, 64, 0)
    with pytest.raises(Exception, match=message) as info:
        runtime.InferenceSession(_warm_model(tmp_path, n=64, **attrs))
    assert "Prefetch" in str(info.value)


def test_a_warm_prefetch_needs_the_cache_and_int64_indices(tmp_path):
    w = _data(tmp_path, 64, 0)
    with pytest.raises(Exception, match="needs expert_cache > 0"):
        runtime.InferenceSession(_warm_model(tmp_path, n=64, cache=0))
    bad = runtime.InferenceSession(_warm_model(tmp_path, n=64, file_name="w3.onnx",
                                               idx_type=TensorProto.INT32))
    x = np.zeros(64, np.float32)
    with pytest.raises(Exception, match="reads int64 expert indices"):
        bad.run(None, {"x": x, "idx": np.array([3], np.int32)})
    sess = runtime.InferenceSession(_warm_model(tmp_path, n=64, file_name="w2.onnx"))
    # (the session still runs a good request afterwards)
    np.testing.assert_array_equal(sess.run(None, {"x": x, "idx": np.array([3], np.int64)})[0], w)


def test_a_failed_speculative_read_fails_that_run_only(tmp_path):
    """The file is cut after session creation: the warm read fails, the routed Prefetch finds
    that failed entry and its Wait says why (the run fails, naming the file); the entry is
    dropped, so once the file is whole again the next run reads it afresh, exact."""
    n = 5000
    w = _data(tmp_path, n, 0)
    sess = runtime.InferenceSession(_warm_model(tmp_path, n=n))
    x = np.zeros(n, np.float32)
    idx = np.array([3], np.int64)
    os.truncate(tmp_path / "w.bin", 4 * n // 2)
    for _ in range(2):
        with pytest.raises(Exception, match="unexpected end of file") as info:
            sess.run(None, {"x": x, "idx": idx})
        assert "w.bin" in str(info.value)
    w = _data(tmp_path, n, 0, seed=5)
    runtime.reset_counters()
    np.testing.assert_array_equal(sess.run(None, {"x": x, "idx": idx})[0], w)
    assert (_c()["warm_reads"], _c()["warm_hits"]) == (1, 1)


def test_warm_and_routed_reads_from_threads_stay_exact(tmp_path):
    """Four threads run one warm model each with random predictions through a cache with
    room for one weight of the four models sharing the data file: warm reads, hits, misses
    and evictions interleave; every output is exact."""
    import threading

    n, k = 4096, 4
    w = _data(tmp_path, n * k, 0)
    sessions = [runtime.InferenceSession(_warm_model(
        tmp_path, n=n, cache=4 * n, file_name=f"m{i}.onnx", offset=4 * n * i,
        name=f"e{i}", expert=i)) for i in range(k)]
    rounds = threading.Barrier(k)  # (every thread runs once per round: they interleave)

    def work(i: int) -> None:
        rng = np.random.default_rng(i)
        x = rng.standard_normal(n).astype(np.float32)
        want = x + w[i * n:(i + 1) * n]
        try:
            for _ in range(40):
                rounds.wait(timeout=60)
                idx = rng.integers(0, k, size=2).astype(np.int64)
                np.testing.assert_array_equal(sessions[i].run(None, {"x": x, "idx": idx})[0],
                                              want)
        except BaseException:
            rounds.abort()  # (the others stop waiting for this one)
            raise

    runtime.reset_counters()
    run_threads(work, k)
    c = _c()
    assert c["warm_reads"] > 0 and c["expert_cache_misses"] > 0 and c["expert_cache_hits"] > 0
