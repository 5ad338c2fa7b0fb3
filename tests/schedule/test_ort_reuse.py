"""ORT's buffer reuse replayed (``schedule/ort_reuse.py``), checked against ORT's own CPU
arena: the samples every Wait takes (``ho_onnx.sample_arena=1`` + ``arena_trace``)."""

from __future__ import annotations

import graphs
import numpy as np
import onnxruntime as ort
import pytest

from ho_onnx import _ops
from ho_onnx.contract import CONFIG_SAMPLE_ARENA
from ho_onnx.graph.analyse import analyse
from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.lifetimes import schedule_memory
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.schedule.ort_reuse import ort_buffer_intervals, ort_memory
from ho_onnx.target.ort import runtime

MIB = 1 << 20

# t1 and t2 ([512, 512] f32, 1 MiB each) die at steps 1 and 2; Split's two [512, 512] outputs
# at step 4 take their buffers from ORT's free list, so ORT holds both through steps 2-3,
# where t3 and t4 (2 MiB each, a shape nothing else has) are live. Tensors at step 3:
# t3 + t4 = 4 MiB; ORT's buffers: t1 + t2 + t3 + t4 = 6 MiB. None of these ops writes in
# place. W (1 MiB) is read last, so with weights offloaded its Wait samples ORT's arena
# after the peak.
GAP = """
gap (float[512, 512] x) => (float[512, 512] y) {
  t1 = Transpose<perm = [1, 0]>(x)
  t2 = MatMul(t1, t1)
  t3 = Concat<axis = 0>(t2, t2)
  t4 = Transpose<perm = [1, 0]>(t3)
  s1, s2 = Split<axis = 1>(t4)
  m = MatMul(s1, W)
  y = MatMul(m, s2)
}
"""


def _model():
    return graphs.text_model(GAP, W=(512, 512))


def _gap(tmp_path):
    return graphs.save(_model(), tmp_path / "gap.onnx")


def test_a_reused_buffer_is_held_across_the_gap():
    a = analyse(_model())
    tensors = schedule_memory(a, None)
    reused = ort_memory(a, None)
    static = MIB  # W (x is read at step 0 only)
    pos = a.tensors["t4"].producer
    assert tensors[pos] - static == 4 * MIB
    assert reused[pos] - static == 6 * MIB
    intervals, held = ort_buffer_intervals(a, None)
    assert held == static
    # x, t1, t2, t3, t4, m, y: s1 and s2 take t2's and t1's buffers (s1 is still read when m
    # is allocated: ORT frees a node's inputs after allocating its outputs; y is a graph
    # output, never reused)
    assert sorted((b, s, e) for s, e, b in intervals) == [
        (MIB, 0, 0), (MIB, 0, 6), (MIB, 1, 5), (MIB, 5, 6), (MIB, 6, 6),
        (2 * MIB, 2, 3), (2 * MIB, 3, 4)]


def test_replay_matches_the_arena_ort_reports(tmp_path):
    """The replay's peak (the buffers ORT allocates; W's copy now among them) is what ORT's
    CPU arena reports as MaxInUse; the tensor count falls short of it by at least 1 MiB."""
    src = _gap(tmp_path)
    out = tmp_path / "gap.ho.onnx"
    r = optimize(src, out, OffloadOptions(activations=False, min_bytes=0, prefetch_distance=1))
    assert r.decision.choice.weights, "W must be offloaded so that a Wait samples the arena"
    choice = r.decision.choice
    _, held = ort_buffer_intervals(r.analysis, choice)
    predicted = int(ort_memory(r.analysis, choice).max()) - held
    tensor_count = int(schedule_memory(r.analysis, choice).max()) - held

    so = ort.SessionOptions()
    so.add_session_config_entry(CONFIG_SAMPLE_ARENA, "1")
    so.enable_mem_pattern = False
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = runtime.InferenceSession(str(out), sess_options=so, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
    _ops.set_debug(arena_trace=True)
    try:
        _ops.arena_trace()
        for _ in range(2):
            s.run(None, {"x": x})
        trace = _ops.arena_trace()
    finally:
        _ops.set_debug()
    if not trace or trace[-1]["max_in_use"] < 0:
        pytest.skip("this onnxruntime reports no arena statistics (needs >= 1.23)")
    assert [t["node"] for t in trace] == ["ho.wait.W.0"] * 2
    measured = trace[-1]["max_in_use"]
    assert abs(measured - predicted) <= 64 << 10, (measured, predicted, tensor_count)
    assert measured - tensor_count >= MIB, (measured, tensor_count)


def test_trace_is_off_unless_asked(tmp_path):
    src = _gap(tmp_path)
    out = tmp_path / "gap.ho.onnx"
    optimize(src, out, OffloadOptions(activations=False, min_bytes=0))
    so = ort.SessionOptions()
    so.add_session_config_entry(CONFIG_SAMPLE_ARENA, "1")
    s = runtime.InferenceSession(str(out), sess_options=so, providers=["CPUExecutionProvider"])
    x = np.ones((512, 512), np.float32)
    _ops.set_debug()
    _ops.arena_trace()
    s.run(None, {"x": x})
    assert _ops.arena_trace() == []
    try:  # the same run with the hook on does sample (else the check above proves nothing)
        _ops.set_debug(arena_trace=True)
        s.run(None, {"x": x})
        trace = _ops.arena_trace()
    finally:
        _ops.set_debug()
    if trace and trace[0]["max_in_use"] < 0:
        pytest.skip("this onnxruntime reports no arena statistics (needs >= 1.23)")
    assert [t["node"] for t in trace] == ["ho.wait.W.0"]
    assert _ops.arena_trace() == []  # read with reset
