"""The KV cache's offloads (the ``kv`` kind, :mod:`ho_onnx.graph.kv`): fixed, not chosen.

With ``OffloadOptions.kv`` the caller holds the cache in host memory between steps: every
past KV input is copied into the fast tier before each reader of its data and every present
KV output leaves right after its last reader in the graph. Both deciders add these to their
choice and plan the other tensors around them, so the budget holds one layer's cache at a
time instead of every layer's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from .. import kinds
from ..graph.analyse import GraphAnalysis
from .eligibility import ineligible, placement_reasons, split_shape_readers
from .lifetimes import Sizes, TensorSizes
from .options import OffloadOptions
from .types import InputOffload, OffloadChoice, OutputOffload

NO_KV_NOTE = ("kv: no KV cache found (no graph input whose reader produces a graph output like "
              "it, grown along one axis): nothing of it moves; export the model with past "
              "(Optimum's text-generation-with-past, the genai builder)")

# Where each past KV reload is issued, given its reader: (reader, bytes) -> position.
Window = Callable[[int, int], int]


def distance_window(distance: int) -> Window:
    """The explicit policy's window: ``distance`` compute nodes before the reader."""
    return lambda reader, nbytes: max(0, reader - distance)


def overlap_window(prefix: np.ndarray, load_s: Callable[[int], float],
                   opts: OffloadOptions) -> Window:
    """The planner's window: the latest position whose compute up to the reader covers
    ``preferred_overlap`` copy-times, never more than ``max_overlap`` (``prefix``: the
    compute seconds before each step, :meth:`CostModel.prefix`)."""
    def window(reader: int, nbytes: int) -> int:
        tt = load_s(nbytes)
        p = reader
        while p > 0 and prefix[reader] - prefix[p] < opts.preferred_overlap * tt \
                and prefix[reader] - prefix[p - 1] <= opts.max_overlap * tt:
            p -= 1
        return p
    return window


def kv_choice(analysis: GraphAnalysis, opts: OffloadOptions, dims: Mapping[str, int],
              window: Window, sizes: Sizes | None = None) -> OffloadChoice:
    """The KV offloads of ``analysis``' model under ``dims`` (none unless ``opts.kv``); a
    KV tensor that cannot move gets its reason in ``skipped``."""
    choice = OffloadChoice(decided_by="kv")
    if not opts.kv:
        return choice
    sizes = sizes or TensorSizes(analysis.tensors, dims)
    placement = placement_reasons(analysis)
    # A window opens no earlier than right after the previous reader of a past (the layer
    # before's attention): one layer's past ahead at most, never every layer's at once, and
    # never alongside the previous layer's at its attention.
    readers = sorted({c for t in analysis.tensors.values() if t.kv_peer is not None
                      and t.is_graph_input for c in split_shape_readers(analysis, t)[0]})

    def opens(c: int, nbytes: int) -> int:
        before = [r for r in readers if r < c]
        return max(window(c, nbytes), before[-1] + 1 if before else 0)

    for name, t in analysis.tensors.items():
        if kinds.kind_of(t) is not kinds.KV:
            continue
        reason = (placement.get(name) or ("read by a subgraph (If/Loop/Scan) from the outer "
                                           "scope" if t.implicit_consumers else None)
                  or (ineligible(t) if t.is_graph_input else None))
        nbytes = None if reason else sizes(name)  # raises UnboundDimError naming the dim
        if reason is None and not nbytes:
            reason = "size unknown or empty"
        if reason is not None:
            choice.skipped[name] = reason
            continue
        assert nbytes is not None
        if t.is_graph_input:
            data, _ = split_shape_readers(analysis, t)
            if not data:
                choice.skipped[name] = "no reader of its data"
                continue
            choice.inputs.append(InputOffload(name, nbytes, tuple(data),
                                              tuple(opens(c, nbytes) for c in data),
                                              t.kv_peer or ""))
        else:
            assert t.producer is not None
            choice.outputs.append(OutputOffload(name, nbytes, t.producer,
                                                max(t.consumers, default=t.producer)))
    if not choice.inputs and not choice.outputs and not choice.skipped:
        choice.notes.append(NO_KV_NOTE)
    return choice
