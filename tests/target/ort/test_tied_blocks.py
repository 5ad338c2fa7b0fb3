"""A GPT-2 with tied embeddings (random weights from a transformers config, exported by
torch.onnx): its lm_head reads the embedding table whole (``MatMul(x, Transpose(wte))``),
so the floor stayed at or above the table. Streamed in blocks (``rewrite/blocks.py``) while
its Gather side is a ``GatherRows``, the floor falls below the table, and the logits stay
bit-exact (ORT's optimizations off and at ``basic``), at the planned length and others, and
greedy decoding picks the same tokens."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from ho_onnx import InferenceSession
from ho_onnx.errors import HoOnnxError
from ho_onnx.rewrite.pipeline import optimize, plan_model
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.target.ort.verify import verify

pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[hf]')")
pytest.importorskip("transformers", reason="transformers is not installed")
from models.hf_export import export_hf

pytestmark = pytest.mark.usefixtures("no_debug_hooks")

VOCAB, HIDDEN = 1000, 64
TABLE = VOCAB * HIDDEN * 4
DIMS = {"batch": 1, "seq": 8}


def _floor(src, **kw: int) -> int:
    with pytest.raises(HoOnnxError) as e:
        plan_model(src, OffloadOptions(budget=1, min_bytes=0, **kw), DIMS)
    return e.value.min_budget  # type: ignore[attr-defined]


def _greedy(sess, prompt: np.ndarray, steps: int) -> tuple[list[int], list[np.ndarray]]:
    ids, logits = prompt, []
    for _ in range(steps):
        out = sess.run(None, {"input_ids": ids})[0]
        logits.append(out)
        ids = np.concatenate([ids, out[:, -1:].argmax(-1)], axis=1)
    return ids[0].tolist(), logits


@pytest.mark.slow
def test_gpt2_tied_floor_below_the_table_and_exact(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    src = export_hf("gpt2", folder / "gpt2.onnx", layers=2, hidden=HIDDEN, heads=4,
                    vocab=VOCAB, seq=8, external_data=True)
    reads = [n for n in onnx.load(str(src), load_external_data=False).graph.node
             if "inner.lm_head.weight" in n.input]
    assert sorted(n.op_type for n in reads) == ["Gather", "Transpose"]  # tied
    whole, floor = _floor(src, max_blocks=0), _floor(src)
    assert whole >= TABLE > floor  # (before: the table and its transpose at once)
    out = folder / "gpt2.ho.onnx"
    r = optimize(src, out, OffloadOptions(budget=floor, min_bytes=0), DIMS)
    assert r.plan is not None and r.plan.planned.peak_bytes <= floor < TABLE
    table = next(w for w in r.choice.weights if w.name == "inner.lm_head.weight")
    assert table.row_readers and not table.consumers  # the Gather side: rows only
    split = next(s for s in r.choice.splits if s.name == "inner.lm_head.weight")
    assert len(split.blocks) > 1
    assert {w.name for w in r.choice.weights} >= set(split.blocks)  # every block streamed
    for dims in (DIMS, {"batch": 2, "seq": 5}, {"batch": 1, "seq": 13}):
        for level in ("disable", "basic"):
            rep = verify(src, out, dims=dims, opt_level=level, int_high=VOCAB, isolate=False)
            assert rep.exact, (dims, level, rep.outputs)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    prompt = np.array([[5, 17, 998]], np.int64)
    want, want_logits = _greedy(ref, prompt, 8)
    got, got_logits = _greedy(InferenceSession(out), prompt, 8)
    assert got == want
    for a, b in zip(got_logits, want_logits, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_optimum_gpt2_lm_head_in_column_blocks(tmp_path):
    """Optimum's export folds the tied lm_head's transpose into an initializer of its own
    (``MatMul(x, W[H, V])``): column blocks, sliced when the data is written."""
    pytest.importorskip("optimum.exporters.onnx", reason="optimum is not installed")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from models.optimum_export import export_optimum

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=HIDDEN, n_head=4, vocab_size=VOCAB,
                               n_positions=128, bos_token_id=VOCAB - 1,
                               eos_token_id=VOCAB - 1)).save_pretrained(tmp_path / "hf")
    src = export_optimum(tmp_path / "hf", tmp_path / "onnx", optimize=None) / "model.onnx"
    dims = {"batch_size": 1, "sequence_length": 8, "past_sequence_length": 4}
    floors = []
    for kw in ({"max_blocks": 0}, {}):
        with pytest.raises(HoOnnxError) as e:
            plan_model(src, OffloadOptions(budget=1, min_bytes=0, **kw), dims)
        floors.append(e.value.min_budget)  # type: ignore[attr-defined]
    assert floors[0] >= TABLE > floors[1]
    out = tmp_path / "onnx" / "o.onnx"
    r = optimize(src, out, OffloadOptions(budget=floors[1], min_bytes=0), dims)
    assert any(len(s.blocks) > 1 for s in r.choice.splits)
    for d in (dims, {"batch_size": 2, "sequence_length": 1, "past_sequence_length": 9}):
        for level in ("disable", "basic"):  # (ids < 128: also the position table's rows)
            assert verify(src, out, dims=d, opt_level=level, int_high=100, isolate=False).exact
