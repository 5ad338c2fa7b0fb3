"""Weight Prefetches record their data file's final size and fingerprint, never a folder
(issue 9): the library refuses a data file of another optimization."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import ho_onnx
from ho_onnx import contract
from ho_onnx.errors import ModelLoadError
from ho_onnx.graph.fingerprint import data_fingerprint
from tests.graphs import chain_model, save

HO = str(Path(sys.executable).with_name("ho-onnx"))
WEIGHTS = ["--offload", "weights", "--min-bytes", "1", "--dim", "N=2"]


def _optimize(src: Path, out: Path) -> None:
    r = subprocess.run([HO, "optimize", str(src), str(out), *WEIGHTS], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def _weight_prefetches(path: Path) -> list[dict[str, object]]:
    m = onnx.load(str(path), load_external_data=False)
    found = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
             for n in m.graph.node
             if n.domain == contract.DOMAIN and n.op_type == contract.PREFETCH
             and any(a.name == contract.ATTR_LOCATION for a in n.attribute)]
    assert found
    return found


def _shifted_chain(delta: float) -> onnx.ModelProto:
    m = chain_model()
    for t in m.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) + delta, t.name))
    return m


@pytest.mark.parametrize("layout", ["sidecar", "external-beside", "external-copied"])
def test_prefetches_carry_the_final_files_size_and_fingerprint(tmp_path: Path, layout: str):
    src = save(chain_model(), tmp_path / "m.onnx", external=layout != "sidecar")
    out = tmp_path / ("m.ho.onnx" if layout == "external-beside" else "o/m.ho.onnx")
    _optimize(src, out)
    for a in _weight_prefetches(out):
        assert "base_dir" not in a
        data = out.parent / a[contract.ATTR_LOCATION].decode()  # type: ignore[union-attr]
        assert a[contract.ATTR_DATA_SIZE] == data.stat().st_size
        assert a[contract.ATTR_DATA_FINGERPRINT].decode() == data_fingerprint(data)  # type: ignore[union-attr]
    x = np.ones((2, 16), np.float32)
    ho_onnx.InferenceSession(out).run(None, {"x": x})


def test_data_file_of_another_optimization_is_refused(tmp_path: Path):
    """A copied model folder whose data file was replaced by another optimization's (same
    size, other weights) fails at session creation, naming the file and the fingerprint."""
    for name, delta in (("a", 0.0), ("b", 1.0)):
        src = save(_shifted_chain(delta), tmp_path / f"{name}.onnx")
        _optimize(src, tmp_path / name / "m.ho.onnx")
    shutil.copytree(tmp_path / "a", tmp_path / "c")
    shutil.copyfile(tmp_path / "b" / "m.ho.onnx.data", tmp_path / "c" / "m.ho.onnx.data")
    ho_onnx.InferenceSession(tmp_path / "a" / "m.ho.onnx")  # the original is fine
    with pytest.raises(Exception, match=r"m\.ho\.onnx\.data.*fingerprint.*not the data file"):
        ho_onnx.InferenceSession(tmp_path / "c" / "m.ho.onnx")


def test_model_bytes_with_offloaded_weights_need_model_dir(tmp_path: Path):
    src = save(chain_model(), tmp_path / "m.onnx")
    out = tmp_path / "o" / "m.ho.onnx"
    _optimize(src, out)
    with pytest.raises(ModelLoadError, match="model_dir="):
        ho_onnx.InferenceSession(out.read_bytes())
    sess = ho_onnx.InferenceSession(out.read_bytes(), model_dir=out.parent)
    x = np.ones((2, 16), np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0],
                                  ho_onnx.InferenceSession(out).run(None, {"x": x})[0])
