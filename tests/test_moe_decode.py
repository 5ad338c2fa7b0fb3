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
                         "routed + cache + speculation, disk", "routed + cache, budget, disk"}
    assert rows["routed, disk"]["ratio"] == pytest.approx(1.0)
    assert rows["all streamed, disk"]["ratio"] > 1.0
    # the cache: bytes read == the router's choice less what an LRU of its size held
    cached = rows["routed + cache, disk"]
    assert cached["expert_cache"] > 0 and cached["ratio"] == pytest.approx(1.0)
    assert cached["hit_rate"] > 0
    assert cached["moved_per_token"] < rows["routed, disk"]["moved_per_token"]
    # speculation: bytes read == the replay over the router's choice and the speculation's
    # own picks (its MatMul and TopK in the probe), and it read some of them early
    spec = rows["routed + cache + speculation, disk"]
    assert spec["ratio"] == pytest.approx(1.0)
    if arch == "qwen3_moe":
        assert 0 < spec["warm_hits"] <= spec["warm_reads"]
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


def test_cuda_mode_prepared_here_loads_there(tmp_path, monkeypatch):
    """``--strip-to`` with ``--device cuda`` writes the graph without its weights, the rows'
    optimized models and a manifest; ``--graph`` regrows the weights to the same bytes (the
    manifest's fingerprints hold) and loads the rows without planning again. The bench's
    bookkeeping runs end to end with the CPU EP standing in for CUDA (not a GPU test: the
    device runs it as ``gpu_run.sh moebench``); a regrow from another seed is caught and the
    rows are planned again on the spot."""
    pytest.importorskip("optimum.exporters.onnx")
    from models.regrow import regrow

    graph = tmp_path / "graph"
    assert moe_decode.main(["--quick", "--device", "cuda", "--strip-to", str(graph),
                            "--keep-bytes", "1024"]) == 0  # (experts 2 KiB: regrown)
    man = json.loads((graph / "manifest.json").read_text())
    assert man["fingerprints"] and not any(  # (weights to regrow, none carried)
        (graph / name).exists() for name in man["fingerprints"])
    assert set(man["rows"]) == {"all streamed", "routed", "all streamed, 1/4 experts",
                                "routed, 1/4 experts", "CPU experts, 1/4 experts",
                                "routed + CPU experts"}
    assert all((graph / r["file"]).is_file() for r in man["rows"].values())
    with pytest.raises(SystemExit, match="no CUDAExecutionProvider"):
        moe_decode.main(["--quick", "--device", "cuda", "--graph", str(graph)])
    monkeypatch.setattr(moe_decode, "CUDA_EP", "CPUExecutionProvider")
    out = tmp_path / "moe.json"
    rows = "routed, 1/4 experts;routed + CPU experts"
    assert moe_decode.main(["--quick", "--device", "cuda", "--graph", str(graph),
                            "--rows", rows, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["prepared"] and doc["budget"] == man["budget"]
    got = {r["row"]: r for r in doc["rows"]}
    assert set(got) == {"resident", "routed, 1/4 experts", "routed + CPU experts",
                        "ort partition, 1/4 experts"}
    assert all(r["ok"] and r["same_tokens"] for r in got.values())
    assert got["routed + CPU experts"]["host_matmuls_per_token"] > 0
    assert got["routed, 1/4 experts"]["ratio"] == pytest.approx(1.0)
    assert got["routed, 1/4 experts"]["kernel_create_s"] > 0
    with pytest.raises(SystemExit, match="not rows of this bench"):
        moe_decode.main(["--quick", "--device", "cuda", "--graph", str(graph),
                         "--rows", "routed, 1/2 experts"])
    regrow(graph / "model.onnx", seed=1)  # other bytes: the prepared rows cannot be used
    assert moe_decode.prepared(graph / "model.onnx") is None
