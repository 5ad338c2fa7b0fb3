"""Errors raised by ho_onnx: each names the problem in words a user can act on; and
:data:`Log`, how a long step tells its caller how it goes."""

from __future__ import annotations

from collections.abc import Callable

Log = Callable[[str], None]
"""Takes a step's progress messages, one line each (``log=`` of the long steps)."""


def quiet(_msg: str) -> None:
    """The :data:`Log` of a caller that wants no messages (``say = log or quiet``)."""


class HoOnnxError(Exception):
    """Base class of every error ho_onnx raises on purpose."""


class ModelLoadError(HoOnnxError):
    """The input model cannot be read or is not a valid ONNX model."""


class ExternalDataError(HoOnnxError):
    """An external-data reference is missing, outside the model folder or too short."""


class UnboundDimError(HoOnnxError):
    """A symbolic dimension that a decision depends on has no value (or a value that is no
    size)."""


class UnsupportedModelError(HoOnnxError):
    """The model uses something the rewriter does not handle (opset, dtype, ...)."""


class OutputPathError(HoOnnxError):
    """The output path would overwrite the input or cannot be written."""


class VerificationError(HoOnnxError):
    """Original and optimized models disagree."""
