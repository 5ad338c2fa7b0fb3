"""ho-onnx: compiler-driven offloading (HyperOffload) for ONNX Runtime.

A rewriter turns an unmodified ONNX model into one whose chosen tensors live off the fast
tier between uses, with explicit cache operators (domain ``ai.hyperoffload``), and a
custom-op library executes them inside an ordinary ORT session.

Glossary (full version and the op contract: docs/design.md)
    fast tier        memory the kernels read (GPU memory; ORT's buffers on the CPU EP)
    slow tier        the library's host store / host pool (later: disk)
    residency        the schedule interval during which a tensor occupies the fast tier
    prefetch window  the compute between a Prefetch being issued and its Wait
    overlap ratio    compute time in a prefetch window / the transfer's time (>= 1 hides it)
    channel          a FIFO transfer queue per direction (load, store)
    ordering input   an extra cache-op input meaning only "not before"

Passes: :mod:`ho_onnx.loader` → :mod:`ho_onnx.analysis` → :mod:`ho_onnx.choice` →
:mod:`ho_onnx.insertion` → :mod:`ho_onnx.save`, chained by :func:`optimize`.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_RUNTIME = ("InferenceSession", "session_options", "library_path", "include_dir", "counters",
            "reset_counters", "build_info")


def __getattr__(name: str) -> Any:  # runtime names load the compiled library lazily
    if name in _RUNTIME:
        from . import runtime

        return getattr(runtime, name)
    if name in ("optimize", "OptimizeResult"):
        from . import pipeline

        return getattr(pipeline, name)
    if name == "OffloadPolicy":
        from .choice import OffloadPolicy

        return OffloadPolicy
    raise AttributeError(f"module 'ho_onnx' has no attribute {name!r}")


__all__ = ["OffloadPolicy", "OptimizeResult", "__version__", "optimize", *_RUNTIME]
