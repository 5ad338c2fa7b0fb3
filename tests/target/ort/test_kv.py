"""The KV cache as an offload kind (issue 36, item 2): past KV inputs copied in just before
their reader (PrefetchInput, Wait), present KV outputs handed out right after their last
reader (Emit), found by structure; the budget then holds one layer's cache. Generation is
checked against the unmodified model token for token (greedy), through the IOBinding loop
that keeps the cache in ORT values in host memory (``ho_onnx.target.ort.generate``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from native_util import testing_ops

from ho_onnx import InferenceSession, contract, counters, reset_counters
from ho_onnx.cli import main
from ho_onnx.errors import HoOnnxError
from ho_onnx.graph.analyse import analyse
from ho_onnx.rewrite.pipeline import optimize, plan_model
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.target.ort.generate import greedy, kv_layout
from ho_onnx.target.ort.verify import verify
from models.decoder import build_decoder

pytestmark = pytest.mark.usefixtures("no_debug_hooks")

# Optimum's layout: present = Concat(past, new) on the sequence axis, read by the attention.
CONCAT = """
g (float[b, 2, s, 4] k, float[b, 2, p, 4] past_k, float[b, 2, p, 4] past_v)
  => (float[b, 2, t, 4] present_k, float[b, 2, t, 4] present_v, float[b, 2, t, 4] y) {
  present_k = Concat<axis = 2>(past_k, k)
  present_v = Concat<axis = 2>(past_v, k)
  y = Add(present_k, present_v)
}
"""
# onnxruntime-genai's: one node reads both pasts and produces both presents (k-th with k-th).
FUSED = """
g (float[b, 2, s, 4] q, float[b, 2, p, 4] past_key, float[b, 2, p, 4] past_value)
  => (float[b, 2, s, 4] out, float[b, 2, t, 4] present_key, float[b, 2, t, 4] present_value) {
  out, present_key, present_value = com.microsoft.Attn(q, past_key, past_value)
}
"""


def _pairs(text: str) -> dict[str, str]:
    model = onnx.parser.parse_model(
        '<ir_version: 9, opset_import: ["" : 17, "com.microsoft" : 1]>\n' + text)
    a = analyse(model)
    return {t.name: t.kv_peer for t in a.tensors.values() if t.kv_peer and t.is_graph_input}


def test_pairs_are_found_by_structure_not_names():
    assert _pairs(CONCAT) == {"past_k": "present_k", "past_v": "present_v"}
    assert _pairs(FUSED) == {"past_key": "present_key", "past_value": "present_value"}
    # an input only the shape of is read is no past; an input and an output of the same
    # dims (a query and the attention's output) are no pair
    assert _pairs(CONCAT.replace("present_v = Concat<axis = 2>(past_v, k)",
                                 "sv = Shape(past_v)\n  present_v = Identity(present_k)")) == {
        "past_k": "present_k"}
    assert "q" not in _pairs(FUSED)


def _decoder(tmp: Path, **kw) -> Path:
    path = tmp / "dec.onnx"
    build_decoder(path, external_data=True, kv_cache=True, **kw)
    return path


def _floor(src: Path, past: int, kv: bool) -> int:
    try:
        plan_model(src, OffloadOptions(kv=kv, budget=1), {"batch": 1, "seq": 1, "past": past})
    except HoOnnxError as e:
        return e.min_budget  # type: ignore[attr-defined]
    raise AssertionError("a 1-byte budget was met")


def test_the_floor_grows_by_one_layer_not_every_layers_cache(tmp_path):
    """The goal figure: from 2k to 4k of context the smallest feasible budget grows by about
    one layer's past + present (K and V) with the KV cache in host memory, by every layer's
    without it."""
    layers, hidden = 8, 64
    src = _decoder(tmp_path, layers=layers, hidden=hidden, heads=4, max_positions=8192)
    per_layer_kv = 2 * 2048 * hidden * 4  # K and V of 2,048 more positions, fp32
    grow = {kv: _floor(src, 4096, kv) - _floor(src, 2048, kv) for kv in (False, True)}
    assert grow[False] >= layers * per_layer_kv
    assert grow[True] <= 2 * per_layer_kv  # one layer's past + present (+ its K transpose)


def _generate(path: Path, prompt: list[int], n: int, **kw) -> list[int]:
    sess = InferenceSession(path, **kw) if str(path).endswith(".ho.onnx") else \
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return greedy(sess, kv_layout(path), prompt, n)


def test_one_range_plan_generates_the_unmodified_models_tokens(tmp_path):
    """Weights, activations and the KV cache offloaded under a budget, one plan for prefills
    of 1..8 tokens and pasts of 0..40: greedy tokens identical at both ends and the middle,
    the cache moved through PrefetchInput/Emit, and a run past the range refused."""
    src = _decoder(tmp_path, layers=2, hidden=64, heads=4, max_positions=128, vocab=97, std=0.2)
    out = tmp_path / "dec.ho.onnx"
    r = optimize(src, out, OffloadOptions(kv=True, budget=200_000, min_bytes=0), {},
                 dim_ranges={"batch": (1, 1), "seq": (1, 8), "past": (0, 40)})
    c = r.choice
    assert len(c.inputs) == len(c.outputs) == 4 and c.weights
    ops = [n.op_type for n in onnx.load(str(out), load_external_data=False).graph.node
           if n.domain == contract.DOMAIN]
    assert ops.count(contract.PREFETCH_INPUT) == 4 and ops.count(contract.EMIT) == 4
    for prompt, n in (([3], 30), ([3, 1, 4, 1, 5, 9, 2, 6], 33), ([2, 7, 1, 8], 20)):
        want = _generate(src, prompt, n)
        assert len(set(want)) > 3, want  # not one token repeated: a useful reference
        reset_counters()
        assert _generate(out, prompt, n) == want, prompt
        assert counters()["bytes_emitted"] > 0
    with pytest.raises(Exception, match=r"outside the range 0\.\.40"):
        _generate(out, [3, 1, 4, 1], 45)


def test_kv_offload_is_bit_exact_at_other_dims(tmp_path):
    src = _decoder(tmp_path, layers=2, hidden=32, heads=2, max_positions=64)
    out = tmp_path / "dec.ho.onnx"
    optimize(src, out, OffloadOptions(kv=True, weights=False, activations=False),
             {"batch": 1, "seq": 16, "past": 8})
    for dims in ({"batch": 1, "seq": 1, "past": 16}, {"batch": 2, "seq": 3, "past": 40},
                 {"batch": 1, "seq": 16, "past": 0}):
        assert verify(src, out, dims=dims, opt_level="basic", isolate=False, atol=0.0).exact


def test_a_skipped_wait_gives_wrong_kv(tmp_path):
    """The past reaches its reader only through the Wait: without it the reader sees the
    poison (the test would pass with a PrefetchInput that copied nothing otherwise)."""
    src = _decoder(tmp_path, layers=1, hidden=32, heads=2, max_positions=64)
    out = tmp_path / "dec.ho.onnx"
    optimize(src, out, OffloadOptions(kv=True, weights=False, activations=False),
             {"batch": 1, "seq": 1, "past": 8})
    rng = np.random.default_rng(0)
    feeds = {"input_ids": np.array([[5]], np.int64)} | {
        i.name: rng.standard_normal((1, 2, 8, 16)).astype(np.float32)
        for i in onnx.load(str(src), load_external_data=False).graph.input if "past" in i.name}
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, feeds)
    sess = InferenceSession(out)
    np.testing.assert_array_equal(sess.run(None, feeds)[0], want[0])
    testing_ops().set_debug(poison=True, skip_wait=True)
    try:
        bad = sess.run(None, feeds)
    finally:
        testing_ops().set_debug()
    assert not np.array_equal(bad[1], want[1])  # present_key.0 = Concat(past (poison), new)


def test_cli_offload_kv(tmp_path):
    src = _decoder(tmp_path, layers=2, hidden=32, heads=2, max_positions=4096)
    r = CliRunner().invoke(main, ["plan", str(src), "--budget", "2MiB", "--offload-kv",
                                  "--dim", "batch=1", "--dim", "seq=1", "--dim", "past=4000"])
    assert r.exit_code == 0, r.output
    assert "past_key.0" in r.output and "present_key.0" in r.output
    assert "the KV cache in the caller's host memory (4 past, 4 present" in r.output
    r = CliRunner().invoke(main, ["plan", str(src), "--budget", "2MiB", "--offload-kv",
                                  "--dim", "batch=1", "--dim", "seq=1", "--dim", "past=4000",
                                  "--json"])
    off = json.loads(r.stdout)["offloaded"]
    assert {i["name"]: i["present"] for i in off["kv_inputs"]}["past_key.0"] == "present_key.0"
    assert len(off["kv_outputs"]) == 4
    dst = tmp_path / "out.onnx"
    r = CliRunner().invoke(main, ["optimize", str(src), str(dst), "--offload-kv",
                                  "--offload", "none", "--dim", "batch=1", "--dim", "seq=1",
                                  "--dim", "past=0..4000"])
    assert r.exit_code == 0, r.output
    assert "the KV cache (2 past, 2 present" in r.output.replace("\n", " ") or \
        "KV cache" in r.output
    meta = {p.key: p.value for p in onnx.load(str(dst), load_external_data=False).metadata_props}
    assert meta["ho_onnx.kv_pairs"] == ("past_key.0:present_key.0,past_value.0:present_value.0,"
                                        "past_key.1:present_key.1,past_value.1:present_value.1")


def test_offload_kv_on_a_model_without_a_cache_says_so(tmp_path):
    """``--offload-kv`` on a decoder exported without past: one note, not silence."""
    src = tmp_path / "plain.onnx"
    build_decoder(src, layers=1, hidden=32, heads=2, external_data=True)
    for budget in ([], ["--budget", "1GiB"]):
        r = CliRunner().invoke(main, ["optimize", str(src), str(tmp_path / "o.onnx"),
                                      "--offload-kv", *budget, "--dim", "batch=1",
                                      "--dim", "seq=4"])
        assert r.exit_code == 0, r.output
        assert "note: kv: no KV cache found" in r.output, r.output
