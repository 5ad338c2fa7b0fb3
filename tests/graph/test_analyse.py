"""The analyses (graph.analyse) on hand-written graphs: order, lifetimes, sizes, dims."""

from __future__ import annotations

import pytest
from graphs import chain_model

from ho_onnx.errors import UnboundDimError
from ho_onnx.graph.analyse import analyse, topological_order


def test_lifetimes_and_sizes():
    a = analyse(chain_model(), {"N": 4})
    h1 = a.tensors["h1"]
    assert (h1.producer, h1.consumers) == (0, [1, 5])
    assert h1.nbytes({"N": 4}) == 4 * 16 * 4
    assert a.tensors["W1"].is_initializer and a.tensors["W1"].nbytes() == 16 * 16 * 4
    assert a.tensors["y"].is_graph_output
    assert a.last_use("h1") == 5


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


def test_symbolic_dim_expressions():
    from ho_onnx.graph.analyse import eval_dim

    assert eval_dim("seq + 1", {"seq": 9}) == 10
    assert eval_dim("2*batch", {"batch": 3}) == 6
    assert eval_dim("s // 2", {"s": 9}) == 4
    with pytest.raises(UnboundDimError, match=r"'past' \(in 'seq \+ past'\)"):
        eval_dim("seq + past", {"seq": 1})
    with pytest.raises(UnboundDimError, match="'weird dim!'"):
        eval_dim("weird dim!", {})
