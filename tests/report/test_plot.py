"""``ho_onnx.report.plot.plot_timeline``: a readable PNG of a plan (matplotlib is optional)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from graphs import two_weights_model

from ho_onnx.cost.source import CostSource
from ho_onnx.errors import HoOnnxError
from ho_onnx.graph.analyse import analyse
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.schedule.planner import Plan, plan
from ho_onnx.schedule.simulate import simulate
from ho_onnx.schedule.types import OffloadChoice, WeightOffload
from models.decoder import build_decoder

DIMS = {"batch": 1, "seq": 64}


def _read_png(path):
    mpimg = pytest.importorskip("matplotlib.image")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(str(path))
    assert img.ndim == 3 and img.shape[2] in (3, 4)
    h, w = img.shape[:2]
    assert 500 <= h <= 2000 and 800 <= w <= 3000, img.shape
    rgb = img[..., :3]
    ink = (rgb.sum(axis=2) < 2.7).mean()  # share of pixels that are not (near) white
    assert 0.02 < ink < 0.6, ink
    assert rgb.std() > 0.05
    return rgb


def _decoder_plan(frac: float):
    a = analyse(build_decoder(layers=3, hidden=128, heads=4), DIMS)
    costs = CostSource().cost_model(a, DIMS)
    base = simulate(a, None, costs.compute_s, costs.transfer_time, DIMS)
    p = plan(a, OffloadOptions(budget=int(base.peak_bytes * frac), min_bytes=0), costs, DIMS)
    return a, p


def test_plot_of_a_decoder_plan(tmp_path):
    pytest.importorskip("matplotlib")
    from ho_onnx.report.plot import plot_timeline

    a, p = _decoder_plan(0.5)
    assert p.planned.transfers and p.planned.peak_bytes < p.baseline.peak_bytes
    out = tmp_path / "sub" / "timeline.png"  # the folder is created
    plot_timeline(p, [n.name for n in a.nodes], out)
    rgb = _read_png(out)
    # the planned memory line is drawn in matplotlib's default blue (#1f77b4)
    blue = (np.abs(rgb - np.array([0x1F, 0x77, 0xB4]) / 255).max(axis=2) < 0.05).mean()
    assert blue > 1e-4


def test_plot_when_nothing_moves(tmp_path):
    pytest.importorskip("matplotlib")
    from ho_onnx.report.plot import plot_timeline

    a, p = _decoder_plan(2.0)  # (room for ORT's arena too: nothing moves)
    assert not p.planned.transfers
    out = tmp_path / "fits.png"
    plot_timeline(p, [n.name for n in a.nodes], out)
    _read_png(out)


def test_fifo_queue_is_drawn(tmp_path):
    """Two reloads issued together on one channel: the second waits for the first (the
    queue line from its issue to its start) and the compute stalls for both."""
    pytest.importorskip("matplotlib")
    from ho_onnx.report.plot import _issue_times, plot_timeline

    m = two_weights_model()
    a = analyse(m)
    cs = np.full(4, 1e-3)
    nbytes = 512 * 512 * 4

    def tt(n, direction):
        return n / (nbytes / 3e-3)

    choice = OffloadChoice(weights=[WeightOffload("W1", nbytes, (2,), (0,)),
                                    WeightOffload("W2", nbytes, (3,), (0,))])
    base, after = simulate(a, None, cs, tt), simulate(a, choice, cs, tt)
    p = Plan(choice, OffloadOptions(budget=after.peak_bytes), base, after, after.peak_bytes,
             2 * nbytes)
    w1, w2 = after.transfers
    issued = _issue_times(after)
    assert issued[id(w1)] == 0 and issued[id(w2)] == 0
    assert w2.start_s == pytest.approx(w1.end_s) and w1.stall_s > 0 and w2.stall_s > 0
    out = tmp_path / "fifo.png"
    plot_timeline(p, [n.name for n in a.nodes], out)
    _read_png(out)


def test_missing_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    from ho_onnx.report.plot import plot_timeline

    a, p = _decoder_plan(1.0)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(HoOnnxError, match="pip install matplotlib"):
        plot_timeline(p, [n.name for n in a.nodes], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_a_format_matplotlib_cannot_write_is_refused_before_planning(tmp_path):
    """Found by hand: ``plan --plot t.txt`` planned, then failed with an unexpected
    ValueError from matplotlib; now one error line before any work, and any format
    matplotlib writes (SVG here) is written."""
    from click.testing import CliRunner

    from ho_onnx.cli import main
    from ho_onnx.report.plot import image_format

    assert image_format("a.PNG") == "png" and image_format("noext") == "png"
    src = tmp_path / "d.onnx"
    build_decoder(src, layers=1, hidden=32, heads=2, vocab=64, external_data=True)
    args = ["plan", str(src), "--budget", "256KiB", "--dim", "batch=1", "--dim", "seq=8"]
    r = CliRunner().invoke(main, [*args, "--plot", str(tmp_path / "t.txt")])
    assert r.exit_code == 2 and "'txt' is no image format matplotlib writes (" in r.stderr
    assert "analysed" not in r.stderr and not (tmp_path / "t.txt").exists(), r.stderr
    r = CliRunner().invoke(main, [*args, "--plot", str(tmp_path / "t.svg")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "t.svg").read_bytes().lstrip().startswith((b"<?xml", b"<svg"))


def test_names_are_drawn_as_text_never_as_math(tmp_path):
    """Found by hand: matplotlib reads a label between two ``$`` as math, and a model's
    name such as ``node$\\bogus$`` failed the plot ("unexpected ValueError: Unknown symbol");
    node and tensor names are now drawn as they are."""
    pytest.importorskip("matplotlib")
    from ho_onnx.report.plot import plot_timeline

    a, p = _decoder_plan(0.5)
    assert p.planned.transfers and len(p.planned.transfers) <= 24  # (labelled)
    for e in p.planned.transfers:
        e.tensor = "w$\\bogus{$" + e.tensor
    out = tmp_path / "names.png"
    plot_timeline(p, [f"node$\\undefined$ {n.name}" for n in a.nodes], out)
    _read_png(out)
