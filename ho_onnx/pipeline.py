"""``optimize``: load → analyse → choose → insert → save, with progress."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__
from .analysis import GraphAnalysis, analyse
from .choice import OffloadChoice, OffloadPolicy, choose
from .insertion import RewrittenModel, insert_cache_ops
from .loader import load_model
from .save import Progress, SaveReport, check_output_path, save_model

Log = Callable[[str], None]


@dataclass
class OptimizeResult:
    """Everything one optimize run decided and wrote, and how long each pass took."""

    analysis: GraphAnalysis
    choice: OffloadChoice
    rewritten: RewrittenModel
    report: SaveReport
    seconds: dict[str, float] = field(default_factory=dict)


def plan_metadata(choice: OffloadChoice, dims: Mapping[str, int]) -> dict[str, str]:
    """The plan as recorded in the output's ``metadata_props`` (keys prefixed ``ho_onnx.``)."""
    p = choice.policy
    return {
        "version": __version__,
        "policy": f"offload={p.what} min_bytes={p.min_bytes} min_gap={p.min_gap} "
        f"prefetch_distance={p.prefetch_distance}",
        "dims": ",".join(f"{k}={v}" for k, v in sorted(dims.items())),
        "offloaded_weights": str(len(choice.weights)),
        "offloaded_activations": str(len(choice.activations)),
        "offloaded_bytes": str(choice.offloaded_bytes),
        "host_bytes": str(sum(w.nbytes for w in choice.weights)
                          + sum(a.nbytes or 0 for a in choice.activations)),
    }


def optimize(in_path: str | os.PathLike[str], out_path: str | os.PathLike[str],
             policy: OffloadPolicy | None = None, dims: Mapping[str, int] | None = None, *,
             log: Log | None = None, progress: Progress | None = None) -> OptimizeResult:
    """Rewrite ``in_path`` into ``out_path`` with cache operators (input never modified)."""
    policy = policy or OffloadPolicy()
    dims = dict(dims or {})
    say = log or (lambda _msg: None)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    loaded = load_model(in_path)
    check_output_path(loaded, out_path)  # fail before any work
    seconds["load"] = time.perf_counter() - t0
    say(f"loaded {Path(in_path).name}: {len(loaded.model.graph.node)} nodes, "
        f"{len(loaded.model.graph.initializer)} initializers ({seconds['load']:.2f} s)")
    t = time.perf_counter()
    analysis = analyse(loaded.model, dims)
    seconds["analyse"] = time.perf_counter() - t
    say(f"analysed {len(analysis.tensors)} tensors ({seconds['analyse']:.2f} s)")
    t = time.perf_counter()
    choice = choose(analysis, policy, dims)
    rewritten = insert_cache_ops(analysis, choice)
    seconds["rewrite"] = time.perf_counter() - t
    say(f"offloading {len(choice.weights)} weights and {len(choice.activations)} activations "
        f"({choice.offloaded_bytes / 2**20:.1f} MiB), {rewritten.cache_nodes} cache ops "
        f"({seconds['rewrite']:.2f} s)")
    t = time.perf_counter()
    report = save_model(rewritten, loaded, out_path, progress=progress,
                        metadata=plan_metadata(choice, dims))
    seconds["save"] = time.perf_counter() - t
    say(f"wrote {report.model_path} ({seconds['save']:.2f} s)"
        + (f", copied {len(report.copied)} data file(s)" if report.copied else ""))
    return OptimizeResult(analysis, choice, rewritten, report, seconds)
