"""Embedding rows gathered (issue 38, item 3): a Gather of an offloaded table's rows becomes
a ``GatherRows`` that copies only the rows its ids select out of the host store, so the
table never enters the fast tier and the floor can fall below it."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from ho_onnx import InferenceSession, contract, counters, reset_counters
from ho_onnx.errors import HoOnnxError
from ho_onnx.rewrite.pipeline import optimize, plan_model
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.target.ort.verify import verify
from models.decoder import build_decoder

pytestmark = pytest.mark.usefixtures("no_debug_hooks")

V, H = 4096, 64  # a 1 MiB table (fp32) next to a 16 KiB weight


def _model(tmp: Path) -> Path:
    model = onnx.parser.parse_model(f"""
<ir_version: 8, opset_import: ["" : 17]>
emb (int64[N] ids) => (float[N, {H}] y) {{
  e = Gather<axis = 0>(E, ids)
  y = MatMul(e, W)
}}""")
    rng = np.random.default_rng(0)
    for name, shape in (("E", (V, H)), ("W", (H, H))):
        model.graph.initializer.append(numpy_helper.from_array(
            rng.standard_normal(shape).astype(np.float32), name))
    path = tmp / "emb.onnx"
    onnx.save(model, path, save_as_external_data=True, location="emb.onnx.data",
              size_threshold=0)
    return path


def _runs(src: Path, out: Path):  # type: ignore[no-untyped-def]
    """Ids (some, negative ones, none) run on both models, outputs equal; yields each with
    the counters of its run. (The counters are the process's: an earlier test's sessions
    still to be collected, with a read ahead staged, would show in them.)"""
    gc.collect()
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    sess = InferenceSession(out)
    for ids in (np.array([3, 0, V - 1, 3], np.int64), np.array([-1, -V], np.int64),
                np.zeros(0, np.int64)):
        reset_counters()
        np.testing.assert_array_equal(sess.run(None, {"ids": ids})[0],
                                      ref.run(None, {"ids": ids})[0])
        yield ids, counters()


def test_only_the_selected_rows_move(tmp_path):
    src, out = _model(tmp_path), tmp_path / "emb.ho.onnx"
    r = optimize(src, out, OffloadOptions(activations=False, min_bytes=0), {"N": 8})
    table = next(w for w in r.choice.weights if w.name == "E")
    assert table.row_readers and not table.consumers  # no reload: rows only
    m = onnx.load(str(out), load_external_data=False)
    ops = [n.op_type for n in m.graph.node if n.domain == contract.DOMAIN]
    assert ops.count(contract.GATHER_ROWS) == 1 and "Gather" not in [
        n.op_type for n in m.graph.node]
    assert "E" not in {i.name for i in m.graph.initializer}
    for ids, c in _runs(src, out):
        assert c["bytes_gathered"] == ids.size * H * 4  # rows, never the table
    with pytest.raises(Exception, match=rf"index {V} is out of range \[-{V}, {V}\)"):
        InferenceSession(out).run(None, {"ids": np.array([V], np.int64)})


def test_the_floor_falls_below_the_table(tmp_path):
    src = _model(tmp_path)
    with pytest.raises(HoOnnxError) as e:
        plan_model(src, OffloadOptions(activations=False, min_bytes=0, budget=1), {"N": 8})
    assert e.value.min_budget < V * H * 4  # type: ignore[attr-defined]


def test_a_decoders_embeddings_are_gathered_and_exact(tmp_path):
    src = tmp_path / "dec.onnx"
    build_decoder(src, layers=2, hidden=64, heads=4, vocab=512, max_positions=128,
                  external_data=True)
    out = tmp_path / "dec.ho.onnx"
    r = optimize(src, out, OffloadOptions(min_bytes=0), {"batch": 2, "seq": 16})
    rows = [w.name for w in r.choice.weights if w.row_readers]
    assert "embed.tok.weight" in rows
    for dims in ({"batch": 2, "seq": 16}, {"batch": 1, "seq": 3}):
        assert verify(src, out, dims=dims, opt_level="basic", isolate=False, atol=0.0).exact


def test_disk_tier_rows_are_read_from_the_file(tmp_path):
    """On the disk tier the table stays in its data file: GatherRows reads the selected rows
    from it inside its Compute (no staging, nothing in flight after it), exact; the plan of
    a budget below the table gathers instead of reloading it (a staged reload would hold it
    twice); an id outside the table fails the run before any read."""
    src, out = _model(tmp_path), tmp_path / "emb.disk.onnx"
    r = optimize(src, out, OffloadOptions(activations=False, min_bytes=0, weight_tier="disk",
                                          budget=V * H * 4 // 2), {"N": 8})
    table = next(w for w in r.choice.weights if w.name == "E")
    assert table.tier == "disk" and table.row_readers and not table.consumers
    assert [w.name for w in r.choice.weights] == ["E"]  # (W fits: resident)
    for ids, c in _runs(src, out):
        assert c["bytes_gathered"] == ids.size * H * 4
        assert c["bytes_read_disk"] == ids.size * H * 4  # the rows, read from the file
        assert c["disk_staging_peak"] == 0  # (read in place: nothing staged)
    with pytest.raises(Exception, match=rf"index {V} is out of range \[-{V}, {V}\)"):
        InferenceSession(out).run(None, {"ids": np.array([V], np.int64)})
