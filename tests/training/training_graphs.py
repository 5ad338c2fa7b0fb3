"""Small training graphs as ``onnxruntime.training.artifacts.generate_artifacts`` writes them
(parameters, gradient buffers and ``lazy_reset_grad`` as graph inputs; ORT's gradient, loss
and accumulator ops of domain com.microsoft with their schemas' inputs and outputs), built
with onnx's helper: no training runtime needed."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MS = "com.microsoft"
F = TensorProto.FLOAT


def mlp_training_graph(batch: int = 64, hidden: int = 256, layers: int = 3,
                       classes: int = 10) -> onnx.ModelProto:
    """A ``layers``-deep ReLU MLP's training graph: forward, SoftmaxCrossEntropyLoss,
    SoftmaxCrossEntropyLossGrad, per layer Gemm gradients and ReluGrad, one
    InPlaceAccumulatorV2 per weight. Outputs: the loss and the accumulators' flags; no
    value_info (types come from inference)."""
    nodes: list[onnx.NodeProto] = []
    inputs = [helper.make_tensor_value_info("x", F, [batch, hidden]),
              helper.make_tensor_value_info("labels", TensorProto.INT64, [batch])]
    dims = [(hidden, classes if i == layers - 1 else hidden) for i in range(layers)]
    for i, shape in enumerate(dims):
        inputs.append(helper.make_tensor_value_info(f"w{i}", F, list(shape)))
    for i, shape in enumerate(dims):
        inputs.append(helper.make_tensor_value_info(f"w{i}_grad.accumulation.buffer", F,
                                                    list(shape)))
    inputs.append(helper.make_tensor_value_info("lazy_reset_grad", TensorProto.BOOL, [1]))
    h = "x"
    for i in range(layers):
        if i == layers - 1:
            nodes.append(helper.make_node("MatMul", [h, f"w{i}"], ["logits"]))
        else:
            nodes.append(helper.make_node("MatMul", [h, f"w{i}"], [f"a{i}"]))
            nodes.append(helper.make_node("Relu", [f"a{i}"], [f"h{i}"]))
            h = f"h{i}"
    nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"],
                                  ["loss", "log_prob"], reduction="mean"))
    nodes.append(helper.make_node("SoftmaxCrossEntropyLossGrad",
                                  ["loss_grad", "log_prob", "labels"], ["logits_grad"],
                                  domain=MS, reduction="mean"))
    d = "logits_grad"
    for i in reversed(range(layers)):
        x_in = "x" if i == 0 else f"h{i - 1}"
        nodes.append(helper.make_node("Gemm", [x_in, d], [f"w{i}_grad"], transA=1))
        if i:
            nodes.append(helper.make_node("Gemm", [d, f"w{i}"], [f"h{i - 1}_grad"], transB=1))
            nodes.append(helper.make_node("ReluGrad", [f"h{i - 1}_grad", f"h{i - 1}"],
                                          [f"a{i - 1}_grad"], domain=MS))
            d = f"a{i - 1}_grad"
    outputs = [helper.make_tensor_value_info("loss", F, [])]
    for i in range(layers):
        nodes.append(helper.make_node(
            "InPlaceAccumulatorV2",
            [f"w{i}_grad.accumulation.buffer", f"w{i}_grad", "lazy_reset_grad"],
            [f"w{i}_grad.accumulation.out"], domain=MS))
        outputs.append(helper.make_tensor_value_info(f"w{i}_grad.accumulation.out",
                                                     TensorProto.BOOL, [1]))
    graph = helper.make_graph(nodes, "mlp_training", inputs, outputs,
                              [numpy_helper.from_array(np.array(1.0, np.float32), "loss_grad")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid(MS, 1)], ir_version=9)


def norm_training_graph(rows: int = 32, width: int = 64) -> onnx.ModelProto:
    """LayerNormalization, Softmax and Gather with their gradients (LayerNormalizationGrad,
    SoftmaxGrad_13, GatherGrad): ``(y, x_grad, scale_grad, bias_grad, table_grad)``."""
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["x"]),
        helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["ln", "mean", "rstd"],
                         axis=-1),
        helper.make_node("Softmax", ["ln"], ["y"], axis=-1),
        helper.make_node("SoftmaxGrad_13", ["y_grad", "y"], ["ln_grad"], domain=MS, axis=-1),
        helper.make_node("LayerNormalizationGrad", ["ln_grad", "x", "scale", "mean", "rstd"],
                         ["x_grad", "scale_grad", "bias_grad"], domain=MS, axis=-1),
        helper.make_node("Shape", ["table"], ["table_shape"]),
        helper.make_node("GatherGrad", ["table_shape", "ids", "x_grad"], ["table_grad"],
                         domain=MS),
    ]
    inputs = [helper.make_tensor_value_info("table", F, [rows * 2, width]),
              helper.make_tensor_value_info("ids", TensorProto.INT64, [rows]),
              helper.make_tensor_value_info("scale", F, [width]),
              helper.make_tensor_value_info("bias", F, [width]),
              helper.make_tensor_value_info("y_grad", F, [rows, width])]
    outputs = [helper.make_tensor_value_info(n, F, shape) for n, shape in (
        ("y", [rows, width]), ("x_grad", [rows, width]), ("scale_grad", [width]),
        ("bias_grad", [width]), ("table_grad", [rows * 2, width]))]
    graph = helper.make_graph(nodes, "norm_training", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid(MS, 1)], ir_version=9)
