"""Storage tiers and tensor kinds: the two registries every layer looks up instead of
comparing the words ``"host"``, ``"disk"``, ``"weight"`` and ``"activation"``.

**Tiers** (:class:`StorageTier`): where an offloaded tensor waits between uses. Each entry
says everything the Python side needs of it: its name (the model's ``tier`` attribute, the
``--weight-tier`` word, the ``tier`` of the JSON reports), its place in the hierarchy
(``rank``: the lowest is the default, written as no attribute at all), the copy direction a
reload from it takes (:class:`Link`: the cost model's direction name and the
:class:`~ho_onnx.cost.machine.Machine` field of its bandwidth), the copy channel its
Prefetches queue on in the rewritten graph, and whether its bytes occupy host memory
(counted in ``host_bytes`` and against ``--host-budget``; loaded through the CUDA engine's
device staging buffers). ``host`` and ``disk`` are registered here; a further tier is one
more :func:`register_tier` call, and for the library to run it one entry of the same name in
the C++ registry ``csrc/tiers.cc`` with its I/O class (docs/design.md, "Adding a tensor kind
or a tier").

**Kinds** (:class:`TensorKind`): what sort of tensor a candidate is. Each entry says which
tensors are its candidates (``matches``, first match by ``priority``), which option enables
it, and how it moves, which also says how it is sized: ``stored=False`` tensors are in the
slow tier before the run (the model's data), reloaded before each data reader (Prefetch,
Wait), sized with the companions that move with them (``schedule.eligibility.WeightGroups``:
a MatMulNBits weight's scales and zero points) and may wait in any tier; ``stored=True``
tensors are produced on the device, stored after their producer into the default tier,
detached after their early readers and reloaded before the late ones (Store, Detach,
Prefetch, Wait), sized alone (a symbolic size is allowed with ``min_bytes=0``). The
deciders, the simulation and the insertion pass dispatch on those fields, never on a kind's
name, so a new kind that moves like one of the two (MoE experts like weights; KV cache like
activations) is one more entry.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol, TypeVar

from . import contract


@dataclass(frozen=True)
class Link:
    """One copy direction of the cost model."""

    direction: str  # TransferEvent.direction, transfer_time's argument, the plot's lane
    bandwidth: str  # the Machine field holding its bytes per second
    label: str  # the plot's lane label


H2D = Link("h2d", "h2d_bw", "h2d\n(load)")  # slow tier to fast tier
D2H = Link("d2h", "d2h_bw", "d2h\n(store)")  # fast tier to slow tier
DISK_READ = Link("disk", "disk_bw", "disk\n(read)")  # a read from the data file


@dataclass(frozen=True)
class StorageTier:
    """Where an offloaded tensor waits between uses (module docstring)."""

    name: str  # the ``tier`` attribute's value, the --weight-tier word, JSON ``tier``
    rank: int  # order in the hierarchy: lower is nearer the fast tier; the lowest is default
    load: Link  # the direction a reload from this tier copies on
    channel: str  # the copy channel its Prefetches queue on (FIFO, one per channel)
    in_host_memory: bool  # its bytes occupy host memory (host_bytes, --host-budget)
    store: Link | None = None  # the direction a Store copies into it; None: holds no stores
    # Its reloads land in a staging buffer of the CPU engine first (reads in flight never
    # write ORT's memory: a failed run may free it), so on the CPU EP a reload holds its
    # bytes twice from its Prefetch to its Wait (WeightOffload.staged).
    staged: bool = False


_TIERS: dict[str, StorageTier] = {}


def _changed() -> None:
    """Forget what was derived from the registries (they are read in the planner's loops)."""
    for f in (tiers, links, bandwidths, host_loads, kinds):
        f.cache_clear()


def register_tier(t: StorageTier) -> StorageTier:
    """Add ``t`` to the registry (its name and rank must be new); returns it."""
    if t.name in _TIERS or any(o.rank == t.rank for o in _TIERS.values()):
        raise ValueError(f"a tier named {t.name!r} or of rank {t.rank} is registered already")
    _TIERS[t.name] = t
    _changed()
    return t


def unregister_tier(name: str) -> None:
    """Remove the tier ``name`` (a plug-in's or a test's; the default cannot go)."""
    if tier(name) is default_tier():
        raise ValueError(f"{name!r} is the default tier")
    del _TIERS[name]
    _changed()


@functools.cache
def tiers() -> tuple[StorageTier, ...]:
    """The registered tiers, nearest the fast tier first."""
    return tuple(sorted(_TIERS.values(), key=lambda t: t.rank))


def tier_names() -> tuple[str, ...]:
    """The registered tiers' names, nearest the fast tier first."""
    return tuple(t.name for t in tiers())


def tier(name: str) -> StorageTier:
    """The registered tier ``name``; a :class:`ValueError` names the registered ones."""
    try:
        return _TIERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"tier must be {'|'.join(tier_names())}, not {name!r}") from None


def default_tier() -> StorageTier:
    """The tier nearest the fast tier: where stored tensors go, and what a Prefetch without a
    ``tier`` attribute reads from."""
    return tiers()[0]


def tier_of_attribute(value: object) -> StorageTier:
    """The tier a Prefetch's ``tier`` attribute names (absent or unknown: the default)."""
    return _TIERS.get(value, default_tier()) if isinstance(value, str) else default_tier()


def spill_tier(t: StorageTier) -> StorageTier | None:
    """The first tier after ``t`` in the hierarchy that does not occupy host memory: where a
    weight goes when the host budget is full (None: there is none)."""
    return next((o for o in tiers() if o.rank > t.rank and not o.in_host_memory), None)


@functools.cache
def links() -> tuple[Link, ...]:
    """Every copy direction of the registered tiers: each tier's load, then its store."""
    out: dict[str, Link] = {}
    for t in tiers():
        for link in (t.load, t.store):
            if link is not None:
                out.setdefault(link.direction, link)
    return tuple(out.values())


def stored_links() -> tuple[Link, Link]:
    """(store, load) links of a stored tensor: it waits in the default tier."""
    home = default_tier()
    if home.store is None:
        raise ValueError(f"the default tier {home.name!r} holds no stored tensors")
    return home.store, home.load


@functools.cache
def bandwidths() -> Mapping[str, str]:
    """The Machine field of each copy direction's bandwidth (direction -> field)."""
    return MappingProxyType({link.direction: link.bandwidth for link in links()})


@functools.cache
def host_loads() -> frozenset[str]:
    """The load directions of the tiers in host memory (the CUDA engine stages them)."""
    return frozenset(t.load.direction for t in tiers() if t.in_host_memory)


class TensorFacts(Protocol):
    """What a kind's ``matches`` reads of a tensor (``graph.analyse.TensorInfo`` has it)."""

    name: str
    is_initializer: bool
    is_graph_input: bool
    is_graph_output: bool
    producer: int | None
    kv_peer: str | None


@dataclass(frozen=True)
class TensorKind:
    """What sort of tensor a candidate is, and how it moves (module docstring)."""

    name: str  # the JSON/table ``kind``, the plot's colour
    option: str  # the OffloadOptions field (a bool) that enables it
    stored: bool  # True: Store/Detach then Prefetch/Wait; False: Prefetch/Wait per reader
    matches: Callable[[TensorFacts], bool]  # whether a tensor is of this kind
    priority: int = 0  # kinds are tried highest first (a specific kind before a general one)
    # Offloaded whenever its option is on, never a decider's choice (the KV cache: the
    # caller's memory); the deciders plan the others around it (schedule.kv).
    fixed: bool = False

    @property
    def ops(self) -> tuple[str, ...]:
        """The cache operators that move it, in the order they run."""
        if self.fixed:
            return (contract.PREFETCH_INPUT, contract.WAIT, contract.EMIT)
        reload = (contract.PREFETCH, contract.WAIT)
        return (contract.STORE, contract.DETACH, *reload) if self.stored else reload


_KINDS: dict[str, TensorKind] = {}


def register_kind(k: TensorKind) -> TensorKind:
    """Add ``k`` to the registry (its name must be new); returns it."""
    if k.name in _KINDS:
        raise ValueError(f"a kind named {k.name!r} is registered already")
    _KINDS[k.name] = k
    _changed()
    return k


def unregister_kind(name: str) -> None:
    """Remove the kind ``name`` (a plug-in's or a test's)."""
    del _KINDS[kind(name).name]
    _changed()


_Entry = TypeVar("_Entry", "StorageTier", "TensorKind")


@contextmanager
def registered(entry: _Entry) -> Iterator[_Entry]:
    """``entry`` (a tier or a kind) registered for the duration of the ``with`` block."""
    is_tier = isinstance(entry, StorageTier)
    register_tier(entry) if is_tier else register_kind(entry)
    try:
        yield entry
    finally:
        unregister_tier(entry.name) if is_tier else unregister_kind(entry.name)


@functools.cache
def kinds() -> tuple[TensorKind, ...]:
    """The registered kinds, in the order a tensor is matched against them."""
    return tuple(sorted(_KINDS.values(), key=lambda k: -k.priority))


def kind(name: str) -> TensorKind:
    """The registered kind ``name``; a :class:`ValueError` names the registered ones."""
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"kind must be {'|'.join(_KINDS)}, not {name!r}") from None


def kind_of(t: TensorFacts, *, fixed: bool = True) -> TensorKind | None:
    """The first kind (highest priority) ``t`` matches, or None (a graph input that is not
    a past KV: the caller owns its memory). ``fixed=False``: among the kinds a decider
    chooses from (the fixed kinds' tensors are then matched by the next kind, if any)."""
    return next((k for k in kinds() if (fixed or not k.fixed) and k.matches(t)), None)


WEIGHT = register_kind(TensorKind("weight", "weights", stored=False,
                                  matches=lambda t: t.is_initializer))
ACTIVATION = register_kind(TensorKind(
    "activation", "activations", stored=True,
    matches=lambda t: not t.is_initializer and t.producer is not None))

# The KV cache (graph.kv): each past KV input reaches the fast tier just before its reader
# and leaves after it (PrefetchInput, Wait), each present KV output leaves after its last
# reader in the graph (Emit); the caller holds both in host memory between steps.
KV = register_kind(TensorKind("kv", "kv", stored=False, fixed=True, priority=10,
                              matches=lambda t: t.kv_peer is not None))

# The registered tiers and kinds (after the functions: registering reads them).
HOST = register_tier(StorageTier("host", 0, H2D, "load", in_host_memory=True, store=D2H))
DISK = register_tier(StorageTier("disk", 1, DISK_READ, "disk", in_host_memory=False,
                                 staged=True))
