"""Shape inference of untrusted models is bounded in memory and time (issue 9), and stays
cheap for ordinary and big models."""

from __future__ import annotations

import os
import signal
import time

import pytest
from onnx import TensorProto, helper

from ho_onnx.errors import ModelLoadError
from ho_onnx.graph import bounded
from ho_onnx.graph.analyse import analyse
from tests.graphs import chain_model, doubling_model


def test_memory_bound_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(bounded.ENV_MEMORY, "1GiB")
    with pytest.raises(ModelLoadError, match=f"shape inference.*1.00 GiB.*{bounded.ENV_MEMORY}"):
        analyse(doubling_model(40))
    assert analyse(chain_model(), {"N": 2}).tensors["h1"].shape == (2, 16)  # still usable


def test_time_bound_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(bounded.ENV_TIMEOUT, "0.2")
    t = time.monotonic()
    with pytest.raises(ModelLoadError, match=f"took more than 0.2 s.*{bounded.ENV_TIMEOUT}"):
        analyse(doubling_model(40))
    assert time.monotonic() - t < 10
    monkeypatch.delenv(bounded.ENV_TIMEOUT)
    assert analyse(chain_model(), {"N": 2}).tensors["h1"].shape == (2, 16)  # a new worker


@pytest.mark.parametrize("env, value", [(bounded.ENV_MEMORY, "lots"),
                                        (bounded.ENV_TIMEOUT, "soon"),
                                        (bounded.ENV_TIMEOUT, "0")])
def test_bad_settings_are_clear_errors(monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    with pytest.raises(ModelLoadError, match=env):
        analyse(chain_model(), {"N": 2})


def test_unbounded_in_process_when_disabled(monkeypatch):
    monkeypatch.setenv(bounded.ENV_MEMORY, "0")
    monkeypatch.setattr(bounded, "_worker", None)  # would fail if used
    assert analyse(chain_model(), {"N": 2}).tensors["h1"].shape == (2, 16)


def test_long_1d_tensors_keep_their_lengths_and_stay_cheap():
    """A 768 MiB 1-D weight added to a 1-D input: ONNX's data propagation alone would need
    ~14 GB; the lengths are hidden from it and restored, so the bound is not reached."""
    n = (768 << 20) // 4
    w = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[n])
    w.data_location = TensorProto.EXTERNAL
    e = w.external_data.add()
    e.key, e.value = "location", "w.bin"
    shape = helper.make_tensor("s", TensorProto.INT64, [2], [2, n // 2])
    g = helper.make_graph([helper.make_node("Add", ["x", "W"], ["y"]),
                           helper.make_node("Reshape", ["y", "s"], ["z"])], "long",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)], [w, shape])
    a = analyse(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    assert {k: a.tensors[k].shape for k in ("x", "W", "y", "z")} == {
        "x": (n,), "W": (n,), "y": (n,), "z": (2, n // 2)}


def test_a_call_costs_milliseconds_once_the_worker_runs():
    m = chain_model()
    analyse(m, {"N": 2})
    t = time.perf_counter()
    for _ in range(20):
        analyse(m, {"N": 2})
    assert (time.perf_counter() - t) / 20 < 0.25


def test_a_started_inference_is_read_later_or_cancelled():
    from ho_onnx.graph.bounded import start_infer_shapes

    pending = start_infer_shapes(chain_model())
    inferred = pending.result()
    assert {vi.name for vi in inferred.graph.value_info} >= {"h1", "h2", "h3"}
    abandoned = start_infer_shapes(doubling_model(40))  # would run out of memory
    abandoned.cancel()  # the worker is stopped and free again at once
    again = start_infer_shapes(chain_model()).result()
    assert {vi.name for vi in again.graph.value_info} >= {"h1", "h2", "h3"}


def test_a_failure_while_the_worker_infers_frees_the_worker(monkeypatch):
    from ho_onnx.graph import analyse as analyse_module

    def broken(*args):
        raise RuntimeError("walk failed")

    monkeypatch.setattr(analyse_module, "_tensor_infos", broken)
    with pytest.raises(RuntimeError, match="walk failed"):
        analyse(chain_model(), {"N": 2})
    monkeypatch.undo()
    assert analyse(chain_model(), {"N": 2}).tensors["h1"].shape == (2, 16)  # not stuck


def test_a_pending_inference_answers_once_and_cancels_once():
    from ho_onnx.graph.bounded import start_infer_shapes

    pending = start_infer_shapes(chain_model())
    first = pending.result()
    assert pending.result() == first  # the worker was released once, the answer kept
    pending.cancel()  # nothing left to abandon
    cancelled = start_infer_shapes(chain_model())
    cancelled.cancel()
    cancelled.cancel()
    with pytest.raises(ModelLoadError, match="cancelled"):
        cancelled.result()
    assert start_infer_shapes(chain_model()).result().graph.value_info  # worker free


_ECHO = """
import os
from ho_onnx.graph._shape_worker import serve

def infer(data):
    os.write(1, b"noise on stdout, as a library's print or a C library's write")
    if data == b"big":
        bytearray(1 << 32)  # 4 GiB: past the limit
    if data == b"crash":
        os.abort()
    return data[::-1]

def warm():
    raise RuntimeError("a warm-up that fails is ignored")

serve(infer, warm)
"""


def test_a_worker_answers_apart_from_what_its_inference_prints(monkeypatch):
    """Any worker (bounded.Worker + _shape_worker.serve): what the inference writes on stdout
    does not corrupt the answer; its limit applies per request; the worker survives."""
    monkeypatch.setenv(bounded.ENV_TIMEOUT, "20")  # (a corrupted answer fails, not hangs)
    w = bounded.Worker(["-c", _ECHO], "echo")
    try:
        assert w.call(b"abc") == (bounded.OK, b"cba")
        monkeypatch.setenv(bounded.ENV_MEMORY, "1GiB")
        assert w.call(b"big")[0] == bounded.NO_MEMORY
        assert w.call(b"xyz") == (bounded.OK, b"zyx")
    finally:
        w.stop()


def test_a_worker_that_does_not_start_is_a_clear_error():
    w = bounded.Worker(["-c", "raise SystemExit(3)"], "echo")
    with pytest.raises(ModelLoadError, match="the echo worker process did not start"):
        w.call(b"abc")
    assert w.proc is None


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _sleeping(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "S"
    except OSError:
        return False


def _waiting_child(pid: int) -> int:
    """The child the worker ``pid`` forked for its next request: its only child, asleep
    (blocked on the request) twice 50 ms apart (the child that answered the last request
    exits at once and is reaped before the next one is forked)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        children = _children(pid)
        if len(children) == 1 and _sleeping(children[0]):
            time.sleep(0.05)
            if _children(pid) == children and _sleeping(children[0]):
                return children[0]
        time.sleep(0.01)
    raise AssertionError(f"worker {pid} has children {_children(pid)}, not one waiting")


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"),
                    reason="needs Linux's /proc/PID/task/PID/children")
def test_a_worker_forks_each_child_before_its_request(monkeypatch):
    """The fork is not a request's time: after each answer the worker already has the next
    child waiting, a new one each time; a child that dies answers DIED, one killed while it
    waited makes the worker end (the stream may be cut mid-request) and the next call start
    a fresh worker; the warm-up's failure is ignored (warm() raises in this worker)."""
    monkeypatch.setenv(bounded.ENV_TIMEOUT, "20")
    w = bounded.Worker(["-c", _ECHO], "echo")
    try:
        assert w.call(b"abc") == (bounded.OK, b"cba")
        assert w.proc is not None
        worker = w.proc.pid
        first = _waiting_child(worker)
        assert w.call(b"def") == (bounded.OK, b"fed")
        second = _waiting_child(worker)
        assert second != first
        assert w.call(b"crash")[0] == bounded.DIED
        assert w.call(b"ghi") == (bounded.OK, b"ihg")
        assert w.proc.pid == worker  # a child's crash never takes the worker down
        os.kill(_waiting_child(worker), signal.SIGKILL)
        assert w.call(b"jkl") == (bounded.OK, b"lkj")
        assert w.proc.pid != worker
    finally:
        w.stop()


def test_concurrent_inferences_each_get_their_own_answer():
    """An inference server analyses models from several threads: each request gets the
    answer to its own model (one request at a time in the worker, the next child forked
    ahead), also when some of them are cancelled."""
    from concurrent.futures import ThreadPoolExecutor

    from ho_onnx.graph.bounded import start_infer_shapes

    def shapes(n: int) -> dict[str, list[int]]:
        model = chain_model()
        model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = n
        pending = start_infer_shapes(model)
        if n % 5 == 0:
            pending.cancel()
            return {}
        out = pending.result()
        return {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
                for vi in out.graph.value_info}

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(shapes, range(1, 41)))
    for n, s in zip(range(1, 41), got, strict=True):
        assert s == ({} if n % 5 == 0 else {f"h{i}": [n, 16] for i in range(1, 6)}), n


def _chain_shapes(n: int) -> dict[str, list[int]]:
    from ho_onnx.graph.bounded import infer_shapes

    model = chain_model()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = n
    return {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
            for vi in infer_shapes(model).graph.value_info}


def test_a_forked_process_has_its_own_worker():
    """A server that forks after using ho-onnx (``ProcessPoolExecutor``/``multiprocessing``
    on Linux, gunicorn's preload): parent and child infer side by side and each gets the
    answers to its own models, also when a request of another thread was in flight at the
    fork (found by hand: the child inherited the held lock and waited forever)."""
    _chain_shapes(1)  # the worker runs before the fork
    parent_worker = bounded._worker.proc.pid
    r, w = os.pipe()
    done = (0, 0)
    bounded._worker.lock.acquire()  # (what a request in flight in another thread holds)
    pid = os.fork()
    if pid == 0:  # the child: its own answers, reported through the pipe
        code = 1
        try:
            os.close(r)
            ok = all(_chain_shapes(n) == {f"h{i}": [n, 16] for i in range(1, 6)}
                     for n in range(100, 160))
            ok = ok and bounded._worker.proc.pid != parent_worker
            os.write(w, b"ok" if ok else b"wrong")
            code = 0
        finally:
            os._exit(code)
    bounded._worker.lock.release()  # (the parent's request ends; the child's copy is held)
    os.close(w)
    try:
        for n in range(200, 260):
            assert _chain_shapes(n) == {f"h{i}": [n, 16] for i in range(1, 6)}, n
        deadline, done = time.monotonic() + 60, (0, 0)
        while done == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
            done = os.waitpid(pid, os.WNOHANG)
    finally:
        if done == (0, 0):  # (a child still waiting after a minute, or a failure above)
            os.kill(pid, signal.SIGKILL)
            done = os.waitpid(pid, 0)
        status = done[1]
        answer = os.read(r, 16)
        os.close(r)
    assert os.waitstatus_to_exitcode(status) == 0 and answer == b"ok", answer
    assert bounded._worker.proc.pid == parent_worker  # the parent's worker is still its own
    assert _chain_shapes(3) == {f"h{i}": [3, 16] for i in range(1, 6)}
