"""ORT contrib ops: the standard-domain check, their shapes (ORT's symbolic inference), ORT load
validation, cost entries, and the weights that move together."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import pytest
from onnx import TensorProto, numpy_helper

from ho_onnx.contrib import (
    check_standard,
    contrib_ops,
    contrib_value_types,
    invented_dim,
    ort_check,
    weights_as_inputs,
)
from ho_onnx.contrib_costs import contrib_flops_bytes, weight_groups
from ho_onnx.errors import UnsupportedModelError

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
    assert contrib_ops(model) == passed


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
    with pytest.raises(UnsupportedModelError, match="NoSuchOpAnywhere"):
        check_standard(model)


def test_custom_domains_pass():
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 21, "my.ops" : 1]>
    g (float[2] x) => (float[2] y) { h = my.ops.Anything (x)  y = Relu (h) }""")
    assert check_standard(model) == [("my.ops", "Anything")]


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


def _node(text: str) -> onnx.NodeProto:
    return onnx.parser.parse_node(text)


def test_gqa_cost_counts_attention_over_the_present_cache():
    node = _node("a, pk2, pv2 = com.microsoft.GroupQueryAttention <num_heads = 4, "
                 "kv_num_heads = 2> (q, k, v, pk, pv, sl, ts)")
    ins = [[1, 8, 64], [1, 8, 32], [1, 8, 32], [1, 2, 24, 16], [1, 2, 24, 16], [1], [1]]
    outs = [[1, 8, 64], [1, 2, 32, 16], [1, 2, 32, 16]]
    in_b = [2048, 1024, 1024, 3072, 3072, 4, 4]
    out_b = [2048, 4096, 4096]
    flops, moved = contrib_flops_bytes(node, ins, outs, in_b, out_b)  # type: ignore[misc]
    assert flops == 4 * 512 * 32 + 5 * 8 * 4 * 32
    assert moved == sum(in_b) + 2048 + (8192 - 6144)  # past and present share ORT's buffer
    # Without outputs' shapes: past (24) + new keys (8)
    flops2, _ = contrib_flops_bytes(node, ins, [[1, 8, 64], None, None], in_b,
                                    [2048, 0, 0])  # type: ignore[misc]
    assert flops2 == flops


def test_mha_cost_with_4d_keys():
    node = _node("o = com.microsoft.MultiHeadAttention <num_heads = 2> (q, k, v)")
    flops, _ = contrib_flops_bytes(node, [[1, 4, 32], [1, 2, 10, 16], [1, 2, 10, 16]],
                                   [[1, 4, 32]], [512, 1280, 1280], [512])  # type: ignore[misc]
    assert flops == 4 * 128 * 10 + 5 * 4 * 2 * 10


def test_matmulnbits_cost():
    node = _node("y = com.microsoft.MatMulNBits <K = 64, N = 128, bits = 4, block_size = 32> "
                 "(a, b, s, z)")
    flops, moved = contrib_flops_bytes(node, [[1, 8, 64], [128, 2, 16], [256], [128]],
                                       [[1, 8, 128]], [2048, 4096, 1024, 128],
                                       [4096])  # type: ignore[misc]
    assert flops == 2 * 8 * 128 * 64 + 2 * 128 * 64
    assert moved == 2048 + 4096 + 1024 + 128 + 4096  # packed weight, scales, zero points


def test_gather_block_quantized_reads_only_its_rows():
    node = _node("e = com.microsoft.GatherBlockQuantized <block_size = 32, bits = 4, "
                 "gather_axis = 0, quantize_axis = 1> (table, ids, scales)")
    flops, moved = contrib_flops_bytes(node, [[256, 32], [1, 8], [256, 2]], [[1, 8, 64]],
                                       [8192, 64, 2048], [2048])  # type: ignore[misc]
    assert flops == 2 * 512
    assert moved == pytest.approx(8 / 256 * (8192 + 2048) + 64 + 2048)


@pytest.mark.parametrize("op,per", [("FastGelu", 8), ("BiasGelu", 9), ("RotaryEmbedding", 3),
                                    ("SkipLayerNormalization", 10),
                                    ("SkipSimplifiedLayerNormalization", 7),
                                    ("SimplifiedLayerNormalization", 5)])
def test_elementwise_contrib_costs(op, per):
    node = _node(f"y = com.microsoft.{op} (x, b)")
    flops, moved = contrib_flops_bytes(node, [[2, 3, 8], [8]], [[2, 3, 8]], [192, 32],
                                       [192])  # type: ignore[misc]
    assert (flops, moved) == (per * 48, 192 + 32 + 192)


def test_ops_without_an_entry_are_left_to_the_generic_rules():
    assert contrib_flops_bytes(_node("y = Relu (x)"), [[4]], [[4]], [16], [16]) is None


def test_weight_groups_keep_scales_and_zero_points_with_the_packed_weight():
    assert weight_groups(genai_block().graph) == [("qkv_q", "qkv_s"), ("o_q", "o_s", "o_z")]


def test_weight_groups_merge_tied_embeddings():
    model = onnx.parser.parse_model(f"""{HEADER}
    g (int64[1, 8] ids) => (float[1, 8, 256] logits) {{
      e = com.microsoft.GatherBlockQuantized <block_size = 32, bits = 4> (table, ids, scales, zp)
      logits = com.microsoft.MatMulNBits <K = 64, N = 256, bits = 4, block_size = 32>
          (e, table, scales, zp)
    }}""")
    for name, shape in (("table", (256, 2, 16)), ("scales", (512,)), ("zp", (256,))):
        model.graph.initializer.append(
            numpy_helper.from_array(np.zeros(shape, np.uint8 if name != "scales" else
                                             np.float32), name))
    assert weight_groups(model.graph) == [("table", "scales", "zp")]
    # The builder's form: the table is a Reshape of the lm_head's packed weight.
    model.graph.node[0].input[0] = "view"
    model.graph.node.insert(0, onnx.parser.parse_node("view = Reshape (table, shape)"))
    assert weight_groups(model.graph) == [("table", "scales", "zp")]


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
    types = contrib_value_types(model)
    assert [_dims(types[n]) for n in ("h", "k", "m", "z")] == [
        [None, 4], [None, 4], [None, 4], ["a + 2*b", 4]]
