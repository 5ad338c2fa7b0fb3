"""ORT's buffer reuse: the bytes ORT's arena holds per step, not the tensors' bytes.

ORT's sequential allocation planner (``onnxruntime/core/framework/allocation_planner.cc``)
gives a node's output the buffer of an earlier value instead of a new one when

* the kernel declares the output an alias of an input (``Reshape``, ``Squeeze``,
  ``Unsqueeze``, ``Flatten``, ``Identity``; ho-onnx's ``Wait`` of input 0 and ``Detach`` of
  input 1), or
* a buffer on its free list has the same element size and the same shape (dim by dim: equal
  values or the same symbolic name; scalars never); the free list is searched most recently
  freed first.

A reused buffer is released to the arena only after the last reader of the last value that
used it, so it stays allocated across the gap between two users: ORT's arena can hold more
than the live tensors (measured on an H100 with a 24-layer decoder at 2,048 tokens: a
constant ~0.5 GB of attention scores kept for the next layer, docs/benchmarks.md).
``MayInplace`` reuse (an elementwise op writing into an input at its last use) is not
modelled: it only lowers the count. These rules are :data:`ORT`, the
:class:`~ho_onnx.target.base.Target` the deciders get; :mod:`ho_onnx.schedule.arena` says
which values a schedule has and replays them with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ...contract import DOMAIN
from ...graph.dtypes import ELEMENT_BITS
from ..base import ArenaValue, Target

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


ORT = Target("onnxruntime", alias_input, reuse_key, replay)
