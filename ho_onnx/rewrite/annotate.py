"""Record a decision in the rewritten model's ``metadata_props`` (keys ``ho_onnx.*``)."""

from __future__ import annotations

from collections.abc import Mapping

import onnx_ir as ir

from .. import __version__, contract
from ..schedule.types import Decision


def plan_metadata(decision: Decision, dims: Mapping[str, int]) -> dict[str, str]:
    """The decision as recorded: the decider's own entries, the version and the dims."""
    return decision.metadata() | {
        "version": __version__,
        "dims": ",".join(f"{k}={v}" for k, v in sorted(dims.items())),
    }


def annotate(model: ir.Model, metadata: Mapping[str, str]) -> None:
    """Set ``ho_onnx.<key>`` entries of ``model.metadata_props`` (in place, replacing)."""
    for k, v in metadata.items():
        model.metadata_props[contract.META_PREFIX + k] = str(v)
