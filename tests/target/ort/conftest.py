"""Fixtures of the ORT target tests: the library's fault hooks and measurement switches reset
around a test."""

from __future__ import annotations

import gc
import time

import pytest
from native_util import testing_ops

from ho_onnx.target.ort import runtime


@pytest.fixture
def no_debug_hooks():
    """Fault hooks and measurement switches off before and after; transfers of a deliberately
    broken run may still be landing afterwards, so wait for them."""
    testing_ops().set_debug()
    runtime._ops().set_trace()
    yield
    testing_ops().set_debug()
    runtime._ops().set_trace()
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
