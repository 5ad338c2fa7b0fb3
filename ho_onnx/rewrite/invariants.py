"""The schedule invariants the insertion promises (:mod:`.insert`), checked on the rewritten
``onnx_ir`` model in one walk of each graph (the main graph, and each subgraph: an If
branch has cache ops of its own, :mod:`.branches`):

* topologically sorted, the cache ops included: every input of a node (and every value a
  subgraph of it reads from the main graph) is a graph input, an initializer or the output
  of an earlier node;
* every ``Wait`` reads a ``Prefetch``'s data output, and nothing else does (no compute node,
  no graph output: a reader must wait for the transfer); a routed pair is gated by the same
  value (a closed gate skips the copy and the Wait's copy together); a *warm* Prefetch (a
  speculation: it only starts a read into the expert cache) has an empty output that only
  a later Prefetch of the same weight reads, as an ordering input;
* every ``Store``'s token reaches a ``Detach`` (which releases what the Store stored) and
  that Detach's token a ``Prefetch``;
* every ``Fence`` (a recomputed activation's: :mod:`~ho_onnx.schedule.recompute`) has an
  ordering input and is read by a node that is not a cache op (what it keeps apart and
  late is a recomputation; a Fence read by nothing, or unordered, recomputes early);
* each copy channel's Prefetches are chained FIFO in file order: each one after the first on
  its channel reads, as its last input, the ``issued`` output of the one before (what keeps
  the transfers queued in the order the plan simulated, under any node order);
* every ``Emit`` with a cache op after it has a ``done`` output that a cache op reads as an
  ordering input (else ORT's DEFAULT order runs it after the whole graph, and the present
  it copies stays allocated until then);
* every cache op inside a Loop/Scan body (at any depth) has attribute ``iteration`` = 1 and
  no other has (the library keeps a body op's records for one iteration; without it, the
  op's second iteration would start a new run and release the run's other records), and
  reads no cache op's output from another graph but a Guard's (an iteration's transfers
  are its own);
* a decode cache (:mod:`~ho_onnx.schedule.decode_cache`) is whole: every Prefetch of its
  group reads a streamed tier with the cache's capacity (``expert_cache``) and a place of
  its own among the cache's reads (``cache_order``), and every Guard of the main graph
  carries the group with one row of its dims, one size kept (at most that capacity) and one
  read ahead per point, so that each run limits the cache it fills and reads.

A violation is a rewriter bug; :func:`check_schedule` raises :class:`ScheduleError` naming
the first node that breaks one.
"""

from __future__ import annotations

import onnx_ir as ir

from .. import contract, kinds
from ..errors import ScheduleError
from ..graph.analyse import all_graphs, subgraphs
from ..schedule.eligibility import HOISTED_OPS
from .insert import prefetch_channel


def _is(node: ir.Node, op: str) -> bool:
    return node.domain == contract.DOMAIN and node.op_type == op


def _is_prefetch(node: ir.Node) -> bool:
    """A Prefetch or a PrefetchInput (both load on a channel, completed by a Wait)."""
    return node.domain == contract.DOMAIN and node.op_type in contract.PREFETCHES


def _label(node: ir.Node) -> str:
    return repr(node.name or f"<unnamed {node.op_type}>")


def check_schedule(model: ir.Model) -> None:
    """Raise :class:`ScheduleError` at the first node of ``model``'s graphs (the main graph,
    then each subgraph) that breaks an invariant above."""
    for graph in all_graphs(model.graph):
        _check_graph(graph)
    _check_decode_cache(model)
    stack = [(model.graph, False)]  # (a graph, whether it is inside a Loop/Scan body)
    while stack:
        graph, in_body = stack.pop()
        for node in graph:
            if node.domain == contract.DOMAIN:
                _check_iteration(node, graph, in_body)
            stack.extend((sub, in_body or node.op_type in HOISTED_OPS)
                         for sub in subgraphs(node))


def _check_iteration(node: ir.Node, graph: ir.Graph, in_body: bool) -> None:
    """A cache op of a Loop/Scan body (``in_body``) is marked per iteration and keeps its
    chain inside its graph; any other is not marked."""
    attr = node.attributes.get(contract.ATTR_ITERATION)
    if (attr is not None and attr.value == 1) != in_body:
        raise ScheduleError(f"{node.op_type} {_label(node)} " + (
            "is inside a Loop/Scan body without attribute iteration = 1" if in_body
            else "has attribute iteration = 1 outside any Loop/Scan body"))
    for v in node.inputs if in_body else ():
        p = v.producer() if v is not None else None
        if p is not None and p.domain == contract.DOMAIN and p.graph is not graph \
                and p.op_type != contract.GUARD:  # (a Guard's empty output: order only)
            raise ScheduleError(f"{node.op_type} {_label(node)} inside a Loop/Scan body reads "
                                f"{p.op_type} {_label(p)}'s output from another graph")


def _check_graph(graph: ir.Graph) -> None:
    """The invariants in one graph (each copy channel chained within it)."""
    position = {id(n): i for i, n in enumerate(graph)}
    last_on: dict[str, ir.Node] = {}  # channel -> its latest Prefetch so far
    emits: list[ir.Node] = []  # Emits no later cache op has been seen after yet
    for i, node in enumerate(graph):
        _check_sorted(node, i, position, graph)
        if node.domain != contract.DOMAIN:
            continue
        if node.op_type == contract.EMIT:
            emits.append(node)
            continue
        for e in emits:
            _check_emit(e)
        emits = []
        if node.op_type == contract.WAIT:
            src = node.inputs[0] if node.inputs else None
            p = src.producer() if src is not None else None
            if p is None or not _is_prefetch(p) or src is not p.outputs[0]:
                raise ScheduleError(f"Wait {_label(node)} does not read a Prefetch's output")
            if _gate(node) is not _gate(p):  # (a closed gate skips both or neither)
                raise ScheduleError(f"Wait {_label(node)} and its Prefetch {_label(p)} are "
                                    "not gated by the same value")
        elif node.op_type in contract.PREFETCHES:
            _check_prefetch(node, last_on)
        elif node.op_type == contract.STORE:
            _check_store(node)
        elif node.op_type == contract.FENCE and (len(node.inputs) < 2 or not any(
                u.domain != contract.DOMAIN for u, _ in node.outputs[0].uses())):
            raise ScheduleError(f"Fence {_label(node)} has no ordering input or no "
                                "reader that recomputes")
    for v in graph.outputs:
        p = v.producer()
        if p is not None and _is_prefetch(p):
            raise ScheduleError(f"graph output {v.name!r} is Prefetch {_label(p)}'s output, "
                                "read without a Wait")


def _gate(node: ir.Node) -> ir.Value | None:
    """The gate of a routed Prefetch or Wait (attribute ``gated``: input 1), or None."""
    attr = node.attributes.get(contract.ATTR_GATED)
    if attr is None or attr.value != 1:
        return None
    return node.inputs[1] if len(node.inputs) > 1 else None


def _check_sorted(node: ir.Node, i: int, position: dict[int, int], graph: ir.Graph) -> None:
    """``node`` (at ``i``) reads only values available before it."""
    reads = [v for v in node.inputs if v is not None]
    for attr in node.attributes.values():  # what its subgraphs read from the main graph
        if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            for sub in [attr.value] if attr.type == ir.AttributeType.GRAPH else attr.value:
                for inner in ir.traversal.RecursiveGraphIterator(sub):
                    reads.extend(v for v in inner.inputs if v is not None)
    for v in reads:
        p = v.producer()
        if p is None:
            if not (v.is_graph_input() or v.is_initializer()):
                raise ScheduleError(f"node {_label(node)} reads {v.name!r}, which nothing "
                                    "produces")
        elif p.graph is graph and position[id(p)] >= i:
            raise ScheduleError(f"node {_label(node)} reads {v.name!r} before its producer "
                                f"{_label(p)}: the graph is not sorted topologically")


def _check_prefetch(node: ir.Node, last_on: dict[str, ir.Node]) -> None:
    """Only a Wait reads ``node``'s data (a warm one's: a Prefetch of its weight, as an
    ordering input); it is chained after its channel's previous one."""
    warm = node.attributes.get(contract.ATTR_WARM)
    for user, idx in node.outputs[0].uses():
        if warm is not None and warm.value == 1:
            name = node.attributes.get(contract.ATTR_NAME)
            other = user.attributes.get(contract.ATTR_NAME)
            if not _is(user, contract.PREFETCH) or idx < 1 or other is None \
                    or name is None or other.value != name.value:
                raise ScheduleError(f"node {_label(user)} reads warm Prefetch {_label(node)}'s "
                                    "output, not as an ordering input of a Prefetch of its "
                                    "weight")
            continue
        if not _is(user, contract.WAIT):
            raise ScheduleError(f"node {_label(user)} reads Prefetch {_label(node)}'s output "
                                "directly, not through a Wait")
    channel = prefetch_channel(node)
    prev = last_on.get(channel)
    last_on[channel] = node
    if prev is None:
        return
    issued = prev.outputs[1] if len(prev.outputs) > 1 else None
    if issued is None or not node.inputs or node.inputs[-1] is not issued:
        raise ScheduleError(f"Prefetch {_label(node)} is not chained after Prefetch "
                            f"{_label(prev)} on the {channel!r} channel (its last input must "
                            "be that one's 'issued' output)")


def _check_emit(node: ir.Node) -> None:
    """``node`` (an Emit a cache op follows) signals its ``done`` to a cache op."""
    done = node.outputs[1] if len(node.outputs) > 1 else None
    if done is None or not any(u.domain == contract.DOMAIN and j >= 1 for u, j in done.uses()):
        raise ScheduleError(f"Emit {_label(node)} has no 'done' output that a later cache op "
                            "reads (ORT's DEFAULT order would run it after the whole graph)")


def _check_store(node: ir.Node) -> None:
    """``node``'s token reaches a Detach of the stored tensor, whose token reaches a
    Prefetch."""
    for user, idx in node.outputs[0].uses():
        if _is(user, contract.DETACH) and idx == 1 and user.inputs[0] is node.inputs[0]:
            if any(_is(p, contract.PREFETCH) and j == 0 for p, j in user.outputs[0].uses()):
                return
            raise ScheduleError(f"Store {_label(node)}'s token reaches Detach {_label(user)} "
                                "but no Prefetch")
    raise ScheduleError(f"Store {_label(node)}'s token reaches no Detach of the tensor it "
                        "stores")


def _ints(node: ir.Node, name: str) -> list[int]:
    attr = node.attributes.get(name)
    if attr is None:
        return []
    return [int(v) for v in attr.value] if isinstance(attr.value, (list, tuple)) \
        else [int(attr.value)]


def _check_decode_cache(model: ir.Model) -> None:
    """The decode cache's Prefetches and the main graph's Guards agree on its group."""
    groups: dict[int, int] = {}  # group -> capacity
    orders: set[tuple[int, int]] = set()
    for graph in all_graphs(model.graph):
        for node in graph:
            g = _ints(node, contract.ATTR_CACHE_GROUP)
            if not g or not _is(node, contract.PREFETCH):
                continue
            cap = _ints(node, contract.ATTR_EXPERT_CACHE)
            tier = node.attributes.get(contract.ATTR_TIER)
            if not cap or cap[0] <= 0 or tier is None or kinds.tier(tier.value).in_host_memory:
                raise ScheduleError(f"Prefetch {_label(node)} of decode cache {g[0]} has no "
                                    "expert_cache capacity or no streamed tier")
            if groups.setdefault(g[0], cap[0]) != cap[0]:
                raise ScheduleError(f"Prefetch {_label(node)} gives decode cache {g[0]} another "
                                    "capacity")
            order = _ints(node, contract.ATTR_CACHE_ORDER)
            if len(order) != 1 or order[0] < 0 or (g[0], order[0]) in orders:
                raise ScheduleError(f"Prefetch {_label(node)} of decode cache {g[0]} has no "
                                    "cache_order of its own")
            orders.add((g[0], order[0]))
    guards = [n for n in model.graph if _is(n, contract.GUARD)]
    for node in guards:
        g = _ints(node, contract.ATTR_CACHE_GROUP)
        if not g:
            continue
        rows = _ints(node, contract.ATTR_CACHE_POINTS)
        sizes = _ints(node, contract.ATTR_CACHE_BYTES)
        ahead = _ints(node, contract.ATTR_CACHE_AHEAD)
        if g[0] not in groups or not 0 < len(sizes) <= 64 or len(ahead) != len(sizes) \
                or len(rows) != len(sizes) * len(_ints(node, contract.ATTR_AXES)) \
                or any(not 0 <= b <= groups[g[0]] for b in sizes) or min(ahead) < 0:
            raise ScheduleError(f"Guard {_label(node)}: decode cache {g[0]} has no Prefetch, or "
                                "its rows or sizes do not fit its dims and capacity")
    for group in groups:
        if not guards or any(_ints(n, contract.ATTR_CACHE_GROUP) != [group]
                             or _ints(n, contract.ATTR_CACHE_GUARDS) != [len(guards)]
                             for n in guards):
            raise ScheduleError(f"decode cache {group}: not every Guard of the main graph "
                                "limits it (a run would keep what an earlier run left)")
