"""ONNX Runtime on untrusted models runs in a child process (ho_onnx.target.ort.isolate): a
crash there is an error here, and everything else comes back as if it ran here."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import onnx
import pytest
from graphs import FOREVER_LOOP, text_model

from ho_onnx.errors import HoOnnxError, UnsupportedModelError
from ho_onnx.target.ort import isolate
from ho_onnx.target.ort.contrib import ort_check
from ho_onnx.target.ort.optimize import ort_optimize
from ho_onnx.target.ort.profile import profile_model
from ho_onnx.target.ort.verify import verify


def _children() -> set[str]:
    """This process's child pids (Linux)."""
    out: set[str] = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # (a thread ended)
            out |= set((task / "children").read_text().split())
    return out


def test_the_call_runs_in_another_process():
    assert isolate.run_isolated(os.getpid, what="asking for a pid") != os.getpid()


def test_exceptions_come_back_raised():
    with pytest.raises(ValueError, match="invalid literal") as e:
        isolate.run_isolated(int, "x", what="parsing")
    assert any("in the child process" in n for n in e.value.__notes__)
    with pytest.raises(HoOnnxError, match="could not load"):  # the library's own error
        ort_optimize("/nonexistent/m.onnx", "/nonexistent/o.onnx")


def test_a_signal_is_an_error_naming_it():
    with pytest.raises(UnsupportedModelError, match=r"crashed \(SIGABRT\) while aborting"):
        isolate.run_isolated(os.abort, what="aborting")


def test_a_kill_is_an_error_that_suspects_memory():
    with pytest.raises(UnsupportedModelError, match=r"killed \(SIGKILL\) while dying.*memory"):
        isolate.run_isolated(signal.raise_signal, signal.SIGKILL, what="dying")


@pytest.mark.skipif(not Path("/proc/self/oom_score_adj").exists(), reason="Linux only")
def test_the_child_is_the_first_the_kernel_ends_out_of_memory():
    adj = isolate.run_isolated(Path.read_text, Path("/proc/self/oom_score_adj"), what="asking")
    assert adj.strip() == "1000"
    assert Path("/proc/self/oom_score_adj").read_text().strip() != "1000"  # not this process


def test_the_child_writes_nothing_to_stdout(capfd):
    isolate.run_isolated(print, "from the child", what="printing")
    out, err = capfd.readouterr()
    assert out == "" and "from the child" in err



def test_what_the_child_prints_is_shown_never_obeyed(capfd):
    """ORT's log lines quote a model's names (found by hand: "Removing initializer '...'"
    put a hostile name's escape sequences straight onto the terminal): the child's output,
    stdout and stderr, is shown on this process's stderr with them escaped, ORT's colours
    dropped, every line there (also one without a newline at the end)."""
    code = ("import sys; sys.stdout.write('a\\x1b]0;t\\x07\\n'); sys.stdout.flush(); "
            "sys.stderr.write('\\x1b[0;93mwarn \\u202eb\\x1b[m\\nlast')")
    isolate.run_isolated(exec, code, what="printing")
    out, err = capfd.readouterr()
    assert out == ""
    assert err.splitlines() == ["a\\x1b]0;t\\x07", "warn \\u202eb", "last"]

def test_an_interrupt_leaves_no_child_behind():
    before = _children()
    calling = threading.Lock()  # held while run_isolated runs: the only time to interrupt

    def interrupt_once_the_child_runs() -> None:
        deadline = time.monotonic() + 30
        while _children() == before and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # (past Popen: the parent waits for the answer)
        # (never after the call: a stray SIGINT would end a later test, or the whole run)
        if calling.locked() and time.monotonic() < deadline:
            os.kill(os.getpid(), signal.SIGINT)

    t0 = time.monotonic()
    # (Python's handler, whatever the run inherited: a shell's background job starts with
    # SIGINT ignored, and the signal then ended the whole test run)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with calling:
            threading.Thread(target=interrupt_once_the_child_runs, daemon=True).start()
            with pytest.raises(KeyboardInterrupt):
                isolate.run_isolated(time.sleep, 60, what="sleeping")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - t0 < 30
    assert _children() == before


def test_a_time_limit_ends_the_child():
    before = _children()
    t0 = time.monotonic()
    with pytest.raises(UnsupportedModelError, match=r"did not finish sleeping within 0\.5 s"):
        isolate.run_isolated(time.sleep, 60, what="sleeping", timeout_s=0.5)
    assert time.monotonic() - t0 < 30
    assert _children() == before
    # a limit the call stays within changes nothing
    assert isolate.run_isolated(os.getpid, what="asking", timeout_s=60) != os.getpid()



def test_the_time_limit_ends_with_the_answer():
    """A child slow to exit after answering (a big session torn down) is not a run past its
    limit: the answer counts (the child's output is read until it exits, without the
    deadline)."""
    import atexit

    t0 = time.monotonic()
    assert isolate.run_isolated(atexit.register, time.sleep, 2, what="registering",
                                timeout_s=1) is time.sleep
    assert time.monotonic() - t0 >= 2  # (it did wait for the child's exit)

def test_the_time_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(isolate.ENV_TIMEOUT, "0.5")
    with pytest.raises(UnsupportedModelError, match=f"within 0.5 s.*{isolate.ENV_TIMEOUT}"):
        isolate.run_isolated(time.sleep, 60, what="sleeping")
    monkeypatch.setenv(isolate.ENV_TIMEOUT, "0")  # no limit
    assert isolate.default_timeout() is None
    for bad in ("soon", "-1", "inf", "nan"):
        monkeypatch.setenv(isolate.ENV_TIMEOUT, bad)
        with pytest.raises(HoOnnxError, match=isolate.ENV_TIMEOUT):
            isolate.run_isolated(os.getpid, what="asking")
    with pytest.raises(ValueError, match="timeout_s"):
        isolate.run_isolated(os.getpid, what="asking", timeout_s=-1)


@pytest.mark.parametrize("step", ["verify", "profile"])
def test_a_model_that_runs_forever_is_ended(tmp_path: Path, step: str):
    """Was: ``verify``/``profile`` ran until interrupted (a server's request never ended)."""
    m = tmp_path / "forever.onnx"
    onnx.save(text_model(FOREVER_LOOP), m)
    before = _children()
    with pytest.raises(UnsupportedModelError, match=r"did not finish .* within 3 s"):
        if step == "verify":
            verify(m, m, timeout_s=3)
        else:
            profile_model(m, tmp_path / "p.json", runs=1, warmup=0, timeout_s=3)
    assert _children() == before and not (tmp_path / "p.json").exists()


def test_a_time_limit_is_refused_where_it_could_not_apply(tmp_path: Path):
    """In this process a run cannot be ended: a limit there would only pretend."""
    m = tmp_path / "forever.onnx"
    onnx.save(text_model(FOREVER_LOOP), m)
    with pytest.raises(ValueError, match="timeout_s needs isolate=True"):
        verify(m, m, isolate=False, timeout_s=1)
    with pytest.raises(ValueError, match="timeout_s needs isolate=True"):
        profile_model(m, None, isolate=False, timeout_s=1)


def test_an_answer_cut_short_is_the_exit_status():
    """A child killed while writing its answer leaves a truncated pickle: the parent reports
    the death, not an unpickling error."""
    answer_then_die = (  # in the child, sys.argv[1] is the answer's descriptor
        "import os, pickle, signal, sys\n"
        "os.write(int(sys.argv[1]), pickle.dumps(('ok', b'x' * 1000))[:20])\n"
        "signal.raise_signal(signal.SIGKILL)\n")
    with pytest.raises(UnsupportedModelError, match=r"killed \(SIGKILL\) while writing"):
        isolate.run_isolated(exec, answer_then_die, what="writing")


def test_a_child_importing_another_ho_onnx_refuses():
    status, err, _ = pickle.loads(isolate._answer(pickle.dumps(
        ("os", "getpid", (), {}, "/elsewhere/ho_onnx/target/ort/isolate.py"))))
    assert status == "raised" and isinstance(err, HoOnnxError)
    assert "/elsewhere" in str(err)


def test_ort_crashes_on_the_model_in_process(ort_crash_model: Path):
    """The crash the tests below contain is real: ``isolate=False`` dies by the signal."""
    code = ("import sys; from ho_onnx.target.ort.verify import verify; "
            "verify(sys.argv[1], sys.argv[1], isolate=False)")
    r = subprocess.run([sys.executable, "-c", code, str(ort_crash_model)], capture_output=True,
                       timeout=120, check=False)
    assert r.returncode == -signal.SIGSEGV, r.stderr[-2000:]


@pytest.mark.parametrize("step", ["verify", "profile", "ort_optimize"])
def test_an_ort_crash_is_an_error(ort_crash_model: Path, tmp_path: Path, step: str):
    m = str(ort_crash_model)
    with pytest.raises(UnsupportedModelError, match=r"ONNX Runtime crashed \(SIGSEGV\)"):
        if step == "verify":
            verify(m, m)
        elif step == "profile":
            profile_model(m, tmp_path / "p.json", runs=1, warmup=0)
        else:
            ort_optimize(m, tmp_path / "o.onnx", "extended")
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("step", ["verify", "profile"])
def test_an_ort_crash_while_running_is_an_error(ort_run_crash_model: Path, tmp_path: Path,
                                                step: str):
    m = str(ort_run_crash_model)
    with pytest.raises(UnsupportedModelError, match=r"ONNX Runtime crashed \(SIGSEGV\)"):
        if step == "verify":
            verify(m, m, opt_level="disable")
        else:
            profile_model(m, tmp_path / "p.json", runs=1, warmup=0, opt_level="disable")
    assert not (tmp_path / "p.json").exists()


def test_ort_check_runs_in_a_child(monkeypatch, tmp_path: Path):
    calls = []
    monkeypatch.setattr("ho_onnx.target.ort.contrib.run_isolated",
                        lambda fn, *a, **kw: calls.append((fn, a, kw)))
    ort_check(tmp_path / "m.onnx")
    assert calls and calls[0][0] is ort_check and calls[0][2]["isolate"] is False


@pytest.mark.parametrize("atol, rtol", [(float("nan"), 0.0), (-1.0, 0.0), (0.0, float("inf"))])
def test_verify_refuses_tolerances_no_comparison_can_use(tmp_path: Path, atol, rtol):
    """Before any process starts (the library API; the CLI's options refuse them too)."""
    m = tmp_path / "forever.onnx"
    onnx.save(text_model(FOREVER_LOOP), m)
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        verify(m, m, atol=atol, rtol=rtol)


def say_then_die(*, log) -> None:
    """(Run in the child.) Three messages, then a death no answer follows."""
    log("first")
    log("two\nlines")
    log("x" * 100000)
    signal.raise_signal(signal.SIGKILL)


def test_messages_come_as_the_child_sends_them(monkeypatch):
    """``log=``: each message the child sends is one line here, also the last ones of a
    child that then dies; a message's own line breaks are spaces."""
    here = Path(__file__).parent  # (the child imports this module by name)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(here), str(here.parents[1])]))
    got: list[str] = []
    with pytest.raises(UnsupportedModelError, match=r"killed \(SIGKILL\) while talking"):
        isolate.run_isolated(say_then_die, what="talking", log=got.append)
    assert got == ["first", "two lines", "x" * 100000]
    # without log=, the function gets no log argument and there is no message pipe
    assert isolate.run_isolated(len, [1, 2], what="counting") == 2


@pytest.mark.parametrize("step", ["verify", "profile"])
def test_progress_arrives_while_the_model_still_runs(tmp_path: Path, step: str):
    """A long verify/profile says how it goes (found by hand: a big model's verify was
    silent for minutes): the session's line arrives while the first run is still going
    (a model that runs forever, ended by the time limit), not with the answer."""
    m = tmp_path / "forever.onnx"
    onnx.save(text_model(FOREVER_LOOP), m)
    got: list[str] = []
    with pytest.raises(UnsupportedModelError, match=r"within 3 s"):
        if step == "verify":
            verify(m, m, timeout_s=3, log=got.append)
        else:
            profile_model(m, None, runs=1, warmup=1, timeout_s=3, log=got.append)
    assert len(got) == 1 and got[0].startswith(("sessions ready (", "session ready (")), got


def test_verify_and_profile_say_each_run(tmp_path: Path):
    import re

    from graphs import chain_model, save

    m = save(chain_model(), tmp_path / "m.onnx")
    got: list[str] = []
    assert verify(m, m, runs=2, dims={"N": 2}, log=got.append).ok
    ms = r"[0-9.]+ ms"
    want = [r"sessions ready \([0-9.]+ s, CPUExecutionProvider\)",
            f"run 1/2: original {ms}, optimized {ms}", f"run 2/2: original {ms}, optimized {ms}"]
    assert len(got) == 3 and all(map(re.fullmatch, want, got)), got
    got.clear()
    profile_model(m, None, runs=2, warmup=1, dims={"N": 2}, log=got.append, isolate=False)
    want = [r"session ready \([0-9.]+ s, CPUExecutionProvider\)", f"warm-up run 1/1: {ms}",
            f"run 1/2: {ms}", f"run 2/2: {ms}"]
    assert len(got) == 4 and all(map(re.fullmatch, want, got)), got
