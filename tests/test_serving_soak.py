"""The bounded serving soak (tests/serving_soak.py, issue 34) in a child process of its own,
so that its descriptor, RSS and counter baselines are its own. HO_SOAK_SECONDS (default 30)
sets its length; run it longer by hand with ``tests/serving_soak.py --seconds N``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parent / "serving_soak.py"


def test_serving_soak():
    seconds = float(os.environ.get("HO_SOAK_SECONDS", "30"))
    proc = subprocess.run([sys.executable, str(SOAK), "--seconds", str(seconds)],
                          capture_output=True, text=True, timeout=seconds + 240)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no report (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    report = json.loads(lines[-1])
    assert proc.returncode == 0 and not report["errors"], (report, proc.stderr[-3000:])
    assert report["good"] > 0 and report["failed_as_asked"] > 0 and report["swaps"] > 0
