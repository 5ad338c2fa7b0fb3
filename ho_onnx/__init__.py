"""ho-onnx: compiler-driven offloading (HyperOffload) for ONNX Runtime.

A rewriter turns an unmodified ONNX model into one whose chosen tensors live off the fast
tier between uses, with explicit cache operators (domain ``ai.hyperoffload``), and a
custom-op library executes them inside an ordinary ORT session.

Glossary (full version and the op contract: docs/design.md)
    fast tier        memory the kernels read (GPU memory; ORT's buffers on the CPU EP)
    slow tier        the library's host store / host pool, or the disk (a disk-tier
                     weight is read from its data file at every reload)
    residency        the schedule interval during which a tensor occupies the fast tier
    prefetch window  the compute between a Prefetch being issued and its Wait
    overlap ratio    compute time in a prefetch window / the transfer's time (>= 1 hides it)
    channel          a FIFO transfer queue per direction (load: slow→fast, store:
                     fast→slow, disk: file→fast)
    ordering input   an extra cache-op input meaning only "not before"

Packages, lower layers first (each imports only from those before it): :mod:`.graph`
(load, analyse, save) → :mod:`.target.ort` (ORT: facts, sessions, verify, profile) →
:mod:`.cost` → :mod:`.schedule` (options, deciders, simulation) → :mod:`.rewrite` (insert,
annotate, place data, :func:`optimize`) → :mod:`.report`. The command line (top-level
``cli/``, installed as ``ho_onnx.cli``) sits on top and is never imported by the library.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {  # name -> module that defines it (imported on first use: ORT loads lazily)
    **dict.fromkeys(("InferenceSession", "session_options", "library_path", "include_dir",
                     "counters", "reset_counters", "build_info"), ".target.ort.runtime"),
    **dict.fromkeys(("optimize", "plan_model", "OptimizeResult"), ".rewrite.pipeline"),
    "OffloadOptions": ".schedule.options",
    "ExplicitPolicy": ".schedule.policy",
    "BudgetPlanner": ".schedule.planner",
    "CostSource": ".cost.source",
}


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name], __name__), name)
    raise AttributeError(f"module 'ho_onnx' has no attribute {name!r}")


__all__ = ["__version__", *_PUBLIC]
