"""GPT-style decoder-only transformer written directly in ONNX (no torch).

The graph is built with ``onnx.helper`` and random numpy weights, so it can be produced at any
size quickly and offline. It is meant as a test and benchmark workload for ho-onnx::

    from models.decoder import build_decoder
    model = build_decoder("out/tiny.onnx", layers=2, hidden=64, heads=4)

or from the shell::

    python -m models.decoder out/gpt.onnx --layers 12 --hidden 768 --heads 12 --external-data

Graph (opset 17+): ``input_ids`` int64 [batch, seq] -> ``logits`` [batch, seq, vocab]; with
``kv_cache=True`` also a key/value cache per layer in and out (decode steps), named as this
module always has (``past_key.{i}``) or, with ``cache_layout="optimum"``, as Optimum's
exports name it (``past_key_values.{i}.key`` in, ``present.{i}.key`` out); ``kv_heads`` below
``heads`` shares each key/value head among ``heads // kv_heads`` query heads (grouped-query
attention, the cache holds ``kv_heads``).
Token embedding Gather + learned position embedding (positions from ``Range(0, seq)``), N pre-LN
blocks (LayerNormalization, fused QKV MatMul, multi-head causal attention with a run-time
``Trilu`` mask, output projection, residual, LayerNormalization, MLP with erf-GELU, residual),
final LayerNormalization and an LM head MatMul. Nodes are named like ``layers.3.attn.qkv`` and
weights like ``layers.3.attn.qkv.weight``.

With ``external_data=True`` every initializer is streamed, one tensor at a time, into a single
``<model file name>.data`` file beside the model (e.g. ``gpt.onnx`` -> ``gpt.onnx.data``), each
tensor at a 4096-byte-aligned offset, so models far above 2 GB never exist twice in memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["CACHE_LAYOUTS", "build_decoder", "build_decoder_once", "cache_names",
           "decoder_config_bytes", "decoder_weight_specs", "main"]

PROTO_LIMIT = 2**31  # protobuf cannot serialize a message of 2 GiB or more
ALIGN = 4096  # offset alignment of tensors in the external data file (page size, mmap friendly)

CACHE_LAYOUTS = ("ho", "optimum")  # names of the cache inputs/outputs (:func:`cache_names`)

_DTYPES = {
    "float32": (np.float32, TensorProto.FLOAT),
    "float16": (np.float16, TensorProto.FLOAT16),
}


def cache_names(layer: int, layout: str = "ho") -> dict[str, str]:
    """The cache's graph names of ``layer`` in ``layout``: keys ``past_key``, ``past_value``,
    ``present_key``, ``present_value``."""
    if layout == "optimum":
        return {f"{d}_{k}": f"{pre}.{layer}.{k}" for d, pre in
                (("past", "past_key_values"), ("present", "present")) for k in ("key", "value")}
    if layout == "ho":
        return {f"{d}_{k}": f"{d}_{k}.{layer}" for d in ("past", "present")
                for k in ("key", "value")}
    raise ValueError(f"cache_layout must be one of {CACHE_LAYOUTS}, got {layout!r}")


def _resolve(hidden: int, heads: int, ffn: int | None, seq: int | str,
             max_positions: int | None, kv_heads: int | None = None) -> tuple[int, int]:
    if hidden <= 0 or heads <= 0 or hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be a positive multiple of heads ({heads})")
    if kv_heads is not None and (kv_heads <= 0 or heads % kv_heads):
        raise ValueError(f"kv_heads ({kv_heads}) must divide heads ({heads})")
    ffn = 4 * hidden if ffn is None else ffn
    if max_positions is None:
        max_positions = seq if isinstance(seq, int) else 1024
    if isinstance(seq, int) and seq > max_positions:
        raise ValueError(f"seq ({seq}) exceeds max_positions ({max_positions})")
    return ffn, max_positions


def _qkv_width(hidden: int, heads: int | None, kv_heads: int | None) -> int:
    """Columns of the fused QKV projection: queries, then keys and values of ``kv_heads``."""
    if heads is None or kv_heads is None:
        return 3 * hidden
    return hidden + 2 * kv_heads * (hidden // heads)


def decoder_weight_specs(*, layers: int = 2, hidden: int = 64, ffn: int | None = None,
                         vocab: int = 128, max_positions: int = 1024, heads: int | None = None,
                         kv_heads: int | None = None,
                         ) -> list[tuple[str, tuple[int, ...], str]]:
    """The weights in creation order as ``(name, shape, init)``; init is normal/ones/zeros.
    ``heads`` and ``kv_heads`` matter only together (grouped-query attention's narrower QKV)."""
    ffn = 4 * hidden if ffn is None else ffn
    qkv = _qkv_width(hidden, heads, kv_heads)
    specs: list[tuple[str, tuple[int, ...], str]] = [
        ("embed.tok.weight", (vocab, hidden), "normal"),
        ("embed.pos.weight", (max_positions, hidden), "normal"),
    ]
    for i in range(layers):
        p = f"layers.{i}"
        specs += [
            (f"{p}.ln_1.weight", (hidden,), "ones"),
            (f"{p}.ln_1.bias", (hidden,), "zeros"),
            (f"{p}.attn.qkv.weight", (hidden, qkv), "normal"),
            (f"{p}.attn.qkv.bias", (qkv,), "normal"),
            (f"{p}.attn.proj.weight", (hidden, hidden), "normal"),
            (f"{p}.attn.proj.bias", (hidden,), "normal"),
            (f"{p}.ln_2.weight", (hidden,), "ones"),
            (f"{p}.ln_2.bias", (hidden,), "zeros"),
            (f"{p}.mlp.fc1.weight", (hidden, ffn), "normal"),
            (f"{p}.mlp.fc1.bias", (ffn,), "normal"),
            (f"{p}.mlp.fc2.weight", (ffn, hidden), "normal"),
            (f"{p}.mlp.fc2.bias", (hidden,), "normal"),
        ]
    specs += [
        ("ln_f.weight", (hidden,), "ones"),
        ("ln_f.bias", (hidden,), "zeros"),
        ("lm_head.weight", (hidden, vocab), "normal"),
    ]
    return specs


def decoder_config_bytes(*, layers: int = 2, hidden: int = 64, heads: int = 4,
                         ffn: int | None = None, vocab: int = 128, seq: int | str = "seq",
                         max_positions: int | None = None, dtype: str = "float32",
                         kv_heads: int | None = None) -> dict[str, int]:
    """Parameter counts and weight bytes of a :func:`build_decoder` config (no graph is built).

    Keys: ``per_layer_params``, ``per_layer_bytes`` (one transformer block),
    ``embedding_params``/``embedding_bytes`` (token + position tables),
    ``head_params``/``head_bytes`` (final LayerNorm + LM head), ``total_params``, ``total_bytes``,
    ``itemsize``.
    """
    ffn, max_positions = _resolve(hidden, heads, ffn, seq, max_positions, kv_heads)
    itemsize = np.dtype(_DTYPES[dtype][0]).itemsize
    qkv = _qkv_width(hidden, heads, kv_heads)
    per_layer = 4 * hidden + (hidden * qkv + qkv) + (hidden * hidden + hidden) \
        + (hidden * ffn + ffn) + (ffn * hidden + hidden)
    embedding = vocab * hidden + max_positions * hidden
    head = 2 * hidden + hidden * vocab
    total = embedding + layers * per_layer + head
    return {
        "per_layer_params": per_layer,
        "per_layer_bytes": per_layer * itemsize,
        "embedding_params": embedding,
        "embedding_bytes": embedding * itemsize,
        "head_params": head,
        "head_bytes": head * itemsize,
        "total_params": total,
        "total_bytes": total * itemsize,
        "itemsize": itemsize,
    }


def _weights(specs, rng: np.random.Generator, np_dtype, std: float
             ) -> Iterator[tuple[str, np.ndarray]]:
    for name, shape, init in specs:
        if init == "ones":
            arr = np.ones(shape, dtype=np_dtype)
        elif init == "zeros":
            arr = np.zeros(shape, dtype=np_dtype)
        else:
            arr = rng.standard_normal(shape, dtype=np.float32)
            arr *= np.float32(std)
            if np_dtype != np.float32:
                arr = arr.astype(np_dtype)
        yield name, arr


def _external_tensor(t: TensorProto, name: str, arr: np.ndarray, elem_type: int,
                     location: str, offset: int) -> TensorProto:
    t.name = name
    t.data_type = elem_type
    t.dims.extend(arr.shape)
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)),
                       ("length", str(arr.nbytes))):
        entry = t.external_data.add()
        entry.key = key
        entry.value = value
    return t


class _Graph:
    """Small helper collecting nodes with unique, meaningful names."""

    def __init__(self, elem_type: int, np_dtype) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.names: set[str] = set()
        self.elem_type = elem_type
        self.np_dtype = np_dtype

    def op(self, op_type: str, name: str, inputs: list[str], n_out: int = 1,
           outputs: list[str] | None = None, **attrs) -> str | list[str]:
        if name in self.names:
            raise AssertionError(f"duplicate node name {name}")
        self.names.add(name)
        if outputs is None:
            outputs = [name] if n_out == 1 else [f"{name}.{k}" for k in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=name, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def const(self, name: str, value) -> str:
        arr = np.asarray(value)
        return self.op("Constant", name, [], value=numpy_helper.from_array(arr, name))

    def fconst(self, name: str, value: float) -> str:
        return self.const(name, np.array(value, dtype=self.np_dtype))


def build_decoder(path: str | os.PathLike | None = None, *, layers: int = 2, hidden: int = 64,
                  heads: int = 4, ffn: int | None = None, vocab: int = 128,
                  seq: int | str = "seq", batch: int | str = "batch", dtype: str = "float32",
                  seed: int = 0, external_data: bool = False, opset: int = 17,
                  max_positions: int | None = None, std: float = 0.02,
                  kv_cache: bool = False, past: int | str = "past",
                  cache_layout: str = "ho", kv_heads: int | None = None) -> onnx.ModelProto:
    """Build a random-weight GPT-style decoder as an ONNX model.

    Args:
        path: where to save the model (optional). Needed when ``external_data`` is True.
        layers, hidden, heads, ffn, vocab: architecture (``ffn`` defaults to ``4 * hidden``).
        seq, batch: dims of ``input_ids``; a str is a symbolic dim, an int a fixed one.
        dtype: ``"float32"`` or ``"float16"`` (weights, activations and logits).
        seed: ``numpy.random.default_rng`` seed; same seed -> identical weights.
        external_data: stream all initializers into ``<file name>.data`` beside ``path``; the
            returned proto then references that file and holds no weight bytes.
        opset: default-domain opset, >= 17 (LayerNormalization).
        max_positions: rows of the position table (default: ``seq`` if it is an int, else 1024);
            the model accepts any sequence length up to this.
        std: standard deviation of the normal weights.
        kv_cache: decode with a key/value cache: inputs ``past_key.{i}``/``past_value.{i}``
            [batch, heads, past, head_dim], outputs ``present_key.{i}``/``present_value.{i}``
            [batch, heads, past + seq, head_dim] (the past with this step's keys/values
            appended); positions start at ``past`` and the causal mask lets token ``t`` see
            the whole past. Same weights as without a cache (same seed).
        past: the past length dim of the cache inputs (a str is symbolic, an int fixed; ``0``
            is an empty cache).
        cache_layout: the cache's names (:func:`cache_names`): ``"ho"`` as above, or
            ``"optimum"``: ``past_key_values.{i}.key``/``.value`` in, ``present.{i}.key``/
            ``.value`` out, as Optimum's decoder exports with past.
        kv_heads: key/value heads (default ``heads``); fewer share each among
            ``heads // kv_heads`` query heads (grouped-query attention): the QKV projection is
            ``hidden + 2 * kv_heads * head_dim`` wide and the cache holds ``kv_heads`` heads.

    Returns:
        The ``onnx.ModelProto`` (without weight data when ``external_data`` is True).
    """
    if opset < 17:
        raise ValueError("opset must be >= 17 (LayerNormalization)")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}")
    ffn, max_positions = _resolve(hidden, heads, ffn, seq, max_positions, kv_heads)
    kv_heads = heads if kv_heads is None else kv_heads
    names = [cache_names(i, cache_layout) for i in range(layers)]
    np_dtype, elem = _DTYPES[dtype]
    sizes = decoder_config_bytes(layers=layers, hidden=hidden, heads=heads, ffn=ffn,
                                 vocab=vocab, seq=seq, max_positions=max_positions, dtype=dtype,
                                 kv_heads=kv_heads)
    if external_data and path is None:
        raise ValueError("external_data=True needs a path to write the data file beside")
    if not external_data and sizes["total_bytes"] >= PROTO_LIMIT - (64 << 20):
        raise ValueError(f"{sizes['total_bytes']} bytes of weights do not fit in one protobuf "
                         "(2 GiB limit): use external_data=True")
    head_dim = hidden // heads

    specs = decoder_weight_specs(layers=layers, hidden=hidden, ffn=ffn, vocab=vocab,
                                 max_positions=max_positions, heads=heads, kv_heads=kv_heads)

    g = _Graph(elem, np_dtype)
    eps = 1e-5
    # shapes / positions / causal mask, shared by all layers
    ids_shape = g.op("Shape", "embed.ids_shape", ["input_ids"])
    seq_len = g.op("Gather", "embed.seq_len", [ids_shape, g.const("const.one_i64", np.int64(1))],
                   axis=0)
    if kv_cache:  # positions past .. past + seq - 1
        past_shape = g.op("Shape", "cache.past_shape", [names[0]["past_key"]])
        start = g.op("Gather", "cache.past_len", [past_shape, g.const("const.two_i64",
                                                                      np.int64(2))], axis=0)
        end = g.op("Add", "cache.total_len", [start, seq_len])
    else:
        start, end = g.const("const.zero_i64", np.int64(0)), seq_len
    positions = g.op("Range", "embed.positions", [start, end,
                                                  g.const("const.step_i64", np.int64(1))])
    tok = g.op("Gather", "embed.tok", ["embed.tok.weight", "input_ids"], axis=0)
    pos = g.op("Gather", "embed.pos", ["embed.pos.weight", positions], axis=0)
    x = g.op("Add", "embed.add", [tok, pos])

    axes0 = g.const("const.axes0", np.array([0]))
    seq_1d = g.op("Unsqueeze", "mask.seq_1d", [seq_len, axes0])
    # [seq, past + seq]: query t sees keys 0 .. past + t
    keys_1d = g.op("Unsqueeze", "mask.keys_1d", [end, axes0]) if kv_cache else seq_1d
    mask_shape = g.op("Concat", "mask.shape", [seq_1d, keys_1d], axis=0)
    ones = g.op("ConstantOfShape", "mask.ones", [mask_shape],
                value=numpy_helper.from_array(np.array([1.0], dtype=np.float32)))
    diag = g.op("Add", "mask.diag", [start, g.const("const.diag1", np.int64(1))]) if kv_cache \
        else g.const("const.diag1", np.int64(1))
    upper = g.op("Trilu", "mask.upper", [ones, diag], upper=1)
    neg = -1e9 if dtype == "float32" else -1e4
    mask = g.op("Mul", "mask.causal_f32", [upper, g.const("mask.neg", np.float32(neg))])
    if dtype != "float32":
        mask = g.op("Cast", "mask.causal", [mask], to=elem)

    kv_width = kv_heads * head_dim
    split_sizes = g.const("const.qkv_split", np.array([hidden, kv_width, kv_width],
                                                      dtype=np.int64))
    heads_shape = g.const("const.heads_shape", np.array([0, 0, heads, head_dim], dtype=np.int64))
    kv_shape = heads_shape if kv_heads == heads else g.const(
        "const.kv_heads_shape", np.array([0, 0, kv_heads, head_dim], dtype=np.int64))
    if kv_heads != heads:  # [b, kvH, t, d] -> [b, kvH, group, t, d] -> [b, H, t, d]
        group_expand = g.const("const.group_expand",
                               np.array([1, 1, heads // kv_heads, 1, 1], dtype=np.int64))
        group_merge = g.const("const.group_merge",
                              np.array([0, heads, -1, head_dim], dtype=np.int64))
        axes2 = g.const("const.axes2", np.array([2]))
    merge_shape = g.const("const.merge_shape", np.array([0, 0, hidden], dtype=np.int64))
    scale = g.fconst("const.attn_scale", 1.0 / math.sqrt(head_dim))
    inv_sqrt2 = g.fconst("const.inv_sqrt2", 1.0 / math.sqrt(2.0))
    one = g.fconst("const.one", 1.0)
    half = g.fconst("const.half", 0.5)

    def linear(name: str, inp: str, bias: bool = True) -> str:
        y = g.op("MatMul", name, [inp, f"{name}.weight"])
        if bias:
            y = g.op("Add", f"{name}.bias_add", [y, f"{name}.bias"])
        return y

    def share_heads(name: str, kv: str) -> str:
        """``kv`` [b, kv_heads, t, d] as [b, heads, t, d] (each head used by its group)."""
        if kv_heads == heads:
            return kv
        kv = g.op("Unsqueeze", f"{name}_group", [kv, axes2])
        kv = g.op("Expand", f"{name}_expand", [kv, group_expand])
        return g.op("Reshape", f"{name}_shared", [kv, group_merge])

    def layer_norm(name: str, inp: str) -> str:
        return g.op("LayerNormalization", name, [inp, f"{name}.weight", f"{name}.bias"],
                    axis=-1, epsilon=eps)

    for i in range(layers):
        p = f"layers.{i}"
        h = layer_norm(f"{p}.ln_1", x)
        qkv = linear(f"{p}.attn.qkv", h)
        q, k, v = g.op("Split", f"{p}.attn.split", [qkv, split_sizes], axis=-1,
                       outputs=[f"{p}.attn.q", f"{p}.attn.k", f"{p}.attn.v"])
        q = g.op("Reshape", f"{p}.attn.q_heads", [q, heads_shape])
        k = g.op("Reshape", f"{p}.attn.k_heads", [k, kv_shape])
        v = g.op("Reshape", f"{p}.attn.v_heads", [v, kv_shape])
        q = g.op("Transpose", f"{p}.attn.q_t", [q], perm=[0, 2, 1, 3])  # [b, H, s, d]
        if kv_cache:  # [b, H, past + s, d], kept for the next step; keys transposed for q @ k
            k = g.op("Transpose", f"{p}.attn.k_new", [k], perm=[0, 2, 1, 3])
            k = g.op("Concat", f"{p}.cache.key", [names[i]["past_key"], k], axis=2,
                     outputs=[names[i]["present_key"]])
            k = share_heads(f"{p}.attn.k", k)
            k = g.op("Transpose", f"{p}.attn.k_t", [k], perm=[0, 1, 3, 2])
            v = g.op("Transpose", f"{p}.attn.v_new", [v], perm=[0, 2, 1, 3])
            v = g.op("Concat", f"{p}.cache.value", [names[i]["past_value"], v], axis=2,
                     outputs=[names[i]["present_value"]])
            v = share_heads(f"{p}.attn.v", v)
        elif kv_heads != heads:
            k = g.op("Transpose", f"{p}.attn.k_new", [k], perm=[0, 2, 1, 3])  # [b, kvH, s, d]
            k = g.op("Transpose", f"{p}.attn.k_t", [share_heads(f"{p}.attn.k", k)],
                     perm=[0, 1, 3, 2])  # [b, H, d, s]
            v = g.op("Transpose", f"{p}.attn.v_new", [v], perm=[0, 2, 1, 3])
            v = share_heads(f"{p}.attn.v", v)  # [b, H, s, d]
        else:
            k = g.op("Transpose", f"{p}.attn.k_t", [k], perm=[0, 2, 3, 1])  # [b, H, d, s]
            v = g.op("Transpose", f"{p}.attn.v_t", [v], perm=[0, 2, 1, 3])  # [b, H, s, d]
        s = g.op("MatMul", f"{p}.attn.scores", [q, k])
        s = g.op("Mul", f"{p}.attn.scale", [s, scale])
        s = g.op("Add", f"{p}.attn.mask", [s, mask])
        a = g.op("Softmax", f"{p}.attn.softmax", [s], axis=-1)
        c = g.op("MatMul", f"{p}.attn.context", [a, v])  # [b, H, s, d]
        c = g.op("Transpose", f"{p}.attn.context_t", [c], perm=[0, 2, 1, 3])
        c = g.op("Reshape", f"{p}.attn.merge", [c, merge_shape])
        c = linear(f"{p}.attn.proj", c)
        x = g.op("Add", f"{p}.attn.residual", [x, c])

        h = layer_norm(f"{p}.ln_2", x)
        h = linear(f"{p}.mlp.fc1", h)
        e = g.op("Mul", f"{p}.mlp.gelu.scale", [h, inv_sqrt2])
        e = g.op("Erf", f"{p}.mlp.gelu.erf", [e])
        e = g.op("Add", f"{p}.mlp.gelu.add1", [e, one])
        e = g.op("Mul", f"{p}.mlp.gelu.mul_x", [h, e])
        h = g.op("Mul", f"{p}.mlp.gelu", [e, half])
        h = linear(f"{p}.mlp.fc2", h)
        x = g.op("Add", f"{p}.mlp.residual", [x, h])

    x = layer_norm("ln_f", x)
    g.op("MatMul", "lm_head", [x, "lm_head.weight"], outputs=["logits"])

    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq])]
    outputs = [helper.make_tensor_value_info("logits", elem, [batch, seq, vocab])]
    if kv_cache:
        total = past + seq if isinstance(past, int) and isinstance(seq, int) else f"{past} + {seq}"
        for i in range(layers):
            for kind in ("key", "value"):
                inputs.append(helper.make_tensor_value_info(
                    names[i][f"past_{kind}"], elem, [batch, kv_heads, past, head_dim]))
                outputs.append(helper.make_tensor_value_info(
                    names[i][f"present_{kind}"], elem, [batch, kv_heads, total, head_dim]))
    graph = helper.make_graph(g.nodes, f"decoder_l{layers}_h{hidden}", inputs, outputs)
    opsets = [helper.make_opsetid("", opset)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="ho-onnx.models.decoder",
                              ir_version=helper.find_min_ir_version_for(opsets))
    # Weights go straight into the model's graph (make_graph/make_model would copy them).
    inits = model.graph.initializer
    rng = np.random.default_rng(seed)
    if external_data:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        location = path.name + ".data"
        offset = 0
        with open(path.parent / location, "wb") as f:
            for name, arr in _weights(specs, rng, np_dtype, std):
                pad = -offset % ALIGN
                if pad:
                    f.write(b"\0" * pad)
                    offset += pad
                f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
                _external_tensor(inits.add(), name, arr, elem, location, offset)
                offset += arr.nbytes
                del arr
    else:
        for name, arr in _weights(specs, rng, np_dtype, std):
            t = inits.add()
            t.name = name
            t.data_type = elem
            t.dims.extend(arr.shape)
            t.raw_data = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()
            del arr
    meta = {"layers": layers, "hidden": hidden, "heads": heads,
            **({"kv_heads": kv_heads} if kv_heads != heads else {}), "ffn": ffn, "vocab": vocab,
            "max_positions": max_positions, "dtype": dtype, "seed": seed,
            "total_params": sizes["total_params"], "total_bytes": sizes["total_bytes"]}
    helper.set_model_props(model, {k: str(v) for k, v in meta.items()})

    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not external_data:
            stale = path.parent / (path.name + ".data")
            if stale.exists():
                stale.unlink()
        onnx.save_model(model, str(path))
    return model


def build_decoder_once(folder: str | os.PathLike, cfg: dict) -> tuple[Path, bool]:
    """``folder/decoder.onnx`` with external data for ``cfg`` (``layers``, ``hidden``,
    ``heads``, ``vocab``, ``seq``, ``batch``, ``dtype``; positions up to ``seq`` unless
    ``max_positions``; optional ``kv_cache``, ``past``, ``cache_layout``, ``kv_heads``, ``ffn``
    as :func:`build_decoder` takes them), built only when ``folder/decoder.json`` does not
    record the same config; returns the path and whether it was built now (benchmarks
    rebuild a multi-GB decoder only when its config changed)."""
    folder = Path(folder)
    src, stamp = folder / "decoder.onnx", folder / "decoder.json"
    if src.exists() and stamp.exists() and json.loads(stamp.read_text()) == cfg:
        return src, False
    build_decoder(src, layers=cfg["layers"], hidden=cfg["hidden"], heads=cfg["heads"],
                  vocab=cfg["vocab"], seq=cfg["seq"], batch=cfg["batch"], dtype=cfg["dtype"],
                  external_data=True, max_positions=cfg.get("max_positions", cfg["seq"]),
                  **{k: cfg[k] for k in ("kv_cache", "past", "cache_layout", "kv_heads", "ffn")
                     if k in cfg})
    stamp.write_text(json.dumps(cfg))
    return src, True


def add_shape_args(ap: argparse.ArgumentParser, *, layers: int, hidden: int, heads: int,
                   seq: int, batch: int = 1) -> None:
    """``--layers --hidden --heads --seq --batch`` of a benchmark's decoder, with its defaults."""
    for name, default in (("layers", layers), ("hidden", hidden), ("heads", heads),
                          ("seq", seq), ("batch", batch)):
        ap.add_argument(f"--{name}", type=int, default=default)


def _int_or_str(value: str) -> int | str:
    return int(value) if value.lstrip("-").isdigit() else value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m models.decoder",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output .onnx path")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=None, help="MLP width (default 4*hidden)")
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--seq", type=_int_or_str, default="seq", help="int or symbolic name")
    ap.add_argument("--batch", type=_int_or_str, default="batch", help="int or symbolic name")
    ap.add_argument("--max-positions", type=int, default=None)
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--opset", type=int, default=17)
    ap.add_argument("--external-data", action="store_true",
                    help="write weights to <out>.data beside the model")
    ap.add_argument("--kv-cache", action="store_true",
                    help="past_key/past_value inputs and present_* outputs per layer (decode)")
    ap.add_argument("--past", type=_int_or_str, default="past",
                    help="past length of the cache inputs: int or symbolic name")
    ap.add_argument("--cache-layout", choices=CACHE_LAYOUTS, default="ho",
                    help="cache names: past_key.{i} (ho) or past_key_values.{i}.key (optimum)")
    ap.add_argument("--kv-heads", type=int, default=None,
                    help="key/value heads (default --heads; fewer: grouped-query attention)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    build_decoder(args.out, layers=args.layers, hidden=args.hidden, heads=args.heads,
                  ffn=args.ffn, vocab=args.vocab, seq=args.seq, batch=args.batch,
                  dtype=args.dtype, seed=args.seed, external_data=args.external_data,
                  opset=args.opset, max_positions=args.max_positions,
                  kv_cache=args.kv_cache, past=args.past, cache_layout=args.cache_layout,
                  kv_heads=args.kv_heads)
    sizes = decoder_config_bytes(layers=args.layers, hidden=args.hidden, heads=args.heads,
                                 ffn=args.ffn, vocab=args.vocab, seq=args.seq,
                                 max_positions=args.max_positions, dtype=args.dtype,
                                 kv_heads=args.kv_heads)
    print(f"wrote {args.out} in {time.perf_counter() - t0:.2f} s")
    print(f"parameters: {sizes['total_params']:,}  bytes: {sizes['total_bytes']:,} "
          f"({sizes['total_bytes'] / 2**20:.1f} MiB; {sizes['per_layer_bytes']:,} per layer)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
