"""The rewriter's passes on hand-written graphs: analyses, choice and insertion structure."""

from __future__ import annotations

import onnx
import pytest
from graphs import chain_model, text_model

from ho_onnx import ops
from ho_onnx.analysis import analyse, topological_order
from ho_onnx.choice import OffloadPolicy, choose, largest_gap
from ho_onnx.errors import UnboundDimError
from ho_onnx.insertion import insert_cache_ops, token_elems


def test_lifetimes_and_sizes():
    a = analyse(chain_model(), {"N": 4})
    h1 = a.tensors["h1"]
    assert (h1.producer, h1.consumers) == (0, [1, 5])
    assert h1.nbytes({"N": 4}) == 4 * 16 * 4
    assert a.tensors["W1"].is_initializer and a.tensors["W1"].nbytes() == 16 * 16 * 4
    assert a.tensors["y"].is_graph_output
    assert a.last_use("h1") == 5


def test_unbound_dim_is_named():
    a = analyse(chain_model())
    with pytest.raises(UnboundDimError, match=r"'N'.*--dim N="):
        a.tensors["h1"].nbytes({})
    # min_bytes > 0 needs the size of every activation candidate
    with pytest.raises(UnboundDimError, match="'N'"):
        choose(a, OffloadPolicy("activations", min_bytes=1, min_gap=1))
    # ... but forced offload of everything does not
    c = choose(a, OffloadPolicy("activations", min_bytes=0, min_gap=1))
    assert {x.name for x in c.activations} >= {"h1", "h2"}


def test_largest_gap():
    assert largest_gap(0, [1, 5]) == (4, 1)
    assert largest_gap(0, [3, 4]) == (3, 0)
    assert largest_gap(2, [3]) == (1, 0)


def test_topological_order_repairs_unsorted_graph():
    m = chain_model()
    nodes = list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(reversed(nodes))
    order = topological_order(m.graph)
    produced = {i.name for i in m.graph.input} | {t.name for t in m.graph.initializer}
    for i in order:
        assert all(n in produced for n in m.graph.node[i].input)
        produced.update(m.graph.node[i].output)


def test_choice_policy():
    a = analyse(chain_model(), {"N": 4})
    c = choose(a, OffloadPolicy("all", min_bytes=0, min_gap=3))
    assert {w.name for w in c.weights} == {"W1", "W2"}
    assert [x.name for x in c.activations] == ["h1"]  # the only gap >= 3
    h1 = c.activations[0]
    assert (h1.producer, h1.early, h1.late) == (0, (1,), (5,))
    assert c.skipped["y"] == "graph output"
    c = choose(a, OffloadPolicy("weights", min_bytes=2000))
    assert [w.name for w in c.weights] == []  # 1024 bytes each
    assert choose(a, OffloadPolicy("none")).weights == []


def _positions(model: onnx.ModelProto) -> dict[str, int]:
    return {o: i for i, n in enumerate(model.graph.node) for o in n.output}


def _check_schedule(model: onnx.ModelProto) -> None:
    """Topologically sorted; every Wait after its Prefetch; no consumer reads a Prefetch."""
    onnx.checker.check_model(model)
    pos = _positions(model)
    avail = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
    for node in model.graph.node:
        assert all(n in avail for n in node.input if n), node.name
        avail.update(node.output)
    prefetch_out = {n.output[0] for n in model.graph.node
                    if n.domain == ops.DOMAIN and n.op_type == ops.PREFETCH}
    for node in model.graph.node:
        if node.domain == ops.DOMAIN and node.op_type == ops.WAIT:
            assert node.input[0] in prefetch_out
            continue
        assert not set(node.input) & prefetch_out, f"{node.name} reads a Prefetch output"
    assert all(pos[o] >= 0 for o in pos)


def test_insertion_structure():
    a = analyse(chain_model(), {"N": 4})
    c = choose(a, OffloadPolicy("all", min_bytes=0, min_gap=1, prefetch_distance=2))
    r = insert_cache_ops(a, c)
    m = r.model
    _check_schedule(m)
    assert {i.domain: i.version for i in m.opset_import}[ops.DOMAIN] == ops.OPSET_VERSION
    # offloaded weights left the initializers; an empty per-type source replaced them
    names = {t.name for t in m.graph.initializer}
    assert "W1" not in names and "W2" not in names
    src = [t for t in m.graph.initializer if t.name.startswith("ho_onnx.src.")]
    assert len(src) == 1 and list(src[0].dims) == [0]
    assert set(r.weights) == {"W1", "W2"}
    by_op: dict[str, int] = {}
    for n in m.graph.node:
        if n.domain == ops.DOMAIN:
            by_op[n.op_type] = by_op.get(n.op_type, 0) + 1
    n_act = len(c.activations)
    assert by_op == {ops.PREFETCH: 2 + n_act, ops.WAIT: 2 + n_act, ops.STORE: n_act,
                     ops.DETACH: n_act}
    assert r.cache_nodes == sum(by_op.values())
    # analysis' model is untouched
    assert len(a.model.graph.node) == 6


def test_activation_schedule_positions():
    a = analyse(chain_model(), {"N": 4})
    c = choose(a, OffloadPolicy("activations", min_bytes=0, min_gap=3, prefetch_distance=1))
    m = insert_cache_ops(a, c).model
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
    c = choose(a, OffloadPolicy("all", min_bytes=0, min_gap=1))
    assert "h" in c.skipped and "W" in c.skipped
    assert "subgraph" in c.skipped["W"]
    _check_schedule(insert_cache_ops(a, c).model)


def test_prefetch_of_first_weight_depends_on_a_graph_input():
    a = analyse(chain_model(), {"N": 4})
    m = insert_cache_ops(a, choose(a, OffloadPolicy("weights", min_bytes=0))).model
    first = m.graph.node[0]
    assert first.op_type == ops.PREFETCH and first.input[1:] == ["x"]


def test_symbolic_dim_expressions():
    from ho_onnx.analysis import eval_dim

    assert eval_dim("seq + 1", {"seq": 9}) == 10
    assert eval_dim("2*batch", {"batch": 3}) == 6
    assert eval_dim("s // 2", {"s": 9}) == 4
    with pytest.raises(UnboundDimError, match=r"'past' \(in 'seq \+ past'\)"):
        eval_dim("seq + past", {"seq": 1})
    with pytest.raises(UnboundDimError, match="'weird dim!'"):
        eval_dim("weird dim!", {})


def test_shape_readers_of_an_offloaded_weight_become_constants(tmp_path):
    """Shape/Size need no transfer: they are replaced by constants (ORT would otherwise fold
    them through the declared shape and silently drop the transfer we inserted)."""
    import numpy as np

    from ho_onnx.runtime import InferenceSession, counters, reset_counters

    m = text_model("""
    g (float[2, 6] x) => (float[2, 4] y, int64[1] s, int64 n) {
      y = MatMul(x, W)
      s = Shape <start = -1> (W)
      n = Size(W)
    }
    """, W=(6, 4))
    a = analyse(m)
    c = choose(a, OffloadPolicy("weights", min_bytes=0))
    assert c.weights[0].consumers == (0,) and c.weights[0].shape_readers == (1, 2)
    r = insert_cache_ops(a, c)
    kinds = [n.op_type for n in r.model.graph.node]
    assert kinds.count(ops.PREFETCH) == 1 and kinds.count("Constant") == 2
    src, out = tmp_path / "m.onnx", tmp_path / "m.ho.onnx"
    onnx.save(m, str(src))
    from ho_onnx.pipeline import optimize

    optimize(src, out, OffloadPolicy("weights", min_bytes=0))
    x = np.ones((2, 6), np.float32)
    reset_counters()
    y, s, n = InferenceSession(out).run(None, {"x": x})
    assert counters()["bytes_loaded"] == 6 * 4 * 4
    w = onnx.numpy_helper.to_array(m.graph.initializer[0])
    assert np.allclose(y, x @ w) and s.tolist() == [4] and int(n) == 24


def test_stores_carry_the_stored_peak_for_ring_sizing():
    a = analyse(chain_model(), {"N": 4})
    c = choose(a, OffloadPolicy("activations", min_bytes=0, min_gap=1))
    m = insert_cache_ops(a, c).model
    stores = [n for n in m.graph.node if n.op_type == ops.STORE]
    values = {onnx.helper.get_attribute_value(x) for n in stores for x in n.attribute
              if x.name == ops.ATTR_HOST_BYTES}
    # every activation is [4, 16] fp32 = 256 bytes; h1 (producer 0, last reader 5) overlaps
    # each of the others, which overlap each other pairwise (producer to first late use)
    from ho_onnx.insertion import stored_peak_bytes

    assert values == {stored_peak_bytes(c)}
    assert 256 * 2 <= stored_peak_bytes(c) <= 256 * len(c.activations)
