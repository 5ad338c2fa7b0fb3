"""What ONNX Runtime does with a model that the decisions must respect, in one place.

Each fact names the ORT behaviour it encodes; the deciders, the cost model and the insertion
pass consult these instead of knowing ORT themselves.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

# ORT 1.31 cannot register custom-op kernels for complex tensors (session creation fails),
# so complex tensors are never offloaded.
UNSUPPORTED_TYPES = (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128)
UNSUPPORTED_REASON = "complex tensors cannot be offloaded (ORT has no custom-op support for them)"

# Shape and Size read only their input's shape: ORT never needs the data for them.
SHAPE_OPS = ("Shape", "Size")


def is_default_domain(node: onnx.NodeProto | ir.Node) -> bool:
    """A node of the ONNX standard domain."""
    return node.domain in ("", "ai.onnx")


def reads_only_shape(node: onnx.NodeProto | ir.Node) -> bool:
    """A default-domain Shape or Size node: it needs its input's shape, not its data."""
    return node.op_type in SHAPE_OPS and is_default_domain(node)


def never_runs(node: onnx.NodeProto | ir.Node) -> bool:
    """ORT turns Constant nodes into initializers at load time: they cost no compute."""
    return node.op_type == "Constant" and is_default_domain(node)



# Ops whose kernels give the same bytes every time they run on the same inputs, and cost
# about what their inputs and outputs weigh (elementwise, layout, normalization): an
# activation made by them may be computed again before a late reader instead of stored
# (schedule.recompute). Random ops (Dropout, RandomNormal, ...) and ops with subgraphs are
# never among them; nor are MatMul, Conv or attention (their cost is the compute the
# offload saves elsewhere).
_RECOMPUTABLE_DEFAULT = frozenset((
    "Abs", "Add", "And", "Cast", "CastLike", "Ceil", "Celu", "Clip", "Concat", "Constant",
    "ConstantOfShape", "Cos", "Div", "Elu", "Equal", "Erf", "Exp", "Expand", "Flatten", "Floor",
    "Gather", "Gelu", "Greater", "GreaterOrEqual", "HardSigmoid", "HardSwish", "Identity",
    "IsInf", "IsNaN", "LayerNormalization", "LeakyRelu", "Less", "LessOrEqual", "Log",
    "LogSoftmax", "Max", "Min", "Mish", "Mod", "Mul", "Neg", "Not", "Or", "Pow", "PRelu",
    "Range", "Reciprocal", "Relu", "Reshape", "RMSNormalization", "Round", "Selu", "Shape",
    "Sigmoid", "Sign", "Sin", "Size", "Slice", "Softmax", "Softplus", "Softsign", "Sqrt",
    "Squeeze", "Sub", "Tanh", "Tile", "Transpose", "Trilu", "Unsqueeze", "Where", "Xor",
))
_RECOMPUTABLE_MS = frozenset((
    "BiasGelu", "FastGelu", "Gelu", "QuickGelu", "SimplifiedLayerNormalization",
))


def recomputable(node: onnx.NodeProto | ir.Node) -> bool:
    """Whether ``node`` may run a second time on the same inputs to make the same output
    (the ops above, none of which has a subgraph)."""
    if is_default_domain(node):
        return node.op_type in _RECOMPUTABLE_DEFAULT
    return node.domain == "com.microsoft" and node.op_type in _RECOMPUTABLE_MS
