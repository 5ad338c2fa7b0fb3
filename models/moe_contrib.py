"""A random-weight decoder whose experts run in ORT's ``com.microsoft`` ``MoE`` (or ``QMoE``)
contrib op, written with onnx.helper; dims and init from a transformers ``Qwen3MoeConfig``
(nothing downloaded; its expert MLP is SwiGLU, fused and interleaved as the CPU op wants).

    input_ids [1, seq] int64, past_sum [1, 1, hidden] float  ->  logits [1, seq, vocab],
                                                                present_sum [1, 1, hidden]

Tokens mix through a running sum (``past_sum``, carried between calls like a KV cache, so a
decode step is one token); each layer is ``h += MoE(LayerNorm(h), router(LayerNorm(h)))``
with the router a weight MatMul whose ``[tokens, E]`` output is the op's ``router_probs``
(logits: the op applies its softmax); an lm_head at the end. ``quant=True`` stores the
experts as 8-bit ``QMoE`` weights (symmetric, a scale per output row).

    python -m models.moe_contrib out/moe_contrib.onnx [--quant]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["build_contrib_moe", "contrib_config", "greedy", "router_outputs", "select"]


def contrib_config(*, layers: int = 2, hidden: int = 32, moe_ffn: int = 16, experts: int = 8,
                   top_k: int = 2, vocab: int = 128) -> Any:
    """The ``Qwen3MoeConfig`` of those dims (SMALL of ``models.moe_export`` by default)."""
    import transformers as tf

    return tf.Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2,
                             moe_intermediate_size=moe_ffn, num_experts=experts,
                             num_experts_per_tok=top_k, decoder_sparse_step=1,
                             mlp_only_layers=[], norm_topk_prob=True)


def _quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """8-bit symmetric, a scale per output row (QMoE: value = scale * (q - 128))."""
    scale = np.abs(w).max(axis=-1) / 127.0 + 1e-12
    q = np.clip(np.round(w / scale[..., None]) + 128, 0, 255).astype(np.uint8)
    return q, scale.astype(np.float32)


def _layer(h: Any, nodes: list, inits: list, cfg: Any, i: int, rng: np.random.Generator,
           quant: bool) -> str:
    from onnx import helper, numpy_helper

    d, e, f, std = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, \
        cfg.initializer_range
    p = f"layers.{i}"

    def init(name: str, a: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(a, f"{p}.{name}"))
        return f"{p}.{name}"

    ln = init("norm.weight", np.ones(d, np.float32))
    nodes.append(helper.make_node("LayerNormalization", [h, ln], [f"{p}.normed"], axis=-1,
                                  epsilon=cfg.rms_norm_eps, name=f"{p}.norm"))
    nodes.append(helper.make_node("Reshape", [f"{p}.normed", "flat_shape"], [f"{p}.flat"],
                                  name=f"{p}.flatten"))
    gate = init("router.weight", rng.normal(0, std, (d, e)).astype(np.float32))
    nodes.append(helper.make_node("MatMul", [f"{p}.flat", gate], [f"{p}.router_probs"],
                                  name=f"{p}.router"))
    fc1 = rng.normal(0, std, (e, 2 * f, d)).astype(np.float32)  # gate/up rows interleaved
    fc2 = rng.normal(0, std, (e, d, f)).astype(np.float32)
    attrs = {"k": cfg.num_experts_per_tok, "activation_type": "swiglu", "swiglu_fusion": 1,
             "activation_alpha": 1.0, "activation_beta": 0.0,
             "normalize_routing_weights": int(cfg.norm_topk_prob)}
    if quant:
        (q1, s1), (q2, s2) = _quantize(fc1), _quantize(fc2)
        ins = [init("experts.fc1", q1), init("experts.fc1_scales", s1), "",
               init("experts.fc2", q2), init("experts.fc2_scales", s2)]
        op, attrs = "QMoE", attrs | {"expert_weight_bits": 8}
    else:
        ins = [init("experts.fc1", fc1), "", init("experts.fc2", fc2)]
        op = "MoE"
    nodes.append(helper.make_node(op, [f"{p}.flat", f"{p}.router_probs", *ins], [f"{p}.moe"],
                                  domain="com.microsoft", name=f"{p}.moe", **attrs))
    nodes.append(helper.make_node("Reshape", [f"{p}.moe", "seq_shape"], [f"{p}.moe3"],
                                  name=f"{p}.unflatten"))
    nodes.append(helper.make_node("Add", [h, f"{p}.moe3"], [f"{p}.out"], name=f"{p}.residual"))
    return f"{p}.out"


def build_contrib_moe(path: str | Path, *, quant: bool = False, seed: int = 0,
                      external_data: bool = True, **dims: int) -> Path:
    """Write the decoder (module docstring) of ``contrib_config(**dims)`` to ``path``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    cfg = contrib_config(**dims)
    rng = np.random.default_rng(seed)
    d, v, std = cfg.hidden_size, cfg.vocab_size, cfg.initializer_range
    inits = [numpy_helper.from_array(rng.normal(0, std, (v, d)).astype(np.float32), "embed"),
             numpy_helper.from_array(np.array([-1, d], np.int64), "flat_shape"),
             numpy_helper.from_array(np.array([1, -1, d], np.int64), "seq_shape"),
             numpy_helper.from_array(np.array(1, np.int64), "seq_axis"),
             numpy_helper.from_array(np.array([-1], np.int64), "last"),
             numpy_helper.from_array(np.array([1 << 62], np.int64), "end"),
             numpy_helper.from_array(np.array([1], np.int64), "axis1"),
             numpy_helper.from_array(np.array(0.1, np.float32), "mix")]
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["emb"], name="embed"),
             helper.make_node("CumSum", ["emb", "seq_axis"], ["cum"], name="cumsum"),
             helper.make_node("Add", ["cum", "past_sum"], ["running"], name="running"),
             helper.make_node("Slice", ["running", "last", "end", "axis1"], ["present_sum"],
                              name="present"),
             helper.make_node("Mul", ["running", "mix"], ["mixed"], name="mixed"),
             helper.make_node("Add", ["emb", "mixed"], ["h0"], name="h0")]
    h = "h0"
    for i in range(cfg.num_hidden_layers):
        h = _layer(h, nodes, inits, cfg, i, rng, quant)
    inits += [numpy_helper.from_array(np.ones(d, np.float32), "norm.weight"),
              numpy_helper.from_array(rng.normal(0, std, (d, v)).astype(np.float32),
                                      "lm_head.weight")]
    nodes += [helper.make_node("LayerNormalization", [h, "norm.weight"], ["final"], axis=-1,
                               epsilon=cfg.rms_norm_eps, name="norm"),
              helper.make_node("MatMul", ["final", "lm_head.weight"], ["logits"],
                               name="lm_head")]
    graph = helper.make_graph(
        nodes, "moe_contrib",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "seq"]),
         helper.make_tensor_value_info("past_sum", TensorProto.FLOAT, [1, 1, d])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "seq", v]),
         helper.make_tensor_value_info("present_sum", TensorProto.FLOAT, [1, 1, d])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)],
                              ir_version=8)  # opset 17's; not the installed onnx's newest
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path, save_as_external_data=external_data, size_threshold=256,
              location=path.name + ".data" if external_data else None)
    return path


def router_outputs(src: str | Path, dst: str | Path) -> list[str]:
    """Copy ``src`` to ``dst`` with every MoE/QMoE node's router input as an extra output
    (the router's own output, to check what moved against); returns those names."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(src))
    names = [n.input[1] for n in model.graph.node if n.op_type in ("MoE", "QMoE")]
    model.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                              for n in names)
    onnx.save(model, str(dst), save_as_external_data=True, location=Path(dst).name + ".data")
    return names


def select(router: np.ndarray, k: int, softmax: bool = True) -> set[int]:
    """The experts the op selects for any row of ``router`` [tokens, E]: the k largest
    (softmax probability, expert) pairs of each row (QMoE: raw values), a larger index winning
    a tie (the CPU kernels' partial sort on pairs)."""
    chosen: set[int] = set()
    for row in np.asarray(router, np.float32).reshape(-1, router.shape[-1]):
        p = row
        if softmax:
            p = np.exp(row - row.max())
            p = p / p.sum()
        chosen |= {j for _, j in sorted(((v, j) for j, v in enumerate(p.tolist())),
                                        reverse=True)[:k]}
    return chosen


def greedy(session: Any, prompt: list[int], steps: int, hidden: int) -> list[int]:
    """Greedy tokens: the prompt at once, then one token per call (``past_sum`` carried)."""
    past = np.zeros((1, 1, hidden), np.float32)
    ids, out = list(prompt), []
    for _ in range(steps):
        logits, past = session.run(None, {"input_ids": np.asarray([ids], np.int64),
                                          "past_sum": past})[:2]
        ids = [int(np.argmax(logits[0, -1]))]
        out += ids
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--quant", action="store_true", help="8-bit QMoE experts")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    args = ap.parse_args(argv)
    print(build_contrib_moe(args.out, quant=args.quant, layers=args.layers,
                            experts=args.experts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
