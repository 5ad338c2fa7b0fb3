"""Planning inside If branches (rewrite.branches): each branch planned as a graph of its own,
its outer-scope weights prefetched inside it; checked in ORT against the original, both
branches, bit-exact with graph optimizations off."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from graphs import save, text_model

from ho_onnx import contract
from ho_onnx.cli import main
from ho_onnx.errors import ScheduleError
from ho_onnx.graph.fingerprint import data_fingerprint
from ho_onnx.rewrite.invariants import check_schedule
from ho_onnx.rewrite.pipeline import optimize, plan_model
from ho_onnx.schedule.eligibility import OVERRIDABLE_REASON
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.target.ort.runtime import InferenceSession

# Both branches read W; the then-branch reads A too.
BOTH = """
g (float[N, 32] x, bool c) => (float[N, 32] y) {
  y = If(c) <then_branch = t () => (float[N, 32] u) { h = MatMul(x, W)
                                                      r = Relu(h)
                                                      u = MatMul(r, A) },
             else_branch = e () => (float[N, 32] v) { k = MatMul(x, W)
                                                      v = Sigmoid(k) }>
}
"""
# W is read by the main graph and by the then-branch; B only by the else-branch.
MAIN_TOO = """
g (float[N, 32] x, bool c) => (float[N, 32] y) {
  m = MatMul(x, W)
  y = If(c) <then_branch = t () => (float[N, 32] u) { u = MatMul(m, W) },
             else_branch = e () => (float[N, 32] v) { v = MatMul(m, B) }>
}
"""
# W1 is read inside an If nested in a branch (not planned), W3 inside a Loop body (reloaded
# before the Loop: tests/rewrite/test_loop_bodies.py).
REFUSED = """
g (float[N, 32] x, bool c, int64 n) => (float[N, 32] y, float[N, 32] z) {
  y = If(c) <then_branch = t () => (float[N, 32] u) {
                 u = If(c) <then_branch = t2 () => (float[N, 32] p) { p = MatMul(x, W1) },
                            else_branch = e2 () => (float[N, 32] q) { q = Relu(x) }> },
             else_branch = e () => (float[N, 32] v) { v = MatMul(x, W2) }>
  z = Loop(n, c, x) <body = b (int64 i, bool ci, float[N, 32] s) => (bool co, float[N, 32] s2) {
                         co = Identity(ci)
                         s2 = MatMul(s, W3) }>
}
"""
DIMS = {"N": 4}
EXPLICIT = OffloadOptions(min_bytes=0, activations=False)


def _outputs(path, feed: dict, ho: bool) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.add_session_config_entry("session.disable_prepacking", "1")
    s = InferenceSession(str(path), sess_options=so) if ho else ort.InferenceSession(
        str(path), so, providers=["CPUExecutionProvider"])
    return s.run(None, feed)


def _same_in_ort(src, out, **extra: np.ndarray) -> None:
    """Both branches (c true and false) give bit-identical outputs."""
    x = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    for c in (True, False):
        feed = {"x": x, "c": np.array(c), **extra}
        for a, b in zip(_outputs(src, feed, False), _outputs(out, feed, True), strict=True):
            assert np.array_equal(a, b)


def _branches(path) -> dict[str, onnx.GraphProto]:
    m = onnx.load(str(path), load_external_data=False)
    return {a.name: a.g for n in m.graph.node for a in n.attribute if a.type == a.GRAPH}


def _prefetched(g: onnx.GraphProto) -> list[str]:
    """The weights ``g``'s own Prefetches load (their ``name`` attribute)."""
    return sorted(next(a.s.decode() for a in n.attribute if a.name == "name")
                  for n in g.node if n.domain == contract.DOMAIN and n.op_type == contract.PREFETCH)


def test_both_branches_reload_a_weight_the_main_graph_holds_once(tmp_path):
    src = save(text_model(BOTH, W=(32, 32), A=(32, 32)), tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    r = optimize(src, out, EXPLICIT, DIMS)
    m = onnx.load(str(out), load_external_data=False)
    assert not {"W", "A"} & {t.name for t in m.graph.initializer}  # left the main graph
    b = _branches(out)
    assert _prefetched(b["then_branch"]) == ["A", "W"] and _prefetched(b["else_branch"]) == ["W"]
    for g in b.values():  # each Prefetch knows where its bytes are
        for n in g.node:
            if n.op_type == contract.PREFETCH:
                assert {"location", "offset", "length"} <= {a.name for a in n.attribute}
    assert sorted(w.name for w in r.choice.weights) == ["A", "W"]
    assert r.rewritten.cache_nodes == 6
    _same_in_ort(src, out)


def test_a_weight_the_main_graph_reads_too_stays_resident_everywhere(tmp_path):
    src = save(text_model(MAIN_TOO, W=(32, 32), B=(32, 32)), tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    r = optimize(src, out, EXPLICIT, DIMS)
    assert [w.name for w in r.choice.weights] == ["B"]
    assert "main graph" in r.choice.skipped["W"]
    b = _branches(out)
    assert _prefetched(b["then_branch"]) == [] and _prefetched(b["else_branch"]) == ["B"]
    _same_in_ort(src, out)


def test_nested_if_is_refused_with_a_reason_and_a_loop_body_reads_a_reload(tmp_path):
    src = save(text_model(REFUSED, W1=(32, 32), W2=(32, 32), W3=(32, 32)), tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    lines: list[str] = []
    r = optimize(src, out, EXPLICIT, DIMS, log=lines.append)
    assert sorted(w.name for w in r.choice.weights) == ["W2", "W3"]
    loop = next(i for i, n in enumerate(r.analysis.nodes) if n.op_type == "Loop")
    assert next(w for w in r.choice.weights if w.name == "W3").consumers == (loop,)
    assert "nested subgraph" in r.choice.skipped["W1"] and "W3" not in r.choice.skipped
    assert any("nested subgraphs are not planned" in line for line in lines)  # (the notes)
    assert any("else_branch planned" in line for line in lines)
    _same_in_ort(src, out, n=np.array(2, np.int64))


def test_budget_plan_offloads_inside_branches(tmp_path):
    """The then-branch must offload to fit, the else-branch would not: a weight both read
    is offloaded in both (memory only falls in the one that did not need it)."""
    src = save(text_model(BOTH.replace("32", "64"), W=(64, 64), A=(64, 64)), tmp_path / "m.onnx")
    opts = OffloadOptions(budget=(2 * 64 * 64 * 4) * 3 // 4, min_bytes=0, activations=False)
    _, _, plan = plan_model(src, opts, DIMS)
    notes = [n for n in plan.choice.notes if "then_branch planned" in n]
    assert notes and "offloading 0 weights" not in notes[0]
    r = CliRunner().invoke(main, ["plan", str(src), "--budget", str(opts.budget),
                                  "--min-bytes", "0", "--offload", "weights", "--dim", "N=4"])
    assert r.exit_code == 0, r.output
    table = r.stdout[r.stdout.index("then_branch (its own plan"):]
    assert "reload" in table and "offloaded: 0 weights" not in table  # its transfers
    r = CliRunner().invoke(main, ["plan", str(src), "--budget", str(opts.budget), "--json",
                                  "--min-bytes", "0", "--offload", "weights", "--dim", "N=4"])
    branches = json.loads(r.stdout)["branches"]
    assert branches[next(k for k in branches if "then_branch" in k)]["offloaded"]["weights"]
    out = tmp_path / "o.onnx"
    r = optimize(src, out, opts, DIMS)
    assert r.choice.weights  # offloaded inside the branches
    b = _branches(out)
    for w in r.choice.weights:  # in every branch that reads it
        assert w.name in _prefetched(b["then_branch"])
        assert w.name in _prefetched(b["else_branch"]) or w.name == "A"
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    for c in (True, False):
        feed = {"x": x, "c": np.array(c)}
        for a, y in zip(_outputs(src, feed, False), _outputs(out, feed, True), strict=True):
            assert np.array_equal(a, y)


def test_the_verifier_checks_branch_bodies(tmp_path):
    src = save(text_model(BOTH, W=(32, 32), A=(32, 32)), tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    optimize(src, out, EXPLICIT, DIMS)
    model = ir.load(str(out))
    check_schedule(model)
    branch = next(a.value for a in model.graph.node(0).attributes.values())
    wait = next(n for n in branch if n.op_type == contract.WAIT)
    pf = wait.inputs[0].producer()
    wait.replace_input_with(0, pf.inputs[0])  # a Wait that reads no Prefetch
    with pytest.raises(ScheduleError, match="does not read a Prefetch"):
        check_schedule(model)


def test_branch_prefetches_are_stamped_with_their_data_file(tmp_path):
    src = save(text_model(BOTH, W=(32, 32), A=(32, 32)), tmp_path / "m.onnx", external=True)
    out = tmp_path / "out" / "o.onnx"
    optimize(src, out, EXPLICIT, DIMS)
    stamped = [n for g in _branches(out).values() for n in g.node
               if n.op_type == contract.PREFETCH]
    assert len(stamped) == 3
    for n in stamped:
        a = {x.name: x for x in n.attribute}
        data = out.parent / a[contract.ATTR_LOCATION].s.decode()
        assert a[contract.ATTR_DATA_SIZE].i == data.stat().st_size
        assert a[contract.ATTR_DATA_FINGERPRINT].s.decode() == data_fingerprint(data)
    _same_in_ort(src, out)


def test_the_functional_pass_offloads_inside_branches(tmp_path):
    from ho_onnx.rewrite.passes import OffloadPass
    from ho_onnx.schedule.policy import ExplicitPolicy

    src = save(text_model(BOTH, W=(32, 32), A=(32, 32)), tmp_path / "m.onnx", external=True)
    model = ir.load(str(src))
    result = OffloadPass(ExplicitPolicy(EXPLICIT), DIMS)(model)
    assert result.modified and "W" in model.graph.initializers  # the input is untouched
    out = tmp_path / "o.onnx"  # beside the input: its data file resolves as before
    onnx.save(ir.to_proto(result.model), str(out))
    assert _prefetched(_branches(out)["else_branch"]) == ["W"]
    _same_in_ort(src, out)


def test_a_weight_one_branch_cannot_offload_stays_resident_in_all(tmp_path):
    """The else-branch reads W as Reshape's shape (read in host memory by a CUDA kernel:
    never offloaded); the then-branch, which could reload it, keeps it resident too."""
    m = text_model("""
    g (float[4, 32] x, bool c) => (float[?, ?] y) {
      y = If(c) <then_branch = t () => (float[1, 2] u) { f = Cast <to = 1> (W)
                                                         u = Unsqueeze(f, zero) },
                 else_branch = e () => (float[8, 16] v) { v = Reshape(x, W) }>
    }
    """, W=np.array([8, 16], np.int64), zero=np.array([0], np.int64))
    src = save(m, tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    r = optimize(src, out, EXPLICIT, {})
    assert "W" not in [w.name for w in r.choice.weights]
    assert "host memory" in r.choice.skipped["W"] and "else_branch" in r.choice.skipped["W"]
    assert "W" not in _prefetched(_branches(out)["then_branch"])
    _same_in_ort(src, out)


def test_a_weight_that_is_also_a_graph_input_stays_resident(tmp_path):
    m = text_model(BOTH.replace("(float[N, 32] x, bool c)", "(float[N, 32] x, bool c, "
                                "float[32, 32] W)"), W=(32, 32), A=(32, 32))
    src = save(m, tmp_path / "m.onnx")
    r = optimize(src, tmp_path / "o.onnx", EXPLICIT, DIMS)
    assert [w.name for w in r.choice.weights] == ["A"]
    assert r.choice.skipped["W"] == OVERRIDABLE_REASON


def test_a_range_plan_whose_cache_ops_are_all_in_branches_is_guarded(tmp_path):
    """A range-planned model whose main graph has no cache op (a merged decoder: one If)
    still refuses a run outside its ranges: the Guard's output orders each branch's first
    cache op (an implicit input of the If), so the check runs before any transfer; inside
    the range, outputs are bit-exact."""
    src = save(text_model(BOTH, W=(32, 32), A=(32, 32)), tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    optimize(src, out, EXPLICIT, {}, dim_ranges={"N": (1, 8)})
    m = onnx.load(str(out), load_external_data=False)
    assert [n.op_type for n in m.graph.node] == ["Guard", "If"]
    guard = m.graph.node[0].output[0]
    for g in _branches(out).values():
        first = next(n for n in g.node if n.domain == contract.DOMAIN)
        assert guard in first.input
    check_schedule(ir.load(str(out)))
    _same_in_ort(src, out)
    x = np.ones((9, 32), np.float32)
    with pytest.raises(Exception, match=r"dim 'N' is 9, outside the range 1\.\.8"):
        _outputs(out, {"x": x, "c": np.array(True)}, True)
