"""Run a test body on several threads at once (sessions shared between threads)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_threads(worker: Callable[[int], None], n: int) -> None:
    """Start ``worker(0)`` ... ``worker(n - 1)`` on their own threads and join them all."""
    pool = [threading.Thread(target=worker, args=(k,)) for k in range(n)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
