"""Compute time measured on the target: an ORT profile (``ho-onnx profile``) mapped onto
the nodes of the unmodified model; nodes the profile does not name are filled in as
:func:`profile_costs` describes."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..contract import ALL_OPS, HOST_READERS
from ..graph.analyse import GraphAnalysis
from ..target.ort.facts import never_runs
from ..target.ort.profile import read_profile
from .analytic import analytic_costs, node_seconds
from .machine import MACHINES, Machine
from .model import NodeCosts

_FUSION_SEPARATORS = ("/", "_", ":")
DEVICE_SCALED = "profile run time"  # NodeCosts.source of :func:`device_scaled`
_TRANSFER_OPS = frozenset(("MemcpyFromHost", "MemcpyToHost"))
# In the profile of an optimized model: transfers, not compute (a GatherRows or HostMatMul
# does its Gather's or MatMul's work, under that node's name: compute).
CACHE_OPS = frozenset(ALL_OPS) - set(HOST_READERS)


def profile_costs(analysis: GraphAnalysis,
                  profile_json_path: str | os.PathLike[str] | Mapping[str, Any],
                  machine: Machine | None = None,
                  dims: Mapping[str, int] | None = None) -> NodeCosts:
    """Per-node seconds from a profile file, mapped onto ``analysis``'s positions.

    Mapping rule, in order, for each profiled entry:

    1. **index**: the entry's ORT ``node_index`` names an original node with the same op
       type whose name is the entry's name or empty (ORT invents ``<Op>_<i>`` names for
       unnamed nodes); used only when the profile recorded the same node count as the model;
    2. **name**: the entry's name equals an original node's name;
    3. **fusion**: the entry's name starts with an original node's name followed by ``/``,
       ``_`` or ``:`` (ORT names most fused nodes after the node it fused into, e.g.
       ``fc2/MatMulScaleFusion/``); the longest such name wins and the time is *added*
       to that node.

    Nodes matched by 1–3 count towards ``coverage``, and so do Constant nodes (0 s: ORT
    makes them initializers, they never run). Entries left over (nodes ORT created
    with invented names, e.g. ``Gelu`` or ``LayerNormalization`` fusions) form a pool whose
    time is spread over the unmatched nodes in proportion to their analytic estimates, so
    the total equals the profile's. With no pool, unmatched nodes cost 0 when the profile
    ran with ORT optimizations (they were fused into a matched node or folded away) and
    their analytic estimate when it ran with ``opt_level="disable"``. ORT's own copy nodes
    (``MemcpyFromHost``/``MemcpyToHost``) are transfers, not compute, and are skipped, as
    are the cache operators in the profile of an optimized model (``cache_ops``).

    A profile of a GPU provider whose node times are host launch times (``time_basis``
    ``"host"``: ORT's release builds record no device kernels) cannot time nodes; its run
    time is real (a run ends when the device is done). Its nodes get the analytic estimates
    scaled so that they add up to the profile's median run time (:func:`device_scaled`).

    ``machine`` (for the analytic weights) defaults to ``h100`` for a CUDA profile and
    ``cpu`` otherwise; ``dims`` defaults to the dims the profile was taken with.
    """
    prof = profile_json_path if isinstance(profile_json_path, Mapping) else \
        read_profile(profile_json_path)  # (a Mapping: one read_profile already checked)
    if is_launch_time_profile(prof):
        return device_scaled(analysis, prof, machine, dims)
    n = len(analysis.order)
    locate = _Locator(analysis, prof.get("model_nodes") == len(analysis.nodes))
    secs = np.zeros(n, dtype=np.float64)
    matched = np.zeros(n, dtype=bool)
    pool, pool_entries = 0.0, 0
    skip = _TRANSFER_OPS | (CACHE_OPS if prof.get("cache_ops") is True else frozenset())
    for ename, e in ((k, e) for k, e in prof["nodes"].items() if e.get("op") not in skip):
        pos = locate(ename, e)
        if pos is None:
            pool += float(e["median_s"])
            pool_entries += 1
            continue
        secs[pos] += float(e["median_s"])
        matched[pos] = True
    for pos in range(n):  # nodes ORT never runs (Constant: made initializers) cost 0 s
        if not matched[pos] and never_runs(analysis.node_at(pos)):
            matched[pos] = True
    coverage = float(matched.mean()) if n else 1.0
    notes = coverage_notes(prof, coverage, n) + _fill_unmatched(
        analysis, prof, secs, matched, pool, pool_entries, machine, dims)
    return NodeCosts(secs, "profile", coverage, notes, gpu=_gpu(prof))


LOW_COVERAGE = 0.5  # below this fraction of nodes matched, the profile may be another model's


def coverage_notes(prof: Mapping[str, Any], coverage: float, nodes: int) -> list[str]:
    """Say that a profile times under :data:`LOW_COVERAGE` of the model's nodes and was
    taken of a model with another node count, naming it (found by hand: a profile of another
    model was used without a word, its time spread over nodes it never timed). The same
    count: the model's own profile whose nodes ORT renamed (inlined functions), said by the
    cost line's coverage alone."""
    count = prof.get("model_nodes")
    if coverage >= LOW_COVERAGE or not isinstance(count, int) or count == nodes:
        return []
    taken = prof.get("model")
    of = f" ({str(taken)!r})" if isinstance(taken, str) else ""
    return [f"the profile times {coverage:.0%} of this model's {nodes} nodes and was taken of "
            f"a model of {count} nodes{of}: is it this model's? (`ho-onnx profile MODEL --out "
            "FILE` makes one)"]


def _gpu(prof: Mapping[str, Any]) -> bool:
    return not str(prof.get("provider") or "CPU").startswith("CPU")


def is_launch_time_profile(prof: Mapping[str, Any]) -> bool:
    """A profile of a non-CPU provider whose node times are host launch times."""
    return prof.get("time_basis") == "host" and _gpu(prof)


def device_scaled(analysis: GraphAnalysis, prof: Mapping[str, Any],
                  machine: Machine | None = None,
                  dims: Mapping[str, int] | None = None) -> NodeCosts:
    """Analytic node times scaled so their sum is the profile's median run time (a launch-time
    profile of a GPU: its node times say nothing of the device, its run time does)."""
    use_dims = dict(prof.get("dims") or {}) if dims is None else dims
    est = analytic_costs(analysis, machine or MACHINES["h100"], use_dims).seconds
    total = float(prof.get("total_median_s") or 0.0)
    if total <= 0 or est.sum() <= 0:  # nothing measured: the analytic model, timed as such
        return NodeCosts(est, "analytic", 0.0, [
            f"{prof.get('provider')} profile with launch times and no run time: analytic "
            "estimate"])
    scale = total / float(est.sum())
    return NodeCosts(est * scale, DEVICE_SCALED, 1.0, gpu=True, notes=[
        f"{prof.get('provider')} profile records launch times only: analytic estimates "
        f"scaled x{scale:.3g} to its median run time ({total * 1e3:.3g} ms)"])


class _Locator:
    """The schedule position of a profiled entry (rules 1-3 of :func:`profile_costs`)."""

    def __init__(self, analysis: GraphAnalysis, same_model: bool) -> None:
        self.nodes = analysis.nodes
        self.same_model = same_model
        self.pos_of_index = {idx: pos for pos, idx in enumerate(analysis.order)}
        self.pos_of_name: dict[str, int] = {}
        for pos, node in enumerate(analysis.nodes):
            if node.name:
                self.pos_of_name.setdefault(node.name, pos)
        self.names_by_len = sorted(self.pos_of_name, key=len, reverse=True)

    def __call__(self, ename: str, e: Mapping[str, Any]) -> int | None:
        idx = e.get("index")
        if self.same_model and isinstance(idx, int) and idx in self.pos_of_index:
            node = self.nodes[self.pos_of_index[idx]]
            if node.op_type == e.get("op") and (node.name or "") in (ename, ""):
                return self.pos_of_index[idx]
        pos = self.pos_of_name.get(ename)
        if pos is not None:
            return pos
        for cand in self.names_by_len:
            if ename.startswith(cand) and ename[len(cand):len(cand) + 1] in _FUSION_SEPARATORS:
                return self.pos_of_name[cand]
        return None


def _fill_unmatched(analysis: GraphAnalysis, prof: Mapping[str, Any], secs: np.ndarray,
                    matched: np.ndarray, pool: float, pool_entries: int,
                    machine: Machine | None, dims: Mapping[str, int] | None) -> list[str]:
    """Give the unmatched nodes their time (the pool, an estimate or 0); say what was done."""
    unmatched = np.flatnonzero(~matched)
    if not len(unmatched):
        if pool > 0:
            return [f"{pool_entries} profiled entries ({pool:.3g} s) matched no node: dropped"]
        return []
    optimized = prof.get("opt_level", "all") != "disable"
    if pool <= 0 and optimized:
        return [f"{len(unmatched)} nodes not in the optimized profile: 0 s "
                "(fused or folded by ORT)"]
    if machine is None:
        prov = str(prof.get("provider", ""))
        machine = MACHINES["h100" if prov.startswith("CUDA") else "cpu"]
    use_dims = dict(prof.get("dims") or {}) if dims is None else dims
    est = np.array([node_seconds(machine, analysis, int(p), use_dims) for p in unmatched])
    if pool <= 0:
        secs[unmatched] = est
        return [f"{len(unmatched)} nodes not in the profile: analytic estimate"]
    w = est / est.sum() if est.sum() > 0 else np.full(len(est), 1.0 / len(est))
    secs[unmatched] = pool * w
    return [f"{pool_entries} profiled entries ({pool:.3g} s) matched no node: "
            f"spread over {len(unmatched)} unmatched nodes"]
