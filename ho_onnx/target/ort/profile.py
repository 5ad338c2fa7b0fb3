"""``ho-onnx profile``: per-node times of an unmodified model measured by ORT's profiler.

The model runs ``warmup + runs`` times on random inputs in one session with
``enable_profiling``; ORT's chrome-trace file (written into a temporary folder and
deleted afterwards) is parsed: every ``model_run`` session event delimits one run, the
first ``warmup`` runs are dropped, and each node's ``<name>_kernel_time`` events are summed
per run and reduced to the median over the measured runs. Events nested inside another
node's event on the same thread (nodes of If/Loop/Scan bodies) are already counted in
their parent and skipped. Where ORT also recorded device kernels (``cat: "Kernel"``, a
build with CUDA profiling) a node's time is the sum of its kernels; otherwise it is the
host time of the node's ``Compute``, which on a GPU is only the launch time (the output
then carries a ``warning``, and the planner uses only the run time:
:func:`ho_onnx.cost.profiled.device_scaled`).

Output (JSON)::

    {"format": "ho-onnx-profile", "version": 1, "model": ..., "provider": ...,
     "providers": [...], "dims": {...}, "opt_level": ..., "runs": n, "warmup": w,
     "model_nodes": len(graph.node), "ort_version": ..., "time_basis": "host"|"device",
     "nodes": {name: {"op": ..., "median_s": ..., "runs": k, "index": ORT node index,
                      "provider": ...}},
     "total_median_s": median wall time of one run, "nodes_sum_s": sum of node medians}
"""

from __future__ import annotations

import bisect
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ...contract import DOMAIN
from ...errors import HoOnnxError, Log, UnboundDimError, quiet
from ...graph.dims import check_bindings
from ...graph.save import read_json, write_atomic
from .isolate import check_timeout, run_isolated
from .session import (
    OPT_LEVELS,
    checked_inputs,
    model_for_ort,
    ort_opt_level,
    require_providers,
    run_outputs,
)

_KERNEL_SUFFIX = "_kernel_time"


class ProfilingError(HoOnnxError):
    """ORT's profile could not be taken or read."""


class ProfileError(HoOnnxError):
    """A per-node profile file is missing or not in the expected format."""


PROFILE_FORMAT = "ho-onnx-profile"
#: A profile holds ~100 bytes a node: 256 MiB is millions of nodes, and a device or a
#: runaway file is refused before it is read.
MAX_PROFILE_BYTES = 256 << 20


def read_profile(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load and check a per-node times file written by :func:`profile_model`."""
    p = Path(path)
    try:
        data = read_json(p, MAX_PROFILE_BYTES)
    except FileNotFoundError:
        raise ProfileError(f"profile file {str(p)!r} does not exist "
                           "(make one with `ho-onnx profile MODEL`)") from None
    except (OSError, ValueError, RecursionError) as e:
        raise ProfileError(f"profile file {str(p)!r} is not readable JSON: {e}") from None
    if isinstance(data, list) or (isinstance(data, dict) and "traceEvents" in data):
        raise ProfileError(f"profile file {str(p)!r} looks like ORT's raw trace; convert it "
                           "with `ho-onnx profile` (per-node medians) first")
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), dict):
        raise ProfileError(f"profile file {str(p)!r} is not a ho-onnx profile: "
                           "expected a JSON object with a 'nodes' object")
    for name, e in data["nodes"].items():
        if not isinstance(e, dict) or not _seconds(e.get("median_s"), MAX_NODE_S):
            raise ProfileError(f"profile file {str(p)!r}: node {name!r} has no valid "
                               f"'median_s' (seconds, 0 to {MAX_NODE_S:g})")
    if data.get("total_median_s") is not None and not _seconds(data["total_median_s"],
                                                               MAX_RUN_S):
        raise ProfileError(f"profile file {str(p)!r}: 'total_median_s' must be seconds, 0 "
                           f"to {MAX_RUN_S:g}")
    dims = data.get("dims")
    try:
        if dims is not None and not isinstance(dims, dict):
            raise UnboundDimError("not an object of dim names and sizes")
        check_bindings(dims)
    except UnboundDimError as e:
        raise ProfileError(f"profile file {str(p)!r}: 'dims': {e}") from None
    return data


# A profile's times are checked against these (a node of over ~11 days, a run of over ~30
# years: a broken file; NaN, infinite or huge times would make every plan's times NaN).
MAX_NODE_S = 1e6
MAX_RUN_S = 1e9


def _seconds(v: object, limit: float) -> bool:
    return (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            and 0 <= v <= limit)


def _host_times_warning(provider: str) -> str:
    return (f"{provider}: node times are host-side launch times (this ORT build records no "
            "device kernels): the planner uses its analytic estimates scaled to this "
            "profile's run time, and times loads as the CUDA engine issues them")


def profile_model(model_path: str | os.PathLike[str], out_json: str | os.PathLike[str] | None,
                  *, providers: Sequence[str] = ("CPUExecutionProvider",),
                  dims: Mapping[str, int] | None = None, runs: int = 10, warmup: int = 2,
                  opt_level: str = "all", seed: int = 0, int_high: int = 8,
                  intra_op_threads: int | None = None,
                  shapes: Mapping[str, list[int]] | None = None,
                  isolate: bool = True, timeout_s: float | None = None,
                  log: Log | None = None) -> dict[str, Any]:
    """Profile ``model_path`` with ORT and write per-node median times to ``out_json``.

    ``opt_level`` is ORT's graph optimization level (``disable`` keeps every original node,
    so every node gets its own time; ``all`` measures what really runs, fused). Returns the
    dict that is written (``out_json=None`` writes nothing). ORT runs in a child process
    unless ``isolate`` is false (:mod:`.isolate`), ended after ``timeout_s`` seconds (None:
    ``HO_ONNX_ORT_TIMEOUT``, unset: no limit; 0: no limit). ``log`` gets a line as the
    session is ready and after each run (from the child as it runs).
    """
    if runs < 1 or warmup < 0:
        raise ValueError(f"runs must be >= 1 and warmup >= 0 (got {runs}, {warmup})")
    if opt_level not in OPT_LEVELS:
        raise ValueError(f"opt_level must be one of {OPT_LEVELS}, got {opt_level!r}")
    check_timeout(timeout_s, isolate)
    if isolate:
        return run_isolated(
            profile_model, model_path, out_json, providers=providers, dims=dims, runs=runs,
            warmup=warmup, opt_level=opt_level, seed=seed, int_high=int_high,
            intra_op_threads=intra_op_threads, shapes=shapes, isolate=False,
            timeout_s=timeout_s, log=log, what=f"profiling {os.fspath(model_path)!r}")
    import onnxruntime as ort

    dims = dict(dims or {})
    model = model_for_ort(model_path)
    feeds = checked_inputs(model, dims, seed=seed, int_high=int_high, shapes=shapes)
    cache_ops = any(n.domain == DOMAIN for n in model.graph.node)  # an optimized model
    trace, used = _run_profiled(model_path, feeds, providers, opt_level, warmup, runs,
                                intra_op_threads, log or quiet, cache_ops)
    nodes, totals, basis = parse_trace(trace, warmup=warmup)
    result: dict[str, Any] = {
        "format": PROFILE_FORMAT,
        "version": 1,
        "model": os.path.abspath(os.fspath(model_path)),
        "provider": used[0] if used else None,
        "providers": list(providers),
        "dims": dims,
        "opt_level": opt_level,
        "runs": len(totals),
        "warmup": warmup,
        "model_nodes": len(model.graph.node),
        "cache_ops": cache_ops,
        "ort_version": ort.__version__,
        "time_basis": basis,
        "nodes": nodes,
        "total_median_s": statistics.median(totals) if totals else 0.0,
        "nodes_sum_s": sum(e["median_s"] for e in nodes.values()),
    }
    if basis == "host" and any(not p.startswith("CPU") for p in used[:1]):
        result["warning"] = _host_times_warning(used[0])
    if out_json is not None:
        write_atomic(out_json, (json.dumps(result, indent=1) + "\n").encode())
    return result


def _run_profiled(model_path: str | os.PathLike[str], feeds: Mapping[str, Any],
                  providers: Sequence[str], opt_level: str, warmup: int, runs: int,
                  intra_op_threads: int | None, say: Log, cache_ops: bool = False
                  ) -> tuple[Any, list[str]]:
    """ORT's chrome trace of ``warmup`` then ``runs`` runs (written in a temporary folder,
    then removed) and the providers the session used; ``say`` hears of the session and
    each run. ``cache_ops``: the model is an optimized one, run with the ho-onnx library
    as ``ho_onnx.InferenceSession`` runs it (found by hand: ORT refused its ops)."""
    import onnxruntime as ort

    from .runtime import session_options

    so = ort.SessionOptions()
    so.graph_optimization_level = ort_opt_level(opt_level)
    if intra_op_threads is not None:
        so.intra_op_num_threads = intra_op_threads
    tmp = tempfile.mkdtemp(prefix="ho_onnx_profile_")
    try:
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tmp, "ort")
        if cache_ops:
            so = session_options(model_path, base=so)
        t = time.perf_counter()
        sess = ort.InferenceSession(os.fspath(model_path), sess_options=so,
                                    providers=list(providers))
        require_providers(sess, providers, f"profiling {os.fspath(model_path)!r}")
        say(f"session ready ({time.perf_counter() - t:.2f} s, {sess.get_providers()[0]})")
        try:
            for i in range(warmup + runs):
                t = time.perf_counter()
                run_outputs(sess, feeds, repr(os.fspath(model_path)))
                which = (f"warm-up run {i + 1}/{warmup}" if i < warmup
                         else f"run {i - warmup + 1}/{runs}")
                say(f"{which}: {(time.perf_counter() - t) * 1e3:.1f} ms")
        finally:
            trace_path = sess.end_profiling()
        with open(trace_path) as f:
            return json.load(f), sess.get_providers()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def parse_trace(trace: Any, *, warmup: int = 0
                ) -> tuple[dict[str, dict[str, Any]], list[float], str]:
    """Per-node medians from ORT's chrome-trace events.

    Returns ``(nodes, run_seconds, time_basis)``: ``nodes`` as in the output file,
    ``run_seconds`` the wall time of each measured run, ``time_basis`` ``"device"`` when
    kernel events were used.
    """
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list):
        raise ProfilingError("ORT profile: expected a list of trace events")
    events = [e for e in events if isinstance(e, dict) and "ts" in e]
    runs = _Runs(events, warmup)
    node_events = [e for e in events if e.get("cat") == "Node"
                   and str(e.get("name", "")).endswith(_KERNEL_SUFFIX)]
    top = _top_level(node_events)
    device = _device_times(events, top, runs)
    per_run: dict[str, dict[int, float]] = {}
    meta: dict[str, dict[str, Any]] = {}
    for e in node_events:
        r = runs.of(int(e["ts"]))
        if id(e) not in top or r is None or r < warmup:
            continue
        name = e["name"][: -len(_KERNEL_SUFFIX)]
        d = per_run.setdefault(name, {})
        d[r] = d.get(r, 0.0) + int(e.get("dur", 0)) * 1e-6
        if name not in meta:
            args = e.get("args") or {}
            idx = args.get("node_index")
            meta[name] = {"op": args.get("op_name"),
                          "index": int(idx) if str(idx).isdigit() else None,
                          "provider": args.get("provider")}
    nodes: dict[str, dict[str, Any]] = {}
    for name, d in per_run.items():
        times = [device.get((r, name), t) for r, t in sorted(d.items())]
        nodes[name] = {**meta[name], "median_s": statistics.median(times), "runs": len(times)}
    return nodes, runs.measured_seconds(), "device" if device else "host"


class _Runs:
    """The runs of a trace: each ``model_run`` session event (older ORT:
    ``SequentialExecutor::Execute``) delimits one."""

    def __init__(self, events: list[dict[str, Any]], warmup: int) -> None:
        for name in ("model_run", "SequentialExecutor::Execute"):
            self.windows = sorted((int(e["ts"]), int(e["ts"]) + int(e.get("dur", 0)))
                                  for e in events if e.get("cat") == "Session"
                                  and e.get("name") == name)
            if self.windows:
                break
        if not self.windows:
            raise ProfilingError("ORT profile has no 'model_run' events: cannot tell runs apart")
        if len(self.windows) <= warmup:
            raise ProfilingError(f"ORT profile has {len(self.windows)} runs, no more than the "
                                 f"{warmup} warm-up runs")
        self.warmup = warmup
        self.starts = [w[0] for w in self.windows]

    def of(self, ts: int) -> int | None:
        """The run a timestamp falls in (None: between runs)."""
        i = bisect.bisect_right(self.starts, ts) - 1
        return i if i >= 0 and ts <= self.windows[i][1] else None

    def measured_seconds(self) -> list[float]:
        return [(b - a) * 1e-6 for a, b in self.windows[self.warmup:]]


def _top_level(node_events: list[dict[str, Any]]) -> set[int]:
    """Ids of the node events not nested in another node event of the same thread (nodes of
    If/Loop/Scan bodies are counted in their parent)."""
    ordered = sorted(node_events, key=lambda e: (e.get("tid"), int(e["ts"]), -int(e.get("dur", 0))))
    top: set[int] = set()
    last_tid, open_end = None, -1
    for e in ordered:
        ts, end = int(e["ts"]), int(e["ts"]) + int(e.get("dur", 0))
        if e.get("tid") != last_tid:
            last_tid, open_end = e.get("tid"), -1
        if ts < open_end and end <= open_end:
            continue  # inside the previous top-level node (a subgraph's node)
        top.add(id(e))
        open_end = end
    return top


def _device_times(events: list[dict[str, Any]], top: set[int], runs: _Runs
                  ) -> dict[tuple[int, str], float]:
    """Seconds of device kernels per (run, node), attributed to their parent node (by name,
    else the node before them in the file)."""
    device: dict[tuple[int, str], float] = {}
    parent: dict[str, Any] | None = None
    for e in events:  # file order: kernels follow the node that launched them
        if e.get("cat") == "Node" and id(e) in top:
            parent = e
        elif e.get("cat") == "Kernel":
            pname = (e.get("args") or {}).get("parent_name")
            owner = pname + _KERNEL_SUFFIX if pname else (parent or {}).get("name")
            r = runs.of(int(parent["ts"])) if parent is not None and not pname else runs.of(
                int(e["ts"]))
            if owner and r is not None:
                key = (r, owner[: -len(_KERNEL_SUFFIX)])
                device[key] = device.get(key, 0.0) + int(e.get("dur", 0)) * 1e-6
    return device


def summary(result: Mapping[str, Any], top: int = 10) -> str:
    """A short text report of a profile: totals and the slowest nodes."""
    nodes = result["nodes"]
    lines = [f"{result['model']}: {len(nodes)} nodes profiled on {result['provider']} "
             f"({result['runs']} runs, opt_level={result['opt_level']}), "
             f"run median {result['total_median_s'] * 1e3:.3f} ms, "
             f"node sum {result['nodes_sum_s'] * 1e3:.3f} ms"]
    for name, e in sorted(nodes.items(), key=lambda kv: -kv[1]["median_s"])[:top]:
        lines.append(f"  {e['median_s'] * 1e6:10.1f} us  {e['op']:<20} {name}")
    if "warning" in result:
        lines.append(f"warning: {result['warning']}")
    return "\n".join(lines)
