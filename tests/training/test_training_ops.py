"""ORT's training ops known without the training runtime (issue 39): the checks, the types
and the cost model read ho-onnx's table (ho_onnx.target.ort.training), and ``optimize``
accepts a training graph under plain onnxruntime, storing forward activations until the
backward pass. Graphs: tests/training/training_graphs.py (real schemas' inputs/outputs)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import helper
from training_graphs import MS, mlp_training_graph, norm_training_graph

from ho_onnx import OffloadOptions, optimize, plan_model
from ho_onnx.cost.analytic import node_flops_bytes
from ho_onnx.graph.analyse import analyse
from ho_onnx.target.ort.contrib import contrib_value_types, ort_check, refuse_unknown_ops
from ho_onnx.target.ort.training import TRAINING_OPS, runtime_trains, training_arity

HO = str(Path(sys.executable).with_name("ho-onnx"))


def _dims(tp: onnx.TypeProto) -> list[int]:
    return [d.dim_value for d in tp.tensor_type.shape.dim]


def _input_dims(model: onnx.ModelProto, name: str) -> list[int]:
    return next(_dims(vi.type) for vi in model.graph.input if vi.name == name)


def test_every_entry_matches_its_rules() -> None:
    """Each table row has one rule per output, and its indices name inputs it has."""
    for name, op in TRAINING_OPS.items():
        assert len(op.rules) == len(op.outputs), name
        assert 0 < op.required_inputs <= len(op.inputs), name
        assert 0 < op.required_outputs <= len(op.outputs), name
        assert op.per < len(op.inputs), name
        for rule in op.rules:
            assert not isinstance(rule, int) or rule < len(op.inputs), name
        assert training_arity()[(MS, name)].inputs == (op.required_inputs, len(op.inputs))


def test_types_of_gradients_come_from_the_table() -> None:
    """Without value_info, every output of the MLP's training graph gets its full shape:
    a gradient has its forward tensor's (ORT's symbolic inference alone gives up at the
    first training op)."""
    m = mlp_training_graph()
    types = contrib_value_types(m)
    outs = [o for n in m.graph.node for o in n.output]
    assert all(o in types and all(d.HasField("dim_value") for d in
                                  types[o].tensor_type.shape.dim) for o in outs)
    for fwd in ("a0", "h0", "a1", "h1", "logits"):
        assert _dims(types[f"{fwd}_grad"]) == _dims(types[fwd])
    for i in range(3):
        assert _dims(types[f"w{i}_grad"]) == _input_dims(m, f"w{i}")
        flag = types[f"w{i}_grad.accumulation.out"].tensor_type
        assert (flag.elem_type, _dims(types[f"w{i}_grad.accumulation.out"])) == (
            onnx.TensorProto.BOOL, [1])


def test_scatter_and_norm_gradients_typed() -> None:
    """GatherGrad's output has the shape its shape input holds; LayerNormalizationGrad's
    scale and bias gradients the scale's."""
    m = norm_training_graph(rows=32, width=64)
    del m.graph.output[1:]  # (no declared types to fall back on)
    types = contrib_value_types(m)
    assert _dims(types["table_grad"]) == _input_dims(m, "table")
    assert _dims(types["x_grad"]) == _dims(types["x"])
    assert _dims(types["scale_grad"]) == _dims(types["bias_grad"]) == _input_dims(m, "scale")


@pytest.mark.parametrize(("op", "inputs", "outputs", "why"), [
    ("ReluGrad", ["dy"], ["dx"], "takes 2 to 2 inputs, has 1"),
    ("LayerNormalizationGrad", ["dy", "x", "s", "m", "r"], ["dx"], "takes 3 to 3 outputs"),
    ("InPlaceAccumulatorV2", ["buf", ""], ["flag"], "has no name for its required input 1"),
])
def test_arity_checked(op: str, inputs: list[str], outputs: list[str], why: str) -> None:
    """A training node whose inputs or outputs do not fit its schema is refused by the
    checks, naming the node."""
    node = helper.make_node(op, inputs, outputs, domain=MS, name="bad")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(
        n, onnx.TensorProto.FLOAT, [2]) for n in inputs if n],
        [helper.make_tensor_value_info(outputs[0], onnx.TensorProto.FLOAT, [2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid(MS, 1)])
    with pytest.raises(onnx.checker.ValidationError, match=f"'bad': {MS}:{op} {why}"):
        refuse_unknown_ops(m)


def test_cli_refuses_a_bad_training_node(tmp_path: Path) -> None:
    m = mlp_training_graph()
    relu_grad = next(n for n in m.graph.node if n.op_type == "ReluGrad")
    del relu_grad.input[1]
    onnx.save(m, tmp_path / "bad.onnx")
    r = subprocess.run([HO, "optimize", str(tmp_path / "bad.onnx"), str(tmp_path / "o.onnx"),
                        "--offload", "all"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors == [r.stderr.strip().splitlines()[-1]]  # (after the progress lines)
    assert "ReluGrad takes 2 to 2 inputs, has 1" in errors[0]
    assert not (tmp_path / "o.onnx").exists()


def test_cost_of_training_ops_from_the_table() -> None:
    """FLOPs are the table's per-element count times the elements of its tensor; an
    in-place accumulator's buffer is read and written."""
    m = norm_training_graph(rows=32, width=64)
    a = analyse(m, more_types=contrib_value_types)
    by_op = {a.node_at(p).op_type: p for p in range(len(a.order))}
    ln = TRAINING_OPS["LayerNormalizationGrad"]
    flops, moved = node_flops_bytes(a, by_op["LayerNormalizationGrad"])
    assert flops == ln.flops * 32 * 64
    size = {n: t.nbytes({}) or 0 for n, t in a.tensors.items()}
    assert moved == sum(size[n] for n in ("ln_grad", "x", "scale", "mean", "rstd", "x_grad",
                                          "scale_grad", "bias_grad"))
    f, b = onnx.TensorProto.FLOAT, onnx.TensorProto.BOOL
    m = helper.make_model(helper.make_graph(
        [helper.make_node("InPlaceAccumulatorV2", ["buf", "value", "reset"], ["flag"],
                          domain=MS)], "acc",
        [helper.make_tensor_value_info("buf", f, [256, 256]),
         helper.make_tensor_value_info("value", f, [256, 256]),
         helper.make_tensor_value_info("reset", b, [1])],
        [helper.make_tensor_value_info("flag", b, [1])]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    a = analyse(m, more_types=contrib_value_types)
    flops, moved = node_flops_bytes(a, 0)
    assert flops == TRAINING_OPS["InPlaceAccumulatorV2"].flops * 256 * 256
    buf = 256 * 256 * 4
    assert moved == buf + buf + 1 + 1 + buf  # buffer, value, reset; flag; buffer written
    m = mlp_training_graph(batch=64, hidden=256, layers=3)
    a = analyse(m, more_types=contrib_value_types)
    relu = next(p for p in range(len(a.order)) if a.node_at(p).op_type == "ReluGrad")
    assert node_flops_bytes(a, relu)[0] == TRAINING_OPS["ReluGrad"].flops * 64 * 256


def _plan_budget(path: Path) -> int:
    """Three quarters of the unmodified graph's peak."""
    _, _, plan = plan_model(path, OffloadOptions(budget=1 << 40))
    return plan.baseline.peak_bytes * 3 // 4


def test_optimize_stores_forward_activations_until_backward(tmp_path: Path, caplog) -> None:
    """``optimize`` of a training graph succeeds under this runtime (plain onnxruntime: its
    ORT validation stands in for the training ops, and says so), and the planner stores
    forward activations for the backward pass: each is produced before the loss and
    reloaded after it, and every graph input (parameters, gradient buffers) stays."""
    m = mlp_training_graph(batch=2048, hidden=128, layers=4)  # (activations dominate)
    src = tmp_path / "train.onnx"
    onnx.save(m, src)
    budget = _plan_budget(src)
    with caplog.at_level(logging.WARNING):
        res = optimize(src, tmp_path / "train.ho.onnx", OffloadOptions(budget=budget))
    acts = res.choice.activations
    assert acts and not res.choice.weights
    a = res.analysis
    loss = next(p for p in range(len(a.order))
                if a.node_at(p).op_type == "SoftmaxCrossEntropyLoss")
    for act in acts:
        assert act.producer < loss < act.late[0], act
        assert not a.tensors[act.name].is_graph_input
    assert {"h0", "h1"} & {act.name for act in acts}
    assert res.plan is not None and res.plan.planned.peak_bytes <= budget
    stood = [r for r in caplog.records if "checked against ho-onnx's table" in r.getMessage()]
    assert bool(stood) == (not runtime_trains())
    ops = {n.op_type for n in onnx.load(tmp_path / "train.ho.onnx").graph.node}
    assert {"Store", "Prefetch", "Wait", "ReluGrad"} <= ops


def test_ort_check_stands_in_only_without_the_training_runtime(tmp_path: Path) -> None:
    """The written model is loaded by ORT: with the training ops themselves under
    onnxruntime-training, with stand-ins of their output types under plain onnxruntime."""
    onnx.save(mlp_training_graph(), tmp_path / "m.onnx")
    stood = ort_check(tmp_path / "m.onnx")
    if runtime_trains():
        assert stood == []
    else:
        assert sorted(stood) == ["InPlaceAccumulatorV2", "ReluGrad",
                                 "SoftmaxCrossEntropyLossGrad"]


def test_stand_ins_do_not_hide_errors_elsewhere(tmp_path: Path) -> None:
    """A graph ORT cannot load for a reason outside the training ops (an Add of float and
    int64) is still refused under the stand-ins."""
    m = mlp_training_graph()
    m.graph.node.append(helper.make_node("Add", ["loss", "labels"], ["bad"]))
    m.graph.output.append(helper.make_tensor_value_info("bad", onnx.TensorProto.FLOAT, None))
    onnx.save(m, tmp_path / "m.onnx")
    with pytest.raises(Exception, match="does not load"):
        ort_check(tmp_path / "m.onnx")
