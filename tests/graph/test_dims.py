"""Binding dims: --shape parsing, whole shapes, expression dims, one error for all that is
missing."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import pytest

from ho_onnx.errors import UnboundDimError
from ho_onnx.graph.analyse import analyse
from ho_onnx.graph.dims import (
    MAX_DIM_EXPRESSION,
    dims_from_shapes,
    eval_dim,
    free_names,
    input_shapes,
    missing_dims,
    parse_dim,
    parse_shapes,
)
from tests.graphs import save, text_model

# The inputs of an Optimum text-generation-with-past export.
WITH_PAST = """<ir_version: 8, opset_import: ["" : 18]>
g (int64[batch_size, sequence_length] input_ids,
   int64[batch_size, total] attention_mask,
   float[batch_size, 2, past_sequence_length, 16] past_key)
  => (int64[batch_size, sequence_length] y) { y = Identity (input_ids) }
"""


def with_past_proto() -> onnx.ModelProto:
    model = onnx.parser.parse_model(WITH_PAST)  # (ONNX text has no expression dims)
    model.graph.input[1].type.tensor_type.shape.dim[1].dim_param = (
        "past_sequence_length + sequence_length")
    return model


def with_past() -> ir.Model:
    return ir.from_proto(with_past_proto())


def paddle_like() -> ir.Model:
    """An input whose dynamic dims have no name, another named '?' (as Paddle exports)."""
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18]>
    g (float[1, 3, H, W] x, float[N] z) => (float[1, 3, H, W] y) { y = Identity (x) }""")
    x = model.graph.input[0].type.tensor_type.shape.dim
    x[2].ClearField("dim_param")  # no name at all
    x[3].dim_param = "?"
    return ir.from_proto(model)


def test_parse_shapes():
    assert parse_shapes(["x=1,3,48,320", "ids=1x8"]) == {"x": [1, 3, 48, 320], "ids": [1, 8]}
    assert parse_shapes(["input:0=2,4"]) == {"input:0": [2, 4]}
    assert parse_shapes(["a=b=7"]) == {"a=b": [7]}  # the name is all before the last '='
    for bad in ("x", "x=", "=1,2", "x=1,?", "x=1,,2"):
        with pytest.raises(ValueError, match="INPUT=D0,D1"):
            parse_shapes([bad])


def test_free_names():
    assert free_names("past_sequence_length + sequence_length") == [
        "past_sequence_length", "sequence_length"]
    assert free_names("2*seq // 3") == ["seq"]
    assert free_names("?") is None
    assert free_names("p2o.DynamicDimension.0") is None
    assert free_names("f(x)") is None


def test_a_model_dim_no_parser_can_take_is_no_expression():
    """A 6,000-character ``b*b*...*b`` was an unexpected RecursionError in Python's parser; a
    null byte a ValueError. Now they are dims that are no expression (a whole shape, or
    ``--dim`` with the dim itself as the name, gives them)."""
    deep = "*".join(["b"] * 3000)
    for dim in (deep, "(" * 400 + "b" + ")" * 400, "b\x00", "b" * 501):
        assert parse_dim(dim) is None and free_names(dim) is None
        with pytest.raises(UnboundDimError, match="no value"):
            eval_dim(dim, {"b": 2})
        assert eval_dim(dim, {dim: 3}) == 3
    near = "*".join(["b"] * 250)  # the longest kind still evaluated
    assert len(near) <= MAX_DIM_EXPRESSION and eval_dim(near, {"b": 2}) == 2**250


def test_expression_dims_are_evaluated_as_plan_does():
    shapes = input_shapes(with_past(), {"batch_size": 1, "sequence_length": 8,
                                        "past_sequence_length": 4})
    assert shapes == {"input_ids": [1, 8], "attention_mask": [1, 12],
                      "past_key": [1, 2, 4, 16]}


def test_every_unbound_dim_in_one_error():
    with pytest.raises(UnboundDimError) as e:
        input_shapes(with_past(), {"batch_size": 1})
    msg = str(e.value)
    assert "sequence_length" in msg and "past_sequence_length" in msg
    assert "--dim sequence_length=<value>" in msg and "--dim past_sequence_length=<value>" in msg
    assert "batch_size" not in msg
    assert "\n" not in msg


def test_unnamed_and_odd_dims_ask_for_whole_shapes():
    with pytest.raises(UnboundDimError) as e:
        input_shapes(paddle_like(), {})
    msg = str(e.value)
    assert "--shape x=1,3,N,N" in msg
    assert "--dim ?=<value>" not in msg
    assert "--dim N=<value>" in msg  # z's dim has a plain name (not "N=N")
    shapes = input_shapes(paddle_like(), {"N": 5}, {"x": [1, 3, 48, 320]})
    assert shapes == {"x": [1, 3, 48, 320], "z": [5]}


def test_whole_shapes_bind_the_dims_they_name():
    dims = dims_from_shapes(with_past(), {"input_ids": [2, 7]})
    assert dims == {"batch_size": 2, "sequence_length": 7}
    shapes = input_shapes(with_past(), {"past_sequence_length": 0}, {"input_ids": [2, 7]})
    assert shapes["attention_mask"] == [2, 7]


@pytest.mark.parametrize("shapes,dims,match", [
    ({"nope": [1]}, {}, "no input 'nope'"),
    ({"input_ids": [1, 2, 3]}, {}, "rank 2"),
    ({"past_key": [1, 3, 4, 16]}, {}, "fixed"),
    ({"input_ids": [1, 8]}, {"batch_size": 2}, "'batch_size' is 2"),
])
def test_whole_shape_errors(shapes, dims, match):
    with pytest.raises(UnboundDimError, match=match):
        dims_from_shapes(with_past(), shapes, dims)


def test_missing_dims():
    names, odd = missing_dims(["a + b", "c", "a", "?", "b*2"], {"b": 1})
    assert names == ["a", "c"]
    assert odd == ["?"]


def test_require_dims_names_all_at_once():
    from ho_onnx.graph.dims import require_dims

    require_dims(["a + b", "?"], {"a": 1, "b": 2})  # odd dims are the caller's business
    with pytest.raises(UnboundDimError, match=r"'a', 'c' .*--dim a=<value> --dim c=<value>"):
        require_dims(["a + b", "c", "2*a"], {"b": 1})


def test_unused_dims_are_named_with_the_closest_missing_one():
    """A misspelt ``--dim`` (found by hand: ``--dim btach=4`` was ignored without a word) is
    named beside the missing dim it resembles; a dim an expression uses, one only declared
    (``model``), and a dim that is no expression but bound by its text are used."""
    from ho_onnx.graph.dims import require_dims, unused_dims, unused_note

    assert unused_dims(["a + b", "?", "batch", "c*" * 300 + "c"],
                       {"a": 1, "b": 2, "?": 3, "btach": 4, "c": 5}) == ["btach"]
    assert unused_note(["btach", "zzz"], ["batch", "seq"]) == (
        "--dim btach names no dim of the model (did you mean 'batch'?); "
        "--dim zzz names no dim of the model")
    with pytest.raises(UnboundDimError, match=r"--dim batch=<value>\); --dim btach names no dim of "
                                              r"the model \(did you mean 'batch'\?\)$"):
        require_dims(["batch", "seq"], {"btach": 1, "seq": 2})
    with pytest.raises(UnboundDimError) as e:  # bound dims leave the expressions: the model
        require_dims(["sequence_length"], {"batch_size": 2}, model=with_past())
    assert "batch_size" not in str(e.value)


def test_declared_dims_and_inputs_hint():
    """Every graph's inputs, outputs and value_info declare dims; ``input_shapes`` (verify,
    profile) names a --dim none of the inputs use, and not those a --shape bound."""
    from ho_onnx.graph.dims import declared_dims

    proto = with_past_proto()
    proto.graph.node.append(onnx.helper.make_node("Identity", ["past_key"], ["v"]))
    proto.graph.value_info.append(onnx.helper.make_tensor_value_info(
        "v", onnx.TensorProto.FLOAT, ["hidden_len"]))
    model = ir.from_proto(proto)
    assert declared_dims(model) == ["batch_size", "sequence_length",
                                    "past_sequence_length + sequence_length",
                                    "past_sequence_length", "hidden_len"]
    from ho_onnx.graph.dims import unused_in_model

    assert declared_dims(model, everywhere=False) == declared_dims(model)[:-1]
    # the main graph's signature first, the value_info only for a name not found there
    assert unused_in_model(model, {"batch_size": 1, "hidden_len": 2, "hiden": 3}) == (
        ["hiden"], ["batch_size", "sequence_length", "past_sequence_length", "hidden_len"])
    with pytest.raises(UnboundDimError, match=r"'past_sequence_length' .*; --dim "
                       r"past_seqlen names no dim of the model's inputs \(did you mean "
                       r"'past_sequence_length'\?\)$"):
        input_shapes(model, {"past_seqlen": 3}, {"input_ids": [1, 4]})


def test_mask_inputs():
    from ho_onnx.graph.dims import is_mask_input

    assert is_mask_input("attention_mask") and is_mask_input("encoder_attention_mask")
    assert not is_mask_input("input_ids") and not is_mask_input("mask_token")


@pytest.mark.parametrize("value", [-1, 2**64, True, 1.5, "8", None])
def test_library_callers_bindings_must_be_sizes(value):
    """Found by hand: ``optimize(..., dims={"batch": -1})`` planned without a word; 2**64,
    True, 1.5 or a string were unexpected errors from protobuf or int()."""
    m = text_model("g (float[batch,4] x) => (float[batch,4] y) { y = Relu (x) }")
    with pytest.raises(UnboundDimError, match=r"'batch'.*is not a size"):
        analyse(m, {"batch": value})
    with pytest.raises(UnboundDimError, match=r"shape of 'x'.*is not a size"):
        analyse(m, shapes={"x": [value, 4]})
    assert analyse(m, {"batch": np.int64(3)}).tensors["y"].shape == (3, 4)


# ---- a dim bound past the model's own tables (issue 35: README's seq=2048 on a 1,024-row
# position table planned without a word, and verify then failed with ORT's Gather error) --

def test_a_dim_past_the_position_table_is_one_error_at_plan_time():
    from models.decoder import build_decoder

    m = build_decoder(layers=1, hidden=16, heads=2, vocab=32, max_positions=16)
    analyse(m, {"batch": 1, "seq": 16})  # the last row is allowed
    with pytest.raises(UnboundDimError) as e:
        analyse(m, {"batch": 1, "seq": 17})
    assert str(e.value) == (
        "dim seq=17 is past what the model allows: node 'embed.pos' (Gather) reads 0..16 along "
        "axis 0 of the constant 'embed.pos.weight', which has 16 (a position or mask table the "
        "model was built with): bind a smaller value")
    kv = build_decoder(layers=1, hidden=16, heads=2, vocab=32, max_positions=16, kv_cache=True)
    analyse(kv, {"batch": 1, "seq": 4, "past": 12})
    with pytest.raises(UnboundDimError, match=r"^dims past=12, seq=5 are past what the model "
                                              r"allows: .* reads 12\.\.16 along axis 0"):
        analyse(kv, {"batch": 1, "seq": 5, "past": 12})


MASK_SLICE = """
g (float[batch, seq] x) => (float[batch, seq] y)
  <int64[1] zero = {0}, int64[1] one = {1}, int64[1] two = {2}, int64[1] axis1 = {1},
   int64[1] to_end = {%d}> {
    shape = Shape (x)
    seq_1 = Slice (shape, one, two)
    row = Slice (mask, zero, seq_1, axis1)
    y = Mul (x, row)
    rest = Slice (mask, zero, to_end, axis1)
}
"""


@pytest.mark.parametrize("to_end", [8, 9223372036854775807])
def test_a_dim_past_a_sliced_constant_is_refused_a_constant_end_is_not(to_end):
    """A Slice of a constant whose end comes from a dim (a causal-mask buffer) past its size
    is refused (ORT would clamp it and fail later broadcasting); an end written as a
    constant past the size ("to the end") is no error, nor is the end at the size."""
    m = text_model(MASK_SLICE % to_end, mask=(1, 8))
    analyse(m, {"batch": 2, "seq": 8})
    with pytest.raises(UnboundDimError, match=r"^dim seq=9 is past what the model allows: "
                                              r"node .* \(Slice\) reads 0\.\.8 along axis 1 of "
                                              r"the constant 'mask', which has 8"):
        analyse(m, {"batch": 2, "seq": 9})


_MASKED = """
g (int64[1, {ids}] input_ids, int64[1, {mask}] attention_mask, float[1, P, 16] past_key)
  => (float[1, {ids}, 16] y) {{
  e = Gather(E, input_ids)
  y = MatMul(e, W)
}}
"""


@pytest.mark.parametrize("mask", ["S", "T"])
def test_a_mask_named_like_the_new_tokens_is_warned_about(tmp_path, mask):
    """Optimum's merged export names attention_mask's length like input_ids' new tokens
    (``sequence_length``), though with a KV cache it is past + new tokens: a range sized for
    the new tokens is left at the first decode step past it (the Guard then refuses it).
    ``optimize`` says so for that model, and nothing for a mask of its own dim."""
    from ho_onnx.graph.dims import context_named_as_new_tokens
    from ho_onnx.rewrite.pipeline import optimize
    from ho_onnx.schedule.options import OffloadOptions

    m = text_model(_MASKED.format(ids="S", mask=mask), E=(100, 16), W=(16, 16))
    ranges = {"S": (1, 8), "P": (0, 64), **({"T": (1, 72)} if mask == "T" else {})}
    said: list[str] = []
    optimize(save(m, tmp_path / "m.onnx"), tmp_path / "o.onnx",
             OffloadOptions(min_bytes=0, activations=False), {}, dim_ranges=ranges,
             log=said.append)
    warned = [s for s in said if s.startswith("warning: attention_mask's length")]
    assert len(warned) == (mask == "S"), said
    if warned:
        assert "the range S=1..8 must reach the whole context" in warned[0]
    assert context_named_as_new_tokens(ir.from_proto(m), {"P": (0, 64)}) == []
    wide = {"S": (1, 72), "P": (0, 64)}  # (it reaches the whole context: no warning)
    assert context_named_as_new_tokens(ir.from_proto(m), wide) == []
