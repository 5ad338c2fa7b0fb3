"""A random-weight Llama saved locally and converted by the onnxruntime-genai model builder.

Needs the ``hf`` and ``genai`` extras (torch, transformers, tokenizers, onnxruntime-genai);
nothing is downloaded. :func:`build_hf_llama` writes a Hugging Face folder (config, random
``safetensors`` weights, a word-level tokenizer made here); :func:`export_genai` runs
``python -m onnxruntime_genai.models.builder`` on it for the CPU execution provider, in
``fp32`` or ``int4`` (MatMulNBits; with tied embeddings a GatherBlockQuantized table shared
with the lm_head; asymmetric by default, so zero points exist). :func:`genai_greedy` runs
greedy generation from token ids (no tokenizer involved).

    python -m models.genai_export out/llama-int4 --precision int4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

__all__ = ["build_hf_llama", "build_tokenizer", "export_genai", "genai_greedy", "main"]

Precision = Literal["fp32", "int4"]

# Small enough to build in seconds; the embedding is a small share of the weights, so a
# budget of half the weights is feasible for both precisions.
DEFAULT_CONFIG: dict[str, Any] = {
    "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 256, "vocab": 256,
    "max_positions": 128, "tie": True, "seed": 0,
}
# (The builder 0.15.2 feeds the lm_head from the last layer's post-attention norm, not the
# final norm, so its logits differ from transformers'; Optimum's export matches them: compare
# genai outputs with genai outputs only.)
BOS, EOS, PAD, UNK = 1, 2, 0, 3


def build_tokenizer(out_dir: str | os.PathLike[str], vocab: int) -> None:
    """A word-level tokenizer (``<pad> <s> </s> <unk> w4 ... w{vocab-1}``) saved beside the
    model, made here with ``tokenizers`` (the builder and Optimum load one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, "<unk>": UNK}
    words |= {f"w{i}": i for i in range(len(words), vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>", pad_token="<pad>").save_pretrained(str(out_dir))


def build_hf_llama(out_dir: str | os.PathLike[str], *, layers: int = 4, hidden: int = 64,
                   heads: int = 4, kv_heads: int = 2, ffn: int = 256, vocab: int = 256,
                   max_positions: int = 128, tie: bool = True, seed: int = 0,
                   std: float = 0.1) -> Path:
    """Save a ``LlamaForCausalLM`` with ``torch.manual_seed(seed)`` random weights and a local
    tokenizer to ``out_dir`` (a Hugging Face model folder); returns the folder.

    Matrices are drawn with standard deviation ``std`` (transformers' default, 0.02, makes a
    model this small repeat one token forever)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
                      tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    model.save_pretrained(str(out))
    build_tokenizer(out, vocab)
    return out


def export_genai(hf_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                 precision: Precision = "fp32", *, symmetric: bool = True,
                 block_size: int = 32, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Run the onnxruntime-genai model builder on ``hf_dir`` (CPU execution provider).

    Returns ``out_dir``, which then holds ``genai_config.json``, ``model.onnx`` and
    ``model.onnx.data``. ``symmetric`` and ``block_size`` are the int4 quantizer's options.
    Raises RuntimeError with the builder's last lines when it fails.
    """
    out = Path(out_dir)
    cache = Path(cache_dir) if cache_dir is not None else out.with_name(out.name + ".cache")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir),
           "-o", str(out), "-p", precision, "-e", "cpu", "-c", str(cache)]
    if precision == "int4":
        cmd += ["--extra_options", f"is_symmetric={str(symmetric).lower()}",
                f"block_size={block_size}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if r.returncode != 0 or not (out / "genai_config.json").is_file():
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-8:])
        raise RuntimeError(f"onnxruntime-genai builder failed ({r.returncode}):\n{tail}")
    return out


def genai_greedy(folder: str | os.PathLike[str], prompt: Sequence[int],
                 max_length: int = 32) -> list[int]:
    """Greedy generation with onnxruntime-genai from token ids: the whole sequence."""
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=max_length)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([list(prompt)], dtype=np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--precision", choices=["fp32", "int4"], default="fp32")
    ap.add_argument("--symmetric", action="store_true")
    for k, v in DEFAULT_CONFIG.items():
        if isinstance(v, bool):
            ap.add_argument(f"--{k}", action=argparse.BooleanOptionalAction, default=v)
        else:
            ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    a = ap.parse_args(argv)
    out = Path(a.out_dir)
    cfg = {k: getattr(a, k) for k in DEFAULT_CONFIG}
    hf = build_hf_llama(out.with_name(out.name + ".hf"), **cfg)
    export_genai(hf, out, a.precision, symmetric=a.symmetric)
    print(json.dumps({"folder": str(out), "hf": str(hf), **cfg}))


if __name__ == "__main__":
    main()
