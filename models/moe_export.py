"""Random-weight mixture-of-experts decoders from transformers configs, exported with Optimum
(``text-generation-with-past``): Qwen3-MoE, Qwen2-MoE (a shared expert beside the routed
ones) and Mixtral. Nothing is downloaded.

Optimum exports Qwen3-MoE itself, with its sparse block patched to run every expert on the
tokens routed to it (transformers loops only over the experts hit by the tracing input, so
an expert no dummy token chose would be left out of the graph: a model that is wrong for
other inputs). It refuses Qwen2-MoE and Mixtral (no ONNX config), and torch.onnx's dynamo
exporter fails on their data-dependent loop (``GuardOnDataDependentSymNode``, torch 2.13).
Here they are exported with Optimum's Llama-family configs and the same patch
(:func:`all_experts_forward`), whose outputs equal the original block's (checked by
``tests/graph/test_moe.py``).

    python -m models.moe_export out/mixtral --arch mixtral
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["ARCHS", "SMALL", "all_experts", "all_experts_forward", "build_hf_moe", "export_moe",
           "main"]

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")
# The tests' size: every expert weight 16 x 32 floats (2 KiB), 8 experts, top-2, 2 layers.
SMALL = {"layers": 2, "hidden": 32, "moe_ffn": 16, "experts": 8, "top_k": 2, "heads": 4,
         "kv_heads": 2, "vocab": 128, "positions": 64}


def build_hf_moe(out_dir: str | os.PathLike[str], arch: str = "qwen3_moe", *, layers: int = 2,
                 hidden: int = 32, moe_ffn: int = 16, experts: int = 4, top_k: int = 2,
                 heads: int = 4, kv_heads: int = 2, vocab: int = 128, positions: int = 64,
                 seed: int = 0) -> Path:
    """Save a random-weight ``arch`` causal LM to ``out_dir``; returns the folder."""
    import torch
    import transformers as tf

    head_dim = hidden // heads
    common = {"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "max_position_embeddings": positions, "num_experts_per_tok": top_k}
    if arch == "qwen3_moe":
        cfg, cls = tf.Qwen3MoeConfig(**common, intermediate_size=2 * hidden,
                                     moe_intermediate_size=moe_ffn, head_dim=head_dim,
                                     num_experts=experts), tf.Qwen3MoeForCausalLM
    elif arch == "qwen2_moe":
        cfg, cls = tf.Qwen2MoeConfig(**common, intermediate_size=2 * hidden,
                                     moe_intermediate_size=moe_ffn,
                                     shared_expert_intermediate_size=2 * moe_ffn,
                                     num_experts=experts), tf.Qwen2MoeForCausalLM
    elif arch == "mixtral":
        cfg, cls = tf.MixtralConfig(**common, intermediate_size=moe_ffn,
                                    num_local_experts=experts), tf.MixtralForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}: one of {', '.join(ARCHS)}")
    torch.manual_seed(seed)
    out = Path(out_dir)
    cls(cfg).eval().save_pretrained(out)
    return out


def all_experts_forward(self: Any, hidden_states: Any) -> tuple[Any, Any]:
    """A Qwen2-MoE / Mixtral sparse block's forward that runs every expert on the tokens
    routed to it (none: an empty batch), so tracing keeps every expert in the graph. Same
    arithmetic as transformers' own forward (which skips the experts no token chose)."""
    import torch
    import torch.nn.functional as F

    batch, seq, dim = hidden_states.shape
    x = hidden_states.view(-1, dim)
    router_logits = self.gate(x)
    weights = F.softmax(router_logits, dim=1, dtype=torch.float)
    weights, chosen = torch.topk(weights, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # (Mixtral always normalises)
        weights /= weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    out = torch.zeros((batch * seq, dim), dtype=x.dtype, device=x.device)
    mask = F.one_hot(chosen, num_classes=self.num_experts).permute(2, 1, 0)
    for e in range(self.num_experts):
        slot, token = torch.where(mask[e])
        y = self.experts[e](x[None, token].reshape(-1, dim)) * weights[token, slot, None]
        out.index_add_(0, token, y.to(x.dtype))
    if hasattr(self, "shared_expert"):  # Qwen2-MoE: a gated expert every token runs
        out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
    return out.reshape(batch, seq, dim), router_logits


@contextlib.contextmanager
def all_experts(arch: str) -> Iterator[None]:
    """Within: ``arch``'s sparse block runs :func:`all_experts_forward` (Qwen3-MoE: Optimum
    patches it itself; nothing to do)."""
    if arch == "qwen3_moe":
        yield
        return
    if arch == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import (
            Qwen2MoeSparseMoeBlock as Block,
        )
    else:
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
    original = Block.forward
    Block.forward = all_experts_forward
    try:
        yield
    finally:
        Block.forward = original


def export_moe(hf_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str],
               arch: str = "qwen3_moe", *, with_past: bool = True) -> Path:
    """Export ``hf_dir`` (an ``arch`` model) with Optimum; returns ``out_dir/model.onnx``."""
    from optimum.exporters.onnx import main_export
    from optimum.exporters.tasks import TasksManager
    from transformers import AutoConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    task = "text-generation-with-past" if with_past else "text-generation"
    kw: dict[str, Any] = {}
    if arch != "qwen3_moe":  # (no Optimum config of its own: a Llama-family one fits)
        make = TasksManager.get_exporter_config_constructor(
            "onnx", model_type="mistral" if arch == "mixtral" else "qwen2",
            task=task, library_name="transformers")
        kw["custom_onnx_configs"] = {"model": make(
            AutoConfig.from_pretrained(hf_dir), task="text-generation", use_past=with_past,
            use_past_in_inputs=with_past)}
    with all_experts(arch):
        main_export(str(hf_dir), output=str(out_dir), task=task, device="cpu",
                    do_validation=False, **kw)
    model = Path(out_dir) / "model.onnx"
    if not model.is_file():
        raise RuntimeError(f"optimum export wrote no model.onnx in {str(out_dir)!r}")
    return model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--arch", choices=ARCHS, default="qwen3_moe")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args(argv)
    out = Path(a.out_dir)
    hf = build_hf_moe(out.with_name(out.name + ".hf"), a.arch, experts=a.experts,
                      layers=a.layers)
    print(export_moe(hf, out, a.arch))


if __name__ == "__main__":
    main()
