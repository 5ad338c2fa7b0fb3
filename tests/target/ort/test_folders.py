"""Model folders: genai and Optimum folders in, ready folders out (library, config entries)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from graphs import chain_model, save

from ho_onnx.contract import CONFIG_MODEL_DIR
from ho_onnx.errors import ModelLoadError, OutputPathError
from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.target.ort.folders import detect_folder, optimize_folder, optimum_session_options
from ho_onnx.target.ort.runtime import library_path


def _optimize(src: Path, dst: Path) -> None:
    optimize(src, dst, OffloadOptions(activations=False, min_bytes=0))


def genai_folder(root: Path) -> Path:
    root.mkdir()
    save(chain_model(), root / "model.onnx", external=True)
    cfg = {"model": {"type": "llama", "decoder": {
        "filename": "model.onnx", "session_options": {"log_id": "onnxruntime-genai",
                                                      "provider_options": []}}}}
    (root / "genai_config.json").write_text(json.dumps(cfg))
    (root / "tokenizer.json").write_text("{}")
    return root


def optimum_folder(root: Path) -> Path:
    root.mkdir()
    save(chain_model(), root / "model.onnx")
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "generation_config.json").write_text("{}")
    return root


def test_detect(tmp_path):
    g = detect_folder(genai_folder(tmp_path / "g"))
    assert (g.kind, g.model.name) == ("genai", "model.onnx")
    o = detect_folder(optimum_folder(tmp_path / "o"))
    assert (o.kind, o.model.name) == ("optimum", "model.onnx")
    (tmp_path / "e").mkdir()
    with pytest.raises(ModelLoadError, match="neither an onnxruntime-genai folder"):
        detect_folder(tmp_path / "e")
    (tmp_path / "e" / "genai_config.json").write_text('{"model": {"decoder": '
                                                      '{"filename": "nope.onnx"}}}')
    with pytest.raises(ModelLoadError, match=r"'nope\.onnx', which is not in"):
        detect_folder(tmp_path / "e")


@pytest.mark.parametrize(("model", "message"), [
    (5, "names no model.decoder.filename"),
    ({"decoder": []}, "names no model.decoder.filename"),
    ({"decoder": {"filename": "../outside.onnx"}}, "points outside the model folder"),
    ({"decoder": {"filename": "{abs}"}}, "must be a relative path inside the model folder"),
    ({"decoder": {"filename": "m\0.onnx"}}, "has a NUL byte"),
    ({"decoder": {"filename": "."}}, "which is not in"),
    ({"decoder": {"filename": "model.onnx", "session_options": []}},
     "session_options must be a JSON object"),
])
def test_a_genai_config_names_only_a_file_inside_its_folder(tmp_path, model, message):
    """Its decoder is read there and written at the same place in the output folder: a
    name out of the folder would read, and write, elsewhere (was: an unexpected
    AttributeError for a non-object ``model``, and ``../x.onnx`` read the file beside the
    folder and aimed the output beside the output folder)."""
    save(chain_model(), tmp_path / "outside.onnx")
    g = genai_folder(tmp_path / "g")
    if isinstance(model, dict) and model.get("decoder", {}) == {"filename": "{abs}"}:
        model = {"decoder": {"filename": str(tmp_path / "outside.onnx")}}
    (g / "genai_config.json").write_text(json.dumps({"model": model}))
    with pytest.raises(ModelLoadError, match=message):
        detect_folder(g)
    with pytest.raises(ModelLoadError, match=message):
        optimize_folder(g, tmp_path / "out", _optimize)
    assert not (tmp_path / "out").exists()


def _run(path: Path, so: ort.SessionOptions) -> np.ndarray:
    s = ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    return s.run(None, {"x": x})[0]


def test_genai_folder_is_ready(tmp_path):
    src = genai_folder(tmp_path / "src")
    lib = tmp_path / "libfake_ops.so"
    lib.write_bytes(Path(library_path()).read_bytes())
    r = optimize_folder(src, tmp_path / "out", _optimize, library=lib)
    out = tmp_path / "out"
    assert r.kind == "genai" and r.library == out / "libfake_ops.so" and r.library.is_file()
    assert sorted(p.name for p in out.iterdir()) == [
        "genai_config.json", "libfake_ops.so", "model.onnx", "model.onnx.data",
        "tokenizer.json"]
    so_cfg = json.loads((out / "genai_config.json").read_text())["model"]["decoder"][
        "session_options"]
    assert so_cfg["custom_ops_library"] == "libfake_ops.so"
    assert so_cfg["enable_mem_pattern"] is False  # ORT's pattern block is not in the budget
    assert so_cfg[CONFIG_MODEL_DIR] == str(out.resolve())
    assert so_cfg["log_id"] == "onnxruntime-genai"  # what was there stays
    assert json.loads((src / "genai_config.json").read_text())["model"]["decoder"][
        "session_options"] == {"log_id": "onnxruntime-genai", "provider_options": []}
    # What genai does with that config: config entries first, then the library.
    so = ort.SessionOptions()
    for k, v in so_cfg.items():
        if k.startswith("ho_onnx."):
            so.add_session_config_entry(k, v)
    copied = out / so_cfg["custom_ops_library"]
    assert copied.read_bytes() == lib.read_bytes()
    # (the same bytes, registered from library_path(): a second copy mapped in the test
    # process would be a second library state; the genai tests load the copy in a child)
    so.register_custom_ops_library(library_path())
    want = _run(src / "model.onnx", ort.SessionOptions())
    np.testing.assert_array_equal(_run(out / "model.onnx", so), want)


def test_optimum_folder_is_ready(tmp_path):
    src = optimum_folder(tmp_path / "src")
    r = optimize_folder(src, tmp_path / "out", _optimize)
    out = tmp_path / "out"
    assert r.kind == "optimum" and r.library is None
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "generation_config.json", "model.onnx", "model.onnx.data"]
    want = _run(src / "model.onnx", ort.SessionOptions())
    np.testing.assert_array_equal(_run(out / "model.onnx", optimum_session_options(out)), want)


def test_output_folder_must_be_new_or_empty(tmp_path):
    src = optimum_folder(tmp_path / "src")
    with pytest.raises(OutputPathError, match="is the input folder"):
        optimize_folder(src, src, _optimize)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    with pytest.raises(OutputPathError, match="not empty"):
        optimize_folder(src, tmp_path / "busy", _optimize)


@pytest.mark.parametrize("existing", [False, True])
def test_a_failure_leaves_the_output_folder_as_it_was(tmp_path, existing):
    """Absent, or empty: nothing half-written (was: the library and the model stayed when a
    later step failed)."""
    src = genai_folder(tmp_path / "g")
    out = tmp_path / "new" / "out"
    if existing:
        out.mkdir(parents=True)

    def fails_after_writing(a: Path, b: Path) -> None:
        _optimize(a, b)
        (b.parent / "sub").mkdir()
        (b.parent / "sub" / "x").write_text("x")
        raise OutputPathError("disk full (simulated after the model was written)")

    with pytest.raises(OutputPathError, match="simulated"):
        optimize_folder(src, out, fails_after_writing)
    if existing:
        assert list(out.iterdir()) == []
    else:
        assert not (tmp_path / "new").exists()
