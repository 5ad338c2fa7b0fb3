"""Issue 9, native half: failed runs, forged models and bad requests cannot corrupt memory,
read outside the model folder, or leak. Every failure class is a test here; each one failed
on main before the fix (46b76cd) and passes now. Scenarios that crashed the process then
run in a child process (tests/native_child.py) so that a crash is a test failure, not the
end of the test session.

Run them against another build of the library with HO_ONNX_TEST_OPS (native_util.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from native_util import (
    N,
    hnode,
    make_model,
    ops,
    save,
    session,
    session_options,
    testing_ops,
    weight_attrs,
    write_failure_model,
    write_moving_failure_model,
)
from onnx import TensorProto, helper

from ho_onnx.graph.fingerprint import data_fingerprint

CHILD = Path(__file__).resolve().parent / "native_child.py"


def run_child(*args: str, timeout: int = 120) -> dict:
    proc = subprocess.run([sys.executable, str(CHILD), *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy())
    assert proc.returncode == 0, (
        f"child exited with {proc.returncode} (negative: killed by a signal)\n"
        f"{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# Item 1: transfers never outlive the Compute that was handed ORT's buffer


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("order", ["default", "priority"])
@pytest.mark.parametrize("arena", [0, 1])
def test_failed_runs_interleaved_with_good_runs(arena, order, tier):
    """A node fails between every cache op and its completion (Store..Detach,
    Prefetch..Wait) in every other run, from 3 threads on one session, with every transfer
    delayed: good runs stay exact, nothing crashes, and nothing stays in the pool."""
    r = run_child("interleave", "--arena", str(arena), "--order", order, "--tier", tier)
    assert r["bad"] > 0 and r["good"] > 0, r
    assert r["wrong"] == 0 and r["other"] == 0, r
    assert r["pool_in_use"] == 0, r


@pytest.mark.parametrize("missing", ["--no-wait", "--no-detach"])
@pytest.mark.parametrize("arena", [0, 1])
def test_hand_edited_graph_missing_wait_or_detach(arena, missing):
    """A graph without its Wait (the Prefetch output read directly) or without its Detach
    (the stored tensor freed right after Store) may compute garbage but never touches freed
    memory."""
    r = run_child("interleave", "--arena", str(arena), "--order", "priority", missing)
    assert r["other"] == 0, r
    assert r["pool_in_use"] == 0, r
    if missing == "--no-detach":
        assert r["wrong"] == 0, r  # the Store copied synchronously: the data is right


def test_missing_wait_is_caught_by_poison(tmp_path):
    """The asynchronous path is observable: with skip_wait the Wait does not copy and the
    poisoned Prefetch output reaches the consumer."""
    path, w = write_failure_model(tmp_path, "disk")
    sess = session(path)
    x = np.ones(N, np.float32)
    feeds = {"x": x, "idx": np.array([1], np.int64)}
    try:
        testing_ops().set_debug(poison=True, skip_wait=True, delay_us=2000)
        (bad,) = sess.run(None, feeds)
        testing_ops().set_debug(poison=True, delay_us=2000)
        (good,) = sess.run(None, feeds)
    finally:
        testing_ops().set_debug()
    assert not np.array_equal(bad, x + w)
    np.testing.assert_array_equal(good, x + w)


# --------------------------------------------------------------------------------------------
# Item 2: stored tensors checked at reload; tokens reach only their own run's data


def _store_model(ttype=TensorProto.FLOAT, n=1024) -> onnx.ModelProto:
    """x -> Store -> Detach -> token output (never reloaded: the token leaves the run)."""
    return make_model(
        [hnode("Store", ["x"], ["t"]), hnode("Detach", ["x", "t"], ["t2"])],
        [helper.make_tensor_value_info("x", ttype, [n])],
        [helper.make_tensor_value_info("t2", ttype, None)],
    )


def _reload_model(ttype, tok_len) -> onnx.ModelProto:
    """token input -> Prefetch -> Wait -> output."""
    return make_model(
        [hnode("Prefetch", ["tok"], ["y"]), hnode("Wait", ["y"], ["z"])],
        [helper.make_tensor_value_info("tok", ttype, [tok_len])],
        [helper.make_tensor_value_info("z", ttype, None)],
    )


def _on_thread(fn):
    """Run fn on a thread that has ended when this returns (its runs are over)."""
    out: list = []

    def body():
        try:
            out.append(("ok", fn()))
        except Exception as e:
            out.append(("err", e))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out[0]


class _LiveThread:
    """Run fn on a thread that stays alive (as an ORT_PARALLEL worker would) until close()."""

    def __init__(self, fn):
        self.result: list = []
        self._go = threading.Event()
        self._ran = threading.Event()

        def body():
            try:
                self.result.append(fn())
            finally:
                self._ran.set()
                self._go.wait()

        self._t = threading.Thread(target=body)
        self._t.start()
        self._ran.wait()

    def close(self):
        self._go.set()
        self._t.join()


@pytest.mark.parametrize("order", ["default", "priority"])
@pytest.mark.parametrize("arena", [False, True])
@pytest.mark.parametrize(("store_type", "reload_type"), [
    (TensorProto.FLOAT, TensorProto.DOUBLE),   # half of the output would stay unwritten
    (TensorProto.DOUBLE, TensorProto.FLOAT),   # the copy would overflow the output
])
def test_reload_with_another_element_type_is_refused(tmp_path, arena, order, store_type,
                                                     reload_type):
    so = session_options(tmp_path, arena=arena, order=order)  # one engine for both
    s_store = session(save(_store_model(store_type), tmp_path, "s.onnx"), so)
    dt = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64}
    x = np.arange(1024).astype(dt[store_type])
    live = _LiveThread(lambda: s_store.run(None, {"x": x})[0])
    try:
        (tok,) = live.result
        tok_other = np.frombuffer(tok.tobytes(), dt[reload_type]).copy()
        s_reload = session(save(_reload_model(reload_type, len(tok_other)), tmp_path, "r.onnx"),
                           so)
        with pytest.raises(Exception, match="element type"):
            s_reload.run(None, {"tok": tok_other})
    finally:
        live.close()


@pytest.mark.parametrize("arena", [False, True])
def test_token_of_an_earlier_run_is_refused(tmp_path, arena):
    """A token that left its run (a graph output fed back as an input) reaches no data once
    the next run of its session started on that thread, or once its thread ended."""
    so = session_options(tmp_path, arena=arena)
    s_store = session(save(_store_model(), tmp_path, "s.onnx"), so)
    s_reload = session(save(_reload_model(TensorProto.FLOAT, 4), tmp_path, "r.onnx"), so)
    (tok,) = s_store.run(None, {"x": np.arange(1024, dtype=np.float32)})
    s_store.run(None, {"x": np.zeros(1024, dtype=np.float32)})  # the next run
    with pytest.raises(Exception, match="no stored tensor"):
        s_reload.run(None, {"tok": tok})
    status, tok = _on_thread(lambda: s_store.run(None, {"x": np.ones(1024, np.float32)})[0])
    assert status == "ok"
    time.sleep(0.3)  # Python's join() returns before the thread's C++ thread-locals are gone
    with pytest.raises(Exception, match="no stored tensor"):
        s_reload.run(None, {"tok": tok})
    assert ops().counters()["host_pool_bytes_in_use"] == 0


def test_forged_token_is_refused(tmp_path):
    """Store ids are guessable; the token's second word is a random tag that must match."""
    so = session_options(tmp_path)
    s_store = session(save(_store_model(), tmp_path, "s.onnx"), so)
    s_reload = session(save(_reload_model(TensorProto.UINT64, 2), tmp_path, "r.onnx"), so)
    live = _LiveThread(lambda: s_store.run(None, {"x": np.ones(1024, np.float32)})[0])
    try:
        (tok,) = live.result
        real_id = int(np.frombuffer(tok.tobytes(), np.uint64)[0])
        magic = 0x4B545F584E4E4F48  # the old fixed second word
        for guess in range(max(1, real_id - 8), real_id + 8):
            for second in (magic, 0, 1):
                with pytest.raises(Exception, match="no stored tensor"):
                    s_reload.run(None, {"tok": np.array([guess, second], np.uint64)})
    finally:
        live.close()


# --------------------------------------------------------------------------------------------
# Item 5: a failed run's stores are released by the next run; the pool is bounded


@pytest.mark.parametrize("arena", [False, True])
def test_failed_runs_do_not_leak_stores(tmp_path, arena):
    path, w = write_failure_model(tmp_path)
    sess = session(path, arena=arena)
    x = np.ones(N, np.float32)
    base = ops().counters()["host_pool_bytes_in_use"]
    for _ in range(50):
        with pytest.raises(Exception, match=r"Gather|indices"):
            sess.run(None, {"x": x, "idx": np.array([100], np.int64)})
    (out,) = sess.run(None, {"x": x, "idx": np.array([1], np.int64)})
    np.testing.assert_array_equal(out, x + w)
    c = ops().counters()
    assert c["host_pool_bytes_in_use"] == base
    assert c["host_pool_bytes_reserved"] <= base + 4 * 4 * N  # reused, not grown per run


@pytest.mark.parametrize("arena", [False, True])
def test_failed_runs_of_changing_lengths_hold_one_runs_store(tmp_path, arena):
    """Failed runs of growing lengths (a Reshape fails between every cache op and its
    completion): each holds only its own store until the next run starts, whatever buffers
    it got; the good run after them is exact and leaves the pool as it found it. (The CUDA
    engine keys stores by token address: test_cuda_engine.py runs the same scenario.)"""
    path, w = write_moving_failure_model(tmp_path)
    sess = session(path, arena=arena)
    base = ops().counters()["host_pool_bytes_in_use"]
    for i in range(30):
        n = 1024 + 256 * i
        with pytest.raises(Exception, match=r"(?i)reshape"):
            sess.run(None, {"x": np.ones(n, np.float32), "shp": np.array([5], np.int64)})
        assert ops().counters()["host_pool_bytes_in_use"] - base == 4 * n
    x = np.linspace(-2, 2, 5000, dtype=np.float32)
    z, wz = sess.run(None, {"x": x, "shp": np.array([4], np.int64)})
    np.testing.assert_array_equal(z, np.maximum(x, 0))
    np.testing.assert_array_equal(wz, w)
    assert ops().counters()["host_pool_bytes_in_use"] == base


@pytest.mark.parametrize("threads", [1, 4])
def test_failed_requests_of_per_request_sessions_are_released(tmp_path, threads):
    """Issue 34 item 3: a server making a fresh session per request while another session
    of the folder keeps its engine alive. The failed requests' stores were never released
    (no kernel of a dead session repeats on a thread; 100 failures held 400 MiB): now each
    goes with its session, and the good requests around them stay exact."""
    import gc
    from concurrent.futures import ThreadPoolExecutor

    path, w = write_failure_model(tmp_path)
    keeper = session(path)  # the folder's engine outlives every request
    x = np.ones(N, np.float32)
    base = ops().counters()["host_pool_bytes_in_use"]

    def request(i: int) -> None:
        s = session(path)
        if i % 3:
            with pytest.raises(Exception, match=r"Gather|indices"):
                s.run(None, {"x": x, "idx": np.array([100], np.int64)})
        else:
            (out,) = s.run(None, {"x": x, "idx": np.array([1], np.int64)})
            np.testing.assert_array_equal(out, x + w)

    with ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(request, range(24)):
            pass
    gc.collect()
    assert ops().counters()["host_pool_bytes_in_use"] == base
    (out,) = keeper.run(None, {"x": x, "idx": np.array([1], np.int64)})
    np.testing.assert_array_equal(out, x + w)
    assert ops().counters()["host_pool_bytes_in_use"] == base


def test_a_data_file_rewritten_in_place_is_read_again(tmp_path):
    """Issue 34 item 2: weights were cached by file identity (device, inode, range), so a
    data file rewritten in place while a session of the folder lived served the new
    session the old bytes (as an inode reused by the next version did). Keyed by content
    now (the file's version and fingerprint)."""
    path, w = write_failure_model(tmp_path)
    x = np.ones(N, np.float32)
    ok = {"x": x, "idx": np.array([1], np.int64)}
    old = session(path)
    np.testing.assert_array_equal(old.run(None, ok)[0], x + w)
    time.sleep(0.05)  # (past the file system's timestamp tick)
    w2 = w[::-1].copy()
    with open(tmp_path / "w.bin", "r+b") as f:  # the same inode, new bytes
        f.write(w2.tobytes())
    np.testing.assert_array_equal(session(path).run(None, ok)[0], x + w2)
    np.testing.assert_array_equal(old.run(None, ok)[0], x + w)  # (read at its creation)


def test_hot_swapped_versions_release_their_weights(tmp_path):
    """Issue 34 item 2: every version's weights stayed in the host store for the engine's
    life (33x one model's after 40 swaps); a version goes with its last session."""
    import gc

    path, w = write_failure_model(tmp_path)
    keeper = session(path)  # the engine stays
    base = ops().counters()["host_store_bytes"]
    x = np.ones(N, np.float32)
    ok = {"x": x, "idx": np.array([1], np.int64)}
    live = None
    for v in range(8):
        time.sleep(0.02)
        wv = w + v + 1
        (tmp_path / "w.bin").write_bytes(wv.tobytes())
        new = session(path)  # the new version opens, then the old one is dropped
        np.testing.assert_array_equal(new.run(None, ok)[0], x + wv)
        live = new
        gc.collect()
        assert ops().counters()["host_store_bytes"] <= base + 4 * N, v
    del keeper, live


def test_pool_size_classes():
    """At least the bytes asked, at most 1/8 more (plus 64-byte rounding), monotonic, so
    runs of nearby lengths share buffers."""
    cls = testing_ops().pool_size_class
    sizes = [0, 1, 63, 64, 65, 511, 512, 513, 1000, 4096, 4097, 5000, 123_457, 1 << 20,
             (1 << 20) + 1, 3 * (1 << 30) + 7, (1 << 62) + 5]
    prev = 0
    for n in sorted(sizes):
        c = cls(n)
        assert n <= c <= n + n // 8 + 64 and c % 64 == 0 and c >= prev, (n, c)
        prev = c
    assert len({cls(n) for n in range(40_000, 45_000)}) <= 2


@pytest.mark.parametrize("arena", [False, True])
def test_failed_runs_between_a_prefetch_input_and_its_wait(tmp_path, arena):
    """A run fails between a PrefetchInput (the KV cache: the caller's buffer) and its Wait,
    at a new length each time, and the caller's array is freed right after: the pending
    copy holds only that run's pointer and is never read after the run (under ASan a read
    is a use-after-free). Good runs between them, with arrays of other lengths, are exact."""
    nodes = [
        hnode("PrefetchInput", ["past"], ["p"]),
        helper.make_node("Gather", ["table", "idx"], ["g"]),  # idx 100: fails
        hnode("Wait", ["p", "g"], ["pw"]),
        helper.make_node("Add", ["pw", "one"], ["out"]),
    ]
    model = make_model(
        nodes,
        [helper.make_tensor_value_info("past", TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("idx", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor("table", TensorProto.FLOAT, [4], [1, 2, 3, 4]),
         helper.make_tensor("one", TensorProto.FLOAT, [1], [1])])
    sess = session(save(model, tmp_path), arena=arena)
    ops().reset_counters()
    for i in range(20):
        n = 1000 + 97 * i
        with pytest.raises(Exception, match=r"Gather|indices"):
            sess.run(None, {"past": np.full(n, float(i), np.float32),
                            "idx": np.array([100], np.int64)})
        past = np.arange(n + 13, dtype=np.float32) * 0.5 - float(i)
        (out,) = sess.run(None, {"past": past, "idx": np.array([1], np.int64)})
        np.testing.assert_array_equal(out, past + 1)
    assert ops().counters()["prefetches"] == 40  # (the PrefetchInput ran in every run)


def test_runs_of_changing_lengths_keep_about_one_runs_buffers_idle(tmp_path):
    """Issue 34 item 4: the pool kept a free buffer of every size it ever served (runs at
    512 lengths left 662 MiB idle where one run stores 17 MiB); now what it keeps idle is
    bounded by what recent runs took. A run that repeats reuses its buffers."""
    path, _ = write_moving_failure_model(tmp_path)
    sess = session(path)
    base = ops().counters()["host_pool_bytes_reserved"]
    in_use = ops().counters()["host_pool_bytes_in_use"]
    lengths = [1000 + 97 * i for i in range(120)]
    for n in lengths:
        x = np.linspace(-2, 2, n, dtype=np.float32)
        z, _ = sess.run(None, {"x": x, "shp": np.array([4], np.int64)})
        np.testing.assert_array_equal(z, np.maximum(x, 0))
    c = ops().counters()
    assert c["host_pool_bytes_in_use"] == in_use
    one_run = testing_ops().pool_size_class(4 * max(lengths))
    assert c["host_pool_bytes_reserved"] - base <= 2 * one_run, (
        c["host_pool_bytes_reserved"] - base, one_run)
    # the same length again and again: nothing more is reserved
    x = np.ones(lengths[-1], np.float32)
    for _ in range(5):
        sess.run(None, {"x": x, "shp": np.array([4], np.int64)})
    assert ops().counters()["host_pool_bytes_reserved"] == c["host_pool_bytes_reserved"]


@pytest.mark.parametrize("threads", [1, 4])
def test_repeated_runs_reuse_their_buffers(tmp_path, threads):
    """The pool's idle bound (issue 34 item 4) must not free what the next runs need: runs
    of one length, alone or four at once on one session, allocate a buffer only for each
    run that can be in progress at once (measured before the bound remembered concurrency:
    2-3 allocations per run with four threads), never per run."""
    from concurrent.futures import ThreadPoolExecutor

    path, _ = write_moving_failure_model(tmp_path)
    x = np.ones(50_000, np.float32)
    one = testing_ops().pool_size_class(x.nbytes)
    base = ops().counters()
    sess = session(path)

    def run(_: int) -> None:
        z, _w = sess.run(None, {"x": x, "shp": np.array([4], np.int64)})
        np.testing.assert_array_equal(z, x)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, range(48 * threads)))
    c = ops().counters()
    assert c["host_pool_allocs"] - base["host_pool_allocs"] <= threads
    assert c["host_pool_bytes_reserved"] - base["host_pool_bytes_reserved"] <= threads * one


def test_host_pool_limit_is_a_clear_error(tmp_path):
    path, w = write_failure_model(tmp_path)
    so = session_options(tmp_path, config={"ho_onnx.host_pool_limit_bytes": str(100_000)})
    sess = session(path, so)
    with pytest.raises(Exception, match=r"host pool limit exceeded.*ho_onnx.host_pool_limit_bytes"):
        sess.run(None, {"x": np.ones(N, np.float32), "idx": np.array([1], np.int64)})
    so2 = session_options(tmp_path, config={"ho_onnx.host_pool_limit_bytes": str(8 * N)})
    (out,) = session(path, so2).run(None, {"x": np.ones(N, np.float32),
                                           "idx": np.array([1], np.int64)})
    np.testing.assert_array_equal(out, 1 + w)


def test_bad_pool_limit_entry_is_refused(tmp_path):
    with pytest.raises(Exception, match="host_pool_limit_bytes"):
        session_options(tmp_path, config={"ho_onnx.host_pool_limit_bytes": "-5"})


# --------------------------------------------------------------------------------------------
# Items 3 and 4: weights come only from the model's own folder, opened once


def _weight_model(location="w.bin", length=64, shape=(16,), **extra) -> onnx.ModelProto:
    return make_model(
        [hnode("Prefetch", ["s0"], ["wy"],
               **weight_attrs(location, 0, length, list(shape), "layer.weight", **extra)),
         hnode("Wait", ["wy"], ["w"])],
        [],
        [helper.make_tensor_value_info("w", TensorProto.FLOAT, None)],
        [helper.make_tensor("s0", TensorProto.FLOAT, [0], [])],
    )


def test_absolute_base_dir_is_never_read(tmp_path):
    """A model given as bytes naming /etc/passwd through base_dir: refused, and the error
    says to set ho_onnx.model_dir."""
    m = _weight_model("passwd", length=64, base_dir="/etc")
    import onnxruntime as ort

    with pytest.raises(Exception, match=r"ho_onnx\.model_dir"):
        ort.InferenceSession(m.SerializeToString(), session_options(None),
                             providers=["CPUExecutionProvider"])


def test_base_dir_ignored_when_model_dir_is_set(tmp_path):
    (tmp_path / "w.bin").write_bytes(np.arange(16, dtype=np.float32).tobytes())
    other = tmp_path / "other"
    other.mkdir()
    (other / "w.bin").write_bytes(np.full(16, 7, np.float32).tobytes())
    path = save(_weight_model(base_dir=str(other)), tmp_path)
    np.testing.assert_array_equal(session(path).run(None, {})[0], np.arange(16))


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_data_file_of_another_optimization_is_refused(tmp_path, tier):
    """data_size / data_fingerprint recorded at optimize time: a copied folder whose data
    file was replaced (re-optimized original) is refused with the file's name."""
    w = np.arange(1024, dtype=np.float32)
    (tmp_path / "w.bin").write_bytes(w.tobytes())
    fp = data_fingerprint(tmp_path / "w.bin")
    size = os.path.getsize(tmp_path / "w.bin")
    extra = dict(data_size=size, data_fingerprint=fp, tier=tier)
    good = save(_weight_model(**extra), tmp_path)
    np.testing.assert_array_equal(session(good).run(None, {})[0], w[:16])
    # same size, other bytes: only the fingerprint tells
    (tmp_path / "w.bin").write_bytes((w + 1).tobytes())
    with pytest.raises(Exception, match=r"w\.bin.*fingerprint"):
        session(good)
    # another size
    (tmp_path / "w.bin").write_bytes(np.arange(2048, dtype=np.float32).tobytes())
    with pytest.raises(Exception, match=r"w\.bin.*bytes but the model was optimized for"):
        session(good)


def test_fingerprint_reference_matches_library(tmp_path):
    for size in (0, 1, 15, 16, 4095, 4096, 4097, 65536, 100_003):
        p = tmp_path / f"f{size}.bin"
        p.write_bytes(np.random.default_rng(size).integers(0, 256, size, np.uint8).tobytes())
        m = _weight_model(location=p.name, length=0, shape=(0,),
                          data_fingerprint=data_fingerprint(p))
        session(save(m, tmp_path)).run(None, {})  # the library computes the same value


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_symlinks_inside_the_folder_are_not_followed(tmp_path, tier):
    d = tmp_path / "model"
    (d / "sub").mkdir(parents=True)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.full(16, 42, np.float32).tobytes())
    os.symlink(secret, d / "w.bin")
    os.symlink(tmp_path, d / "sub" / "up")
    for loc in ("w.bin", "sub/up/secret.bin"):
        with pytest.raises(Exception, match="symbolic links"):
            session(save(_weight_model(loc, tier=tier), d))


_SWAPPER = r"""
import os, sys, time
d, inside, outside = sys.argv[1], sys.argv[2], sys.argv[3]
end = time.time() + float(sys.argv[4])
tmp_link = os.path.join(d, ".lnk")
tmp_file = os.path.join(d, ".reg")
while time.time() < end:
    try:
        os.unlink(tmp_link)
    except FileNotFoundError:
        pass
    os.symlink(outside, tmp_link)
    os.replace(tmp_link, os.path.join(d, "w.bin"))   # now a symlink to the secret
    with open(tmp_file, "wb") as f:
        f.write(open(inside, "rb").read())
    os.replace(tmp_file, os.path.join(d, "w.bin"))   # now the regular file again
"""


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_symlink_swapped_in_during_session_creation_is_never_read(tmp_path, tier):
    """Item 4: a process swaps model/w.bin between the real file and a symlink to a secret
    while sessions are created: every session either fails or reads the real file."""
    d = tmp_path / "model"
    d.mkdir()
    real = np.arange(16, dtype=np.float32)
    (tmp_path / "inside.bin").write_bytes(real.tobytes())
    (tmp_path / "secret.bin").write_bytes(np.full(16, 42, np.float32).tobytes())
    (d / "w.bin").write_bytes(real.tobytes())
    path = save(_weight_model(tier=tier), d)
    swapper = subprocess.Popen([sys.executable, "-c", _SWAPPER, str(d),
                                str(tmp_path / "inside.bin"), str(tmp_path / "secret.bin"),
                                "4"])
    leaked = ok = 0
    try:
        end = time.time() + 3
        while time.time() < end:
            try:
                (w,) = session(path).run(None, {})
            except Exception:
                continue
            if np.array_equal(w, real):
                ok += 1
            else:
                leaked += 1
    finally:
        swapper.kill()
        swapper.wait()
    assert leaked == 0, f"{leaked} sessions read the symlinked secret ({ok} read the model)"


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("kind", ["loop", "if"])
def test_cache_ops_inside_loop_and_if_bodies(tmp_path, kind, tier):
    """A hand-edited model (the rewriter never writes one): an optimized graph's nodes, cache
    ops and all, moved into a Loop body run three times per run (each Store, Prefetch and
    Detach again) or into an If branch; two threads run it at once. Each iteration's output
    is the original model's, bit-exact (the same CPU kernels), and nothing crashes (also
    under ASan, scripts/test_native.sh); with the library's Waits made to skip, it is not."""
    import onnxruntime as ort
    from graphs import chain_model
    from graphs import save as save_model
    from threads import run_threads

    from ho_onnx.rewrite.pipeline import optimize
    from ho_onnx.schedule.options import OffloadOptions

    src = save_model(chain_model(), tmp_path / "src.onnx", external=True)
    opt = tmp_path / "opt.onnx"
    optimize(src, opt, OffloadOptions(min_bytes=0, min_gap=1, prefetch_distance=1,
                                      weight_tier=tier), {"N": 4})
    m = onnx.load(str(opt), load_external_data=False)
    g = m.graph
    assert {n.op_type for n in g.node if n.domain == "ai.hyperoffload"} == {
        "Prefetch", "Wait", "Store", "Detach"}
    nodes, y = list(g.node), g.output[0].name
    any_float = helper.make_tensor_value_info
    if kind == "loop":
        body = helper.make_graph(
            [*nodes, helper.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
            [any_float("i", TensorProto.INT64, []), any_float("cond_in", TensorProto.BOOL, [])],
            [any_float("cond_out", TensorProto.BOOL, []), any_float(y, TensorProto.FLOAT, None)])
        outer = helper.make_node("Loop", ["M", "c"], ["ys"], body=body)
        g.initializer.append(helper.make_tensor("M", TensorProto.INT64, [], [3]))
    else:
        then = helper.make_graph(nodes, "then", [], [any_float(y, TensorProto.FLOAT, None)])
        other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [],
                                  [any_float("e", TensorProto.FLOAT, None)])
        outer = helper.make_node("If", ["c"], ["ys"], then_branch=then, else_branch=other)
    g.initializer.append(helper.make_tensor("c", TensorProto.BOOL, [], [True]))
    del g.node[:], g.output[:]
    g.node.append(outer)
    g.output.append(any_float("ys", TensorProto.FLOAT, None))
    hostile = save(m, tmp_path, "hostile.onnx")
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    s = session(hostile)
    results: list[np.ndarray] = []

    def runs(_: int) -> None:
        for _ in range(5):
            results.append(s.run(None, {"x": x})[0])

    try:  # (poisoned Prefetch outputs and slow copies: a missing wait would show)
        testing_ops().set_debug(poison=True, delay_us=200)
        run_threads(runs, 2)
        testing_ops().set_debug(poison=True, delay_us=200, skip_wait=True)
        skipped = s.run(None, {"x": x})[0]
    finally:
        testing_ops().set_debug()
    assert len(results) == 10
    for got in results:
        for row in (got if kind == "loop" else [got]):
            np.testing.assert_array_equal(row, want)
    assert results[0].shape == ((3, 4, 16) if kind == "loop" else (4, 16))
    assert not np.array_equal(skipped, results[0])  # (the test sees a Wait that does not)


def _iteration_model(marked: bool, n: int = 1024) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(a model whose main graph stores ``a`` before a Loop and reloads it after, while each
    of the Loop's 3 iterations stores and reloads its own state; the same without cache ops).
    ``marked``: the body's cache ops carry attribute ``iteration`` = 1, as the rewriter
    writes them (rewrite/branches.py). Iteration ``k`` (an input) fails between its body's
    Prefetch and Wait (an out-of-range Gather that the Wait depends on)."""
    f = TensorProto.FLOAT
    vi = helper.make_tensor_value_info
    it = {"iteration": 1} if marked else {}

    def body(cached: bool) -> onnx.GraphProto:
        fail = [helper.make_node("Equal", ["i", "k"], ["hit"]),
                helper.make_node("Where", ["hit", "five", "zero"], ["idx"]),
                helper.make_node("Gather", ["two", "idx"], ["g"])]
        nodes = [helper.make_node("Identity", ["c"], ["c2"]), *fail]
        if cached:
            nodes += [hnode("Store", ["h"], ["bt"], **it),
                      hnode("Detach", ["h", "bt"], ["bt2"], **it),
                      hnode("Prefetch", ["bt2"], ["bp"], **it),
                      hnode("Wait", ["bp", "g"], ["bz"], **it)]
        else:
            nodes += [helper.make_node("Identity", ["h"], ["bz"])]
        nodes.append(helper.make_node("Tanh", ["bz"], ["h2"]))
        return helper.make_graph(nodes, "body", [vi("i", TensorProto.INT64, []),
                                                 vi("c", TensorProto.BOOL, []), vi("h", f, [n])],
                                 [vi("c2", TensorProto.BOOL, []), vi("h2", f, [n])])

    def model(cached: bool) -> onnx.ModelProto:
        head = [helper.make_node("Tanh", ["x"], ["a"])]
        if cached:
            head += [hnode("Store", ["a"], ["t"]), hnode("Detach", ["a", "t"], ["t2"])]
        loop = helper.make_node("Loop", ["M", "cond", "x"], ["out"], body=body(cached))
        tail = [hnode("Prefetch", ["t2", "out"], ["p"]), hnode("Wait", ["p"], ["r"])] \
            if cached else [helper.make_node("Identity", ["a"], ["r"])]
        inits = [helper.make_tensor("M", TensorProto.INT64, [], [3]),
                 helper.make_tensor("cond", TensorProto.BOOL, [], [True]),
                 helper.make_tensor("five", TensorProto.INT64, [], [5]),
                 helper.make_tensor("zero", TensorProto.INT64, [], [0]),
                 helper.make_tensor("two", f, [2], [1.0, 2.0])]
        return make_model([*head, loop, *tail, helper.make_node("Add", ["out", "r"], ["y"])],
                          [vi("x", f, [n]), vi("k", TensorProto.INT64, [])], [vi("y", f, [n])],
                          inits)

    return model(True), model(False)


def test_a_loop_bodys_cache_ops_keep_the_main_graphs_records_across_iterations(tmp_path):
    """Cache ops inside a Loop body (issue 38 item 4) run once per iteration; marked
    ``iteration`` = 1, a body op seen again starts the next iteration, so the main graph's
    Store (made before the Loop, reloaded after it) survives the iterations. Unmarked, the
    second iteration starts a new run, which releases it: the test sees the difference. A
    run that fails inside an iteration (between the body's Prefetch and Wait) leaves nothing
    behind once the next run ends; two threads run it at once; outputs are the model's
    without cache ops, bit-exact."""
    import onnxruntime as ort
    from threads import run_threads

    from ho_onnx.target.ort import runtime

    marked, plain = _iteration_model(True)
    unmarked, _ = _iteration_model(False)
    x = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    ok = {"x": x, "k": np.array(-1, np.int64)}
    want = ort.InferenceSession(plain.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, ok)[0]
    s = session(save(marked, tmp_path, "marked.onnx"))
    results: list[np.ndarray] = []

    def runs(_: int) -> None:
        for _ in range(4):
            results.append(s.run(None, ok)[0])

    try:  # (poisoned Prefetch outputs and slow copies: a missing wait would show)
        testing_ops().set_debug(poison=True, delay_us=200)
        run_threads(runs, 2)
        for k in (0, 1, 2):  # a failure inside each iteration, then a good run
            with pytest.raises(Exception, match=r"Gather|indices|out of"):
                s.run(None, {"x": x, "k": np.array(k, np.int64)})
            np.testing.assert_array_equal(s.run(None, ok)[0], want)
            assert runtime.counters()["host_pool_bytes_in_use"] == 0
    finally:
        testing_ops().set_debug()
    assert len(results) == 8
    for got in results:
        np.testing.assert_array_equal(got, want)
    with pytest.raises(Exception, match=r"no stored tensor of this run"):
        session(save(unmarked, tmp_path, "unmarked.onnx")).run(None, ok)
