"""Weights read by Loop/Scan bodies (issue 38, item 4): reloaded once before the Loop in the
main graph (the Loop their reader), the body's reads pointed at that Wait; run in ORT
against the unmodified model at several trip counts."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from ho_onnx.graph.analyse import analyse
from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.eligibility import hoisted_readers, ineligible
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.target.ort import runtime

HEADER = '<ir_version: 9, opset_import: ["" : 17]>'

# W1 is read inside the Loop body, W3 inside an If nested in it (depth 2); W0 and W2 by the
# main graph.
LOOP = """
lp (float[64, 64] x, int64 n, bool flip) => (float[64, 64] y) {
  a = MatMul(x, W0)
  cond = Constant<value = bool {1}>()
  out = Loop(n, cond, a) <body = body (int64 i, bool c, float[64, 64] h) => (bool c2,
                                                                          float[64, 64] h2) {
      c2 = Identity(c)
      t = MatMul(h, W1)
      u = If(flip) <then_branch = th () => (float[64, 64] r) { r = MatMul(t, W3) },
                    else_branch = el () => (float[64, 64] r) { r = Tanh(t) }>
      h2 = Tanh(u)
  }>
  y = MatMul(out, W2)
}
"""

# The same weight read by the Loop body and by an If branch of the main graph.
SHARED = """
sh (float[64, 64] x, int64 n, bool flip) => (float[64, 64] y) {
  cond = Constant<value = bool {1}>()
  out = Loop(n, cond, x) <body = body (int64 i, bool c, float[64, 64] h) => (bool c2,
                                                                          float[64, 64] h2) {
      c2 = Identity(c)
      h2 = MatMul(h, W1)
  }>
  y = If(flip) <then_branch = th () => (float[64, 64] r) { r = MatMul(out, W1) },
                else_branch = el () => (float[64, 64] r) { r = Tanh(out) }>
}
"""


def _model(text: str, names: tuple[str, ...]) -> onnx.ModelProto:
    m = onnx.parser.parse_model(f"{HEADER}\n{text}")
    rng = np.random.default_rng(0)
    for k in names:
        m.graph.initializer.append(numpy_helper.from_array(
            (rng.standard_normal((64, 64)) / 8).astype(np.float32), k))
    onnx.checker.check_model(m)
    return m


def test_a_weight_read_by_a_loop_body_is_read_by_the_loop():
    a = analyse(_model(LOOP, ("W0", "W1", "W2", "W3")))
    loop = next(i for i, n in enumerate(a.nodes) if n.op_type == "Loop")
    for w in ("W1", "W3"):  # (W3: inside an If inside the body)
        assert hoisted_readers(a, a.tensors[w]) == (loop,)
        assert ineligible(a.tensors[w], a) is None
        assert "subgraph" in ineligible(a.tensors[w])  # (without the analysis: as before)
    s = analyse(_model(SHARED, ("W1",)))
    assert hoisted_readers(s, s.tensors["W1"]) == ()  # an If branch reads it too
    assert "subgraph" in ineligible(s.tensors["W1"], s)


@pytest.mark.parametrize("budget", [False, True], ids=["explicit", "planner"])
def test_loop_weights_reloaded_once_per_run(tmp_path, budget):
    src = tmp_path / "loop.onnx"
    onnx.save(_model(LOOP, ("W0", "W1", "W2", "W3")), str(src))
    # (the planner's budget: the four weights and two activations do not fit, so it must
    # offload one of the Loop's weights too)
    opts = OffloadOptions(budget=64 * 64 * 4 * 3 + 4096, activations=False, min_bytes=0) \
        if budget else OffloadOptions(min_bytes=0, activations=False, prefetch_distance=1)
    r = optimize(src, tmp_path / "o" / "m.onnx", opts)
    loop = next(i for i, n in enumerate(r.analysis.nodes) if n.op_type == "Loop")
    by_name = {w.name: w for w in r.choice.weights}
    assert ({"W1", "W3"} <= set(by_name)) if not budget else ({"W1", "W3"} & set(by_name))
    for w in ("W1", "W3"):
        if w in by_name:
            assert by_name[w].consumers == (loop,)
            assert w not in r.choice.skipped
    out = onnx.load(str(tmp_path / "o" / "m.onnx"))
    hoisted = {"W1", "W3"} & set(by_name)  # (no longer initializers: the body reads a Wait)
    assert not hoisted & {i.name for i in out.graph.initializer}
    sess = runtime.InferenceSession(str(tmp_path / "o" / "m.onnx"))
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)
    moved = len(r.choice.weights)
    for n, flip in ((0, True), (1, False), (5, True), (3, False)):
        feeds = {"x": x, "n": np.array(n, np.int64), "flip": np.array(flip)}
        runtime.reset_counters()
        got = sess.run(None, feeds)[0]
        np.testing.assert_array_equal(got, ref.run(None, feeds)[0])
        assert runtime.counters()["prefetches"] == moved  # once per run, whatever n


def test_a_weight_an_if_branch_reads_too_stays_resident(tmp_path):
    src = tmp_path / "shared.onnx"
    onnx.save(_model(SHARED, ("W1",)), str(src))
    r = optimize(src, tmp_path / "o" / "m.onnx",
                 OffloadOptions(min_bytes=0, activations=False, prefetch_distance=1))
    assert "W1" not in {w.name for w in r.choice.weights}
    assert "Loop" in r.choice.skipped["W1"] and "If branch" in r.choice.skipped["W1"]
    sess = runtime.InferenceSession(str(tmp_path / "o" / "m.onnx"))
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(2).standard_normal((64, 64)).astype(np.float32)
    for n, flip in ((2, True), (2, False)):
        feeds = {"x": x, "n": np.array(n, np.int64), "flip": np.array(flip)}
        np.testing.assert_array_equal(sess.run(None, feeds)[0], ref.run(None, feeds)[0])
