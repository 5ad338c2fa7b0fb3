"""Recomputation (schedule/recompute.py, issue 38 item 5): a stored activation computed
again before its late readers instead of stored and reloaded, decided by the planner's own
simulation, rewritten with Fences (csrc: Fence) and run in ORT against the unmodified model
and the stored plan."""

from __future__ import annotations

import graphs
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from ho_onnx import contract
from ho_onnx.graph.analyse import analyse
from ho_onnx.rewrite.pipeline import optimize, plan_model
from ho_onnx.schedule.lifetimes import resident_intervals
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.schedule.recompute import MAX_NODES, cone
from ho_onnx.schedule.types import ActivationOffload
from ho_onnx.target.ort import runtime

# n (a LayerNormalization of the graph input) is read by the first MatMul and, after a
# peak it would sit through, by the Mul: stored, or computed again from x.
LN = """
rec (float[256, 256] x) => (float[256, 256] y) {
  n = LayerNormalization<axis = -1>(x, g, b)
  a = MatMul(n, W1)
  big = Concat<axis = 0>(a, a, a, a)
  big2 = Relu(big)
  r = ReduceMean<keepdims = 1>(big2)
  m = Mul(n, r)
  y = Add(m, a)
}
"""

# A causal mask made from the input's shape (Shape, Gather, Range, ..., the Mul that makes
# it), read before and after a peak: its whole chain runs again from x.
MASK = """
mask (float[N, 64] x) => (float[N, 64] y) {
  zero = Constant<value = int64 {0}>()
  one = Constant<value = int64 {1}>()
  ax = Constant<value = int64[1] {1}>()
  s = Shape(x)
  n = Gather<axis = 0>(s, zero)
  r = Range(zero, n, one)
  c = Cast<to = 1>(r)
  u = Unsqueeze(c, ax)
  mask = Mul(u, x)
  e = Relu(mask)
  big = Concat<axis = 1>(e, e, e, e)
  t = ReduceMean<keepdims = 1, axes = [1]>(big)
  y = Add(mask, t)
}
"""


def _model(text: str = LN) -> onnx.ModelProto:
    return graphs.text_model(text, g=(256,), b=(256,), W1=(256, 256)) if text is LN \
        else graphs.text_model(text)


def _stored(a, name: str, dims=None) -> ActivationOffload:
    """``name`` stored across its gap: early = its first reader, late = the rest."""
    t = a.tensors[name]
    return ActivationOffload(name, t.nbytes(dims), t.producer, (t.consumers[0],),
                             tuple(t.consumers[1:]), t.consumers[1])


def test_the_cone_is_what_is_not_resident_at_the_late_reader():
    a = analyse(_model(MASK), {"N": 128})
    spans, _ = resident_intervals(a, {"N": 128})
    by_out = {a.nodes[i].outputs[0].name: i for i in range(len(a.nodes))}
    got = cone(a, _stored(a, "mask", {"N": 128}), set(), spans)
    assert got == tuple(sorted(by_out[v] for v in ("s", "n", "r", "c", "u", "mask"))), got
    # (the Constants are initializers in ORT and x a graph input: resident, not recomputed)


def test_why_an_activation_is_not_recomputed():
    a = analyse(_model(MASK), {"N": 128})
    spans, _ = resident_intervals(a, {"N": 128})
    assert "moves out of the fast tier" in cone(a, _stored(a, "mask", {"N": 128}), {"x"}, spans)
    assert "MatMul" in cone(analyse(_model()), _stored(analyse(_model()), "a"), set(),
                            resident_intervals(analyse(_model()))[0])
    chain = "\n".join(f"  h{i + 1} = Relu(h{i})" for i in range(MAX_NODES + 1))
    long = graphs.text_model(f"""
    long (float[64, 64] h0) => (float[64, 64] y) {{
      h00 = Neg(h0)
      h1b = Relu(h00)
{chain.replace("h1 = Relu(h0)", "h1 = Relu(h1b)")}
      e = Sigmoid(h{MAX_NODES + 1})
      big = Concat<axis = 0>(e, e, e, e)
      t = ReduceMean<keepdims = 1>(big)
      y = Add(h{MAX_NODES + 1}, t)
    }}
    """)
    la = analyse(long)
    why = cone(la, _stored(la, f"h{MAX_NODES + 1}"), set(), resident_intervals(la)[0])
    assert f"more than {MAX_NODES} nodes" in why


def _budget(path, fraction: float) -> int:
    return int(plan_model(path, OffloadOptions(budget=1 << 40))[2].baseline.peak_bytes
               * fraction)


@pytest.mark.parametrize("machine", ["cpu", "h100"])
def test_the_planner_recomputes_where_its_simulation_is_faster(tmp_path, machine):
    from ho_onnx.cost.source import CostSource

    src = graphs.save(_model(), tmp_path / "ln.onnx")
    budget = _budget(src, 0.9)
    costs = CostSource(machine)
    _, a, off = plan_model(src, OffloadOptions(budget=budget, recompute="off"), None, costs)
    _, _, auto = plan_model(src, OffloadOptions(budget=budget), None, costs)
    assert "n" in [x.name for x in off.choice.activations]
    assert [r.name for r in auto.choice.recomputes] == ["n"]
    assert "n" not in [x.name for x in auto.choice.activations]
    r = auto.choice.recomputes[0]
    assert [a.nodes[p].op_type for p in r.nodes] == ["LayerNormalization"]
    assert r.fenced == ((r.producer, "g"),)  # (the smallest input: x and b are larger or as large)
    assert r.transient == 256 * 4  # (g's copy: ORT never aliases an initializer)
    assert auto.planned.total_s < off.planned.total_s
    assert auto.planned.peak_bytes <= auto.planned_for
    assert auto.host_bytes < off.host_bytes  # (nothing of n is stored)
    for x in auto.choice.activations:  # (the MatMul's output, if stored, says why)
        assert "MatMul" in auto.choice.recompute_skipped[x.name]
    meta = auto.metadata()
    assert meta["recomputed_activations"] == "n"


def test_memory_model_holds_the_copy_from_the_late_reader(tmp_path):
    from ho_onnx.schedule.arena import arena_memory
    from ho_onnx.schedule.lifetimes import schedule_memory
    from ho_onnx.schedule.types import OffloadChoice

    src = graphs.save(_model(), tmp_path / "ln.onnx")
    _, a, p = plan_model(src, OffloadOptions(budget=_budget(src, 0.9)))
    r = p.choice.recomputes[0]
    n = a.tensors["n"].nbytes()
    only = OffloadChoice(recomputes=[r])
    diff = schedule_memory(a, only) - schedule_memory(a, None)
    u, last = r.late[0], max(r.late)
    assert (diff[r.last_early + 1:u] == -n).all()  # gone across the gap
    assert diff[u] == r.transient and (diff[u + 1:last + 1] == 0).all()
    assert (arena_memory(a, only)[r.last_early + 1:u]
            <= arena_memory(a, None)[r.last_early + 1:u]).all()


def _run(path, x, level) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    return runtime.InferenceSession(str(path), sess_options=so).run(None, {"x": x})[0]


LEVELS = [ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL]


@pytest.mark.parametrize("level", LEVELS, ids=["disabled", "all"])
def test_recomputed_runs_the_same_kernels(tmp_path, level):
    """Activations only (the weights resident, as in the unmodified model): the recomputed
    model's output is bit-exact with the unmodified model's and with the stored plan's; ORT
    keeps the copy apart (two LayerNormalizations in the graph it runs) and the Fence is
    ordered after the node before the late reader."""
    src = graphs.save(_model(), tmp_path / "ln.onnx")
    opts = dict(budget=_budget(src, 0.97), weights=False)
    rec = optimize(src, tmp_path / "rec" / "m.onnx", OffloadOptions(**opts))
    sto = optimize(src, tmp_path / "sto" / "m.onnx", OffloadOptions(**opts, recompute="off"))
    assert [r.name for r in rec.choice.recomputes] == ["n"] and not rec.choice.weights
    assert [x.name for x in sto.choice.activations] == ["n"]
    x = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    ref = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    got = _run(tmp_path / "rec" / "m.onnx", x, level)
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(got, _run(tmp_path / "sto" / "m.onnx", x, level))
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    so.optimized_model_filepath = str(tmp_path / "ort.onnx")
    runtime.InferenceSession(str(tmp_path / "rec" / "m.onnx"), sess_options=so)
    ran = onnx.load(so.optimized_model_filepath).graph.node
    assert [n.op_type for n in ran].count("LayerNormalization") == 2
    fence = next(n for n in ran if n.op_type == contract.FENCE)
    assert list(fence.input)[:1] == ["g"] and len(fence.input) == 2  # (g, then its order)
    late = next(n for n in ran if n.op_type == "Mul")
    assert any(i.endswith("ho_recomputed") for i in late.input)


def test_the_mask_chain_recomputed_runs_at_other_lengths(tmp_path):
    """A six-node chain from the input's shape, recomputed (on: the plan's cost model may
    not prefer it on this tiny graph), planned at N=128 and run at 128 and 40: identical to
    the unmodified model."""
    src = graphs.save(_model(MASK), tmp_path / "mask.onnx")
    base = plan_model(src, OffloadOptions(budget=1 << 40), {"N": 128})[2].baseline.peak_bytes
    r = optimize(src, tmp_path / "o" / "m.onnx", OffloadOptions(
        budget=int(base * 0.95), weights=False, recompute="on", min_bytes=0), {"N": 128})
    assert [x.name for x in r.choice.recomputes] == ["mask"]
    assert len(r.choice.recomputes[0].nodes) == 6
    for n in (128, 40):
        x = np.random.default_rng(n).standard_normal((n, 64)).astype(np.float32)
        ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(
            None, {"x": x})[0]
        np.testing.assert_array_equal(_run(tmp_path / "o" / "m.onnx", x,
                                           ort.GraphOptimizationLevel.ORT_ENABLE_ALL), ref)


def test_recompute_on_needs_the_planner():
    with pytest.raises(ValueError, match="budget"):
        OffloadOptions(recompute="on")
    with pytest.raises(ValueError, match="recompute must be"):
        OffloadOptions(budget=1, recompute="always")


def test_views_cost_no_transient_bytes():
    """A Reshape's output is its input's buffer in ORT: a recomputation ending in one holds
    the buffer it views as its result, and one in the middle holds nothing of its own."""
    from ho_onnx.schedule.recompute import transient_bytes

    a = analyse(graphs.text_model("""
    v (float[64, 64] x) => (float[4096] r, float[4096] q) {
      shape = Constant<value = int64[1] {4096}>()
      c = Concat<axis = 0>(x, x)
      n = Neg(c)
      r = Reshape(n, shape)
      f = Reshape(c, shape)
      h = Slice(f, zero, half)
      q = Neg(h)
    }
    """.replace("zero", "z").replace("half", "hh").replace(
        "shape = Constant", "z = Constant<value = int64[1] {0}>()\n      hh = Constant<value = "
        "int64[1] {4096}>()\n      shape = Constant")))
    pos = {n.outputs[0].name: i for i, n in enumerate(a.nodes)}

    def size(v: str) -> int:
        return a.tensors[v].nbytes() or 0

    c = size("c")
    # r views n: n is r's own buffer; c is held beside it
    assert transient_bytes(a, (pos["c"], pos["n"], pos["r"]), "r", (), size) == c
    # f views c (no bytes of its own); c and h are held beside q
    assert transient_bytes(a, (pos["c"], pos["f"], pos["h"], pos["q"]), "q", (), size) \
        == c + size("h")
    # a Fence of the graph input x copies it (ORT never aliases a graph input)
    assert transient_bytes(a, (pos["c"],), "c", ("x",), size) == size("x")


def test_fewer_tries_on_large_graphs():
    from ho_onnx.schedule.recompute import MAX_TRIES, tries_for

    assert tries_for(100) == MAX_TRIES and tries_for(10_000) == 20 and tries_for(10**7) == 8
