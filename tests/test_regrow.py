"""models/regrow.py: a model carried as its graph alone (small tensors inside), its weights
regrown from a seed to the same bytes anywhere; entries that point outside the folder,
overlap or lie about their length are refused."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from models.decoder import build_decoder  # noqa: E402
from models.regrow import regrow, strip  # noqa: E402

KEEP = 4096


def _run(path: Path) -> np.ndarray:
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return s.run(None, {"input_ids": np.arange(6, dtype=np.int64)[None, :]})[0]


@pytest.mark.parametrize("external", [True, False])
def test_strip_then_regrow_runs_and_is_deterministic(tmp_path, external):
    src = tmp_path / "src" / "model.onnx"
    src.parent.mkdir()
    build_decoder(src, layers=1, hidden=64, heads=4, vocab=128, external_data=external)
    full = onnx.load(str(src))
    small = {t.name: numpy_helper.to_array(t) for t in full.graph.initializer
             if numpy_helper.to_array(t).nbytes < KEEP}
    out = strip(src, tmp_path / "a", keep_bytes=KEEP)
    g = onnx.load(str(out), load_external_data=False)
    ext = [t for t in g.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert ext and all(t.dims and np.prod(t.dims) * 4 >= KEEP for t in ext)
    assert not any(p.name.endswith("data") for p in out.parent.iterdir())  # no weights
    files = regrow(out, seed=3)
    assert [p.name for p in files] == ["model.onnx.data" if external else "model.onnx_data"]
    regrown = onnx.load(str(out))
    for t in regrown.graph.initializer:
        a = numpy_helper.to_array(t)
        if t.name in small:  # (norm gains, biases: verbatim)
            np.testing.assert_array_equal(a, small[t.name])
        else:
            assert abs(float(a.std()) - 0.02) < 0.005, t.name
    y = _run(out)
    assert np.isfinite(y).all()
    # the same graph and seed give the same bytes elsewhere; another seed other bytes
    strip(src, tmp_path / "b", keep_bytes=KEEP)
    regrow(tmp_path / "b" / "model.onnx", seed=3)
    np.testing.assert_array_equal(_run(tmp_path / "b" / "model.onnx"), y)
    regrow(tmp_path / "b" / "model.onnx", seed=4)
    assert not np.array_equal(_run(tmp_path / "b" / "model.onnx"), y)


def _with_external(tmp_path: Path, entries: list[tuple[str, int, int, int]]) -> Path:
    """A graph of float initializers (name, location, offset, length, elements)."""
    inits = []
    for i, (loc, offset, length, n) in enumerate(entries):
        t = TensorProto(name=f"w{i}", data_type=TensorProto.FLOAT, dims=[n])
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", loc), ("offset", str(offset)), ("length", str(length))):
            t.external_data.add(key=k, value=v)
        inits.append(t)
    g = onnx.helper.make_graph([], "g", [], [onnx.helper.make_tensor_value_info(
        "w0", TensorProto.FLOAT, None)], inits)
    path = tmp_path / "m.onnx"
    onnx.save(onnx.helper.make_model(g), str(path))
    return path


@pytest.mark.parametrize("entries, match", [
    ([("../escape.bin", 0, 64, 16)], "points outside the model folder"),
    ([("/etc/passwd", 0, 64, 16)], "must be a relative path"),
    ([("w.bin", 0, 60, 16)], "is not 16 x 4 bytes"),
    ([("w.bin", 0, 64, 16), ("w.bin", 32, 64, 16)], "overlap"),
    ([("a.bin", 0, 64, 16), ("w.bin", 0, 64, 16), ("w.bin", 32, 64, 16)], "overlap"),
])
def test_hostile_entries_are_refused_and_nothing_is_written(tmp_path, entries, match):
    path = _with_external(tmp_path, entries)
    with pytest.raises(ValueError, match=match):
        regrow(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    assert not (tmp_path.parent / "escape.bin").exists()


def test_a_data_file_in_a_subfolder_is_regrown_there(tmp_path):
    path = _with_external(tmp_path, [("sub/w.bin", 0, 64, 16)])
    (written,) = regrow(path, seed=1)
    assert written == (tmp_path / "sub" / "w.bin").resolve() and written.stat().st_size == 64
    a = np.fromfile(written, np.float32)
    assert a.shape == (16,) and a.any()
