"""bench/moe_decode.py runs (its --quick mode): the routed rows move exactly the bytes the
router selected (with an expert cache: less what an LRU simulation of it held), all rows'
logits equal the resident model's. Not a timing test."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("optimum.exporters.onnx")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import moe_decode

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_quick_run(tmp_path, arch):
    out = tmp_path / "moe.json"
    assert moe_decode.main(["--quick", "--arch", arch, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["arch"] == arch
    rows = {r["row"]: r for r in doc["rows"]}
    assert set(rows) == {"resident", "all streamed", "routed", "routed, budget",
                         "all streamed, disk", "routed, disk", "routed + cache, disk",
                         "routed + cache, budget, disk"}
    assert all(r["equal"] for r in rows.values())
    for tier in ("", ", disk"):
        assert rows["routed" + tier]["ratio"] == pytest.approx(1.0)
        assert rows["all streamed" + tier]["ratio"] > 1.0
        assert rows["routed" + tier]["moved_per_token"] < \
            rows["all streamed" + tier]["moved_per_token"]
    # the cache: bytes read == the router's choice less what an LRU of its size held
    cached = rows["routed + cache, disk"]
    assert cached["expert_cache"] > 0 and cached["ratio"] == pytest.approx(1.0)
    assert cached["hit_rate"] > 0
    assert cached["moved_per_token"] < rows["routed, disk"]["moved_per_token"]
