"""The one byte formatter and its parser (ho_onnx.units)."""

from __future__ import annotations

import pytest

from ho_onnx.units import binary_unit, format_bytes, parse_size


def test_format_bytes():
    assert format_bytes(3 << 20) == "3.00 MiB"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(5 << 30, "MiB", 1) == "5,120.0 MiB"
    assert binary_unit(3 << 20, at_least=4) == ("KiB", 1024)
    # past 1 EiB a power of two: (2**62)**300 was an unexpected OverflowError (found by
    # tests/optimize_fuzz.py: an input of 300 dims of 2**62 in profile's memory check)
    assert format_bytes((1 << 62) ** 300) == "at least 2^18600 B"
    assert format_bytes((1 << 60) + 5, "GiB") == "at least 2^60 B"
    assert format_bytes((1 << 60) - 1) == "1,073,741,824.00 GiB"


def test_parse_size_round_trips_and_refuses_words():
    assert parse_size("8GiB") == 8 << 30 and parse_size(" 64 kib ") == 64 << 10
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("4096") == 4096
    assert parse_size(format_bytes(3 << 20, "MiB", 0).replace(" ", "")) == 3 << 20
    with pytest.raises(ValueError, match="is not a size"):
        parse_size("lots")


def test_parse_size_is_exact_for_big_and_fractional_sizes():
    """Found by hand: through a float, '9223372036854775807B' (int64's largest) became one
    past it and was refused as past int64; fractions round down to whole bytes."""
    assert parse_size("9223372036854775807B") == (1 << 63) - 1
    assert parse_size("123456789012345678901") == 123456789012345678901
    assert parse_size("0.1KiB") == 102 and parse_size("1.5KiB") == 1536
