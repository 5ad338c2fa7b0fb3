"""Run a test body on several threads at once (sessions, the optimizer: shared by threads)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_threads(worker: Callable[[int], None], n: int, timeout: float | None = 600) -> None:
    """Start ``worker(0)`` ... ``worker(n - 1)`` on their own threads, join them all and
    fail with every exception a worker raised (a thread's own exception would otherwise
    only be printed) or when one is still running after ``timeout`` seconds."""
    errors: list[BaseException] = []

    def guarded(k: int) -> None:
        try:
            worker(k)
        except BaseException as e:  # (reported below, by the test's thread)
            errors.append(e)

    pool = [threading.Thread(target=guarded, args=(k,), daemon=True) for k in range(n)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout)
    assert not [t for t in pool if t.is_alive()], f"a worker still runs after {timeout} s"
    assert not errors, errors
