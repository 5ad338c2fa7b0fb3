"""What the deciders need to know of a runtime, handed to them as one object of callbacks
(:class:`Target`; ONNX Runtime's: :data:`ho_onnx.target.ort.arena.ORT`), so that no decider
imports a runtime's knowledge itself."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass
class ArenaValue:
    """One value a runtime's allocator sees: allocated (or aliased) at step ``start``, last
    read at ``end``; ``key``: the buffers it may share (:attr:`Target.reuse_key`; None:
    none); ``alias_of``: the value whose buffer it is (a view)."""

    start: int
    end: int
    nbytes: int
    key: tuple | None
    alias_of: str | None = None


@dataclass(frozen=True)
class Target:
    """A runtime's facts as callbacks: ``alias_input(domain, op_type)``, the input whose
    buffer output 0 takes (None: a new buffer); ``reuse_key(elem_type, shape)``, what two
    values must share for one to take the other's freed buffer (None: never);
    ``replay(values, steps)``, the ``(start, end, bytes)`` of every buffer the allocator
    holds for ``values`` over ``steps`` steps."""

    name: str
    alias_input: Callable[[str, str], int | None]
    reuse_key: Callable[[int | None, tuple | None], tuple | None]
    replay: Callable[[Mapping[str, ArenaValue], int], list[tuple[int, int, int]]]
