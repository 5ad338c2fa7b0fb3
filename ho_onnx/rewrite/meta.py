"""The keys under which the rewrite steps hand their results on in ``model.meta``
(:mod:`.passes`, :mod:`.branches`), and the precondition check that reads one."""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

CONTRIB = "ho_onnx.contrib"
ANALYSIS = "ho_onnx.analysis"
DECISION = "ho_onnx.decision"
SPLITS = "ho_onnx.splits"  # (the weights streamed in blocks or kept whole, rewrite/blocks.py)
REWRITTEN = "ho_onnx.rewritten"
OUTPUT_FILES = "ho_onnx.output_files"
BRANCHES = "ho_onnx.branches"  # (planned If branches, reasons of the weights left resident)


def need(model: ir.Model, key: str, producer: str) -> Any:
    """``model.meta[key]``; raises ``onnx_ir.passes.PreconditionError`` naming the pass to
    run first when it is missing."""
    if key not in model.meta:
        raise ir.passes.PreconditionError(f"{key} missing: run {producer} first")
    return model.meta[key]
