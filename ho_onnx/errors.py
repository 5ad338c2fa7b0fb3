"""Errors raised by ho_onnx: each names the problem in words a user can act on; and
:data:`Log`, how a long step tells its caller how it goes."""

from __future__ import annotations

import re
from collections.abc import Callable

Log = Callable[[str], None]
"""Takes a step's progress messages, one line each (``log=`` of the long steps)."""


def quiet(_msg: str) -> None:
    """The :data:`Log` of a caller that wants no messages (``say = log or quiet``)."""


# What a terminal acts on: control characters but tab and newline (ESC starts colour,
# title and clipboard sequences; CR and BS overwrite), and the bidirectional overrides
# that reorder what is shown ("Trojan Source").
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_UNSAFE_IN_A_CELL = re.compile(f"[\t\n{_UNSAFE.pattern[1:-1]}]")


def printable(text: str, *, cell: bool = False) -> str:
    """``text`` with the characters a terminal acts on written as escapes (``\\x1b``): a
    model's names, which messages quote, are shown, never obeyed. With ``cell``, a table's
    cell: newline and tab too (they would break the row), and escaped before it is cut to
    its column (was cut first, so the escapes overflowed it)."""
    return (_UNSAFE_IN_A_CELL if cell else _UNSAFE).sub(lambda m: ascii(m.group())[1:-1], text)


class HoOnnxError(Exception):
    """Base class of every error ho_onnx raises on purpose."""


class ModelLoadError(HoOnnxError):
    """The input model cannot be read or is not a valid ONNX model."""


class ExternalDataError(HoOnnxError):
    """An external-data reference is missing, outside the model folder or too short."""


class UnboundDimError(HoOnnxError):
    """A symbolic dimension that a decision depends on has no value (or a value that is no
    size)."""


class PastTableError(UnboundDimError):
    """A bound dim reads past one of the model's own tables (a learned position or causal-mask
    table): the model cannot run at that value."""


class UnsupportedModelError(HoOnnxError):
    """The model uses something the rewriter does not handle (opset, dtype, ...)."""


class OutputPathError(HoOnnxError):
    """The output path would overwrite the input or cannot be written."""


class VerificationError(HoOnnxError):
    """Original and optimized models disagree."""


class ScheduleError(HoOnnxError):
    """The rewritten graph breaks an invariant of the schedule the insertion promises (a
    rewriter bug: :mod:`ho_onnx.rewrite.invariants`)."""
