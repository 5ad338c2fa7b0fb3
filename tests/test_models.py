"""Tests of the test/benchmark model builders in models/ (ONNX decoder and HF exports)."""

from __future__ import annotations

import importlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # `models` is a top-level folder, not part of the installed package
    sys.path.insert(0, _ROOT)

from models import decoder as dec  # noqa: E402
from models.decoder import build_decoder, decoder_config_bytes  # noqa: E402

VOCAB = 128


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _ids(batch: int, seq: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, seq), dtype=np.int64)


def _reference(model: onnx.ModelProto, ids: np.ndarray, layers: int, heads: int,
               kv_heads: int | None = None) -> np.ndarray:
    """The same decoder in plain numpy (float64), from the model's initializers; with
    ``kv_heads``, query head ``h`` attends with key/value head ``h // (heads // kv_heads)``."""
    w = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}

    def ln(x, name):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-5) * w[f"{name}.weight"] + w[f"{name}.bias"]

    def lin(x, name):
        return x @ w[f"{name}.weight"] + w[f"{name}.bias"]

    b, s = ids.shape
    x = w["embed.tok.weight"][ids] + w["embed.pos.weight"][:s]
    hid = x.shape[-1]
    d = hid // heads
    kvh = kv_heads or heads
    causal = np.triu(np.full((s, s), -np.inf), 1)
    erf = np.vectorize(math.erf)
    for i in range(layers):
        p = f"layers.{i}"
        q, k, v = np.split(lin(ln(x, f"{p}.ln_1"), f"{p}.attn.qkv"), [hid, hid + kvh * d],
                           axis=-1)
        q = q.reshape(b, s, heads, d).transpose(0, 2, 1, 3)
        k, v = (np.repeat(t.reshape(b, s, kvh, d).transpose(0, 2, 1, 3), heads // kvh, axis=1)
                for t in (k, v))
        sc = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + causal
        sc = np.exp(sc - sc.max(-1, keepdims=True))
        ctx = (sc / sc.sum(-1, keepdims=True)) @ v
        x = x + lin(ctx.transpose(0, 2, 1, 3).reshape(b, s, hid), f"{p}.attn.proj")
        h = lin(ln(x, f"{p}.ln_2"), f"{p}.mlp.fc1")
        x = x + lin(0.5 * h * (1 + erf(h / math.sqrt(2))), f"{p}.mlp.fc2")
    return ln(x, "ln_f") @ w["lm_head.weight"]


# --------------------------------------------------------------------------------------------
# models/decoder.py

CONFIGS = [  # layers, hidden, heads, batch, seq, external_data
    (1, 32, 2, "batch", "seq", False),
    (3, 64, 4, "batch", "seq", True),
    (3, 32, 4, "b", "s", False),
    (1, 64, 2, "batch", "seq", True),
]


@pytest.mark.parametrize(("layers", "hidden", "heads", "batch", "seq", "external"), CONFIGS)
def test_decoder_checks_and_runs(tmp_path, layers, hidden, heads, batch, seq, external):
    path = tmp_path / "dec.onnx"
    model = build_decoder(path, layers=layers, hidden=hidden, heads=heads, vocab=VOCAB,
                          batch=batch, seq=seq, external_data=external)
    onnx.checker.check_model(str(path), full_check=True)
    if not external:
        onnx.checker.check_model(model, full_check=True)
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims] == [batch, seq]
    assert len({n.name for n in model.graph.node}) == len(model.graph.node)
    assert f"layers.{layers - 1}.attn.qkv" in {n.name for n in model.graph.node}

    sess = _session(path)
    full = onnx.load(str(path))  # with its weights, for the numpy reference
    for b, s in ((2, 7), (2, 1), (1, 12)):
        ids = _ids(b, s)
        (logits,) = sess.run(["logits"], {"input_ids": ids})
        assert logits.shape == (b, s, VOCAB)
        assert logits.dtype == np.float32
        assert np.isfinite(logits).all()
        np.testing.assert_allclose(logits, _reference(full, ids, layers, heads),
                                   rtol=1e-4, atol=1e-4)


def test_decoder_fixed_dims(tmp_path):
    path = tmp_path / "fixed.onnx"
    model = build_decoder(path, layers=1, hidden=32, heads=2, batch=2, seq=7, vocab=VOCAB)
    onnx.checker.check_model(model, full_check=True)
    out = model.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in out] == [2, 7, VOCAB]
    (logits,) = _session(path).run(None, {"input_ids": _ids(2, 7)})
    assert logits.shape == (2, 7, VOCAB) and np.isfinite(logits).all()


def test_decoder_deterministic_per_seed(tmp_path):
    kw = {"layers": 2, "hidden": 32, "heads": 2, "vocab": VOCAB}
    a = build_decoder(seed=3, **kw)
    b = build_decoder(seed=3, **kw)
    c = build_decoder(seed=4, **kw)
    assert a.SerializeToString() == b.SerializeToString()
    qkv_a, qkv_c = (numpy_helper.to_array(next(t for t in m.graph.initializer
                                                if t.name == "layers.1.attn.qkv.weight"))
                    for m in (a, c))
    assert not np.array_equal(qkv_a, qkv_c)
    # The same seed gives the same weights with and without external data.
    path = tmp_path / "ext.onnx"
    build_decoder(path, seed=3, external_data=True, **kw)
    ext = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    for t in a.graph.initializer:
        np.testing.assert_array_equal(ext[t.name], numpy_helper.to_array(t))


def test_decoder_external_data_layout(tmp_path):
    path = tmp_path / "sub" / "model.onnx"
    model = build_decoder(path, layers=2, hidden=64, heads=4, vocab=VOCAB, external_data=True)
    data = tmp_path / "sub" / "model.onnx.data"
    assert data.is_file()
    sizes = decoder_config_bytes(layers=2, hidden=64, heads=4, vocab=VOCAB)
    assert data.stat().st_size >= sizes["total_bytes"]
    assert path.stat().st_size < 64 * 1024  # graph only
    assert len(model.graph.initializer) > 0
    for t in model.graph.initializer:
        assert t.data_location == TensorProto.EXTERNAL
        assert not t.HasField("raw_data") and not t.float_data
        info = {e.key: e.value for e in t.external_data}
        assert info["location"] == "model.onnx.data"
        assert int(info["offset"]) % dec.ALIGN == 0
    saved = onnx.load(str(path), load_external_data=False)
    assert all(t.data_location == TensorProto.EXTERNAL for t in saved.graph.initializer)
    # Rebuilding without external data removes the stale data file.
    build_decoder(path, layers=1, hidden=32, heads=2, vocab=VOCAB)
    assert not data.exists()


def test_decoder_is_causal(tmp_path):
    path = tmp_path / "causal.onnx"
    build_decoder(path, layers=2, hidden=32, heads=4, vocab=VOCAB)
    sess = _session(path)
    ids = _ids(2, 9)
    (base,) = sess.run(None, {"input_ids": ids})
    for t in (0, 4, 7):
        changed = ids.copy()
        changed[:, t + 1:] = (changed[:, t + 1:] + 1 + np.arange(8 - t)) % VOCAB
        (out,) = sess.run(None, {"input_ids": changed})
        np.testing.assert_allclose(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-6)
        assert not np.allclose(out[:, t + 1:], base[:, t + 1:])
    # A prefix alone gives the same logits as the prefix positions of the full sequence.
    (prefix,) = sess.run(None, {"input_ids": ids[:, :5]})
    np.testing.assert_allclose(prefix, base[:, :5], rtol=0, atol=1e-5)


def test_decoder_kv_cache_continues_the_full_run():
    """Prefix with an empty cache, then the rest with the presents as the past: the logits
    of the model without a cache, same weights (measured: bit-identical on the CPU EP; the
    tolerance allows another summation order)."""
    kw = {"layers": 2, "hidden": 32, "heads": 2, "vocab": 50, "max_positions": 16, "seed": 3}
    full = ort.InferenceSession(build_decoder(None, **kw).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    kv_model = build_decoder(None, kv_cache=True, **kw)
    onnx.checker.check_model(kv_model, full_check=True)
    kv = ort.InferenceSession(kv_model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in kv.get_outputs()]
    ids = np.random.default_rng(1).integers(0, 50, (2, 9), dtype=np.int64)
    want = full.run(None, {"input_ids": ids})[0]
    past = {f"past_{k}.{i}": np.zeros((2, 2, 0, 16), np.float32)
            for i in range(2) for k in ("key", "value")}
    for lo, hi in ((0, 6), (6, 8), (8, 9)):
        out = dict(zip(names, kv.run(None, {"input_ids": ids[:, lo:hi], **past}), strict=True))
        np.testing.assert_allclose(out["logits"], want[:, lo:hi], rtol=1e-5, atol=1e-6)
        assert out["present_key.1"].shape == (2, 2, hi, 16)
        past = {n.replace("present", "past"): v for n, v in out.items() if n != "logits"}


def _greedy_with_cache(sess: ort.InferenceSession, prompt: np.ndarray, steps: int,
                       past_shape: tuple[int, ...], dtype) -> tuple[list[np.ndarray], list[int]]:
    """Prefill ``prompt`` with an empty Optimum-layout cache, then ``steps`` greedy decode
    steps feeding ``present.*`` back as ``past_key_values.*``: each run's last-position
    logits and the tokens."""
    past = {i.name: np.zeros(past_shape, dtype) for i in sess.get_inputs()
            if i.name.startswith("past_key_values.")}
    names = [o.name for o in sess.get_outputs()]
    ids, lasts, tokens = prompt, [], []
    for _ in range(steps + 1):
        out = dict(zip(names, sess.run(None, {"input_ids": ids, **past}), strict=True))
        lasts.append(out["logits"][:, -1])
        tokens.append(int(out["logits"][0, -1].argmax()))
        ids = np.array([[tokens[-1]]], dtype=np.int64)
        past = {"past_key_values" + n[len("present"):]: v for n, v in out.items()
                if n.startswith("present.")}
    return lasts, tokens


@pytest.mark.parametrize(("dtype", "kv_heads", "tol"), [
    ("float32", 2, 1e-5), ("float32", 4, 1e-5), ("float16", 2, 2e-3)])
def test_decoder_optimum_cache_generates_as_the_full_model(dtype, kv_heads, tol):
    """The Optimum layout (past_key_values.{i}.key in, present.{i}.key out, [batch, kv_heads,
    past, head_dim]): a prompt prefilled, then 6 greedy steps with the cache, has the
    last-position logits of the model without a cache run on the whole sequence each time
    (atol/rtol ``tol``: fp32 1e-5, fp16 2e-3) and the same tokens."""
    kw = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 50, "max_positions": 32, "seed": 5,
          "dtype": dtype, "kv_heads": kv_heads, "std": 0.2}
    np_dtype = np.float16 if dtype == "float16" else np.float32
    kv_model = build_decoder(None, kv_cache=True, cache_layout="optimum", **kw)
    onnx.checker.check_model(kv_model, full_check=True)
    ins = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
           for i in kv_model.graph.input}
    assert ins["past_key_values.1.value"] == ["batch", kv_heads, "past", 8]
    assert [o.name for o in kv_model.graph.output][:3] == ["logits", "present.0.key",
                                                            "present.0.value"]
    kv = ort.InferenceSession(kv_model.SerializeToString(), providers=["CPUExecutionProvider"])
    full = ort.InferenceSession(build_decoder(None, **kw).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    prompt = np.random.default_rng(2).integers(0, 50, (1, 9), dtype=np.int64)
    lasts, tokens = _greedy_with_cache(kv, prompt, 6, (1, kv_heads, 0, 8), np_dtype)
    seq = prompt
    for step, (last, token) in enumerate(zip(lasts, tokens, strict=True)):
        want = full.run(None, {"input_ids": seq})[0][:, -1]
        np.testing.assert_allclose(last.astype(np.float32), want.astype(np.float32),
                                   rtol=tol, atol=tol, err_msg=f"step {step}")
        assert token == int(want[0].argmax()), f"step {step}"
        seq = np.concatenate([seq, [[token]]], axis=1)
    assert len(set(tokens)) > 1  # (a constant token would hide a wrong position offset)


def test_decoder_grouped_query_attention_matches_numpy():
    """kv_heads < heads: each key/value head serves its group of query heads (the float64
    numpy reference repeats K/V per group), and the QKV projection is narrower."""
    kw = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "vocab": VOCAB,
          "max_positions": 16, "std": 0.2}
    model = build_decoder(None, **kw)
    qkv = next(t for t in model.graph.initializer if t.name == "layers.0.attn.qkv.weight")
    assert list(qkv.dims) == [32, 32 + 2 * 2 * 8]
    assert decoder_config_bytes(**{k: v for k, v in kw.items() if k != "std"})[
        "total_bytes"] == sum(len(t.raw_data) for t in model.graph.initializer)
    ids = _ids(2, 7)
    (got,) = ort.InferenceSession(model.SerializeToString(),
                                  providers=["CPUExecutionProvider"]).run(None, {"input_ids": ids})
    want = _reference(model, ids, layers=2, heads=4, kv_heads=2)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="kv_heads"):
        build_decoder(None, hidden=32, heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="cache_layout"):
        build_decoder(None, kv_cache=True, cache_layout="genai")


def test_decoder_sizes_match_initializers():
    kw = {"layers": 3, "hidden": 48, "heads": 4, "ffn": 100, "vocab": 77, "max_positions": 40}
    model = build_decoder(**kw)
    sizes = decoder_config_bytes(**kw)
    nbytes = sum(len(t.raw_data) for t in model.graph.initializer)
    assert sizes["total_bytes"] == nbytes
    assert sizes["total_params"] * 4 == nbytes
    layer0 = sum(len(t.raw_data) for t in model.graph.initializer
                 if t.name.startswith("layers.0."))
    assert sizes["per_layer_bytes"] == layer0
    assert sizes["total_bytes"] == (sizes["embedding_bytes"] + 3 * sizes["per_layer_bytes"]
                                    + sizes["head_bytes"])


def test_decoder_float16(tmp_path):
    path = tmp_path / "f16.onnx"
    model = build_decoder(path, layers=1, hidden=32, heads=2, vocab=VOCAB, dtype="float16")
    onnx.checker.check_model(model, full_check=True)
    assert {t.data_type for t in model.graph.initializer} == {TensorProto.FLOAT16}
    (logits,) = _session(path).run(None, {"input_ids": _ids(2, 7)})
    assert logits.dtype == np.float16 and logits.shape == (2, 7, VOCAB)
    assert np.isfinite(logits).all()


def test_decoder_medium_builds_fast():
    t0 = time.perf_counter()
    model = build_decoder(layers=4, hidden=256, heads=8, vocab=1000)
    assert time.perf_counter() - t0 < 10
    assert len(model.graph.initializer) == 2 + 4 * 12 + 3


def test_decoder_errors():
    with pytest.raises(ValueError, match="path"):
        build_decoder(external_data=True)
    with pytest.raises(ValueError, match="multiple"):
        build_decoder(hidden=30, heads=4)
    with pytest.raises(ValueError, match="2 GiB"):
        build_decoder(layers=64, hidden=2048, heads=16)  # ~13 GB: refused before any work
    with pytest.raises(ValueError, match="opset"):
        build_decoder(opset=16)


def test_decoder_cli(tmp_path, capsys):
    out = tmp_path / "cli.onnx"
    assert dec.main([str(out), "--layers", "1", "--hidden", "32", "--heads", "2",
                     "--external-data"]) == 0
    assert "parameters:" in capsys.readouterr().out
    assert out.is_file() and (tmp_path / "cli.onnx.data").is_file()


# --------------------------------------------------------------------------------------------
# models/hf_export.py (needs the `hf` extra: torch, transformers, onnxscript)

HF_CONFIGS = {  # tiny, to keep the exports quick
    "gpt2": {"layers": 1, "hidden": 32, "heads": 2, "vocab": 64, "seq": 8},
    "llama": {"layers": 1, "hidden": 32, "heads": 4, "kv_heads": 2, "vocab": 64, "seq": 8},
}


@pytest.fixture(scope="module")
def hf_export():
    for mod in ("torch", "transformers", "onnxscript"):  # the `hf` extra
        try:
            importlib.import_module(mod)
        except ImportError as e:  # missing, or installed but broken
            pytest.skip(f"models.hf_export needs {mod} (pip install '.[hf]'): {e}")
    from models import hf_export

    return hf_export


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.export internals
@pytest.mark.parametrize("arch", sorted(HF_CONFIGS))
def test_hf_export_matches_torch(tmp_path, hf_export, arch):
    import torch

    cfg = HF_CONFIGS[arch]
    path = hf_export.export_hf(arch, tmp_path / f"{arch}.onnx", **cfg)
    assert path.is_file()
    meta = json.loads((tmp_path / f"{arch}.onnx.json").read_text())
    assert meta["config"]["arch"] == arch and meta["max_abs_diff"] <= 1e-4

    model = onnx.load(str(path))
    assert [i.name for i in model.graph.input] == ["input_ids"]
    assert [o.name for o in model.graph.output] == ["logits"]
    sess = _session(path)
    module = hf_export._build_torch_model(
        arch, layers=cfg["layers"], hidden=cfg["hidden"], heads=cfg["heads"],
        kv_heads=cfg.get("kv_heads"), ffn=None, vocab=cfg["vocab"],
        max_positions=meta["config"]["max_positions"], attn="eager", seed=0)
    for b, s in ((2, 5), (1, 1), (3, 11)):
        ids = np.random.default_rng(s).integers(0, cfg["vocab"], (b, s), dtype=np.int64)
        (got,) = sess.run(["logits"], {"input_ids": ids})
        with torch.no_grad():
            ref = module(torch.from_numpy(ids)).numpy()
        assert got.shape == (b, s, cfg["vocab"])
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)

    # Cached: the same config again returns the file without exporting.
    mtime = path.stat().st_mtime_ns
    t0 = time.perf_counter()
    assert hf_export.export_hf(arch, path, **cfg) == path
    assert time.perf_counter() - t0 < 1 and path.stat().st_mtime_ns == mtime


def test_hf_export_rejects_bad_args(hf_export, tmp_path):
    with pytest.raises(ValueError, match="arch"):
        hf_export.export_hf("bert", tmp_path / "x.onnx")
    with pytest.raises(ValueError, match="seq"):
        hf_export.export_hf("gpt2", tmp_path / "x.onnx", seq=1)
