"""The KV cache of a decoder exported with past, found by structure (never by names).

A **past** tensor is a graph input that one node reads as data and that node also produces
a graph output of the same element type and rank that differs from it in one axis (the
sequence the cache grows along), the **present**: Optimum's layout
(``present = Concat(past, new)``) and onnxruntime-genai's (``GroupQueryAttention(...,
past_key, past_value, ...) -> (out, present_key, present_value)``). When a node reads several
past inputs and produces several such outputs, the k-th past it reads pairs with the k-th
present it produces (the order both exporters use). The pairs are recorded on the tensors
(``TensorInfo.kv_peer``): the ``kv`` kind (:mod:`ho_onnx.kinds`) reads them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import onnx_ir as ir

# Readers that take only a tensor's shape: they never make it a past (no data read).
_SHAPE_READERS = frozenset({"Shape", "Size"})


class _Facts(Protocol):
    name: str
    elem_type: int | None
    shape: tuple[object, ...] | None
    is_initializer: bool
    is_graph_input: bool
    is_graph_output: bool
    kv_peer: str | None


def _declared(v: ir.Value, t: _Facts) -> tuple[object, ...] | None:
    """``v``'s shape as the model declares it (a graph input's or output's: symbolic dims
    stay names whatever the analysis bound), else the analysis's."""
    if v.shape is not None:
        return tuple(d if isinstance(d, int) else getattr(d, "value", None) for d in v.shape)
    return t.shape


def _like(a: _Facts, sa: tuple[object, ...] | None, b: _Facts,
          sb: tuple[object, ...] | None) -> bool:
    """Same element type and rank (>= 3), different in exactly one axis: the sequence the
    cache grows along (a query and the attention's output have the same dims: no pair)."""
    if a.elem_type is None or a.elem_type != b.elem_type or sa is None or sb is None \
            or len(sa) != len(sb) or len(sa) < 3:
        return False
    return sum(x != y or x is None for x, y in zip(sa, sb, strict=True)) == 1


def pair_kv(nodes: Sequence[ir.Node], tensors: Mapping[str, _Facts]) -> list[tuple[str, str]]:
    """The (past, present) pairs of the main graph (module docstring); sets ``kv_peer`` on
    both tensors of each pair. Shapes compared as declared, else as inferred: a merged
    decoder's branch may declare a present's head size as a symbol its past gives as a
    number (``Addpresent.0.key_dim_3`` against 16)."""
    pairs: list[tuple[str, str]] = []
    taken: set[str] = set()
    for node in nodes:
        if node.domain in ("", "ai.onnx") and node.op_type in _SHAPE_READERS:
            continue
        pasts = [(t, v) for v in node.inputs if v is not None and v.name
                 and (t := tensors.get(v.name)) is not None and t.is_graph_input
                 and not t.is_initializer and not t.is_graph_output and t.name not in taken]
        presents = [(t, v) for v in node.outputs if v.name
                    and (t := tensors.get(v.name)) is not None and t.is_graph_output
                    and not t.is_graph_input and t.name not in taken]
        for (past, pv), (present, qv) in zip(pasts, presents, strict=False):
            if not (_like(past, _declared(pv, past), present, _declared(qv, present))
                    or _like(past, past.shape, present, present.shape)):
                continue
            past.kv_peer, present.kv_peer = present.name, past.name
            taken.update((past.name, present.name))
            pairs.append((past.name, present.name))
    return pairs
