"""Run a check in a forked child while this process does other work.

Loading checks a parsed model (UTF-8 of every string, external-data references, the ONNX
checker) and builds its ``onnx_ir`` model: independent CPU work in Python, which threads
cannot overlap. A child made by ``fork`` sees the parsed proto copy-on-write (nothing is
serialised) and runs the check while the parent deserialises; it reports ``None`` or the
:class:`~ho_onnx.errors.HoOnnxError` the check raised.

Only where forking is safe enough: on Linux, from a process with a single *Python* thread
(a Python lock another thread held at the fork would never be released in the child; idle
native pools such as OpenBLAS' or ORT's are there in most processes and hold nothing the
check uses; glibc's allocator is fork-safe), and not when disabled with
``HO_ONNX_FORKED_CHECKS=0``. Otherwise, and whenever the child fails in any other way
(killed, an unexpected exception, no answer within the timeout), the check runs here, so
the outcome is the same either way; only the time differs.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable

from ..errors import HoOnnxError

ENV = "HO_ONNX_FORKED_CHECKS"
TIMEOUT_S = 120.0
# A fork costs a few milliseconds plus the copy-on-write faults both processes then take;
# the overlap breaks even at ~350 nodes (load_model of bench-style decoders on a 2-core VM,
# forked and in-process alternated, min of 60: 88 nodes 7.4 vs 4.0 ms, 196: 8.9 vs 7.0,
# 336: 12.4 vs 12.2, 646: 20.8 vs 22.5; of 30: 1,266: 33.8 vs 41.6, 5,017: 128 vs 172), so
# smaller graphs are checked in-process.
MIN_NODES = 500
_PASSED = b"="  # the check passed
_FALLBACK = b"?"  # the child could not give a verdict (or died: no bytes): check here


def forking_allowed() -> bool:
    return (sys.platform.startswith("linux") and os.environ.get(ENV, "1") != "0"
            and threading.active_count() == 1)


class PendingCheck:
    """A check started by :func:`start_check`: :meth:`wait` for its verdict, or
    :meth:`cancel` it (the child is killed and reaped)."""

    def __init__(self, check: Callable[[], None], pid: int | None = None, fd: int = -1,
                 deadline: float = 0.0) -> None:
        self.check, self.pid, self.fd, self.deadline = check, pid, fd, deadline

    def wait(self) -> None:
        """Raise the check's error, if any (run here when the child gave no verdict)."""
        if self.pid is None:
            return
        try:
            verdict = _read(self.fd, self.deadline)
        finally:
            self.cancel()
        if verdict == _PASSED:
            return
        error = _error(verdict)
        if error is None:  # no verdict (died, timed out, gave up, or a garbled answer)
            self.check()
            return
        raise error

    def cancel(self) -> None:
        if self.pid is not None:
            os.close(self.fd)
            _reap(self.pid)
            self.pid = None


def start_check(check: Callable[[], None], timeout: float = TIMEOUT_S, *,
                worth_forking: bool = True) -> PendingCheck:
    """Start ``check()`` (raises a :class:`HoOnnxError` or returns None) in a forked child
    when allowed and ``worth_forking`` (see :data:`MIN_NODES`), else run it now (then
    :meth:`PendingCheck.wait` has nothing to do)."""
    if not (worth_forking and forking_allowed()):
        check()
        return PendingCheck(check)
    r, w = os.pipe()
    with warnings.catch_warnings():  # (3.12+ warns of native threads; see the docstring)
        warnings.filterwarnings("ignore", message=".*multi-threaded.*fork",
                                category=DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: never returns
        _child(check, r, w)
    os.close(w)
    return PendingCheck(check, pid, r, time.monotonic() + timeout)


def _error(verdict: bytes) -> HoOnnxError | None:
    """The check's error from the child's answer (our own child: pickle is safe here), or
    None when the answer is no error."""
    if verdict in (_FALLBACK, b""):
        return None
    try:
        error = pickle.loads(verdict)
    except Exception:  # truncated (the child was killed while writing)
        return None
    return error if isinstance(error, HoOnnxError) else None


def _child(check: Callable[[], None], r: int, w: int) -> None:
    code = 0
    try:
        # Signals end the child at once: the parent's handlers (the command line's cleanup
        # of partial outputs) are the parent's to run.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        os.close(r)
        try:
            check()
            out = _PASSED
        except HoOnnxError as e:
            try:
                out = pickle.dumps(e)
            except Exception:  # an error that does not pickle: the parent checks itself
                out = _FALLBACK
        except BaseException:  # anything else: the parent checks itself
            out = _FALLBACK
        view = memoryview(out)
        while view:
            view = view[os.write(w, view):]
    except BaseException:
        code = 1
    finally:
        os._exit(code)  # no atexit handlers, no flushing of the parent's buffers


def _read(r: int, deadline: float) -> bytes:
    """The child's whole answer, or the fallback marker if it dies or misses the deadline."""
    chunks: list[bytes] = []
    poller = select.poll()  # (not select.select: descriptors past 1024 exist in servers)
    poller.register(r, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return _FALLBACK
        if not poller.poll(left * 1000):
            return _FALLBACK
        chunk = os.read(r, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _reap(pid: int) -> None:
    """Collect the child (killed first if it is still running)."""
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
            os.waitpid(pid, 0)
