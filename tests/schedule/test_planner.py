"""The budget planner on graphs with known answers, and its invariants on random DAGs."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from graphs import text_model, tile_model, two_weights_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from ho_onnx import contract
from ho_onnx.cost.model import CostModel
from ho_onnx.graph.analyse import analyse
from ho_onnx.rewrite.insert import insert_cache_ops
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.schedule.planner import InfeasibleBudgetError, plan
from ho_onnx.schedule.simulate import simulate
from ho_onnx.target.ort.placement import HOST_INPUT_REASON


def linear(bw: float = 1e9, latency: float = 1e-6):
    return lambda nbytes, direction: latency + nbytes / bw


def _chain(big: str = "W2"):
    """x[64,256] → three MatMuls; the weight named ``big`` is 8x the others."""
    sizes = {"W1": (256, 256), "W2": (256, 256), "W3": (256, 256)}
    sizes[big] = (256, 2048)
    body = """
    chain (float[64, 256] x) => (float[64, 256] y) {
      h1 = MatMul(x, W1)
      h2 = Relu(h1)
      h3 = MatMul(h2, W2)
      h4 = Slice(h3, s0, s1, s2)
      y = MatMul(h4, W3)
    }
    """
    return text_model(body, W1=sizes["W1"], W2=sizes["W2"], W3=sizes["W3"],
                      s0=np.array([0], np.int64), s1=np.array([256], np.int64),
                      s2=np.array([1], np.int64))


def test_exactly_one_weight_must_stream():
    """The peak is a 1 MiB activation early on; W2 (512 KiB) is read only at the end, with
    a small working set. Offloading W2 is necessary and sufficient; W1 (16 KiB) is not."""
    m = tile_model((64, 64), (64, 2048))
    a = analyse(m)
    cs = np.full(len(a.order), 2e-3)
    base = simulate(a, None, cs, linear())
    w2 = 64 * 2048 * 4
    budget = base.peak_bytes - w2 + 1
    # (the tensors: ORT's arena would hand W2's reload the 1 MiB chunk `a` leaves, less the
    # 256 bytes a step's output split off it, whole: under twice the request. Fitting that
    # takes W1 too; test_bfc.py and test_ort_reuse.py test the arena's rules.)
    p = plan(a, OffloadOptions(budget=budget, min_bytes=0, arena_refits=0),
             CostModel(cs, linear()))
    assert [w.name for w in p.choice.weights] == ["W2"]
    assert p.choice.activations == []
    assert p.planned.peak_bytes <= budget
    # the reload (0.5 ms) hides behind compute before its reader: no stall
    w = p.choice.weights[0]
    assert w.prefetch_at[0] < w.consumers[0]
    assert p.planned.stall_s == 0
    assert p.planned.total_s == pytest.approx(cs.sum())
    with pytest.raises(InfeasibleBudgetError):  # W2's own step cannot shrink below this
        plan(a, OffloadOptions(budget=w2, min_bytes=0), CostModel(cs, linear()))


def test_every_candidate_left_resident_has_its_reason():
    """The planner records why each tensor of the chosen kinds stayed resident: ineligible,
    too small, no gap, or not needed for the budget."""
    m = tile_model((64, 64), (64, 2048))
    a = analyse(m)
    cs = np.full(len(a.order), 2e-3)
    budget = simulate(a, None, cs, linear()).peak_bytes - 64 * 2048 * 4 + 1
    p = plan(a, OffloadOptions(budget=budget, min_bytes=64 << 10), CostModel(cs, linear()))
    c = p.choice
    assert [w.name for w in c.weights] == ["W2"] and c.decided_by == "planner"
    assert c.skipped["W1"] == "16384 bytes < min_bytes"
    assert c.skipped["y"] == "graph output"
    assert c.skipped["reps"] == HOST_INPUT_REASON  # (Tile's repeats, 16 bytes)
    assert c.skipped["a"].startswith("largest gap")  # the 1 MiB Tile: read right away
    offloaded = {w.name for w in c.weights}
    kinds = [n for n, t in a.tensors.items() if t.is_initializer or t.producer is not None]
    assert set(kinds) == offloaded | set(c.skipped)
    fits = plan(a, OffloadOptions(budget=1 << 40, min_bytes=0), CostModel(cs, linear()))
    assert not fits.choice.weights
    assert fits.choice.skipped["W2"] == "the model fits the budget"


def test_planning_keeps_no_state_between_calls():
    """Two plans of the same inputs are the same (the planner's state is local to a call)."""
    m = tile_model((64, 64), (64, 2048))
    a = analyse(m)
    cs = np.full(len(a.order), 2e-3)
    opts = OffloadOptions(budget=simulate(a, None, cs, linear()).peak_bytes - 64 * 2048 * 4 + 1,
                          min_bytes=0, host_budget=1024)  # W2 does not fit the host: disk
    first, second = (plan(a, opts, CostModel(cs, linear())) for _ in range(2))
    assert first.choice.weights and {w.tier for w in first.choice.weights} == {"disk"}
    assert first.choice == second.choice
    assert first.planned.total_s == second.planned.total_s


@pytest.mark.parametrize(("reload_ms", "stall_ms"), [(1.5, 0.0), (3.0, 3.0)])
def test_two_weights_compete_for_one_channel(reload_ms, stall_ms):
    """Both reloads issued at the start share one FIFO channel: the second starts when the
    first ends. With 3 ms copies and 1 ms steps, W1 is late by 1 ms and W2 (queued behind
    it) by 2 ms more; two parallel copies would have stalled only 1 ms."""
    from ho_onnx.schedule.types import OffloadChoice, WeightOffload

    m = two_weights_model()
    a = analyse(m)
    cs = np.full(4, 1e-3)
    nbytes = 512 * 512 * 4
    choice = OffloadChoice(weights=[WeightOffload("W1", nbytes, (2,), (0,)),
                                    WeightOffload("W2", nbytes, (3,), (0,))])
    sim = simulate(a, choice, cs, linear(bw=nbytes / (reload_ms * 1e-3), latency=0.0))
    w1, w2 = sim.transfers
    assert w1.start_s == 0 and w2.start_s == pytest.approx(w1.end_s)
    assert sim.stall_s == pytest.approx(stall_ms * 1e-3)
    assert sim.total_s == pytest.approx(4e-3 + stall_ms * 1e-3)
    # both weights are resident from the start (issued at 0) until their readers
    assert sim.memory[0] >= 2 * nbytes


def test_budget_below_largest_working_set_is_refused_with_the_minimum():
    a = analyse(_chain("W2"))
    cs = np.full(len(a.order), 1e-3)
    # the MatMul reading W2: h2 [64,256] + W2 [256,2048] + h3 [64,2048], all fp32, and the
    # Slice's starts/ends/axes (3 x 8 bytes, which CUDA's Slice reads in host memory: never
    # offloaded)
    need = (64 * 256 + 256 * 2048 + 64 * 2048) * 4 + 3 * 8
    with pytest.raises(InfeasibleBudgetError) as e:
        plan(a, OffloadOptions(budget=need - 1, min_bytes=0), CostModel(cs, linear()))
    assert e.value.min_budget == need
    assert "smallest feasible budget" in str(e.value) and "W2" in str(e.value)
    p = plan(a, OffloadOptions(budget=need, min_bytes=0), CostModel(cs, linear()))
    assert p.planned.peak_bytes <= need


def test_infeasible_budget_says_why_each_listed_tensor_stays():
    """Each tensor the refusal lists as "must be resident" says why it cannot leave: a
    weight that is a graph output, a graph input; an offloadable one says nothing."""
    m = text_model("""
    g (float[64, 256] x) => (float[64, 256] y, float[256, 256] W1) {
      a = MatMul(x, W1)
      b = Relu(a)
      y = MatMul(b, W2)
    }
    """, W1=(256, 256), W2=(256, 256))
    a = analyse(m)
    cs = np.full(len(a.order), 1e-3)
    with pytest.raises(InfeasibleBudgetError) as e:
        plan(a, OffloadOptions(budget=1 << 10, min_bytes=0), CostModel(cs, linear()))
    said = str(e.value)
    assert "W1 (256.00 KiB, graph output)" in said and "y (64.00 KiB, graph output)" in said
    assert "b (64.00 KiB, largest gap 1 < min_gap)" in said, said
    assert "W2 (256.00 KiB)" in said, said  # offloadable: resident only while read
    a = analyse(text_model("g (float[256, 256] x) => (float[256, 256] y) { y = MatMul(x, W) }",
                           W=(256, 256)))
    with pytest.raises(InfeasibleBudgetError, match=r"x \(256.00 KiB, a graph input\)"):
        plan(a, OffloadOptions(budget=1 << 10, min_bytes=0), CostModel(np.ones(1), linear()))


def test_infeasible_budget_counts_the_callers_inputs():
    """A KV cache's past (graph inputs, many of them) is most of the floor at long contexts,
    but the four largest tensors left it out (issue 36): the refusal adds up the graph inputs
    resident at the peak."""
    from models.decoder import build_decoder

    a = analyse(build_decoder(layers=4, hidden=64, heads=4, kv_cache=True, max_positions=4096),
                {"batch": 1, "seq": 1, "past": 2048})
    cs = np.full(len(a.order), 1e-3)
    with pytest.raises(InfeasibleBudgetError) as e:
        plan(a, OffloadOptions(budget=1 << 20, min_bytes=0), CostModel(cs, linear()),
             {"batch": 1, "seq": 1, "past": 2048})
    # 4 layers x (key, value) x [1, 4, 2048 (+1), 16] fp32 = 8 x 512 KiB: the presents
    # (graph outputs, held to the end) at the peak step, and the option that moves them
    m = re.search(r"of it, (\d+) graph inputs and outputs hold ([\d.]+) MiB \(the caller's: "
                  r"(past|present)_", str(e.value))
    assert m and int(m[1]) >= 8 and float(m[2]) >= 4.0, str(e.value)
    assert "--offload-kv keeps a KV cache in host memory" in str(e.value)


def test_empty_tensors_are_never_candidates():
    """A tensor of 0 bytes (a dim bound to 0, or an empty weight) stays resident, with its
    reason: it was scored by dividing by its transfer time, 0 (found by hand: ``optimize
    --dim batch=0 --min-bytes 0`` was a ZeroDivisionError)."""
    a = analyse(text_model("""
    g (float[N, 64] x) => (float[M, 64] y) {
      e = Concat<axis = 0>(x, E)
      h = MatMul(e, W1)
      r = Relu(h)
      s = Add(r, h)
      y = MatMul(s, W2)
    }
    """, E=(0, 64), W1=(64, 64), W2=(64, 64)), {"N": 0})
    cs = np.full(len(a.order), 1e-3)
    opts = OffloadOptions(budget=64 * 64 * 4, min_bytes=0, min_gap=1)
    p = plan(a, opts, CostModel(cs, linear(latency=0.0)), {"N": 0})
    assert "W2" in {w.name for w in p.choice.weights} and not p.choice.activations
    for name in ("E", "e", "h", "r"):
        assert p.choice.skipped[name] == "empty (0 bytes): nothing to move"


def test_no_offload_when_the_model_fits():
    a = analyse(_chain())
    cs = np.full(len(a.order), 1e-3)
    base = simulate(a, None, cs, linear())
    p = plan(a, OffloadOptions(budget=base.peak_bytes, min_bytes=0), CostModel(cs, linear()))
    assert p.choice.weights == [] and p.choice.activations == []
    assert p.planned.total_s == pytest.approx(base.total_s)



@pytest.mark.parametrize("body", [
    "g (float[2] x) => (float[2] x) { }",  # an input that is the output
    "g (float[2] x) => (float[2] W) { }",  # a constant output (what ORT folding can leave)
])
def test_a_graph_without_nodes_is_refused_in_words(body):
    """No step to simulate: was an IndexError (found by the fuzzer: a model whose nodes ORT's
    extended optimizations folded away, planned with --ort-optimize)."""
    from ho_onnx.errors import UnsupportedModelError

    a = analyse(text_model(body, W=(2,)) if "W" in body else text_model(body))
    with pytest.raises(UnsupportedModelError, match="no nodes"):
        plan(a, OffloadOptions(budget=1 << 20, min_bytes=0), CostModel(np.zeros(0), linear()))


# ---- random DAGs -----------------------------------------------------------------------

@st.composite
def random_dag(draw):
    """A DAG of custom 'T.Op' nodes whose tensors have random sizes (declared value_info)."""
    n_nodes = draw(st.integers(3, 14))
    n_weights = draw(st.integers(0, 4))
    sizes = draw(st.lists(st.integers(1, 64), min_size=n_nodes + n_weights + 1,
                          max_size=n_nodes + n_weights + 1))
    weights = [f"w{i}" for i in range(n_weights)]
    avail = ["x"]
    nodes = []
    used: set[str] = set()
    for i in range(n_nodes):
        k = draw(st.integers(1, min(3, len(avail) + len(weights))))
        pool = avail + weights
        ins = draw(st.lists(st.sampled_from(pool), min_size=k, max_size=k))
        out = f"t{i}"
        nodes.append(helper.make_node("Op", ins, [out], domain="T", name=f"n{i}"))
        used.update(ins)
        avail.append(out)
    outputs = [t for t in avail[1:] if t not in used] or [avail[-1]]
    size_of = {"x": sizes[0]}
    for i in range(n_nodes):
        size_of[f"t{i}"] = sizes[1 + i]
    vi = [helper.make_tensor_value_info(t, TensorProto.FLOAT, [size_of[t] * 1024])
          for t in avail[1:]]
    inits = [helper.make_tensor(w, TensorProto.FLOAT, [sizes[1 + n_nodes + j] * 1024],
                                np.zeros(sizes[1 + n_nodes + j] * 1024, np.float32))
             for j, w in enumerate(weights) if w in used]
    g = helper.make_graph(nodes, "r", [helper.make_tensor_value_info("x", 1, [sizes[0] * 1024])],
                          [v for v in vi if v.name in outputs], inits, value_info=vi)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                                helper.make_opsetid("T", 1)])
    costs = draw(st.lists(st.floats(1e-5, 1e-2), min_size=n_nodes, max_size=n_nodes))
    frac = draw(st.floats(0.2, 1.0))
    bw = draw(st.sampled_from([1e8, 1e9, 1e10]))
    return model, np.array(costs), frac, bw


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_dag())
def test_plan_invariants_on_random_dags(case):
    model, costs, frac, bw = case
    a = analyse(model)
    tt = linear(bw)
    base = simulate(a, None, costs, tt)
    budget = max(1, int(base.peak_bytes * frac))
    try:
        p = plan(a, OffloadOptions(budget=budget, min_bytes=0, min_gap=1), CostModel(costs, tt))
    except InfeasibleBudgetError as e:
        assert e.min_budget > budget
        return
    # the simulated peak never exceeds the budget
    assert p.planned.peak_bytes <= budget
    # the rewritten graph is a valid topological order in which every offloaded tensor is
    # back (its Wait ran) before each reader, and no reader sees a Prefetch output
    m = ir.to_proto(insert_cache_ops(a, p.choice).model)
    seen = {i.name for i in m.graph.input} | {t.name for t in m.graph.initializer}
    waited: set[str] = set()
    pf_out = set()
    for node in m.graph.node:
        assert all(i in seen for i in node.input if i), node.name
        if node.domain == contract.DOMAIN and node.op_type == contract.PREFETCH:
            pf_out.add(node.output[0])
        elif node.domain == contract.DOMAIN and node.op_type == contract.WAIT:
            assert node.input[0] in pf_out
            waited.add(node.output[0])
        elif node.domain != contract.DOMAIN:
            assert not set(node.input) & pf_out
        seen.update(node.output)
    # copies on a channel are issued in reader order (FIFO)
    reloads = sorted([(c, p_) for w in p.choice.weights
                      for c, p_ in zip(w.consumers, w.prefetch_at, strict=True)]
                     + [(x.late[0], x.prefetch_at) for x in p.choice.activations])
    assert [p_ for _, p_ in reloads] == sorted(p_ for _, p_ in reloads)
    # time: never faster than the compute alone; stall accounted exactly
    assert p.planned.total_s == pytest.approx(costs.sum() + p.planned.stall_s)
    onnx.checker.check_model(m)


def test_two_weights_compete_planned_optimum():
    """A 1 MiB activation fills the budget until step 2, so neither reload can start before
    step 2; the two 1.5 ms copies then queue on one channel in front of readers at steps 3
    and 4 (1 ms steps). The optimum: W1 issued at step 2 and late by 0.5 ms; W2 queued behind
    it (the channel is busy until 3.5 ms, so issuing it at step 3 instead of 2 costs nothing
    and holds its buffer one step less) and late by another 0.5 ms: 1 ms of stall."""
    m = tile_model((64, 2048), (2048, 64))
    a = analyse(m)
    cs = np.full(5, 1e-3)
    w = 64 * 2048 * 4
    tt = linear(bw=w / 1.5e-3, latency=0.0)
    base = simulate(a, None, cs, tt)
    budget = base.peak_bytes - 2 * w + 16384  # both must leave while `a` lives; after it, both fit
    # (the tensors' optimum: the arena's regions around the 16 KiB margin are test_bfc's)
    p = plan(a, OffloadOptions(budget=budget, min_bytes=0, arena_refits=0), CostModel(cs, tt))
    assert sorted(x.name for x in p.choice.weights) == ["W1", "W2"]
    by = {x.name: x for x in p.choice.weights}
    assert by["W1"].prefetch_at == (2,) and by["W2"].prefetch_at == (3,)
    assert p.planned.stall_s == pytest.approx(1e-3)
    assert p.planned.peak_bytes <= budget


# A graph hypothesis found (test_planner_ort): the greedy selection cannot meet the
# largest-gap estimate of the smallest budget (6 KiB), so the estimate is not what is reported.
SHORT_OF_ESTIMATE = """
g (float[32, 8] x) => (float[32, 8] s4) {
  t0 = Add(x, x)
  t1 = Add(t0, x)
  t2 = MatMul(x, W0)
  t3 = Relu(t1)
  t4 = Add(t3, x)
  t5 = Relu(t4)
  t6 = MatMul(x, W1)
  t7 = Add(t6, t6)
  t8 = Add(t2, t5)
  t9 = MatMul(t6, W2)
  t10 = Relu(t7)
  t11 = Relu(x)
  t12 = Relu(t10)
  t13 = MatMul(t12, W3)
  t14 = Add(t12, t6)
  s1 = Add(t8, t9)
  s2 = Add(s1, t11)
  m3 = MatMul(t13, W4)
  s3 = Add(s2, m3)
  m4 = MatMul(t14, W5)
  s4 = Add(s3, m4)
}
"""


def test_the_reported_smallest_budget_is_one_the_planner_meets():
    a = analyse(text_model(SHORT_OF_ESTIMATE, W0=(8, 8), W1=(8, 16), W2=(16, 8), W3=(16, 16),
                           W4=(16, 8), W5=(16, 8)))
    costs = np.array([0.001, 0.001, 0.000995, 0.000943, 0.000891, 0.000896, 0.000965,
                      0.000973, 0.000558, 0.00055, 0.000744, 0.000914, 0.000628, 0.000358,
                      0.000379, 0.000293, 0.000212, 0.000174, 0.000121, 0.0001, 1e-06])
    cm = CostModel(costs, linear(1e8, 0.0))
    opts = OffloadOptions(min_bytes=0, min_gap=1, preferred_overlap=1.0, max_overlap=1.0)
    with pytest.raises(InfeasibleBudgetError) as e:
        plan(a, OffloadOptions(budget=1, min_bytes=0, min_gap=1, preferred_overlap=1.0,
                               max_overlap=1.0), cm)
    least = e.value.min_budget
    p = plan(a, OffloadOptions(budget=least, **{k: getattr(opts, k) for k in (
        "min_bytes", "min_gap", "preferred_overlap", "max_overlap")}), cm)
    assert p.planned.peak_bytes <= least
    with pytest.raises(InfeasibleBudgetError) as below:  # and one byte less is reported too
        plan(a, OffloadOptions(budget=least - 1, min_bytes=0, min_gap=1, preferred_overlap=1.0,
                               max_overlap=1.0), cm)
    assert below.value.min_budget >= least


def test_a_staged_tier_holds_each_reload_twice_on_the_cpu():
    """On the CPU EP a disk-tier reload lands in the engine's staging first, then ORT's
    buffer: the plan counts both from its Prefetch through its Wait (was: once, and runs went
    over the budget); under host-ahead (GPU) timing the staging is pinned host memory, not
    the budget's. The staged plan still fits, and the memory model says 2x over its window."""
    from ho_onnx.schedule.lifetimes import schedule_memory
    from ho_onnx.schedule.types import OffloadChoice

    a = analyse(tile_model((64, 64), (64, 2048)))  # (the early Tile is the peak)
    cs = np.full(len(a.order), 2e-3)
    base = simulate(a, None, cs, linear()).peak_bytes
    opts = OffloadOptions(budget=base - 64 * 2048 * 4 + 1, min_bytes=0, activations=False,
                          weight_tier="disk")
    cpu = plan(a, opts, CostModel(cs, linear()))
    gpu = plan(a, opts, CostModel(cs, linear(), host_ahead=True))
    assert cpu.choice.weights and all(w.staged for w in cpu.choice.weights)
    assert gpu.choice.weights and not any(w.staged for w in gpu.choice.weights)
    assert cpu.planned.peak_bytes <= opts.budget
    w = cpu.choice.weights[0]
    one = OffloadChoice(weights=[w])
    plain = OffloadChoice(weights=[dataclasses.replace(w, staged=False)])
    diff = schedule_memory(a, one) - schedule_memory(a, plain)
    p, c = w.prefetch_at[0], w.consumers[0]
    assert (diff[p:c + 1] == w.nbytes).all() and diff.sum() == w.nbytes * (c - p + 1)


def test_the_arena_prediction_counts_the_staging_beside_orts_buffers():
    """ORT's replayed arena plus the engine's staging copy of each staged reload (library
    memory, outside ORT's allocator): the arena fit must see both (found measuring the
    2.75 GB decoder at 15 % of its weights under a hard limit: the replayed arena fitted
    the budget while up to 144 MiB of disk reads were staged beside it, and the run was
    OOM-killed)."""
    from ho_onnx.schedule.arena import arena_buffer_intervals, arena_memory
    from ho_onnx.schedule.types import OffloadChoice

    a = analyse(tile_model((64, 64), (64, 2048)))
    cs = np.full(len(a.order), 2e-3)
    base = simulate(a, None, cs, linear()).peak_bytes
    opts = OffloadOptions(budget=base - 64 * 2048 * 4 + 1, min_bytes=0, activations=False,
                          weight_tier="disk")
    p = plan(a, opts, CostModel(cs, linear()))
    w = next(w for w in p.choice.weights if w.staged)
    one = OffloadChoice(weights=[w])
    plain = OffloadChoice(weights=[dataclasses.replace(w, staged=False)])
    diff = arena_memory(a, one) - arena_memory(a, plain)
    s, c = w.prefetch_at[0], w.consumers[0]
    assert (diff[s:c + 1] == w.nbytes).all() and diff.sum() == w.nbytes * (c - s + 1)
    staged, _ = arena_buffer_intervals(a, one)
    unstaged, _ = arena_buffer_intervals(a, plain)
    assert sorted(staged) == sorted([*unstaged, (s, c, w.nbytes)])
    assert p.arena_bytes == int(arena_memory(a, p.choice).max())
