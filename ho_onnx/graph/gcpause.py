"""Pause Python's cyclic garbage collector while a pass builds or walks a whole graph.

Loading, analysing, planning and rewriting a 10,000-node model allocate hundreds of
thousands of objects that all stay alive; the collector, triggered by the allocation count,
would traverse them again and again to find no garbage (a third of the time of the
``onnx_ir`` deserialisation, measured with ``bench/plan_scale.py``). Reference counting
still frees everything as usual; cycles made meanwhile are collected once the collector
runs again. Process-wide (as ``gc`` is), nested uses restore the state they found.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Context manager (and decorator) that disables ``gc`` for its duration."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
