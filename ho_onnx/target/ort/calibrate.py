"""Calibration of the slow tiers' transfer rates on this machine, and on the CPU EP of its
compute rates.

``measure_file_read`` is the disk tier's reference rate: sequential reads of one file in
``block``-byte positional reads, with the page cache bypassed (``O_DIRECT``, into a
page-aligned buffer) so that the number is the device's, not memory's. ``measure_host_copy``
is the host tier's: a large memcpy between two host buffers. Both return bytes per second.
``measure_cpu_compute`` times ONNX Runtime's CPU EP itself (issue 38, honest CPU time: the
``cpu`` preset's modest rates predicted 63.7 ms for a decode step measured at 10.3 ms): a
large MatMul (FLOP/s), chains of one-row MatMuls over 64 MiB of distinct weights (the rate a
decode step reads its weights at, the roofline's memory term, and a fixed cost per MatMul),
a KV cache's Concat and Transpose (the data-movement rates) and a chain of tiny nodes (the
cost of one node).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ...errors import HoOnnxError, Log, quiet
from ...graph.save import free_bytes, new_temp, temporary_files, write_atomic
from ...units import format_bytes

__all__ = ["CalibrationError", "calibrate", "measure_cpu_compute", "measure_file_read",
           "measure_host_copy"]

_ALIGN = 4096


def _write_temp_file(folder: Path, size: int, temps: list[Path]) -> str:
    """A new file of ``size`` bytes in ``folder``, synced and out of the page cache. Its path
    is in ``temps`` before it exists (the caller's :func:`temporary_files` removes it, also
    after a failure or an interruption; found by hand: a write that failed or was
    interrupted left the partial file, and said only "File too large")."""
    if not folder.is_dir():
        raise CalibrationError(f"{str(folder)!r} is not a folder")
    free = free_bytes(folder)

    def refused(why: str) -> CalibrationError:
        return CalibrationError(f"cannot write the {format_bytes(size)} test file in "
                                f"{str(folder)!r}: {why}; pass a smaller --size or another --dir")

    if free is not None and free < size:
        raise refused(f"only {format_bytes(free)} free")
    try:
        fd, path = new_temp(folder, ".ho_onnx_calibrate.", temps)
    except OSError as e:
        raise refused(e.strerror or str(e)) from None
    try:
        chunk = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
        left = size
        while left > 0:
            n = min(left, len(chunk))
            view = memoryview(chunk)[:n]
            while view:
                view = view[os.write(fd, view):]
            left -= n
        os.fsync(fd)
        _drop_cache(fd)
    except OSError as e:
        raise refused(e.strerror or str(e)) from None
    finally:
        os.close(fd)
    return os.fspath(path)


def _drop_cache(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


MIN_FILE_BYTES = 1 << 20  # a smaller file is read before a rate can be timed


class CalibrationError(HoOnnxError, ValueError):
    """A measurement that cannot be made (the file to read is not a file of data)."""


def _open(path: str, direct: bool) -> tuple[int, bool]:
    """(fd, opened with O_DIRECT) of the regular file ``path`` of at least
    :data:`MIN_FILE_BYTES`; falls back to buffered when the file system refuses O_DIRECT.
    Opened without blocking (a FIFO would wait for a writer forever), then checked."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
    try:
        try:
            if not (direct and hasattr(os, "O_DIRECT")):
                raise OSError
            fd, is_direct = os.open(path, flags | os.O_DIRECT), True
        except OSError:
            fd, is_direct = os.open(path, flags), False
    except OSError as e:
        raise CalibrationError(f"cannot read {path!r}: {e.strerror or e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size < MIN_FILE_BYTES:
        os.close(fd)
        what = "is not a regular file" if not stat.S_ISREG(st.st_mode) else (
            f"has {st.st_size} bytes")
        raise CalibrationError(f"{path!r} {what}: the disk rate needs a file of at least "
                               f"{format_bytes(MIN_FILE_BYTES)} (a model's data file, or no "
                               "--file: a temporary one)")
    if hasattr(os, "O_NONBLOCK"):
        os.set_blocking(fd, True)
    return fd, is_direct


def measure_file_read(path: str | os.PathLike[str] | None = None, block: int = 8 << 20,
                      direct: bool = True, *, threads: int = 1, size: int = 1 << 30,
                      max_bytes: int | None = None, directory: str | None = None) -> float:
    """Sequential read rate of ``path`` in bytes/s.

    ``block``: bytes per read (rounded up to 4096). ``direct``: bypass the page cache with
    ``O_DIRECT`` (falls back to buffered reads after dropping the file's cached pages when
    the file system refuses it). ``threads``: readers taking the file's blocks in turn (one
    read in flight each, like the engine's I/O threads; 1 = plain sequential reads). Without
    ``path`` a temporary file of ``size`` bytes is written (in ``directory``, default the
    system's temp folder), measured and removed. ``max_bytes`` limits how much is read.
    """
    block = max(_ALIGN, (block + _ALIGN - 1) // _ALIGN * _ALIGN)
    threads = max(1, threads)
    if path is not None:
        return _read_rate(os.fspath(path), block, direct, threads, max_bytes)
    folder = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    with temporary_files(folder) as temps:  # the test file is removed whatever happens
        return _read_rate(_write_temp_file(folder, size, temps), block, direct, threads,
                          max_bytes)


def _read_rate(fpath: str, block: int, direct: bool, threads: int,
               max_bytes: int | None) -> float:
    """Bytes/s of ``threads`` readers taking ``fpath``'s ``block``-byte blocks in turn."""
    fd, is_direct = _open(fpath, direct)
    try:
        if not is_direct:
            _drop_cache(fd)
        total = os.fstat(fd).st_size
        if max_bytes is not None:
            total = min(total, max_bytes)
        if total <= 0:
            raise CalibrationError(f"{fpath!r}: nothing to read")
        counts = [0] * threads

        def reader(k: int) -> None:
            buf = mmap.mmap(-1, block)  # page aligned, as O_DIRECT needs
            view = memoryview(buf)
            try:
                off = k * block
                while off < total:
                    n = os.preadv(fd, [view[:min(block, _round_up(total - off))]], off)
                    if n <= 0:
                        break
                    counts[k] += min(n, total - off)
                    off += threads * block
            finally:
                view.release()
                buf.close()

        t0 = time.perf_counter()
        if threads == 1:
            reader(0)
        else:
            pool = [threading.Thread(target=reader, args=(k,)) for k in range(threads)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
    return sum(counts) / seconds


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def measure_host_copy(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Host memcpy rate in bytes/s (best of ``repeats`` copies of ``nbytes``)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def _best_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], threads: int,
              repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` runs of ``model`` (an onnx ModelProto) on ORT's
    CPU EP with ``threads`` intra-op threads (0: ORT's default, as a session of the planned
    model would have), after one warm-up run."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    s.run(None, feeds)
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        s.run(None, feeds)
        best = min(best, time.perf_counter() - t0)
    return best


def _graph(nodes: list[onnx.NodeProto], inputs: dict[str, list[int]], output: str,
           inits: Sequence[onnx.TensorProto] = ()) -> onnx.ModelProto:
    """A float graph of ``nodes`` with ``inputs`` (name: shape) and one ``output``."""
    g = helper.make_graph(nodes, "calibrate",
                          [helper.make_tensor_value_info(k, TensorProto.FLOAT, v)
                           for k, v in inputs.items()],
                          [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
                          list(inits))
    # The lowest IR version for the opset: an onnx newer than the runtime writes its own (14,
    # which onnxruntime 1.31 refuses: found on a GPU machine, stop 48).
    opsets = [helper.make_opsetid("", 17)]
    return helper.make_model(g, opset_imports=opsets,
                             ir_version=helper.find_min_ir_version_for(opsets))


def _matmul_rates(rng: np.random.Generator, threads: int, repeats: int) -> dict[str, float]:
    """``mem_bw`` and ``matmul_overhead_s``: a decode step's MatMuls, as chains of one-row
    MatMuls over 64 MiB of distinct weights (beyond a last-level cache), in 64 pieces of
    1 MiB and in 4 of 16 MiB; their times fit a fixed cost per MatMul (ORT's thread-pool
    dispatch) plus the bytes at the weight-read rate."""
    def matmuls(k: int, count: int) -> float:
        nodes = [helper.make_node("MatMul", [f"x{i}", f"w{i}"], [f"x{i + 1}"])
                 for i in range(count)]
        inits = [numpy_helper.from_array(rng.random((k, k), np.float32), f"w{i}")
                 for i in range(count)]
        return _best_run(_graph(nodes, {"x0": [1, k]}, f"x{count}", inits),
                         {"x0": rng.random((1, k), np.float32)}, threads, repeats)

    many, few = matmuls(512, 64), matmuls(2048, 4)
    overhead = max(0.0, (many - few) / (64 - 4))
    return {"mem_bw": 64.0 * 2**20 / max(few - 4 * overhead, few / 2),
            "matmul_overhead_s": float(overhead)}


def _movement_rates(rng: np.random.Generator, threads: int, repeats: int
                    ) -> dict[str, float]:
    """``move_bw`` and ``transpose_bw``: a decode step's KV cache at three lengths (1, 4 and
    8 MiB a tensor) concatenated with a new position, and transposed as attention's K^T;
    bytes read and written over the seconds of all three (a small cache's fixed costs weigh
    as much as a step sees them)."""
    new = [1, 8, 1, 64]
    moved = transposed = cat_s = tr_s = 0.0
    for length in (512, 2048, 4096):
        past = [1, 8, length, 64]
        p = rng.random(past, np.float32)
        cat = _graph([helper.make_node("Concat", ["p", "n"], ["c"], axis=2)],
                     {"p": past, "n": new}, "c")
        cat_s += _best_run(cat, {"p": p, "n": rng.random(new, np.float32)}, threads, repeats)
        moved += 4.0 * 2 * (np.prod(past) + np.prod(new))
        tr = _graph([helper.make_node("Transpose", ["p"], ["c"], perm=[0, 1, 3, 2])],
                    {"p": past}, "c")
        tr_s += _best_run(tr, {"p": p}, threads, repeats)
        transposed += 4.0 * 2 * np.prod(past)
    return {"move_bw": float(moved / cat_s), "transpose_bw": float(transposed / tr_s)}


def measure_cpu_compute(threads: int = 0, repeats: int = 10) -> dict[str, float]:
    """ONNX Runtime's CPU EP rates as machine fields: ``peak_flops`` (a 512x1024x1024 fp32
    MatMul; ``efficiency`` 1: the rate is what ORT reaches), ``mem_bw`` and
    ``matmul_overhead_s`` (:func:`_matmul_rates`), ``move_bw`` and ``transpose_bw``
    (:func:`_movement_rates`) and ``launch_overhead_s`` (per node of a chain of 200 tiny
    Adds, less a chain of one)."""
    rng = np.random.default_rng(0)
    m, k, n = 512, 1024, 1024
    mm = _graph([helper.make_node("MatMul", ["a", "b"], ["c"])], {"a": [m, k], "b": [k, n]}, "c")
    feeds = {"a": rng.random((m, k), np.float32), "b": rng.random((k, n), np.float32)}
    flops = 2.0 * m * k * n / _best_run(mm, feeds, threads, repeats)
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])

    def chain(length: int) -> float:
        nodes = [helper.make_node("Add", [f"x{i}", "one"], [f"x{i + 1}"]) for i in range(length)]
        return _best_run(_graph(nodes, {"x0": [16]}, f"x{length}", [one]),
                         {"x0": np.ones(16, np.float32)}, threads, repeats)

    per_node = max(0.0, (chain(200) - chain(1)) / 199)
    return {"peak_flops": flops, "efficiency": 1.0, "launch_overhead_s": per_node,
            **_matmul_rates(rng, threads, repeats), **_movement_rates(rng, threads, repeats)}


def calibrate(out_json: str | os.PathLike[str] | None = None, *, base: str = "cpu",
              file: str | os.PathLike[str] | None = None, size: int = 1 << 30,
              directory: str | None = None, threads: int = 2,
              log: Log | None = None) -> dict[str, object]:
    """Measure this machine's transfer rates and write a machine file for the planner.

    ``h2d_bw``/``d2h_bw``: pinned host<->device copies when the library has CUDA and a GPU is
    present, else the host memcpy rate (the CPU EP's "transfers" are copies between ORT's
    buffers and the library's host memory). ``disk_bw``: O_DIRECT sequential reads with
    ``threads`` readers (as the engine's disk channel) of ``file``, or of a temporary file of
    ``size`` bytes in ``directory``. The file merges onto preset ``base`` when loaded.
    """
    say = log or quiet
    result: dict[str, object] = {"base": base, "name": f"{base}+calibrated"}
    # The disk first: a bad --file, --dir or --size is refused before anything else is
    # measured (found by hand: after the copies were).
    say(f"measuring disk reads ({threads} O_DIRECT readers)")
    result["disk_bw"] = measure_file_read(file, threads=threads, size=size, directory=directory)
    result["disk_source"] = os.fspath(file) if file else f"temporary file of {size} bytes"
    from . import runtime

    ops = runtime._ops()
    gpu = getattr(ops, "cuda_calibrate", None)
    if gpu is not None and ops.cuda_device_count() > 0:
        say("measuring pinned host<->device copies")
        r = gpu(256 << 20)
        result.update({"h2d_bw": float(r["h2d_bw"]), "d2h_bw": float(r["d2h_bw"]),
                       "h2d_source": "cudaMemcpyAsync, pinned"})
        say("measuring ONNX Runtime's CPU EP (the host's rates: experts computed there)")
        cpu = measure_cpu_compute()
        result.update({"host_flops": cpu["peak_flops"], "host_mem_bw": cpu["mem_bw"]})
    else:
        say("measuring host memcpy (no CUDA device: the CPU EP's transfers are host copies)")
        bw = measure_host_copy()
        result.update({"h2d_bw": bw, "d2h_bw": bw, "h2d_source": "host memcpy"})
        if base == "cpu":  # (a GPU preset's compute is the GPU's, not this CPU's)
            say("measuring ONNX Runtime's CPU EP: a MatMul, a one-row MatMul, a cache Concat, "
                "a node chain")
            result.update(measure_cpu_compute())
            result["compute_source"] = "onnxruntime CPU EP, default threads"
    if out_json is not None:
        import json

        write_atomic(out_json, json.dumps(result, indent=2).encode())
    return result
