"""Fast-tier residency: the interval each tensor occupies, bytes per step, and the bytes the
slow tier holds, for the unmodified schedule and for one with a choice's offloads.

Memory is counted per compute position: a tensor occupies the fast tier from the step that
allocates it through its last reader, inclusive.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from ..graph.analyse import GraphAnalysis
from .types import ActivationOffload, OffloadChoice

Interval = tuple[int, int, int]  # (first position, last position inclusive, bytes)


def resident_intervals(analysis: GraphAnalysis, dims: Mapping[str, int] | None = None
                       ) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """Fast-tier interval (first, last position, inclusive) and bytes of every tensor of the
    unmodified schedule. Initializers live for the whole run, graph inputs from the start,
    graph outputs to the end. Tensors of unknown size count 0 bytes (see ``unknown``)."""
    n = len(analysis.order)
    spans: dict[str, tuple[int, int]] = {}
    sizes: dict[str, int] = {}
    for name, t in analysis.tensors.items():
        uses = t.consumers + t.implicit_consumers
        if t.is_initializer:
            if not uses:
                continue  # ORT drops unused initializers
            span = (0, n - 1)
        elif t.producer is not None:
            span = (t.producer, n - 1 if t.is_graph_output else max(uses, default=t.producer))
        elif t.is_graph_input:
            span = (0, n - 1 if t.is_graph_output else max(uses, default=0))
        else:
            continue
        try:
            size = t.nbytes(dims)
        except Exception:  # unbound dims are reported by the planner where they matter
            size = None
        sizes[name] = size or 0
        spans[name] = span
    return spans, sizes


def memory_profile(n: int, intervals: list[Interval]) -> np.ndarray:
    """Bytes resident at each of ``n`` positions given (start, end, bytes) intervals."""
    delta = np.zeros(n + 1, dtype=np.int64)
    if intervals:
        s, e, b = (np.fromiter(col, dtype=np.int64, count=len(intervals))
                   for col in zip(*intervals, strict=True))
        np.add.at(delta, s, b)
        np.subtract.at(delta, e + 1, b)
    return np.cumsum(delta[:n])


def offloaded_intervals(choice: OffloadChoice) -> tuple[set[str], list[Interval]]:
    """Names whose baseline residency an offload replaces, and their new intervals."""
    names: set[str] = set()
    out: list[Interval] = []
    for w in choice.weights:
        names.add(w.name)
        out.extend((p, c, w.nbytes) for c, p in zip(w.consumers, w.prefetch_at, strict=True))
    for a in choice.activations:
        names.add(a.name)
        b = a.nbytes or 0
        out.append((a.producer, a.last_early, b))
        out.append((a.prefetch_at, max(a.late), b))
    return names, out


Residency = tuple[dict[str, tuple[int, int]], dict[str, int]]  # resident_intervals' result


def schedule_memory(analysis: GraphAnalysis, choice: OffloadChoice | None,
                    dims: Mapping[str, int] | None = None,
                    residency: Residency | None = None) -> np.ndarray:
    """Fast-tier bytes per position of the schedule with ``choice``'s offloads
    (``residency``: :func:`resident_intervals` of ``analysis`` and ``dims``, when known)."""
    spans, sizes = residency or resident_intervals(analysis, dims)
    moved, extra = offloaded_intervals(choice) if choice else (set(), [])
    base = [(s, e, sizes[k]) for k, (s, e) in spans.items() if k not in moved]
    return memory_profile(len(analysis.order), base + extra)


def stored_peak_bytes(choice: OffloadChoice) -> int:
    """Most bytes of stored activations the slow tier holds at once (each from its producer
    to its last late reader); unknown sizes count 0."""
    return peak(stored_intervals(choice.activations), default=0)


def stored_intervals(activations: Iterable[ActivationOffload]) -> list[Interval]:
    """Slow-tier interval of each stored activation: producer through last late reader."""
    return [(a.producer, max(a.late), a.nbytes or 0) for a in activations]


def host_bytes(choice: OffloadChoice) -> int:
    """Peak bytes the slow tier holds: host-tier weights plus the stored peak."""
    return sum(w.nbytes for w in choice.weights if w.tier == "host") + stored_peak_bytes(choice)


def peak(intervals: list[Interval], default: int = 0) -> int:
    """Largest sum of bytes of intervals that overlap one position."""
    if not intervals:
        return default
    return int(memory_profile(max(e for _, e, _ in intervals) + 1, intervals).max(initial=0))
