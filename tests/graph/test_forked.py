"""graph.forked: a check run in a forked child gives the same outcome as run here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ho_onnx.errors import ExternalDataError
from ho_onnx.graph import forked


@pytest.fixture
def may_fork(monkeypatch):
    """Fork even if an earlier test left a Python thread behind (tqdm's monitor does)."""
    monkeypatch.setattr(forked, "forking_allowed", lambda: True)


def test_a_single_threaded_process_forks():
    code = "from ho_onnx.graph import forked; print(forked.forking_allowed())"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "True"


def _marker(tmp_path):
    """A check that records the pid it ran in."""
    seen = tmp_path / "pids"

    def check() -> None:
        with open(seen, "a") as f:
            f.write(f"{os.getpid()}\n")

    return check, lambda: [int(x) for x in seen.read_text().split()]


def test_runs_in_a_child_and_passes(tmp_path, may_fork):
    check, pids = _marker(tmp_path)
    forked.start_check(check).wait()
    assert pids() and pids()[0] != os.getpid()  # ran once, elsewhere


def test_the_childs_error_is_raised_here(may_fork):
    def check() -> None:
        raise ExternalDataError("initializer 'w': points outside the model folder")

    pending = forked.start_check(check)
    with pytest.raises(ExternalDataError, match="outside the model folder"):
        pending.wait()


@pytest.mark.parametrize("how", ["unexpected error", "killed", "timeout"])
def test_without_a_verdict_the_check_runs_here(tmp_path, how, may_fork):
    parent = os.getpid()
    log = tmp_path / "log"

    def check() -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        if os.getpid() == parent:
            return  # here: the real check passes
        if how == "unexpected error":
            raise RuntimeError("a bug in the child")
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)

    forked.start_check(check, timeout=1.0 if how == "timeout" else 30.0).wait()
    pids = [int(x) for x in log.read_text().split()]
    assert pids[-1] == parent and len(pids) == 2


def test_no_fork_with_another_python_thread(tmp_path):
    check, pids = _marker(tmp_path)
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert not forked.forking_allowed()
        pending = forked.start_check(check)
        assert pids() == [os.getpid()]  # ran at once, here
        pending.wait()
    finally:
        stop.set()
        t.join()


def test_disabled_by_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(forked.ENV, "0")
    check, pids = _marker(tmp_path)
    forked.start_check(check).wait()
    assert pids() == [os.getpid()]


def test_a_cancelled_check_leaves_no_child(may_fork):
    pending = forked.start_check(lambda: time.sleep(30))
    pid = pending.pid
    assert pid is not None
    pending.cancel()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # killed and reaped
    pending.wait()  # nothing left to wait for


def test_small_graphs_are_checked_here(tmp_path, may_fork):
    check, pids = _marker(tmp_path)
    pending = forked.start_check(check, worth_forking=False)
    assert pids() == [os.getpid()]
    pending.wait()


def test_a_garbled_answer_means_checking_here(tmp_path):
    """A child killed while writing its error leaves half a pickle: no verdict, not a crash."""
    check, pids = _marker(tmp_path)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, b"\x80\x04\x95garbled")
        os._exit(0)
    os.close(w)
    forked.PendingCheck(check, pid, r, time.monotonic() + 10).wait()
    assert pids() == [os.getpid()]
