"""Real Hugging Face architectures (GPT-2, Llama) with random weights, exported to ONNX offline.

Needs the ``hf`` extra (torch, transformers, onnxscript); nothing is downloaded: the model is
built from a small config with ``torch.manual_seed(seed)`` random weights. Export uses the
``torch.onnx.export(dynamo=True)`` (torch.export + onnxscript) exporter; the legacy TorchScript
exporter (``dynamo=False``) cannot export transformers 5's mask code (``aten::diff``).

After export the ONNX logits are checked against torch's with onnxruntime (two input shapes, so
the dynamic ``batch``/``seq`` axes are exercised too); a mismatch raises and removes the file.
A sidecar ``<path>.json`` records the config; a later call with the same config (and the same
torch/transformers versions) returns the existing file without exporting again.

    python -m models.hf_export gpt2 out/gpt2.onnx --layers 2
"""

from __future__ import annotations

import argparse
import json
import os
import time
from importlib import metadata
from pathlib import Path
from typing import Literal

import numpy as np

__all__ = ["ARCHS", "export_hf", "main"]

ARCHS = ("gpt2", "llama")


def _versions() -> dict[str, str]:
    out = {}
    for pkg in ("torch", "transformers", "onnxscript"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "missing"
    return out


def _data_path(path: Path) -> Path:
    return path.with_name(path.name + ".data")


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _build_torch_model(arch: str, *, layers: int, hidden: int, heads: int, kv_heads: int | None,
                       ffn: int | None, vocab: int, max_positions: int, attn: str, seed: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if arch == "gpt2":
        cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_inner=ffn,
                         vocab_size=vocab, n_positions=max_positions, use_cache=False,
                         bos_token_id=vocab - 1, eos_token_id=vocab - 1,
                         attn_implementation=attn)
        model = GPT2LMHeadModel(cfg)
    elif arch == "llama":
        cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden,
                          num_attention_heads=heads,
                          num_key_value_heads=heads if kv_heads is None else kv_heads,
                          intermediate_size=4 * hidden if ffn is None else ffn,
                          vocab_size=vocab, max_position_embeddings=max_positions,
                          bos_token_id=min(1, vocab - 1), eos_token_id=min(2, vocab - 1),
                          use_cache=False, attn_implementation=attn)
        model = LlamaForCausalLM(cfg)
    else:
        raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")
    model.eval()

    class LogitsOnly(torch.nn.Module):
        """input_ids -> logits, no KV cache, no dict output."""

        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.inner(input_ids=input_ids, use_cache=False).logits

    return LogitsOnly(model).eval()


def export_hf(arch: Literal["gpt2", "llama"], path: str | os.PathLike, *, layers: int = 2,
              hidden: int = 64, heads: int = 4, vocab: int = 256, seq: int = 16,
              opset: int = 18, seed: int = 0, external_data: bool = False,
              kv_heads: int | None = None, ffn: int | None = None,
              max_positions: int | None = None, attn: str = "eager", atol: float = 1e-4,
              force: bool = False) -> Path:
    """Build a random-weight GPT-2 / Llama causal LM with transformers and export it to ONNX.

    Args:
        arch: ``"gpt2"`` (GPT2LMHeadModel) or ``"llama"`` (LlamaForCausalLM).
        path: output ``.onnx`` path (parent directories are created).
        layers, hidden, heads, vocab: architecture; ``kv_heads`` (Llama GQA, default ``heads``)
            and ``ffn`` (MLP width, default ``4 * hidden``) are optional.
        seq: sequence length of the example input used for export and verification (>= 2).
        opset: ONNX opset (the dynamo exporter supports >= 18).
        seed: ``torch.manual_seed`` for the random weights (and the example inputs).
        external_data: save the weights in ``<path>.data`` beside the model.
        max_positions: position-table size / longest supported seq (default ``max(seq, 128)``).
        attn: transformers ``attn_implementation`` (``"eager"`` or ``"sdpa"``).
        atol: max abs difference allowed between onnxruntime and torch logits.
        force: export even if a matching cached file exists.

    Returns:
        ``Path(path)``. Input ``input_ids`` int64 [batch, seq], output ``logits`` float32
        [batch, seq, vocab] (``batch``/``seq`` dynamic).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")
    if seq < 2:
        raise ValueError("seq must be >= 2 (torch.export specializes dims of size 0/1)")
    max_positions = max(seq, 128) if max_positions is None else max_positions
    if seq > max_positions:
        raise ValueError(f"seq ({seq}) > max_positions ({max_positions})")
    path = Path(path)
    config = {"arch": arch, "layers": layers, "hidden": hidden, "heads": heads,
              "kv_heads": kv_heads, "ffn": ffn, "vocab": vocab, "seq": seq, "opset": opset,
              "seed": seed, "external_data": external_data, "max_positions": max_positions,
              "attn": attn, "versions": _versions()}
    sidecar = _sidecar(path)
    if not force and path.exists() and sidecar.exists() \
            and (not external_data or _data_path(path).exists()):
        try:
            cached = json.loads(sidecar.read_text())
        except (OSError, ValueError):
            cached = None
        if isinstance(cached, dict) and cached.get("config") == config:
            return path

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import onnxruntime as ort
    import torch

    for stale in (sidecar, path, _data_path(path)):
        stale.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    module = _build_torch_model(arch, layers=layers, hidden=hidden, heads=heads,
                                kv_heads=kv_heads, ffn=ffn, vocab=vocab,
                                max_positions=max_positions, attn=attn, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    example = torch.randint(0, vocab, (2, seq), dtype=torch.int64, generator=gen)
    dyn = {"input_ids": {0: torch.export.Dim("batch", min=1),
                         1: torch.export.Dim("seq", min=1, max=max_positions)}}
    with torch.no_grad():
        torch.onnx.export(module, (example,), str(path), input_names=["input_ids"],
                          output_names=["logits"], dynamic_shapes=dyn, opset_version=opset,
                          dynamo=True, external_data=external_data, verbose=False)
    t_export = time.perf_counter() - t0

    # Verify with onnxruntime: the example shape and another (batch, seq) pair.
    try:
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        other = torch.randint(0, vocab, (3, max(1, seq // 2 + 1)), dtype=torch.int64,
                              generator=gen)
        worst = 0.0
        for ids in (example, other):
            with torch.no_grad():
                ref = module(ids).numpy()
            (got,) = sess.run(["logits"], {"input_ids": ids.numpy()})
            if got.shape != ref.shape:
                raise RuntimeError(f"{arch}: ONNX logits shape {got.shape} != torch {ref.shape}")
            worst = max(worst, float(np.max(np.abs(got - ref))))
        if not worst <= atol:
            raise RuntimeError(f"{arch}: ONNX vs torch logits differ by {worst:g} > {atol:g}")
    except Exception:
        for out in (path, _data_path(path)):
            out.unlink(missing_ok=True)
        raise
    sidecar.write_text(json.dumps({"config": config, "max_abs_diff": worst,
                                   "export_s": round(t_export, 3),
                                   "params": sum(p.numel() for p in module.parameters())},
                                  indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m models.hf_export",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("arch", choices=ARCHS)
    ap.add_argument("out", help="output .onnx path")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=None, help="llama only (default: heads)")
    ap.add_argument("--ffn", type=int, default=None, help="MLP width (default 4*hidden)")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=16, help="example sequence length")
    ap.add_argument("--max-positions", type=int, default=None)
    ap.add_argument("--opset", type=int, default=18)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attn", choices=("eager", "sdpa"), default="eager")
    ap.add_argument("--external-data", action="store_true")
    ap.add_argument("--force", action="store_true", help="ignore the cache")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    out = export_hf(args.arch, args.out, layers=args.layers, hidden=args.hidden,
                    heads=args.heads, kv_heads=args.kv_heads, ffn=args.ffn, vocab=args.vocab,
                    seq=args.seq, max_positions=args.max_positions, opset=args.opset,
                    seed=args.seed, attn=args.attn, external_data=args.external_data,
                    force=args.force)
    info = json.loads(_sidecar(out).read_text())
    print(f"{out}: {info['params']:,} parameters, max |onnx - torch| = "
          f"{info['max_abs_diff']:.3g} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
