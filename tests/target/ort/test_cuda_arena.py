"""The session helper configures ORT's CUDA arena for a budget (checked without a GPU: the
options the helper hands to ORT)."""

from __future__ import annotations

import onnx
import onnx.parser
import onnxruntime as ort
import pytest

from ho_onnx.target.ort import runtime


def test_arena_grows_by_what_is_requested_and_a_limit_caps_it():
    assert runtime.cuda_arena_options() == {"arena_extend_strategy": "kSameAsRequested"}
    assert runtime.cuda_arena_options(3 << 30)["gpu_mem_limit"] == str(3 << 30)
    with pytest.raises(ValueError):
        runtime.cuda_arena_options(0)


def test_only_the_cuda_provider_gets_the_options_and_the_callers_win():
    got = runtime.with_cuda_arena(
        ["CPUExecutionProvider",
         ("CUDAExecutionProvider", {"device_id": "1", "arena_extend_strategy": "kNextPowerOfTwo"})],
        device_limit=1 << 30)
    assert got[0] == "CPUExecutionProvider"
    name, opts = got[1]
    assert name == "CUDAExecutionProvider"
    assert opts == {"device_id": "1", "arena_extend_strategy": "kNextPowerOfTwo",
                    "gpu_mem_limit": str(1 << 30)}


def test_inference_session_hands_the_arena_options_to_ort(monkeypatch, tmp_path):
    seen = {}

    def fake(model, sess_options=None, providers=None, **kw):
        seen["providers"] = providers
        return "session"

    monkeypatch.setattr(ort, "InferenceSession", fake)
    fixed, symbolic = tmp_path / "fixed.onnx", tmp_path / "symbolic.onnx"
    for path, dim in ((fixed, "4"), (symbolic, "N")):
        onnx.save(onnx.parser.parse_model(f"""
        <ir_version: 10, opset_import: ["" : 21]>
        g (float[{dim}] x) => (float[{dim}] y) {{ y = Neg(x) }}
        """), str(path))
    assert runtime.InferenceSession(fixed, providers=["CUDAExecutionProvider"],
                                    device_limit=5 << 20) == "session"
    assert seen["providers"] == [("CUDAExecutionProvider",
                                  {"arena_extend_strategy": "kSameAsRequested",
                                   "gpu_mem_limit": str(5 << 20)})]
    # symbolic dims: ORT's own growth (a decode loop asks for more at every step), the cap kept
    runtime.InferenceSession(symbolic, providers=["CUDAExecutionProvider"],
                             device_limit=5 << 20)
    assert seen["providers"] == [("CUDAExecutionProvider", {"gpu_mem_limit": str(5 << 20)})]
