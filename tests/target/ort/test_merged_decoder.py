"""An Optimum merged decoder (``decoder_model_merged.onnx``: one If, both branches whole
decoders reading the weights from the outer scope) offloads inside its branches: greedy
tokens through ORTModelForCausalLM and logits (first step without cache, then cached steps)
identical to the unmodified model. A random-weight Llama built locally (nothing from a hub)."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest

pytest.importorskip("optimum.onnxruntime")
pytest.importorskip("transformers")

from click.testing import CliRunner

from ho_onnx import contract
from ho_onnx.cli import main
from ho_onnx.rewrite.pipeline import optimize, plan_model
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.target.ort.folders import optimum_session_options
from ho_onnx.target.ort.runtime import InferenceSession
from models.genai_export import DEFAULT_CONFIG, build_hf_llama
from models.merged_export import MERGED, export_merged
from models.optimum_export import optimum_greedy

pytestmark = pytest.mark.slow

PROMPT = [1, 5, 9, 17, 33, 70, 3]
DIMS = {"batch_size": 1, "sequence_length": 8, "past_sequence_length": 8}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return build_hf_llama(tmp_path_factory.mktemp("hf") / "hf", **DEFAULT_CONFIG)


@pytest.fixture(scope="module")
def merged(hf, tmp_path_factory):
    return export_merged(hf, tmp_path_factory.mktemp("merged") / "onnx")


def _weight_bytes(folder) -> int:
    m = onnx.load(str(folder / MERGED), load_external_data=False)
    return sum(int(np.prod(t.dims)) * 4 for t in m.graph.initializer)


def _optimized(merged, out, *args: str) -> None:
    out.mkdir()
    for f in merged.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, out / f.name)
    r = CliRunner().invoke(main, ["optimize", str(merged / MERGED), str(out / MERGED), *args,
                                  *(x for k, v in DIMS.items() for x in ("--dim", f"{k}={v}"))])
    assert r.exit_code == 0, r.output


def _session(path, ho: bool) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.add_session_config_entry("session.disable_prepacking", "1")
    return InferenceSession(str(path), sess_options=so) if ho else ort.InferenceSession(
        str(path), so, providers=["CPUExecutionProvider"])


def _same_steps(src, out, steps: int = 4) -> None:
    """The first step (use_cache_branch false, empty past) and cached steps: every output
    bit-identical (graph optimizations and pre-packing off in both sessions)."""
    a, b = _session(src / MERGED, False), _session(out / MERGED, True)
    names = [i.name for i in a.get_inputs()]
    outs = [o.name for o in a.get_outputs()]
    ids = np.array([PROMPT], np.int64)
    past = {n: np.zeros((1, DEFAULT_CONFIG["kv_heads"], 0,
                         DEFAULT_CONFIG["hidden"] // DEFAULT_CONFIG["heads"]), np.float32)
            for n in names if n.startswith("past_key_values")}
    length = 0
    for step in range(steps):
        feed = {"input_ids": ids, "attention_mask": np.ones((1, length + ids.shape[1]), np.int64),
                "position_ids": np.arange(length, length + ids.shape[1])[None],
                "use_cache_branch": np.array([step > 0]), **past}
        ra, rb = a.run(None, feed), b.run(None, feed)
        for name, x, y in zip(outs, ra, rb, strict=True):
            assert np.array_equal(x, y), (step, name, float(np.abs(x - y).max()))
        length += ids.shape[1]
        ids = ra[0][:, -1:].argmax(-1).astype(np.int64)
        past = {n.replace("present", "past_key_values"): v
                for n, v in zip(outs[1:], ra[1:], strict=True)}


def test_plan_shows_offloads_inside_both_branches(merged):
    opts = OffloadOptions(budget=_weight_bytes(merged) // 2, min_bytes=0)
    lines: list[str] = []
    _, _, plan = plan_model(merged / MERGED, opts, DIMS, log=lines.append)
    for branch in ("then_branch", "else_branch"):
        note = next(n for n in plan.choice.notes if f"{branch} planned" in n)
        assert "offloading 0 weights" not in note and "OVER" not in note
    assert any("then_branch planned" in line for line in lines)  # what `plan` prints


def test_half_the_weights_generates_what_the_unmodified_model_does(merged, tmp_path):
    out = tmp_path / "half"
    _optimized(merged, out, "--budget", str(_weight_bytes(merged) // 2), "--min-bytes", "0")
    m = onnx.load(str(out / MERGED), load_external_data=False)
    assert len(m.graph.initializer) < len(onnx.load(
        str(merged / MERGED), load_external_data=False).graph.initializer)
    for a in m.graph.node[0].attribute:  # both branches reload weights
        assert any(n.op_type == contract.PREFETCH for n in a.g.node), a.name
    want = optimum_greedy(merged, PROMPT, 20, file_name=MERGED)
    got = optimum_greedy(out, PROMPT, 20, file_name=MERGED,
                         session_options=optimum_session_options(out))
    assert got == want
    _same_steps(merged, out)


def test_o2_merged_decoder_with_contrib_ops(hf, merged, tmp_path_factory):
    """Both exports optimized (``O2``: SimplifiedLayerNormalization, com.microsoft
    QuickGelu inside the branches, typed by ORT's symbolic inference) before the merge."""
    o2 = export_merged(hf, tmp_path_factory.mktemp("o2") / "onnx", optimize="O2")
    out = tmp_path_factory.mktemp("o2out") / "half"
    _optimized(o2, out, "--budget", str(_weight_bytes(o2) // 2), "--min-bytes", "0")
    want = optimum_greedy(o2, PROMPT, 12, file_name=MERGED)
    assert want == optimum_greedy(merged, PROMPT, 12, file_name=MERGED)
    assert optimum_greedy(out, PROMPT, 12, file_name=MERGED,
                          session_options=optimum_session_options(out)) == want
    _same_steps(o2, out, steps=3)


def test_offload_all_writes_cache_ops_in_the_branches(merged, tmp_path):
    out = tmp_path / "all"
    _optimized(merged, out, "--offload", "all", "--min-bytes", "0")
    m = onnx.load(str(out / MERGED), load_external_data=False)
    ops = [n.op_type for a in m.graph.node[0].attribute for n in a.g.node
           if n.domain == contract.DOMAIN]
    assert ops.count(contract.PREFETCH) > 0 and ops.count(contract.STORE) > 0
    assert not m.graph.initializer or all(t.name.startswith("ho_onnx.") for t in
                                          m.graph.initializer) or len(m.graph.initializer) < 31
    _same_steps(merged, out, steps=3)


def test_optimize_api_counts_the_branch_offloads(merged, tmp_path):
    out = tmp_path / "api"
    out.mkdir()
    budget = _weight_bytes(merged) // 2
    r = optimize(merged / MERGED, out / MERGED, OffloadOptions(budget=budget, min_bytes=0), DIMS)
    assert r.choice.weights and r.rewritten.cache_nodes > 0
    meta = {p.key: p.value for p in onnx.load(str(out / MERGED),
                                                load_external_data=False).metadata_props}
    assert int(meta["ho_onnx.branch_offloaded_weights"]) == len(r.choice.weights)
    assert int(meta["ho_onnx.offloaded_weights"]) == len(r.choice.weights)
    assert int(meta["ho_onnx.branch_predicted_peak_bytes"]) <= budget  # the If's peak
    # the main plan's predictions hold the If as it runs (the larger branch)
    assert int(meta["ho_onnx.predicted_peak_bytes"]) <= budget < int(
        meta["ho_onnx.baseline_peak_bytes"])
    assert int(meta["ho_onnx.host_bytes"]) >= sum(w.nbytes for w in r.choice.weights)


def test_a_legacy_optimum_folder_is_optimized_by_its_merged_decoder(merged, tmp_path):
    out = tmp_path / "folder"
    r = CliRunner().invoke(main, ["optimize", str(merged), str(out), "--budget",
                                  str(_weight_bytes(merged) // 2), "--min-bytes", "0",
                                  *(x for k, v in DIMS.items() for x in ("--dim", f"{k}={v}"))])
    assert r.exit_code == 0, r.output
    want = optimum_greedy(merged, PROMPT, 12)  # (no file_name: Optimum finds the merged one)
    assert optimum_greedy(out, PROMPT, 12, session_options=optimum_session_options(out)) == want


def test_offload_kv_moves_the_cache_inside_the_past_branch(merged, tmp_path):
    """``--offload-kv`` on a merged decoder: the past branch reloads every layer's past (keys
    included: the branch declares a present key's head size as a symbol) and stores every
    present; the step without past has none and says nothing of it. Range-planned: one
    model at both ends and the middle of its past, greedy tokens and every output equal."""
    out = tmp_path / "kv"
    lines = _plan_lines(merged, "--offload-kv", "--offload", "all")
    assert not any("no KV cache found" in line for line in lines), lines
    layers = DEFAULT_CONFIG["layers"]
    assert any(f"({2 * layers} past, {2 * layers} present" in line for line in lines), lines
    out.mkdir()
    for f in merged.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, out / f.name)
    # (Optimum's merged export names attention_mask's length 'sequence_length' too, though it
    # is past + new tokens: the range covers it, or the Guard refuses the steps past 8)
    r = CliRunner().invoke(main, [
        "optimize", str(merged / MERGED), str(out / MERGED), "--offload-kv", "--offload", "all",
        "--min-bytes", "0",
        "--dim", "batch_size=1", "--dim", "sequence_length=1..72",
        "--dim", "past_sequence_length=0..64"])
    assert r.exit_code == 0, r.output
    m = onnx.load(str(out / MERGED), load_external_data=False)
    # (the main graph: the If after the range plan's Guards, which order each branch's first
    # cache op: a run outside the ranges is refused before any transfer)
    assert {n.op_type for n in m.graph.node} == {"Guard", "If"}
    ops = {a.name: [n.op_type for n in a.g.node if n.domain == contract.DOMAIN]
           for a in next(n for n in m.graph.node if n.op_type == "If").attribute}
    assert sum(ops[b].count(contract.PREFETCH_INPUT) for b in ops) == 2 * layers, ops
    want = optimum_greedy(merged, PROMPT, 20, file_name=MERGED)
    got = optimum_greedy(out, PROMPT, 20, file_name=MERGED,
                         session_options=optimum_session_options(out))
    assert got == want
    _same_steps(merged, out, steps=6)


def _plan_lines(merged, *args: str) -> list[str]:
    r = CliRunner().invoke(main, ["plan", str(merged / MERGED), "--budget", "64MiB", *args,
                                  *(x for k, v in DIMS.items() for x in ("--dim", f"{k}={v}"))])
    assert r.exit_code == 0, r.output
    return r.output.splitlines()
