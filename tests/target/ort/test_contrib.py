"""ORT contrib ops: the standard-domain check, their shapes (ORT's symbolic inference), ORT load
validation."""

from __future__ import annotations

import os
import resource
import time

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import pytest
from onnx import TensorProto, numpy_helper

from ho_onnx.errors import ModelLoadError, UnsupportedModelError
from ho_onnx.graph import bounded
from ho_onnx.graph.check import check_standard, contrib_ops, weights_as_inputs
from ho_onnx.target.ort import contrib
from ho_onnx.target.ort._symbolic_worker import infer
from ho_onnx.target.ort.contrib import (
    contrib_value_types,
    invented_dim,
    ort_check,
    refuse_unknown_ops,
    symbolic_types,
)
from tests.graphs import contrib_blowup_model

HEADER = '<ir_version: 8, opset_import: ["" : 21, "com.microsoft" : 1]>'

# The ops onnxruntime-genai's builder emits for a Llama block (int4), small: hidden 64,
# 4 query heads, 2 KV heads of 16, block size 32.
GENAI_BLOCK = """
block (float[batch, seq, 64] x, float[batch, 2, past, 16] pk, float[batch, 2, past, 16] pv,
       int32[batch] seqlens, int32[1] total) => (float[batch, seq, 64] y,
       float[batch, 2, total_seq, 16] present_k, float[batch, 2, total_seq, 16] present_v) {
  n = SimplifiedLayerNormalization <axis = -1, epsilon = 1e-5> (x, ln_w)
  qkv = com.microsoft.MatMulNBits <K = 64, N = 128, bits = 4, block_size = 32> (n, qkv_q, qkv_s)
  q = Slice (qkv, q0, q1, ax)
  k = Slice (qkv, k0, k1, ax)
  v = Slice (qkv, v0, v1, ax)
  a, present_k, present_v = com.microsoft.GroupQueryAttention <num_heads = 4, kv_num_heads = 2>
      (q, k, v, pk, pv, seqlens, total)
  o = com.microsoft.MatMulNBits <K = 64, N = 64, bits = 4, block_size = 32> (a, o_q, o_s, o_z)
  y, mean, inv, sum = com.microsoft.SkipSimplifiedLayerNormalization <epsilon = 1e-5> (o, x, ln_w)
}
"""


def _i64(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


def genai_block() -> onnx.ModelProto:
    model = onnx.parser.parse_model(f"{HEADER}\n{GENAI_BLOCK}")
    rng = np.random.default_rng(0)
    inits = {
        "ln_w": np.ones(64, np.float32),
        "qkv_q": rng.integers(0, 255, (128, 2, 16), dtype=np.uint8),
        "qkv_s": rng.random(256, dtype=np.float32),
        "o_q": rng.integers(0, 255, (64, 2, 16), dtype=np.uint8),
        "o_s": rng.random(128, dtype=np.float32),
        "o_z": rng.integers(0, 255, 64, dtype=np.uint8),
        "q0": _i64(0), "q1": _i64(64), "k0": _i64(64), "k1": _i64(96), "v0": _i64(96),
        "v1": _i64(128), "ax": _i64(2),
    }
    for name, arr in inits.items():
        model.graph.initializer.append(numpy_helper.from_array(arr, name))
    return model


def external(model: onnx.ModelProto, *names: str) -> onnx.ModelProto:
    """Make ``names`` external initializers whose file does not exist (nothing may read it)."""
    for t in model.graph.initializer:
        if t.name in names:
            t.ClearField("raw_data")
            t.data_location = TensorProto.EXTERNAL
            e = t.external_data.add()
            e.key, e.value = "location", "no_such_file.bin"
    return model


def test_checker_refuses_contrib_ops_that_check_standard_lets_through():
    model = genai_block()
    with pytest.raises(onnx.checker.ValidationError, match="SimplifiedLayerNormalization"):
        onnx.checker.check_model(model)
    passed = check_standard(model)
    assert ("", "SimplifiedLayerNormalization") in passed
    assert ("com.microsoft", "GroupQueryAttention") in passed
    assert contrib_ops(ir.from_proto(model)) == passed


def test_check_standard_reads_no_weight_bytes():
    model = external(genai_block(), "qkv_q", "o_q", "qkv_s")
    check_standard(model)  # the file does not exist: only its reference was looked at


def test_check_standard_still_checks_the_standard_parts():
    bad = genai_block()
    bad.graph.node[2].input[0] = "not_defined_anywhere"  # a Slice reading nothing
    with pytest.raises(onnx.checker.ValidationError, match="not_defined_anywhere"):
        check_standard(bad)


def test_unknown_default_domain_op_is_refused_by_name():
    model = onnx.parser.parse_model(f"""{HEADER}
    g (float[2] x) => (float[2] y) {{ y = NoSuchOpAnywhere (x) }}""")
    assert check_standard(model) == [("", "NoSuchOpAnywhere")]  # the graph layer knows no ORT
    with pytest.raises(UnsupportedModelError, match="NoSuchOpAnywhere"):
        refuse_unknown_ops(model)
    assert refuse_unknown_ops(genai_block())  # ORT's own ops pass


def test_custom_domains_pass():
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 21, "my.ops" : 1]>
    g (float[2] x) => (float[2] y) { h = my.ops.Anything (x)  y = Relu (h) }""")
    assert check_standard(model) == [("my.ops", "Anything")]


def test_check_standard_finds_contrib_ops_in_subgraphs_and_checks_around_them():
    """The ops onnx cannot judge are found on the model and moved on the checker's copy by
    their place (graph, node): in a branch, beside a standard node the checker still judges."""
    model = onnx.parser.parse_model(f"""{HEADER}
    g (bool c, float[2] x) => (float[2] y) {{
      y = If (c) <then_branch = t () => (float[2] a) {{
                     h = com.microsoft.FastGelu (x)
                     a = NoSuchOpAnywhere (h) }},
                   else_branch = e () => (float[2] b) {{ b = Relu (x) }}>
    }}""")
    assert check_standard(model) == [("", "NoSuchOpAnywhere"), ("com.microsoft", "FastGelu")]
    assert model.graph.node[0].attribute[0].g.node[1].domain == ""  # the input is unchanged
    with pytest.raises(UnsupportedModelError, match="NoSuchOpAnywhere"):
        check_standard(model, known=[("com.microsoft", "FastGelu")])
    bad = onnx.ModelProto()
    bad.CopyFrom(model)
    bad.graph.node[0].attribute[1].g.node[0].input[0] = "undefined_here"  # Relu in a branch
    with pytest.raises(onnx.checker.ValidationError, match="undefined_here"):
        check_standard(bad)


def test_weights_as_inputs_types_each_weight_by_its_own_shape():
    """Weights of one shape share a type made once; each keeps its name, type and dims."""
    model = onnx.parser.parse_model(f"""{HEADER}
    g (float[2] x) => (float[2] y) {{ y = Add (x, a) }}""")
    for name, dt, dims in [("a", TensorProto.FLOAT, [2]), ("b", TensorProto.FLOAT, [2]),
                           ("c", TensorProto.FLOAT16, [2]), ("d", TensorProto.FLOAT, [3, 2])]:
        t = onnx.helper.make_tensor(name, dt, dims, np.zeros(int(np.prod(dims))).tolist())
        model.graph.initializer.append(t)
    typed = {vi.name: vi.type for vi in weights_as_inputs(model, keep_bytes=0).graph.input}
    assert typed["a"] == typed["b"] == onnx.helper.make_tensor_type_proto(TensorProto.FLOAT, [2])
    assert typed["c"] == onnx.helper.make_tensor_type_proto(TensorProto.FLOAT16, [2])
    assert typed["d"] == onnx.helper.make_tensor_type_proto(TensorProto.FLOAT, [3, 2])


def test_weights_as_inputs_keeps_small_tensors_and_types_the_rest():
    sk = weights_as_inputs(external(genai_block(), "qkv_q"))
    kept = {t.name for t in sk.graph.initializer}
    assert "qkv_q" not in kept  # external: a typed input, never read
    assert {"q0", "qkv_s", "o_q"} <= kept  # inline and at most 4 KiB: kept
    assert not weights_as_inputs(genai_block(), keep_bytes=0).graph.initializer
    typed = {vi.name: vi for vi in sk.graph.input}
    assert [d.dim_value for d in typed["qkv_q"].type.tensor_type.shape.dim] == [128, 2, 16]
    assert typed["qkv_q"].type.tensor_type.elem_type == TensorProto.UINT8


def _dims(tp: onnx.TypeProto) -> list[int | str | None]:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in tp.tensor_type.shape.dim]


def test_contrib_shapes_where_onnx_inference_knows_none():
    model = external(genai_block(), "qkv_q", "o_q")
    onnx_types = {vi.name for vi in onnx.shape_inference.infer_shapes(model).graph.value_info}
    assert "qkv" not in onnx_types and "o" not in onnx_types  # onnx cannot size them
    types = contrib_value_types(model, {"batch": 1, "seq": 8, "past": 0})
    assert _dims(types["n"]) == [1, 8, 64]
    assert _dims(types["qkv"]) == [1, 8, 128]
    assert _dims(types["q"]) == [1, 8, 64]
    assert _dims(types["a"]) == [1, 8, 64]
    assert _dims(types["o"]) == [1, 8, 64]
    assert types["qkv"].tensor_type.elem_type == TensorProto.FLOAT


def test_contrib_shapes_keep_unbound_dims_symbolic_and_take_whole_shapes():
    model = genai_block()
    types = contrib_value_types(model)
    assert _dims(types["qkv"]) == ["batch", "seq", 128]
    types = contrib_value_types(model, shapes={"x": [2, 5, 64]})
    assert _dims(types["qkv"]) == [2, 5, 128]


def test_contrib_shapes_are_the_same_in_the_worker_and_in_process():
    model = genai_block()
    child = contrib_value_types(model)
    here = symbolic_types(infer(weights_as_inputs(model).SerializeToString()))
    assert {k: v.SerializeToString() for k, v in child.items()} == {
        k: v.SerializeToString() for k, v in here.items()}
    assert _dims(child["qkv"]) == ["batch", "seq", 128]
    worker = contrib._SYMBOLIC.proc
    assert worker is not None and worker.pid != os.getpid()
    contrib_value_types(model)  # the next request: the same warm worker
    assert contrib._SYMBOLIC.proc is worker and worker.poll() is None


def test_contrib_shape_inference_writes_nothing_where_it_runs(monkeypatch, tmp_path):
    """ORT's tool saves ``sym_shape_infer_temp.onnx`` in the working directory when its
    inference is incomplete (found by tests/optimize_fuzz.py: ``ho-onnx optimize`` left it
    in the user's folder, or overwrote a file of that name there)."""
    model = contrib_blowup_model(4)
    model.opset_import[0].version = 7  # (no ConstantOfShape at opset 7: incomplete)
    monkeypatch.chdir(tmp_path)
    contrib._SYMBOLIC.stop()  # the next one starts here, in tmp_path
    assert "c" not in contrib_value_types(model)
    assert list(tmp_path.iterdir()) == []


def test_contrib_shape_inference_of_a_hostile_model_is_bounded_in_memory(monkeypatch):
    """~270 bytes of model make ORT's tool allocate 2 x 1.8 GB (CONTRIB_BLOWUP): the child's
    address-space limit stops it; this process does not grow."""
    model = contrib_blowup_model()
    assert model.ByteSize() < 400
    monkeypatch.setenv(bounded.ENV_MEMORY, "1.5GiB")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ModelLoadError, match=(
            f"ORT's symbolic shape inference.*more than 1.50 GiB.*{bounded.ENV_MEMORY}")):
        contrib_value_types(model)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 << 10  # KiB
    monkeypatch.setenv(bounded.ENV_MEMORY, "4GiB")  # a small one fits the default
    assert _dims(contrib_value_types(contrib_blowup_model(100))["c"]) == [100, 100]


def test_contrib_shape_inference_of_a_hostile_model_is_bounded_in_time(monkeypatch):
    contrib_value_types(contrib_blowup_model(4))  # (a warm worker: its start is not timed)
    monkeypatch.setenv(bounded.ENV_TIMEOUT, "0.2")  # the 2 x 1.15 GB fill takes seconds
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match=(
            f"ORT's symbolic shape inference.*more than 0.2 s.*{bounded.ENV_TIMEOUT}")):
        contrib_value_types(contrib_blowup_model(12000))
    assert time.monotonic() - t0 < 30
    monkeypatch.delenv(bounded.ENV_TIMEOUT)  # the worker ended with the request; a new one
    assert _dims(contrib_value_types(contrib_blowup_model(4))["c"]) == [4, 4]


def test_invented_dims():
    assert invented_dim("unk__3")
    assert invented_dim("Flatten_99_o0__d1")
    assert invented_dim("Flatten_99_o0__d1*batch_size*past + seq")
    assert not invented_dim("past_sequence_length + sequence_length")
    assert not invented_dim("batch_size")


def test_ort_check_loads_contrib_models_and_names_what_ort_refuses(tmp_path):
    model = genai_block()
    good = tmp_path / "good.onnx"
    onnx.save(model, str(good))
    ort_check(good)
    bad = genai_block()
    bad.graph.node[1].attribute[1].i = 96  # MatMulNBits N no longer matches its scales
    for a in bad.graph.node[1].attribute:
        if a.name == "K":
            a.i = 65
    path = tmp_path / "bad.onnx"
    onnx.save(bad, str(path))
    with pytest.raises(UnsupportedModelError, match="onnxruntime does not load"):
        ort_check(path)


def test_contrib_shapes_clear_what_no_dim_binding_can_evaluate(monkeypatch):
    from onnxruntime.tools import symbolic_shape_infer

    def fake(model, **kw):  # what ORT's inference writes for broadcasts, Flatten, unknowns
        out = onnx.ModelProto()
        out.CopyFrom(model)
        for name, dim in (("h", "Max(a, b)"), ("k", "Flatten_9_o0__d1"), ("m", "unk__2"),
                          ("z", "a + 2*b")):
            out.graph.value_info.append(onnx.helper.make_tensor_value_info(
                name, TensorProto.FLOAT, [dim, 4]))
        return out

    monkeypatch.setattr(symbolic_shape_infer.SymbolicShapeInference, "infer_shapes",
                        staticmethod(fake))
    model = onnx.parser.parse_model(f"""{HEADER}
    g (float[a, 4] x) => (float[a, 4] y) {{ y = Relu (x) }}""")
    types = symbolic_types(infer(model.SerializeToString()))  # here, where the fake is
    assert [_dims(types[n]) for n in ("h", "k", "m", "z")] == [
        [None, 4], [None, 4], [None, 4], ["a + 2*b", 4]]


@pytest.mark.parametrize(("providers", "asks_kernels"), [
    (["CPUExecutionProvider"], True),
    (["CUDAExecutionProvider", "CPUExecutionProvider"], False),
])
def test_kernel_listing_is_asked_only_of_cpu_only_builds(monkeypatch, providers, asks_kernels):
    """onnxruntime-gpu 1.31.1 segfaults in get_all_opkernel_def (measured on an H100): a GPU
    build is asked for its schemas only."""
    from onnxruntime.capi import _pybind_state as C

    from ho_onnx.target.ort.contrib import ort_schemas

    asked = []

    class _Kernel:
        domain, op_name = "com.example", "OnlyAKernel"

    def kernels():
        asked.append(True)
        return [_Kernel()]

    monkeypatch.setattr(C, "get_available_providers", lambda: providers)
    monkeypatch.setattr(C, "get_all_opkernel_def", kernels, raising=False)
    got = ort_schemas.__wrapped__()  # past the process-wide cache
    assert bool(asked) == asks_kernels
    assert (("com.example", "OnlyAKernel") in got) == asks_kernels
    assert ("", "MatMul") in got  # the schemas are there either way
