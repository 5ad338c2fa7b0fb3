"""A MatMulNBits packed weight moves with its scales and zero points, in both deciders, and the
rewritten model computes what the original does."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import pytest
from onnx import numpy_helper

from ho_onnx.cost.model import CostModel
from ho_onnx.graph.analyse import analyse
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.schedule.planner import plan
from ho_onnx.schedule.policy import choose

HEADER = '<ir_version: 8, opset_import: ["" : 21, "com.microsoft" : 1]>'
# Two int4 projections (K=N=64, block 32) around a Relu chain that gives the planner room.
BODY = """
g (float[1, 8, 64] x) => (float[1, 8, 64] y) {
  h = com.microsoft.MatMulNBits <K = 64, N = 64, bits = 4, block_size = 32> (x, a_q, a_s, a_z)
  r1 = Relu (h)
  r2 = Sigmoid (r1)
  r3 = Relu (r2)
  r4 = Sigmoid (r3)
  y = com.microsoft.MatMulNBits <K = 64, N = 64, bits = 4, block_size = 32> (r4, b_q, b_s, b_z)
}
"""
MEMBERS = {"a_q": ("a_q", "a_s", "a_z"), "b_q": ("b_q", "b_s", "b_z")}


def model() -> onnx.ModelProto:
    m = onnx.parser.parse_model(f"{HEADER}\n{BODY}")
    rng = np.random.default_rng(0)
    for p in ("a", "b"):
        for name, arr in ((f"{p}_q", rng.integers(0, 255, (64, 2, 16), dtype=np.uint8)),
                          (f"{p}_s", (rng.random(128, dtype=np.float32) + 0.5) / 16),
                          (f"{p}_z", rng.integers(0, 255, 64, dtype=np.uint8))):
            m.graph.initializer.append(numpy_helper.from_array(arr, name))
    return m


def _offloaded(choice) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    return {w.name: (w.consumers, w.prefetch_at) for w in choice.weights}


def _check_groups(choice) -> None:
    got = _offloaded(choice)
    for members in MEMBERS.values():
        present = [m for m in members if m in got]
        assert present in ([], list(members)), present  # all of a group, or none
        if present:  # one reload per member, at the same place
            assert len({got[m] for m in members}) == 1
    for companion in ("a_s", "a_z", "b_s", "b_z"):
        assert choice.skipped.get(companion, "").startswith("moves together with")


def test_explicit_policy_moves_groups():
    a = analyse(model())
    c = choose(a, OffloadOptions(activations=False, min_bytes=0))
    _check_groups(c)
    assert set(_offloaded(c)) == {m for g in MEMBERS.values() for m in g}
    # min_bytes counts the group: 2048 + 512 + 64 bytes
    c = choose(a, OffloadOptions(activations=False, min_bytes=2049))
    assert set(_offloaded(c)) == {m for g in MEMBERS.values() for m in g}
    c = choose(a, OffloadOptions(activations=False, min_bytes=2625))
    assert not c.weights


@pytest.mark.parametrize("budget_cut", [1, 2600, 5200])
def test_planner_moves_groups(budget_cut):
    a = analyse(model())
    n = len(a.order)
    costs = CostModel(np.full(n, 1e-4), lambda b, d: 1e-6 + b / 1e9)
    total = sum(t.nbytes() or 0 for t in a.tensors.values() if t.is_initializer)
    p = plan(a, OffloadOptions(budget=total + 6000 - budget_cut, activations=False,
                               min_bytes=0), costs)
    _check_groups(p.choice)
    assert p.planned.peak_bytes <= p.budget


def test_rewritten_groups_compute_the_same(tmp_path):
    import onnxruntime as ort

    from ho_onnx.rewrite.pipeline import optimize
    from ho_onnx.target.ort.runtime import session_options

    src = tmp_path / "m.onnx"
    onnx.save(model(), str(src))
    out = tmp_path / "o.onnx"
    r = optimize(src, out, OffloadOptions(activations=False, min_bytes=0))
    _check_groups(r.choice)
    x = np.random.default_rng(1).standard_normal((1, 8, 64)).astype(np.float32)
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    want = ort.InferenceSession(str(src), so).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(out), session_options(out, base=so)).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)
