"""ORT's MatMul fusions in the arena replay (``target/ort/arena.py``'s ``fusions``): the
values they remove are the ones ORT's own optimized model no longer has, and the replay
that knows them is what ORT's arena reports (stop 49: an attention's ``K^T``, replayed as a
buffer of its own, let the replay fall 3 MiB short on a 4-layer decoder at 4k context)."""

from __future__ import annotations

import graphs
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from ho_onnx import _ops
from ho_onnx.contract import CONFIG_SAMPLE_ARENA
from ho_onnx.graph.analyse import analyse
from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.arena import arena_buffer_intervals
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.target.base import Target
from ho_onnx.target.ort import bfc, runtime
from ho_onnx.target.ort.arena import ORT, alias_input, fusions, replay, reuse_key

UNFUSED = Target("onnxruntime, graph optimizations off", alias_input, reuse_key, replay)

# Each graph: which of its values ORT's optimized model drops (checked against ORT below).
CASES = {
    "transpose into the right input": """
g (float[4, 8, 64] q, float[4, 100, 64] k) => (float[4, 8, 100] y) {
  kt = Transpose<perm = [0, 2, 1]>(k)
  y = MatMul(q, kt)
}""",
    "transpose into the left input": """
g (float[4, 64, 8] q, float[4, 64, 100] k) => (float[4, 8, 100] y) {
  qt = Transpose<perm = [0, 2, 1]>(q)
  y = MatMul(qt, k)
}""",
    "the same transpose on both sides": """
g (float[64, 64] x) => (float[64, 64] y) {
  t = Transpose<perm = [1, 0]>(x)
  y = MatMul(t, t)
}""",
    "a transpose of the batch axis first": """
g (float[8, 4, 64] q, float[4, 100, 64] k) => (float[4, 8, 100] y) {
  qt = Transpose<perm = [1, 0, 2]>(q)
  kt = Transpose<perm = [0, 2, 1]>(k)
  y = MatMul(qt, kt)
}""",
    "a transpose of the batch axis first against a lower rank": """
g (float[8, 4, 64] q, float[64, 100] k) => (float[4, 8, 100] y) {
  qt = Transpose<perm = [1, 0, 2]>(q)
  y = MatMul(qt, k)
}""",
    "a transpose that moves the last axis first": """
g (float[4, 100, 64] k, float[64, 8, 4] q) => (float[64, 8, 100] y) {
  kt = Transpose<perm = [2, 0, 1]>(k)
  y = MatMul(q, kt)
}""",
    "a transpose of non-contiguous batch axes": """
g (float[2, 3, 4, 8, 16] x, float[2, 4, 3, 16, 5] w) => (float[2, 4, 3, 8, 5] y) {
  xt = Transpose<perm = [0, 2, 1, 3, 4]>(x)
  y = MatMul(xt, w)
}""",
    "a transpose read by a MatMul and a Relu": """
g (float[8, 64] q, float[100, 64] k) => (float[8, 100] y, float[64, 100] r) {
  kt = Transpose<perm = [1, 0]>(k)
  y = MatMul(q, kt)
  r = Relu(kt)
}""",
    "a transpose of an initializer (folded first)": """
g (float[8, 64] q) => (float[8, 100] y) {
  kt = Transpose<perm = [1, 0]>(K)
  y = MatMul(q, kt)
}""",
    "a scale by a scalar constant": """
g (float[8, 64] a, float[64, 16] b) => (float[8, 16] y) {
  c = Constant<value = float {0.125}>()
  p = MatMul(a, b)
  y = Mul(p, c)
}""",
    "a division by a one-element constant": """
g (float[8, 64] a, float[64, 16] b) => (float[8, 16] y) {
  c = Constant<value = float[1] {8.0}>()
  p = MatMul(a, b)
  y = Div(p, c)
}""",
    "a constant divided by the product": """
g (float[8, 64] a, float[64, 16] b) => (float[8, 16] y) {
  c = Constant<value = float {8.0}>()
  p = MatMul(a, b)
  y = Div(c, p)
}""",
    "a scale by a vector": """
g (float[8, 64] a, float[64, 2] b) => (float[8, 2] y) {
  c = Constant<value = float[2] {0.5, 0.25}>()
  p = MatMul(a, b)
  y = Mul(p, c)
}""",
    "a product read twice": """
g (float[8, 64] a, float[64, 16] b) => (float[8, 16] y) {
  c = Constant<value = float {0.5}>()
  p = MatMul(a, b)
  q = Mul(p, c)
  y = Add(q, p)
}""",
    "attention scores": """
g (float[1, 4, 8, 64] q, float[1, 4, 100, 64] k) => (float[1, 4, 8, 100] y) {
  c = Constant<value = float {0.125}>()
  kt = Transpose<perm = [0, 1, 3, 2]>(k)
  s = MatMul(q, kt)
  m = Mul(s, c)
  y = Softmax<axis = -1>(m)
}""",
}


def _ort_dropped(model: onnx.ModelProto, tmp_path) -> set[str]:
    """The values of ``model`` that ORT's optimized model (default level) no longer has."""
    src, opt = tmp_path / "m.onnx", tmp_path / "m.opt.onnx"
    onnx.save(model, str(src))
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(opt)
    ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    kept = {v for n in onnx.load(str(opt)).graph.node for v in [*n.input, *n.output]}
    return {v for n in model.graph.node for v in n.output if n.op_type != "Constant"} - kept


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_values_the_fusions_remove_are_the_ones_ort_drops(case, tmp_path):
    model = graphs.text_model(CASES[case], K=(100, 64))
    dropped = _ort_dropped(model, tmp_path)
    assert fusions(analyse(model)).gone == dropped


def test_the_fused_matmul_reads_the_transposed_input_where_its_scale_ran():
    a = analyse(graphs.text_model(CASES["attention scores"]))
    f = fusions(a)
    pos = {n.name or n.op_type: i for i, n in enumerate(a.nodes)}
    by_output = {n.outputs[0].name: i for i, n in enumerate(a.nodes)}
    assert f.read_at(by_output["kt"]) == by_output["m"]  # k is read by the fused node
    assert f.read_at(by_output["s"]) == by_output["m"]
    assert f.read_at(by_output["y"]) == by_output["y"]  # (nothing fused there)
    assert len(pos) == len(a.nodes)


# q [64, 256] against keys k [1024, 256] (1 MiB): unfused, K^T is a 1 MiB buffer of its own
# beside k; ORT's FusedMatMul reads k, so K^T never exists. (The graph inputs are small: the
# replay counts them, ORT's arena does not hold the caller's buffers.) W is offloaded so that
# a Wait samples ORT's arena.
ATTENTION = """
att (float[64, 256] q, float[1024, 16] kin) => (float[64, 256] y) {
  c = Constant<value = float {0.0625}>()
  k = MatMul(kin, Wk)
  kt = Transpose<perm = [1, 0]>(k)
  s = MatMul(q, kt)
  m = Mul(s, c)
  p = Softmax<axis = -1>(m)
  o = MatMul(p, k)
  y = MatMul(o, W)
}
"""


def test_the_replay_with_ort_fusions_is_the_arena_ort_reports(tmp_path):
    """With ORT's default graph optimizations, its CPU arena's MaxInUse is the replay that
    knows the fusions, not the one of the graph as written (0.75 MiB more: K^T)."""
    src = graphs.save(graphs.text_model(ATTENTION, W=(256, 256), Wk=(16, 256)),
                      tmp_path / "att.onnx")
    out = tmp_path / "att.ho.onnx"
    r = optimize(src, out, OffloadOptions(activations=False, min_bytes=0, prefetch_distance=1))
    choice = r.decision.choice
    assert "W" in [w.name for w in choice.weights]
    n = len(r.analysis.order)
    # (MaxInUse: the chunks in use, not the regions the planner counts)
    fused, unfused = (int(bfc.in_use(arena_buffer_intervals(r.analysis, choice, target=t)[0],
                                     n).max()) for t in (ORT, UNFUSED))
    assert unfused - fused >= 512 << 10, (unfused, fused)

    so = ort.SessionOptions()
    so.add_session_config_entry(CONFIG_SAMPLE_ARENA, "1")
    so.enable_mem_pattern = False
    s = runtime.InferenceSession(str(out), sess_options=so, cpu_arena="ort",
                                 providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {"q": rng.standard_normal((64, 256)).astype(np.float32),
             "kin": rng.standard_normal((1024, 16)).astype(np.float32)}
    _ops.set_trace(arena_trace=True)
    try:
        _ops.arena_trace()
        for _ in range(2):
            s.run(None, feeds)
        trace = _ops.arena_trace()
    finally:
        _ops.set_trace()
    if not trace or trace[-1]["max_in_use"] < 0:
        pytest.skip("this onnxruntime reports no arena statistics (needs >= 1.23)")
    measured = trace[-1]["max_in_use"]
    assert abs(measured - fused) <= 64 << 10, (measured, fused, unfused)
    assert ORT.fusions is fusions


def test_the_planner_counts_the_tensors_of_the_fused_graph():
    """The simulation's tensors are the fused graph's: K^T and the unscaled scores are not
    resident (nor named by a floor), and k stays until the fused MatMul reads it."""
    from ho_onnx.cost.model import CostModel
    from ho_onnx.schedule.lifetimes import resident_intervals
    from ho_onnx.schedule.planner import InfeasibleBudgetError, plan

    a = analyse(graphs.text_model(ATTENTION, W=(256, 256), Wk=(16, 256)))
    spans, _ = resident_intervals(a, fusions=fusions(a))
    at = {n.outputs[0].name: i for i, n in enumerate(a.nodes)}
    assert "kt" not in spans and "s" not in spans
    assert spans["k"] == (at["k"], at["o"]) and spans["q"][1] == at["m"]
    written, _ = resident_intervals(a)
    assert written["q"][1] == at["s"] and "kt" in written
    costs = CostModel(np.full(len(a.order), 1e-3), lambda nbytes, direction: nbytes / 10e9)
    floors = {}
    for name, target in (("fused", ORT), ("written", UNFUSED)):
        with pytest.raises(InfeasibleBudgetError) as e:
            plan(a, OffloadOptions(budget=1 << 10, min_bytes=0), costs, target=target)
        floors[name] = (e.value.min_budget, str(e.value))
    assert "kt (1.00 MiB" in floors["written"][1]  # (what the floor named before)
    assert "kt (" not in floors["fused"][1], floors["fused"][1]
    assert floors["fused"][0] == (1 << 20) + (320 << 10)  # k, p and o at the last MatMul
    assert floors["written"][0] > floors["fused"][0]


# A causal mask built from a fixed shape (Shape through ConstantOfShape and Trilu), as a
# decoder exported with static shapes computes it, added to attention scores.
MASK = """
g (float[1, 16, 8] x) => (float[1, 16, 8] y) {
  s = Shape(x)
  n = Gather<axis = 0>(s, one)
  d = Unsqueeze(n, zero1)
  dd = Concat<axis = 0>(d, d)
  o = ConstantOfShape<value = float[1] {1.0}>(dd)
  u = Trilu<upper = 1>(o)
  m = Mul(u, neg)
  t = Transpose<perm = [0, 2, 1]>(x)
  sc = MatMul(x, t)
  a = Add(sc, m)
  y = MatMul(a, x)
}
"""


def _mask_model(x: str = "float[1, 16, 8] x") -> onnx.ModelProto:
    return graphs.text_model(MASK.replace("float[1, 16, 8] x", x), one=np.array(1, np.int64),
                             zero1=np.array([0], np.int64), neg=np.array(-1e9, np.float32))


def test_the_values_ort_folds_when_it_loads_are_the_ones_replayed_as_constants(tmp_path):
    """ORT's ConstantFolding computes the mask at load (every value whose inputs are
    constants, a Shape of a fixed shape among them): ``fusions().folded`` are the values
    ORT's optimized model no longer computes; with a symbolic dim nothing folds. The replay
    counts the one a computed node still reads (``m``) for the whole run, beside the arena,
    and none of the others."""
    from ho_onnx.schedule.arena import _values

    model = _mask_model()
    a = analyse(model)
    folded = fusions(a).folded
    src, opt = tmp_path / "m.onnx", tmp_path / "m.opt.onnx"
    onnx.save(model, str(src))
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(opt)
    ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    computed = {v for n in onnx.load(str(opt)).graph.node for v in n.output}
    assert folded == {v for n in model.graph.node for v in n.output} - computed - fusions(a).gone
    assert folded == {"s", "n", "d", "dd", "o", "u", "m"}
    values, static = _values(a, None, None, None, ORT)
    assert not folded & set(values)
    assert static == 16 * 16 * 4 + 8 + 8 + 4  # m (and the initializers the mask reads)
    assert not fusions(analyse(_mask_model("float[N, 16, 8] x"), {"N": 1})).folded
