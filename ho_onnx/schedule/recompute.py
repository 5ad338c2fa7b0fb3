"""Recomputation (issue 38, item 5): a stored activation computed again right before its
late readers instead of stored after its producer and reloaded before them, where the cost
model says that is faster (the seed's cost model weighs size, access frequency,
recomputation and bandwidth; PyTorch's activation checkpointing and Megatron's selective
recomputation make the same trade by hand).

**Candidates** are the activations a plan stores (``OffloadChoice.activations``). One is
recomputable when its producer, and whatever it needs that is not resident at its first late
reader, can run again right there: the *cone*, walked back from the producer, of nodes that
are all recomputable (:func:`~ho_onnx.target.ort.facts.recomputable`: deterministic and
cheap: elementwise, layout, normalization; never random ops, MatMul or attention), at most
:data:`MAX_NODES` of them, whose inputs from outside the cone are resident at that reader in
the plan: an initializer it keeps, a graph input it does not move, a Constant's output (ORT
makes it an initializer), or an activation no offload of the plan touches whose residency
reaches the reader (so the copy extends no lifetime).

**Its cost**: the memory of a reload at the first late reader (the copy lives from there to
the last late reader) plus the cone's other outputs while it runs (``transient``); the time
of the cone's compute at that step, instead of a store and a reload (no host bytes, no
transfer). **The decision** (``OffloadOptions.recompute``): ``auto`` (default) recomputes a
stored activation where the simulated run is shorter and the plan still fits (its tensors'
peak within the budget it was made for, ORT's replayed arena no larger than the budget or
than it was), the largest saving first; ``on`` wherever it fits; ``off`` never. Each stored
activation left stored says why (``OffloadChoice.recompute_skipped``).

The rewrite (:mod:`~ho_onnx.rewrite.insert`) clones the cone's nodes, with fresh output
names, right before the first late reader and points the late readers at the copy; each clone
reads a clone made before it or one input through a ``Fence`` (:func:`fenced_inputs`), which
keeps ORT from merging it back into the first computation or running it early. The same
kernels on the same bytes: bit-exact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from ..graph.analyse import GraphAnalysis, input_names, output_names
from ..target.ort.facts import recomputable
from .lifetimes import held_by_ort, transient_bytes
from .types import ActivationOffload, OffloadChoice, Recompute

MAX_NODES = 16  # the largest cone recomputed (a causal mask's chain, a decomposed GELU)
MAX_TRIES = 64  # stored activations tried (largest first): each try is one simulation


def tries_for(nodes: int) -> int:
    """Stored activations tried on a graph of ``nodes`` nodes: each try simulates and
    replays the arena once (~30 ms at 10k nodes), so fewer on large graphs (a bound by
    count, not time: the plan does not depend on the machine's load)."""
    return max(8, min(MAX_TRIES, 200_000 // max(nodes, 1)))


# The plan's time and whether it still fits, for a choice (the planner's simulation).
Score = Callable[[OffloadChoice], tuple[float, bool]]


def moved_names(choice: OffloadChoice) -> set[str]:
    """Every tensor an offload of ``choice`` takes out of the fast tier for a while."""
    return ({w.name for w in choice.weights} | {a.name for a in choice.activations}
            | {r.name for r in choice.recomputes} | {i.name for i in choice.inputs}
            | {o.name for o in choice.outputs})


def cone(analysis: GraphAnalysis, a: ActivationOffload, moved: set[str],
         spans: Mapping[str, tuple[int, int]]) -> tuple[int, ...] | str:
    """The positions (ascending) of the nodes that make ``a`` again right before its first
    late reader from values resident there, or why there are none (module docstring)."""
    at = a.late[0]

    def resident(name: str) -> bool:
        if name not in analysis.tensors or name in moved:
            return False
        if held_by_ort(analysis, name):
            return True
        s, e = spans.get(name, (at, -1))
        return s < at <= e

    nodes: set[int] = set()
    todo = [a.producer]
    while todo:
        pos = todo.pop()
        if pos in nodes:
            continue
        node = analysis.nodes[pos]
        if not recomputable(node):
            what = (f"{node.domain}::{node.op_type}" if node.domain else node.op_type) + (
                f" ('{node.name}')" if node.name else "")
            return ("made by " if pos == a.producer else "needs again ") + what + (
                ", not among the ops recomputed (deterministic and cheap: elementwise, "
                "layout, normalization)")
        outs = [v.name for v in node.outputs]
        while outs and not outs[-1]:
            outs.pop()
        if any(not o or (t := analysis.tensors.get(o)) is None or t.elem_type is None
               for o in outs):
            return f"'{node.name}' has an output without a name or a known type"
        nodes.add(pos)
        if len(nodes) > MAX_NODES:
            return f"its recomputation needs more than {MAX_NODES} nodes"
        for name in input_names(node):
            if name and resident(name) and analysis.tensors[name].elem_type is None:
                return f"needs '{name}', whose type is unknown (a Fence must declare it)"
            if not name or resident(name):
                continue
            t = analysis.tensors.get(name)
            if t is None or t.producer is None:
                return (f"needs '{name}', which the plan moves out of the fast tier"
                        if name in moved else f"needs '{name}', not resident there")
            todo.append(t.producer)
    return tuple(sorted(nodes))


def fenced_inputs(analysis: GraphAnalysis, nodes: tuple[int, ...],
                  size: Callable[[str], int]) -> dict[int, str]:
    """Per node of a recomputation (its position), the input it reads through a Fence: none
    for a node reading a copy made before it (already apart from the first computation);
    else an activation it reads (ORT aliases the Fence's output to it: nothing is copied),
    else its smallest input (ORT never aliases a graph input or an initializer: the Fence
    copies it)."""
    made = {v for p in nodes for v in output_names(analysis.nodes[p])}
    out: dict[int, str] = {}
    for p in nodes:
        ins = [v for v in input_names(analysis.nodes[p]) if v]
        if not ins or any(v in made for v in ins):
            continue
        kept = [v for v in ins if not held_by_ort(analysis, v)]
        out[p] = kept[0] if kept else min(ins, key=size)
    return out


def recompute(analysis: GraphAnalysis, choice: OffloadChoice, mode: str,
              spans: Mapping[str, tuple[int, int]], size: Callable[[str], int],
              score: Score) -> OffloadChoice:
    """``choice`` with the stored activations that ``mode`` recomputes turned into
    :class:`Recompute` s, and why each other stayed stored (module docstring); ``spans``:
    the unmodified schedule's residency, ``size``: a tensor's bytes, ``score``: the plan's
    simulated time for a choice and whether it fits."""
    if mode == "off" or not choice.activations:
        return choice
    current, (now, _) = choice, score(choice)
    skipped: dict[str, str] = {}
    tried = sorted(choice.activations, key=lambda a: -(a.nbytes or 0))
    limit = tries_for(len(analysis.order))
    for a in tried[limit:]:
        skipped[a.name] = f"not tried: only the {limit} largest stored activations are"
    for a in tried[:limit]:
        if a.nbytes is None:
            skipped[a.name] = "its size is symbolic"
            continue
        nodes = cone(analysis, a, moved_names(current) - {a.name}, spans)
        if isinstance(nodes, str):
            skipped[a.name] = nodes
            continue
        fenced = fenced_inputs(analysis, nodes, size)
        r = Recompute(a.name, a.nbytes, a.producer, a.early, a.late, nodes,
                      tuple(fenced.items()),
                      transient_bytes(analysis, nodes, a.name, fenced.values(), size))
        trial = replace(current, activations=[x for x in current.activations if x is not a],
                        recomputes=[*current.recomputes, r])
        seconds, fits = score(trial)
        if not fits:
            skipped[a.name] = "recomputing it does not fit the budget"
        elif mode == "auto" and seconds >= now:
            skipped[a.name] = (f"storing it is predicted as fast or faster ({now * 1e3:.3f} "
                               f"ms; {seconds * 1e3:.3f} ms recomputing {len(nodes)} nodes)")
        else:
            current, now = trial, seconds
    return replace(current, recompute_skipped={**choice.recompute_skipped, **skipped})


def describe(choice: OffloadChoice) -> str:
    """One line of the recomputations for plan reports ("" without any)."""
    from ..units import format_bytes

    if not choice.recomputes:
        return ""
    n = len(choice.recomputes)
    return (f"recomputed instead of stored: {n} activation{'s' * (n != 1)} "
            f"({format_bytes(sum(r.nbytes for r in choice.recomputes), unit='MiB', digits=1)}"
            f", {sum(len(r.nodes) for r in choice.recomputes)} nodes run again: "
            + ", ".join(r.name for r in choice.recomputes[:4])
            + (", ..." if n > 4 else "") + ")")
