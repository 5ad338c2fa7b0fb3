"""Fixtures of the ORT target tests: the library's debug hooks reset around a test."""

from __future__ import annotations

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
