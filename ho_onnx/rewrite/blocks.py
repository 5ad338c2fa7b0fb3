"""A large weight read whole by one MatMul/Gemm streamed in column blocks (issue 38, item 3).

``MatMul(x, W[K, N])`` becomes ``Concat(MatMul(x, W_0), ..., MatMul(x, W_k-1), axis=-1)``:
each ``W_i`` (a range of the ``N`` output columns) is a weight of its own, which the planner
offloads and reloads like any other, so only a block or two (the one computed, the next one
arriving) need the fast tier at once and the floor can fall below the whole weight. The
forms found (:func:`find_sites`):

* ``matmul``: ``MatMul(x, W[K, N])``: column blocks, not contiguous in ``W``'s bytes: each
  block is a lazy slice, read when the rewritten model's data is written (never when
  planning);
* ``matmul_t``: ``MatMul(x, Transpose(W[N, K]))`` (torch's ``Linear``, a tied lm_head):
  row blocks of ``W``, contiguous: each block is a byte range of ``W``'s own data file
  (nothing is copied), transposed before its MatMul;
* ``gemm`` / ``gemm_t``: ``Gemm(A, W, C)`` with ``transB`` 0 or 1 (a ``C`` along ``N`` is
  sliced per block).

``W``'s other readers may only gather its rows (an embedding table tied to the lm_head:
those become ``GatherRows`` when the table is offloaded) or read its shape. MLAS sums each
output column alone, so the blocks give the same bits as the whole product.

The decision (:func:`choose_blocks`) is the planner's: the plan without blocks, then one per
block count of a ladder (2, 4, 8, ...); the fastest plan that meets the budget wins (blocks
cost a copy latency and a node each), and where none meets it the block count with the
smallest floor is applied, so the floor the planner then reports is one it meets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from ..graph.analyse import GraphAnalysis
from ..graph.dtypes import ELEMENT_BITS
from ..schedule.eligibility import (
    Routed,
    ineligible,
    placement_reasons,
    row_readers,
    split_shape_readers,
)
from ..schedule.options import OffloadOptions
from ..schedule.planner import InfeasibleBudgetError, Plan
from ..schedule.types import Decider, WeightSplit
from ..units import format_bytes
from .insert import Names

#: A weight over this share of the budget is tried in blocks (when the plan without blocks
#: offloads it, or fails).
SPLIT_SHARE = 0.25

COLUMNS_REASON = ("its blocks are columns, written with the model's data (ho_onnx.optimize), "
                  "not by a pass that writes none")

Reanalyse = Callable[[ir.Model], GraphAnalysis]


@dataclass(frozen=True)
class Site:
    """A weight read whole by one MatMul/Gemm (module docstring), with its form."""

    weight: str
    reader: int  # position of the MatMul/Gemm
    transpose: int | None  # position of the Transpose between (form ``matmul_t``)
    form: str  # matmul | matmul_t | gemm | gemm_t
    columns: int  # N, the product's last dim
    nbytes: int
    slice_bias: bool = False  # a Gemm's C is N wide: sliced per block

    @property
    def rows(self) -> bool:
        """Whether a block is a range of ``W``'s rows (contiguous bytes)."""
        return self.form in ("matmul_t", "gemm_t")


def _only_reader(analysis: GraphAnalysis, name: str) -> int | None:
    t = analysis.tensors[name]
    return t.consumers[0] if len(t.consumers) == 1 and not t.is_graph_output else None


def _form(analysis: GraphAnalysis, name: str, r: int) -> tuple[str, int, int | None] | str:
    """(form, reader, transpose) of ``name`` read by the node at ``r``, or why not."""
    node = analysis.nodes[r]
    ins = [v.name if v is not None else "" for v in node.inputs]
    if node.domain in ("", "ai.onnx") and node.op_type == "Transpose" and ins == [name]:
        perm = node.attributes.get("perm")
        out = node.outputs[0].name or ""
        m = _only_reader(analysis, out)
        if (perm is None or list(perm.value) == [1, 0]) and m is not None:
            mm = analysis.nodes[m]
            if mm.op_type == "MatMul" and mm.domain in ("", "ai.onnx") \
                    and [v.name if v else "" for v in mm.inputs][1:] == [out] \
                    and mm.inputs[0] is not None and mm.inputs[0].name != out:
                return "matmul_t", m, r
        return f"its transpose is not read by one MatMul alone (node {node.name!r})"
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm") \
            or len(ins) < 2 or ins[1] != name or name in (ins[0], *ins[2:]):
        return (f"read whole by {node.op_type} {node.name!r}: only the weight (B) of a "
                "MatMul/Gemm is streamed in blocks")
    if node.op_type == "MatMul":
        return "matmul", r, None
    trans = node.attributes.get("transB")
    return ("gemm_t" if trans is not None and trans.value else "gemm"), r, None


def _gemm_bias(analysis: GraphAnalysis, form: str, reader: int, columns: int) -> bool | None:
    """Whether a Gemm's ``C`` is sliced per block (N wide), shared (absent, a scalar, last
    dim 1), or None: neither."""
    node = analysis.nodes[reader]
    if form not in ("gemm", "gemm_t") or len(node.inputs) < 3 or node.inputs[2] is None:
        return False
    shape = analysis.tensors[node.inputs[2].name or ""].shape
    if shape is None or (shape and shape[-1] not in (1, columns)):
        return None
    return bool(shape) and shape[-1] == columns != 1


def _why_not(analysis: GraphAnalysis, name: str, tier: str, dims: Mapping[str, int],
             placement: Mapping[str, str]) -> tuple[str, int, int | None] | str:
    """(form, reader, transpose) of the weight ``name``, or why it cannot be split
    (``placement``: :func:`placement_reasons`)."""
    t = analysis.tensors[name]
    if not t.shape or len(t.shape) != 2 or not all(isinstance(d, int) for d in t.shape):
        return "not a 2-D weight of known shape"
    if ELEMENT_BITS.get(t.elem_type or 0, 0) < 8:
        return "elements narrower than a byte"
    reason = ineligible(t) or placement.get(name)
    if reason:
        return reason
    if name in Routed.of(analysis, dims).fraction:
        return "an MoE expert (moved by its router)"
    data, shape = split_shape_readers(analysis, t)
    if shape:
        return "its shape is read (Shape/Size)"
    rows = row_readers(analysis, t, tier)
    whole = [c for c in data if c not in rows]
    if len(whole) != 1:
        return f"read whole by {len(whole)} nodes: blocks need one MatMul/Gemm reader"
    return _form(analysis, name, whole[0])


def find_sites(analysis: GraphAnalysis, tier: str, dims: Mapping[str, int], min_bytes: int
               ) -> tuple[list[Site], dict[str, str]]:
    """Weights of at least ``min_bytes`` that can be streamed in blocks, and why each other
    one cannot (``tier``: where offloaded weights wait, for the row readers)."""
    sites: list[Site] = []
    declined: dict[str, str] = {}
    if analysis.model.opset_imports.get("", 1) < 11:  # (Concat on axis -1)
        return sites, declined
    placement = placement_reasons(analysis)
    for name, t in analysis.tensors.items():
        if not t.is_initializer or (nbytes := t.nbytes(dims) or 0) < max(min_bytes, 1):
            continue
        found = _why_not(analysis, name, tier, dims, placement)
        if isinstance(found, str):
            declined[name] = found
            continue
        form, reader, transpose = found
        columns = int(t.shape[0 if form in ("matmul_t", "gemm_t") else 1])
        bias = _gemm_bias(analysis, form, reader, columns)
        if bias is None:
            declined[name] = "its Gemm's C is neither broadcast along N nor N wide"
        else:
            sites.append(Site(name, reader, transpose, form, columns, nbytes, bias))
    return sites, declined


def bounds(n: int, k: int) -> list[tuple[int, int]]:
    """``k`` ranges covering ``0..n``, the first ``n % k`` one longer."""
    q, r = divmod(n, k)
    out, a = [], 0
    for i in range(k):
        b = a + q + (1 if i < r else 0)
        out.append((a, b))
        a = b
    return out


def _block_tensor(w: ir.Value, rows: bool, a: int, b: int, name: str) -> ir.TensorProtocol:
    """Rows (or columns) ``a:b`` of ``w``'s value: a byte range of its data file where the
    rows of an external tensor are asked, else a lazy slice (read only when written)."""
    t = w.const_value
    assert t is not None
    r, c = (int(d) for d in t.shape)
    shape = ir.Shape([b - a, c] if rows else [r, b - a])
    if rows and isinstance(t, ir.ExternalTensor):
        row = c * ELEMENT_BITS[int(t.dtype)] // 8
        return ir.ExternalTensor(t.location, (t.offset or 0) + a * row, (b - a) * row, t.dtype,
                                 shape=shape, name=name, base_dir=t.base_dir)

    def cut() -> ir.TensorProtocol:
        arr = t.numpy()
        return ir.Tensor(np.ascontiguousarray(arr[a:b] if rows else arr[:, a:b]), name=name)

    return ir.LazyTensor(cut, t.dtype, shape, name=name)


def _int64s(graph: ir.Graph, names: Names, base: str, value: int) -> ir.Value:
    """A new int64[1] initializer holding ``value``."""
    name = names.fresh(base)
    v = ir.Value(name=name, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([1]),
                 const_value=ir.Tensor(np.array([value], np.int64), name=name))
    graph.register_initializer(v)
    return v


def _block_nodes(graph: ir.Graph, names: Names, site: Site, node: ir.Node, w: ir.Value,
                 a: int, b: int, i: int) -> tuple[list[ir.Node], ir.Value]:
    """The nodes computing columns ``a:b`` of ``node``'s product (block ``i``), and the
    block's weight (a new initializer)."""
    wname = names.fresh(f"{site.weight}.ho_block{i}")
    value = _block_tensor(w, site.rows, a, b, wname)
    wi = ir.Value(name=wname, type=w.type, shape=ir.Shape(list(value.shape)),
                  const_value=value)
    graph.register_initializer(wi)
    base = f"{node.name or node.op_type}.ho_block{i}"
    x = node.inputs[0]
    out: list[ir.Node] = []
    if site.form == "matmul_t":
        out.append(ir.Node("", "Transpose", [wi], [ir.AttrInt64s("perm", [1, 0])],
                           num_outputs=1, name=names.fresh(f"{base}.t")))
        out.append(ir.Node("", "MatMul", [x, out[-1].outputs[0]], num_outputs=1,
                           name=names.fresh(base)))
    elif site.form == "matmul":
        out.append(ir.Node("", "MatMul", [x, wi], num_outputs=1, name=names.fresh(base)))
    else:
        c = node.inputs[2] if len(node.inputs) > 2 else None
        if c is not None and site.slice_bias:
            out.append(ir.Node("", "Slice", [c, _int64s(graph, names, f"{base}.start", a),
                                             _int64s(graph, names, f"{base}.end", b),
                                             _int64s(graph, names, f"{base}.axis", -1)],
                               num_outputs=1, name=names.fresh(f"{base}.c")))
            c = out[-1].outputs[0]
        out.append(ir.Node("", "Gemm", [x, wi, *([c] if c is not None else [])],
                           list(node.attributes.values()), num_outputs=1,
                           name=names.fresh(base)))
    for n in out:
        n.outputs[0].name = names.fresh(f"{n.name}.out")
    return out, wi


def split_site(graph: ir.Graph, nodes: list[ir.Node], site: Site, k: int, names: Names
               ) -> tuple[str, ...]:
    """Rewrite ``site`` (positions into ``nodes``, the graph's nodes when it was analysed)
    of ``graph`` in place into ``k`` blocks and a Concat that produces the reader's own
    output value; the names of the blocks' weights."""
    node = nodes[site.reader]
    w = graph.initializers[site.weight]
    parts: list[ir.Node] = []
    blocks: list[str] = []
    for i, (a, b) in enumerate(bounds(site.columns, k)):
        more, wi = _block_nodes(graph, names, site, node, w, a, b, i)
        parts += more
        blocks.append(wi.name or "")
    concat = ir.Node("", "Concat", [n.outputs[0] for n in parts
                                    if n.op_type in ("MatMul", "Gemm")],
                     [ir.AttrInt64("axis", -1)], num_outputs=1, name=node.name)
    old = node.outputs[0]
    ir.convenience.replace_all_uses_with(old, concat.outputs[0], replace_graph_outputs=True)
    graph.insert_before(node, [*parts, concat])
    graph.remove(node, safe=True)
    if site.transpose is not None:
        graph.remove(nodes[site.transpose], safe=True)
    new, name = concat.outputs[0], old.name
    old.name = None
    new.name, new.type, new.shape = name, old.type, old.shape
    if not w.uses():  # (a tied table keeps its row readers)
        graph.initializers.pop(site.weight)
    return tuple(blocks)


def block_counts(sites: list[Site], k: int) -> dict[str, int]:
    """Blocks of each site when the largest is cut in ``k``: blocks of about one size (at
    most a site's columns; a site under one block's size stays whole, count 1)."""
    size = max((s.nbytes for s in sites), default=0) / max(k, 1)
    return {s.weight: max(1, min(s.columns, k, round(s.nbytes / size))) for s in sites}


def apply_blocks(model: ir.Model, sites: list[Site], k: int) -> dict[str, tuple[str, ...]]:
    """Split the sites of ``model`` (in place; its graph as analysed, positions unchanged)
    into :func:`block_counts` blocks; the blocks' weight names by weight (those split)."""
    nodes, names = list(model.graph), Names(model.graph)
    counts = block_counts(sites, k)
    return {s.weight: split_site(model.graph, nodes, s, counts[s.weight], names)
            for s in sites if counts[s.weight] > 1}


@dataclass(frozen=True)
class _Trial:
    """The plan of one block count (0: every weight whole), or why none meets the budget."""

    k: int
    plan: Plan | None
    error: InfeasibleBudgetError | None = None

    def key(self) -> tuple[bool, float]:
        """Rank of a plan that meets the budget: ORT's arena within it first, then time."""
        assert self.plan is not None
        return not self.plan.arena_fits, self.plan.planned.total_s

    def text(self) -> str:
        if self.plan is not None:
            return f"{self.plan.planned.total_s * 1e3:.3f} ms"
        assert self.error is not None
        return f"floor {format_bytes(self.error.min_budget)}"


def _try(planner: Decider, analysis: GraphAnalysis, dims: Mapping[str, int],
         k: int) -> _Trial | None:
    """The plan with ``k`` blocks (0: whole), or the floor it misses; None when the decider
    makes no predicted plan (a decider of its own: its decision is not a :class:`Plan`)."""
    try:
        d = planner.decide(analysis, dims)
    except InfeasibleBudgetError as e:
        return _Trial(k, None, e)
    return _Trial(k, d) if isinstance(d, Plan) else None


def ladder(sites: list[Site], max_blocks: int) -> list[int]:
    """The block counts tried: 2, 4, 8, ... up to ``max_blocks`` and the widest site's N."""
    cap = min(max_blocks, max((s.columns for s in sites), default=1))
    out, k = [], 2
    while k < cap:
        out.append(k)
        k *= 2
    return out + ([cap] if cap >= 2 else [])


def _tried_sites(analysis: GraphAnalysis, planner: Decider, base: _Trial,
                 sites: list[Site]) -> list[Site]:
    """Sites worth blocks: every one where the plan without blocks fails, else those over
    :data:`SPLIT_SHARE` of the budget that it offloads, or that it keeps resident when ORT's
    arena does not fit the budget (a large resident weight in blocks can leave it room:
    found on the 2.75 GB decoder at 15 %, its 250 MiB lm_head kept whole and the arena
    111 MiB over)."""
    if base.plan is None:
        return sites
    budget = getattr(planner, "options").budget or 0  # noqa: B009 (checked by choose_blocks)
    moved = {w.name for w in base.plan.choice.weights if w.consumers}
    return [s for s in sites if (s.weight in moved or not base.plan.arena_fits)
            and s.nbytes > SPLIT_SHARE * budget]


def _best(base: _Trial, trials: list[_Trial]) -> _Trial:
    """The fastest plan that meets the budget, else the block count with the lowest floor
    (whole wins ties: blocks cost nodes and copy latencies)."""
    met = [t for t in (base, *trials) if t.plan is not None]
    if met:
        return min(met, key=_Trial.key)
    return min((base, *trials), key=lambda t: t.error.min_budget if t.error else 0)


def choose_blocks(analysis: GraphAnalysis, planner: Decider, dims: Mapping[str, int],
                  reanalyse: Reanalyse, columns: bool = True
                  ) -> tuple[GraphAnalysis | None, list[WeightSplit]]:
    """Stream weights in blocks where the planner predicts it pays (module docstring): the
    model is split in place and analysed again (the new analysis; None when nothing was
    split), and what was split or kept whole, with why (``columns``: False keeps the forms
    whose blocks are no byte range of the weight's file whole). ``planner``: a decider with
    budgeted ``OffloadOptions`` whose decisions are predicted :class:`Plan` s (the budget
    planner); any other gets no blocks."""
    opts = getattr(planner, "options", None)  # (a Decider declares none)
    if not isinstance(opts, OffloadOptions) or not opts.weights or opts.max_blocks < 2 \
            or opts.budget is None:
        return None, []
    sites, declined = find_sites(analysis, opts.weight_tier, dims, opts.min_bytes_or_default)
    if not columns:
        declined |= {s.weight: COLUMNS_REASON for s in sites if not s.rows}
        sites = [s for s in sites if s.rows]
    if dataclasses.is_dataclass(planner):  # the trials unrefined: only the final plan is
        planner = dataclasses.replace(  # type: ignore[type-var]
            planner, options=dataclasses.replace(opts, refine_s=0.0, exact_s=0.0))
    base = _try(planner, analysis, dims, 0)
    if base is None or (base.plan is not None and not base.plan.choice.weights):
        return None, []  # (no weight moves: nothing to say)
    tried = _tried_sites(analysis, planner, base, sites)
    said = _declines(analysis, dims, declined, base, [s for s in sites if s not in tried])
    if not tried:
        return None, said
    trials: list[_Trial] = []
    for k in ladder(tried, opts.max_blocks):
        work = analysis.model.clone()
        apply_blocks(work, tried, k)
        t = _try(planner, reanalyse(work), dims, k)
        assert t is not None  # (the same decider made a Plan of the whole)
        trials.append(t)
        met = [x for x in trials if x.plan is not None]
        if t.plan is not None and len(met) > 1 and met[-2].key() < t.key():
            break  # (more blocks, slower: past the best count)
    best = _best(base, trials)
    others = "; ".join(f"{t.k or 'whole'}: {t.text()}" for t in (base, *trials) if t is not best)
    if best.k == 0:
        why = f"kept whole: predicted {best.text()} (against {others})"
        return None, [WeightSplit(s.weight, s.nbytes, (), why) for s in tried] + said
    blocks = apply_blocks(analysis.model, tried, best.k)
    why = f"the largest in {best.k} blocks: predicted {best.text()} (against {others})"
    return reanalyse(analysis.model), [WeightSplit(
        s.weight, s.nbytes, blocks.get(s.weight, ()), why if s.weight in blocks else
        "kept whole: under one block's size", s.rows) for s in tried] + said


def _declines(analysis: GraphAnalysis, dims: Mapping[str, int], declined: Mapping[str, str],
              base: _Trial, sites: list[Site]) -> list[WeightSplit]:
    """Why the weights over :data:`SPLIT_SHARE` of the budget (all, where the plan without
    blocks fails) stay whole that were not tried: not of a form blocks fit (``declined``), or
    ``sites`` kept resident by the plan without blocks (or under the share)."""
    share = SPLIT_SHARE * base.plan.budget if base.plan is not None else 0
    size = {n: analysis.tensors[n].nbytes(dims) or 0 for n in declined}
    out = [WeightSplit(n, size[n], (), f"kept whole: {why}") for n, why in declined.items()
           if size[n] > share]
    moved = {w.name for w in base.plan.choice.weights if w.consumers} if base.plan else set()
    return out + [WeightSplit(s.weight, s.nbytes, (), "kept whole: " + (
        "the plan without blocks keeps it resident" if s.weight not in moved else
        f"under {SPLIT_SHARE:.0%} of the budget")) for s in sites if s.nbytes > share]
