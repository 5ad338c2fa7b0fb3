"""The arena a schedule needs: which values a runtime's allocator sees at each step of the
schedule with a choice's offloads, replayed by the target's rules
(:class:`~ho_onnx.target.base.Target`; ONNX Runtime's: :mod:`ho_onnx.target.ort.arena`).

The allocator can hold more than the live tensors (a reused buffer stays allocated across
the gap between two users): the planner's simulation counts tensors (:mod:`.lifetimes`);
this module counts the runtime's buffers (and the library's staging beside them), for the
prediction of its arena peak, which the planner then fits to the budget
(``OffloadOptions.arena_refits``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from ..graph.analyse import GraphAnalysis, TensorInfo, input_names, output_names
from ..target.base import ArenaValue, Target
from ..target.ort.arena import ORT
from .lifetimes import Interval, Residency, memory_profile, resident_intervals
from .types import OffloadChoice


def _values(analysis: GraphAnalysis, choice: OffloadChoice | None,
            dims: Mapping[str, int] | None, residency: Residency | None, target: Target
            ) -> tuple[dict[str, ArenaValue], int]:
    """The values the allocator sees at each step of the schedule with ``choice``, and the
    bytes held for the whole run (the initializers that stay). Reuse is keyed by the shapes
    ORT infers when it loads the model (:meth:`GraphAnalysis.unbound_shape`: the dims bound
    for planning are symbolic there, so two values of one size at the planned dims share a
    buffer only where their symbolic shapes are provably equal; keyed by the bound shapes,
    the replay had each layer's attention scores kept for the next layer, which ORT did not
    do: 66.9 MiB replayed against 43.0 at 2k context, stop 49)."""
    fused = target.fusions(analysis)
    spans, sizes = residency or resident_intervals(analysis, dims, fusions=fused)
    n = len(analysis.order)
    key, declared = _keys(analysis, choice, target)
    folded = _still_folded(analysis, fused.folded, choice)
    folding = {analysis.tensors[name].producer for name in folded}  # (the nodes ORT folds)
    moved_w = {w.name: w for w in (choice.weights if choice else ())}
    moved_a = {a.name: a for a in (choice.activations if choice else ())}
    moved_in = {i.name: i for i in (choice.inputs if choice else ())}
    moved_out = {o.name: o for o in (choice.outputs if choice else ())}
    values: dict[str, ArenaValue] = {}
    static = 0
    for name, (s, e) in spans.items():  # (the fused graph's: no value a fusion removes)
        t = analysis.tensors[name]
        if t.is_initializer and name not in moved_w:
            static += sizes[name]
        elif name in moved_in or name in moved_out:
            continue  # the KV cache: its copies below
        elif t.is_graph_input:  # the caller's buffer (or ORT's copy of it): never reused
            values[name] = ArenaValue(s, e, sizes[name], None)
        elif name in moved_a:
            a, k = moved_a[name], key(name)
            b = a.nbytes or 0
            values[name] = ArenaValue(s, a.last_early, b, k)
            values[name + "\0reload"] = ArenaValue(a.prefetch_at, max(a.late), b, declared(name))
        elif name in folded:  # (a constant once ORT loads the model, if still read)
            static += sizes[name] if _read_unfolded(t, folding) else 0
        elif not t.is_initializer:
            k = None if t.is_graph_output else key(name)
            values[name] = ArenaValue(s, n - 1 if t.is_graph_output else e, sizes[name], k)
    for r in (choice.recomputes if choice else ()):  # (its copy: a new buffer at late[0])
        k = key(r.name)
        values[r.name] = ArenaValue(spans[r.name][0], r.last_early, r.nbytes, k)
        values[r.name + "\0recomputed"] = ArenaValue(r.late[0], max(r.late), r.nbytes, k)
        values[r.name + "\0transient"] = ArenaValue(r.late[0], r.late[0], r.transient, None)
    for w in moved_w.values():
        k = key(w.name)
        for j, (c, p) in enumerate(zip(w.consumers, w.prefetch_at, strict=True)):
            values[f"{w.name}\0{j}"] = ArenaValue(p, c, w.nbytes, k)
    for i in moved_in.values():  # each Wait's output: a buffer the allocator may reuse
        k = declared(i.name)
        for j, (c, p) in enumerate(zip(i.consumers, i.prefetch_at, strict=True)):
            values[f"{i.name}\0{j}"] = ArenaValue(p, fused.read_at(c), i.nbytes, k)
    for o in moved_out.values():  # an intermediate until its Emit (then the caller's)
        t = analysis.tensors[o.name]
        last = max([o.last, *(fused.read_at(c) for c in t.consumers)])
        values[o.name] = ArenaValue(o.producer, last, o.nbytes, key(o.name))
    _alias(analysis, values, spans, moved_w, target)
    return values, static


def _still_folded(analysis: GraphAnalysis, folded: frozenset[str],
                  choice: OffloadChoice | None) -> frozenset[str]:
    """``folded`` less what reads an offloaded weight, directly or through another folded
    value: a Wait's (or GatherRows') output is no constant to the runtime (found at stop 54:
    a position table read by GatherRows was replayed as a constant, 2 MiB short)."""
    moved = {w.name for w in (choice.weights if choice else ())}
    if not moved or not folded:
        return folded
    lost: set[str] = set()
    for name in sorted(folded, key=lambda n: analysis.tensors[n].producer or 0):
        node = analysis.nodes[analysis.tensors[name].producer]
        if any(i in moved or i in lost for i in input_names(node)):
            lost.add(name)
    return folded - lost


def _read_unfolded(t: TensorInfo, folding: set[int | None]) -> bool:
    """A node the runtime does not fold (not in ``folding``) reads ``t`` (a folded value),
    which stays then."""
    return bool(t.implicit_consumers) or any(c not in folding for c in t.consumers)


def _keys(analysis: GraphAnalysis, choice: OffloadChoice | None, target: Target
          ) -> tuple[Callable[[str], tuple | None], Callable[[str], tuple | None]]:
    """The reuse key of a value in the model rewritten with ``choice``'s offloads, and that
    of a cache op's output reloading it (which declares its shape)."""
    dark = _shapeless(analysis, choice, target) if choice else frozenset()

    def declared(name: str) -> tuple | None:
        return target.reuse_key(analysis.tensors[name].elem_type, analysis.unbound_shape(name))

    return (lambda name: None if name in dark else declared(name)), declared


def _shapeless(analysis: GraphAnalysis, choice: OffloadChoice, target: Target
               ) -> frozenset[str]:
    """The values the runtime knows no shape of in the model rewritten with ``choice``'s
    offloads (:attr:`Target.shapeless`): the outputs of the readers that become the
    library's ops (``GatherRows``, ``HostMatMul``) and declare no shape (the rewrite keeps a
    declared one), and what reads them; a reload's Wait declares the shape it reloads."""
    opaque = []
    for w in choice.weights:
        for pos in (*w.row_readers, *w.host_readers):
            out = analysis.nodes[pos].outputs[0]
            if out.shape is None or any(not isinstance(d, int | str) and
                                        getattr(d, "value", None) is None for d in out.shape):
                opaque.append(pos)
    if not opaque:
        return frozenset()
    declared = {a.name: a.late for a in choice.activations if analysis.unbound_shape(a.name)}
    declared |= {i.name: i.consumers for i in choice.inputs if analysis.unbound_shape(i.name)}
    return target.shapeless(analysis, opaque, declared)


def _alias(analysis: GraphAnalysis, values: dict[str, ArenaValue],
           spans: Mapping[str, tuple[int, int]], moved_w: Mapping[str, object],
           target: Target) -> None:
    """Mark the views (:attr:`Target.alias_input`) in ``values``, in place."""
    for pos, node in enumerate(analysis.nodes):
        src = target.alias_input(node.domain or "", node.op_type)
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


def arena_buffer_intervals(analysis: GraphAnalysis, choice: OffloadChoice | None = None,
                           dims: Mapping[str, int] | None = None,
                           residency: Residency | None = None, *, target: Target = ORT
                           ) -> tuple[list[Interval], int]:
    """Interval and bytes of every buffer ``target``'s allocator holds for the schedule with
    ``choice``'s offloads, with the library's staging copy of each staged reload (outside
    the allocator, in the same memory: the CPU EP's disk tier reads into it from the
    Prefetch to the Wait), and the bytes held for the whole run (resident initializers).
    ``residency``: :func:`~.lifetimes.resident_intervals` under ``dims`` and ``target``'s
    fusions, when known."""
    buffers, static = _runtime_buffers(analysis, choice, dims, residency, target)
    return buffers + _staging(choice), static


def _runtime_buffers(analysis: GraphAnalysis, choice: OffloadChoice | None,
                     dims: Mapping[str, int] | None, residency: Residency | None,
                     target: Target) -> tuple[list[Interval], int]:
    """:func:`arena_buffer_intervals` without the staging: the runtime allocator's buffers,
    in the order it allocates them."""
    values, static = _values(analysis, choice, dims, residency, target)
    # The cache ops of a step run before its node: their outputs (the reloads, named
    # "<value>\0...") are allocated first (ORT's arena then decides which free chunk each
    # takes in that order).
    values = dict(sorted(values.items(), key=lambda kv: "\0" not in kv[0]))
    return target.replay(values, len(analysis.order)), static


def _staging(choice: OffloadChoice | None) -> list[Interval]:
    """The library's staging buffers of ``choice``'s staged reloads (found measuring the
    2.75 GB decoder at 15 % under a hard limit: ORT's arena fitted the budget while up to
    144 MiB of disk reads were staged beside it)."""
    return [(p, c, w.nbytes) for w in (choice.weights if choice else ()) if w.staged
            for c, p in zip(w.consumers, w.prefetch_at, strict=True)]


def arena_memory(analysis: GraphAnalysis, choice: OffloadChoice | None = None,
                 dims: Mapping[str, int] | None = None,
                 residency: Residency | None = None, *, target: Target = ORT) -> np.ndarray:
    """Bytes ``target``'s arena holds per step of the schedule with ``choice`` (its buffer
    reuse and its allocator replayed: :attr:`Target.held`), with the library's staging
    beside it and the resident initializers."""
    buffers, static = _runtime_buffers(analysis, choice, dims, residency, target)
    staging = _staging(choice)
    n = len(analysis.order)
    out = np.full(n, static, dtype=np.int64)
    if buffers:
        held = target.held(analysis, buffers, n) if target.held else None
        out += memory_profile(n, buffers) if held is None else held
    if staging:
        out += memory_profile(n, staging)
    return out
