"""The expert cache (issue 37): routed expert weights of a streamed tier (``disk``: read from
their file at every reload) kept by the library across runs in a cache of ``capacity``
bytes, least recently used first out, so a hot expert is not read again (``csrc/
expert_cache.h``). The decision is its capacity: from the options (``expert_cache``:
bytes, or ``auto``: the slack the budget planner's plan leaves under the budget, none
without a budget), counted in the plan's memory and recorded on every cached Prefetch
(attribute ``expert_cache``).

Why ``auto`` takes only the slack: under the cost model's uniform routing, a cache of ``C``
bytes serves ``C / N`` of the reloads, exactly what keeping ``C`` bytes of experts resident
serves, without the misses' reads; so the planner never trades resident bytes for a cache
(tried: plans for the budget less a quarter to all of the experts' bytes, each with its
cache, were never predicted faster on the tests' Qwen3-MoE at 30-75 % of its peak, with
the CPU preset or a 2 MB/s disk). The cache pays where routing repeats itself, which the
plan cannot know from the graph (the bench's random-weight Qwen3-MoE: 97 % hits with half
the experts); an explicit size makes that trade (the plan is made for the budget less it).

Only streamed tiers are cached: a reload from a tier in host memory is a copy from host
memory on the CPU EP, which a cache in host memory would only repeat (on the CUDA EP a
device-memory cache would turn its H2D copy into a D2D one: not built, the CUDA engine
streams every load).

The cost model's expected hit rate (:func:`expected_hit`): with uniform routing an LRU
cache of ``C`` of the experts' ``N`` bytes serves ``C / N`` of the reloads (exact for
independent uniform references; an LRU simulation of uniform top-k routing in step order
measured 0.19-0.24 at C/N = 0.25 and 0.67-0.73 at 0.75), none when it cannot hold one
step's selection (the next step finds every entry evicted: a scan), all when it holds every
expert.
"""

from __future__ import annotations

from dataclasses import replace

from .. import kinds
from .options import OffloadOptions
from .types import OffloadChoice, WeightOffload


def cacheable(w: WeightOffload) -> bool:
    """Whether ``w``'s reloads go through the expert cache: routed, from a streamed tier."""
    return bool(w.gates) and any(w.gates) and not kinds.tier(w.tier).in_host_memory


def cacheable_bytes(choice: OffloadChoice) -> int:
    """Bytes the cache would hold to keep every cacheable weight (one entry per weight)."""
    return sum(w.nbytes for w in choice.weights if cacheable(w))


def step_bytes(choice: OffloadChoice) -> float:
    """Expected bytes of cacheable weights one run selects (each at its routed share)."""
    return sum(w.nbytes * w.fraction for w in choice.weights if cacheable(w))


def expected_hit(capacity: int, choice: OffloadChoice) -> float:
    """The share of cacheable reloads the cache is expected to serve (module docstring)."""
    total = cacheable_bytes(choice)
    if capacity <= 0 or total <= 0:
        return 0.0
    if capacity >= total:
        return 1.0
    return capacity / total if capacity >= step_bytes(choice) else 0.0


def asked(options: OffloadOptions) -> int | None:
    """The capacity the options ask for in bytes, or None for ``auto``."""
    return None if options.expert_cache == "auto" else int(options.expert_cache)


def with_cache(choice: OffloadChoice, capacity: int) -> OffloadChoice:
    """``choice`` with an expert cache of ``capacity`` bytes (at most what every cacheable
    weight needs; 0 when none is cacheable or it cannot hold the smallest):
    ``choice.expert_cache`` and each cacheable weight's expected ``hit`` set (in place;
    returned)."""
    capacity = max(0, min(capacity, cacheable_bytes(choice)))
    if capacity < min((w.nbytes for w in choice.weights if cacheable(w)), default=0):
        capacity = 0  # (it could not hold one entry)
    hit = expected_hit(capacity, choice)
    choice.expert_cache = capacity
    choice.weights[:] = [replace(w, hit=hit if capacity and cacheable(w) else 0.0)
                         for w in choice.weights]
    return choice


def describe(choice: OffloadChoice) -> str:
    """One line of the cache for plan reports ("" without one)."""
    from ..units import format_bytes

    if not choice.expert_cache:
        return ""
    hit = next((w.hit for w in choice.weights if cacheable(w)), 0.0)
    return (f"expert cache {format_bytes(choice.expert_cache, unit='MiB', digits=1)} (LRU) "
            f"of {format_bytes(cacheable_bytes(choice), unit='MiB', digits=1)} of "
            f"streamed experts: expected hit rate {hit:.0%}")
