"""Prefetches on one channel are chained by their zero-size ``issued`` outputs, so the issue
order is the file's (FIFO per channel, as the simulator assumes) under any execution order."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from ho_onnx import OffloadOptions, optimize
from ho_onnx.contract import DOMAIN, PREFETCH
from ho_onnx.rewrite.insert import prefetch_channel
from ho_onnx.target.ort import runtime
from tests.graphs import save, text_model

# Two independent branches joined at the end: nothing but the chain orders the Prefetches of
# one branch against the other's. (ORT 1.32's sequential executor happened to follow the
# file order here even without the chain; ORT_PARALLEL or another ORT need not.)
BRANCHES = """
g (float[4, 32] x) => (float[4, 32] y) {
  a1 = MatMul(x, W1)
  a2 = Relu(a1)
  a3 = MatMul(a2, W2)
  a4 = Relu(a3)
  b1 = MatMul(x, W3)
  b2 = Relu(b1)
  b3 = MatMul(b2, W4)
  b4 = Relu(b3)
  y = Add(a4, b4)
}
"""


def _model(tmp_path: Path, tier: str = "host") -> tuple[Path, Path]:
    src = save(text_model(BRANCHES, W1=(32, 32), W2=(32, 32), W3=(32, 32), W4=(32, 32)),
               tmp_path / "m.onnx", external=True)
    out = tmp_path / "m.ho.onnx"
    optimize(src, out, OffloadOptions(activations=False, min_bytes=0, prefetch_distance=1,
                                      weight_tier=tier))
    return src, out


def _prefetches(m: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in m.graph.node if n.domain == DOMAIN and n.op_type == PREFETCH]


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_each_prefetch_waits_for_the_previous_one_on_its_channel(tmp_path, tier):
    _, out = _model(tmp_path, tier)
    m = onnx.load(out, load_external_data=False)
    pfs = _prefetches(m)
    assert len(pfs) == 4 and {prefetch_channel(p) for p in pfs} == {
        "disk" if tier == "disk" else "load"}
    declared = {vi.name: vi for vi in m.graph.value_info}
    for prev, cur in itertools.pairwise(pfs):
        assert len(prev.output) == 2 and prev.output[1] in cur.input[1:]
        dims = declared[prev.output[1]].type.tensor_type.shape.dim
        assert [d.dim_value for d in dims] == [0]  # zero bytes: holds no memory
    assert len(pfs[-1].output) == 1  # nothing waits for the last one


def _issue_order(path: Path, order: str) -> list[str]:
    so = runtime.session_options(path, execution_order=order)
    so.enable_profiling = True
    so.profile_file_prefix = str(path.parent / f"prof_{order}")
    so.add_session_config_entry("session.disable_prepacking", "1")
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    sess.run(None, {"x": np.ones((4, 32), np.float32)})
    events = json.loads(Path(sess.end_profiling()).read_text())
    names = {p.name for p in _prefetches(onnx.load(path, load_external_data=False))}
    ran = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
           and e["name"].removesuffix("_kernel_time") in names]
    ran.sort(key=lambda e: e["ts"])
    return [e["name"].removesuffix("_kernel_time") for e in ran]


@pytest.mark.parametrize("order", ["default", "priority"])
def test_ort_issues_prefetches_in_file_order(tmp_path, order):
    _, out = _model(tmp_path)
    file_order = [p.name for p in _prefetches(onnx.load(out, load_external_data=False))]
    assert _issue_order(out, order) == file_order


def test_chained_model_is_bit_exact(tmp_path):
    src, out = _model(tmp_path)
    x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    want = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    for order in ("default", "priority"):
        base = ort.SessionOptions()
        base.add_session_config_entry("session.disable_prepacking", "1")
        got = runtime.InferenceSession(out, sess_options=base, execution_order=order).run(
            None, {"x": x})[0]
        np.testing.assert_array_equal(got, want)
