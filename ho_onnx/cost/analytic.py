"""Analytic compute time: a roofline per node from the analysed shapes.

FLOPs and bytes moved (:func:`node_flops_bytes`; one small function per op family, chosen
from a table) against the machine's peak rate and memory bandwidth, plus a fixed per-node
launch overhead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
import onnx_ir as ir

from ..graph.analyse import (
    GraphAnalysis,
    TensorInfo,
    attribute_values,
    input_names,
    output_names,
)
from ..graph.dims import eval_dim
from ..graph.dtypes import capped_numel
from ..graph.gcpause import gc_paused
from ..target.ort.costs import CONTRIB_COST_OPS, contrib_flops_bytes
from ..target.ort.facts import never_runs
from .machine import Machine
from .model import NodeCosts

# FLOPs per output element of elementwise / normalization ops (rough; these ops are
# memory bound on every preset, so the constants rarely decide anything).
_ELEMENTWISE_FLOPS: dict[str, float] = {
    **dict.fromkeys(
        ("Add", "Sub", "Mul", "Div", "Neg", "Abs", "Relu", "LeakyRelu", "PRelu", "Max", "Min",
         "Sum", "Mean", "Clip", "Where", "Equal", "Less", "Greater", "LessOrEqual",
         "GreaterOrEqual", "And", "Or", "Xor", "Not", "Sign", "Floor", "Ceil", "Round",
         "Cast", "CastLike", "Mod", "BitShift", "IsNaN", "IsInf", "Reciprocal", "ThresholdedRelu",
         "BiasAdd", "Trilu", "QuantizeLinear", "DequantizeLinear"), 1.0),
    **dict.fromkeys(
        ("Exp", "Log", "Sqrt", "Pow", "Erf", "Tanh", "Sigmoid", "HardSigmoid", "HardSwish",
         "Softplus", "Softsign", "Elu", "Selu", "Celu", "Mish", "Sin", "Cos", "Tan", "Asin",
         "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Gelu", "FastGelu",
         "BiasGelu", "QuickGelu"), 8.0),
    **dict.fromkeys(("Softmax", "LogSoftmax", "Hardmax"), 5.0),
    **dict.fromkeys(
        ("LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
         "SkipSimplifiedLayerNormalization", "RMSNormalization", "BatchNormalization",
         "InstanceNormalization", "GroupNormalization", "LpNormalization",
         "MeanVarianceNormalization"), 8.0),
}
# FLOPs per *input* element.
_REDUCE_FLOPS: dict[str, float] = {
    **dict.fromkeys(
        ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
         "ReduceSumSquare", "ArgMax", "ArgMin", "GlobalAveragePool", "GlobalMaxPool",
         "CumSum", "TopK"), 1.0),
    **dict.fromkeys(("ReduceL2", "ReduceLogSum", "ReduceLogSumExp"), 2.0),
}
# No arithmetic, only data movement (bytes = inputs + outputs).
_MOVEMENT_OPS = frozenset((
    "Reshape", "Transpose", "Concat", "Split", "Expand", "Tile", "Pad", "Squeeze", "Unsqueeze",
    "Flatten", "Identity", "Dropout", "DepthToSpace", "SpaceToDepth", "ScatterND",
    "ScatterElements", "Scatter", "Compress", "ReverseSequence", "Resize", "Upsample",
    "ConcatFromSequence", "SplitToSequence", "MemcpyFromHost", "MemcpyToHost", "Range",
    "ConstantOfShape", "EyeLike", "OneHot", "NonZero", "Unique",
))
# Read only the part of the data input they output: bytes = 2 * output + index inputs.
_GATHER_OPS = frozenset(("Gather", "GatherElements", "GatherND", "Slice"))
# Metadata only: bytes = outputs.
_META_OPS = frozenset(("Shape", "Size", "Constant"))
_MATMUL_OPS = frozenset(("MatMul", "MatMulInteger", "QLinearMatMul", "FusedMatMul"))


_CONV_OPS = frozenset(("Conv", "ConvInteger", "QLinearConv", "FusedConv", "NhwcConv"))
_ATTENTION_OPS = frozenset(("Attention", "MultiHeadAttention", "GroupQueryAttention"))
_POOL_OPS = frozenset(("MaxPool", "AveragePool", "LpPool"))

Shape = list[int] | None


def _dims_of(t: TensorInfo | None, dims: Mapping[str, int]) -> Shape:
    """Concrete shape of ``t`` (None if unknown, or no size: a negative dim, more elements
    than any tensor holds); raises UnboundDimError for unbound dims. (Found by the optimize
    fuzzer, seed 148: a MatMul input of 100 dims of 2**62 made its FLOPs an integer past
    what a float holds, "unexpected OverflowError".)"""
    if t is None or t.shape is None:
        return None
    out: list[int] = []
    for d in t.shape:
        if isinstance(d, int):
            out.append(d)
        elif isinstance(d, str):
            out.append(eval_dim(d, dims, t.name))
        else:
            return None
    return out if capped_numel(out) is not None else None


def _numel(shape: Shape) -> int | None:
    return None if shape is None else math.prod(shape)


def _broadcast(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    a = [1] * (n - len(a)) + a
    b = [1] * (n - len(b)) + b
    return [max(x, y) for x, y in zip(a, b, strict=True)]


def _at(shapes: list[Shape], i: int) -> Shape:
    return shapes[i] if len(shapes) > i else None


# FLOPs of one op family: (node, input shapes, output elements, attributes) -> FLOPs or None.
_Flops = Callable[..., float | None]


def _matmul_flops(node: ir.Node, shapes: list[Shape], out_elems: int | None,
                  attrs: dict) -> float | None:
    """``2*M*N*K`` times the broadcast batch (QLinearMatMul's B is input 3)."""
    a, b = _at(shapes, 0), _at(shapes, 3 if node.op_type == "QLinearMatMul" else 1)
    if not (a and b):
        return None
    a2 = [1, *a] if len(a) == 1 else a
    b2 = [*b, 1] if len(b) == 1 else b
    if attrs.get("transA", 0):
        a2 = [*a2[:-2], a2[-1], a2[-2]]
    if attrs.get("transB", 0):
        b2 = [*b2[:-2], b2[-1], b2[-2]]
    m, k, n = a2[-2], a2[-1], b2[-1]
    return 2.0 * math.prod(_broadcast(a2[:-2], b2[:-2])) * m * n * k


def _gemm_flops(node: ir.Node, shapes: list[Shape], out_elems: int | None,
                attrs: dict) -> float | None:
    """``2*M*N*K`` plus ``M*N`` for the bias."""
    a, b = _at(shapes, 0), _at(shapes, 1)
    if not (a and b and len(a) == 2 and len(b) == 2):
        return None
    m, k = (a[1], a[0]) if attrs.get("transA", 0) else (a[0], a[1])
    n = b[0] if attrs.get("transB", 0) else b[1]
    return 2.0 * m * n * k + (m * n if len(node.inputs) > 2 and node.inputs[2] is not None
                               else 0)


def _conv_flops(node: ir.Node, shapes: list[Shape], out_elems: int | None,
                attrs: dict) -> float | None:
    """``2 * out_elems * Cin/group * prod(kernel)`` (QLinearConv's W is input 3)."""
    w = _at(shapes, 3) if node.op_type == "QLinearConv" and len(shapes) > 3 else _at(shapes, 1)
    return 2.0 * out_elems * math.prod(w[1:]) if w and out_elems is not None else None


def _conv_transpose_flops(node: ir.Node, shapes: list[Shape], out_elems: int | None,
                          attrs: dict) -> float | None:
    x, w = _at(shapes, 0), _at(shapes, 1)
    return 2.0 * math.prod(x) * math.prod(w[1:]) if x and w else None


def _attention_flops(node: ir.Node, shapes: list[Shape], out_elems: int | None,
                     attrs: dict) -> float | None:
    """``4 * elems(Q) * kv_len``; com.microsoft Attention adds its packed QKV projection."""
    q, k = _at(shapes, 0), _at(shapes, 1)
    if not (q and k):
        return None
    if node.op_type == "Attention" and node.domain not in ("", "ai.onnx"):
        # com.microsoft Attention: input [B, S, hidden] and packed QKV weights
        return 2.0 * math.prod(q[:-1]) * math.prod(k) + 4.0 * math.prod(q) * q[-2]
    kv = k[-2] if len(k) == 4 else k[1] if len(k) > 1 else 1  # [B,S,hidden] or [B,h,S,d]
    return 4.0 * math.prod(q) * kv


def _pool_flops(node: ir.Node, shapes: list[Shape], out_elems: int | None,
                attrs: dict) -> float | None:
    k = attrs.get("kernel_shape")
    return float(out_elems * math.prod(k)) if k and out_elems is not None else None


def _elementwise_flops(node: ir.Node, shapes: list[Shape], out_elems: int | None,
                       attrs: dict) -> float | None:
    return _ELEMENTWISE_FLOPS[node.op_type] * out_elems if out_elems is not None else None


def _reduce_flops(node: ir.Node, shapes: list[Shape], out_elems: int | None,
                  attrs: dict) -> float | None:
    x = _numel(_at(shapes, 0))
    return _REDUCE_FLOPS[node.op_type] * x if x is not None else None


def _default_flops(node: ir.Node, shapes: list[Shape], out_elems: int | None,
                   attrs: dict) -> float | None:
    """Unknown op: one FLOP per output element."""
    return float(out_elems) if out_elems is not None else None


_FLOPS: dict[str, _Flops] = {
    **dict.fromkeys(_MATMUL_OPS, _matmul_flops),
    "Gemm": _gemm_flops,
    **dict.fromkeys(_CONV_OPS, _conv_flops),
    "ConvTranspose": _conv_transpose_flops,
    **dict.fromkeys(_ATTENTION_OPS, _attention_flops),
    **dict.fromkeys(_POOL_OPS, _pool_flops),
    **dict.fromkeys(_ELEMENTWISE_FLOPS, _elementwise_flops),
    **dict.fromkeys(_REDUCE_FLOPS, _reduce_flops),
}


def node_flops_bytes(analysis: GraphAnalysis, pos: int,
                     dims: Mapping[str, int] | None = None,
                     sizes: dict[str, int] | None = None) -> tuple[float, float]:
    """Analytic ``(FLOPs, bytes moved)`` of the node at schedule position ``pos``.

    Bytes are the node's distinct inputs plus outputs whose size is known (Gather/Slice
    count only the part they read; Shape/Size/Constant only their outputs). FLOPs:
    MatMul-like ``2*M*N*K`` times the broadcast batch, Gemm ``2*M*N*K``, Conv
    ``2 * out_elems * Cin/group * prod(kernel)``, Attention ``4 * elems(Q) * kv_len``,
    elementwise/normalization/softmax a few per output element, reductions one per input
    element, data movement 0, unknown ops one per output element; ORT's contrib ops of LLM
    exports (GroupQueryAttention, MatMulNBits, ...) by :func:`~ho_onnx.target.ort.costs.
    contrib_flops_bytes`. Unknown shapes count as 0
    (never an error); an unbound symbolic dim raises :class:`UnboundDimError` naming it.
    ``sizes``: bytes of the tensors already asked for (name -> bytes, filled in here), for
    callers that cost every node under the same ``dims`` (each tensor is read by its
    producer and each consumer).
    """
    dims = dims or {}
    node = analysis.node_at(pos)
    op = node.op_type
    tensors = analysis.tensors
    known = {} if sizes is None else sizes

    def nbytes(name: str) -> int:
        b = known.get(name)
        if b is None:
            t = tensors.get(name)
            b = known[name] = 0 if t is None else t.nbytes(dims) or 0
        return b

    ins, outs = input_names(node), output_names(node)
    in_names = list(dict.fromkeys(n for n in ins if n))
    out_b = sum(nbytes(n) for n in outs if n)
    if op in _META_OPS:
        return 0.0, float(out_b)
    if op in _GATHER_OPS:
        return 0.0, float(2 * out_b + sum(nbytes(n) for n in in_names[1:]))
    bytes_moved = float(sum(nbytes(n) for n in in_names) + out_b)
    if op in _MOVEMENT_OPS:
        return 0.0, bytes_moved
    shapes = [_dims_of(tensors.get(n) if n else None, dims) for n in ins]
    if op in CONTRIB_COST_OPS and node.domain in ("", "ai.onnx", "com.microsoft"):
        out_shapes = [_dims_of(tensors.get(n) if n else None, dims) for n in outs]
        contrib = contrib_flops_bytes(node, shapes, out_shapes, [nbytes(n) for n in ins],
                                      [nbytes(n) for n in outs])
        if contrib is not None:
            return contrib
    out_shape = _dims_of(tensors.get(outs[0]) if outs[0] else None, dims) if outs else None
    attrs = attribute_values(node)
    flops = _FLOPS.get(op, _default_flops)(node, shapes, _numel(out_shape), attrs)
    return float(flops or 0.0), bytes_moved


def node_time(machine: Machine, flops: float, nbytes: float, movement: bool = False,
              transpose: bool = False, matmul: bool = False) -> float:
    """Roofline seconds of one node: ``max(compute, memory) + launch overhead``; the bytes of
    a data-movement op (``movement``) at the machine's movement rate, a Transpose's
    (``transpose``: a strided copy) at its transpose rate; a MatMul (``matmul``) pays the
    machine's ``matmul_overhead_s`` too."""
    bw = machine.transposing_bw if transpose else machine.movement_bw if movement else \
        machine.mem_bw
    return max(flops / (machine.peak_flops * machine.efficiency), nbytes / bw) \
        + machine.launch_overhead_s + (machine.matmul_overhead_s if matmul else 0.0)


def node_seconds(machine: Machine, analysis: GraphAnalysis, pos: int,
                 dims: Mapping[str, int] | None = None,
                 sizes: dict[str, int] | None = None) -> float:
    """:func:`node_time` of the node at ``pos`` (:func:`node_flops_bytes`, its family)."""
    op = analysis.node_at(pos).op_type
    return node_time(machine, *node_flops_bytes(analysis, pos, dims, sizes),
                     movement=op in _MOVEMENT_OPS or op in _GATHER_OPS,
                     transpose=op == "Transpose", matmul=op in _MATMUL_OPS)


def host_node_time(analysis: GraphAnalysis, machine: Machine, dims: Mapping[str, int],
                   pos: int) -> float:
    """Roofline seconds of the node at ``pos`` on the host CPU (``machine.host_flops``,
    ``host_mem_bw``) plus one copy of each activation input to the host and of each output
    back (what HostMatMul costs on a GPU: the activations move, the weights stay). A size
    shape inference leaves unknown (an expert's routed rows) counts as none: its weight's
    read and the copies' latency remain, what a decode step costs."""
    flops, nbytes = node_flops_bytes(analysis, pos, dims)
    node = analysis.node_at(pos)
    ins = [t for n in dict.fromkeys(input_names(node)) if n
           and (t := analysis.tensors.get(n)) is not None and not t.is_initializer]
    outs = [t for n in output_names(node) if n and (t := analysis.tensors.get(n)) is not None]
    copies = sum(machine.transfer_time(max(t.nbytes(dims) or 0, 1), d)
                 for ts, d in ((ins, "d2h"), (outs, "h2d")) for t in ts)
    return (max(flops / (machine.host_flops * machine.efficiency), nbytes / machine.host_mem_bw)
            + machine.launch_overhead_s + copies)


@gc_paused()
def analytic_costs(analysis: GraphAnalysis, machine: Machine,
                   dims: Mapping[str, int] | None = None) -> NodeCosts:
    """Roofline time of every node (see :func:`node_flops_bytes`, :func:`node_time`);
    nodes ORT never runs (Constant) cost 0."""
    sizes: dict[str, int] = {}
    secs = np.array([0.0 if never_runs(analysis.node_at(pos))
                     else node_seconds(machine, analysis, pos, dims, sizes)
                     for pos in range(len(analysis.order))], dtype=np.float64)
    return NodeCosts(secs, "analytic", 1.0)
