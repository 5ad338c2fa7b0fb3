"""Byte sizes in words: the one formatter every message and report uses, and its parser."""

from __future__ import annotations

import re
from fractions import Fraction

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}
_BINARY = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_HUGE = 1 << 60
INT64_MAX = (1 << 63) - 1  # the largest size, dim or seed ONNX and numpy hold


def binary_unit(nbytes: float, at_least: float = 1.0) -> tuple[str, int]:
    """The largest binary unit in which ``nbytes`` is at least ``at_least`` units, and its
    size (``("B", 1)`` when none is)."""
    for unit, k in _BINARY:
        if nbytes >= at_least * k:
            return unit, k
    return "B", 1


def format_bytes(nbytes: float, unit: str | None = None, digits: int = 2) -> str:
    """``format_bytes(3 << 20)`` → ``'3.00 MiB'``; ``unit`` fixes the unit (``'MiB'``).

    Below 1 KiB without a fixed unit the count is printed as whole bytes; from 1 EiB on,
    an integer count as a power of two (a model's dims can make a size of any length, past
    what a float holds).
    """
    if isinstance(nbytes, int) and nbytes >= _HUGE:
        return f"at least 2^{nbytes.bit_length() - 1} B"
    if unit is None:
        unit, k = binary_unit(nbytes)
        if k == 1:
            return f"{int(nbytes)} B"
    else:
        k = dict(_BINARY).get(unit, 1)
    return f"{nbytes / k:,.{digits}f} {unit}"


def parse_size(text: str) -> int:
    """``'8GiB'`` → 8589934592; plain integers are bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (examples: 4096, 64MiB, 8GiB, 1.5GB)")
    # (exact: a float would make 9223372036854775807 one past int64's largest value)
    return int(Fraction(m.group(1)) * _UNITS[m.group(2).lower()])
