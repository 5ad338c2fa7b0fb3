"""What the deciders need to know of a runtime, handed to them as one object of callbacks
(:class:`Target`; ONNX Runtime's: :data:`ho_onnx.target.ort.arena.ORT`), so that no decider
imports a runtime's knowledge itself."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any


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
class Fusions:
    """What a runtime's graph fusions change in a graph's values: ``gone``, values no node
    writes once their producer is merged into its consumer; ``later``, a node's position and
    the later one at which the fused node that replaces it reads its inputs; ``folded``,
    values it computes when it loads the model (constants then, held for the whole run
    outside its arena)."""

    gone: frozenset[str] = frozenset()
    later: Mapping[int, int] = field(default_factory=dict)
    folded: frozenset[str] = frozenset()

    def read_at(self, pos: int) -> int:
        """Where the inputs of the node at ``pos`` are last read."""
        return self.later.get(pos, pos)


@dataclass(frozen=True)
class Target:
    """A runtime's facts as callbacks: ``alias_input(domain, op_type)``, the input whose
    buffer output 0 takes (None: a new buffer); ``reuse_key(elem_type, shape)``, what two
    values must share for one to take the other's freed buffer (None: never);
    ``replay(values, steps)``, the ``(start, end, bytes)`` of every buffer the allocator
    holds for ``values`` over ``steps`` steps; ``fusions(analysis)``, what the runtime's
    own graph fusions change in the analysed graph's values (:class:`Fusions`);
    ``held(analysis, buffers, steps)``, the bytes the allocator holds at each step for
    those buffers of ``analysis``'s model (its rounding, the chunks it does not split, the
    regions it grows and keeps), or None (and None for the field): their bytes;
    ``shapeless(analysis, opaque, declared)``, the values whose shape the runtime does not
    know once the ``opaque`` nodes are the library's ops that declare none (``declared``:
    value -> the readers that read it through a cache op's output, which declares it): they
    take and give no freed buffer."""

    name: str
    alias_input: Callable[[str, str], int | None]
    reuse_key: Callable[[int | None, tuple | None], tuple | None]
    replay: Callable[[Mapping[str, ArenaValue], int], list[tuple[int, int, int]]]
    fusions: Callable[[Any], Fusions] = lambda analysis: Fusions()
    held: Callable[[Any, list[tuple[int, int, int]], int], Any] | None = None
    shapeless: Callable[[Any, Any, Mapping[str, Any]], frozenset[str]] = \
        lambda analysis, opaque, declared: frozenset()


def without_reuse(target: Target) -> Target:
    """``target`` with its runtime's buffer reuse off: no value takes a freed buffer (the
    views and the allocator's rules stay; ``OffloadOptions.ort_reuse``)."""
    if target.name.endswith(_NO_REUSE):
        return target
    return replace(target, name=target.name + _NO_REUSE,
                   reuse_key=lambda elem_type, shape: None)


_NO_REUSE = ", no buffer reuse"
