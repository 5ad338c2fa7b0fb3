"""What a decision is: the data every decider produces and the insertion pass consumes.

An :class:`OffloadChoice` says, for each offloaded weight, which readers reload it and where
each reload is issued; for each offloaded activation, the uses before and after its gap; and
for every candidate that stays resident, why. A :class:`Decider` (the explicit policy or the
budget planner) makes one from a :class:`~ho_onnx.graph.analyse.GraphAnalysis`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import onnx_ir as ir

from .. import kinds
from ..graph.analyse import GraphAnalysis, TensorInfo
from ..target.base import Target

# A registered tier's name (ho_onnx.kinds: host, disk, and any tier registered there).
Tier = str


@dataclass(frozen=True)
class WeightOffload:
    """An initializer reloaded once before each consumer node that reads its data.

    ``prefetch_at[k]`` is the schedule position before which the reload for
    ``consumers[k]`` is issued (``<= consumers[k]``; the Wait sits right before the consumer).
    ``shape_readers`` (Shape/Size nodes) read only its static shape: the insertion pass
    replaces them with constants, so they cost no transfer. ``tier``: where the bytes wait
    between uses (the library's host store, or read from the data file each time).
    """

    name: str
    nbytes: int
    consumers: tuple[int, ...]
    prefetch_at: tuple[int, ...]
    shape_readers: tuple[int, ...] = ()
    tier: Tier = kinds.HOST.name
    # Per consumer, the routed value whose emptiness skips that reload (an MoE expert no
    # token was routed to: graph.moe.empty_gate), or "" (always moved); () for none. A
    # gated reload is issued after its gate is produced.
    gates: tuple[str, ...] = ()
    fraction: float = 1.0  # expected share of the reloads that move (routing's top-k)
    # Readers that gather rows of it (embedding lookups): each becomes a GatherRows that
    # copies only the selected rows from the host store; no reload, no fast-tier copy.
    row_readers: tuple[int, ...] = ()
    # Per consumer, for a gated reload of an expert tensor stacked on axis 0 that ORT's
    # MoE/QMoE op reads: (the op's selection rule, its k), and only the experts it selects
    # move (the gate is its router input; schedule.eligibility.Routed); None otherwise.
    routes: tuple[tuple[str, int] | None, ...] = ()
    # MatMuls of it computed where it lives (HostMatMul on the CPU EP against the host
    # store: an MoE expert, ``cpu_experts``); no reload, no fast-tier copy.
    host_readers: tuple[int, ...] = ()
    # Expected share of its moved reloads the expert cache serves (schedule.expert_cache).
    hit: float = 0.0

    # Each reload also holds a staging copy of its bytes in the fast tier from its Prefetch
    # through its Wait (a staged tier on the CPU EP, where host memory is the fast tier:
    # kinds.StorageTier.staged); counted by the memory model (lifetimes).
    staged: bool = False

    def __post_init__(self) -> None:
        kinds.tier(self.tier)  # a registered tier, or a ValueError naming them
        if self.routes and (len(self.routes) != len(self.consumers) or any(
                r and not (self.gates and self.gates[k])
                for k, r in enumerate(self.routes))):
            raise ValueError(f"{self.name}: routes {self.routes} need a gate per consumer")
        if self.gates and len(self.gates) != len(self.consumers):
            raise ValueError(f"{self.name}: {len(self.gates)} gates for "
                             f"{len(self.consumers)} consumers")
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"{self.name}: fraction {self.fraction} is not in [0, 1]")
        if not 0.0 <= self.hit <= 1.0:
            raise ValueError(f"{self.name}: hit {self.hit} is not in [0, 1]")
        if len(self.prefetch_at) != len(self.consumers) or any(
            not 0 <= p <= c for p, c in zip(self.prefetch_at, self.consumers, strict=True)
        ):
            raise ValueError(f"{self.name}: prefetch positions {self.prefetch_at} do not fit "
                             f"consumers {self.consumers}")


@dataclass(frozen=True)
class ActivationOffload:
    """An activation stored after ``producer``, detached after ``early``, reloaded for ``late``."""

    name: str
    nbytes: int | None  # None: symbolic size (only with min_bytes == 0)
    producer: int
    early: tuple[int, ...]
    late: tuple[int, ...]
    prefetch_at: int  # position before which the reload is issued: after early, <= late[0]

    @property
    def last_early(self) -> int:
        """Position after which the Detach ends the first residency."""
        return max(self.early) if self.early else self.producer

    def __post_init__(self) -> None:
        if not self.late or not self.last_early < self.prefetch_at <= self.late[0]:
            raise ValueError(f"{self.name}: prefetch position {self.prefetch_at} is not in "
                             f"({self.last_early}, {self.late[:1]}]")


@dataclass(frozen=True)
class Recompute:
    """An activation computed again right before its late readers instead of stored
    (:mod:`~ho_onnx.schedule.recompute`): its first residency ends after ``early``; the
    nodes at ``nodes`` (schedule positions, in order, the last its ``producer``) run again
    right before ``late[0]`` on values resident there, and the late readers read that copy.
    ``fenced``: (node position, input) each read through a Fence (ordered after the node
    before ``late[0]``, opaque to ORT's optimizers); ``transient``: bytes held beside the
    copy while the nodes run (their other outputs, the Fences' copies)."""

    name: str
    nbytes: int
    producer: int
    early: tuple[int, ...]
    late: tuple[int, ...]
    nodes: tuple[int, ...]
    fenced: tuple[tuple[int, str], ...] = ()
    transient: int = 0

    @property
    def last_early(self) -> int:
        """Position after which the first residency ends."""
        return max(self.early) if self.early else self.producer

    def __post_init__(self) -> None:
        if not self.late or not self.last_early < self.late[0]:
            raise ValueError(f"{self.name}: late readers {self.late[:1]} not after "
                             f"{self.last_early}")
        if not self.nodes or self.nodes[-1] != self.producer or list(self.nodes) != sorted(
                set(self.nodes)):
            raise ValueError(f"{self.name}: nodes {self.nodes} must be ascending and end at "
                             f"its producer {self.producer}")


@dataclass(frozen=True)
class InputOffload:
    """A graph input the caller holds in host memory (a past KV), copied into the fast tier
    before each reader that reads its data (PrefetchInput issued before ``prefetch_at[k]``,
    Wait before ``consumers[k]``); its shape readers read the input itself (no transfer)."""

    name: str
    nbytes: int
    consumers: tuple[int, ...]
    prefetch_at: tuple[int, ...]
    peer: str = ""  # the present KV output it pairs with (graph.kv)

    def __post_init__(self) -> None:
        if not self.consumers or len(self.prefetch_at) != len(self.consumers) or any(
                not 0 <= p <= c for p, c in zip(self.prefetch_at, self.consumers, strict=True)):
            raise ValueError(f"{self.name}: prefetch positions {self.prefetch_at} do not fit "
                             f"consumers {self.consumers}")


@dataclass(frozen=True)
class OutputOffload:
    """A graph output (a present KV) handed to the caller's host memory right after its last
    reader in the graph (``last``; its producer when none), by an Emit."""

    name: str
    nbytes: int
    producer: int
    last: int

    def __post_init__(self) -> None:
        if self.last < self.producer:
            raise ValueError(f"{self.name}: last reader {self.last} before its producer "
                             f"{self.producer}")


@dataclass(frozen=True)
class WeightSplit:
    """A weight read whole by one MatMul/Gemm that was streamed as column blocks, each a
    weight of its own (``blocks``, in column order: :mod:`ho_onnx.rewrite.blocks`), or kept
    whole (``blocks`` empty); ``reason`` says why, in the planner's predictions."""

    name: str
    nbytes: int
    blocks: tuple[str, ...]
    reason: str
    # The blocks are ranges of the weight's own bytes (row blocks of a transposed read): an
    # offloaded table of it (a tied embedding's, gathered by rows) holds them in the host
    # store once, not twice.
    rows: bool = False


@dataclass(frozen=True)
class Warm:
    """One speculative read (:mod:`~ho_onnx.schedule.speculate`): the reload ``consumer``
    (an index into the weight's consumers) of the cached expert weight ``weight``, whose
    expert is column ``expert`` of its router."""

    weight: str
    consumer: int
    expert: int


@dataclass(frozen=True)
class Speculation:
    """The router of the MoE layer ``layer`` (its TopK, at schedule position ``topk``)
    applied to an earlier router's input ``activation`` right after that router's MatMul
    (position ``after``): the ``k`` experts it picks there have their weights' reads into the
    expert cache started (``warms``), a layer before the layer's own router asks for them."""

    layer: str
    topk: int
    after: int
    activation: str
    router_weight: str
    bias: str | None
    k: int
    warms: tuple[Warm, ...]
    # The warm Prefetches go right after this position (>= ``after``): after the earlier
    # layer's own expert Prefetches, so that they do not queue ahead of them on the channel.
    issue_at: int = -1

    def __post_init__(self) -> None:
        if self.issue_at < self.after:
            self.issue_at = self.after


@dataclass(frozen=True)
class DecodeCache:
    """The decode cache of a range plan (:mod:`ho_onnx.schedule.decode_cache`): streamed
    weights the library keeps across runs, and reads ahead, as far as a run's dims leave
    room."""

    group: int  # its id in the model (attribute ``cache_group``; not 0)
    weights: tuple[str, ...]  # its weights (every reload of each), by their first reload
    capacity: int  # the most bytes a point keeps (attribute ``expert_cache``)
    # Per point of the plan (a range end or a named point): its name, the value of every
    # ranged dim there, the bytes a run the point covers may keep and read ahead (those of
    # the covering point with the most room are the run's; a Guard's ``cache_points``,
    # ``cache_bytes``, ``cache_ahead``).
    points: tuple[tuple[str, tuple[tuple[str, int], ...], int, int], ...]


@dataclass
class OffloadChoice:
    """The tensors to offload, and why each other candidate stays resident.

    ``decided_by`` names the decider and its options (recorded in the output's metadata).
    """

    decided_by: str = ""
    weights: list[WeightOffload] = field(default_factory=list)
    activations: list[ActivationOffload] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    # The KV cache (schedule.kv): the caller's, in host memory between steps.
    inputs: list[InputOffload] = field(default_factory=list)
    outputs: list[OutputOffload] = field(default_factory=list)
    # What the user should hear about the decision (an option that found nothing to do).
    notes: list[str] = field(default_factory=list)
    # Weights streamed in blocks, or kept whole, and why (before deciding: rewrite.blocks).
    splits: list[WeightSplit] = field(default_factory=list)
    # Offloaded MoE expert weights (``cpu_experts``): computed on the host or moved, and why.
    cpu_experts: dict[str, str] = field(default_factory=dict)
    # Bytes of the expert cache the library keeps for the routed weights of a streamed tier
    # (schedule.expert_cache; 0: none), recorded on their Prefetches.
    expert_cache: int = 0
    # Speculative reads of the next MoE layer's experts into that cache (schedule.speculate),
    # and, by layer (its TopK), why one was not speculated.
    speculations: list[Speculation] = field(default_factory=list)
    speculation_skipped: dict[str, str] = field(default_factory=dict)
    # Activations computed again before their late readers instead of stored
    # (schedule.recompute), and, by name, why a stored one was not.
    recomputes: list[Recompute] = field(default_factory=list)
    recompute_skipped: dict[str, str] = field(default_factory=dict)
    # Streamed weights kept across runs where a run's dims leave room (a range plan's decode
    # steps: schedule.decode_cache), or why there is none ("" where none was considered).
    decode_cache: DecodeCache | None = None
    decode_cache_skipped: str = ""

    @property
    def offloaded_bytes(self) -> int:
        return sum(w.nbytes for w in self.weights) + sum(
            a.nbytes or 0 for a in self.activations
        )

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV cache kept in the caller's host memory (past and present)."""
        return sum(i.nbytes for i in self.inputs) + sum(o.nbytes for o in self.outputs)


def host_positions(c: OffloadChoice) -> list[int]:
    """Positions of the MatMuls ``c`` computes on the host (HostMatMul: their host time)."""
    return [p for w in c.weights for p in w.host_readers]


def kv_pairs_text(c: OffloadChoice) -> str:
    """The KV pairs (past input, present output) of ``c``'s offloads, recorded in the
    model's metadata as ``past:present,...`` (the rewrite hides the structure they were
    found by)."""
    return ",".join(f"{i.name}:{i.peer}" for i in c.inputs if i.peer)


def decode_cache_text(d: DecodeCache) -> str:
    """``3 weights, 12582912 bytes; decode (past=4095,seq=1): 12582912 kept, 0 ahead; ...``:
    the metadata ``ho_onnx.decode_cache``."""
    return (f"{len(d.weights)} weights, {d.capacity} bytes; " + "; ".join(
        f"{name} ({','.join(f'{k}={v}' for k, v in at)}): {b} kept, {a} ahead"
        for name, at, b, a in d.points))


@dataclass
class Decision:
    """What a decider returns: the choice, and what to record about it in the output."""

    choice: OffloadChoice
    # Decisions made apart for subgraphs (If branches: rewrite/branches.py), each with its
    # label and the names of its nodes by position (what the plan table prints of it).
    parts: list[tuple[str, Decision, list[str]]] = field(
        default_factory=list, kw_only=True, repr=False, compare=False)

    def metadata(self) -> dict[str, str]:
        """The decision as recorded in the output's ``metadata_props`` (keys without the
        ``ho_onnx.`` prefix); ``host_bytes``: the slow tier's peak, as the planner's
        (:func:`~ho_onnx.schedule.lifetimes.host_bytes`; was every offloaded byte, disk-tier
        weights included)."""
        from .lifetimes import host_bytes  # (lifetimes imports this module)

        c = self.choice
        return {
            "policy": c.decided_by,
            "offloaded_weights": str(len(c.weights)),
            "offloaded_activations": str(len(c.activations)),
            "offloaded_bytes": str(c.offloaded_bytes),
            **({"offloaded_kv": str(len(c.inputs) + len(c.outputs)),
                "kv_bytes": str(c.kv_bytes), "kv_pairs": kv_pairs_text(c)}
               if c.inputs or c.outputs else {}),
            "host_bytes": str(host_bytes(c)),
            **({"expert_cache_bytes": str(c.expert_cache)} if c.expert_cache else {}),
            **({"decode_cache": decode_cache_text(c.decode_cache)} if c.decode_cache else {}),
            **({"recomputed_activations": ",".join(r.name for r in c.recomputes)}
               if c.recomputes else {}),
            **({"split_weights": ",".join(f"{s.name}:{len(s.blocks)}" for s in c.splits
                                          if s.blocks)}
               if any(s.blocks for s in c.splits) else {}),
        }

    def summary(self, seconds: float) -> list[str]:
        """Lines a run logs about the decision, made in ``seconds`` (none by default: the
        rewrite's own line says what is offloaded)."""
        return []


@dataclass(frozen=True)
class RunFacts:
    """What the pipeline hands a decider for one run (:meth:`Decider.prepared`): the
    target's facts (``target``: callbacks, :class:`~ho_onnx.target.base.Target`) and, for a
    plan made for ranges of dims, ``bottom``: a model (the loaded one, or a copy split in
    blocks) analysed at the bottom of every range (``bottom_dims``), where compute is least:
    the times a range plan sizes its prefetch windows by (issue 36)."""

    target: Target
    bottom: Callable[[ir.Model], GraphAnalysis] | None = None
    bottom_dims: Mapping[str, int] = field(default_factory=dict)


class Decider(Protocol):
    """The decision seam: which tensors leave the fast tier and when their reloads start.

    Implemented by :class:`~ho_onnx.schedule.policy.ExplicitPolicy` and
    :class:`~ho_onnx.schedule.planner.BudgetPlanner`; a decider never modifies ``analysis``.
    The pipeline checks the dims of the tensors it sizes (:meth:`sized`), logs its
    decision's :meth:`Decision.summary`, and hands it the run's facts (:meth:`prepared`,
    optional: a decider without it decides as it is).
    """

    def decide(self, analysis: GraphAnalysis, dims: Mapping[str, int]) -> Decision:
        """The offloads of ``analysis``'s model with symbolic dims bound by ``dims``."""
        ...

    def sized(self, t: TensorInfo) -> bool:
        """Whether :meth:`decide` needs ``t``'s size: the pipeline names every symbolic dim
        of such tensors that ``dims`` leaves unbound, in one error, before deciding."""
        ...

    def prepared(self, run: RunFacts) -> Decider:
        """This decider for one run of the pipeline, with what ``run`` gives it."""
        ...
