"""bench/decode_cache.py runs and writes well-formed JSON with identical tokens and a decode
cache that reads fewer bytes per step (not timing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "decode_cache.py"


def test_a_small_run_writes_json_with_identical_tokens(tmp_path):
    out = tmp_path / "dc.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--layers", "2", "--hidden", "128",
                        "--heads", "4", "--vocab", "512", "--context", "128", "--chunk", "64",
                        "--new-tokens", "6", "--rounds", "1", "--offload-kv", "--json",
                        str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"ort", "ho disk", "ho disk + cache"}
    assert rows["ort"]["tokens"] == "reference"
    assert rows["ho disk"]["tokens"] == rows["ho disk + cache"]["tokens"] == "= ort"
    plain, cached = rows["ho disk"], rows["ho disk + cache"]
    assert plain["read_per_step"] > 0 and plain["cache_at_decode"] == 0
    assert cached["cache_at_decode"] + cached["ahead_at_decode"] > 0  # (its room is used)
    # (reads ahead of the last step are for a step that never comes: at most the room)
    assert cached["read_per_step"] <= plain["read_per_step"] + cached["ahead_at_decode"]
    if cached["cache_at_decode"]:  # (the planner kept weights: fewer read per step)
        assert cached["read_per_step"] < plain["read_per_step"]
    assert "| ho disk + cache |" in p.stdout
