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


@pytest.fixture(scope="session")
def ort_crash_model(tmp_path_factory) -> Path:
    """``tests.graphs.ORT_CRASH`` saved, after checking in a child process that ONNX Runtime
    really crashes creating a session for it at level ``all`` (skips where it does not: the
    tests that use it are about what happens when ORT crashes)."""
    from tests.graphs import ort_crash_model

    path = tmp_path_factory.mktemp("ort_crash") / "ln.onnx"
    onnx.save(ort_crash_model(), path)
    probe = ("import sys, onnxruntime as ort; so = ort.SessionOptions(); "
             "ort.InferenceSession(sys.argv[1], so, providers=['CPUExecutionProvider'])")
    r = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True,
                       timeout=120, check=False)
    if r.returncode >= 0:
        import onnxruntime

        pytest.skip(f"onnxruntime {onnxruntime.__version__} does not crash on "
                    f"tests.graphs.ORT_CRASH (exit {r.returncode})")
    return path
