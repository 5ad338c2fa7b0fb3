"""Run a step that hands an untrusted model to ONNX Runtime in a child process.

ORT crashes on some models instead of returning an error (measured, onnxruntime 1.32:
valid one-node models ``LayerNormalization(X, W, "")``, SIGSEGV creating a session at level
extended or all, and ``Max(X, "")``, SIGSEGV in its first run; tests/graphs.py; fuzzing ORT
alone with mutated backend node models, 7 crashes, SIGSEGV or SIGFPE, in ~105,000 cases). A
crash in the caller's process would end an inference server, or the CLI without its
one-line error. :func:`run_isolated` calls a module-level function in a fresh interpreter
(``python -m ho_onnx.target.ort.isolate``, the same interpreter and import path as this
process), so a crash ends only that child and becomes an
:class:`~ho_onnx.errors.UnsupportedModelError` naming the signal.

The call and its answer cross two pipes as pickles (the arguments and results are paths,
options and reports; files are read by the child itself). What the child prints (ORT's own
log lines, which quote the model's names) is shown on this process's stderr with what a
terminal would act on escaped (:func:`~ho_onnx.errors.printable`). The child is a crash
boundary, not a sandbox: it runs as the same user. Its ``oom_score_adj`` is 1000: when memory runs
out (a model can make ORT allocate without bound), the kernel ends it first, reported as
"killed (SIGKILL): out of memory?". Cost: one interpreter start and the imports, ~0.5 s
per call (``verify`` of a small model: 0.51 s, in-process 0.01 s), paid only by the steps
that build ORT sessions on a model (``verify``, ``profile``, ``--ort-optimize``, the
contrib-op output check).

A model can also make ORT run forever (a ``Loop`` whose condition stays true and has no
trip count): with a time limit (``timeout_s``, or ``HO_ONNX_ORT_TIMEOUT`` seconds; unset or
``0``: none, as a big model's run may legitimately take hours) the child is killed when it
is reached, an :class:`UnsupportedModelError` saying so.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import pickle
import re
import selectors
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from ...errors import HoOnnxError, UnsupportedModelError, printable

T = TypeVar("T")
_OK, _RAISED = "ok", "raised"
ENV_TIMEOUT = "HO_ONNX_ORT_TIMEOUT"


def default_timeout() -> float | None:
    """``HO_ONNX_ORT_TIMEOUT`` in seconds; None (no limit) when unset or 0."""
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise HoOnnxError(f"{ENV_TIMEOUT}: {raw!r} is not a number of seconds") from None
    if seconds < 0 or not math.isfinite(seconds):
        raise HoOnnxError(f"{ENV_TIMEOUT} must be a number of seconds >= 0 (0: no limit), "
                          f"not {raw!r}")
    return seconds or None


def check_timeout(timeout_s: float | None, isolate: bool) -> None:
    """Refuse a time limit for a run in this process (only a child process can be ended)."""
    if timeout_s and not isolate:
        raise ValueError("timeout_s needs isolate=True (a run in this process cannot be ended)")


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def run_isolated(fn: Callable[..., T], /, *args: Any, what: str,
                 timeout_s: float | None = None, log: Callable[[str], None] | None = None,
                 **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a child process: its result, or the exception it raised.

    ``fn`` must be a module-level function; ``what`` completes "ONNX Runtime crashed while
    ..." (e.g. ``"verifying 'a.onnx'"``). A child that dies by a signal, or is still running
    after ``timeout_s`` seconds (None: :func:`default_timeout`; 0: no limit), raises
    :class:`UnsupportedModelError`; one that cannot start or answer, :class:`HoOnnxError`.
    ``log``: ``fn`` is called with ``log=`` a function that sends each message here, where
    ``log`` gets it as it comes (progress of a long step). Off POSIX systems (no inherited
    pipe descriptors) ``fn`` runs in this process, unbounded.
    """
    if timeout_s is None:
        timeout_s = default_timeout()
    elif timeout_s < 0 or not math.isfinite(timeout_s):
        raise ValueError(f"timeout_s must be >= 0 (0: no limit), not {timeout_s!r}")
    if os.name != "posix":
        return fn(*args, **kwargs) if log is None else fn(*args, log=log, **kwargs)
    request = pickle.dumps((fn.__module__, fn.__qualname__, args, kwargs, __file__))
    proc, r, mr = _start_child(log is not None)
    deadline = time.monotonic() + timeout_s if timeout_s else None
    with os.fdopen(r, "rb", buffering=0) as reader, \
            contextlib.ExitStack() as stack:  # (all closed whatever happens)
        assert proc.stdout is not None
        stack.callback(proc.stdout.close)
        if mr >= 0:
            stack.callback(os.close, mr)
        try:
            assert proc.stdin is not None
            try:
                proc.stdin.write(request)
                proc.stdin.close()
            except BrokenPipeError:  # it died before reading: its exit status says why
                pass
            answer = _read_answer(reader.fileno(), deadline, mr, log, proc.stdout.fileno())
            if answer is None:
                raise UnsupportedModelError(
                    f"ONNX Runtime did not finish {what} within {timeout_s:g} s (a model that "
                    "runs forever, such as a Loop whose condition stays true?); its child "
                    f"process was ended. Allow more with --timeout or {ENV_TIMEOUT} (seconds, "
                    "0: no limit)")
            returncode = proc.wait()
        except BaseException:  # interrupted or timed out: no child left behind
            proc.kill()
            proc.wait()
            raise
    return _result(answer, returncode, what)


def _start_child(messages: bool) -> tuple[subprocess.Popen[bytes], int, int]:
    """The child process, the read end of its answer pipe and of its message pipe (-1
    without ``messages``); its stdout and stderr are one pipe, shown by
    :func:`_show_output`."""
    r, w = os.pipe()
    mr, mw = os.pipe() if messages else (-1, -1)
    try:
        proc = subprocess.Popen([sys.executable, "-m", __name__, str(w), str(mw)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, pass_fds=(w,) if mw < 0 else (w, mw))
    except OSError as e:
        os.close(r)
        if mr >= 0:
            os.close(mr)
        raise HoOnnxError(f"cannot start a child process to run ONNX Runtime ({e})") from None
    finally:
        os.close(w)
        if mw >= 0:
            os.close(mw)
    return proc, r, mr


def _result(answer: bytes, returncode: int, what: str) -> Any:
    """The value the child answered, or the exception it raised (with its traceback as a
    note), or why it gave no answer (a signal, memory, or an exit without one)."""
    try:
        status, value, *rest = pickle.loads(answer) if answer else (None, None)
    except Exception:  # cut short (killed while writing it): its exit status says why
        status, value, rest = None, None, []
    if status is None:
        if returncode == -signal.SIGKILL:
            raise UnsupportedModelError(
                f"ONNX Runtime was killed (SIGKILL) while {what}: out of memory? (it ran in a "
                "child process, the first the kernel ends when memory runs out)")
        if returncode < 0:
            raise UnsupportedModelError(
                f"ONNX Runtime crashed ({_signal_name(returncode)}) while {what}: the model is "
                "malformed or hits an ONNX Runtime bug (it ran in a child process, which "
                "ended; nothing else did)")
        raise HoOnnxError(f"the child process {what} exited with status {returncode} "
                          "without an answer (its messages are above)")
    if status == _OK:
        return value
    if isinstance(value, BaseException):
        if rest and isinstance(value, Exception) and not isinstance(value, HoOnnxError):
            value.add_note(f"in the child process:\n{rest[0]}")
        raise value
    raise HoOnnxError(str(value))


def _read_answer(fd: int, deadline: float | None, messages: int = -1,
                 log: Callable[[str], None] | None = None, output: int = -1) -> bytes | None:
    """Everything the child writes to ``fd`` until it closes its end, or None when
    ``deadline`` (``time.monotonic()``) passes first; meanwhile each line the child writes
    to ``messages`` (when >= 0) goes to ``log`` as it comes, and each line of its ``output``
    (its stdout and stderr: ORT's own log lines, a traceback) to :func:`_show_output`, the
    last ones once it exits (with the answer in, the deadline no longer applies: a child
    tearing a big session down after answering is not a run past its limit)."""
    chunks: list[bytes] = []
    pending = {messages: b"", output: b""}
    show = {messages: log, output: _show_output}
    open_fds = {f for f in (fd, messages, output) if f >= 0}
    with selectors.DefaultSelector() as sel:
        for f in open_fds:
            sel.register(f, selectors.EVENT_READ)
        while open_fds:
            answered = fd not in open_fds and messages not in open_fds
            left = None if deadline is None or answered else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 1 << 20)
                if not chunk:
                    sel.unregister(key.fd)
                    open_fds.discard(key.fd)
                elif key.fd == fd:
                    chunks.append(chunk)
                else:
                    *lines, pending[key.fd] = (pending[key.fd] + chunk).split(b"\n")
                    for line in lines:
                        show[key.fd](line.decode(errors="replace"))  # type: ignore[misc]
    for f, rest in pending.items():
        if rest:
            show[f](rest.decode(errors="replace"))  # type: ignore[misc]
    return b"".join(chunks)


# ORT colours its log lines (SGR sequences), into a pipe too.
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def _show_output(line: str) -> None:
    """A line the child printed, on this process's stderr: without ORT's colour codes, and
    with what a terminal would act on as escapes (found by hand: ORT's warning "Removing
    initializer '...'" quoted a hostile model's name, escape sequences and all, straight
    onto the terminal)."""
    with contextlib.suppress(OSError, ValueError):  # (no stderr to show it on)
        sys.stderr.write(printable(_COLOUR.sub("", line)) + "\n")
        sys.stderr.flush()


class _Messages:
    """The child's ``log``: each message one line on the parent's message pipe."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __call__(self, message: str) -> None:
        data = (" ".join(str(message).splitlines()) + "\n").encode(errors="replace")
        while data:
            data = data[os.write(self.fd, data):]


def _answer(request: bytes, messages: int = -1) -> bytes:
    """The pickled answer to a pickled request (run in the child); with a ``messages``
    pipe, the function gets ``log=`` a :class:`_Messages` writing to it."""
    module, qualname, args, kwargs, expected = pickle.loads(request)
    if messages >= 0:
        kwargs = {**kwargs, "log": _Messages(messages)}
    try:
        if os.path.realpath(__file__) != os.path.realpath(expected):
            raise HoOnnxError(f"the child process runs ho_onnx from {__file__!r}, not "
                              f"{expected!r} as its parent does")
        fn: Any = importlib.import_module(module)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        return pickle.dumps((_OK, fn(*args, **kwargs)))
    except BaseException as e:  # (KeyboardInterrupt too: the parent decides)
        tb = traceback.format_exc()
        try:
            return pickle.dumps((_RAISED, e, tb))
        except Exception:  # an exception that does not pickle: its words
            return pickle.dumps((_RAISED, f"{type(e).__name__}: {e}", tb))


def main(argv: list[str] | None = None) -> int:
    argv = argv if argv is not None else sys.argv[1:]
    fd, messages = int(argv[0]), int(argv[1]) if len(argv) > 1 else -1
    try:  # out of memory, the kernel ends this child first, not its parent (a server)
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:  # not Linux, or not allowed: the kernel's default choice
        pass
    answer = _answer(sys.stdin.buffer.read(), messages)
    if messages >= 0:
        os.close(messages)  # (every message is out before the answer)
    with os.fdopen(fd, "wb") as f:
        f.write(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
