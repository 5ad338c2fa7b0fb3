"""bench/ort_reuse.py runs and writes well-formed JSON: ORT's measured arena is smaller with
its buffer reuse off, the replay follows it, and the outputs match (not timing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "ort_reuse.py"


def test_a_small_run_writes_json_and_reuse_off_holds_less(tmp_path):
    out = tmp_path / "reuse.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--configs", "2x256x128", "--budgets",
                        "60", "--runs", "1", "--json", str(out)], capture_output=True,
                       text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = {(r["row"], r["reuse"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("resident", True), ("resident", False), ("plan 60%", True),
                         ("plan 60%", False)}
    on, off = rows["resident", True], rows["resident", False]
    if on["regions"] < 0:  # (this onnxruntime reports no arena statistics)
        return
    assert on["regions"] - off["regions"] >= 512 << 10  # (measured: the reuse held more)
    assert on["max_in_use"] - off["max_in_use"] >= 1 << 20
    assert abs(off["regions"] - off["replayed"]) <= 1 << 20
    assert off["exact"] == "bit-exact"
    assert all(r["exact"] != "MISMATCH" for r in rows.values())
    assert "| 2x256x128 | resident | off |" in p.stdout
