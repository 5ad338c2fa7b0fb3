"""The experts of a mixture-of-experts model, found by the graph's structure (never by names,
never reading weight bytes: sizes come from shapes).

Two forms are recognised:

* **Routed MatMuls** (Hugging Face exports: torch.onnx, Optimum). A *router* is a TopK over
  the last axis of a weight MatMul/Gemm's output (the logits, E wide; a bias Add, Cast,
  Reshape may sit between), with a Softmax before the TopK or on its values. Relative to one
  router, a value is *routed* when it descends from the TopK and from no weight MatMul that
  is not an ancestor of the router (the routing weights, the expert masks, the tokens
  gathered for an expert, a stacked weight gathered by the selected indices). A weight MatMul
  belongs to the layer's experts when it reads a routed value (an expert's first projections,
  or one reading gathered expert weights), or when its output reaches, through no other
  weight MatMul, a node that reads a routed value (the down projection scaled by its routing
  weight or scattered back to its tokens); the weight MatMuls feeding such a down projection
  through no other weight MatMul join it (the gate and up projections of experts computed on
  every token). Those MatMuls, joined when they share an activation or one feeds the other,
  are the experts: E groups of the same weight shapes (the loop unrolled), or groups whose
  weights are all stacked with E slices on axis 0 (one expert a slice). Anything else is not
  an MoE layer: a Softmax+TopK whose readers are not E experts (sampling over logits), a
  single MLP, a shared expert (it reads no routed value).
* **ORT's contrib ops** (``com.microsoft`` ``MoE``/``QMoE``): the router probabilities are an
  input, ``k`` an attribute, each initializer input with E slices on axis 0 an expert
  weight (fc1/fc2/fc3 weights, their biases and scales).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import onnx_ir as ir

from .analyse import GraphAnalysis, attribute_values, input_names, output_names

_WEIGHT_MATMULS = {"MatMul", "Gemm", "MatMulNBits", "FusedMatMul", "MatMulInteger"}
_WEIGHT_PATH = {"Transpose", "Cast", "Identity", "Reshape", "Squeeze", "Unsqueeze",
                "DequantizeLinear", "Gather", "Slice", "Flatten"}
_FIRST_INPUT_ONLY = {"Reshape", "Gather", "Slice", "Squeeze", "Unsqueeze"}
_ROUTER_PATH = {"Softmax", "Cast", "Identity", "Reshape", "Flatten", "Add"}
_CONTRIB = {"MoE", "QMoE"}
_REACH = 64  # nodes a forward or backward walk between two weight MatMuls visits at most


@dataclass(frozen=True)
class Expert:
    """One expert: its weights (initializer names) and their bytes. When its layer is
    ``stacked``, each name is a tensor of all the layer's experts and this expert is slice
    ``index`` on axis 0 of each (``nbytes`` is its share)."""

    index: int
    weights: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class MoELayer:
    """One mixture-of-experts layer."""

    form: str  # "unrolled" (one initializer per projection and expert), "stacked", "contrib"
    node: str  # the router's TopK, or the MoE/QMoE node
    router_logits: str  # the value the routing is computed from (the contrib op's input 1)
    top_k: int | None  # None: not a constant
    experts: tuple[Expert, ...]

    @property
    def stacked(self) -> bool:
        return self.form != "unrolled"

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.experts)

    @property
    def per_token_bytes(self) -> int | None:
        """The bytes of ``top_k`` experts of average size: what one token's routing reads."""
        if self.top_k is None or not self.experts:
            return None
        return self.top_k * self.nbytes // len(self.experts)

    def as_dict(self) -> dict[str, Any]:
        return {"form": self.form, "node": self.node, "router_logits": self.router_logits,
                "top_k": self.top_k, "num_experts": len(self.experts),
                "bytes": self.nbytes, "per_token_bytes": self.per_token_bytes,
                "experts": [{"index": e.index, "weights": list(e.weights), "bytes": e.nbytes}
                            for e in self.experts]}


def find_experts(a: GraphAnalysis) -> tuple[MoELayer, ...]:
    """The MoE layers of ``a``'s main graph, in schedule order (empty: none)."""
    layers = []
    for pos, node in enumerate(a.nodes):
        if node.op_type in _CONTRIB and node.domain == "com.microsoft":
            layer = _contrib_layer(a, node)
        elif node.op_type == "TopK":
            layer = _routed_layer(a, pos)
        else:
            continue
        if layer is not None:
            layers.append(layer)
    return tuple(layers)


def _shape(a: GraphAnalysis, name: str) -> tuple[Any, ...] | None:
    t = a.tensors.get(name)
    return None if t is None else t.shape


def _bytes(a: GraphAnalysis, name: str) -> int:
    return a.tensors[name].nbytes() or 0


def _name(node: ir.Node) -> str:
    return node.name or node.op_type


def _contrib_layer(a: GraphAnalysis, node: ir.Node) -> MoELayer | None:
    ins = input_names(node)
    w1 = _shape(a, ins[2]) if len(ins) > 2 and ins[2] else None
    if not w1 or not isinstance(w1[0], int) or len(ins) < 2 or not ins[1]:
        return None
    e = w1[0]
    stacked = [n for n in ins[2:] if n and a.tensors[n].is_initializer
               and (_shape(a, n) or (None,))[0] == e]
    share = sum(_bytes(a, n) for n in stacked) // e
    k = attribute_values(node).get("k", 1)
    return MoELayer("contrib", _name(node), ins[1], k if isinstance(k, int) else None,
                    tuple(Expert(i, tuple(stacked), share) for i in range(e)))


def _producer(a: GraphAnalysis, name: str) -> ir.Node | None:
    t = a.tensors.get(name)
    return None if t is None or t.producer is None else a.nodes[t.producer]


def _weight_sources(a: GraphAnalysis, name: str) -> list[tuple[str, bool]] | None:
    """The initializers ``name`` is computed from by weight-only ops (transposes, casts,
    slices of a stacked tensor, dequantization), each with whether it was indexed (Gather or
    Slice); None when it depends on anything else (an activation)."""
    t = a.tensors.get(name)
    if t is None:
        return None
    if t.is_initializer:
        return [(name, False)]
    node = _producer(a, name)
    if node is None or node.op_type not in _WEIGHT_PATH:
        return None
    ins = input_names(node)
    follow = ins[:1] if node.op_type in _FIRST_INPUT_ONLY else [n for n in ins if n]
    out: list[tuple[str, bool]] = []
    for n in follow:
        got = _weight_sources(a, n)
        if got is None:
            return None
        out += [(w, idx or node.op_type in ("Gather", "Slice")) for w, idx in got]
    return out


def _weight_matmul(a: GraphAnalysis, node: ir.Node) -> tuple[list[str], list[tuple[str, bool]]]:
    """(activation inputs, weight sources) of a MatMul-like node; no weights: not one."""
    if node.op_type not in _WEIGHT_MATMULS:
        return [], []
    acts, weights = [], []
    for n in input_names(node)[:2]:
        w = _weight_sources(a, n) if n else None
        if w is None:
            acts.append(n)
        else:
            weights += w
    return (acts, weights) if acts else ([], [])


def _constant_int(a: GraphAnalysis, name: str) -> int | None:
    v = a.values.get(name)
    node = _producer(a, name)
    if node is not None and node.op_type == "Constant":
        value = attribute_values(node).get("value")
    else:
        value = v.const_value if v is not None and a.tensors[name].is_initializer else None
    if value is None or value.size != 1:
        return None
    return int(value.numpy().reshape(-1)[0])


def _router(a: GraphAnalysis, pos: int) -> tuple[str, int, int | None] | None:
    """(logits, experts, k) when the TopK at ``pos`` routes: over the last axis of a weight
    MatMul's output, a Softmax before it or on its values."""
    topk = a.nodes[pos]
    ins, outs = input_names(topk), output_names(topk)
    k = _constant_int(a, ins[1]) if len(ins) > 1 and ins[1] else None
    shape = _shape(a, ins[0])
    axis = attribute_values(topk).get("axis", -1)
    if not shape or axis not in (-1, len(shape) - 1) or not isinstance(shape[-1], int):
        return None
    softmax, name = False, ins[0]
    node = _producer(a, name)
    while node is not None and node.op_type in _ROUTER_PATH:
        softmax |= node.op_type == "Softmax"
        name = next((n for n in input_names(node) if n and _weight_sources(a, n) is None), "")
        node = _producer(a, name)
    if node is None or not _weight_matmul(a, node)[1]:
        return None
    logits = output_names(node)[0]
    softmax |= any(a.nodes[c].op_type == "Softmax" for c in _readers(a, outs[0], {"Cast"}))
    e = shape[-1]
    if not softmax or e < 2 or (k is not None and not 0 < k < e):
        return None
    return logits, e, k


@dataclass(frozen=True)
class RouterSource:
    """How a routed layer's router computes its logits: ``MatMul(activation, weight)``, plus
    ``bias`` (an initializer added on the way to the TopK) when there is one; ``position``
    and ``topk``: the MatMul's and the TopK's schedule positions. What a speculation needs
    to apply the router to an earlier hidden state (:mod:`ho_onnx.schedule.speculate`)."""

    position: int
    activation: str
    weight: str
    bias: str | None
    topk: int  # the layer's TopK's position


def router_source(a: GraphAnalysis, layer: MoELayer) -> RouterSource | str:
    """``layer``'s :class:`RouterSource`, or why there is none that can be applied elsewhere:
    the logits must come from a MatMul of an activation by an initializer [hidden, E], and
    the way to the TopK may only keep the ranking (Softmax, Cast, Reshape, Identity, Flatten)
    or add an initializer (the router's bias)."""
    if layer.form != "unrolled" and layer.form != "stacked":
        return "the router probabilities are an input of ORT's MoE op"
    t = a.tensors.get(layer.router_logits)
    if t is None or t.producer is None:
        return "its router logits have no producer"
    mm = a.nodes[t.producer]
    ins = input_names(mm)
    if mm.op_type != "MatMul" or len(ins) != 2 or not ins[0] or not ins[1] \
            or not a.tensors[ins[1]].is_initializer or a.tensors[ins[0]].is_initializer:
        return f"its router is a {mm.op_type}, not a MatMul of an activation by an initializer"
    shape = _shape(a, ins[1])
    if not shape or len(shape) != 2 or shape[1] != len(layer.experts):
        return "its router weight is not [hidden, experts]"
    bias = None
    topk = next((p for p, n in enumerate(a.nodes) if _name(n) == layer.node), None)
    if topk is None:
        return "its TopK is gone"
    if attribute_values(a.nodes[topk]).get("largest", 1) != 1:
        return "its TopK picks the smallest"
    name = input_names(a.nodes[topk])[0]
    while name != layer.router_logits:
        node = _producer(a, name)
        if node is None or node.op_type not in _ROUTER_PATH:
            return "the way from its router to the TopK is not a plain ranking"
        nins = [n for n in input_names(node) if n]
        if node.op_type == "Add":
            consts = [n for n in nins if a.tensors[n].is_initializer]
            if len(consts) != 1 or len(nins) != 2 or bias is not None:
                return "its router adds more than one bias"
            bias = consts[0]
            name = next(n for n in nins if n != bias)
        elif node.op_type == "Reshape" or node.op_type == "Flatten":
            name = nins[0]
        else:
            axis = attribute_values(node).get("axis", -1)
            if len(nins) != 1 or (node.op_type == "Softmax" and axis != -1
                                  and axis != len(_shape(a, nins[0]) or ()) - 1):
                return f"its router's {node.op_type} does not keep the ranking of each row"
            name = nins[0]
    return RouterSource(t.producer, ins[0], ins[1], bias, topk)


def _readers(a: GraphAnalysis, name: str, through: set[str]) -> Iterator[int]:
    """Positions of the readers of ``name``, looking through the ops in ``through``."""
    for c in a.tensors[name].consumers:
        yield c
        if a.nodes[c].op_type in through:
            for out in output_names(a.nodes[c]):
                yield from _readers(a, out, through)


def _ancestors(a: GraphAnalysis, pos: int) -> set[int]:
    seen: set[int] = set()
    todo = [pos]
    while todo:
        for n in input_names(a.nodes[todo.pop()]):
            p = a.tensors[n].producer if n in a.tensors else None
            if p is not None and p not in seen:
                seen.add(p)
                todo.append(p)
    return seen


def _routed(a: GraphAnalysis, pos: int, matmuls: dict[int, Any]) -> set[str]:
    """The values routed by the TopK at ``pos`` (module docstring): descendants of it, of no
    weight MatMul that is not its ancestor."""
    before = _ancestors(a, pos)
    tainted: set[str] = set()
    routed = set(output_names(a.nodes[pos]))
    for p, node in enumerate(a.nodes):
        if p == pos:
            continue
        ins = input_names(node)
        taint = (p in matmuls and p not in before) or any(n in tainted for n in ins)
        outs = [n for n in output_names(node) if n]
        if taint:
            tainted.update(outs)
        elif p > pos and any(n in routed for n in ins):
            routed.update(outs)
    return routed


def _walk(a: GraphAnalysis, start: Iterable[int], step: Any, matmuls: dict[int, Any]
          ) -> Iterator[int]:
    """Positions reached from ``start`` by ``step`` (position -> next positions), stopping at
    weight MatMuls (yielded, not passed), at most _REACH nodes."""
    seen: set[int] = set()
    todo = list(start)
    while todo and len(seen) < _REACH:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        yield p
        if p not in matmuls:
            todo.extend(step(p))


def _experts_of(a: GraphAnalysis, pos: int, matmuls: dict[int, Any]) -> list[set[int]]:
    """The weight MatMuls of the TopK at ``pos``'s experts, grouped (module docstring)."""
    routed = _routed(a, pos, matmuls)
    before = _ancestors(a, pos)
    fwd = lambda p: [c for n in output_names(a.nodes[p]) for c in a.tensors[n].consumers]  # noqa: E731
    back = lambda p: [q for n in matmuls.get(p, (input_names(a.nodes[p]), []))[0]  # noqa: E731
                      if n in a.tensors and (q := a.tensors[n].producer) is not None]
    parent = {p: p for p in matmuls if p not in before and p != pos}

    def find(p: int) -> int:
        while parent[p] != p:
            p = parent[p]
        return p

    chosen: set[int] = set()
    for p in parent:
        if any(n in routed for n in input_names(a.nodes[p])):
            chosen.add(p)
        elif any(any(n in routed for n in input_names(a.nodes[q]))
                 for q in _walk(a, fwd(p), fwd, matmuls) if q not in matmuls):
            chosen.add(p)
            for q in _walk(a, back(p), back, matmuls):
                if q in parent:
                    chosen.add(q)
                    parent[find(q)] = find(p)
    groups: dict[int, set[int]] = {}
    for p in chosen:
        groups.setdefault(find(p), set()).add(p)
    return list(groups.values())


def _routed_layer(a: GraphAnalysis, pos: int) -> MoELayer | None:
    router = _router(a, pos)
    if router is None:
        return None
    logits, e, k = router
    matmuls = a.derived.get("moe_matmuls")
    if matmuls is None:
        matmuls = a.derived["moe_matmuls"] = {
            p: mm for p, node in enumerate(a.nodes) if (mm := _weight_matmul(a, node))[1]}
    groups = sorted(_experts_of(a, pos, matmuls), key=min)
    weights = [sorted({w for p in g for w in matmuls[p][1]}) for g in groups]
    names = [[w for w, _ in ws] for ws in weights]
    stacked = bool(weights) and all(
        idx and (_shape(a, w) or (None,))[0] == e for ws in weights for w, idx in ws)
    if stacked:
        tensors = sorted({w for ns in names for w in ns})
        share = sum(_bytes(a, w) for w in tensors) // e
        experts = tuple(Expert(i, tuple(tensors), share) for i in range(e))
        form = "stacked"
    else:
        shapes = {tuple(sorted(str(_shape(a, w)) for w in ns)) for ns in names}
        if len(groups) != e or len(shapes) != 1:
            return None
        experts = tuple(Expert(i, tuple(ns), sum(_bytes(a, w) for w in ns))
                        for i, ns in enumerate(names))
        form = "unrolled"
    return MoELayer(form, _name(a.nodes[pos]), logits, k, experts)


# Ops whose output is empty when their first input is (the element count is kept or split).
_EMPTY_FOLLOWS_FIRST = {"Reshape", "Squeeze", "Unsqueeze", "Cast", "Identity", "Transpose",
                        "Flatten", "Softmax", "Sigmoid", "Relu", "Tanh", "Neg", "Abs", "Exp",
                        "Erf", "Gelu", "Split", "Mul", "Add", "Sub", "Div"}


def empty_gate(a: GraphAnalysis, reader: int, host: Iterable[str] = ()) -> str | None:
    """A routed value that is empty whenever the weight MatMul at ``reader`` multiplies an
    empty activation (no token was routed to its expert), so that its transfer may be
    skipped: the walk goes back from the activation through ops that keep emptiness (a
    Gather through its indices) to the NonZero that selects the expert's tokens; the gate is
    the earliest value on that path not in ``host`` (values in host memory on the CUDA EP,
    never an input of a cache op there). None: no such path (an expert computed on every
    token)."""
    acts, _ = _weight_matmul(a, a.nodes[reader])
    if not acts:
        return None
    chain, name = [acts[0]], acts[0]
    for _ in range(_REACH):
        node = _producer(a, name)
        if node is None:
            return None
        if node.op_type == "NonZero":
            break
        ins = input_names(node)
        computed = [n for n in ins if n and (p := _producer(a, n)) is not None
                    and p.op_type != "Constant"]
        if node.op_type == "Gather" and len(ins) > 1 and ins[1] in computed:
            name = ins[1]  # tokens gathered by routed indices: empty with them
        elif node.op_type == "Gather" and ins[0] in computed:
            name = ins[0]  # a constant row of routed indices: empty with them
        elif node.op_type in _EMPTY_FOLLOWS_FIRST or _weight_matmul(a, node)[0]:
            # (elementwise: an empty operand makes the broadcast empty; follow one that is
            # computed, not a constant)
            nxt = _weight_matmul(a, node)[0][:1] or computed[:1]
            if not nxt:
                return None
            name = nxt[0]
        else:
            return None
        chain.append(name)
    else:
        return None
    skip = set(host)
    return next((n for n in reversed(chain) if n not in skip), None)


def gate_column(a: GraphAnalysis, gate: str) -> int | None:
    """The router column (expert id) whose tokens the NonZero ``gate`` selects: the constant a
    Gather (a row of the routing mask) or an Equal (the TopK indices against it) reads on the
    way back from the NonZero's input through casts and reshapes; None when not found."""
    node = _producer(a, gate)
    if node is None or node.op_type != "NonZero":
        return None
    name = input_names(node)[0]
    for _ in range(8):
        node = _producer(a, name)
        if node is None:
            return None
        ins = input_names(node)
        if node.op_type in ("Gather", "Equal") and len(ins) > 1:
            return _constant_int(a, ins[1])
        if node.op_type not in ("Cast", "Squeeze", "Unsqueeze", "Reshape", "Identity"):
            return None
        name = ins[0]
    return None
