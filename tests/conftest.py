"""Shared fixtures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from native_util import load_ops_override

# HO_ONNX_TEST_OPS=<_ops .so>: run the tests against another build (sanitizers, old commit)
load_ops_override()

# The hostile-model tests allocate up to the shape-inference bound (default 4GiB): keep the
# shared test machine's memory for the other tests (the commands they run inherit it).
os.environ.setdefault("HO_ONNX_SHAPE_INFERENCE_MEMORY", "2GiB")


@pytest.fixture
def hostile_model_dir(tmp_path):
    """A model folder for bad-location tests: ``w.bin`` (16 floats), a sub-folder ``sub``,
    and ``link.bin``, a symlink to a file outside the folder."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "sub").mkdir()
    np.zeros(16, np.float32).tofile(model_dir / "w.bin")
    np.zeros(16, np.float32).tofile(tmp_path / "outside.bin")
    os.symlink(tmp_path / "outside.bin", model_dir / "link.bin")
    return model_dir


def _crashes_ort(model: onnx.ModelProto, path: Path, probe: str) -> Path:
    """``model`` saved at ``path``, after checking that ``probe`` (Python, ``sys.argv[1]`` the
    path) dies by a signal in a child process; skips where it does not (the tests that use
    it are about what happens when ORT crashes)."""
    onnx.save(model, path)
    r = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True,
                       timeout=120, check=False)
    if r.returncode >= 0:
        import onnxruntime

        pytest.skip(f"onnxruntime {onnxruntime.__version__} does not crash on {path.name} "
                    f"(exit {r.returncode})")
    return path


_SESSION = ("import sys, numpy as np, onnxruntime as ort; "
            "s = ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider']); ")


@pytest.fixture(scope="session")
def ort_crash_model(tmp_path_factory) -> Path:
    """``tests.graphs.ORT_CRASH``: ORT crashes creating a session (level all)."""
    from tests.graphs import ort_crash_model

    return _crashes_ort(ort_crash_model(), tmp_path_factory.mktemp("ort_crash") / "ln.onnx",
                        _SESSION)


@pytest.fixture(scope="session")
def ort_run_crash_model(tmp_path_factory) -> Path:
    """``tests.graphs.ORT_RUN_CRASH``: ORT crashes in the first run (any level)."""
    from tests.graphs import ort_run_crash_model

    return _crashes_ort(ort_run_crash_model(), tmp_path_factory.mktemp("ort_crash") / "mx.onnx",
                        _SESSION + "s.run(None, {'X': np.ones((3, 4), np.float32)})")


@pytest.fixture(scope="session")
def moe_export(tmp_path_factory):
    """``moe_export(arch)``: the Optimum export (with past) of a random-weight ``arch``
    decoder of ``models.moe_export.SMALL``, made once per session."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        pytest.importorskip("optimum.exporters.onnx")
        pytest.importorskip("torch")
        from models.moe_export import SMALL, build_hf_moe, export_moe

        if arch not in made:
            root = tmp_path_factory.mktemp(arch)
            hf = build_hf_moe(root / "hf", arch, **SMALL)
            made[arch] = export_moe(hf, root / "onnx", arch)
        return made[arch]

    return get
