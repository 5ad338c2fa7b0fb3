"""Pre-apply ONNX Runtime's own graph optimizations, so the planner sees the graph ORT runs.

ORT fuses and folds nodes when it loads a model (MatMul+Add→Gemm, LayerNorm/Gelu fusions,
constant folding...). Planning on the unmodified graph then schedules transfers around
nodes that will not exist. ``ort_optimize`` lets ORT save its optimized model (its
``optimized_model_filepath`` option), initializers of 1 KiB and more in an external-data
file beside it, and the planner works on that. It needs the weight bytes (ORT reads them),
so unlike planning itself it is not free on huge models: it is an opt-in step.
"""

from __future__ import annotations

import os
from pathlib import Path

from ...errors import HoOnnxError
from .isolate import run_isolated
from .session import ort_opt_level, require_providers

LEVELS = ("basic", "extended")


def ort_optimize(model: str | os.PathLike[str], out: str | os.PathLike[str], level: str = "basic",
                 providers: list[str] | None = None, *, isolate: bool = True) -> Path:
    """Write ORT's ``level`` optimization of ``model`` to ``out`` (data in ``<out>.data``).

    ``basic`` keeps standard ONNX ops (constant folding, redundant node removal, simple
    fusions); ``extended`` adds ORT's contrib fusions (com.microsoft ops), which only ORT
    runs. ``all`` is not offered: its layout transformations are provider specific.
    ORT runs in a child process unless ``isolate`` is false (:mod:`.isolate`).
    """
    if level not in LEVELS:
        raise HoOnnxError(f"ORT optimization level must be one of {LEVELS}, not {level!r}")
    if isolate:
        return run_isolated(ort_optimize, model, out, level, providers, isolate=False,
                            what=f"optimizing {os.fspath(model)!r}")
    import onnxruntime as ort

    out = Path(out)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort_opt_level(level)
    so.optimized_model_filepath = str(out)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                f"{out.name}.data")
    so.add_session_config_entry(
        "session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    providers = providers or ["CPUExecutionProvider"]
    try:
        sess = ort.InferenceSession(os.fspath(model), so, providers=providers)
    except Exception as e:  # ORT's own load errors
        raise HoOnnxError(f"ONNX Runtime could not load {os.fspath(model)!r} to optimize it: "
                          f"{str(e).splitlines()[0]}") from None
    require_providers(sess, providers, f"optimizing {os.fspath(model)!r}")
    if not out.is_file():
        raise HoOnnxError(f"ONNX Runtime did not write its optimized model to {str(out)!r}")
    return out
