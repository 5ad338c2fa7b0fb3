"""Fast-tier residency: the interval each tensor occupies, bytes per step, and the bytes the
slow tier holds, for the unmodified schedule and for one with a choice's offloads.

Memory is counted per compute position: a tensor occupies the fast tier from the step that
allocates it through its last reader, inclusive.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from .. import kinds
from ..graph.analyse import Dim, GraphAnalysis, TensorInfo, input_names, output_names
from ..target.base import Fusions
from ..target.ort.arena import alias_input
from ..target.ort.facts import never_runs
from .types import ActivationOffload, OffloadChoice

Interval = tuple[int, int, int]  # (first position, last position inclusive, bytes)


Sizes = Callable[[str], "int | None"]  # tensor name -> TensorInfo.nbytes under one dims


_UNSET: Any = object()


class TensorSizes:
    """``TensorInfo.nbytes`` of one analysis' tensors under one ``dims``, each computed once
    (an error it raised is raised again at each ask): one :func:`plan` call asks for most
    sizes several times, and a size evaluates every symbolic dim. Tensors of one element
    type and shape share the size (only an error names the tensor)."""

    def __init__(self, tensors: Mapping[str, TensorInfo],
                 dims: Mapping[str, int] | None = None) -> None:
        self._tensors = tensors
        self._dims = dims
        self._memo: dict[str, int | Exception | None] = {}
        self._by_type: dict[tuple[int | None, tuple[Dim, ...] | None], int | None] = {}

    def __call__(self, name: str) -> int | None:
        size = self._memo.get(name, _UNSET)  # (a miss is every first ask: no KeyError)
        if size is _UNSET:
            size = self._memo[name] = self._size(self._tensors[name])
        if isinstance(size, Exception):
            raise size
        return size

    def _size(self, t: TensorInfo) -> int | Exception | None:
        key = (t.elem_type, t.shape)
        size = self._by_type.get(key, _UNSET)
        if size is _UNSET:
            try:
                size = self._by_type[key] = t.nbytes(self._dims)
            except Exception as e:  # remembered for this tensor, raised again by __call__
                return e
        return size


def resident_intervals(analysis: GraphAnalysis, dims: Mapping[str, int] | None = None,
                       nbytes: Sizes | None = None, fusions: Fusions | None = None
                       ) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """Fast-tier interval (first, last position, inclusive) and bytes of every tensor of the
    unmodified schedule. Initializers live for the whole run, graph inputs from the start,
    graph outputs to the end. Tensors of unknown size count 0 bytes (see ``unknown``).
    ``nbytes``: the sizes under ``dims`` (a :class:`TensorSizes` the caller shares);
    ``fusions``: the runtime's (:attr:`Target.fusions`): the values they remove are not
    resident, and a fused node's inputs stay until it runs."""
    nbytes = nbytes or TensorSizes(analysis.tensors, dims)
    n = len(analysis.order)
    fused = fusions or Fusions()
    spans: dict[str, tuple[int, int]] = {}
    sizes: dict[str, int] = {}
    for name, t in analysis.tensors.items():
        if name in fused.gone:
            continue
        if t.is_initializer:
            if not t.consumers and not t.implicit_consumers and not t.is_graph_output:
                continue  # ORT drops unused initializers (not those the graph outputs)
            span = (0, n - 1)
        elif t.producer is not None:
            span = (t.producer, n - 1 if t.is_graph_output else _read_until(t, t.producer, fused))
        elif t.is_graph_input:
            span = (0, n - 1 if t.is_graph_output else _read_until(t, 0, fused))
        else:
            continue
        try:
            size = nbytes(name)
        except Exception:  # unbound dims are reported by the planner where they matter
            size = None
        sizes[name] = size or 0
        spans[name] = span
    return spans, sizes


def _read_until(t: TensorInfo, default: int, fused: Fusions) -> int:
    """Last step ``t`` is read at: by its readers, or by the fused node that replaces one."""
    last = _last_use(t, default)
    return max([last, *(fused.read_at(c) for c in t.consumers)]) if fused.later else last


def _last_use(t: TensorInfo, default: int) -> int:
    """Last (implicit or not) reader of ``t``, ``default`` without any."""
    if t.implicit_consumers:
        return max(t.consumers + t.implicit_consumers)
    return max(t.consumers, default=default)


_INTERVALS = np.dtype((np.int64, 3))  # rows of (start, end, bytes)


def memory_profile(n: int, intervals: Iterable[Interval]) -> np.ndarray:
    """Bytes resident at each of ``n`` positions given (start, end, bytes) intervals (any
    iterable: a generator's tuples are never all alive at once)."""
    start, end, nbytes = np.fromiter(intervals, dtype=_INTERVALS).T
    delta = np.zeros(n + 1, dtype=np.int64)
    np.add.at(delta, start, nbytes)
    np.subtract.at(delta, end + 1, nbytes)
    return np.cumsum(delta[:n])


def offloaded_intervals(choice: OffloadChoice) -> tuple[set[str], list[Interval]]:
    """Names whose baseline residency an offload replaces, and their new intervals."""
    names: set[str] = set()
    out: list[Interval] = []
    for w in choice.weights:
        names.add(w.name)
        out.extend((p, c, w.nbytes * (2 if w.staged else 1))  # (with its staging copy)
                   for c, p in zip(w.consumers, w.prefetch_at, strict=True))
    for a in choice.activations:
        names.add(a.name)
        b = a.nbytes or 0
        out.append((a.producer, a.last_early, b))
        out.append((a.prefetch_at, max(a.late), b))
    for r in choice.recomputes:  # (its copy from its late readers' first; the run's others)
        names.add(r.name)
        out.extend(((r.producer, r.last_early, r.nbytes), (r.late[0], max(r.late), r.nbytes),
                    (r.late[0], r.late[0], r.transient)))
    for i in choice.inputs:
        names.add(i.name)
        out.extend((p, c, i.nbytes) for c, p in zip(i.consumers, i.prefetch_at, strict=True))
    for o in choice.outputs:
        names.add(o.name)
        out.append((o.producer, o.last, o.nbytes))
    return names, out


Residency = tuple[dict[str, tuple[int, int]], dict[str, int]]  # resident_intervals' result


def schedule_memory(analysis: GraphAnalysis, choice: OffloadChoice | None,
                    dims: Mapping[str, int] | None = None,
                    residency: Residency | None = None,
                    base: np.ndarray | None = None) -> np.ndarray:
    """Fast-tier bytes per position of the schedule with ``choice``'s offloads
    (``residency``: :func:`resident_intervals` of ``analysis`` and ``dims``, when known;
    ``base``: the unmodified schedule's bytes per position under that residency, when
    known: then only the offloaded tensors' intervals are counted)."""
    spans, sizes = residency or resident_intervals(analysis, dims)
    moved, extra = offloaded_intervals(choice) if choice else (set(), [])
    n = len(analysis.order)
    if base is not None:
        removed = ((*spans[k], -sizes[k]) for k in moved if k in spans)
        return base + memory_profile(n, itertools.chain(removed, extra))
    kept = ((s, e, sizes[k]) for k, (s, e) in spans.items() if k not in moved)
    return memory_profile(n, itertools.chain(kept, extra))


def peaks_at(analysis: GraphAnalysis, choice: OffloadChoice, dims: Mapping[str, int]
             ) -> tuple[int, int]:
    """Fast-tier peaks of the unmodified schedule and of ``choice``'s, every size taken from
    ``analysis`` at ``dims``: another binding of the model the choice was made for (the
    bottom of a range the plan was made at the top of)."""
    resized = resized_choice(analysis, choice, dims)
    residency = resident_intervals(analysis, dims)
    base = schedule_memory(analysis, None, dims, residency)
    planned = schedule_memory(analysis, resized, dims, residency, base)
    return int(base.max(initial=0)), int(planned.max(initial=0))


def resized_choice(analysis: GraphAnalysis, choice: OffloadChoice, dims: Mapping[str, int]
                   ) -> OffloadChoice:
    """``choice`` with every offload's bytes taken from ``analysis`` at ``dims``."""
    def size(name: str) -> int:
        return analysis.tensors[name].nbytes(dims) or 0

    return dataclasses.replace(
        choice, weights=[dataclasses.replace(w, nbytes=size(w.name)) for w in choice.weights],
        activations=[dataclasses.replace(a, nbytes=size(a.name)) for a in choice.activations],
        recomputes=[dataclasses.replace(r, nbytes=size(r.name), transient=transient_bytes(
            analysis, r.nodes, r.name, (v for _, v in r.fenced), size))
            for r in choice.recomputes],
        inputs=[dataclasses.replace(i, nbytes=size(i.name)) for i in choice.inputs],
        outputs=[dataclasses.replace(o, nbytes=size(o.name)) for o in choice.outputs])


def held_by_ort(analysis: GraphAnalysis, name: str) -> bool:
    """A value ORT holds for the whole run: a graph input, an initializer, a Constant's
    output (ORT makes it an initializer)."""
    t = analysis.tensors[name]
    return t.is_initializer or t.is_graph_input or (
        t.producer is not None and never_runs(analysis.nodes[t.producer]))


def transient_bytes(analysis: GraphAnalysis, nodes: tuple[int, ...], name: str,
                    fenced: Iterable[str], size: Callable[[str], int]) -> int:
    """Bytes a recomputation holds beside its result while it runs: its other outputs (but
    views, whose bytes are their source's, and the buffer the result is a view of) and the
    copies its Fences of ``fenced`` make (those ORT does not alias), each sized by
    ``size``."""
    view_of: dict[str, str] = {}  # an output ORT makes a view -> the value it views
    for p in nodes:
        node = analysis.nodes[p]
        src, ins, outs = alias_input(node.domain or "", node.op_type), input_names(node), \
            output_names(node)
        if src is not None and outs and src < len(ins) and ins[src]:
            view_of[outs[0]] = ins[src]
    own = name
    while own in view_of:
        own = view_of[own]
    return sum(size(v) for p in nodes for v in output_names(analysis.nodes[p])
               if v not in (name, own) and v not in view_of) \
        + sum(size(v) for v in set(fenced) if held_by_ort(analysis, v))


def stored_peak_bytes(choice: OffloadChoice) -> int:
    """Most bytes of stored activations the slow tier holds at once (each from its producer
    to its last late reader); unknown sizes count 0."""
    return peak(stored_intervals(choice.activations), default=0)


def stored_intervals(activations: Iterable[ActivationOffload]) -> list[Interval]:
    """Slow-tier interval of each stored activation: producer through last late reader."""
    return [(a.producer, max(a.late), a.nbytes or 0) for a in activations]


def host_bytes(choice: OffloadChoice) -> int:
    """Peak bytes the slow tier holds: weights of the tiers in host memory plus the stored
    peak. Row blocks of a table the host store also holds whole (a tied embedding split for
    its lm_head) are ranges of its copy, counted once, but for a block whose Prefetch comes
    first in the graph (ORT makes the kernels, so the host copies, in the graph's order)."""
    held = {w.name: w for w in choice.weights if kinds.tier(w.tier).in_host_memory}
    shared = {b for s in choice.splits if s.rows and s.name in held for b in s.blocks
              if b in held and min(held[b].prefetch_at, default=0) > min(
                  (*held[s.name].prefetch_at, *held[s.name].row_readers), default=0)}
    return sum(w.nbytes for n, w in held.items() if n not in shared) + \
        stored_peak_bytes(choice)


def peak(intervals: list[Interval], default: int = 0) -> int:
    """Largest sum of bytes of intervals that overlap one position."""
    if not intervals:
        return default
    return int(memory_profile(max(e for _, e, _ in intervals) + 1, intervals).max(initial=0))
