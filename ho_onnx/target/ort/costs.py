"""Cost-model entries for ONNX Runtime contrib ops of LLM exports and of training graphs, and
weights that move together.

:func:`contrib_flops_bytes` is a pure function of a node and its input/output shapes and
sizes; it returns None for ops it has no entry for (the generic rules then apply).
:func:`weight_groups` names the initializers that must be resident together: a
``MatMulNBits`` packed weight with its scales and zero points, a ``GatherBlockQuantized``
table with its scales and zero points; a planner offloads and reloads a group as one unit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import onnx_ir as ir

from ...graph.analyse import attribute_values
from .training import TRAINING_OPS

Shape = list[int] | None

# FLOPs per output element of elementwise and normalization contrib ops.
_PER_ELEMENT: dict[str, float] = {
    "FastGelu": 8.0,  # tanh approximation (+ bias)
    "BiasGelu": 9.0,  # bias add + erf gelu
    "QuickGelu": 4.0,  # x * sigmoid(alpha * x)
    "Gelu": 8.0,
    "BiasAdd": 2.0,
    "SimplifiedLayerNormalization": 5.0,  # square, mean, rsqrt, scale, weight
    "SkipSimplifiedLayerNormalization": 7.0,  # + skip (+ bias)
    "LayerNormalization": 8.0,
    "SkipLayerNormalization": 10.0,
    "RotaryEmbedding": 3.0,  # x * cos + rotate(x) * sin
}
ATTENTION_OPS = frozenset(("GroupQueryAttention", "MultiHeadAttention"))
CONTRIB_COST_OPS = frozenset(_PER_ELEMENT) | ATTENTION_OPS | frozenset(TRAINING_OPS) | {
    "MatMulNBits", "GatherBlockQuantized"}


def _numel(shape: Shape) -> int | None:
    return None if shape is None else math.prod(shape)


def _at(seq: Sequence[Shape], i: int) -> Shape:
    return seq[i] if len(seq) > i else None


def _kv_length(node: ir.Node, ins: Sequence[Shape], outs: Sequence[Shape]) -> int | None:
    """Keys each query attends to: the present cache's length, else past + new keys."""
    present = _at(outs, 1)
    if present is not None and len(present) == 4:
        return present[2]
    past = _at(ins, 3 if node.op_type == "GroupQueryAttention" else 6)
    past_len = past[2] if past is not None and len(past) == 4 else 0
    key = _at(ins, 1)
    if key is not None and len(key) == 4:
        new = key[2]  # [B, heads, L, D]
    elif key is not None and len(key) == 3:
        new = key[1]  # [B, L, hidden]
    else:
        q = _at(ins, 0)
        new = q[1] if q is not None and len(q) >= 2 else None  # packed QKV: L = S
    return None if new is None else past_len + new


# Over 60 lines: one table lookup per op family (attention, MatMulNBits, gathers, norms, the
# training ops' table), side by side so that their formulas can be compared; split, each
# family's few lines would carry the same argument list.
def contrib_flops_bytes(node: ir.Node, ins: Sequence[Shape], outs: Sequence[Shape],
                        in_bytes: Sequence[int], out_bytes: Sequence[int]
                        ) -> tuple[float, float] | None:
    """``(FLOPs, bytes moved)`` of a contrib op, or None when it has no entry.

    ``ins``/``outs`` are concrete shapes per input/output slot (None: unknown or absent),
    ``in_bytes``/``out_bytes`` their sizes (0 when unknown). Rules:

    * GroupQueryAttention / MultiHeadAttention: ``4 * elems(output) * kv_len`` (QK^T and
      PV) plus softmax; bytes: inputs, the output, and what the present cache adds over the
      past (past and present share ORT's buffer);
    * MatMulNBits: ``2*M*N*K`` plus dequantizing ``N*K`` weights; bytes: the packed weight,
      its scales and zero points, the activations;
    * GatherBlockQuantized: dequantizing the gathered rows; bytes: only the rows read, with
      their share of the scales and zero points;
    * RotaryEmbedding, Fast/Bias/QuickGelu, (Skip)(Simplified)LayerNormalization: a few
      FLOPs per output element; bytes: inputs plus outputs;
    * ORT's training ops (gradients, loss gradients, accumulators: the table
      :data:`~ho_onnx.target.ort.training.TRAINING_OPS`): its FLOPs per element of one
      input; bytes: inputs plus outputs, plus the input a kernel updates in place (written
      back).
    """
    op = node.op_type
    if op not in CONTRIB_COST_OPS:
        return None
    total_in, total_out = float(sum(in_bytes)), float(sum(out_bytes))
    training = TRAINING_OPS.get(op)
    if training is not None:
        if node.domain != "com.microsoft":
            return None  # (a default-domain op of that name: the generic rules)
        n = _numel(_at(ins, training.per))
        written = (in_bytes[training.in_place] if training.in_place is not None
                   and len(in_bytes) > training.in_place else 0)
        return training.flops * n if n is not None else 0.0, total_in + total_out + written
    out0 = _numel(_at(outs, 0))
    if op in _PER_ELEMENT:
        return (_PER_ELEMENT[op] * out0 if out0 is not None else 0.0), total_in + total_out
    attrs = attribute_values(node)
    if op in ATTENTION_OPS:
        kv = _kv_length(node, ins, outs)
        heads = int(attrs.get("num_heads", 1) or 1)  # type: ignore[call-overload]
        flops = 0.0
        out_shape = _at(outs, 0)
        if out0 is not None and kv is not None and out_shape:
            batch_seq = out0 // out_shape[-1] if out_shape[-1] else 0
            flops = 4.0 * out0 * kv + 5.0 * batch_seq * heads * kv
        past = 3 if op == "GroupQueryAttention" else 6
        cache_in = sum(in_bytes[past:past + 2]) if len(in_bytes) > past else 0
        cache_out = sum(out_bytes[1:3])
        moved = total_in + (out_bytes[0] if out_bytes else 0) + max(0, cache_out - cache_in)
        return flops, float(moved)
    if op == "MatMulNBits":
        k = int(attrs.get("K", 0) or 0)  # type: ignore[call-overload]
        n = int(attrs.get("N", 0) or 0)  # type: ignore[call-overload]
        a = _numel(_at(ins, 0))
        flops = 0.0
        if k and n and a is not None:
            m = a // k
            flops = 2.0 * m * n * k + 2.0 * n * k
        return flops, total_in + total_out
    # GatherBlockQuantized: data, indices, scales, zero_points
    data, idx = _at(ins, 0), _at(ins, 1)
    axis = int(attrs.get("gather_axis", 0) or 0)  # type: ignore[call-overload]
    flops = 2.0 * out0 if out0 is not None else 0.0
    rows = _numel(idx)
    if data is None or rows is None or not data:
        return flops, total_in + total_out
    axis = axis % len(data)
    frac = min(1.0, rows / data[axis]) if data[axis] else 1.0
    tables = (in_bytes[0] if in_bytes else 0) + sum(in_bytes[2:4])
    idx_b = in_bytes[1] if len(in_bytes) > 1 else 0
    return flops, frac * tables + idx_b + total_out


# Which input of a quantized op is the weight, and which inputs move with it.
_GROUPED: dict[str, tuple[int, tuple[int, ...]]] = {
    "MatMulNBits": (1, (2, 3, 4, 5)),  # B; scales, zero_points, g_idx, bias
    "GatherBlockQuantized": (0, (2, 3)),  # data; scales, zero_points
}


_VIEW_OPS = frozenset(("Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten"))


def weight_groups(graph: ir.Graph) -> list[tuple[str, ...]]:
    """Initializers that must be offloaded and reloaded together, primary weight first.

    Groups sharing a member are merged (a tied embedding feeds a GatherBlockQuantized and
    the lm_head MatMulNBits with the same packed table and scales; a weight seen through a
    Reshape/Identity/(Un)Squeeze/Flatten of it counts as itself). Only groups of two or
    more initializers are returned, in graph order. Found on the use-def chains: the
    union-find is over the values, not their names.
    """
    inits = set(graph.initializers.values())
    parent: dict[ir.Value, ir.Value] = {}

    def find(x: ir.Value) -> ir.Value:
        while parent.setdefault(x, x) is not x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    order: dict[ir.Value, int] = {}
    primaries: set[ir.Value] = set()
    for node in graph:
        rule = _GROUPED.get(node.op_type)
        if rule is None or node.domain != "com.microsoft" or len(node.inputs) <= rule[0]:
            continue
        w = _weight(node.inputs[rule[0]], inits)
        if w is None:
            continue
        primaries.add(w)
        order.setdefault(w, len(order))
        for x in (node.inputs[i] for i in rule[1] if i < len(node.inputs)):
            if x is not None and x in inits:
                order.setdefault(x, len(order))
                parent[find(x)] = find(w)
    groups: dict[ir.Value, list[ir.Value]] = {}
    for v in sorted(order, key=order.__getitem__):
        groups.setdefault(find(v), []).append(v)
    return [tuple(m.name or "" for m in sorted(members, key=lambda m: (m not in primaries,
                                                                     order[m])))
            for members in groups.values() if len(members) >= 2]


def _weight(v: ir.Value | None, inits: set[ir.Value]) -> ir.Value | None:
    """The initializer ``v`` is, or is a view of (the builder's tied table is
    Reshape(lm_head weight)); None for any other value."""
    node = v.producer() if v is not None else None
    if node is not None and node.op_type in _VIEW_OPS and node.inputs \
            and node.inputs[0] in inits:
        v = node.inputs[0]
    return v if v in inits else None
