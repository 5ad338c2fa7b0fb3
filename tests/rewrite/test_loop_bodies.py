"""Weights read by Loop/Scan bodies (issue 38, item 4): reloaded once before the Loop in the
main graph (the Loop their reader), the body's reads pointed at that Wait; run in ORT
against the unmodified model at several trip counts."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import onnxruntime as ort
import pytest
from graphs import LOOP_LAYERS as LAYERS
from graphs import LOOP_N as N
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


# --------------------------------------------------------------------------------------------
# Bodies planned per iteration (a budget planner): the body is a graph of its own, its cache
# ops run at every iteration (attribute ``iteration`` = 1), each iteration's loads its own.

W = N * N * 4

# A body that walks stacked weights: iteration i reads WS[i] (a Gather of the loop counter).
STACKED = """
sw (float[4, 128] x) => (float[4, 128] y) {
  n = Constant<value = int64 {6}>()
  cond = Constant<value = bool {1}>()
  out = Loop(n, cond, x) <body = body (int64 i, bool c, float[4, 128] h) => (bool c2,
                                                                          float[4, 128] h2) {
      c2 = Identity(c)
      w = Gather<axis = 0>(WS, i)
      t = MatMul(h, w)
      h2 = Tanh(t)
  }>
  y = Identity(out)
}
"""

# A Scan over the rows of xs whose body reads two weights.
SCAN = f"""
sc (float[{N}] s0, float[T, {N}] xs) => (float[{N}] s, float[T, {N}] ys) {{
  s, ys = Scan<num_scan_inputs = 1, body = body (float[{N}] st, float[{N}] xt) => (
                                                   float[{N}] st2, float[{N}] yt) {{
      u = Add(st, xt)
      v = MatMul(u, W1)
      st2 = Tanh(v)
      yt = MatMul(st2, W2)
  }}> (s0, xs)
}}
"""


def _weights_model(text: str, **shapes: tuple[int, ...]) -> onnx.ModelProto:
    m = onnx.parser.parse_model(f"{HEADER}\n{text}")
    rng = np.random.default_rng(0)
    for k, shape in shapes.items():
        m.graph.initializer.append(numpy_helper.from_array(
            (rng.standard_normal(shape) / 16).astype(np.float32), k))
    onnx.checker.check_model(m)
    return m


def _exact_sessions(src, out):
    """The optimized model's session and the source's, pre-packing off in both (the same
    CPU kernels: bit-exact)."""
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    return (runtime.InferenceSession(str(out), sess_options=so),
            ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"]))


def _body(model: onnx.ModelProto, op: str) -> onnx.GraphProto:
    node = next(n for n in model.graph.node if n.op_type == op)
    return next(a.g for a in node.attribute if a.name == "body")


def _cache_ops(g: onnx.GraphProto) -> list[onnx.NodeProto]:
    return [n for n in g.node if n.domain == "ai.hyperoffload"]


def _marked(n: onnx.NodeProto) -> bool:
    return any(a.name == "iteration" and a.i == 1 for a in n.attribute)


def test_a_budget_plans_a_loop_body_per_iteration(tmp_path):
    """The body's four weights do not fit beside what the main graph holds at the Loop: the
    body is planned as a graph of its own, each weight reloaded inside every iteration (a
    hoisted reload would hold all four for the whole Loop); the plan fits its budget and
    outputs are bit-exact at every trip count, with one load per body Prefetch per
    iteration."""
    src = tmp_path / "layers.onnx"
    onnx.save(_weights_model(LAYERS, **{f"W{k}": (N, N) for k in range(6)}), str(src))
    budget = 8 * W
    r = optimize(src, tmp_path / "o" / "m.onnx",
                 OffloadOptions(budget=budget, min_bytes=0, activations=False))
    assert r.decision.fits and r.decision.planned.peak_bytes <= budget
    assert r.decision.baseline.peak_bytes > budget
    note = next(n for n in r.choice.notes if n.startswith("Loop '<unnamed>' body planned"))
    assert "its cache ops run at every iteration, whose count the graph does not fix" in note
    out = onnx.load(str(tmp_path / "o" / "m.onnx"))
    ops = _cache_ops(_body(out, "Loop"))
    body_loads = sum(n.op_type == "Prefetch" for n in ops)
    assert body_loads >= 1 and all(_marked(n) for n in ops)
    main_loads = sum(n.op_type == "Prefetch" for n in _cache_ops(out.graph))
    assert not any(_marked(n) for n in _cache_ops(out.graph))
    sess, ref = _exact_sessions(src, tmp_path / "o" / "m.onnx")
    x = np.random.default_rng(1).standard_normal((N, N)).astype(np.float32)
    for n in (0, 1, 3, 5):
        feeds = {"x": x, "n": np.array(n, np.int64)}
        runtime.reset_counters()
        np.testing.assert_array_equal(sess.run(None, feeds)[0], ref.run(None, feeds)[0])
        c = runtime.counters()
        assert c["prefetches"] == main_loads + body_loads * n
        assert c["bytes_loaded"] >= body_loads * n * W


@pytest.mark.parametrize("budget", [7.5 * W, 9 * W])
def test_a_per_iteration_body_holds_its_budget_in_orts_arena(tmp_path, budget):
    """The budget holds as ORT allocates it: ORT's arena peak, sampled at every Wait (the
    body's included), is the plan's replayed arena within 1 KiB, under the budget. (A body's
    inputs are held by its node for the whole iteration: planned as ending at their last
    reader, the arena was one 256 KiB state above the plan, and over the budget.)"""
    src = tmp_path / "layers.onnx"
    onnx.save(_weights_model(LAYERS, **{f"W{k}": (N, N) for k in range(6)}), str(src))
    r = optimize(src, tmp_path / "o" / "m.onnx",
                 OffloadOptions(budget=int(budget), min_bytes=0, activations=False))
    # (in a process of its own: a fixed-shape model gets the process's shared arena by
    # default, whose MaxInUse is every earlier session's high-water mark too)
    code = (
        "import sys, numpy as np, onnxruntime as ort; from ho_onnx.target.ort import runtime; "
        "so = ort.SessionOptions(); so.add_session_config_entry('ho_onnx.sample_arena', '1'); "
        "s = runtime.InferenceSession(sys.argv[1], sess_options=so); "
        f"x = np.random.default_rng(4).standard_normal(({N}, {N})).astype(np.float32); "
        "s.run(None, {'x': x, 'n': np.array(4, np.int64)}); "
        "print(runtime.counters()['ort_arena_max_in_use'])")
    measured = int(subprocess.run([sys.executable, "-c", code, str(tmp_path / "o" / "m.onnx")],
                                  capture_output=True, text=True, check=True).stdout)
    assert measured > 0  # (a runtime without arena statistics would report -1)
    assert abs(measured - r.decision.arena_bytes) <= 1024, (measured, r.decision.arena_bytes)
    assert measured <= budget


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_body_walking_stacked_weights_gathers_one_slice_per_iteration(tmp_path, tier):
    """Iteration i reads WS[i]: the offloaded stack is read by a GatherRows inside the body,
    which copies (or reads from the data file) only that iteration's slice; a run moves the
    stack once, and the stack is never resident whole."""
    src = tmp_path / "stacked.onnx"
    onnx.save(_weights_model(STACKED, WS=(6, 128, 128)), str(src))
    stack, one = 6 * 128 * 128 * 4, 128 * 128 * 4
    r = optimize(src, tmp_path / "o" / "m.onnx",
                 OffloadOptions(budget=3 * one, min_bytes=0, activations=False,
                                weight_tier=tier))
    assert r.decision.fits and r.decision.planned.peak_bytes < stack
    assert any("6 per run" in n for n in r.choice.notes)
    out = onnx.load(str(tmp_path / "o" / "m.onnx"))
    ops = _cache_ops(_body(out, "Loop"))
    assert [n.op_type for n in ops] == ["GatherRows"] and _marked(ops[0])
    assert "WS" not in {i.name for i in out.graph.initializer}
    sess, ref = _exact_sessions(src, tmp_path / "o" / "m.onnx")
    x = np.random.default_rng(2).standard_normal((4, 128)).astype(np.float32)
    for _ in range(2):
        runtime.reset_counters()
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], ref.run(None, {"x": x})[0])
        c = runtime.counters()
        assert c["bytes_gathered"] == stack and c["prefetches"] == 0
        assert c["bytes_read_disk"] == (stack if tier == "disk" else 0)


def test_a_scan_body_is_planned_per_iteration(tmp_path):
    """A Scan's body likewise, its trip count the scanned dim (bound by ``--dim``); outputs
    bit-exact at the planned length and at others."""
    src = tmp_path / "scan.onnx"
    onnx.save(_weights_model(SCAN, W1=(N, N), W2=(N, N)), str(src))
    r = optimize(src, tmp_path / "o" / "m.onnx",
                 OffloadOptions(budget=W + 24 * N * 4, min_bytes=0, activations=False),
                 {"T": 8})
    assert any("Scan '<unnamed>' body planned" in n and "8 per run" in n
               for n in r.choice.notes)
    out = onnx.load(str(tmp_path / "o" / "m.onnx"))
    ops = _cache_ops(_body(out, "Scan"))
    assert ops and all(_marked(n) for n in ops)
    loads = sum(n.op_type == "Prefetch" for n in ops)
    sess, ref = _exact_sessions(src, tmp_path / "o" / "m.onnx")
    rng = np.random.default_rng(3)
    for t in (1, 8, 13):
        feeds = {"s0": rng.standard_normal(N).astype(np.float32),
                 "xs": rng.standard_normal((t, N)).astype(np.float32)}
        runtime.reset_counters()
        for got, want in zip(sess.run(None, feeds), ref.run(None, feeds), strict=True):
            np.testing.assert_array_equal(got, want)
        assert runtime.counters()["prefetches"] == loads * t


def test_a_range_planned_scan_body_is_guarded(tmp_path):
    """A range plan (``T`` 1..16) whose only cache ops are in the Scan's body: the main
    graph's Guard orders the body's first cache op, so a run at T = 17 is refused before
    any transfer, with the dim, its value and the range; inside the range outputs are
    bit-exact."""
    src = tmp_path / "scan.onnx"
    onnx.save(_weights_model(SCAN, W1=(N, N), W2=(N, N)), str(src))
    out = tmp_path / "o" / "m.onnx"
    optimize(src, out, OffloadOptions(budget=W + 40 * N * 4, min_bytes=0, activations=False),
             {}, dim_ranges={"T": (1, 16)})
    m = onnx.load(str(out), load_external_data=False)
    assert [n.op_type for n in m.graph.node] == ["Guard", "Scan"]
    assert m.graph.node[0].output[0] in _cache_ops(_body(m, "Scan"))[0].input
    sess, ref = _exact_sessions(src, out)
    rng = np.random.default_rng(5)
    for t in (1, 16, 17):
        feeds = {"s0": rng.standard_normal(N).astype(np.float32),
                 "xs": rng.standard_normal((t, N)).astype(np.float32)}
        if t > 16:
            runtime.reset_counters()
            with pytest.raises(Exception, match=r"dim 'T' is 17, outside the range 1\.\.16"):
                sess.run(None, feeds)
            assert runtime.counters()["prefetches"] == 0  # (refused before any transfer)
            continue
        for got, want in zip(sess.run(None, feeds), ref.run(None, feeds), strict=True):
            np.testing.assert_array_equal(got, want)


def test_plan_says_what_the_body_offloads(tmp_path):
    """``ho-onnx plan``: the main graph's ``offloaded:`` line counts its own offloads and
    says what the subgraphs planned apart offload (it read "0 weights" before), then the
    body's own plan with its note (trip count unknown here: timed as one iteration)."""
    from click.testing import CliRunner

    from cli import main

    src = tmp_path / "layers.onnx"
    onnx.save(_weights_model(LAYERS, **{f"W{k}": (N, N) for k in range(6)}), str(src))
    r = CliRunner().invoke(main, ["plan", str(src), "--budget", str(8 * W), "--min-bytes", "0",
                                  "--offload", "weights"])
    assert r.exit_code == 0, r.output
    main_line = next(line for line in r.output.splitlines() if line.startswith("offloaded:"))
    assert "in the subgraphs planned apart (below): " in main_line
    assert "Loop '<unnamed>' body (its own plan, 9 nodes):" in r.output
    assert "whose count the graph does not fix (its time is one iteration's)" in r.output


def test_trip_counts_a_hostile_node_gives_are_unknown():
    """``trip_count``: a Scan's scanned dim (bound), a Loop's constant M; where a model was
    written by hand (attributes of the wrong type or out of range, an M that is no number)
    the count is unknown (None), never an exception."""
    from ho_onnx.rewrite.branches import trip_count

    a = analyse(_weights_model(SCAN, W1=(N, N), W2=(N, N)))
    scan = next(n for n in a.nodes if n.op_type == "Scan")
    assert trip_count(a, scan, {"T": 8}) == 8
    assert trip_count(a, scan, {}) is None  # (T unbound)
    for attr in (ir.AttrFloat32("num_scan_inputs", 1.5), ir.AttrInt64("num_scan_inputs", 7),
                 ir.AttrInt64("num_scan_inputs", 0), ir.AttrString("scan_input_axes", "x"),
                 ir.AttrInt64s("scan_input_axes", [9])):
        saved = scan.attributes.get(attr.name)
        scan.attributes[attr.name] = attr
        assert trip_count(a, scan, {"T": 8}) is None, attr
        if saved is None:
            scan.attributes.pop(attr.name)
        else:
            scan.attributes[attr.name] = saved
    m = onnx.parser.parse_model(f"{HEADER}\n" + STACKED.replace("int64 {6}", 'string {"six"}'))
    la = analyse(m)
    loop = next(n for n in la.nodes if n.op_type == "Loop")
    assert trip_count(la, loop, {}) is None  # (an M that is no number)
    six = analyse(_weights_model(STACKED, WS=(6, 128, 128)))
    assert trip_count(six, next(n for n in six.nodes if n.op_type == "Loop"), {}) == 6
