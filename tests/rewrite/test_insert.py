"""The insertion pass (rewrite.insert): structure of the rewritten graph, checked in ORT."""

from __future__ import annotations

import onnx
import onnx_ir as ir
from graphs import chain_model, text_model

from ho_onnx import contract
from ho_onnx.graph.analyse import analyse
from ho_onnx.rewrite.insert import insert_cache_ops, token_elems
from ho_onnx.rewrite.invariants import check_schedule
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.schedule.policy import choose


def _check_schedule(model: ir.Model) -> None:
    """Valid ONNX, and the schedule invariants the production verifier checks (sorted, every
    Wait after its Prefetch, no consumer reads a Prefetch, Store/Detach/Prefetch chains,
    FIFO channels)."""
    onnx.checker.check_model(ir.to_proto(model))
    check_schedule(model)


def test_insertion_structure():
    a = analyse(chain_model(), {"N": 4})
    c = choose(a, OffloadOptions(min_bytes=0, min_gap=1, prefetch_distance=2))
    r = insert_cache_ops(a, c)
    _check_schedule(r.model)
    m = ir.to_proto(r.model)
    assert {i.domain: i.version for i in m.opset_import}[contract.DOMAIN] == contract.OPSET_VERSION
    # offloaded weights left the initializers; an empty per-type source replaced them
    names = {t.name for t in m.graph.initializer}
    assert "W1" not in names and "W2" not in names
    src = [t for t in m.graph.initializer if t.name.startswith("ho_onnx.src.")]
    assert len(src) == 1 and list(src[0].dims) == [0]
    assert set(r.weights) == {"W1", "W2"}
    by_op: dict[str, int] = {}
    for n in m.graph.node:
        if n.domain == contract.DOMAIN:
            by_op[n.op_type] = by_op.get(n.op_type, 0) + 1
    n_act = len(c.activations)
    assert by_op == {contract.PREFETCH: 2 + n_act, contract.WAIT: 2 + n_act, contract.STORE: n_act,
                     contract.DETACH: n_act}
    assert r.cache_nodes == sum(by_op.values())
    # the rewrite is in place: the analysed model is the rewritten one
    assert a.model is r.model


def test_activation_schedule_positions():
    a = analyse(chain_model(), {"N": 4})
    c = choose(a, OffloadOptions(weights=False, min_bytes=0, min_gap=3, prefetch_distance=1))
    m = ir.to_proto(insert_cache_ops(a, c).model)
    order = [n.name or n.op_type for n in m.graph.node]
    idx = {n.name: i for i, n in enumerate(m.graph.node)}
    store, detach = idx["ho.store.h1"], idx["ho.detach.h1"]
    prefetch, wait = idx["ho.prefetch.h1"], idx["ho.wait.h1"]
    relu = next(i for i, n in enumerate(m.graph.node) if n.op_type == "Relu")
    add = next(i for i, n in enumerate(m.graph.node) if n.op_type == "Add")
    sig = next(i for i, n in enumerate(m.graph.node) if n.op_type == "Sigmoid")
    assert store < relu < detach < prefetch < wait < add, order
    # prefetch distance 1: exactly one compute node (Sigmoid) in the prefetch window
    assert prefetch < sig < wait
    assert m.graph.node[prefetch].input[1:] == ["h4"]  # not before the node ahead of the window
    # Detach depends on the early consumer, Wait on the node before the late consumer
    det = m.graph.node[detach]
    assert det.input[0] == "h1" and "h2" in det.input[2:]
    assert m.graph.node[wait].input[1:] == ["h5"]
    assert m.graph.node[add].input[1] == m.graph.node[wait].output[0]
    # the token is 16 bytes of the tensor's own type
    vi = {v.name: v for v in m.graph.value_info}[det.input[1]]
    assert [d.dim_value for d in vi.type.tensor_type.shape.dim] == [token_elems(1)] == [4]


def test_subgraph_outer_scope_values_are_not_offloaded():
    m = text_model("""
    g (float[4] x, bool c) => (float[4] y) {
      h = Relu(x)
      k = Sigmoid(h)
      z = If(c) <then_branch = t () => (float[4] o) { o = Neg(h) },
                  else_branch = e () => (float[4] o) { o = Identity(W) }>
      y = Add(z, k)
    }
    """, W=(4,))
    a = analyse(m)
    assert a.tensors["h"].implicit_consumers == [2]
    c = choose(a, OffloadOptions(min_bytes=0, min_gap=1))
    assert "h" in c.skipped and "W" in c.skipped
    assert "subgraph" in c.skipped["W"]
    _check_schedule(insert_cache_ops(a, c).model)


def test_prefetch_of_first_weight_depends_on_a_graph_input():
    a = analyse(chain_model(), {"N": 4})
    m = ir.to_proto(insert_cache_ops(a, choose(a, OffloadOptions(activations=False,
                                                                  min_bytes=0))).model)
    first = m.graph.node[0]
    assert first.op_type == contract.PREFETCH and first.input[1:] == ["x"]


def test_shape_readers_of_an_offloaded_weight_become_constants(tmp_path):
    """Shape/Size need no transfer: they are replaced by constants (ORT would otherwise fold
    them through the declared shape and silently drop the transfer we inserted)."""
    import numpy as np

    from ho_onnx.target.ort.runtime import InferenceSession, counters, reset_counters

    m = text_model("""
    g (float[2, 6] x) => (float[2, 4] y, int64[1] s, int64 n) {
      y = MatMul(x, W)
      s = Shape <start = -1> (W)
      n = Size(W)
    }
    """, W=(6, 4))
    a = analyse(m)
    c = choose(a, OffloadOptions(activations=False, min_bytes=0))
    assert c.weights[0].consumers == (0,) and c.weights[0].shape_readers == (1, 2)
    r = insert_cache_ops(a, c)
    kinds = [n.op_type for n in r.model.graph]
    assert kinds.count(contract.PREFETCH) == 1 and kinds.count("Constant") == 2
    src, out = tmp_path / "m.onnx", tmp_path / "m.ho.onnx"
    onnx.save(m, str(src))
    from ho_onnx.rewrite.pipeline import optimize

    optimize(src, out, OffloadOptions(activations=False, min_bytes=0))
    x = np.ones((2, 6), np.float32)
    reset_counters()
    y, s, n = InferenceSession(out).run(None, {"x": x})
    assert counters()["bytes_loaded"] == 6 * 4 * 4
    w = onnx.numpy_helper.to_array(m.graph.initializer[0])
    assert np.allclose(y, x @ w) and s.tolist() == [4] and int(n) == 24


def test_stores_carry_the_stored_peak_for_ring_sizing():
    a = analyse(chain_model(), {"N": 4})
    c = choose(a, OffloadOptions(weights=False, min_bytes=0, min_gap=1))
    m = ir.to_proto(insert_cache_ops(a, c).model)
    stores = [n for n in m.graph.node if n.op_type == contract.STORE]
    values = {onnx.helper.get_attribute_value(x) for n in stores for x in n.attribute
              if x.name == contract.ATTR_HOST_BYTES}
    # every activation is [4, 16] fp32 = 256 bytes; h1 (producer 0, last reader 5) overlaps
    # each of the others, which overlap each other pairwise (producer to first late use)
    from ho_onnx.schedule.lifetimes import stored_peak_bytes

    assert values == {stored_peak_bytes(c)}
    assert 256 * 2 <= stored_peak_bytes(c) <= 256 * len(c.activations)


def test_an_analysis_rewrites_its_model_once():
    import pytest

    a = analyse(chain_model(), {"N": 4})
    c = choose(a, OffloadOptions(activations=False, min_bytes=0))
    insert_cache_ops(a, c)
    with pytest.raises(ValueError, match="analyse the model again"):
        insert_cache_ops(a, c)


# ``a`` is read by the MatMul early and by ``y`` late: stored across the gap. The MatMul's
# product is read only by its bias Add, which ORT fuses with it into a Gemm.
BIASED = """
g (float[N, 16] x) => (float[N, 16] y) {
  a = Relu(x)
  m = MatMul(a, W)
  b = Add(m, B)
  c = Tanh(b)
  d = Sigmoid(c)
  e = Neg(d)
  y = Add(e, a)
}
"""


def test_a_detach_keeps_ort_fusing_a_matmul_and_its_bias(tmp_path):
    """The Detach of ``a`` (after its last early reader, the MatMul) takes no ordering input
    from the MatMul's product: a second reader of it kept ORT from fusing MatMul + Add into
    a Gemm (other kernels: a training run drifted 3.6e-4 in 20 steps at ORT's default level)."""
    import onnxruntime as ort

    from ho_onnx.target.ort.runtime import session_options

    model = text_model(BIASED, W=(16, 16), B=(16,))
    a = analyse(model, {"N": 4})
    c = choose(a, OffloadOptions(weights=False, min_bytes=0, min_gap=3, prefetch_distance=1))
    assert [x.name for x in c.activations] == ["a"]
    r = insert_cache_ops(a, c)
    _check_schedule(r.model)
    det = next(n for n in r.model.graph if n.op_type == contract.DETACH)
    assert "m" not in [v.name for v in det.inputs if v is not None]
    path = tmp_path / "m.onnx"
    onnx.save(ir.to_proto(r.model), path)
    opt = tmp_path / "opt.onnx"
    so = session_options(path)
    so.optimized_model_filepath = str(opt)
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    ops = {n.op_type for n in onnx.load(str(opt)).graph.node}
    assert ops & {"Gemm", "FusedGemm"} and "MatMul" not in ops, ops

