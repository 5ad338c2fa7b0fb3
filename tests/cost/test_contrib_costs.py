"""Cost entries of ORT contrib ops, and the weights that move together."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import pytest
from onnx import numpy_helper

from ho_onnx.target.ort.costs import contrib_flops_bytes, weight_groups

HEADER = '<ir_version: 8, opset_import: ["" : 21, "com.microsoft" : 1]>'


def _node(text: str) -> ir.Node:
    return ir.serde.deserialize_node(onnx.parser.parse_node(text))


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
    model = onnx.parser.parse_model(f"""{HEADER}
    g (float[1, 8, 64] x) => (float[1, 8, 64] y) {{
      h = com.microsoft.MatMulNBits <K = 64, N = 128, bits = 4, block_size = 32> (x, a_q, a_s)
      y = com.microsoft.MatMulNBits <K = 128, N = 64, bits = 4, block_size = 32>
          (h, b_q, b_s, b_z)
    }}""")
    for name, shape, dt in (("a_q", (128, 2, 16), np.uint8), ("a_s", (256,), np.float32),
                            ("b_q", (64, 4, 16), np.uint8), ("b_s", (256,), np.float32),
                            ("b_z", (128,), np.uint8)):
        model.graph.initializer.append(numpy_helper.from_array(np.zeros(shape, dt), name))
    assert weight_groups(ir.from_proto(model).graph) == [("a_q", "a_s"), ("b_q", "b_s", "b_z")]


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
    assert weight_groups(ir.from_proto(model).graph) == [("table", "scales", "zp")]
    # The builder's form: the table is a Reshape of the lm_head's packed weight.
    model.graph.node[0].input[0] = "view"
    model.graph.node.insert(0, onnx.parser.parse_node("view = Reshape (table, shape)"))
    assert weight_groups(ir.from_proto(model).graph) == [("table", "scales", "zp")]
