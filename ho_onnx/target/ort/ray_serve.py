"""Serve a model over HTTP with Ray Serve replicas (the ``serve`` extra: ``ray[serve]``).

Each replica is one process with one ONNX Runtime session: an optimized model gets ho-onnx's
session options (the library, its folder, PRIORITY_BASED order, memory patterns off); the
unmodified model the same options without the library, for comparison. Requests carry numpy
arrays as an ``.npz`` body (bit-exact, any dtype):

* ``POST /<route>``: the body is ``numpy.savez`` of the inputs by name; the answer is
  ``numpy.savez`` of every output by name.
* ``GET /<route>``: JSON ``{"pid": ..., "counters": ho_onnx.counters()}`` of the replica
  that answers (its host store and pool, and with ``sample_arena`` its ORT arena peak).

``max_ongoing_requests`` (default 1) is the runs a replica makes at once: each run's memory
is what the plan budgeted, so a replica holds one run's worth. docs/serving.md has the
recipe and the measured figures (bench/serve_ray.py).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ...contract import CONFIG_HOST_POOL_LIMIT, CONFIG_SAMPLE_ARENA


def pack(arrays: dict[str, np.ndarray]) -> bytes:
    """``arrays`` as an ``.npz`` body."""
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    return buf.getvalue()


def unpack(body: bytes) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` body (no pickled objects)."""
    with np.load(io.BytesIO(body), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


class OrtReplica:
    """One replica: a CPU session of ``model`` (``optimized``: with the ho-onnx library)."""

    def __init__(self, model: str, optimized: bool, threads: int = 1,
                 host_pool_limit: int | None = None, sample_arena: bool = False,
                 opt_level: str = "all") -> None:
        import onnxruntime as ort

        from .runtime import session_options
        from .session import ort_opt_level

        so = ort.SessionOptions()
        so.graph_optimization_level = ort_opt_level(opt_level)
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        # Prepacking off in both: an optimized model's weights are not constants, so its
        # MatMuls run unpacked; the unmodified model then runs the same kernels.
        so.add_session_config_entry("session.disable_prepacking", "1")
        if optimized:
            if host_pool_limit is not None:
                so.add_session_config_entry(CONFIG_HOST_POOL_LIMIT, str(host_pool_limit))
            if sample_arena:
                so.add_session_config_entry(CONFIG_SAMPLE_ARENA, "1")
            so = session_options(model, base=so)
        else:
            so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
            so.enable_mem_pattern = False
        self.session = ort.InferenceSession(model, sess_options=so,
                                            providers=["CPUExecutionProvider"])
        self.outputs = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.outputs, self.session.run(None, feeds), strict=True))

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, Response

        from .runtime import counters

        if request.method == "GET":
            return JSONResponse({"pid": os.getpid(), "counters": counters()})
        feeds = unpack(await request.body())
        out = await asyncio.to_thread(self.run, feeds)
        return Response(pack(out), media_type="application/octet-stream")


def deployment(model: str | os.PathLike[str], *, optimized: bool, replicas: int = 2,
               max_ongoing_requests: int = 1, threads: int = 1,
               host_pool_limit: int | None = None, sample_arena: bool = False,
               opt_level: str = "all", name: str = "model") -> Any:
    """A bound Ray Serve application of ``replicas`` :class:`OrtReplica` of ``model``
    (``serve.run(deployment(...), route_prefix=...)`` serves it). ``opt_level`` is ORT's
    graph optimization level (``disable`` ... ``all``): ORT fuses and folds an unmodified
    model's constant weights, not an optimized model's offloaded ones, so answers are
    bit-equal at ``disable`` and may differ in the last bits above it."""
    from ray import serve

    path = str(Path(model).resolve())
    d = serve.deployment(OrtReplica, name=name, num_replicas=replicas,
                         max_ongoing_requests=max_ongoing_requests,
                         ray_actor_options={"num_cpus": threads})
    return d.bind(path, optimized, threads, host_pool_limit, sample_arena, opt_level)


def replica_stats(url: str, tries: int = 64) -> dict[int, dict[str, Any]]:
    """``GET url`` ``tries`` times: the answers by replica pid (each replica's counters)."""
    import urllib.request

    seen: dict[int, dict[str, Any]] = {}
    for _ in range(tries):
        with urllib.request.urlopen(url, timeout=30) as r:
            s = json.loads(r.read())
        seen[s["pid"]] = s["counters"]
    return seen
