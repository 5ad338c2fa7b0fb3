"""The shape-inference worker (run as a script by :mod:`ho_onnx.graph.bounded`; imports
only the standard library and onnx's C++ extension, not the onnx package: it starts in
~20 ms instead of ~250 ms and forks a smaller process).

It writes one byte (:data:`READY`) once warmed up, then serves requests on stdin: 8-byte
LE address-space limit, 8-byte LE length, a serialized model. Each is read by a child the
worker forked (and warmed up with a tiny inference) before the request came, so neither
the fork nor the child's first copy-on-write faults are a request's time (a 57-node model's
round trip on a 2-core VM: ~2.5 ms when each child was forked for its request, ~1.2 ms
now; ONNX's inference itself ~0.25 ms); the child lowers its address-space limit
(RLIMIT_AS), runs ONNX's shape inference with data propagation on the request bytes
(onnx's C++ entry: the model is never parsed into Python objects here) and pipes back the
result; the worker answers on stdout with a 1-byte status, an 8-byte LE length and the
payload (the inferred model, or a message) as soon as it has the child's whole answer. A
child that runs out of memory or dies never takes the worker down; the worker exits when
stdin closes or its parent dies. :func:`serve` is the same loop for another inference
(ORT's symbolic one: :mod:`ho_onnx.target.ort._symbolic_worker`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import importlib.machinery
import importlib.util
import os
import resource
import signal
import struct
import sys
from collections.abc import Callable
from types import ModuleType

OK, FAILED, NO_MEMORY, DIED = 0, 1, 2, 3
READY = b"R"  # written once, when the worker is warm (its start is not a request's time)
_PR_SET_PDEATHSIG = 1
_PIPE_SIZE = 1 << 20


def _load_onnx_c() -> ModuleType:
    """``onnx.onnx_cpp2py_export.shape_inference``; in the worker process, loaded without
    the onnx package (its Python modules, numpy and protobuf take ~10x longer to import than
    the extension). Only :func:`main` loads it so: the extension must never load twice in
    one process (nanobind aborts), and the worker never imports onnx."""
    spec = importlib.util.find_spec("onnx")  # finds the package, does not import it
    where = [os.path.dirname(spec.origin)] if spec is not None and spec.origin else []
    found = importlib.machinery.PathFinder.find_spec("onnx_cpp2py_export", where)
    if "onnx" not in sys.modules and found is not None and found.loader is not None:
        try:
            ext = importlib.util.module_from_spec(found)
            found.loader.exec_module(ext)
            return ext.shape_inference
        except ImportError:  # an onnx build that needs its package: import that
            pass
    import onnx.onnx_cpp2py_export.shape_inference as loaded
    return loaded


# ModelProto{ir_version: 8, graph{node{input: "x", output: "y", op_type: "Relu"}},
# opset_import{version: 17}}, serialized by hand (the worker has no protobuf)
_TINY_MODEL = b'\x08\x08:\x0e\n\x0c\n\x01x\x12\x01y"\x04Relu\x42\x02\x10\x11'


def _warm_up(onnx_c: ModuleType) -> None:
    """One inference in the worker itself: onnx builds its operator-schema tables on first
    use (~10 ms), and every forked child inherits them instead of building them again."""
    with contextlib.suppress(Exception):
        onnx_c.infer_shapes(_TINY_MODEL, False, False, True)


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, looked up once in the worker (a lookup in each forked child cost
    ~0.5 ms of copy-on-write faults); None where there is none (not Linux)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _die_with_parent() -> None:
    prctl = _prctl()
    if prctl is not None:  # (elsewhere stdin's EOF ends it)
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _read(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        b = os.read(fd, min(left, 1 << 24))
        if not b:
            return b""
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def lower_address_space(limit: int) -> None:
    """Lower this process's address-space limit (``RLIMIT_AS``) to ``limit`` bytes; never
    above the hard limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _run(infer: Callable[[bytes], bytes], limit: int, data: bytes) -> tuple[int, bytes]:
    """``infer(data)`` under an address-space limit of ``limit`` bytes (0: none), as a
    status and payload."""
    if limit:
        lower_address_space(limit)
    try:
        return OK, infer(data)
    except MemoryError as e:
        return NO_MEMORY, str(e).encode(errors="replace")
    except Exception as e:  # inference is best effort: the caller decides
        return FAILED, f"{type(e).__name__}: {e}".encode(errors="replace")


_ACK = b"+"  # a child's first byte: it has read a whole request


def _spawn(infer: Callable[[bytes], bytes], warm: Callable[[], object] | None,
           fin: int) -> tuple[int, int]:
    """Fork the child that answers the next request, before it arrives (the fork and the
    copy-on-write faults of a first inference, ``warm()``, are then not a request's time):
    it reads the request from ``fin`` itself, acknowledges it (:data:`_ACK`), runs it under
    its limit and writes status, length and payload to the pipe returned with its pid."""
    r, w = os.pipe()
    _widen(w)
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            os.close(r)
            _die_with_parent()
            if warm is not None:
                with contextlib.suppress(Exception):
                    warm()
            head = _read(fin, 16)
            if len(head) == 16:
                limit, n = struct.unpack("<QQ", head)
                data = _read(fin, n)
                if len(data) == n:
                    _write(w, _ACK)
                    status, payload = _run(infer, limit, data)
                    _write(w, struct.pack("<BQ", status, len(payload)) + payload)
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


def _answer(r: int, pid: int) -> tuple[int, bytes] | None:
    """The answer of the child ``pid`` (reaped here) from its pipe ``r``; None when it ended
    before it had read a whole request (stdin closed: the worker's end)."""
    try:
        if _read(r, 1) != _ACK:
            return None
        head = _read(r, 9)
        if head:
            status, n = struct.unpack("<BQ", head)
            payload = _read(r, n)
            if len(payload) == n:
                return status, payload  # (reaped by the caller, after it answered)
    finally:
        os.close(r)
    _, st = os.waitpid(pid, 0)
    if os.WIFSIGNALED(st):
        sig = os.WTERMSIG(st)
        return (NO_MEMORY if sig == signal.SIGKILL else DIED), f"signal {sig}".encode()
    return DIED, f"exit status {os.waitstatus_to_exitcode(st)}".encode()


def _widen(fd: int) -> None:
    """A pipe's buffer as large as an unprivileged process may make it (1 MiB by default,
    not 64 KiB): an inferred model crosses it in a few wake-ups of the reader, not dozens."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the default size
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)


def serve(infer: Callable[[bytes], bytes], warm: Callable[[], object] | None = None) -> None:
    """Answer requests on stdin with ``infer`` run in a forked, bounded child each (see the
    module's text); :data:`READY` first. ``warm()``: run in each child before its request
    arrives (a first inference's copy-on-write faults; its failures are ignored)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides (it kills the group)
    # The answers go on a copy of stdout; stdout itself becomes stderr, so nothing the
    # inference prints (a library's print) can land inside an answer.
    fin, fout = sys.stdin.fileno(), os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    _widen(fin)
    _widen(fout)
    _write(fout, READY)
    while True:
        pid, r = _spawn(infer, warm, fin)
        answer = _answer(r, pid)
        if answer is None:
            return
        status, payload = answer
        _write(fout, struct.pack("<BQ", status, len(payload)) + payload)
        with contextlib.suppress(ChildProcessError):  # (reaped already when it failed)
            os.waitpid(pid, 0)


def main() -> None:
    _die_with_parent()
    onnx_c = _load_onnx_c()
    _warm_up(onnx_c)
    # check_type, strict_mode, data_prop: as onnx.shape_inference.infer_shapes(...,
    # check_type=False, strict_mode=False, data_prop=True), minus a parse and a
    # serialization of the model
    serve(lambda data: onnx_c.infer_shapes(data, False, False, True),
          lambda: _warm_up(onnx_c))


if __name__ == "__main__":
    main()
