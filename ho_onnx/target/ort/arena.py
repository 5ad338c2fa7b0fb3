"""ORT's buffer reuse: the bytes ORT's arena holds per step, not the tensors' bytes.

ORT's sequential allocation planner (``onnxruntime/core/framework/allocation_planner.cc``)
gives a node's output the buffer of an earlier value instead of a new one when

* the kernel declares the output an alias of an input (``Reshape``, ``Squeeze``,
  ``Unsqueeze``, ``Flatten``, ``Identity``; ho-onnx's ``Wait`` of input 0 and ``Detach`` of
  input 1), or
* a buffer on its free list has the same element size and the same shape (dim by dim: equal
  values or the same symbolic name; scalars never); the free list is searched most recently
  freed first. The shapes are those ORT infers when it loads the model, with the dims
  symbolic (``GraphAnalysis.unbound_shape``: the keys :mod:`ho_onnx.schedule.arena` gives
  :func:`reuse_key`), not those at the dims bound for planning.

A reused buffer is released to the arena only after the last reader of the last value that
used it, so it stays allocated across the gap between two users: ORT's arena can hold more
than the live tensors (measured on an H100 with a 24-layer decoder at 2,048 tokens: a
constant ~0.5 GB of attention scores kept for the next layer, docs/benchmarks.md).
``MayInplace`` reuse (an elementwise op writing into an input at its last use) is not
modelled: it only lowers the count. What the allocator then holds for those buffers (its
rounding, the chunks it does not split, the regions it grows and keeps) is :func:`held`
(:mod:`.bfc`).

ORT also fuses nodes when it loads the model (:func:`fusions`, the ones that change which
buffers exist): a ``Transpose`` of the last two axes into the ``MatMul`` that reads it
(``MatmulTransposeFusion``: the MatMul reads the Transpose's input, and the Transpose is gone
when only MatMuls read it) and a MatMul's scale by a scalar constant (``MatMulScaleFusion``:
the product is gone). Found at stop 49: an attention's ``K^T`` replayed as a buffer of its
own let the replay share it with the scores, while ORT kept the present key alive to the
scores' FusedMatMul instead; the replay fell 3 MiB short on a 4-layer decoder at 4k
context. These rules are :data:`ORT`, the
:class:`~ho_onnx.target.base.Target` the deciders get; :mod:`ho_onnx.schedule.arena` says
which values a schedule has and replays them with it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from ...contract import DOMAIN
from ...graph.analyse import GraphAnalysis, TensorInfo, input_names, output_names
from ...graph.dtypes import ELEMENT_BITS
from ..base import ArenaValue, Fusions, Target, without_reuse
from . import bfc

# (domain, op_type) -> index of the input whose buffer output 0 takes.
ALIAS_INPUT: dict[tuple[str, str], int] = {
    ("", "Reshape"): 0, ("", "Squeeze"): 0, ("", "Unsqueeze"): 0, ("", "Flatten"): 0,
    ("", "Identity"): 0, (DOMAIN, "Wait"): 0, (DOMAIN, "Detach"): 1,
}


def alias_input(domain: str, op_type: str) -> int | None:
    """The input whose buffer output 0 of a ``domain`` ``op_type`` node takes (a view)."""
    return ALIAS_INPUT.get((domain, op_type))


def reuse_key(elem_type: int | None, shape: tuple | None) -> tuple | None:
    """Element size and shape: a freed buffer goes to a value with the same (never a
    scalar's, nor one of unknown type or dims)."""
    if elem_type not in ELEMENT_BITS or not shape or None in shape:
        return None
    return (ELEMENT_BITS[elem_type], tuple(shape))


@dataclass
class _Buffer:
    start: int
    end: int
    nbytes: int
    key: tuple | None
    users: int = 0  # values still to be read that use this buffer


def replay(values: Mapping[str, ArenaValue], steps: int) -> list[tuple[int, int, int]]:
    """``(start, end, bytes)`` of every buffer ORT's planner allocates for ``values``."""
    born: list[list[str]] = [[] for _ in range(steps)]
    dies: list[list[str]] = [[] for _ in range(steps)]
    for name, v in values.items():
        born[v.start].append(name)
        dies[v.end].append(name)
    owner: dict[str, _Buffer] = {}
    # ORT's free list, searched most recently freed first for the first same-key buffer:
    # per key, a stack whose top is the most recently freed.
    free: dict[tuple, list[_Buffer]] = {}
    buffers: list[_Buffer] = []
    for pos in range(steps):
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
    return [(b.start, b.end, b.nbytes) for b in buffers]


_ONNX = ("", "ai.onnx")
# MatMulScaleFusion's element types (CPU: float, double; CUDA adds the 16-bit floats).
_SCALED = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                     onnx.TensorProto.BFLOAT16})


def _fusable_transpose(analysis: GraphAnalysis, pos: int, other: str) -> bool:
    """Node ``pos`` is a Transpose ORT's MatmulTransposeFusion merges into a MatMul whose
    other input is ``other``: the input's last axis stays among the last two and the batch
    axes keep their order, contiguous (a transpose that moves axis 1 first needs ``other`` of
    the same rank)."""
    node = analysis.nodes[pos]
    perm = node.attributes.get("perm")
    if node.op_type != "Transpose" or node.domain not in _ONNX or perm is None:
        return False
    if _constant(analysis, input_names(node)[0]):
        return False  # ORT's constant folding makes it an initializer first
    p = list(perm.value)
    r = len(p)
    if r < 2 or r - 1 not in p[-2:]:
        return False
    if r >= 3 and (p[0] not in (0, 1) or any(p[i] + 1 != p[i + 1] for i in range(r - 3))):
        return False
    if r >= 3 and p[0] == 1:
        o = analysis.tensors.get(other)
        return o is not None and o.shape is not None and len(o.shape) == r
    return True


def _constant(analysis: GraphAnalysis, name: str) -> bool:
    """``name`` is an initializer or a Constant's output (ORT folds Constants into
    initializers when it loads a model)."""
    t = analysis.tensors.get(name)
    return t is not None and (t.is_initializer or (
        t.producer is not None and analysis.nodes[t.producer].op_type == "Constant"))


def _scalar_constant(analysis: GraphAnalysis, name: str) -> bool:
    """``name`` is a one-element constant (:func:`_constant`)."""
    t = analysis.tensors.get(name)
    if t is None or t.shape is None or any(not isinstance(d, int) for d in t.shape):
        return False
    if not _constant(analysis, name):
        return False
    n = 1
    for d in t.shape:
        n *= d
    return n == 1


def _scale_of(analysis: GraphAnalysis, product: str) -> int | None:
    """The position of the Mul/Div that scales the MatMul output ``product`` by a scalar
    constant and is its only reader (ORT's MatMulScaleFusion), else None."""
    t = analysis.tensors[product]
    if len(t.consumers) != 1 or t.is_graph_output or t.elem_type not in _SCALED:
        return None
    c = t.consumers[0]
    node = analysis.nodes[c]
    ins = input_names(node)
    if node.domain not in _ONNX or len(ins) != 2:
        return None
    if node.op_type == "Mul":
        other = ins[1] if ins[0] == product else ins[0]
    elif node.op_type == "Div" and ins[0] == product:
        other = ins[1]
    else:
        return None
    return c if other != product and _scalar_constant(analysis, other) else None


def fusions(analysis: GraphAnalysis) -> Fusions:
    """The values ORT's MatMul fusions remove, and the later reads they make (module
    docstring): a fused MatMul runs where its scale ran, reading the transposes' inputs."""
    gone: set[str] = set()
    later: dict[int, int] = {}
    for pos, node in enumerate(analysis.nodes):
        if node.op_type != "MatMul" or node.domain not in _ONNX or not node.outputs:
            continue
        product = output_names(node)[0]
        at = pos
        if product in analysis.tensors and (scale := _scale_of(analysis, product)) is not None:
            gone.add(product)
            at = later[pos] = scale
        ins = input_names(node)[:2]
        pairs = zip(ins, ins[::-1], strict=True) if len(set(ins)) == 2 else ()  # (no MatMul(t, t))
        for i, other in pairs:
            t = analysis.tensors.get(i)
            if t is None or t.producer is None or t.is_graph_output \
                    or not _fusable_transpose(analysis, t.producer, other):
                continue
            if all(analysis.nodes[c].op_type == "MatMul" for c in t.consumers):
                gone.add(i)
            later[t.producer] = max(later.get(t.producer, at), at)
    return Fusions(frozenset(gone), later, _folded(analysis))


def _outputs_by_node(analysis: GraphAnalysis) -> dict[int, list[TensorInfo]]:
    """Each node position's output values (the analysis' own: a rewritten model's renamed
    outputs are not followed)."""
    outputs: dict[int, list[TensorInfo]] = {}
    for t in analysis.tensors.values():
        if t.producer is not None:
            outputs.setdefault(t.producer, []).append(t)
    return outputs


# Ops ORT's constant folding leaves alone: random ones, and the quantization pair it keeps
# for QDQ fusions.
_UNFOLDED = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                       "Multinomial", "Bernoulli", "QuantizeLinear", "DequantizeLinear"})


def _folded(analysis: GraphAnalysis) -> frozenset[str]:
    """The values ORT's ConstantFolding computes when it loads the model (initializers from
    then on, not its arena's): the outputs of a default-domain node without subgraphs whose
    outputs are no graph output and whose inputs are all constants (initializers,
    ``Constant``s, values folded before it), and of a ``Shape``/``Size`` of a value whose
    shape is fixed at every binding. Found at stop 54: a fixed-shape decoder's causal mask
    (``Shape`` of the ids through ``ConstantOfShape``, ``Trilu`` and a ``Mul``: three
    4 MiB values at 1,024 tokens) replayed as activations, 8 MiB over ORT's regions."""
    outputs = _outputs_by_node(analysis)
    folded: set[str] = set()
    for pos, node in enumerate(analysis.nodes):
        outs = outputs.get(pos, [])
        if node.domain not in _ONNX or node.op_type in _UNFOLDED or not outs \
                or any(t.is_graph_output for t in outs) or _has_subgraph(node):
            continue
        ins = [i for i in input_names(node) if i]
        if node.op_type in ("Shape", "Size"):
            shape = analysis.unbound_shape(ins[0]) if ins else None
            ok = shape is not None and all(isinstance(d, int) for d in shape)
        else:
            ok = bool(ins) and all(i in folded or _constant(analysis, i) for i in ins)
        if ok:
            folded.update(t.name for t in outs)
    return frozenset(folded)


def _has_subgraph(node) -> bool:
    return any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
               for a in node.attributes.values())


def shapeless(analysis: GraphAnalysis, opaque: Collection[int],
              declared: Mapping[str, Collection[int]]) -> frozenset[str]:
    """The values ORT knows no shape of once ``opaque`` nodes are the library's ops whose
    output declares none: ORT infers no shape for a custom op's output (the library gives
    no inference function), and ONNX's inference gives none to an output whose node reads a
    value of unknown shape, but for a ``Reshape`` to a constant shape of positive dims.
    ``declared``: value -> the readers that read it through a cache op's output instead,
    which declares its shape. Such values never take a freed buffer, nor give theirs
    (:func:`reuse_key` of no shape): found at stop 54, an embedding read by ``GatherRows``
    left every activation of a fixed-shape decoder without a shape for ORT, whose arena then
    reused only the weights' reload buffers; keyed by the shapes of the model as planned,
    the replay held 1.4-2x ORT's chunks in use (6.8 vs 4.3 MiB)."""
    outputs = _outputs_by_node(analysis)
    dark: set[str] = set()
    reads_dark: set[int] = set(opaque)
    for pos, node in enumerate(analysis.nodes):
        if pos not in reads_dark or _reshaped_to_constant(analysis, node):
            continue
        for t in outputs.get(pos, ()):
            out = t.name
            dark.add(out)
            skip = declared.get(out, ())
            reads_dark.update(c for c in (*t.consumers, *t.implicit_consumers) if c not in skip)
    return frozenset(dark)


def _reshaped_to_constant(analysis: GraphAnalysis, node) -> bool:
    """``node`` is a ``Reshape`` to a constant shape of positive dims: ONNX's inference
    gives its output that shape whether or not it knows the input's."""
    ins = input_names(node)
    if node.op_type != "Reshape" or node.domain not in _ONNX or len(ins) < 2:
        return False
    v = analysis.values.get(ins[1])
    value = v.const_value if v is not None else None
    if value is None and v is not None and v.producer() is not None \
            and v.producer().op_type == "Constant":
        attr = v.producer().attributes.get("value")
        value = attr.value if attr is not None else None
    if value is None:
        return False
    try:
        dims = np.asarray(value.numpy()).ravel()
    except (OSError, ValueError, TypeError):  # (bytes stripped or elsewhere: unknown)
        return False
    return dims.size > 0 and bool((dims > 0).all())


def grows_as_requested(analysis: GraphAnalysis) -> bool:
    """Every graph input of ``analysis``'s model has a fixed shape: ho-onnx's sessions give
    it an arena grown by what is requested (``runtime.arena_for``, ``cuda_arena_options``)."""
    inputs = [t for t in analysis.tensors.values() if t.is_graph_input and not t.is_initializer]
    return all((s := analysis.unbound_shape(t.name)) is not None
               and all(isinstance(d, int) for d in s) for t in inputs)


def held(analysis: GraphAnalysis, buffers: list[tuple[int, int, int]], steps: int
         ) -> np.ndarray:
    """Bytes ORT's arena holds at each step for ``buffers``: its BFC arena replayed
    (:mod:`.bfc`) run after run, its regions counted, not only the chunks in use, as
    ho-onnx's sessions set it up (``runtime.arena_for``): for a model whose inputs all have
    fixed shapes grown by what is requested (every run asks for the same sizes), else ORT's
    own, grown by powers of two, counted up to the last request each region served (the
    pages a CPU process touches of the regions it maps)."""
    if grows_as_requested(analysis):
        return bfc.held(buffers, steps, "as_requested")
    return bfc.held(buffers, steps, "power_of_two", touched=True)


ORT = Target("onnxruntime", alias_input, reuse_key, replay, fusions, held, shapeless)
# ORT with its buffer reuse off (``SessionOptions.enable_mem_reuse = False``).
ORT_NO_REUSE = without_reuse(ORT)
