"""Shape ranges (issue 36, item 1): ``--dim seq=1..96`` plans once for every value of each
range (at its top, memory's worst case), records the ranges in the model, and the library's
``Guard`` refuses a run outside them with one clear message. Runs inside are compared with
the unmodified model at both ends and the middle (bit-exact: pre-packing off, ORT's ``basic``
level, as ``verify`` does; at ``all`` within 1e-6 on the KV decoder, see test_other_shapes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from native_util import hnode, make_model, session
from onnx import TensorProto, helper

from ho_onnx import contract, session_options
from ho_onnx.cli import main
from ho_onnx.errors import UnboundDimError
from ho_onnx.graph.dims import bind_ranges, ranged_inputs
from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.target.ort.verify import verify
from models.decoder import build_decoder

pytestmark = pytest.mark.usefixtures("no_debug_hooks")

ALL = OffloadOptions(min_bytes=1024, min_gap=1, prefetch_distance=2)


def _decoder(tmp: Path, **kw) -> Path:
    path = tmp / "dec.onnx"
    build_decoder(path, external_data=True, **kw)
    return path


def _guards(path: Path) -> list[onnx.NodeProto]:
    m = onnx.load(str(path), load_external_data=False)
    return [n for n in m.graph.node if n.domain == contract.DOMAIN and n.op_type == "Guard"]


def _run(path: Path, feeds: dict) -> list:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    sess = ort.InferenceSession(str(path), session_options(path, base=so),
                                providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def test_one_plan_for_a_range_runs_at_both_ends_and_refuses_outside(tmp_path):
    src = _decoder(tmp_path, layers=2, hidden=64, heads=4, max_positions=128)
    out = tmp_path / "dec.ho.onnx"
    r = optimize(src, out, ALL, {}, dim_ranges={"batch": (1, 4), "seq": (1, 96)})
    assert r.choice.activations and r.choice.weights
    # planned at the top of each range, and the ranges recorded
    meta = {p.key: p.value for p in onnx.load(str(out), load_external_data=False)
            .metadata_props}
    assert meta["ho_onnx.dim_ranges"] == "batch=1..4,seq=1..96"
    assert meta["ho_onnx.dims"] == "batch=4,seq=96"
    (g,) = _guards(out)
    assert g.input[0] == "input_ids"
    for dims in ({"batch": 1, "seq": 1}, {"batch": 2, "seq": 48}, {"batch": 4, "seq": 96}):
        rep = verify(src, out, dims=dims, opt_level="basic", isolate=False)
        assert rep.exact, (dims, rep.outputs)
    for shape, dim, value in (((1, 97), "seq", 97), ((5, 8), "batch", 5)):
        ids = np.zeros(shape, np.int64)
        with pytest.raises(Exception, match=rf"input 'input_ids' dim '{dim}' is {value}, "
                                            rf"outside the range 1\.\.\d+ this model was "
                                            rf"planned for.*--dim {dim}=LO\.\.HI"):
            _run(out, {"input_ids": ids})


def test_kv_decoder_range_serves_prefill_and_decode(tmp_path):
    """One folder for the prefill and the decode steps: past 0..48, seq 1..16."""
    src = _decoder(tmp_path, layers=2, hidden=32, heads=2, max_positions=64, kv_cache=True)
    out = tmp_path / "dec.ho.onnx"
    optimize(src, out, ALL, {"batch": 1}, dim_ranges={"seq": (1, 16), "past": (0, 48)})
    guarded = {g.input[0] for g in _guards(out)}
    assert "input_ids" in guarded and any("past" in n for n in guarded)
    for dims in ({"batch": 1, "seq": 16, "past": 0}, {"batch": 1, "seq": 1, "past": 48},
                 {"batch": 1, "seq": 1, "past": 20}):
        rep = verify(src, out, dims=dims, opt_level="basic", isolate=False)
        assert rep.exact, (dims, rep.outputs)
    with pytest.raises(Exception, match=r"dim 'past' is 49, outside the range 0\.\.48"):
        verify(src, out, dims={"batch": 1, "seq": 1, "past": 49}, opt_level="basic",
               isolate=False)


def test_nothing_offloaded_records_the_ranges_without_guards(tmp_path):
    src = _decoder(tmp_path)
    out = tmp_path / "dec.ho.onnx"
    lines: list[str] = []
    optimize(src, out, OffloadOptions(weights=False, activations=False), {"batch": 1},
             dim_ranges={"seq": (1, 32)}, log=lines.append)
    assert not _guards(out)
    assert any("recorded, not enforced" in line for line in lines), lines


def test_plan_gives_the_peak_at_both_ends_of_its_ranges(tmp_path):
    """The peak at the bottom is the same choice's, sized there: the unmodified model's
    agrees with a plan made at the bottom itself, and the plan's is below it; at the top the
    plan's own figures."""
    from ho_onnx.rewrite.pipeline import plan_model, range_points

    src = _decoder(tmp_path, layers=2, hidden=64, heads=4, max_positions=128)
    ranges = {"batch": (1, 4), "seq": (2, 96)}
    opts = OffloadOptions(budget=1500 << 10, min_bytes=1024)
    loaded, _, p = plan_model(src, opts, {}, dim_ranges=ranges)
    assert p.choice.activations
    f = range_points(loaded, p.choice, {}, ranges)
    assert list(f) == ["bottom", "top"] and f["bottom"].dims == {"batch": 1, "seq": 2}
    assert (f["top"].unmodified, f["top"].planned) == (p.baseline.peak_bytes,
                                                       p.planned.peak_bytes)
    _, _, at_bottom = plan_model(src, OffloadOptions(budget=1 << 40), {"batch": 1, "seq": 2})
    assert f["bottom"].unmodified == at_bottom.baseline.peak_bytes
    assert 0 < f["bottom"].planned < f["bottom"].unmodified < f["top"].unmodified
    assert f["bottom"].seconds is None


def test_named_points_time_the_plan_and_are_recorded(tmp_path):
    """Named points of the ranges (issue 36, TensorRT's optimization profiles): the plan is
    timed at the first one (its predicted time there is the plan's own), each point's peak
    and time lie between the ends', and optimize records them for ``inspect``."""
    from ho_onnx import CostSource
    from ho_onnx.report.inspect import format_summary, summarize
    from ho_onnx.rewrite.pipeline import optimize, plan_model, range_points

    src = _decoder(tmp_path, layers=2, hidden=64, heads=4, max_positions=128)
    ranges = {"batch": (1, 1), "seq": (1, 96)}
    points = {"mid": {"seq": 48}}
    opts = OffloadOptions(budget=1500 << 10, min_bytes=1024)
    costs = CostSource("h100")
    loaded, _, p = plan_model(src, opts, {}, costs, dim_ranges=ranges, dim_points=points)
    assert "timed at the bottom of the ranges (batch=1,seq=48" in p.costs.description
    f = range_points(loaded, p.choice, {}, ranges, points=points, costs=costs)
    assert list(f) == ["bottom", "mid", "top"] and f["mid"].dims == {"batch": 1, "seq": 48}
    assert f["mid"].seconds == pytest.approx(p.planned.total_s)
    assert f["bottom"].seconds < f["mid"].seconds < f["top"].seconds
    assert f["bottom"].unmodified < f["mid"].unmodified < f["top"].unmodified
    # the same plan timed at the bottom (no points) differs: the point decided the windows
    _, _, q = plan_model(src, opts, {}, costs, dim_ranges=ranges)
    assert "seq=1:" in q.costs.description
    out = tmp_path / "o.onnx"
    r = optimize(src, out, opts, {}, costs=costs, dim_ranges=ranges, dim_points=points)
    assert list(r.points) == ["bottom", "mid", "top"]
    text = format_summary(summarize(out))
    assert "range_points=bottom (batch=1,seq=1): peak" in text and "mid (batch=1,seq=48)" in text


@pytest.mark.parametrize("points, match", [
    ({"p": {"seq": 200}}, r"point 'p': seq=200 is outside its range 1\.\.96"),
    ({"p": {"past": 3}}, r"point 'p': 'past' has no range \(ranged: batch, seq\)"),
    ({"bad name": {"seq": 2}}, r"point 'bad name': a name is"),
])
def test_bad_points_are_refused(tmp_path, points, match):
    from ho_onnx.rewrite.pipeline import plan_model

    src = _decoder(tmp_path)
    with pytest.raises(UnboundDimError, match=match):
        plan_model(src, OffloadOptions(budget=1 << 30), {}, dim_ranges={
            "batch": (1, 1), "seq": (1, 96)}, dim_points=points)
    with pytest.raises(UnboundDimError, match="points of ranges"):
        plan_model(src, OffloadOptions(budget=1 << 30), {"batch": 1, "seq": 4},
                   dim_points={"p": {"seq": 2}})


def test_range_checks():
    assert bind_ranges({"batch": 1}, {"seq": (1, 8)}) == {"batch": 1, "seq": 8}
    for bad, match in (({"seq": (5, 2)}, "not a range"), ({"seq": (-1, 2)}, "not a range"),
                       ({"seq": (1.5, 2)}, "two integers"), ({"seq": (1,)}, "two integers"),
                       ({"": (1, 2)}, "not a dim name")):
        with pytest.raises(UnboundDimError, match=match):
            bind_ranges({}, bad)
    with pytest.raises(UnboundDimError, match=r"given as 4 and as the range 1\.\.8"):
        bind_ranges({"seq": 4}, {"seq": (1, 8)})
    model = ir.from_proto(build_decoder())
    assert ranged_inputs(model, {"seq": (1, 8)}) == {"input_ids": [(1, "seq")]}
    with pytest.raises(UnboundDimError, match=r"'sq': no graph input has this dim.*seq"):
        ranged_inputs(model, {"sq": (1, 8)})


def test_cli_ranges(tmp_path):
    src = _decoder(tmp_path)
    runner = CliRunner()
    out = tmp_path / "o.onnx"
    r = runner.invoke(main, ["optimize", str(src), str(out), "--offload", "all", "--min-bytes",
                             "1KiB", "--dim", "batch=1", "--dim", "seq=1..64"])
    assert r.exit_code == 0, r.output
    assert "planned for seq=1..64" in r.output and _guards(out)
    r = runner.invoke(main, ["plan", str(src), "--budget", "1GiB", "--dim", "batch=1",
                             "--dim", "seq=1..64"])
    assert r.exit_code == 0, r.output
    assert ("ranges: seq=1..64, planned at the top of each, timed at the bottom; bottom "
            "(seq=1): peak") in r.output
    r = runner.invoke(main, ["plan", str(src), "--budget", "1GiB", "--dim", "batch=1",
                             "--dim", "seq=1..64", "--point", "decode:seq=1",
                             "--point", "prefill:seq=32", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert list(doc["range_points"]) == ["bottom", "decode", "prefill", "top"]
    assert doc["range_points"]["prefill"]["dims"] == {"seq": 32}
    assert doc["range_points"]["prefill"]["seconds"] > doc["range_points"]["decode"]["seconds"]
    for args, match in (
            (["--dim", "seq=9..2"], "is not a range"),
            (["--dim", "seq=1..8", "--point", "p:seq=9"], "seq=9 is outside its range 1..8"),
            (["--dim", "seq=1..8", "--point", "p"], "expected NAME:DIM=N"),
            (["--dim", "seq=1..8", "--point", "p:seq=x"], "expected NAME=INTEGER"),
            (["--dim", "seq=1..x"], "expected NAME=LO..HI"),
            (["--dim", "seq=1..8", "--dim", "seq=4"], "given twice"),
            (["--dim", "sq=1..8"], "no graph input has this dim")):
        r = runner.invoke(main, ["optimize", str(src), str(tmp_path / "x.onnx"), "--dim",
                                 "batch=1", *args])
        assert r.exit_code == 2, (args, r.output)
        assert match in r.output and r.output.count("rror") == 1, (args, r.output)
        assert not (tmp_path / "x.onnx").exists()
    r = runner.invoke(main, ["verify", str(src), str(out), "--dim", "batch=1", "--dim",
                             "seq=1..8"])
    assert r.exit_code == 2 and "this command runs at one point" in r.output, r.output


# ---- the Guard op against hostile attributes (the library's own checks) -----------------

def _guard_model(**attrs) -> onnx.ModelProto:
    nodes = [hnode("Guard", ["x"], ["g"], **attrs), helper.make_node("Identity", ["x"], ["y"])]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4]),
                       helper.make_tensor_value_info("g", TensorProto.FLOAT, [0])])


@pytest.mark.parametrize(("attrs", "match"), [
    ({"axes": [0], "lo": [1], "hi": [8]}, "are required"),
    ({"axes": [0, 1], "lo": [1], "hi": [8], "dims": "n"}, "one entry per dim"),
    ({"axes": [0], "lo": [9], "hi": [8], "dims": "n"}, "is not a range"),
    ({"axes": [-1], "lo": [1], "hi": [8], "dims": "n"}, "is not a range"),
])
def test_a_guard_with_bad_attributes_fails_session_creation(tmp_path, attrs, match):
    path = tmp_path / "m.onnx"
    onnx.save(_guard_model(**attrs), str(path))
    with pytest.raises(Exception, match=match):
        session(path)


def test_a_guard_checks_each_dim(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_guard_model(axes=[0, 1], lo=[1, 4], hi=[8, 4], dims="n\nw", input="x"),
              str(path))
    sess = session(path)
    x = np.ones((8, 4), np.float32)
    y, g = sess.run(None, {"x": x})
    np.testing.assert_array_equal(y, x)
    assert g.shape == (0,)
    with pytest.raises(Exception, match=r"input 'x' dim 'n' is 9, outside the range 1\.\.8"):
        sess.run(None, {"x": np.ones((9, 4), np.float32)})
    with pytest.raises(Exception, match=r"dim 'n' is 0, outside the range 1\.\.8"):
        sess.run(None, {"x": np.ones((0, 4), np.float32)})
    onnx.save(_guard_model(axes=[2], lo=[1], hi=[8], dims="z", input="x"), str(path))
    with pytest.raises(Exception, match=r"input 'x' has 2 dims: no axis 2"):
        session(path).run(None, {"x": x})


def test_a_range_plan_is_timed_where_compute_is_least(tmp_path):
    """Memory is planned at the top of the ranges, times (so the prefetch windows) at the
    bottom: a decode step, where the compute that hides a copy is least. Simulated with the
    bottom's times, such a plan stalls no more than the same budget planned at the top."""
    from ho_onnx.cost.source import CostSource
    from ho_onnx.rewrite.pipeline import plan_model
    from ho_onnx.schedule.simulate import simulate

    src = _decoder(tmp_path, layers=4, hidden=256, heads=4, max_positions=4096, kv_cache=True)
    ranges = {"seq": (1, 512), "past": (0, 2048)}
    top = {"batch": 1, "seq": 512, "past": 2048}
    cs = CostSource("h100")
    peak = plan_model(src, OffloadOptions(budget=1 << 40), {"batch": 1}, cs,
                      dim_ranges=ranges)[2].baseline.peak_bytes
    opts = OffloadOptions(budget=int(peak * 0.8))
    _, a_r, ranged = plan_model(src, opts, {"batch": 1}, cs, dim_ranges=ranges)
    _, a_t, at_top = plan_model(src, opts, top, cs)
    assert ranged.costs is not None and "timed at the bottom of the ranges (batch=1,past=0," \
        "seq=1" in ranged.costs.description
    assert ranged.planned.peak_bytes <= opts.budget  # memory still planned at the top
    c = ranged.costs
    stall = {name: simulate(a, p.choice, c.compute_s, c.transfer_time, top).stall_s
             for name, a, p in (("ranged", a_r, ranged), ("top", a_t, at_top))}
    assert stall["ranged"] < stall["top"], stall
