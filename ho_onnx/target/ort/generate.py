"""Greedy generation with the KV cache in host memory (issue 36): an IOBinding loop over a
decoder exported with past (Optimum's or onnxruntime-genai's layout, the models of
``models/decoder.py``), the pairs found by structure (:mod:`ho_onnx.graph.kv`).

Each step binds the last step's present outputs as this step's past inputs (ORT values in
host memory: never copied through numpy, never a full-size device copy), and binds the
presents to host memory. With a model optimized with ``--offload-kv`` the device then holds
one layer's cache at a time; with an unmodified model the same loop is the reference.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from ...graph.analyse import analyse

KV_PAIRS_KEY = "ho_onnx.kv_pairs"  # Decision.metadata's kv_pairs, as recorded


@dataclass(frozen=True)
class KvLayout:
    """The inputs and outputs a generation loop feeds and reads (:func:`kv_layout`)."""

    input_ids: str
    attention_mask: str | None  # fed ones over past + new tokens, when the model has it
    position_ids: str | None  # fed past .. past + n - 1, when the model has it
    logits: str
    pairs: tuple[tuple[str, str], ...]  # (past input, present output), by structure
    past_dims: dict[str, tuple[int | str | None, ...]]  # declared shape of each past
    past_dtype: dict[str, np.dtype]
    seq_axis: int  # the axis along which the cache grows


def kv_layout(model: str | os.PathLike[str], *, input_ids: str = "input_ids",
              attention_mask: str = "attention_mask", position_ids: str = "position_ids",
              logits: str = "logits") -> KvLayout:
    """The layout of the decoder at ``model`` (weights are not read); a :class:`ValueError`
    names what a generation loop needs and the model lacks."""
    proto = onnx.load(os.fspath(model), load_external_data=False)
    names = {i.name for i in proto.graph.input}
    outs = {o.name for o in proto.graph.output}
    for what, name, have in (("input", input_ids, names), ("output", logits, outs)):
        if name not in have:
            raise ValueError(f"{os.fspath(model)!r} has no {what} {name!r} (a decoder's "
                             f"{'token ids' if what == 'input' else 'logits'})")
    a = analyse(proto)
    recorded = {p.key: p.value for p in proto.metadata_props}.get(KV_PAIRS_KEY)
    if recorded:  # an optimized model: the rewrite hid the structure the pairs came from
        pairs = tuple(tuple(pair.split(":", 1)) for pair in recorded.split(","))
        if any(len(pq) != 2 or pq[0] not in names or pq[1] not in outs for pq in pairs):
            raise ValueError(f"{os.fspath(model)!r}: its {KV_PAIRS_KEY} metadata names "
                             f"inputs/outputs it does not have: {recorded!r}")
    else:
        pairs = tuple((t.name, t.kv_peer) for t in a.tensors.values()
                      if t.kv_peer is not None and t.is_graph_input)
    if not pairs:
        raise ValueError(f"{os.fspath(model)!r} has no KV cache (no graph input whose reader "
                         "produces a graph output like it): export it with past")
    dims = {p: a.tensors[p].shape or () for p, _ in pairs}
    axes = {next((k for k, d in enumerate(s) if k > 0 and not isinstance(d, int)), -1)
            for s in dims.values()}
    if len(axes) != 1 or -1 in axes:
        raise ValueError("the past KV inputs do not share one symbolic sequence axis: "
                         f"{ {p: s for p, s in dims.items()} }")
    dtypes = {p: helper.tensor_dtype_to_np_dtype(a.tensors[p].elem_type or 1) for p, _ in pairs}
    return KvLayout(input_ids, attention_mask if attention_mask in names else None,
                    position_ids if position_ids in names else None, logits, pairs, dims,
                    dtypes, axes.pop())


def _empty_past(layout: KvLayout, name: str, batch: int) -> np.ndarray:
    shape = [batch if k == 0 else 0 if k == layout.seq_axis else int(d)
             for k, d in enumerate(layout.past_dims[name])]
    if any(not isinstance(d, int) for k, d in enumerate(layout.past_dims[name])
           if k not in (0, layout.seq_axis)):
        raise ValueError(f"past {name!r} has symbolic dims besides batch and sequence: "
                         f"{layout.past_dims[name]}")
    return np.zeros(shape, dtype=layout.past_dtype[name])


def greedy(session: ort.InferenceSession, layout: KvLayout, prompt: Sequence[int],
           max_new_tokens: int) -> list[int]:
    """Greedy tokens after ``prompt`` (batch 1): a prefill of the prompt, then one decode
    step per token, the cache kept in ORT values in host memory between steps."""
    if not prompt or max_new_tokens < 0:
        raise ValueError("need a prompt of at least one token and max_new_tokens >= 0")
    binding = session.io_binding()
    past: dict[str, ort.OrtValue] = {
        p: ort.OrtValue.ortvalue_from_numpy(_empty_past(layout, p, 1)) for p, _ in layout.pairs}
    step = np.asarray([list(prompt)], dtype=np.int64)
    done = 0
    out: list[int] = []
    while len(out) < max_new_tokens:
        n = step.shape[1]
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        binding.bind_cpu_input(layout.input_ids, step)
        if layout.attention_mask:
            binding.bind_cpu_input(layout.attention_mask, np.ones((1, done + n), np.int64))
        if layout.position_ids:
            binding.bind_cpu_input(layout.position_ids,
                                   np.arange(done, done + n, dtype=np.int64)[None, :])
        for p, _ in layout.pairs:
            binding.bind_ortvalue_input(p, past[p])
        binding.bind_output(layout.logits, "cpu")
        for _, q in layout.pairs:
            binding.bind_output(q, "cpu")
        session.run_with_iobinding(binding)
        bound = [layout.logits, *(q for _, q in layout.pairs)]
        values = dict(zip(bound, binding.get_outputs(), strict=True))
        logits = values[layout.logits].numpy()
        token = int(np.argmax(logits[0, -1]))
        out.append(token)
        past = {p: values[q] for p, q in layout.pairs}
        done += n
        step = np.asarray([[token]], dtype=np.int64)
    return out
