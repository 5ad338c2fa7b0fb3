"""Guards of a range-planned model (``--dim seq=1..2048``): an ``ai.hyperoffload`` ``Guard``
per graph input with a ranged dim, reading only that input's shape, refuses a run whose dims
leave the ranges the plan holds for (the library's error names the dim, its value and the
range). Its empty output is an ordering input of the first cache op of the main graph and of
each subgraph that has one (an If branch, a Loop/Scan body: ORT then makes it an implicit
input of the subgraph's node), so the check runs before the first transfer and is never
pruned as unused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import onnx_ir as ir

from .. import contract
from ..graph.analyse import forget_source, subgraphs
from ..graph.dims import DimRanges
from ..schedule.decode_cache import guard_rows
from ..schedule.types import DecodeCache
from .insert import Names


def insert_guards(model: ir.Model, checks: Mapping[str, Sequence[tuple[int, str]]],
                  ranges: DimRanges, cache: DecodeCache | None = None) -> int:
    """Insert a Guard for each graph input of ``checks`` (its ``(axis, dim)`` pairs, from
    :func:`ho_onnx.graph.dims.ranged_inputs`) at the start of the main graph, in place; the
    number inserted (none when the model has no cache op: nothing to protect). ``cache``:
    the plan's decode cache, which every Guard limits per run (its points' rows)."""
    graph = model.graph
    firsts = [f for g in (graph, *(s for n in graph for s in subgraphs(n)))
              if (f := next((n for n in g if n.domain == contract.DOMAIN), None)) is not None]
    if not firsts or not checks:
        return 0
    forget_source(model)
    inputs = {v.name: v for v in graph.inputs}
    names = Names(graph)
    guards = []
    for name, dims in checks.items():
        v = inputs[name]
        assert isinstance(v.type, ir.TensorType)
        out = ir.Value(name=names.fresh(f"{name}.ho_guard"), type=ir.TensorType(v.type.dtype),
                       shape=ir.Shape([0]))
        guards.append(ir.Node(contract.DOMAIN, contract.GUARD, [v], [
            ir.AttrInt64s(contract.ATTR_AXES, [a for a, _ in dims]),
            ir.AttrInt64s(contract.ATTR_LO, [ranges[d][0] for _, d in dims]),
            ir.AttrInt64s(contract.ATTR_HI, [ranges[d][1] for _, d in dims]),
            ir.AttrString(contract.ATTR_DIMS, "\n".join(d for _, d in dims)),
            ir.AttrString(contract.ATTR_INPUT, name),
            *_cache_attrs(cache, [d for _, d in dims], len(checks)),
        ], outputs=[out], name=names.fresh(f"ho.guard.{name}")))
    graph.insert_before(next(iter(graph)), guards)
    for first in firsts:
        n = len(first.inputs)
        first.resize_inputs(n + len(guards))
        for i, g in enumerate(guards):
            first.replace_input_with(n + i, g.outputs[0])
    return len(guards)


def _cache_attrs(cache: DecodeCache | None, dims: Sequence[str], guards: int
                 ) -> list[ir.Attr]:
    """A Guard's decode-cache attributes for its ``dims`` (none without a cache), one of
    ``guards`` Guards."""
    if cache is None:
        return []
    rows, sizes, ahead = guard_rows(cache, dims)
    return [ir.AttrInt64(contract.ATTR_CACHE_GROUP, cache.group),
            ir.AttrInt64(contract.ATTR_CACHE_GUARDS, guards),
            ir.AttrInt64s(contract.ATTR_CACHE_POINTS, rows),
            ir.AttrInt64s(contract.ATTR_CACHE_BYTES, sizes),
            ir.AttrInt64s(contract.ATTR_CACHE_AHEAD, ahead)]
