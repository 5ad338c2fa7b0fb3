"""Planning inside ``If`` branches (an Optimum merged decoder: the main graph is one ``If``
whose two branches are whole decoders reading the weights from the outer scope) and, under
a budget, inside Loop/Scan bodies (planned as a branch is; their cache ops run at every
iteration, marked ``iteration`` = 1: :func:`mark_per_iteration`).

Each ``If`` branch of the main graph is planned as a graph of its own, by the pipeline's own
steps (:class:`~.passes.AnalysePass`, :class:`~.passes.DecidePass`, then
:func:`~.insert.insert_cache_ops`): while it is analysed, decided and rewritten, every value
it reads from the main graph is stood in for by a *proxy* of the branch (a main-graph
initializer by an initializer of the same name and tensor, anything else by a graph input of
the same name and type); afterwards the proxies go and the branch reads the outer values
again, its cache ops included. A Prefetch inside a branch thus loads an offloaded main-graph
initializer; both branches may reload the same weight, whose initializer leaves the main
graph once.

* **Memory**: the ``If`` holds one branch at a time; each branch is planned for the budget
  less what the main graph holds at the ``If`` (baseline) that the branch does not read,
  less the weights only its siblings read that stay resident.
* **Every reader or none**: a weight one branch offloads is offloaded in every branch that
  reads it (memory only falls where that branch's plan kept it); a weight the main graph
  reads itself (the main graph keeps what a subgraph reads resident), or that a Loop/Scan
  body or a nested subgraph reads (not planned), stays resident in every branch.
* The main graph is planned without the weights its branches offload (they are not resident
  outside the ``If``); its choice records, for every weight a subgraph reads, where it went
  or why it stayed (``skipped``), and a note per branch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir

from .. import contract, kinds
from ..errors import HoOnnxError, UnboundDimError
from ..graph.analyse import GraphAnalysis, TensorInfo, analyse, subgraphs
from ..graph.dims import UNREADABLE, require_dims
from ..schedule.eligibility import HOISTED_OPS, OVERRIDABLE_REASON, hoisted_readers
from ..schedule.kv import NO_KV_NOTE
from ..schedule.lifetimes import resident_intervals, stored_peak_bytes
from ..schedule.options import OffloadOptions
from ..schedule.planner import InfeasibleBudgetError, Plan
from ..schedule.types import Decider, Decision, OffloadChoice, RunFacts
from ..target.ort.arena import ORT
from ..units import format_bytes
from .annotate import annotate
from .insert import Names, RewrittenModel, insert_cache_ops
from .meta import ANALYSIS, BRANCHES, CONTRIB, DECISION, REWRITTEN, need

_ROUNDS = 4  # plans of the branches at most, while their budgets fall
_MIN_NODES = 32  # a branch without weights of its own or outer ones: planned from this size


def _mib(b: int) -> str:
    return format_bytes(b, "MiB", 2)


@dataclass
class Branch:
    """One ``If`` branch of the main graph, planned as a graph of its own."""

    owner: ir.Node  # the If of the main graph
    attr: str  # then_branch / else_branch
    graph: ir.Graph
    outer: dict[str, ir.Value]  # what it reads from the main graph, by name
    weights: frozenset[str] = frozenset()  # those of ``outer`` that are initializers there
    proxies: dict[str, ir.Value] = field(default_factory=dict)  # name -> its stand-in
    model: ir.Model | None = None  # the branch as a model of its own (shares ``graph``)
    analysis_: GraphAnalysis | None = None  # of ``model``
    decision: Decision | None = None
    budget: int | None = None  # what it was planned for (None: the explicit policy)
    main_bytes: int = 0  # what the main graph holds at the If besides the branch's reads
    held: int = 0  # that and its siblings' resident weights, once the branches agree
    unmodified: int = 0  # that and all its siblings' weights: the unmodified model's
    sizes: dict[str, int] = field(default_factory=dict)  # bytes of its outer weights
    pinned: dict[str, str] = field(default_factory=dict)  # weight -> why it stays resident
    opsets: dict[str, int] = field(default_factory=dict)  # the main graph's
    decider: Decider | None = None  # what planned it
    stale: bool = False  # it offloads a weight another branch must keep: plan it again
    saved_opsets: dict[str, int] = field(default_factory=dict)  # its own, while installed
    trips: int | None = None  # a body's iterations per run, where the graph fixes them

    @property
    def label(self) -> str:
        return f"{self.owner.op_type} {self.owner.name or '<unnamed>'!r} {self.attr}"

    @property
    def per_iteration(self) -> bool:
        """A Loop/Scan body: its cache ops run once per iteration (attribute
        ``iteration``), each iteration's loads and stores its own."""
        return self.owner.op_type in HOISTED_OPS

    @property
    def analysis(self) -> GraphAnalysis:
        assert self.analysis_ is not None
        return self.analysis_

    def offloaded(self) -> set[str]:
        """Main-graph initializers the branch's decision offloads."""
        assert self.decision is not None
        return {w.name for w in self.decision.choice.weights} & self.weights


def _proxy(v: ir.Value, info: TensorInfo | None) -> ir.Value:
    """A stand-in of the outer value ``v`` inside a branch (an initializer keeps its tensor)."""
    if v.is_initializer():
        return ir.Value(name=v.name, type=v.type, shape=v.shape, const_value=v.const_value)
    type_, shape = v.type, v.shape
    if type_ is None and info is not None and info.elem_type is not None:
        type_ = ir.TensorType(ir.DataType(info.elem_type))
        shape = None if info.shape is None else ir.Shape(list(info.shape))
    return ir.Value(name=v.name, type=type_, shape=shape)


def install(b: Branch) -> None:
    """Put the proxies in place of the outer values in ``b``'s graph (and the main graph's
    opsets on it, what its model serialises)."""
    g = b.graph
    b.saved_opsets = dict(g.opset_imports)
    g.opset_imports.update(b.opsets)
    for name, outer in b.outer.items():
        p = b.proxies[name]
        if name in b.weights:
            g.register_initializer(p)
        else:
            g.inputs.append(p)
        _rewire(outer, p, g)


def uninstall(b: Branch) -> None:
    """The outer values back in place of the proxies (cache ops included)."""
    g = b.graph
    for name, outer in b.outer.items():
        p = b.proxies[name]
        _rewire(p, outer, g)
        if g.initializers.get(name) is p:
            g.initializers.pop(name)
        if p in g.inputs:
            g.inputs.remove(p)
    g.opset_imports.clear()
    g.opset_imports.update(b.saved_opsets)


def _rewire(old: ir.Value, new: ir.Value, g: ir.Graph) -> None:
    """Readers of ``old`` among ``g``'s own nodes (and ``g``'s outputs) read ``new``."""
    for node, i in list(old.uses()):
        if node.graph is g:
            node.replace_input_with(i, new)
    for k, v in enumerate(g.outputs):
        if v is old:
            g.outputs[k] = new


def _reads_outer(g: ir.Graph, main: ir.Graph) -> dict[str, ir.Value]:
    """Values of ``main`` that ``g``'s own nodes or outputs read."""
    out: dict[str, ir.Value] = {}
    for v in (*(x for n in g for x in n.inputs), *g.outputs):
        if v is None or not v.name:
            continue
        p = v.producer()
        if (p.graph if p is not None else v.graph) is main:
            out[v.name] = v
    return out


def find_branches(analysis: GraphAnalysis, dims: Mapping[str, int] | None = None, *,
                  bodies: bool = False) -> tuple[list[Branch], dict[str, str]]:
    """The plannable ``If`` branches of the main graph (``bodies``: its Loop/Scan bodies
    too), and why each main-graph weight that an unplanned subgraph reads stays resident
    (nested subgraphs; Loop/Scan bodies not planned whose weights an If branch reads)."""
    main = analysis.model.graph
    branches: list[Branch] = []
    refused: dict[str, str] = {}
    hoisted: dict[str, str] = {}  # weight a Loop/Scan body reads -> why, if a branch reads it
    plannable = {"If", *HOISTED_OPS} if bodies else {"If"}
    for node in analysis.nodes:
        for attr, a in node.attributes.data.items():
            if a.type is not ir.AttributeType.GRAPH:
                continue
            g = a.value
            nested = any(True for n in g for _ in subgraphs(n))
            outer = _reads_outer(g, main)
            weights = frozenset(n for n, v in outer.items() if v.is_initializer())
            if node.op_type in plannable and node.domain in ("", "ai.onnx") and not nested:
                if weights or len(g.initializers) or len(g) >= _MIN_NODES:
                    proxies = {n: _proxy(v, analysis.tensors.get(n)) for n, v in outer.items()}
                    branches.append(Branch(node, attr, g, outer, weights, proxies,
                                           trips=trip_count(analysis, node, dims or {})))
                continue
            where = f"read inside {node.op_type} {node.name or '<unnamed>'!r}'s {attr}"
            reads = [n for n in _deep_reads(g, main) if n in main.initializers]
            if node.op_type in HOISTED_OPS and node.domain in ("", "ai.onnx"):
                # (the main plan reloads it before the node: only a branch must keep it)
                hoisted.update((n, f"{where} and by an If branch (the body reads it from the "
                                   "main graph, where it stays resident)") for n in reads)
                continue
            why = f"{where}, which holds a nested subgraph (only If branches without one " \
                "are planned)" if node.op_type == "If" else \
                f"{where} (a {node.op_type} subgraph is not planned)"
            refused.update((n, why) for n in reads)
    read_by_branches = set().union(*(b.weights for b in branches))
    refused.update((n, why) for n, why in hoisted.items()
                   if n in read_by_branches and n not in refused)
    return branches, refused


def trip_count(analysis: GraphAnalysis, node: ir.Node, dims: Mapping[str, int]) -> int | None:
    """Iterations of a Loop (its trip count ``M`` where a constant gives it) or a Scan (its
    first scan input's scanned dim, bound by ``dims``); None where the graph does not fix
    them (an If: None)."""
    if node.op_type == "Loop":
        m = node.inputs[0] if node.inputs else None
        if m is None:
            return None
        value = m.const_value
        p = m.producer()
        if value is None and p is not None and p.op_type == "Constant" \
                and (attr := p.attributes.get("value")) is not None:
            value = attr.value
        try:  # (a hostile model's M: anything, or nothing readable)
            return max(0, int(value.numpy().reshape(-1)[0])) if value is not None else None
        except UNREADABLE:
            return None
    if node.op_type != "Scan":
        return None
    count = node.attributes.get("num_scan_inputs")
    axes = node.attributes.get("scan_input_axes")
    if count is None or not isinstance(count.value, int) or not \
            1 <= count.value <= len(node.inputs):
        return None
    first = node.inputs[len(node.inputs) - count.value]
    info = analysis.tensors.get(first.name) if first is not None else None
    if info is None or not info.shape:
        return None
    axis = axes.value[0] if axes is not None and isinstance(axes.value, Sequence) \
        and axes.value else 0
    if not isinstance(axis, int) or not -len(info.shape) <= axis < len(info.shape):
        return None
    d = info.shape[axis]
    d = dims.get(d) if isinstance(d, str) else d
    return d if isinstance(d, int) and d >= 0 else None


def _deep_reads(g: ir.Graph, main: ir.Graph) -> set[str]:
    """Names of ``main``'s values read anywhere in ``g`` (nested graphs included)."""
    names: set[str] = set()
    for node in ir.traversal.RecursiveGraphIterator(g):
        names.update(v.name for v in node.inputs
                     if v is not None and v.name and v.name in main.initializers)
    return names


def _has_options(decider: Decider) -> bool:
    """Whether ``decider`` is a dataclass with :class:`OffloadOptions` (the budget planner,
    the explicit policy): what a branch's decider is made from."""
    return dataclasses.is_dataclass(decider) and isinstance(
        getattr(decider, "options", None), OffloadOptions)


def branch_decider(decider: Decider, budget: int | None, *, body: bool = False
                    ) -> Decider | None:
    """``decider`` for one branch: its options with ``budget`` (where it has one; ``kv``
    kept: a merged decoder's cache is read in its past branch, but not in a Loop/Scan
    ``body``, whose inputs are its carried state); None for a decider whose options are
    unknown."""
    if not _has_options(decider):
        return None
    options = getattr(decider, "options")  # noqa: B009 (a Decider declares no options)
    opts = dataclasses.replace(options,
                               **({"budget": budget} if options.budget is not None else {}),
                               **({"kv": False} if body else {}))
    return dataclasses.replace(decider, options=opts)  # type: ignore[type-var]


def main_bytes_at(analysis: GraphAnalysis, b: Branch, dims: Mapping[str, int],
                  skip: Iterable[str] = ()) -> int:
    """Bytes the main graph holds at ``b``'s If (unmodified schedule) that ``b`` itself
    does not count: neither what it reads, nor the If's outputs, nor ``skip``."""
    pos = analysis.nodes.index(b.owner)
    spans, sizes = resident_intervals(analysis, dims)
    own = {*b.outer, *skip, *(v.name for v in b.owner.outputs)}
    return sum(sizes.get(n, 0) for n, (lo, hi) in spans.items()
               if lo <= pos <= hi and n not in own)


def _sibling_bytes(b: Branch, branches: list[Branch], sizes: Mapping[str, int]) -> int:
    """Bytes of the weights only ``b``'s sibling branches read that stay resident (while
    ``b`` runs they are in the fast tier too)."""
    gone = set().union(*(o.offloaded() for o in branches if o.decision is not None))
    names = set().union(*(o.weights for o in branches if o.owner is b.owner)) - b.weights
    return sum(sizes.get(n, 0) for n in names - gone)


def _pin(b: Branch, names: Iterable[str]) -> None:
    """Keep ``names`` resident in ``b``'s plan (ineligible: read by a subgraph)."""
    tensors = b.analysis.tensors
    for n in names:
        t = tensors.get(n)
        if t is not None and t.consumers and not t.implicit_consumers:
            t.implicit_consumers = [t.consumers[0]]


def _analyse(b: Branch, main: ir.Model, dims: Mapping[str, int],
             shapes: Mapping[str, Sequence[int]], contrib: Any) -> None:
    """``b``'s graph (proxies in place) as a model of its own, analysed as AnalysePass
    does (``contrib``: ops only ORT knows, typed by its inference)."""
    more = None
    if contrib:
        from ..target.ort.contrib import contrib_value_types as more

    b.model = ir.Model(b.graph, ir_version=main.ir_version)
    b.analysis_ = analyse(b.model, dims, more_types=more,
                          shapes={k: v for k, v in shapes.items() if k in b.outer})
    if b.per_iteration:  # (its node holds them, in ORT's arena, for the whole iteration)
        for v in b.graph.inputs:
            if (t := b.analysis_.tensors.get(v.name)) is not None:
                t.is_graph_output = True


def _decide(b: Branch, decider: Decider, dims: Mapping[str, int]) -> None:
    """``b.decision`` as DecidePass makes one (every dim the decider needs bound), its
    pinned weights kept resident."""
    _pin(b, b.pinned)
    a = b.analysis
    try:
        require_dims((d for t in a.tensors.values() if decider.sized(t)
                      for d in t.symbolic_dims()), dims)
        b.decision = decider.decide(a, dims)
    except InfeasibleBudgetError as e:
        raise InfeasibleBudgetError(
            f"{b.label} (planned as a graph of its own for the budget less "
            f"{_mib(b.main_bytes)} the main graph holds there): {e}",
            e.min_budget + b.main_bytes) from None  # (the smallest the If itself needs)
    for n, why in b.pinned.items():
        if n in b.decision.choice.skipped:
            b.decision.choice.skipped[n] = why


def plan_branches(analysis: GraphAnalysis, decider: Decider, dims: Mapping[str, int], *,
                  shapes: Mapping[str, Sequence[int]] | None = None, contrib: Any = None
                  ) -> tuple[list[Branch], dict[str, str]]:
    """Analyse and decide every plannable If branch of ``analysis``' model (module
    docstring); (the branches, why each weight an unplanned subgraph reads stays). The
    main analysis then no longer counts the weights the branches offload."""
    main = analysis.model
    if not _has_options(decider):  # (a decider of its own: the main graph only)
        return [], {}
    # Loop/Scan bodies are planned under a budget only (without one, one reload before the
    # node, which serves every iteration, is all the explicit policy asks for).
    budgeted = getattr(getattr(decider, "options", None), "budget", None) is not None
    branches, refused = find_branches(analysis, dims, bodies=budgeted)
    if not branches:
        return branches, refused
    kept: dict[str, str] = {}  # pinned in the bodies only: the main graph may reload them
    for n, t in analysis.tensors.items():
        if t.is_initializer and t.is_graph_input and t.implicit_consumers:
            refused.setdefault(n, OVERRIDABLE_REASON)  # (a caller may feed it)
        elif t.is_initializer and t.consumers and t.implicit_consumers:  # (main reads it)
            if hoisted_readers(analysis, t):  # (only bodies: reloaded before them, if at all)
                kept[n] = "also read by the main graph, which reloads it before the body's " \
                          "node if at all (one reload per run)"
            else:
                refused.setdefault(n, "also read by the main graph, which keeps a weight a "
                                      "subgraph reads resident")
    sizes = {n: analysis.tensors[n].nbytes(dims) or 0
             for b in branches for n in b.weights}
    for b in list(branches):
        siblings = set().union(*(o.weights for o in branches if o.owner is b.owner))
        b.main_bytes = main_bytes_at(analysis, b, dims, siblings)
        b.unmodified = b.main_bytes + sum(sizes.get(n, 0) for n in siblings - b.weights)
        b.sizes = {n: sizes.get(n, 0) for n in b.weights}
        b.pinned = {n: why for n, why in (kept | refused).items() if n in b.outer}
        b.opsets = dict(main.opset_imports)
        install(b)
        try:
            _analyse(b, main, dims, shapes or {}, contrib)
        except UnboundDimError:
            raise
        except HoOnnxError as e:  # (its weights stay resident, as before branches were planned)
            branches.remove(b)
            # (a body's may still be reloaded before its node, unless a branch reads them)
            shared = set().union(*(o.weights for o in branches if o.owner is not b.owner))
            refused.update((n, f"read inside {b.label}, whose analysis failed: {e}")
                           for n in b.weights if not b.per_iteration or n in shared)
        finally:
            uninstall(b)
    if not branches:
        return branches, refused
    for b in branches:  # (what a later branch's failed analysis refused: resident here too)
        b.pinned.update((n, why) for n, why in refused.items() if n in b.outer)
    _agree(branches, decider, dims, sizes)
    for b in branches:
        b.held = b.main_bytes + _sibling_bytes(b, branches, sizes)
    offloaded = set.union(*(b.offloaded() for b in branches))
    for n in offloaded:  # outside the If they are not resident: the main plan skips them
        analysis.tensors[n].implicit_consumers = []
    return branches, refused


def _agree(branches: list[Branch], decider: Decider, dims: Mapping[str, int],
           sizes: Mapping[str, int]) -> None:
    """Decide every branch, then offload each weight one branch offloads in every branch
    that reads it (:func:`_force`: memory only falls there). A branch's budget is the
    budget less what the main graph holds at its If and the weights only its siblings read
    that stay resident (none assumed at first); a branch whose budget that lowers is
    planned again (at most :data:`_ROUNDS` times)."""
    total = getattr(getattr(decider, "options", None), "budget", None)
    for _ in range(_ROUNDS):
        again = False
        for b in branches:
            budget = None if total is None else total - b.main_bytes - (
                _sibling_bytes(b, branches, sizes) if b.decision is not None else 0)
            if b.decision is not None and not b.stale and (
                    budget is None or budget >= (b.budget or 0)):
                continue
            if budget is not None and budget <= 0:  # (found by the fuzzer: a ValueError)
                held = total - budget
                raise InfeasibleBudgetError(
                    f"{b.label}: the budget {format_bytes(total)} leaves nothing for it: the "
                    f"main graph holds {format_bytes(held)} at its {b.owner.op_type} (under "
                    "these dims)",
                    held + 1)
            again, b.stale = True, False
            b.budget = budget
            sub = b.decider = branch_decider(decider, budget, body=b.per_iteration)
            assert sub is not None  # (checked by plan_branches)
            install(b)
            try:
                _decide(b, sub, dims)
            finally:
                uninstall(b)
        if not again:
            return
        _force_shared(branches, dims)
    for b in branches:  # (rounds spent: what some branch must keep resident, none offloads)
        assert b.decision is not None
        c = b.decision.choice
        c.weights[:] = [w for w in c.weights if w.name not in b.pinned]
        c.skipped.update((n, why) for n, why in b.pinned.items() if n in b.weights)


def _force_shared(branches: list[Branch], dims: Mapping[str, int]) -> None:
    """Offload in every branch that reads it each weight some branch offloads; one that a
    branch cannot offload (a branch output, a CUDA host read, ...) is pinned resident in
    all, and the branches that offloaded it are planned again."""
    offloaded = set().union(*(b.offloaded() for b in branches))
    for b in branches:
        assert b.decision is not None
        missing = (offloaded & b.weights) - b.offloaded() - set(b.pinned)
        for n, why in (_force(b, sorted(missing), dims) if missing else {}).items():
            for o in branches:
                if n in o.weights:
                    o.pinned[n] = f"{why} (in {b.label})"
                    o.stale = o.stale or n in o.offloaded()


def _force(b: Branch, names: Sequence[str], dims: Mapping[str, int]) -> dict[str, str]:
    """Offload ``names`` in ``b`` too, each reload the explicit policy's distance before its
    reader (``b``'s plan kept them resident: its predicted peak only falls); those it cannot
    offload, with the reason."""
    from ..schedule.eligibility import WeightGroups, ineligible, placement_reasons
    from ..schedule.policy import _weight

    assert b.decision is not None
    a, c = b.analysis, b.decision.choice
    placement = placement_reasons(a)
    refused = {n: why for n in names
               if (why := ineligible(a.tensors[n]) or placement.get(n)) is not None}
    names = [n for n in names if n not in refused]
    opts = dataclasses.replace(getattr(b.decider, "options", None) or OffloadOptions(),
                               budget=None, host_budget=None, min_bytes=0)
    groups = WeightGroups.of(a)
    extra = OffloadChoice()
    for n in names:
        if n not in groups.primary_of:  # (a companion moves with its primary)
            _weight(a, a.tensors[n], opts, dims, extra, groups)
    groups.split(a, extra, dims)
    c.weights += extra.weights
    for w in extra.weights:
        c.skipped.pop(w.name, None)
    if extra.weights:
        c.notes.append(f"{len(extra.weights)} weights offloaded too since another branch "
                       "offloads them (every reader of an offloaded weight reloads it)")
    return refused


def report(branches: list[Branch], refused: Mapping[str, str], main: Decision) -> None:
    """Record in the main graph's choice where each weight a subgraph reads went: a note per
    planned branch, the reason of each that stayed resident (in place)."""
    c = main.choice
    offloaded = set().union(*(b.offloaded() for b in branches)) if branches else set()
    offloaded |= {w.name for w in c.weights}  # (the main graph's own: reloaded before a body)
    for n in offloaded:
        c.skipped.pop(n, None)
    if any(b.decision.choice.inputs or b.decision.choice.outputs for b in branches
           if b.decision is not None):  # a merged decoder's cache is in its past branch
        for notes in [c.notes] + [b.decision.choice.notes for b in branches if b.decision]:
            notes[:] = [n for n in notes if n != NO_KV_NOTE]
    for b in branches:
        assert b.decision is not None
        bc = b.decision.choice
        for n in b.weights - offloaded:
            why = b.pinned.get(n) or (  # (a pinned weight's reason names its branch)
                f"{bc.skipped.get(n, 'stays resident in the plan')} (in {b.label})")
            if n not in c.skipped or c.skipped[n].startswith("read by a subgraph"):
                c.skipped[n] = why
        c.notes.append(_branch_note(b))
    for n, why in refused.items():
        if n not in offloaded:  # (the main graph's own reload before a body stays)
            c.skipped[n] = why
    if refused:
        c.notes.append(f"{len(refused)} weights read inside subgraphs stay resident: nested "
                       "subgraphs are not planned, and a weight a Loop/Scan body reads is "
                       "reloaded before the Loop only where no If branch reads it too "
                       "(--json: each one's reason)")


def _branch_note(b: Branch) -> str:
    """What one branch's plan offloads, and its predicted peak against its budget."""
    assert b.decision is not None and b.model is not None
    c = b.decision.choice
    mine = b.offloaded()
    text = (f"{b.label} planned as a graph of its own ({len(b.analysis.nodes)} nodes): "
            f"offloading {len(c.weights)} weights ({_mib(sum(w.nbytes for w in c.weights))}"
            f", {len(mine)} of them main-graph initializers) and {len(c.activations)} "
            f"activations ({_mib(sum(a.nbytes or 0 for a in c.activations))})")
    d = b.decision
    if isinstance(d, Plan):
        text += (f"; peak {_mib(d.baseline.peak_bytes)} -> {_mib(d.planned.peak_bytes)} "
                 f"(its budget {_mib(d.budget)}: the budget less what the main graph"
                 + (" holds at the node)" if b.per_iteration else
                    " and the other branches' resident weights hold at the If)")
                 + ("" if d.fits else "; OVER its budget"))
    if b.per_iteration:
        text += ("; its cache ops run at every iteration, " + (
            f"{b.trips} per run (its time is theirs)" if b.trips is not None else
            "whose count the graph does not fix (its time is one iteration's)"))
    if len(c.notes):
        text += "; " + "; ".join(c.notes)
    return text


def insert_branches(branches: list[Branch], rewritten: RewrittenModel) -> int:
    """Insert each branch's cache ops into its graph (fresh names unique in every scope of
    the model), the offloaded main-graph initializers out of the main graph (once), their
    Prefetches added to ``rewritten``; the number of cache ops inserted."""
    main = rewritten.model.graph
    count = 0
    for b in branches:
        assert b.decision is not None and b.model is not None
        c = b.decision.choice
        if not (c.weights or c.activations):
            continue
        reserved = Names(main).used
        install(b)
        try:
            done = insert_cache_ops(b.analysis, c, reserved=reserved)
        finally:
            uninstall(b)
        if b.per_iteration:
            mark_per_iteration(b.graph)
        for name, v in done.weights.items():
            if name in b.weights:
                v = main.initializers.pop(name) if name in main.initializers \
                    else rewritten.weights[name]
            rewritten.weights[name] = v
            rewritten.weight_prefetches.setdefault(name, []).extend(
                done.weight_prefetches.get(name, []))
        count += done.cache_nodes
    if count and contract.DOMAIN not in rewritten.model.opset_imports:
        rewritten.model.opset_imports[contract.DOMAIN] = contract.OPSET_VERSION
    return count


def mark_per_iteration(graph: ir.Graph) -> None:
    """Attribute ``iteration`` = 1 on every cache op of the Loop/Scan body ``graph``: the
    library then keeps each one's records for one iteration (seen again, it starts the
    next iteration, not the next run, which would release the main graph's)."""
    for node in graph:
        if node.domain == contract.DOMAIN:
            node.attributes[contract.ATTR_ITERATION] = ir.AttrInt64(contract.ATTR_ITERATION, 1)


def if_peaks(branches: list[Branch]) -> dict[str, int]:
    """Predicted fast-tier peak of each If whose branches a budget planned: its larger
    branch's planned peak with what the main graph and the siblings hold there."""
    out: dict[str, int] = {}
    for b in branches:
        if isinstance(b.decision, Plan):
            name = b.owner.name or "<unnamed>"
            out[name] = max(out.get(name, 0), b.held + b.decision.planned.peak_bytes)
    return out


def fold(main: Plan, branches: list[Branch], refused: Mapping[str, str],
         analysis: GraphAnalysis) -> None:
    """The main plan's predictions with its If steps as they run: at each If, its larger
    branch's peak (and arena) with what the main graph and the siblings hold there, the
    unmodified model's too; the smallest budget (the main graph's without the resident
    weights a branch could offload, or a branch's with what the main graph holds); the
    slower branch's time added (in place)."""
    sizes = {n: v for b in branches for n, v in b.sizes.items()}
    gone = set().union(*(b.offloaded() for b in branches if b.decision is not None))
    gone |= {n for n in sizes  # (the main graph may reload those before a body: not counted)
             if n in analysis.tensors and hoisted_readers(analysis, analysis.tensors[n])}
    main.min_budget -= sum(v for n, v in sizes.items() if n not in gone and n not in refused)
    slowest: dict[ir.Node, tuple[float, float, float, float]] = {}
    for b in branches:
        d = b.decision
        if not isinstance(d, Plan):
            continue
        pos = analysis.nodes.index(b.owner)
        main.planned.memory[pos] = max(main.planned.memory[pos], b.held + d.planned.peak_bytes)
        main.baseline.memory[pos] = max(main.baseline.memory[pos],
                                        b.unmodified + d.baseline.peak_bytes)
        main.min_budget = max(main.min_budget, b.main_bytes + d.min_budget)
        main.arena_bytes = max(main.arena_bytes, b.held + d.arena_bytes)
        times = b.trips if b.per_iteration and b.trips is not None else 1
        old = slowest.get(b.owner, (0.0, 0.0, 0.0, 0.0))
        slowest[b.owner] = (max(old[0], times * d.baseline.total_s),
                            max(old[1], times * d.planned.total_s),
                            max(old[2], times * (d.bound.seconds if d.bound else 0.0)),
                            max(old[3], times * (d.greedy_s or d.planned.total_s)))
    for base, planned, bound, greedy in slowest.values():
        main.baseline.total_s += base
        main.planned.total_s += planned
        main.greedy_s += greedy  # (the node's time is its slower branch's in every plan)
        if main.bound is not None:  # (each branch's plan is at least its own bound)
            main.bound = dataclasses.replace(main.bound, seconds=main.bound.seconds + bound)
    main.host_bytes += _host_bytes(branches)


def _host_bytes(branches: list[Branch]) -> int:
    """What the branches' offloads add to the slow tier: each weight in host memory once,
    and the larger of the branches' stored activations."""
    weights = {w.name: w.nbytes for b in branches if b.decision is not None
               for w in b.decision.choice.weights if kinds.tier(w.tier).in_host_memory}
    stored = [stored_peak_bytes(b.decision.choice) for b in branches if b.decision is not None]
    return sum(weights.values()) + max(stored, default=0)


def metadata(branches: list[Branch]) -> dict[str, str]:
    """What the output records of the branches' plans (``ho_onnx.branch_*``)."""
    weights = [w for b in branches if b.decision is not None for w in b.decision.choice.weights]
    acts = [a for b in branches if b.decision is not None for a in b.decision.choice.activations]
    return {"branches_planned": ",".join(b.label for b in branches),
            "branch_offloaded_weights": str(len({w.name for w in weights})),
            "branch_offloaded_activations": str(len(acts)),
            "branch_offloaded_bytes": str(sum({w.name: w.nbytes for w in weights}.values())
                                          + sum(a.nbytes or 0 for a in acts)),
            **({"branch_predicted_peak_bytes": str(max(peaks.values()))}
               if (peaks := if_peaks(branches)) else {})}


class PlanBranchesPass(ir.passes.InPlacePass):
    """Plan every If branch of the main graph as a graph of its own (:func:`plan_branches`,
    ``meta[BRANCHES]``), before the main graph is decided; changes nothing in the graph."""

    def __init__(self, decider: Decider, dims: Mapping[str, int] | None = None, *,
                 shapes: Mapping[str, Sequence[int]] | None = None,
                 run: RunFacts | None = None) -> None:
        super().__init__()
        self.decider, self.dims, self.shapes = decider, dict(dims or {}), dict(shapes or {})
        # The target's facts, not a range plan's bottom: that is the main graph analysed
        # there, whose positions are not a branch's (a branch is timed at the top).
        self.run = RunFacts(run.target if run is not None else ORT)

    def requires(self, model: ir.Model) -> None:
        need(model, ANALYSIS, "AnalysePass")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        analysis: GraphAnalysis = model.meta[ANALYSIS]
        prepare = getattr(self.decider, "prepared", None)  # (optional in the protocol)
        decider = self.decider if prepare is None or not any(
            n.op_type in {"If", *HOISTED_OPS} for n in analysis.nodes) else prepare(self.run)
        model.meta[BRANCHES] = plan_branches(analysis, decider, self.dims,
                                             shapes=self.shapes, contrib=model.meta.get(CONTRIB))
        return ir.passes.PassResult(model, modified=False)


class ReportBranchesPass(ir.passes.InPlacePass):
    """Record the branches' plans in the main decision (:func:`report`)."""

    def requires(self, model: ir.Model) -> None:
        need(model, DECISION, "DecidePass")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        decision: Decision = model.meta[DECISION]
        branches, refused = model.meta.get(BRANCHES, ([], {}))
        if branches or refused:
            report(branches, refused, decision)
        decision.parts = [(b.label, b.decision, [n.name or n.op_type for n in b.analysis.nodes])
                          for b in branches if b.decision is not None]
        if isinstance(decision, Plan):
            fold(decision, branches, refused, model.meta[ANALYSIS])
        return ir.passes.PassResult(model, modified=False)


class InsertBranchesPass(ir.passes.InPlacePass):
    """Insert the branches' cache ops (:func:`insert_branches`) after the main graph's, and
    record what they offload in ``metadata_props``."""

    def requires(self, model: ir.Model) -> None:
        need(model, REWRITTEN, "InsertPass")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        rewritten: RewrittenModel = model.meta[REWRITTEN]
        branches, _ = model.meta.get(BRANCHES, ([], {}))
        n = insert_branches(branches, rewritten) if branches else 0
        rewritten.cache_nodes += n
        if branches:
            annotate(model, metadata(branches))
            if DECISION in model.meta:
                _count_weights(model.meta[DECISION].choice, branches)
        return ir.passes.PassResult(model, modified=n > 0)


def _count_weights(choice: OffloadChoice, branches: list[Branch]) -> None:
    """The weights the branches offloaded, once each, added to the main graph's ``choice``
    after its insertion (what the run reports and records: offloaded weights and bytes, the
    host store's bytes; their positions are their branch's)."""
    have = {w.name for w in choice.weights}
    for b in branches:
        assert b.decision is not None
        for w in b.decision.choice.weights:
            if w.name not in have:
                have.add(w.name)
                choice.weights.append(w)
