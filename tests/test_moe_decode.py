"""bench/moe_decode.py runs (its --quick mode): the routed rows move exactly the bytes the
router selected (with an expert cache: less what an LRU simulation of it held), all rows'
logits equal the resident model's; on Optimum exports and on ORT's MoE/QMoE contrib ops. Not
a timing test."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import moe_decode

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_quick_run(tmp_path, arch):
    pytest.importorskip("optimum.exporters.onnx")
    out = tmp_path / "moe.json"
    assert moe_decode.main(["--quick", "--arch", arch, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["arch"] == arch
    rows = {r["row"]: r for r in doc["rows"]}
    assert set(rows) == {"resident", "all streamed", "routed", "routed, budget",
                         "routed + CPU experts", "CPU experts, budget",
                         "all streamed, disk", "routed, disk", "routed + cache, disk",
                         "routed + cache, budget, disk"}
    assert rows["routed, disk"]["ratio"] == pytest.approx(1.0)
    assert rows["all streamed, disk"]["ratio"] > 1.0
    # the cache: bytes read == the router's choice less what an LRU of its size held
    cached = rows["routed + cache, disk"]
    assert cached["expert_cache"] > 0 and cached["ratio"] == pytest.approx(1.0)
    assert cached["hit_rate"] > 0
    assert cached["moved_per_token"] < rows["routed, disk"]["moved_per_token"]
    assert all(r["equal"] for r in rows.values())
    assert rows["routed"]["ratio"] == pytest.approx(1.0)
    assert rows["all streamed"]["ratio"] > 1.0
    assert rows["routed"]["moved_per_token"] < rows["all streamed"]["moved_per_token"]
    # experts computed where their weights live: none of their bytes move, the HostMatMuls
    # ran (each token's top-k experts, 3 MatMuls each, per layer), the floor is no higher
    host = rows["routed + CPU experts"]
    cfg = doc["config"]
    assert host["host_matmuls_per_token"] == 3 * cfg["top_k"] * cfg["layers"]
    assert host["ratio"] == pytest.approx(1.0)
    assert host["moved_per_token"] < rows["routed"]["moved_per_token"]
    assert host["floor"] <= rows["routed"]["floor"]
    assert rows["CPU experts, budget"]["peak"] <= doc["budget"]


@pytest.mark.parametrize("arch", ["contrib", "contrib_q"])
def test_quick_run_contrib(tmp_path, arch):
    """The stacked expert tensors of a MoE/QMoE op: only the selected experts' slices move
    (moved == selected, from each op's router input), every row's outputs bit-exact."""
    out = tmp_path / "moe.json"
    assert moe_decode.main(["--quick", "--arch", arch, "--json", str(out)]) == 0
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"resident", "all streamed", "routed", "routed, budget"}
    assert all(r["equal"] for r in rows.values())
    assert rows["routed"]["ratio"] == pytest.approx(1.0)
    assert rows["routed, budget"]["ratio"] == pytest.approx(1.0)
    assert rows["all streamed"]["ratio"] > 1.0
