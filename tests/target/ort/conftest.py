"""Fixtures of the ORT target tests: the library's debug hooks reset around a test."""

from __future__ import annotations

import gc
import time

import pytest

from ho_onnx.target.ort import runtime


@pytest.fixture
def no_debug_hooks():
    """Debug hooks off before and after; transfers of a deliberately broken run may still be
    landing afterwards, so wait for them."""
    runtime._ops().set_debug()
    yield
    runtime._ops().set_debug()
    time.sleep(0.05)


@pytest.fixture
def young_heap():
    """Objects made before the test are frozen, so a ``gc.collect()`` the test times scans only
    its own objects, not the heap the rest of the suite left (which made the teardown-time
    tests depend on test order); unfrozen afterwards."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
