"""Binding symbolic dims: ``--dim NAME=N``, whole input shapes ``--shape x=1,3,48,320``, and
one error naming every dim a command still needs.

Dims are names (``batch``) or arithmetic expressions of names (``past_sequence_length +
sequence_length``, ``2*seq``), evaluated by :func:`eval_dim`. A dim
without a name (``?`` in the viewer, no ``dim_param``), or whose name is no expression
(``?``, ``p2o.DynamicDimension.0``, ``batch-size``), cannot be given with ``--dim``: the
input's whole shape is given instead, as ``trtexec --shapes`` does.
"""

from __future__ import annotations

import ast
import difflib
import itertools
import numbers
import operator
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import cast

import numpy as np
import onnx_ir as ir

from ..errors import PastTableError, UnboundDimError
from ..units import INT64_MAX

Dim = int | str | None


def parse_shapes(items: Iterable[str]) -> dict[str, list[int]]:
    """``('x=1,3,48,320', 'ids=1x8')`` → ``{'x': [1, 3, 48, 320], 'ids': [1, 8]}``.

    The name is everything before the last ``=`` (input names may hold odd characters);
    dims are separated by ``,`` or ``x``. Raises ValueError with a one-line message.
    """
    shapes: dict[str, list[int]] = {}
    for item in items:
        name, sep, spec = item.rpartition("=")
        parts = [p.strip() for p in spec.replace("x", ",").split(",")] if sep else []
        # (ASCII digits only: str.isdigit() takes '²', which int() refuses)
        if not name or not parts or not all(re.fullmatch(r"[0-9]+", p) for p in parts):
            raise ValueError(f"{item!r}: expected INPUT=D0,D1,... with integer dims, "
                             "e.g. x=1,3,48,320")
        shape = [int(p) for p in parts]
        if any(d > INT64_MAX for d in shape):
            raise ValueError(f"{item!r}: a dim is past int64")
        if shapes.get(name, shape) != shape:
            raise ValueError(f"{name!r} given twice, as {shapes[name]} and {shape}")
        shapes[name] = shape
    return shapes


# Exporters' dim expressions are short (``past_sequence_length + sequence_length``,
# ``((s0 + 1)//2)``); a model's longer ones are taken as no expression, so their parse and
# evaluation never run out of stack (measured: ``b*b*...*b`` of 3,000 factors was
# an unexpected RecursionError in the parser).
MAX_DIM_EXPRESSION = 500


def parse_dim(dim: str) -> ast.Expression | None:
    """``dim`` parsed as a Python expression, or None when it is none (a syntax error, a
    null byte, longer than :data:`MAX_DIM_EXPRESSION` characters)."""
    if len(dim) > MAX_DIM_EXPRESSION:
        return None
    try:
        return ast.parse(dim, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


_DIM_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
            ast.FloorDiv: operator.floordiv, ast.Div: operator.floordiv, ast.Mod: operator.mod}


def eval_dim(dim: str, dims: Mapping[str, int], tensor: str = "?") -> int:
    """Value of a symbolic dim: a bound name, or an arithmetic expression of bound names
    (exporters write dims such as ``seq + 1`` or ``2*batch``).

    Raises :class:`UnboundDimError` naming the first name without a value.
    """
    if dim in dims:
        return int(dims[dim])
    tree = parse_dim(dim)

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in dims:
                raise UnboundDimError(
                    f"tensor {tensor!r} has symbolic dimension {node.id!r}"
                    + (f" (in {dim!r})" if node.id != dim else "")
                    + f" with no value: pass {dim_hint(node.id)}"
                )
            return int(dims[node.id])
        if isinstance(node, ast.BinOp) and type(node.op) in _DIM_OPS:
            return _DIM_OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(dim)

    if tree is not None:
        try:
            return ev(tree)
        except (ValueError, ZeroDivisionError, RecursionError):
            pass
    if tree is None and len(dim) > MAX_DIM_EXPRESSION:
        raise UnboundDimError(
            f"tensor {tensor!r} has symbolic dimension {dim_text(dim)!r} with no value, too "
            f"long to be an expression of names (over {MAX_DIM_EXPRESSION} characters): pass "
            "the whole shapes of the inputs that have it with --shape")
    raise UnboundDimError(
        f"tensor {tensor!r} has symbolic dimension {dim!r} with no value: pass {dim_hint(dim)}"
    )


def dim_text(dim: str, limit: int = 60) -> str:
    """``dim`` for a message: itself, or its start and its length when it is long."""
    return dim if len(dim) <= limit else f"{dim[:limit]}... ({len(dim)} characters)"


def shape_text(shape: Sequence[int | str | None], limit: int = 8) -> str:
    """``[a, 4, b*2]`` for a message; a long shape's first ``limit`` dims and its rank."""
    shown = ", ".join("?" if d is None else dim_text(str(d)) for d in shape[:limit])
    return (f"[{shown}]" if len(shape) <= limit
            else f"[{shown}, ...] ({len(shape)} dims)")


def free_names(dim: str) -> list[str] | None:
    """Names an expression dim uses, in order (None when ``dim`` is no expression)."""
    tree = parse_dim(dim)
    if tree is None:
        return None
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if node.id not in names:
                names.append(node.id)
        elif not isinstance(node, ast.Expression | ast.BinOp | ast.Constant | ast.operator
                            | ast.Load | ast.UnaryOp | ast.unaryop):
            return None
    return names


def _dims_of(v: ir.Value) -> list[Dim] | None:
    """The declared dims of tensor value ``v`` (None: not a tensor, or no shape)."""
    if not isinstance(v.type, ir.TensorType) or v.shape is None:
        return None
    return [d if isinstance(d, int) else d.value for d in v.shape]


def declared_dims(model: ir.Model, *, everywhere: bool = True) -> list[str]:
    """Every dim name the model declares, each once: what a ``--dim`` can bind. The inputs
    and outputs of the main graph, and with ``everywhere`` those of every subgraph and
    every node output whose shape the model declares (its value_info)."""
    out: dict[str, None] = {}
    for g in model.graphs() if everywhere else (model.graph,):
        values: Iterable[ir.Value] = (*g.inputs, *g.outputs)
        if everywhere:
            values = itertools.chain(values, (v for n in g for v in n.outputs))
        for v in values:
            out.update((d, None) for d in _dims_of(v) or () if isinstance(d, str))
    return list(out)


def unused_in_model(model: ir.Model, dims: Mapping[str, int],
                    dim_exprs: Iterable[str] = ()) -> tuple[list[str], list[str]]:
    """``(unused, used)``: names of ``dims`` that no dim of the model uses (nor one of
    ``dim_exprs``), and the names the model's dims use. The main graph's inputs and outputs
    are looked at first; the whole model only when a name is not found there."""
    exprs = [*dim_exprs, *declared_dims(model, everywhere=False)]
    unused = unused_dims(exprs, dims)
    if unused:  # (rare: a misspelt name, or one the main graph's signature does not show)
        exprs += declared_dims(model)
        unused = unused_dims(exprs, dims)
    return unused, list(dict.fromkeys(n for d in exprs for n in free_names(d) or ()))


def graph_inputs(model: ir.Model) -> list[ir.Value]:
    """Graph inputs that are not initializers (what a caller feeds)."""
    inits = model.graph.initializers
    return [v for v in model.graph.inputs if v.name not in inits]


def check_bindings(dims: Mapping[str, int] | None,
                   shapes: Mapping[str, Sequence[int]] | None = None) -> None:
    """Raise :class:`UnboundDimError` unless every value of ``dims`` and every dim of
    ``shapes`` is a size: an integer from 0 to int64's largest (found by hand: a library
    caller's ``batch=-1`` planned without a word, ``2**64``, ``True`` or ``1.5`` were
    unexpected errors from protobuf; the command line's parsers check their own)."""
    items = [(f"dim {k!r}", v) for k, v in (dims or {}).items()]
    items += [(f"shape of {k!r}", d) for k, shape in (shapes or {}).items() for d in shape]
    for what, v in items:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not (
                0 <= v <= INT64_MAX):  # (numpy's integers are Integral)
            raise UnboundDimError(f"{what}: {v!r} is not a size (an integer from 0 to "
                                  f"{INT64_MAX})")


def dims_from_shapes(model: ir.Model, shapes: Mapping[str, list[int]],
                     dims: Mapping[str, int] | None = None) -> dict[str, int]:
    """``dims`` plus every plain dim name a whole input shape binds (``--shape ids=1,8`` on
    ``ids[batch, seq]`` binds ``batch=1, seq=8``).

    Raises :class:`UnboundDimError` for an unknown input, a rank or fixed-dim mismatch, or a
    name bound to two values.
    """
    check_bindings(dims, shapes)
    out = dict(dims or {})
    by_name = {str(v.name): v for v in graph_inputs(model)}
    for name, shape in shapes.items():
        if name not in by_name:
            raise UnboundDimError(f"--shape {name}=...: the model has no input {name!r} "
                                  f"(inputs: {', '.join(sorted(by_name)) or 'none'})")
        declared = _dims_of(by_name[name])
        if declared is None:
            continue
        if len(declared) != len(shape):
            raise UnboundDimError(f"--shape {name}: input {name!r} has rank {len(declared)}, "
                                  f"got {len(shape)} dims")
        for d, v in zip(declared, shape, strict=True):
            if isinstance(d, int) and d != v:
                raise UnboundDimError(f"--shape {name}: dim {d} of input {name!r} is fixed, "
                                      f"got {v}")
            if isinstance(d, str) and d.isidentifier():
                if d in out and out[d] != v:
                    raise UnboundDimError(f"dim {d!r} is {out[d]} but --shape {name} "
                                          f"makes it {v}")
                out[d] = v
    return out


def missing_dims(dim_exprs: Iterable[str], dims: Mapping[str, int]
                 ) -> tuple[list[str], list[str]]:
    """``(names, odd)``: names the expressions need that ``dims`` lacks, and dims that are
    no expression of names (only a whole shape can give them), each in first-seen order."""
    names: list[str] = []
    odd: list[str] = []
    for dim in dim_exprs:
        if dim in dims:
            continue
        free = free_names(dim)
        if free is None:
            if dim not in odd:
                odd.append(dim)
            continue
        names.extend(n for n in free if n not in dims and n not in names)
    return names, odd


def unused_dims(dim_exprs: Iterable[str], dims: Mapping[str, int]) -> list[str]:
    """Names bound in ``dims`` that none of ``dim_exprs`` uses: a misspelt ``--dim``, or one
    meant for another model (found by hand: ``--dim btach=4`` was ignored without a word)."""
    used: set[str] = set()
    for dim in dim_exprs:
        used.add(dim)  # (a dim that is no expression is bound by its whole text)
        names = free_names(dim)  # (no expression: every word in it counts as used)
        used.update(names if names is not None else re.findall(r"[A-Za-z_]\w*", dim))
    return [name for name in dims if name not in used]


def unused_note(unused: Sequence[str], known: Iterable[str], where: str = "the model") -> str:
    """``--dim btach names no dim of the model (did you mean 'batch'?)``, one clause per
    name of ``unused``; ``known``: the names the model does use (the suggestions)."""
    known = sorted(set(known))
    parts = []
    for name in unused:
        close = difflib.get_close_matches(name, known, n=1)
        parts.append(f"--dim {dim_text(name)} names no dim of {where}"
                     + (f" (did you mean {close[0]!r}?)" if close else ""))
    return "; ".join(parts)


def require_dims(dim_exprs: Iterable[str], dims: Mapping[str, int], *,
                 model: ir.Model | None = None) -> None:
    """Raise one :class:`UnboundDimError` naming every name ``dim_exprs`` need that ``dims``
    lacks (dims that are no expression are left to the caller: unknown sizes), and every
    name of ``dims`` that neither they nor ``model``'s declared dims use: likely the
    misspelling of a missing one."""
    exprs = list(dim_exprs)
    names, _ = missing_dims(exprs, dims)
    if names:
        unused = (unused_in_model(model, dims, exprs)[0] if model is not None
                  else unused_dims(exprs, dims))
        raise unbound_error(names, unused=unused)


def is_mask_input(name: str) -> bool:
    """Inputs that test data must fill with ones (an attention mask of zeros and random
    integers makes GroupQueryAttention's sequence lengths out of range)."""
    return name.lower().endswith("attention_mask")


def dim_hint(name: str) -> str:
    """How to give dim ``name`` a value (found by hand: for a dim named ``N`` the hint was
    "pass --dim N=N")."""
    return f"--dim {name}=<value>"


def unbound_error(names: list[str], odd_inputs: Mapping[str, list[Dim]] | None = None, *,
                  unused: Sequence[str] = (), where: str = "the model") -> UnboundDimError:
    """One error naming every missing dim and every input that needs a whole shape, and
    the given dims that name nothing in ``where`` (each with the missing name it is
    closest to)."""
    parts = []
    if names:
        parts.append("symbolic dimensions without a value: " + ", ".join(map(repr, names))
                     + " (pass " + " ".join(map(dim_hint, names)) + ")")
    for inp, shape in (odd_inputs or {}).items():
        spec = ",".join("?" if d is None else dim_text(str(d)) for d in shape)
        parts.append(f"input {inp!r} [{spec}] has dims --dim cannot name: pass its whole "
                     f"shape, --shape {inp}=" + ",".join(
                         str(d) if isinstance(d, int) else "N" for d in shape))
    if unused:
        parts.append(unused_note(unused, names, where))
    return UnboundDimError("; ".join(parts))


def input_shapes(model: ir.Model, dims: Mapping[str, int] | None = None,
                 shapes: Mapping[str, list[int]] | None = None, *,
                 unnamed: int | None = None) -> dict[str, list[int]]:
    """Concrete shape of every input a caller feeds: whole shapes from ``shapes``, symbolic
    dims evaluated from ``dims`` (expressions too), dims without a name ``unnamed`` (when
    given).

    Raises one :class:`UnboundDimError` naming every dim name that has no value and every
    input whose dims only a whole shape can give (no name, or a name that is no expression).
    """
    shapes = dict(shapes or {})
    dims = dims_from_shapes(model, shapes, dims)
    out: dict[str, list[int]] = {}
    exprs: list[str] = []
    odd: dict[str, list[Dim]] = {}
    named: list[str] = []  # every input's dim names (what a --dim can be meant for)
    for vi in graph_inputs(model):
        declared = _dims_of(vi)
        named.extend(d for d in declared or () if isinstance(d, str))
        if vi.name in shapes:
            out[vi.name] = list(shapes[vi.name])
            continue
        if declared is None:
            continue  # not a tensor, or unknown rank: callers decide
        for d in declared:
            if d is None and unnamed is not None:
                continue
            if d is None or (isinstance(d, str) and d not in dims and free_names(d) is None):
                odd[vi.name] = declared
            elif isinstance(d, str):
                exprs.append(d)
    names, _ = missing_dims(exprs, dims)
    if names or odd:
        raise unbound_error(names, odd, unused=unused_dims(named, dims),
                            where="the model's inputs")
    for vi in graph_inputs(model):
        declared = _dims_of(vi)
        if vi.name in out or declared is None:
            continue
        out[vi.name] = [d if isinstance(d, int) else unnamed if d is None else
                        eval_dim(d, dims, vi.name) for d in declared]  # type: ignore[misc]
    return out


# A shape range: ``--dim seq=1..2048``; the plan holds for every value in it.
DimRanges = Mapping[str, tuple[int, int]]


def bind_ranges(dims: Mapping[str, int], ranges: DimRanges | None) -> dict[str, int]:
    """``dims`` with each ranged dim bound to the top of its range: sizes grow with the dims,
    so the plan's memory is the range's worst case. Raises :class:`UnboundDimError` for a
    range that is none (``lo > hi``, a negative or non-integer end) or a dim given both as a
    point and as a range with another top."""
    out = dict(dims)
    for name, r in (ranges or {}).items():
        if not isinstance(name, str) or not name or "\n" in name:
            raise UnboundDimError(f"range of dim {name!r}: not a dim name")
        if (not isinstance(r, tuple | list) or len(r) != 2
                or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool)
                           for x in r)):
            raise UnboundDimError(f"range of dim {name!r}: expected two integers (lo, hi), "
                                  f"got {r!r}")
        lo, hi = int(r[0]), int(r[1])
        if not 0 <= lo <= hi <= INT64_MAX:
            raise UnboundDimError(f"range of dim {name!r}: {lo}..{hi} is not a range of sizes "
                                  "(0 <= LO <= HI)")
        if name in out and out[name] != hi:
            raise UnboundDimError(f"dim {name!r} given as {out[name]} and as the range "
                                  f"{lo}..{hi}: give one (the plan is made at the range's top)")
        out[name] = hi
    return out


DimPoints = Mapping[str, Mapping[str, int]]


def bind_points(points: DimPoints | None, ranges: DimRanges | None
                ) -> dict[str, dict[str, int]]:
    """The named points of a range plan (TensorRT's optimization profiles: ``{"decode":
    {"seq": 1, "past": 4095}}``), each with every ranged dim bound: those it names within
    their ranges, the others at the bottom. Raises :class:`UnboundDimError` for a point
    without ranges, a dim no range names, a value outside its range, or a bad name."""
    out: dict[str, dict[str, int]] = {}
    if points and not ranges:
        raise UnboundDimError("named points are points of ranges: give the ranges they lie in "
                              "(--dim NAME=LO..HI)")
    for name, point in (points or {}).items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", name):
            raise UnboundDimError(f"point {name!r}: a name is letters, digits, '_', '.', '-'")
        if not isinstance(point, Mapping):
            raise UnboundDimError(f"point {name!r}: expected dim values, got {point!r}")
        bound = {k: lo for k, (lo, _) in (ranges or {}).items()}
        for dim, v in point.items():
            if dim not in bound:
                raise UnboundDimError(
                    f"point {name!r}: {dim!r} has no range (ranged: "
                    f"{', '.join(sorted(bound))}); a point sets ranged dims only")
            lo, hi = (ranges or {})[dim]
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or not lo <= v <= hi:
                raise UnboundDimError(f"point {name!r}: {dim}={v!r} is outside its range "
                                      f"{lo}..{hi}")
            bound[dim] = int(v)
        out[name] = bound
    return out


def ranged_inputs(model: ir.Model, ranges: DimRanges
                  ) -> dict[str, list[tuple[int, str]]]:
    """Graph input name -> ``(axis, dim name)`` of each of its dims that a range names: what
    the library checks at every run (``ai.hyperoffload`` ``Guard``). Raises
    :class:`UnboundDimError` naming a range that no graph input of a fixed-size type has as
    one of its own dims (an expression such as ``past + seq`` is checked through its names)."""
    out: dict[str, list[tuple[int, str]]] = {}
    seen: set[str] = set()
    for vi in graph_inputs(model):
        if not isinstance(vi.type, ir.TensorType) or vi.dtype in (ir.DataType.STRING,
                                                                   ir.DataType.UNDEFINED):
            continue
        for axis, d in enumerate(_dims_of(vi) or ()):
            if isinstance(d, str) and d in ranges:
                out.setdefault(vi.name, []).append((axis, d))
                seen.add(d)
    missing = [n for n in ranges if n not in seen]
    if missing:
        names = sorted({d for vi in graph_inputs(model) for d in _dims_of(vi) or ()
                        if isinstance(d, str)})
        raise UnboundDimError(
            f"range of {', '.join(map(repr, missing))}: no graph input has "
            f"{'this dim' if len(missing) == 1 else 'these dims'} (a range is checked at every "
            f"run on the inputs; their dims: {', '.join(names) or 'none named'})")
    return out


def context_named_as_new_tokens(model: ir.Model, ranges: DimRanges) -> list[str]:
    """Warnings for a ranged dim that names both the new tokens (``input_ids``' last axis)
    and an ``attention_mask``'s length in a model with a KV cache (graph inputs named
    ``past...``): at run time the mask covers past + new tokens, so a range sized for the new
    tokens alone is left at the first decode step past it (an Optimum merged export names
    them alike). None where the range reaches past the past's own range."""
    dims = {vi.name: _dims_of(vi) or () for vi in graph_inputs(model)}
    ids, mask = dims.get("input_ids", ()), dims.get("attention_mask", ())
    if not ids or not mask or not any(n.startswith("past") for n in dims):
        return []
    d = ids[-1]
    if not isinstance(d, str) or mask[-1] != d or d not in ranges:
        return []
    lo, hi = ranges[d]
    past = max((ranges[p][1] for n, ds in dims.items() if n.startswith("past")
                for p in ds if isinstance(p, str) and p in ranges and p != d), default=None)
    if past is not None and hi > past:  # (it reaches the whole context: past + a token)
        return []
    return [f"attention_mask's length is named {d!r} like input_ids' new tokens, but with a "
            f"KV cache it is past + new tokens at run time: the range {d}={lo}..{hi} must "
            f"reach the whole context, or the Guard refuses the runs whose mask is longer "
            f"than {hi}"]


def format_ranges(ranges: DimRanges) -> str:
    """``seq=1..2048,past=0..8191``: how ranges are written (metadata, messages)."""
    return ",".join(f"{k}={lo}..{hi}" for k, (lo, hi) in sorted(ranges.items()))


# ---- a dim bound past the model's own tables --------------------------------------------

_SMALL = 64  # elements: the shape arithmetic followed (shapes, positions' ends, bounds)
_FOLLOW = 48  # producers followed back from one table read
# The values of a small integer tensor, each with the names of the dims it comes from.
_Known = list[tuple[int, frozenset[str]]]
_ARITH: dict[str, Callable[[int, int], int]] = {
    "Add": operator.add, "Sub": operator.sub, "Mul": operator.mul, "Max": max, "Min": min,
    "Div": lambda a, b: abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)}
_PASS = ("Identity", "Squeeze", "Unsqueeze", "Reshape", "Flatten", "Cast")
# What a constant that cannot be read, or a malformed node, raises: the value is not known.
UNREADABLE = (ValueError, TypeError, OSError, ZeroDivisionError, IndexError, KeyError,
               AttributeError, NotImplementedError, OverflowError)


class _ShapeValues:
    """The small integer tensors of a main graph computed from its input shapes, constants
    and initializers at the bound dims (``Shape``, ``Gather``, ``Slice``, ``Concat``,
    arithmetic, casts); None where not known."""

    def __init__(self, shape_of: Callable[[str], Sequence[Dim] | None],
                 dims: Mapping[str, int]) -> None:
        self.shape_of, self.dims = shape_of, dims
        self.memo: dict[int, _Known | None] = {}

    def __call__(self, v: ir.Value | None, depth: int = 0) -> _Known | None:
        if v is None or depth > _FOLLOW:
            return None
        if id(v) not in self.memo:
            shape = self.shape_of(v.name or "")
            try:  # (vectors and scalars only: what shape arithmetic computes)
                self.memo[id(v)] = self._values(v, depth) if shape is None or len(shape) <= 1 \
                    else None
            except UNREADABLE:
                self.memo[id(v)] = None
        return self.memo[id(v)]

    def _values(self, v: ir.Value, depth: int) -> _Known | None:
        if v.const_value is not None:
            return _constant(v.const_value)
        node = v.producer()
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        op, ins = node.op_type, list(node.inputs)
        if op == "Constant":
            a = node.attributes.get("value") or node.attributes.get("value_int") or \
                node.attributes.get("value_ints")
            value = a.value if a is not None else None
            return _constant(value) if isinstance(value, ir.TensorProtocol) else \
                None if value is None else [(int(x), frozenset()) for x in np.ravel(value)]
        if op == "Shape":
            return self._shape(ins[0], node)
        maybe = [self(x, depth + 1) for x in ins[:1 if op in _PASS else None]]
        if any(k is None for k in maybe) or (op == "Cast" and np.dtype(
                ir.DataType(node.attributes["to"].value).numpy()).kind not in "iu"):
            return None
        known = cast(list[_Known], maybe)
        if op in _PASS:
            return known[0]
        if op == "Concat":
            return [e for k in known for e in k]
        if op in _ARITH and len(known) == 2:
            a, b = known
            n = max(len(a), len(b))
            if len(a) not in (1, n) or len(b) not in (1, n):
                return None
            return [(_ARITH[op](a[i % len(a)][0], b[i % len(b)][0]),
                     a[i % len(a)][1] | b[i % len(b)][1]) for i in range(n)]
        if op == "Gather" and len(known) == 2 and _attr(node, "axis", 0) in (0, -1):
            return [known[0][i] for i, _ in known[1]]
        if op == "Slice" and 3 <= len(known) <= 5:
            step = known[4][0][0] if len(known) == 5 else 1
            return known[0][known[1][0][0]:known[2][0][0]:step]
        return None

    def _shape(self, x: ir.Value | None, node: ir.Node) -> _Known | None:
        shape = self.shape_of(x.name or "") if x is not None else None
        if shape is None or x is None:
            return None
        declared = list(x.shape) if x.shape is not None and len(x.shape) == len(shape) \
            else [None] * len(shape)
        out: _Known = []
        for d, decl in zip(shape, declared, strict=True):
            if isinstance(d, str):
                try:
                    d = eval_dim(d, self.dims)
                except UnboundDimError:
                    return None
            if d is None:
                return None
            name = getattr(decl, "value", None)
            out.append((d, frozenset(free_names(name) or ()) if isinstance(name, str)
                        else frozenset()))
        return out[_attr(node, "start", 0):_attr(node, "end", None)]


def _attr(node: ir.Node, name: str, default: int | None) -> int | None:
    a = node.attributes.get(name)
    return default if a is None else a.value


def _constant(t: ir.TensorProtocol) -> _Known | None:
    """The values of a small integer scalar or vector constant, or None."""
    if t.dtype not in (ir.DataType.INT64, ir.DataType.INT32) or t.size > _SMALL \
            or len(t.shape) > 1:
        return None
    return [(int(x), frozenset()) for x in np.ravel(t.numpy())]


def check_table_reads(nodes: Iterable[ir.Node], shape_of: Callable[[str], Sequence[Dim] | None],
                      dims: Mapping[str, int]) -> None:
    """Refuse bound dims past what the model's own tables allow: a ``Gather`` on an
    initializer whose indices reach past its rows (positions from a ``Range`` up to ``seq``
    on a learned position table: ONNX Runtime's "indices element out of data bounds" at the
    first run), or a ``Slice`` of an initializer whose end, computed from a dim, is past its
    size (a causal-mask buffer: ORT would clamp it and fail later with a broadcast error).
    ``shape_of``: a main-graph value's shape at the bound ``dims``."""
    values = _ShapeValues(shape_of, dims)
    for node in nodes:
        if node.op_type not in ("Gather", "Slice") or node.domain not in ("", "ai.onnx") \
                or len(node.inputs) < 2 or node.inputs[0] is None \
                or node.inputs[0].const_value is None or node.inputs[0].is_graph_input():
            continue
        table = node.inputs[0]
        shape = list(table.const_value.shape)  # type: ignore[union-attr]
        try:
            reads = _gather_reads(node, shape, values) if node.op_type == "Gather" \
                else _slice_reads(node, shape, values)
        except UNREADABLE:
            continue
        if reads is None:
            continue
        axis, lo, hi, size, names = reads
        bound = [f"{n}={dims[n]}" for n in sorted(names) if n in dims]
        raise PastTableError(
            (f"dim {bound[0]} is" if len(bound) == 1 else f"dims {', '.join(bound)} are"
             if bound else "the bound dims are")
            + f" past what the model allows: node {node.name!r} ({node.op_type}) reads "
            f"{lo}..{hi} along axis {axis} of the constant {table.name!r}, which has {size} "
            "(a position or mask table the model was built with): bind a smaller value")


def _gather_reads(node: ir.Node, shape: list[int], values: _ShapeValues
                  ) -> tuple[int, int, int, int, frozenset[str]] | None:
    """(axis, lowest and highest index, rows, dims) of a Gather reading past its table."""
    axis = _attr(node, "axis", 0)
    if axis is None or not -len(shape) <= axis < len(shape):
        return None
    size = shape[axis]
    idx = node.inputs[1]
    producer = idx.producer() if idx is not None else None
    if producer is not None and producer.op_type == "Range" and producer.domain in ("", "ai.onnx"):
        ends = [values(x) for x in producer.inputs]
        if len(ends) != 3 or any(e is None or len(e) != 1 for e in ends):
            return None
        (start, n1), (limit, n2), (delta, n3) = (e[0] for e in cast(list[_Known], ends))
        if delta == 0:
            return None
        count = max(0, -(-(limit - start) // delta))
        if count == 0:
            return None
        lo, hi = sorted((start, start + (count - 1) * delta))
        names = n1 | n2 | n3
    else:
        known = values(idx)
        if not known:
            return None
        lo, hi = min(i for i, _ in known), max(i for i, _ in known)
        names = frozenset().union(*(n for _, n in known))
    return (axis % len(shape), lo, hi, size, names) if names and (lo < -size or hi >= size) \
        else None


def _slice_reads(node: ir.Node, shape: list[int], values: _ShapeValues
                 ) -> tuple[int, int, int, int, frozenset[str]] | None:
    """(axis, start, end - 1, size, dims) of a Slice whose dim-computed end is past its
    table (a forward step; ends written as constants, such as int64's largest, are "to the
    end" and never refused)."""
    known = [values(x) for x in node.inputs[1:5]]
    if len(known) < 2 or known[0] is None or known[1] is None:
        return None
    starts, ends = known[0], known[1]
    axes = known[2] if len(known) > 2 and node.inputs[3] is not None else \
        [(i, frozenset()) for i in range(len(ends))]
    steps = known[3] if len(known) > 3 and node.inputs[4] is not None else \
        [(1, frozenset())] * len(ends)
    if axes is None or steps is None or not len(starts) == len(ends) == len(axes) == len(steps):
        return None
    for (s, _), (e, names), (a, _), (st, _) in zip(starts, ends, axes, steps, strict=True):
        if not -len(shape) <= a < len(shape):
            return None
        size = shape[a]
        if names and st > 0 and e > size:
            return a % len(shape), s + size if s < 0 else s, e - 1, size, names
    return None
