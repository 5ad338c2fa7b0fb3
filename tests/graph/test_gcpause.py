"""graph.gcpause: the collector is paused inside and its state restored after, also on error."""

from __future__ import annotations

import gc

import pytest

from ho_onnx.graph.gcpause import gc_paused


def test_paused_inside_and_restored_after():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested: the inner one leaves it paused
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_restored_when_the_block_fails():
    @gc_paused()
    def boom() -> None:
        assert not gc.isenabled()
        raise ValueError("x")

    with pytest.raises(ValueError):
        boom()
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled():
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
