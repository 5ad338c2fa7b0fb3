"""The one vocabulary of offload options, shared by the explicit policy, the budget planner,
the pipeline and the command line; every default is defined here and nowhere else."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from ..kinds import HOST, tier_names
from ..units import parse_size
from .types import Tier

# Smallest tensor worth a transfer: the explicit policy offloads every eligible tensor, so it
# keeps a high floor; the planner offloads only what the budget needs, so it may go lower.
MIN_BYTES_EXPLICIT = 1 << 20
MIN_BYTES_BUDGET = 64 << 10
#: The explicit policy's compute nodes between a Prefetch and its Wait.
PREFETCH_DISTANCE = 2
#: Values of ``cpu_experts``.
CPU_EXPERTS = ("off", "auto", "all")
#: Values of ``speculate_experts``.
SPECULATE_EXPERTS = ("off", "auto", "on")
#: Values of ``recompute``.
RECOMPUTE = ("off", "auto", "on")


class _Unset(int):
    """The default ``prefetch_distance``: an int that says it was not given, kept as it is
    through ``dataclasses.replace``, so that one given with a budget can be refused."""


_DEFAULT_DISTANCE = _Unset(PREFETCH_DISTANCE)


@dataclass(frozen=True)
class OffloadOptions:
    """What may leave the fast tier, and how the decider works.

    Candidates (both deciders):
      ``weights``, ``activations``: which kinds of tensors may be offloaded.
      ``kv``: the KV cache of a decoder exported with past (:mod:`ho_onnx.graph.kv`) lives in
      the caller's host memory: each past KV input is copied in just before its reader and
      each present KV output leaves right after its last reader (both deciders, always, when
      set; the rest is planned around it).
      ``routed``: an offloaded MoE expert weight moves only when the router sent its expert
      a token (:class:`~ho_onnx.schedule.eligibility.Routed`); False moves it at every run.
      ``cpu_experts``: an offloaded routed expert's MatMuls computed where its weights live
      (``HostMatMul`` on the CPU EP against the host store: the activations move, never the
      weight): ``off``; ``all`` (every such MatMul); ``auto`` (the budget planner decides per
      expert weight from its cost model: moving it and computing on the device against
      computing on the host, :func:`~ho_onnx.schedule.eligibility.cpu_expert_readers`).
      ``min_bytes``: smaller tensors stay resident (None: :data:`MIN_BYTES_BUDGET` with a
      ``budget``, :data:`MIN_BYTES_EXPLICIT` without; see :attr:`min_bytes_or_default`).
      ``min_gap``: an activation is offloaded only across a gap of at least this many
      schedule steps between two of its uses.
      ``weight_tier``: where offloaded weights wait (``host`` store, or ``disk``: read from
      the data file at every reload).
      ``expert_cache``: bytes of the library's expert cache (:mod:`~ho_onnx.schedule.
      expert_cache`: routed MoE expert weights of a streamed tier kept across runs, least
      recently used first out; a size, ``"512MiB"``, is kept as bytes), ``"auto"`` (the
      default: with a ``budget`` the slack the plan leaves under it, without one none), or 0
      (none: every routed reload is read). With a budget the cache counts in the plan's
      memory: the rest is planned for the budget less the cache.
      ``decode_cache``: a range plan with a budget keeps streamed weights (the disk tier)
      across runs wherever a run's dims leave room under the plan's budget, as a decode step
      does, or reads the next ones ahead (:mod:`~ho_onnx.schedule.decode_cache`). Off by
      default: the room is the plan's, not the process's; ORT's CPU arena keeps what a
      prefill allocated, so the cache's bytes can come on top of it (measured: the process's
      peak +25 MiB with a 35 MiB cache, for 2.1x the decode tokens/s, docs/benchmarks.md).
      Without ranges, nothing.
      ``speculate_experts``: the next MoE layer's router applied to this layer's router input
      predicts its experts, whose reads into the expert cache start a layer early
      (:mod:`~ho_onnx.schedule.speculate`): ``off``, ``on`` (wherever the graph and the cache
      allow), ``auto`` (the default: where the budget planner's cost model says it pays;
      never in the explicit policy, which has no cost model).
      ``recompute``: a stored activation whose producer (and what it needs that is not
      resident at its late readers: a few deterministic, cheap nodes) can run again there
      is computed again instead of stored and reloaded (:mod:`~ho_onnx.schedule.recompute`):
      ``auto`` (the default: where the budget planner's simulation says it is faster and the
      plan still fits), ``on`` (wherever it fits), ``off``; the budget planner only.

    Explicit policy (no ``budget``): every eligible tensor is offloaded.
      ``prefetch_distance``: compute nodes between a Prefetch and its Wait (default
      :data:`PREFETCH_DISTANCE`). Given with a ``budget`` it is refused, not ignored: the
      planner places every Prefetch.

    Budget planner (``budget`` set): offloads only what the budget needs.
      ``budget``: fast-tier bytes the simulated peak must fit (``budget``, ``host_budget``
      and ``min_bytes`` may also be written as sizes, ``"8GiB"``: kept as bytes).
      ``host_budget``: slow-tier (host) bytes; offloaded weights beyond it go to disk.
      ``preferred_overlap``, ``max_overlap``: a reload's window hides its copy with this
      margin, and opens at most this many copy-times early (XLA MSA's overlap ratios).
      ``max_extra``, ``max_extra_s``: tries and seconds of the look-ahead that offloads one
      more tensor to rescue a stalled reload.
      ``arena_refits``: ORT's arena holds more than the live tensors (its allocation planner
      keeps reused buffers across gaps, :mod:`~ho_onnx.schedule.arena`); while that
      replayed arena peak exceeds ``budget``, plan again for a budget lowered by the excess,
      at most this many times (0: fit the tensor count only). The replay is ORT's arena
      with memory patterns off, as ``ho_onnx.InferenceSession`` runs.
      ``ort_reuse``: the sessions that run the model keep ORT's buffer reuse (a freed
      buffer given to a later value of the same shape, held across the gap between them:
      on a fixed-shape 4-layer decoder 40 MiB of arena regions for a 19 MiB tensor peak,
      stop 54). False plans for sessions with it off (``enable_mem_reuse = False``: 23 MiB
      there), written into the model (``ho_onnx.ort_reuse``), which ho-onnx's Python
      sessions then set (``ho_onnx.InferenceSession``, ``session_options``, Optimum's); the
      C API has no call for it, so genai and Triton folders are refused for such a model,
      and a C host would hold more than the plan.
      ``refine_s``: seconds the refinement after the greedy may search (joint add, drop and
      swap of offloads and moves of Prefetch positions, each scored by the simulator:
      :mod:`~ho_onnx.schedule.refine`), a safety cap: a count of scored points that grows
      with the graph's size (:func:`~ho_onnx.schedule.refine.tries_for`) stops it first on
      a machine that is not overloaded, so the plan does not depend on the load; 0: the
      greedy plan as it is.
      ``exact_s``: seconds the exact planner (CP-SAT, the ``exact`` extra:
      :mod:`~ho_onnx.schedule.exact`) may search the same space, seeded by the refined plan,
      on graphs of at most ``exact_nodes`` nodes; 0: off. Every plan reports a lower bound
      on its time: the solver's where it ran, else :func:`~ho_onnx.schedule.refine.weak_bound`.
      ``max_blocks``: a weight read whole by one MatMul/Gemm (an lm_head) may be streamed in
      up to this many column blocks, where the planner predicts it pays
      (:mod:`ho_onnx.rewrite.blocks`); 0 or 1 keeps every weight whole.
    """

    weights: bool = True
    activations: bool = True
    kv: bool = False
    routed: bool = True
    cpu_experts: str = "off"
    min_bytes: int | None = None
    min_gap: int = 2
    weight_tier: Tier = HOST.name
    expert_cache: int | str = "auto"
    decode_cache: bool = False
    speculate_experts: str = "auto"
    recompute: str = "auto"
    prefetch_distance: int = _DEFAULT_DISTANCE
    budget: int | None = None
    host_budget: int | None = None
    preferred_overlap: float = 1.5
    max_overlap: float = 10.0
    max_extra: int = 64
    max_extra_s: float = 2.0
    arena_refits: int = 4
    ort_reuse: bool = True
    max_blocks: int = 32
    refine_s: float = 3.0
    exact_s: float = 0.0
    exact_nodes: int = 400

    def __post_init__(self) -> None:
        self._check_types()
        if self.weight_tier not in tier_names():
            raise ValueError(f"weight_tier must be {'|'.join(tier_names())}, "
                             f"not {self.weight_tier!r}")
        for name in ("min_gap", "prefetch_distance", "max_extra", "arena_refits", "max_extra_s",
                     "min_bytes", "max_blocks", "refine_s", "exact_s", "exact_nodes",
                     "expert_cache"):
            # (None: min_bytes' default)
            if (v := getattr(self, name)) is not None and v != "auto" and v < 0:
                raise ValueError(f"{name} must be >= 0, not {v!r}")
        if self.budget is not None and self.budget <= 0:
            raise ValueError(f"budget must be positive, not {self.budget!r}")
        if self.budget is not None and not isinstance(self.prefetch_distance, _Unset):
            raise ValueError(f"prefetch_distance={self.prefetch_distance} is for the explicit "
                             "policy (no budget): with a budget the planner places every "
                             "Prefetch; leave it unset")
        if self.budget is not None and self.expert_cache != "auto" \
                and self.expert_cache >= self.budget:
            raise ValueError(f"expert_cache {self.expert_cache} leaves nothing of the budget "
                             f"{self.budget} for the model")
        if self.host_budget is not None and self.budget is None:
            raise ValueError("host_budget needs a budget (the planner)")
        if self.speculate_experts not in SPECULATE_EXPERTS:
            raise ValueError(f"speculate_experts must be {'|'.join(SPECULATE_EXPERTS)}, "
                             f"not {self.speculate_experts!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be {'|'.join(RECOMPUTE)}, not {self.recompute!r}")
        if self.recompute == "on" and self.budget is None:
            raise ValueError("recompute='on' is decided by the budget planner: give a budget")
        if self.cpu_experts not in CPU_EXPERTS:
            raise ValueError(f"cpu_experts must be {'|'.join(CPU_EXPERTS)}, "
                             f"not {self.cpu_experts!r}")
        if self.cpu_experts == "auto" and self.budget is None:
            raise ValueError("cpu_experts='auto' decides from the planner's cost model: give a "
                             "budget, or use 'all' with the explicit policy")
        if self.cpu_experts != "off" and not self.routed:
            raise ValueError("cpu_experts computes routed experts on the host: it needs "
                             "routed=True")
        if self.preferred_overlap < 1 or self.max_overlap < self.preferred_overlap:
            raise ValueError("need 1 <= preferred_overlap <= max_overlap")

    def _check_types(self) -> None:
        """Whole numbers where counts and bytes are asked (sizes may be written ``"8GiB"``,
        kept as bytes), numbers (not NaN) for the ratios and seconds, booleans for the kinds
        (found by hand: ``budget=float("nan")`` and ``budget=1.5`` were accepted, ``"8GiB"``
        was a TypeError about ``<=``)."""
        for name in ("budget", "host_budget", "min_bytes", "expert_cache"):
            v = getattr(self, name)
            if name == "expert_cache" and v == "auto":
                continue
            if isinstance(v, str):
                try:
                    object.__setattr__(self, name, parse_size(v))
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None
        for name in ("budget", "host_budget", "min_bytes", "min_gap", "prefetch_distance",
                     "max_extra", "arena_refits", "max_blocks", "exact_nodes",
                     "expert_cache"):
            v = getattr(self, name)
            if (v is None and name in ("budget", "host_budget", "min_bytes")) \
                    or isinstance(v, _Unset) or (name == "expert_cache" and v == "auto"):
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ValueError(f"{name} must be a whole number, not {v!r}")
            object.__setattr__(self, name, int(v))
        for name in ("preferred_overlap", "max_overlap", "max_extra_s", "refine_s", "exact_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or math.isnan(v):
                raise ValueError(f"{name} must be a number, not {v!r}")
        for name in ("weights", "activations", "kv", "routed", "decode_cache", "ort_reuse"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, not {getattr(self, name)!r}")

    @property
    def min_bytes_or_default(self) -> int:
        """``min_bytes``, or the default of the decider these options select."""
        if self.min_bytes is not None:
            return self.min_bytes
        return MIN_BYTES_EXPLICIT if self.budget is None else MIN_BYTES_BUDGET

    @property
    def offloads(self) -> str:
        """``all``, ``weights``, ``activations`` or ``none`` (for messages and metadata)."""
        if self.weights and self.activations:
            return "all"
        return "weights" if self.weights else "activations" if self.activations else "none"


def offload_kinds(offload: str) -> dict[str, bool]:
    """``weights=``/``activations=`` of an ``all|weights|activations|none`` word."""
    if offload not in ("all", "weights", "activations", "none"):
        raise ValueError(f"offload must be all|weights|activations|none, not {offload!r}")
    return {"weights": offload in ("all", "weights"),
            "activations": offload in ("all", "activations")}
