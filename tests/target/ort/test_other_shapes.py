"""A model planned at one binding of its symbolic dims runs at every other one, with the
unmodified model's answers (issue 34, item 1).

The rewriter once declared each activation Prefetch/Wait output with the analysis's bound
shape (``[1, 64, 8]`` for ``--dim seq=64``). ORT takes declared shapes as fact: ``Shape`` of
such a value folded to the planned size (a wrong answer at every other length, no error),
and MatMul+Add became a Gemm between reshapes baked for the planned length (a failed run).
``verify`` at the planned dims passed, so each test here runs at other dims, at several of
ORT's optimization levels, against the unmodified model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from graphs import save, text_model

from ho_onnx import contract
from ho_onnx.graph.analyse import analyse
from ho_onnx.rewrite.insert import insert_cache_ops
from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.schedule.policy import choose
from ho_onnx.target.ort.verify import verify
from models.decoder import build_decoder

pytestmark = pytest.mark.usefixtures("no_debug_hooks")

# ``a`` is used early (``b``) and late (``Shape(a)`` and ``y``): it is stored across the gap.
SHAPE_OF_OFFLOADED = """
g (float[batch, seq, 8] x) => (float[batch, seq, 8] y, int64[1] n) {
  a = Relu(x)
  b = Sigmoid(a)
  c = Tanh(b)
  d = Neg(c)
  e = Abs(d)
  s = Shape(a)
  idx = Constant<value = int64[1] {1}>()
  n = Gather(s, idx)
  y = Add(e, a)
}
"""
# every activation and weight, biases included, offloaded (``min_bytes`` 0)
ALL = OffloadOptions(min_bytes=0, min_gap=1, prefetch_distance=2)
# biases stay resident: ORT then fuses MatMul+Add into a Gemm where it knows the shapes
NO_BIASES = OffloadOptions(min_bytes=1024, min_gap=1, prefetch_distance=2)
LEVELS = ["disable", "basic", "extended", "all"]


def _wait_shapes(model: onnx.ModelProto) -> dict[str, list[int | str | None]]:
    """Declared shape of each Wait output, by the name of the value it brings back."""
    declared = {vi.name: vi.type.tensor_type.shape for vi in model.graph.value_info}
    out = {}
    for n in model.graph.node:
        if n.domain == contract.DOMAIN and n.op_type == contract.WAIT:
            shape = declared[n.output[0]]
            out[n.output[0].split(".ho_")[0]] = [
                d.dim_value if d.HasField("dim_value") else d.dim_param or None
                for d in shape.dim]
    return out


def test_declared_shapes_keep_the_models_symbolic_dims():
    """Bound dims never reach the rewritten model: the model's own names are kept where
    shape inference carries them, a dim it cannot name is unknown, fixed dims stay."""
    model = text_model("""
    g (float[batch, seq, 8] x) => (float[batch, seq, 8] y) {
      a = Relu(x)
      shp = Constant<value = int64[2] {-1, 8}>()
      f = Reshape(a, shp)
      b = Sigmoid(f)
      c = Tanh(b)
      d = Neg(c)
      e = Add(d, f)
      y = Add(a, a)
    }
    """)
    a = analyse(model, {"batch": 1, "seq": 64})
    assert a.tensors["a"].shape == (1, 64, 8) and a.tensors["f"].shape == (64, 8)
    r = insert_cache_ops(a, choose(a, OffloadOptions(min_bytes=0, min_gap=1,
                                                     prefetch_distance=2)))
    shapes = _wait_shapes(ir.to_proto(r.model))
    assert shapes["a"] == ["batch", "seq", 8], shapes
    assert shapes["f"] == [None, 8], shapes  # batch*seq: no name; 8 stays fixed
    # nothing bound: the analysis's shapes are the model's
    a = analyse(model)
    assert a.unbound_shape("a") == ("batch", "seq", 8)


@pytest.mark.parametrize("level", LEVELS)
def test_shape_of_an_offloaded_activation_at_other_lengths(tmp_path, level):
    src = save(text_model(SHAPE_OF_OFFLOADED), tmp_path / "m.onnx")
    r = optimize(src, tmp_path / "m.ho.onnx", ALL, {"batch": 1, "seq": 64})
    assert "a" in {x.name for x in r.choice.activations}
    for seq in (8, 64, 100):
        rep = verify(src, tmp_path / "m.ho.onnx", dims={"batch": 1, "seq": seq},
                     opt_level=level, isolate=False)
        assert rep.exact, (seq, rep.outputs)
    # the answer itself, from a plain ORT session with the library registered
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    from ho_onnx import session_options
    sess = ort.InferenceSession(str(tmp_path / "m.ho.onnx"),
                                session_options(tmp_path / "m.ho.onnx", base=so))
    n = sess.run(["n"], {"x": np.ones((1, 8, 8), np.float32)})[0]
    assert n.tolist() == [8]


def _decoder(tmp: Path, **kw) -> Path:
    path = tmp / "dec.onnx"
    build_decoder(path, external_data=True, **kw)
    return path


@pytest.mark.parametrize("options", [ALL, NO_BIASES], ids=["all", "biases-resident"])
def test_decoder_planned_at_one_length_runs_at_others(tmp_path, options):
    """Biases resident is the case the Gemm fusion broke (``gemm_input_reshape``)."""
    src = _decoder(tmp_path, layers=2, hidden=64, heads=4)
    r = optimize(src, tmp_path / "dec.ho.onnx", options, {"batch": 1, "seq": 64})
    assert r.choice.activations
    for level in ("basic", "all"):
        for batch, seq in ((1, 8), (1, 64), (2, 100), (3, 1)):
            rep = verify(src, tmp_path / "dec.ho.onnx", dims={"batch": batch, "seq": seq},
                         opt_level=level, isolate=False)
            assert rep.exact, (level, batch, seq, rep.outputs)


def test_kv_decoder_planned_for_prefill_runs_decode_steps(tmp_path):
    """Planned at a prefill (16 tokens, no past), run as decode steps (1 token, a past).
    Bit-exact at ``basic``; at ``all`` within 1e-6: ORT folds the attention's Transposes into
    FusedMatMul in the original where cache ops separate them in the rewrite (also at the
    planned dims; measured max abs 4.5e-8)."""
    src = _decoder(tmp_path, layers=2, hidden=32, heads=2, max_positions=64, kv_cache=True)
    optimize(src, tmp_path / "dec.ho.onnx", NO_BIASES, {"batch": 1, "seq": 16, "past": 0})
    for level in ("basic", "all"):
        for dims in ({"batch": 1, "seq": 1, "past": 16}, {"batch": 2, "seq": 3, "past": 40},
                     {"batch": 1, "seq": 16, "past": 0}):
            tol = 0.0 if level == "basic" else 1e-6
            rep = verify(src, tmp_path / "dec.ho.onnx", dims=dims, opt_level=level,
                         isolate=False, atol=tol)
            assert rep.exact if level == "basic" else rep.ok, (level, dims, rep.outputs)
