"""The schedule verifier (rewrite.invariants, run after every insertion): hand-written
graphs that break one invariant each are refused with the node named; the well-formed one
each starts from passes."""

from __future__ import annotations

import re

import onnx.parser
import onnx_ir as ir
import pytest
from graphs import chain_model, save

from ho_onnx.errors import ScheduleError
from ho_onnx.rewrite.invariants import check_schedule
from ho_onnx.rewrite.passes import VerifySchedulePass

HEADER = '<ir_version: 8, opset_import: ["" : 17, "ai.hyperoffload" : 1]>'
HO = "ai.hyperoffload"

# Two host-tier weight Prefetches chained FIFO on the load channel, a disk-tier one on its
# own channel, and an activation stored, detached, reloaded (its Prefetch chained too).
GOOD = f"""
g (float[4] x, float[0] src) => (float[4] y) {{
  [pf1] a1, i1 = {HO}.Prefetch <name = "W1", shape = [4]> (src, x)
  [pfd] d1 = {HO}.Prefetch <name = "D", shape = [4], tier = "disk"> (src, x)
  [w1] b1 = {HO}.Wait(a1)
  [mul] h = Mul(x, b1)
  [st] t = {HO}.Store(h)
  [wd] e1 = {HO}.Wait(d1)
  [add] k = Add(h, e1)
  [det] t2 = {HO}.Detach(h, t, k)
  [pf2] a2, i2 = {HO}.Prefetch <name = "W2", shape = [4]> (src, k, i1)
  [pf3] a3 = {HO}.Prefetch(t2, k, i2)
  [w2] b2 = {HO}.Wait(a2)
  [w3] b3 = {HO}.Wait(a3)
  [sub] s = Sub(k, b2)
  [out] y = Add(s, b3)
}}
"""


def _model(text: str) -> ir.Model:
    return ir.from_proto(onnx.parser.parse_model(f"{HEADER}\n{text}"))


def _broken(old: str, new: str) -> ir.Model:
    assert old in GOOD
    return _model(GOOD.replace(old, new))


def test_a_well_formed_schedule_passes_and_the_pass_changes_nothing():
    model = _model(GOOD)
    check_schedule(model)
    result = VerifySchedulePass()(model)
    assert result.model is model and not result.modified


@pytest.mark.parametrize("old,new,message", [
    # a Prefetch dropped: its Wait reads a value nothing produces
    ("  [pf1] a1, i1 = {HO}.Prefetch <name = \"W1\", shape = [4]> (src, x)\n", "",
     "node 'w1' reads 'a1', which nothing produces"),
    # a Wait reading a compute node's output
    ("[w2] b2 = {HO}.Wait(a2)", "[w2] b2 = {HO}.Wait(k)", "Wait 'w2' does not read a Prefetch"),
    # a compute node reading a Prefetch's output without the Wait
    ("[sub] s = Sub(k, b2)", "[sub] s = Sub(k, a2)", "node 'sub' reads Prefetch 'pf2'"),
    # the Store's token goes nowhere (the Detach reads another tensor's token)
    ("[det] t2 = {HO}.Detach(h, t, k)", "[det] t2 = {HO}.Detach(h, i1, k)",
     "Store 'st''s token reaches no Detach"),
    # the Detach releases a tensor other than the one stored
    ("[det] t2 = {HO}.Detach(h, t, k)", "[det] t2 = {HO}.Detach(k, t, k)",
     "Store 'st''s token reaches no Detach"),
    # the Detach's token reaches no Prefetch (a Wait reads it)
    ("[pf3] a3 = {HO}.Prefetch(t2, k, i2)\n  [w2] b2 = {HO}.Wait(a2)\n  [w3] b3 = {HO}.Wait(a3)",
     "[pf3] a3 = {HO}.Prefetch(src, k, i2)\n  [w2] b2 = {HO}.Wait(a2)\n  [w3] b3 = {HO}.Wait(t2)",
     "Store 'st''s token reaches Detach 'det' but no Prefetch"),
    # the load channel's second Prefetch not chained after the first
    ("(src, k, i1)", "(src, k)", "Prefetch 'pf2' is not chained after Prefetch 'pf1' on the "
     "'load' channel"),
    # chained after the Prefetch before the one before
    ("(t2, k, i2)", "(t2, k, i1)", "Prefetch 'pf3' is not chained after Prefetch 'pf2'"),
], ids=["dangling", "wait-reads-compute", "compute-reads-prefetch", "token-to-no-detach",
        "detach-of-another-tensor", "detach-token-to-no-prefetch", "unchained",
        "chained-to-the-wrong-one"])
def test_a_broken_schedule_is_refused_naming_the_node(old, new, message):
    model = _broken(old.replace("{HO}", HO), new.replace("{HO}", HO))
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(")):
        check_schedule(model)


@pytest.mark.parametrize("fence,reader", [
    ("f = {HO}.Fence(x, k)", "r = Neg(f)"),  # well formed
    ("f = {HO}.Fence(x)", "r = Neg(f)"),  # no ordering input: may run (and recompute) early
    ("f = {HO}.Fence(x, k)", "r = {HO}.Store(f)"),  # read by no recomputation
], ids=["good", "unordered", "no-recomputation"])
def test_a_fence_is_ordered_and_read_by_a_recomputation(fence, reader):
    model = _model(f"""
    g (float[4] x) => (float[4] y) {{
      [k0] k = Neg(x)
      [f0] {fence.replace("{HO}", HO)}
      [r0] {reader.replace("{HO}", HO)}
      [out] y = Add(k, k)
    }}
    """)
    if "(x, k)" in fence and "Neg" in reader:
        check_schedule(model)
        return
    with pytest.raises(ScheduleError, match="Fence 'f0' has no ordering input or no reader"):
        check_schedule(model)


@pytest.mark.parametrize("emit,wait,good", [
    ("pr, d = {HO}.Emit(p)", "b = {HO}.Wait(a, d)", True),
    ("pr = {HO}.Emit(p)", "b = {HO}.Wait(a)", False),  # no done: DEFAULT order runs it last
    ("pr, d = {HO}.Emit(p)", "b = {HO}.Wait(a)", False),  # a done nobody reads
], ids=["good", "no-done", "done-unread"])
def test_an_emit_signals_the_next_cache_op(emit, wait, good):
    """A present's Emit is read by nothing, so ORT's DEFAULT order runs it after the whole
    graph unless the next cache op reads its ``done``; the last cache op needs none."""
    def model(emit_first: bool) -> ir.Model:
        lines = [f"[emit] {emit}", f"[w] {wait}"]
        body = "\n      ".join(lines if emit_first else lines[::-1]).replace("{HO}", HO)
        return _model(f"""
    g (float[4] x, float[0] src) => (float[4] y, float[4] pr) {{
      [pf] a, i = {HO}.Prefetch <name = "W", shape = [4]> (src, x)
      [neg] p = Neg(x)
      {body}
      [out] y = Add(p, b)
    }}
    """)
    if good:
        check_schedule(model(True))
    else:
        with pytest.raises(ScheduleError, match="Emit 'emit' has no 'done' output that a later"):
            check_schedule(model(True))
    if "d)" not in wait:  # after the last cache op: nothing to signal
        check_schedule(model(False))


def test_the_wait_moved_above_its_prefetch_is_unsorted():
    text = GOOD.replace("  [w1] b1 = {HO}.Wait(a1)\n".replace("{HO}", HO), "")
    text = text.replace("  [pf1]", f"  [w1] b1 = {HO}.Wait(a1)\n  [pf1]")
    with pytest.raises(ScheduleError, match="node 'w1' reads 'a1' before its producer 'pf1'"):
        check_schedule(_model(text))


def test_a_prefetch_output_as_a_graph_output_is_refused():
    text = GOOD.replace("(float[4] y)", "(float[4] y, float[4] a2)")
    with pytest.raises(ScheduleError, match="graph output 'a2' is Prefetch 'pf2'"):
        check_schedule(_model(text))


def test_a_subgraph_reading_a_later_main_graph_value_is_unsorted():
    text = GOOD.replace("[out] y = Add(s, b3)", "[out] y0 = Add(s, b3)\n  [g2] y = Identity(y0)")
    text = text.replace("[mul] h = Mul(x, b1)", "[mul] h0 = Mul(x, b1)\n"
                        "  [if] h = If(c) <then_branch = t () => (float[4] o) { o = Neg(s) }, "
                        "else_branch = e () => (float[4] o) { o = Identity(h0) }>")
    text = text.replace("float[0] src)", "float[0] src, bool c)")
    with pytest.raises(ScheduleError, match="node 'if' reads 's' before its producer 'sub'"):
        check_schedule(_model(text))


WAIT_REWIRED = re.escape("Wait 'ho.wait.W1.0' does not read a Prefetch")


@pytest.fixture
def broken_insertion(monkeypatch):
    """The insertion, then its first Wait rewired to read the graph input instead."""
    from ho_onnx.rewrite import passes

    real = passes.insert_cache_ops

    def insert(analysis, choice):
        result = real(analysis, choice)
        graph = result.model.graph
        wait = next(n for n in graph if n.op_type == "Wait")
        wait.replace_input_with(0, graph.inputs[0])
        return result

    monkeypatch.setattr(passes, "insert_cache_ops", insert)


@pytest.mark.usefixtures("broken_insertion")
def test_optimize_runs_the_verifier_after_the_insertion(tmp_path):
    from ho_onnx.rewrite.pipeline import optimize
    from ho_onnx.schedule.options import OffloadOptions

    src = save(chain_model(), tmp_path / "m.onnx")
    with pytest.raises(ScheduleError, match=WAIT_REWIRED):
        optimize(src, tmp_path / "o.onnx", OffloadOptions(min_bytes=0), {"N": 4})
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.usefixtures("broken_insertion")
def test_offload_pass_runs_the_verifier_after_the_insertion(tmp_path):
    from ho_onnx.rewrite.passes import OffloadPass
    from ho_onnx.schedule.options import OffloadOptions
    from ho_onnx.schedule.policy import ExplicitPolicy

    model = ir.load(save(chain_model(), tmp_path / "m.onnx", external=True))
    with pytest.raises(ScheduleError, match=WAIT_REWIRED):
        OffloadPass(ExplicitPolicy(OffloadOptions(min_bytes=0)), {"N": 4})(model)


# A Loop whose body stores and reloads its state each iteration, marked per iteration; the
# main graph's own Store is reloaded after the Loop.
LOOPED = f"""
lg (float[4] x, int64 n) => (float[4] y) {{
  [st] t = {HO}.Store(x)
  [det] t2 = {HO}.Detach(x, t)
  [c] cond = Constant<value = bool {{1}}>()
  [loop] out = Loop(n, cond, x) <body = body (int64 i, bool c, float[4] h) => (bool c2,
                                                                             float[4] h2) {{
      [id] c2 = Identity(c)
      [bst] bt = {HO}.Store <iteration = 1> (h)
      [bdet] bt2 = {HO}.Detach <iteration = 1> (h, bt)
      [bpf] bp = {HO}.Prefetch <iteration = 1> (bt2)
      [bw] bz = {HO}.Wait <iteration = 1> (bp)
      [tanh] h2 = Tanh(bz)
  }}>
  [pf] p = {HO}.Prefetch(t2, out)
  [w] r = {HO}.Wait(p)
  [add] y = Add(out, r)
}}
"""


@pytest.mark.parametrize("old,new,message", [
    ("[bw] bz = {HO}.Wait <iteration = 1> (bp)", "[bw] bz = {HO}.Wait(bp)",
     "Wait 'bw' is inside a Loop/Scan body without attribute iteration = 1"),
    ("[w] r = {HO}.Wait(p)", "[w] r = {HO}.Wait <iteration = 1> (p)",
     "Wait 'w' has attribute iteration = 1 outside any Loop/Scan body"),
    # the body's Prefetch ordered by the main graph's Detach: an iteration's chains are its own
    ("[bpf] bp = {HO}.Prefetch <iteration = 1> (bt2)", "[bpf] bp = {HO}.Prefetch "
     "<iteration = 1> (bt2, t2)", "Prefetch 'bpf' inside a Loop/Scan body reads Detach 'det'"),
])
def test_a_loop_bodys_cache_ops_are_marked_per_iteration(old, new, message):
    check_schedule(_model(LOOPED))
    old, new = old.replace("{HO}", HO), new.replace("{HO}", HO)
    assert old in LOOPED
    with pytest.raises(ScheduleError, match=re.escape(message)):
        check_schedule(_model(LOOPED.replace(old, new)))
