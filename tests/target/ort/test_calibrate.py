"""The disk measurement's test file (``calibrate.measure_file_read`` without a file): written
in the folder asked for, measured, and removed whatever happens (found by hand: a write that
failed, e.g. past ``ulimit -f``, or was interrupted, left the partial file behind and said
only "File too large"); refused in words before writing when it cannot fit."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from ho_onnx.target.ort import calibrate


class _Terminated(BaseException):
    """As the CLI's SIGTERM: a BaseException of its own, so that clean-ups run."""


def test_the_test_file_is_measured_and_removed(tmp_path: Path, monkeypatch):
    seen: list[tuple[str, int]] = []
    real = calibrate._read_rate

    def read_rate(fpath: str, *args) -> float:
        seen.append((fpath, os.stat(fpath).st_size))
        return real(fpath, *args)

    monkeypatch.setattr(calibrate, "_read_rate", read_rate)
    rate = calibrate.measure_file_read(size=2 << 20, directory=str(tmp_path), direct=False)
    assert rate > 0
    assert len(seen) == 1 and Path(seen[0][0]).parent == tmp_path  # in the folder asked
    assert seen[0][1] == 2 << 20
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("failure", ["full", "interrupt", "sigterm"])
def test_a_failed_or_interrupted_write_leaves_nothing(tmp_path: Path, monkeypatch, failure):
    """The write fails (a full disk) or is interrupted (Ctrl-C; the CLI's SIGTERM is an
    exception of its own) after the first chunk: the partial file is removed."""
    real_write, writes = os.write, []

    def write(fd: int, data) -> int:
        if writes:
            raise {"full": OSError(errno.ENOSPC, "No space left on device"),
                   "interrupt": KeyboardInterrupt(), "sigterm": _Terminated()}[failure]
        writes.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(calibrate.os, "write", write)
    expected = calibrate.CalibrationError if failure == "full" else (KeyboardInterrupt,
                                                                     _Terminated)
    with pytest.raises(expected) as e:
        calibrate.measure_file_read(size=64 << 20, directory=str(tmp_path))
    assert writes  # (the file existed and had bytes when the failure came)
    assert list(tmp_path.iterdir()) == []
    if failure == "full":
        assert str(e.value) == (f"cannot write the 64.00 MiB test file in {str(tmp_path)!r}: "
                                "No space left on device; pass a smaller --size or another "
                                "--dir")


def test_a_file_that_cannot_fit_is_refused_before_writing(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(calibrate, "free_bytes", lambda folder: 1 << 20)
    with pytest.raises(calibrate.CalibrationError) as e:
        calibrate.measure_file_read(size=2 << 20, directory=str(tmp_path))
    assert "only 1.00 MiB free; pass a smaller --size or another --dir" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_a_missing_folder_is_refused_not_made(tmp_path: Path):
    with pytest.raises(calibrate.CalibrationError, match="is not a folder"):
        calibrate.measure_file_read(size=1 << 20, directory=str(tmp_path / "no" / "such"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad", ["file", "dir"])
def test_a_bad_file_or_folder_is_refused_before_anything_is_measured(tmp_path: Path, bad):
    """Found by hand: ``calibrate --file`` of a small file measured the copies first."""
    said: list[str] = []
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 100)
    kw = {"file": str(small)} if bad == "file" else {"directory": str(tmp_path / "none")}
    with pytest.raises(calibrate.CalibrationError):
        calibrate.calibrate(None, log=said.append, **kw)
    assert not any("copies" in s or "memcpy" in s for s in said), said


@pytest.mark.parametrize("base", ["cpu", "h100"])
def test_cpu_compute_rates_are_measured_for_the_cpu_preset_only(tmp_path: Path, base):
    """On the CPU preset ``calibrate`` also measures ORT's CPU EP (issue 38, honest CPU
    time): FLOP/s, the weight-read rate of a one-row MatMul and the cost of a node, as machine
    fields a planner loads; a GPU preset keeps its own compute rates (this CPU's would be
    wrong there)."""
    from ho_onnx.cost.machine import MACHINES, Machine

    out = tmp_path / "m.json"
    r = calibrate.calibrate(out, base=base, size=2 << 20, directory=str(tmp_path))
    m = Machine.from_json(out)
    compute = ("peak_flops", "mem_bw", "launch_overhead_s", "efficiency", "move_bw",
               "transpose_bw", "matmul_overhead_s")
    if base == "h100":
        assert not set(compute) & set(r)
        assert [getattr(m, f) for f in compute] == [getattr(MACHINES["h100"], f)
                                                    for f in compute]
        return
    assert r["efficiency"] == m.efficiency == 1.0
    assert m.peak_flops == r["peak_flops"] and 1e8 < m.peak_flops < 1e14
    assert m.mem_bw == r["mem_bw"] and 1e8 < m.mem_bw < 1e13
    assert m.move_bw == m.movement_bw == r["move_bw"] and 1e8 < m.move_bw < 1e13
    assert m.transpose_bw == m.transposing_bw == r["transpose_bw"] and 1e8 < m.transpose_bw < 1e13
    assert m.matmul_overhead_s == r["matmul_overhead_s"] and 0 <= m.matmul_overhead_s < 1e-3
    assert m.launch_overhead_s == r["launch_overhead_s"] and 0 <= m.launch_overhead_s < 1e-3


def test_the_calibration_graphs_are_readable_by_older_runtimes():
    """Found on a GPU machine (stop 48): an onnx newer than the runtime wrote IR version 14,
    which onnxruntime 1.31 refuses, and `calibrate` failed there. The graphs it builds carry
    their opset's IR version, which every supported onnxruntime (1.18+: IR 10) reads."""
    from onnx import helper

    g = calibrate._graph([helper.make_node("Relu", ["x"], ["y"])], {"x": [2]}, "y")
    assert g.ir_version == 8
