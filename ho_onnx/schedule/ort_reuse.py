"""ORT's buffer reuse replayed: the bytes ORT's arena holds per step, not the tensors' bytes.

ORT's sequential allocation planner (``onnxruntime/core/framework/allocation_planner.cc``)
gives a node's output the buffer of an earlier value instead of a new one when

* the kernel declares the output an alias of an input (``Reshape``, ``Squeeze``,
  ``Unsqueeze``, ``Flatten``, ``Identity``; ho-onnx's ``Wait`` of input 0 and ``Detach`` of
  input 1), or
* a buffer on its free list has the same element size and the same shape (dim by dim: equal
  values or the same symbolic name; scalars never); the free list is searched most recently
  freed first.

A reused buffer is released to the arena only after the last reader of the last value that
used it, so it stays allocated across the gap between two users: ORT's arena can hold more
than the live tensors (measured on an H100 with a 24-layer decoder at 2,048 tokens: a
constant ~0.5 GB of attention scores kept for the next layer, docs/benchmarks.md). The
planner's simulation counts tensors (:mod:`.lifetimes`); this module counts ORT's buffers,
for the prediction of ORT's arena peak, which the planner then fits to the budget
(``OffloadOptions.arena_refits``). ``MayInplace`` reuse (an elementwise op writing into
an input at its last use) is not modelled: it only lowers the count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..contract import DOMAIN
from ..graph.analyse import GraphAnalysis, input_names, output_names
from ..graph.dtypes import ELEMENT_BITS
from .lifetimes import Interval, Residency, memory_profile, resident_intervals
from .types import OffloadChoice

# (domain, op_type) -> index of the input whose buffer output 0 takes.
ALIAS_INPUT: dict[tuple[str, str], int] = {
    ("", "Reshape"): 0, ("", "Squeeze"): 0, ("", "Unsqueeze"): 0, ("", "Flatten"): 0,
    ("", "Identity"): 0, (DOMAIN, "Wait"): 0, (DOMAIN, "Detach"): 1,
}


@dataclass
class _Value:
    """One value ORT allocates (or aliases) at ``start`` and last reads at ``end``."""

    start: int
    end: int
    nbytes: int
    key: tuple | None  # (element bits, shape) when reusable by shape, else None
    alias_of: str | None = None


@dataclass
class _Buffer:
    start: int
    end: int
    nbytes: int
    key: tuple | None
    users: int = 0  # values still to be read that use this buffer


def _key(elem_type: int | None, shape: tuple | None) -> tuple | None:
    if elem_type not in ELEMENT_BITS or not shape or None in shape:
        return None
    return (ELEMENT_BITS[elem_type], tuple(shape))


def _values(analysis: GraphAnalysis, choice: OffloadChoice | None,
            dims: Mapping[str, int] | None, residency: Residency | None
            ) -> tuple[dict[str, _Value], int]:
    """The values ORT's planner sees at each step of the schedule with ``choice``, and the
    bytes held for the whole run (the initializers that stay)."""
    spans, sizes = residency or resident_intervals(analysis, dims)
    n = len(analysis.order)
    moved_w = {w.name: w for w in (choice.weights if choice else ())}
    moved_a = {a.name: a for a in (choice.activations if choice else ())}
    moved_in = {i.name: i for i in (choice.inputs if choice else ())}
    moved_out = {o.name: o for o in (choice.outputs if choice else ())}
    values: dict[str, _Value] = {}
    static = 0
    for name, (s, e) in spans.items():
        t = analysis.tensors[name]
        if t.is_initializer and name not in moved_w:
            static += sizes[name]
        elif name in moved_in or name in moved_out:
            continue  # the KV cache: its copies below
        elif t.is_graph_input:  # the caller's buffer (or ORT's copy of it): never reused
            values[name] = _Value(s, e, sizes[name], None)
        elif name in moved_a:
            a, key = moved_a[name], _key(t.elem_type, t.shape)
            b = a.nbytes or 0
            values[name] = _Value(s, a.last_early, b, key)
            values[name + "\0reload"] = _Value(a.prefetch_at, max(a.late), b, key)
        elif not t.is_initializer:
            key = None if t.is_graph_output else _key(t.elem_type, t.shape)
            values[name] = _Value(s, n - 1 if t.is_graph_output else e, sizes[name], key)
    for w in moved_w.values():
        t = analysis.tensors[w.name]
        key = _key(t.elem_type, t.shape)
        for k, (c, p) in enumerate(zip(w.consumers, w.prefetch_at, strict=True)):
            values[f"{w.name}\0{k}"] = _Value(p, c, w.nbytes, key)
    for i in moved_in.values():  # each Wait's output: a buffer ORT may reuse
        key = _key(analysis.tensors[i.name].elem_type, analysis.tensors[i.name].shape)
        for k, (c, p) in enumerate(zip(i.consumers, i.prefetch_at, strict=True)):
            values[f"{i.name}\0{k}"] = _Value(p, c, i.nbytes, key)
    for o in moved_out.values():  # an intermediate until its Emit (then the caller's)
        key = _key(analysis.tensors[o.name].elem_type, analysis.tensors[o.name].shape)
        values[o.name] = _Value(o.producer, o.last, o.nbytes, key)
    for pos, node in enumerate(analysis.nodes):
        src = ALIAS_INPUT.get((node.domain or "", node.op_type))
        if src is None:
            continue
        ins, outs = input_names(node), output_names(node)
        if src >= len(ins) or not outs or outs[0] not in values:
            continue
        v = values[outs[0]]
        if ins[src] in values and values[ins[src]].start <= pos:
            v.alias_of = ins[src]
        elif ins[src] in spans and analysis.tensors[ins[src]].is_initializer \
                and ins[src] not in moved_w:
            v.nbytes = 0  # a view of an initializer, held for the whole run
    return values, static


def ort_buffer_intervals(analysis: GraphAnalysis, choice: OffloadChoice | None = None,
                         dims: Mapping[str, int] | None = None,
                         residency: Residency | None = None) -> tuple[list[Interval], int]:
    """Interval and bytes of every buffer ORT's planner allocates for the schedule with
    ``choice``'s offloads, and the bytes held for the whole run (resident initializers).
    ``residency``: :func:`~.lifetimes.resident_intervals` under ``dims``, when known."""
    values, static = _values(analysis, choice, dims, residency)
    n = len(analysis.order)
    born: list[list[str]] = [[] for _ in range(n)]
    dies: list[list[str]] = [[] for _ in range(n)]
    for name, v in values.items():
        born[v.start].append(name)
        dies[v.end].append(name)
    owner: dict[str, _Buffer] = {}
    # ORT's free list, searched most recently freed first for the first same-key buffer:
    # per key, a stack whose top is the most recently freed.
    free: dict[tuple, list[_Buffer]] = {}
    buffers: list[_Buffer] = []
    for pos in range(n):
        for name in born[pos]:
            v = values[name]
            if v.alias_of is not None and v.alias_of in owner:
                buf = owner[v.alias_of]
            else:
                stack = free.get(v.key) if v.key is not None else None
                if stack:
                    buf = stack.pop()
                else:
                    buf = _Buffer(pos, pos, v.nbytes, v.key)
                    buffers.append(buf)
            buf.users += 1
            buf.end = max(buf.end, v.end)
            owner[name] = buf
        for name in dies[pos]:
            buf = owner[name]
            buf.users -= 1
            if buf.users == 0 and buf.key is not None:
                free.setdefault(buf.key, []).append(buf)
    return [(b.start, b.end, b.nbytes) for b in buffers], static


def ort_memory(analysis: GraphAnalysis, choice: OffloadChoice | None = None,
               dims: Mapping[str, int] | None = None,
               residency: Residency | None = None) -> np.ndarray:
    """Bytes ORT's arena holds per step of the schedule with ``choice`` (buffer reuse
    replayed; see the module docstring)."""
    intervals, static = ort_buffer_intervals(analysis, choice, dims, residency)
    n = len(analysis.order)
    if not intervals:
        return np.full(n, static, dtype=np.int64)
    return memory_profile(n, intervals) + static
