"""Greedy generation with the KV cache in host memory (issue 36): an IOBinding loop over a
decoder exported with past (Optimum's or onnxruntime-genai's layout, the models of
``models/decoder.py``), the pairs found by structure (:mod:`ho_onnx.graph.kv`).

Each step binds the last step's presents as this step's pasts and the presents into buffers
of the loop's own (:class:`KvBuffers`: host memory, pinned on a GPU machine, or device
memory; never copied through numpy, never allocated by ORT). With a model optimized with
``--offload-kv`` the device then holds one layer's cache at a time; with an unmodified model
the same loop is the reference.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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


def empty_pasts(layout: KvLayout, batch: int = 1) -> dict[str, np.ndarray]:
    """Every past of ``layout``, empty (a prompt's first run)."""
    return {p: _empty_past(layout, p, batch) for p, _ in layout.pairs}


def run_numpy(session: ort.InferenceSession, layout: KvLayout, pasts: dict[str, np.ndarray],
              ids: Sequence[int]) -> tuple[int, dict[str, np.ndarray]]:
    """One run as a loop without :class:`KvBuffers` makes it (Optimum's ``ORTModelForCausalLM``
    on the CPU): the pasts in as numpy arrays, the presents ORT allocated out; (the greedy
    next token, the presents: the next run's pasts). Batch 1."""
    done = next(iter(pasts.values())).shape[layout.seq_axis] if pasts else 0
    names = [o.name for o in session.get_outputs()]
    out = dict(zip(names, session.run(None, {**_token_inputs(layout, ids, done), **pasts}),
                   strict=True))
    return int(np.argmax(out[layout.logits][0, -1])), {p: out[q] for p, q in layout.pairs}


def _token_inputs(layout: KvLayout, ids: Sequence[int], done: int) -> dict[str, np.ndarray]:
    """The inputs of a run over ``ids`` after ``done`` cached tokens (batch 1): the ids, and
    the attention mask and positions where the model has them."""
    n = len(ids)
    feeds = {layout.input_ids: np.asarray([list(ids)], dtype=np.int64)}
    if layout.attention_mask:
        feeds[layout.attention_mask] = np.ones((1, done + n), np.int64)
    if layout.position_ids:
        feeds[layout.position_ids] = np.arange(done, done + n, dtype=np.int64)[None, :]
    return feeds


class KvBuffers:
    """A generation loop's KV cache in buffers of its own: two per (past, present) pair, each
    for up to ``capacity`` positions. A step binds each past as the first ``length`` positions
    of its front buffer and each present into the back one (ORT writes it there), then
    :meth:`swap` makes the presents the next step's pasts: no copy, and ORT never allocates a
    cache, so its arenas do not grow with the context (the H200 run of stop 48: after a
    32k-token generation whose cache ORT allocated, 39 GB of host memory with the cache in host
    memory, docs/benchmarks.md). A host cache is pinned where the library can pin
    (:class:`ho_onnx._ops.HostBuffer`): the CUDA engine's copies of it run at the link's rate.

    ``device``: ``"cpu"`` (host memory) or ``"cuda"`` (device memory, allocated once by ORT on
    ``device_id``). A step longer than ``capacity`` grows the back buffer (by half again at
    least; no copy: it is the step's output).
    """

    def __init__(self, layout: KvLayout, capacity: int, *, batch: int = 1,
                 device: str = "cpu", device_id: int = 0) -> None:
        if capacity < 1 or batch < 1:
            raise ValueError(f"capacity and batch must be positive, got {capacity}, {batch}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.layout, self.batch, self.device, self.device_id = layout, batch, device, device_id
        self.length = 0  # positions held by the front buffers
        self.allocations = 0
        shapes = {p: _empty_past(layout, p, batch).shape for p, _ in layout.pairs}
        self._row = {p: int(np.prod([d for k, d in enumerate(shape) if k != layout.seq_axis]))
                     for p, shape in shapes.items()}
        self._front = {p: self._alloc(p, capacity) for p, _ in layout.pairs}
        self._back = {p: self._alloc(p, capacity) for p, _ in layout.pairs}

    def _alloc(self, past: str, positions: int) -> tuple[Any, int, int]:
        """(holder, address, capacity in positions) of a buffer for ``past``'s cache."""
        itemsize = np.dtype(self.layout.past_dtype[past]).itemsize
        nbytes = max(1, self._row[past] * positions * itemsize)
        self.allocations += 1
        if self.device == "cpu":
            from ... import _ops

            buf = _ops.HostBuffer(nbytes)
            return buf, buf.address, positions
        value = ort.OrtValue.ortvalue_from_shape_and_type([nbytes], np.uint8, "cuda",
                                                          self.device_id)
        return value, value.data_ptr(), positions

    @property
    def pinned(self) -> bool:
        """Whether the host buffers are page-locked (False on a device)."""
        return self.device == "cpu" and all(getattr(b[0], "pinned", False)
                                            for b in self._front.values())

    def _shape(self, past: str, positions: int) -> list[int]:
        return [self.batch if k == 0 else positions if k == self.layout.seq_axis else int(d)
                for k, d in enumerate(self.layout.past_dims[past])]

    def bind(self, binding: ort.IOBinding, new: int) -> None:
        """Bind the pasts (the front buffers' ``length`` positions) and the presents
        (``length + new`` positions, into the back buffers) of a step of ``new`` tokens."""
        for p, q in self.layout.pairs:
            dtype = self.layout.past_dtype[p]
            _, address, _ = self._front[p]
            binding.bind_input(p, self.device, self.device_id, dtype,
                               self._shape(p, self.length), address)
            if self._back[p][2] < self.length + new:
                self._back[p] = self._alloc(p, max(self.length + new,
                                                   self._back[p][2] * 3 // 2))
            binding.bind_output(q, self.device, self.device_id, dtype,
                                self._shape(p, self.length + new), self._back[p][1])

    def swap(self, new: int) -> None:
        """After a successful step of ``new`` tokens: its presents become the pasts."""
        self._front, self._back = self._back, self._front
        self.length += new

    def past(self, name: str) -> np.ndarray:
        """A copy of the cache ``name`` (a past input) as the next step will read it."""
        holder, _, _ = self._front[name]
        shape = self._shape(name, self.length)
        if self.device == "cpu":
            count = int(np.prod(shape))
            return np.frombuffer(holder, self.layout.past_dtype[name], count).reshape(shape).copy()
        return holder.numpy().view(self.layout.past_dtype[name])[:int(np.prod(shape))] \
            .reshape(shape).copy()


SHRINK_ARENAS = "memory.enable_memory_arena_shrinkage"  # ORT's run config entry


def grown_as_requested(session: ort.InferenceSession) -> str | None:
    """ORT's list of ``session``'s arenas that grow by what is requested (the process's CPU
    arena of ``ho_onnx.InferenceSession(cpu_arena="as_requested")``, a CUDA arena with
    ``kSameAsRequested``), or None."""
    from .runtime import _USE_ENV_ALLOCATORS, CUDA_EP, _config

    names = []
    if _config(session.get_session_options(), _USE_ENV_ALLOCATORS) == "1":
        names.append("cpu:0")
    cuda = session.get_provider_options().get(CUDA_EP)
    if cuda is not None and cuda.get("arena_extend_strategy") in ("kSameAsRequested", "1"):
        names.append(f"gpu:{cuda.get('device_id', '0')}")
    return ";".join(names) or None


def shrink_options(arenas: str | None) -> ort.RunOptions | None:
    """Run options that make ORT release its arenas' free regions at the end of the run
    (``arenas``: ORT's list, e.g. ``"cpu:0"``, ``"gpu:0"``, ``"cpu:0;gpu:0"``; None: none).
    An arena that grows by what is requested (``kSameAsRequested``) keeps a region for
    every request larger than what it holds free: each prefill chunk's attention tensors
    outgrow the last one's (stop 48: 70 GB of device memory held after a 32k prefill in
    1,024-token chunks whose largest run used 9.9 GB), and so does each decode step's KV
    cache, one position longer (stop 50: +2 MiB a step on an 8-layer decoder at 2k context
    with its cache offloaded, 807 MiB after 255 steps; shrunk every step, 274 MiB and 1.7x
    the tokens/s). ORT refuses the run when a named arena does not exist (a session with
    its CPU arena off, ``"gpu:0"`` on the CPU EP): :func:`grown_as_requested` names those
    a session has."""
    if not arenas:
        return None
    ro = ort.RunOptions()
    ro.add_run_config_entry(SHRINK_ARENAS, arenas)
    return ro


def greedy(session: ort.InferenceSession, layout: KvLayout, prompt: Sequence[int],
           max_new_tokens: int, *, chunk: int | None = None, device: str = "cpu",
           shrink_arenas: str | None = "auto") -> list[int]:
    """Greedy tokens after ``prompt`` (batch 1): a prefill of the prompt (in runs of at most
    ``chunk`` tokens), then one decode step per token, the cache in :class:`KvBuffers` on
    ``device`` (host memory by default) sized for the whole generation. ORT's arenas
    ``shrink_arenas`` are shrunk after every run (:func:`shrink_options`; ``"auto"``: the
    session's arenas that grow by what is requested, :func:`grown_as_requested`)."""
    if not prompt or max_new_tokens < 0:
        raise ValueError("need a prompt of at least one token and max_new_tokens >= 0")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    if shrink_arenas == "auto":
        shrink_arenas = grown_as_requested(session)
    shrink = shrink_options(shrink_arenas)
    cache = KvBuffers(layout, len(prompt) + max(max_new_tokens, 1), device=device)
    binding = session.io_binding()
    out: list[int] = []
    if max_new_tokens:
        out.append(prefill(session, binding, layout, cache, prompt, chunk, shrink))
    while len(out) < max_new_tokens:
        out.append(_step(session, binding, layout, cache, [out[-1]], shrink))
    return out


def prefill(session: ort.InferenceSession, binding: ort.IOBinding, layout: KvLayout,
            cache: KvBuffers, ids: Sequence[int], chunk: int | None = None,
            shrink: ort.RunOptions | None = None) -> int:
    """Runs over ``ids`` after the cache, at most ``chunk`` tokens each (all at once: None),
    ``shrink`` (:func:`shrink_options`) on every run; the greedy next token."""
    step = chunk or len(ids)
    for lo in range(0, len(ids), step):
        token = _step(session, binding, layout, cache, ids[lo:lo + step], shrink)
    return token


def _step(session: ort.InferenceSession, binding: ort.IOBinding, layout: KvLayout,
          cache: KvBuffers, ids: Sequence[int], run_options: ort.RunOptions | None = None
          ) -> int:
    """One run over ``ids`` after the cache; the greedy next token."""
    n = len(ids)
    binding.clear_binding_inputs()
    binding.clear_binding_outputs()
    for name, value in _token_inputs(layout, ids, cache.length).items():
        binding.bind_cpu_input(name, value)
    binding.bind_output(layout.logits, "cpu")  # first: get_outputs()[0]
    cache.bind(binding, n)
    session.run_with_iobinding(binding, run_options)
    cache.swap(n)
    logits = binding.get_outputs()[0].numpy()
    return int(np.argmax(logits[0, -1]))
