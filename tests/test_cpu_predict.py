"""bench/cpu_predict.py runs (its --quick mode): every point and row measured and predicted
twice, the calibrated machine's rates in the JSON (no timing is asserted: benchmarks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import cpu_predict

pytestmark = pytest.mark.slow


def test_quick_run(tmp_path):
    out = tmp_path / "p.json"
    assert cpu_predict.main(["--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {(r["point"], r["row"]) for r in doc["rows"]} == {
        (p, r) for p in ("decode", "prefill") for r in ("resident", "ho 50%")}
    for r in doc["rows"]:
        assert 0 < r["measured_min_s"] <= r["measured_median_s"]
        assert r["preset_s"] > 0 and r["calibrated_s"] > 0
    assert doc["machine"]["efficiency"] == 1.0 and doc["machine"]["peak_flops"] > 0
