"""ONNX Runtime's training operators: the facts about them that ho-onnx needs, in one table.

The graphs ``onnxruntime.training.artifacts.generate_artifacts`` writes hold gradient and
loss operators of domain ``com.microsoft`` (``ReluGrad``, ``LayerNormalizationGrad``,
``SoftmaxCrossEntropyLossGrad``, ``InPlaceAccumulatorV2``, ...) that only the training build
of ORT (``onnxruntime-training``) registers. :data:`TRAINING_OPS` records, per operator, its
schema's inputs and outputs (from ORT's ``training_op_defs.cc``; which are optional), the
type rule of each output and a cost (FLOPs per element of one tensor). It serves:

* the checks: :func:`training_arity` for :func:`~ho_onnx.graph.check.check_standard`;
* shape inference without the training runtime: :func:`with_stand_ins` replaces each
  training node by standard nodes whose outputs have the same types (never run: ONNX's and
  ORT's inference, and ORT loading a written model to validate the rest of it, read them);
* the cost model (:func:`~ho_onnx.target.ort.costs.contrib_flops_bytes`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper

from ...graph.check import NodeArity

DOMAIN = "com.microsoft"

# Output type rules (besides an input index: "the type and shape of that input").
FLAG = "flag"  # a bool tensor of shape [1] (an accumulator's "updated" flag)


@dataclass(frozen=True)
class ZerosOfShape:
    """The output has the shape held in input ``shape`` and the element type of input
    ``like`` (a scatter gradient: GatherGrad's ``dX``)."""

    shape: int
    like: int


OutputRule = int | str | ZerosOfShape


@dataclass(frozen=True)
class TrainingOp:
    """One training operator of ORT's schema registry.

    ``inputs``/``outputs``: the schema's names in order, the first ``required_inputs`` /
    ``required_outputs`` required, the rest optional. ``rules``: per output, the input whose
    type it has, :data:`FLAG`, or a :class:`ZerosOfShape`. ``flops``: FLOPs per element of
    input ``per`` (one element's arithmetic, rough: these ops are memory bound). ``in_place``:
    the input the kernel overwrites (its bytes are written as well as read)."""

    inputs: tuple[str, ...]
    required_inputs: int
    outputs: tuple[str, ...]
    required_outputs: int
    rules: tuple[OutputRule, ...]
    flops: float
    per: int = 0
    in_place: int | None = None


def _unary(flops: float, x: str = "X") -> TrainingOp:
    """``(dY, X) -> dX`` of an elementwise activation: ``dX`` has ``dY``'s type."""
    return TrainingOp(("dY", x), 2, ("dX",), 1, (0,), flops)


TRAINING_OPS: dict[str, TrainingOp] = {
    "ReluGrad": _unary(1.0),  # dY where X > 0
    "SigmoidGrad": _unary(3.0, "Y"),  # dY * Y * (1 - Y)
    "TanhGrad": _unary(3.0, "Y"),  # dY * (1 - Y^2)
    "QuickGeluGrad": _unary(8.0),
    "GeluGrad": _unary(12.0),  # erf and exp per element
    "FastGeluGrad": _unary(12.0),  # tanh per element
    "BiasGeluGrad_dX": TrainingOp(("dY", "X", "B"), 3, ("dX",), 1, (0,), 13.0),
    "BiasFastGeluGrad_dX": TrainingOp(("dY", "X", "B"), 3, ("dX",), 1, (0,), 13.0),
    # dX = Y * (dY - sum(Y * dY)): a product, a row sum, a difference, a product
    "SoftmaxGrad": _unary(4.0),
    "SoftmaxGrad_13": _unary(4.0, "Y"),
    "LogSoftmaxGrad": _unary(4.0),
    "LogSoftmaxGrad_13": _unary(4.0),
    "DropoutGrad": TrainingOp(("dy", "mask", "ratio", "training_mode"), 2, ("dx",), 1, (0,),
                              2.0),
    # per element of X: normalize again, scale, two row sums, the input gradient
    "LayerNormalizationGrad": TrainingOp(
        ("Y_grad", "X", "scale", "mean", "inv_std_var"), 5,
        ("X_grad", "scale_grad", "bias_grad"), 3, (1, 2, 2), 12.0, per=1),
    "SimplifiedLayerNormalizationGrad": TrainingOp(
        ("Y_grad", "X", "scale", "inv_std_var"), 4, ("X_grad", "scale_grad"), 2, (1, 2), 9.0,
        per=1),
    "InvertibleLayerNormalizationGrad": TrainingOp(
        ("Y_grad", "Y", "scale", "bias", "inv_std_var"), 5,
        ("X_grad", "scale_grad", "bias_grad"), 3, (1, 2, 2), 12.0, per=1),
    # d_logits = (exp(log_prob) - onehot(label)) * dY (/ N): per element of log_prob
    "SoftmaxCrossEntropyLossGrad": TrainingOp(
        ("dY", "log_prob", "label", "weight"), 3, ("d_logits",), 1, (1,), 3.0, per=1),
    # scatter-add of dY into zeros of the forward input's shape
    "GatherGrad": TrainingOp(("shape", "indices", "dY"), 3, ("dX",), 1,
                             (ZerosOfShape(shape=0, like=2),), 1.0, per=2),
    "GatherElementsGrad": TrainingOp(("dY", "shape", "indices"), 3, ("dX",), 1,
                                     (ZerosOfShape(shape=1, like=0),), 1.0),
    # gradient accumulation into the caller's buffer, in place
    "InPlaceAccumulatorV2": TrainingOp(
        ("accumulation_buffer", "value", "overwrite_flag"), 2,
        ("updated_flag", "accumulation_buffer_out"), 1, (FLAG, 0), 1.0, per=1, in_place=0),
    "InPlaceAccumulator": TrainingOp(("old_sum", "value", "update_signal"), 2, ("new_sum",),
                                     1, (0,), 1.0, per=1, in_place=0),
    "ZeroGradient": TrainingOp(("old_gradient", "reset_signal"), 2, ("zero_gradient",), 1,
                               (0,), 0.0),
}


def training_op(node: onnx.NodeProto) -> TrainingOp | None:
    """``node``'s entry in :data:`TRAINING_OPS`, or None (not a training op)."""
    return TRAINING_OPS.get(node.op_type) if node.domain == DOMAIN else None


@functools.lru_cache(maxsize=1)
def training_arity() -> dict[tuple[str, str], NodeArity]:
    """How many inputs and outputs each training op takes, by ``(domain, op_type)``."""
    return {(DOMAIN, name): NodeArity((op.required_inputs, len(op.inputs)),
                                      (op.required_outputs, len(op.outputs)))
            for name, op in TRAINING_OPS.items()}


@functools.lru_cache(maxsize=1)
def runtime_trains() -> bool:
    """Whether the installed onnxruntime is a training build (onnxruntime-training: it
    registers the training ops; its Python binding has the training API's ``Module``)."""
    try:
        from onnxruntime.capi import _pybind_state as C
    except ImportError:
        return False
    return hasattr(C, "Module") and hasattr(C, "Optimizer")


def training_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The main graph's nodes that are training ops of the table."""
    return [n for n in graph.node if training_op(n) is not None]


def _stand_in(node: onnx.NodeProto, op: TrainingOp) -> Iterable[onnx.NodeProto]:
    """Standard nodes whose outputs have the types ``node``'s outputs have."""
    for k, out in enumerate(node.output):
        if not out:
            continue
        rule = op.rules[k] if k < len(op.rules) else None
        if isinstance(rule, int) and rule < len(node.input) and node.input[rule]:
            yield helper.make_node("Identity", [node.input[rule]], [out])
        elif rule == FLAG:
            yield helper.make_node("Constant", [], [out], value=helper.make_tensor(
                out, TensorProto.BOOL, [1], [True]))
        elif (isinstance(rule, ZerosOfShape) and max(rule.shape, rule.like) < len(node.input)
              and node.input[rule.shape] and node.input[rule.like]):
            scalar = f"{out}.ho_training_scalar"
            yield helper.make_node("ReduceSum", [node.input[rule.like]], [scalar], keepdims=0)
            yield helper.make_node("Expand", [scalar, node.input[rule.shape]], [out])
        # (an output the rule cannot type stays unknown: nothing defines it)


def with_stand_ins(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of ``model`` whose main-graph training nodes are replaced by stand-ins of
    the same output types (Identity of the input whose type an output has, a bool
    ``[1]`` Constant for a flag, ``Expand`` to a shape input), and the distinct op types
    replaced. For type inference and for validating the rest of a model with a runtime that
    lacks the training ops: the stand-ins compute nothing of the kind."""
    if not training_nodes(model.graph):
        return model, []
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes: list[onnx.NodeProto] = []
    replaced: dict[str, None] = {}
    for n in model.graph.node:
        op = training_op(n)
        if op is None:
            nodes.append(n)
            continue
        replaced[n.op_type] = None
        nodes.extend(_stand_in(n, op))
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out, list(replaced)
