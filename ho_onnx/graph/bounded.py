"""Shape inference of an untrusted model, bounded in memory and time.

ONNX's data propagation can be made to allocate without bound by a few kilobytes of graph
(``Shape`` concatenated with itself 40 times materializes 2**40 integers). The inference
therefore runs in a child process whose address space is limited (``RLIMIT_AS``) and that is
killed after a timeout; going past either is a clear :class:`ModelLoadError`, not an
out-of-memory kill of the caller. The child is forked per call from one long-lived worker
(:mod:`._shape_worker`, started on first use), so a call costs milliseconds plus the
(weight-free) skeleton's serialization, and a child that fails leaves no state behind.

Environment: ``HO_ONNX_SHAPE_INFERENCE_MEMORY`` (a size, default 4GiB; ``0`` runs the
inference in-process, unbounded) and ``HO_ONNX_SHAPE_INFERENCE_TIMEOUT`` (seconds, default
300).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable

import onnx
import onnx.onnx_cpp2py_export.shape_inference as onnx_c

from ..errors import ModelLoadError
from ..units import format_bytes, parse_size

ENV_MEMORY = "HO_ONNX_SHAPE_INFERENCE_MEMORY"
ENV_TIMEOUT = "HO_ONNX_SHAPE_INFERENCE_TIMEOUT"
DEFAULT_MEMORY = 4 << 30
DEFAULT_TIMEOUT_S = 300.0

OK, FAILED, NO_MEMORY, DIED = 0, 1, 2, 3  # a worker's statuses (as _shape_worker's)
_READY = b"R"
START_TIMEOUT_S = 120.0  # a worker's imports and warm-up (ORT's symbolic one: ~2 s)
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shape_worker.py")


def limits() -> tuple[int, float]:
    """(address-space bytes, seconds) from the environment; 0 bytes: unbounded."""
    raw = os.environ.get(ENV_MEMORY, "").strip()
    try:
        memory = parse_size(raw) if raw else DEFAULT_MEMORY
    except ValueError as e:
        raise ModelLoadError(f"{ENV_MEMORY}: {e}") from None
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    try:
        timeout = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ModelLoadError(f"{ENV_TIMEOUT}: {raw!r} is not a number of seconds") from None
    if not timeout > 0:
        raise ModelLoadError(f"{ENV_TIMEOUT} must be positive, not {raw!r}")
    return memory, timeout


def too_big(memory: int, what: str = "shape inference") -> ModelLoadError:
    """The error for an inference that needed more than ``memory`` bytes."""
    return ModelLoadError(
        f"{what} of the model needs more than {format_bytes(memory)} of memory (a malformed "
        f"or hostile model, or a 1-D tensor of millions of elements?); set {ENV_MEMORY} to "
        "allow more")


def too_slow(timeout: float, what: str = "shape inference") -> ModelLoadError:
    """The error for an inference still running after ``timeout`` seconds."""
    return ModelLoadError(f"{what} of the model took more than {timeout:g} s (a malformed or "
                          f"hostile model?); set {ENV_TIMEOUT} to allow more")


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """ONNX shape inference with data propagation of ``model`` (best effort: ``model``
    itself when inference fails), bounded by :func:`limits`; raises
    :class:`ModelLoadError` when the model needs more memory or time than that."""
    return start_infer_shapes(model).result()


class PendingShapes:
    """Shape inference started in the worker: :meth:`result` waits for it (the caller works
    meanwhile), :meth:`cancel` abandons it. One of them must be called: the worker serves
    one request at a time."""

    def __init__(self, model: onnx.ModelProto, memory: int,
                 reply: Callable[[], tuple[int, bytes]],
                 abandon: Callable[[], None] = lambda: None) -> None:
        self.model, self.memory = model, memory
        self._reply: Callable[[], tuple[int, bytes]] | None = reply
        self._abandon = abandon
        self._answer: tuple[int, bytes] | None = None

    def result(self) -> onnx.ModelProto:
        if self._answer is None:
            if self._reply is None:
                raise ModelLoadError("this shape inference was cancelled")
            reply, self._reply = self._reply, None  # the worker is released exactly once
            self._answer = reply()
        status, payload = self._answer
        if status == OK:
            return _parse_result(payload)
        if status == FAILED:
            return self.model
        if status == NO_MEMORY:
            raise too_big(self.memory)
        raise ModelLoadError(f"shape inference of the model crashed ({payload.decode()})")

    def cancel(self) -> None:
        if self._reply is not None:
            self._reply = None
            self._abandon()


def start_infer_shapes(model: onnx.ModelProto) -> PendingShapes:
    """Send ``model`` to the worker and return at once (see :func:`infer_shapes`)."""
    memory, timeout = limits()
    data = _hide_long_vectors(model).SerializeToString()
    if memory == 0:
        try:
            reply = (OK, onnx_c.infer_shapes(data, False, False, True))
        except Exception:  # best effort: unknown shapes are handled downstream
            reply = (FAILED, b"")
        return PendingShapes(model, memory, lambda: reply)
    return PendingShapes(model, memory, *_worker.submit(memory, data, timeout))


# ONNX's data propagation spends ~100-250 bytes per element of every 1-D tensor of known
# length that reaches an op it propagates through (Add, Mul, Concat, ...): a 768 MiB 1-D
# weight costs ~14 GB. Shape vectors are short; longer graph inputs and initializers get a
# symbolic length for the inference (their values are not in the skeleton anyway), mapped
# back to the length afterwards.
_LONG_1D = 1 << 16
_LEN_PARAM = "__ho_onnx_len_"


def _hide_long_vectors(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a copy whose long 1-D inputs and initializers have symbolic lengths."""
    g = model.graph
    long_inputs = [vi for vi in g.input if _long_1d(vi.type)]
    long_inits = [t for t in g.initializer if len(t.dims) == 1 and t.dims[0] > _LONG_1D]
    if not long_inputs and not long_inits:
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    g = copy.graph
    hidden = {t.name for t in long_inits}
    inputs = {vi.name for vi in g.input}
    for t in [t for t in g.initializer if t.name in hidden]:
        if t.name not in inputs:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type,
                                                              [t.dims[0]]))
        g.initializer.remove(t)
    for vi in g.input:
        if _long_1d(vi.type):
            d = vi.type.tensor_type.shape.dim[0]
            d.dim_param = f"{_LEN_PARAM}{d.dim_value}"
    return copy


def _long_1d(tp: onnx.TypeProto) -> bool:
    if not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return False
    dims = tp.tensor_type.shape.dim
    return len(dims) == 1 and dims[0].HasField("dim_value") and dims[0].dim_value > _LONG_1D


def _parse_result(data: bytes) -> onnx.ModelProto:
    """The inferred model from onnx's serialized answer, with the lengths
    :func:`_hide_long_vectors` made symbolic restored (looked for only when the bytes name
    one)."""
    model = onnx.ModelProto.FromString(data)
    return _restore_long_vectors(model) if _LEN_PARAM.encode() in data else model


def _restore_long_vectors(model: onnx.ModelProto) -> onnx.ModelProto:
    """The lengths :func:`_hide_long_vectors` made symbolic, back to values (in place)."""
    g = model.graph
    for vi in [*g.input, *g.value_info, *g.output]:
        if vi.type.HasField("tensor_type"):
            for d in vi.type.tensor_type.shape.dim:
                if d.HasField("dim_param") and d.dim_param.startswith(_LEN_PARAM):
                    d.dim_value = int(d.dim_param[len(_LEN_PARAM):])
    return model


def limited_env() -> dict[str, str]:
    """The environment of a child whose address space is limited: ours without preloaded
    sanitizer runtimes (AddressSanitizer's shadow memory cannot live under such a limit; the
    children that get it run only Python and onnx, never the ho-onnx library), with one
    BLAS/OpenMP thread (each thread's buffers are address space: OpenBLAS starts one per
    core, up to 64, and a many-core machine would spend the limit on them)."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    keep = [p for p in env.get("LD_PRELOAD", "").split()
            if "libasan" not in p and "libubsan" not in p]
    if keep:
        env["LD_PRELOAD"] = " ".join(keep)
    else:
        env.pop("LD_PRELOAD", None)
    return env


class Worker:
    """A long-lived worker process (``python ARGS``: :mod:`._shape_worker`'s protocol) that
    runs each request in a forked child under the caller's limits; one request at a time.
    ``what`` names its inference in messages. Started on first use; its start (imports,
    warm-up) is waited for apart, up to :data:`START_TIMEOUT_S`, and never counts against a
    request's time limit."""

    def __init__(self, args: list[str], what: str) -> None:
        self.args, self.what = args, what
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        _WORKERS.add(self)

    def _after_fork(self) -> None:
        """In a forked child (a process pool, a server's preforked workers): the worker
        process and a request another thread had in flight are the parent's. The child
        starts its own worker on first use, with a lock of its own (the inherited one may
        be held forever); the inherited pipes are pointed at /dev/null, so nothing of the
        child's (a buffer flushed when they are collected) can reach the parent's worker,
        and kept, so that they are never closed twice."""
        self.lock = threading.Lock()
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            null = os.open(os.devnull, os.O_RDWR)
            try:
                for f in (proc.stdin, proc.stdout):
                    if f is not None and not f.closed:
                        os.dup2(null, f.fileno())
            finally:
                os.close(null)
        _INHERITED.append(proc)

    def _start(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            safe = ["-P"] if sys.version_info >= (3, 11) else []
            self.proc = subprocess.Popen([sys.executable, *safe, *self.args],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         start_new_session=True, env=limited_env())
            assert self.proc.stdout is not None
            if _read_exactly(self.proc.stdout.fileno(), len(_READY),
                             time.monotonic() + START_TIMEOUT_S) != _READY:
                self.stop()
                raise ModelLoadError(f"the {self.what} worker process did not start (its "
                                     "messages are above)")
        return self.proc

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)  # the worker and a running child
            proc.wait()
        if proc is not None:
            for f in (proc.stdin, proc.stdout):
                if f is not None:
                    f.close()

    def submit(self, memory: int, data: bytes, timeout: float
               ) -> tuple[Callable[[], tuple[int, bytes]], Callable[[], None]]:
        """Send a request: (read its reply, abandon it). The worker is held until one of
        them is called."""
        self.lock.acquire()
        try:
            proc = self._deliver(memory, data)
        except BaseException:
            self.stop()
            self.lock.release()
            raise
        if proc is None:
            self.lock.release()
            return (lambda: (DIED, f"the {self.what} worker died".encode())), lambda: None
        return (lambda: self._reply(proc, memory, data, timeout)), self._abandon

    def _deliver(self, memory: int, data: bytes) -> subprocess.Popen[bytes] | None:
        """The worker that took the request: a worker that had died (its parent thread
        ended) is replaced once."""
        for _attempt in (0, 1):
            proc = self._start()
            if self._send(proc, memory, data):
                return proc
            self.stop()
        return None

    def _reply(self, proc: subprocess.Popen[bytes], memory: int, data: bytes, timeout: float
               ) -> tuple[int, bytes]:
        try:
            reply = self._receive(proc, timeout)
            if reply is None:  # died while working: once more, from the start
                self.stop()
                again = self._deliver(memory, data)
                reply = self._receive(again, timeout) if again is not None else None
            if reply is None:
                self.stop()
                return DIED, f"the {self.what} worker died".encode()
            return reply
        except BaseException:
            self.stop()  # a request left half done (timeout, signal) ends the worker
            raise
        finally:
            self.lock.release()

    def _abandon(self) -> None:
        """Abandon the request in flight (the worker is stopped: it may still be busy)."""
        self.stop()
        self.lock.release()

    @staticmethod
    def _send(proc: subprocess.Popen[bytes], memory: int, data: bytes) -> bool:
        assert proc.stdin is not None
        try:
            proc.stdin.write(struct.pack("<QQ", memory, len(data)) + data)
            proc.stdin.flush()
        except BrokenPipeError:
            return False
        return True

    def _receive(self, proc: subprocess.Popen[bytes], timeout: float
                 ) -> tuple[int, bytes] | None:
        assert proc.stdout is not None
        fd, deadline = proc.stdout.fileno(), time.monotonic() + timeout
        head = _read_exactly(fd, 9, deadline)
        if head is None:
            raise too_slow(timeout, self.what)
        if len(head) < 9:
            return None  # (its output ended: it died)
        n = struct.unpack("<Q", head[1:9])[0]
        payload = _read_exactly(fd, n, deadline)
        if payload is None:
            raise too_slow(timeout, self.what)
        return (head[0], payload) if len(payload) == n else None

    def call(self, data: bytes) -> tuple[int, bytes]:
        """(status, payload) of one request under :func:`limits`."""
        memory, timeout = limits()
        reply, _ = self.submit(memory, data, timeout)
        return reply()


def _read_exactly(fd: int, n: int, deadline: float) -> bytes | None:
    """``n`` bytes from ``fd``, fewer when it ends first, None when ``deadline``
    (``time.monotonic()``) passes first."""
    buf = bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return None
            chunk = os.read(fd, min(n - len(buf), 1 << 24))  # (never past the n bytes)
            if not chunk:
                break
            buf += chunk
    return bytes(buf)


_WORKERS: weakref.WeakSet[Worker] = weakref.WeakSet()
_INHERITED: list[subprocess.Popen[bytes]] = []  # (a forked child's view of its parent's)


def _after_fork_in_child() -> None:
    for worker in list(_WORKERS):
        worker._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
_worker = Worker([_WORKER], "shape inference")
atexit.register(_worker.stop)
