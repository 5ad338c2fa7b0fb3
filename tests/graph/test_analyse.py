"""The analyses (graph.analyse) on hand-written graphs: order, lifetimes, sizes, dims, and
their structure on the onnx_ir model (use-def chains, subgraphs, sorting in place)."""

from __future__ import annotations

import onnx_ir as ir
import pytest
from graphs import chain_model, text_model
from onnx import TensorProto

from ho_onnx.errors import UnboundDimError, UnsupportedModelError
from ho_onnx.graph.analyse import TensorInfo, analyse, is_sorted, sort_graph


def test_lifetimes_and_sizes():
    a = analyse(chain_model(), {"N": 4})
    h1 = a.tensors["h1"]
    assert (h1.producer, h1.consumers) == (0, [1, 5])
    assert h1.nbytes({"N": 4}) == 4 * 16 * 4
    assert a.tensors["W1"].is_initializer and a.tensors["W1"].nbytes() == 16 * 16 * 4
    assert a.tensors["y"].is_graph_output
    assert a.last_use("h1") == 5


def test_a_tensor_past_a_pebibyte_is_one_short_error_and_an_empty_one_is_empty():
    """Many huge dims made a message of thousands of digits (and past 4,300 digits an
    unexpected ValueError of Python's int-to-text limit); a zero dim among them is a size."""
    huge = TensorInfo("t", TensorProto.FLOAT, (1 << 62,) * 300 + ("b",))
    with pytest.raises(UnsupportedModelError, match=r"over 1 PiB \(shape \[4611") as e:
        huge.nbytes({"b": 2})
    assert len(str(e.value)) < 400 and "(301 dims)" in str(e.value)
    assert TensorInfo("e", TensorProto.FLOAT, (1 << 62,) * 300 + (0,)).nbytes() == 0
    assert TensorInfo("s", TensorProto.FLOAT, (2, "b")).nbytes({"b": 3}) == 24


def test_unsorted_graph_is_sorted_in_place():
    m = chain_model()
    nodes = list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(reversed(nodes))
    model = ir.from_proto(m)
    assert not is_sorted(model.graph)
    order = sort_graph(model.graph)
    assert is_sorted(model.graph) and sorted(order) == list(range(6)) and order != list(range(6))
    produced = {v.name for v in model.graph.inputs} | set(model.graph.initializers)
    for node in model.graph:
        assert all(v.name in produced for v in node.inputs if v is not None)
        produced.update(v.name for v in node.outputs)
    a = analyse(m, {"N": 4})  # the analysis' positions follow the sorted graph
    assert [n.op_type for n in a.nodes] == ["MatMul", "Relu", "MatMul", "Relu", "Sigmoid", "Add"]
    assert a.order == [5, 4, 3, 2, 1, 0]  # file index of each position


def test_sorted_graph_keeps_its_order_and_the_analysis_changes_nothing_else():
    model = ir.from_proto(chain_model())
    before = list(model.graph)
    a = analyse(model, {"N": 4})
    assert a.model is model and list(model.graph) == before and a.nodes == before
    assert a.order == list(range(6))
    # the analysis' types are its own: the model's values stay untyped (dims are bound)
    assert model.graph.node(0).outputs[0].shape is None
    assert a.tensors["h1"].shape == (4, 16)


def test_uses_come_from_the_use_def_chains():
    a = analyse(chain_model(), {"N": 4})
    h1 = a.values["h1"]
    assert h1.producer() is a.nodes[0]
    assert sorted(a.nodes.index(u.node) for u in h1.uses()) == a.tensors["h1"].consumers


IF_MODEL = """
branchy (float[4] x, bool c) => (float[4] y) {
  a = Relu(x)
  b = Neg(x)
  y = If(c) <then_branch = g1 () => (float[4] t) { t = Add(a, b) },
             else_branch = g2 () => (float[4] e) { e = Identity(a) }>
}
"""

LOOP_IN_IF = """
nested (float[4] x, bool c) => (float[4] y) {
  a = Relu(x)
  y = If(c) <then_branch = g1 () => (float[4] t) {
                 t = If(c) <then_branch = h1 () => (float[4] u) { u = Neg(a) },
                            else_branch = h2 () => (float[4] v) { v = Abs(x) }>
             },
             else_branch = g2 () => (float[4] e) { e = Identity(x) }>
}
"""


def test_outer_values_read_by_subgraphs_are_implicit_uses():
    a = analyse(text_model(IF_MODEL))
    if_pos = [n.op_type for n in a.nodes].index("If")
    assert a.tensors["a"].implicit_consumers == [if_pos]
    assert a.tensors["b"].implicit_consumers == [if_pos]
    assert a.tensors["a"].consumers == [] and a.last_use("a") == if_pos


def test_reads_from_nested_subgraphs_reach_the_main_graph_node():
    a = analyse(text_model(LOOP_IN_IF))
    if_pos = [n.op_type for n in a.nodes].index("If")
    assert a.tensors["a"].implicit_consumers == [if_pos]
    assert a.tensors["x"].implicit_consumers == [if_pos]
    assert a.tensors["x"].consumers == [0]



def test_nested_subgraphs_are_each_walked_once(monkeypatch):
    """Found by hand: each graph at depth d was walked 2^d times (30 nested Ifs, a 4 KB model,
    kept inspect and optimize busy for hours). Each node's subgraphs are now read once, and
    a read at depth 16 still reaches the main graph's If."""
    from graphs import nested_if_model

    import ho_onnx.graph.analyse as analyse_mod

    depth = 16
    model = ir.from_proto(nested_if_model(depth))
    calls = []
    real = analyse_mod.subgraphs
    monkeypatch.setattr(analyse_mod, "subgraphs", lambda n: (calls.append(n), real(n))[1])
    owners = analyse_mod.subgraph_owners(model.graph)
    top_if = model.graph.node(1)
    assert len(owners) == 2 * depth and set(owners.values()) == {top_if}
    nested_nodes = 2 * depth  # an If (or the innermost Neg) and an Abs in each level
    assert len(calls) == 1 + nested_nodes  # (was 2^17 - 1 + ...)
    assert len(calls) == len(set(calls))
    a = analyse(nested_if_model(depth))
    assert a.tensors["a"].implicit_consumers == [1] and a.last_use("a") == 1

def test_a_subgraph_read_orders_the_graph():
    m = text_model(IF_MODEL)
    nodes = list(m.graph.node)  # the If first: it reads a and b from its branches
    del m.graph.node[:]
    m.graph.node.extend([nodes[2], nodes[0], nodes[1]])
    model = ir.from_proto(m)
    assert not is_sorted(model.graph)
    sort_graph(model.graph)
    assert [n.op_type for n in model.graph][-1] == "If"


def test_symbolic_dim_expressions():
    from ho_onnx.graph.dims import eval_dim

    assert eval_dim("seq + 1", {"seq": 9}) == 10
    assert eval_dim("2*batch", {"batch": 3}) == 6
    assert eval_dim("s // 2", {"s": 9}) == 4
    with pytest.raises(UnboundDimError, match=r"'past' \(in 'seq \+ past'\)"):
        eval_dim("seq + past", {"seq": 1})
    with pytest.raises(UnboundDimError, match="'weird dim!'"):
        eval_dim("weird dim!", {})


def test_a_dim_onnx_invented_does_not_keep_a_known_type_out():
    """onnx names a dim it cannot infer ``unk__N``: such a type told as much as a fully
    known one from ``more_types`` and kept it out (found in training graphs: sizes unknown)."""
    from onnx import TensorProto, helper

    from ho_onnx.graph.analyse import analyse

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 256])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [256, 256])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [256, "unk__0"])
    g = helper.make_graph([helper.make_node("Foo", ["x"], ["z"], domain="com.example"),
                           helper.make_node("Relu", ["z"], ["y"])], "g", [x], [y],
                          value_info=[z])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid("com.example", 1)])

    def more(proto, dims, shapes):
        return {"z": helper.make_tensor_type_proto(TensorProto.FLOAT, [256, 256])}

    a = analyse(m, more_types=more)
    assert a.tensors["z"].shape == (256, 256)
    assert a.tensors["z"].nbytes() == 256 * 256 * 4
