"""A generation loop's KV cache in buffers of its own (``generate.KvBuffers``, issue 36): ORT
writes each present into the loop's buffer and reads each past from it, so it never allocates
a cache (on the H200 of stop 48 the cache ORT allocated held 39 GB of host memory after a
32k-token generation). Checked against a loop that knows nothing of it: ``session.run`` with
numpy pasts, the presents fed back."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import ho_onnx
from ho_onnx import _ops
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.target.ort.generate import (
    KvBuffers,
    _step,
    empty_pasts,
    greedy,
    kv_layout,
    run_numpy,
)
from models.decoder import build_decoder

pytestmark = pytest.mark.usefixtures("no_debug_hooks")


def _decoder(tmp: Path, layers: int = 2, max_positions: int = 128) -> Path:
    path = tmp / "dec.onnx"
    build_decoder(path, layers=layers, hidden=64, heads=4, max_positions=max_positions,
                  vocab=97, std=0.2, external_data=True, kv_cache=True)
    return path


KV_ONLY = OffloadOptions(kv=True, weights=False, activations=False)


def _optimized(src: Path, seq: int, past: int, options: OffloadOptions = KV_ONLY) -> Path:
    """``src`` optimized beside it, one plan for batch 1, ``seq`` 1..seq, ``past`` 0..past."""
    out = src.with_name("dec.ho.onnx")
    ho_onnx.optimize(src, out, options, {},
                     dim_ranges={"batch": (1, 1), "seq": (1, seq), "past": (0, past)})
    return out


def _reference(sess: ort.InferenceSession, layout, steps: list[list[int]]):
    """(tokens, the presents after each step) of the plain loop."""
    past = empty_pasts(layout)
    tokens, presents = [], []
    for ids in steps:
        token, past = run_numpy(sess, layout, past, ids)
        tokens.append(token)
        presents.append(past)
    return tokens, presents


def test_presents_are_written_into_the_loops_buffers(tmp_path):
    """After each step the buffers hold exactly the plain loop's presents (a cache ORT wrote
    elsewhere would leave them zero), across a growth of the back buffers (capacity 2 for a
    5-token prefill) and the decode steps after it."""
    src = _decoder(tmp_path)
    layout = kv_layout(src)
    sess = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    steps = [[3, 1, 4, 1, 5], [9], [2], [6]]
    want_tokens, want_presents = _reference(sess, layout, steps)
    cache = KvBuffers(layout, 2)
    assert cache.allocations == 2 * len(layout.pairs)
    binding = sess.io_binding()
    for ids, token, presents in zip(steps, want_tokens, want_presents, strict=True):
        assert _step(sess, binding, layout, cache, ids) == token
        for p, _ in layout.pairs:
            np.testing.assert_array_equal(cache.past(p), presents[p])
    assert cache.length == 8
    assert cache.allocations > 2 * len(layout.pairs)  # the back buffers grew


def test_a_cache_sized_for_the_generation_never_reallocates(tmp_path):
    src = _decoder(tmp_path)
    layout = kv_layout(src)
    sess = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    cache = KvBuffers(layout, 12)
    binding = sess.io_binding()
    for ids in ([3, 1, 4, 1], [5], [9], [2], [6], [5], [3], [5], [8]):
        _step(sess, binding, layout, cache, ids)
    assert cache.length == 12 and cache.allocations == 2 * len(layout.pairs)


def test_greedy_chunked_and_whole_prefill_and_the_plain_loop_agree(tmp_path):
    src = _decoder(tmp_path)
    layout = kv_layout(src)
    sess = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    whole = greedy(sess, layout, prompt, 12)
    assert len(set(whole)) > 3, whole
    assert greedy(sess, layout, prompt, 12, chunk=3) == whole
    steps = [prompt] + [[t] for t in whole[:-1]]
    assert _reference(sess, layout, steps)[0] == whole


def test_kv_offloaded_model_reads_and_writes_the_buffers(tmp_path):
    """The optimized model's PrefetchInputs copy from the buffers and its Emits write into
    them: the same tokens, every cache byte through the library."""
    src = _decoder(tmp_path)
    out = _optimized(src, 16, 40)
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = greedy(ref, kv_layout(src), prompt, 20, chunk=4)
    ho_onnx.reset_counters()
    got = greedy(ho_onnx.InferenceSession(out), kv_layout(out), prompt, 20, chunk=4)
    assert got == want
    c = ho_onnx.counters()
    assert c["bytes_emitted"] > 0 and c["bytes_loaded"] > 0


def test_bad_arguments_are_refused(tmp_path):
    layout = kv_layout(_decoder(tmp_path))
    with pytest.raises(ValueError, match="capacity and batch must be positive"):
        KvBuffers(layout, 0)
    with pytest.raises(ValueError, match="device must be"):
        KvBuffers(layout, 4, device="tpu")
    sess = ort.InferenceSession(str(tmp_path / "dec.onnx"), providers=["CPUExecutionProvider"])
    with pytest.raises(ValueError, match="chunk must be positive"):
        greedy(sess, layout, [1, 2], 3, chunk=0)


def test_host_buffer_is_zeroed_writable_and_freed_once():
    b = _ops.HostBuffer(3 << 20)
    a = np.frombuffer(b, np.uint8)
    assert len(b) == a.size == 3 << 20 and not a.any() and a.flags.writeable
    assert b.address % 4096 == 0
    assert b.pinned == (_ops.cuda_device_count() > 0)
    small = np.frombuffer(_ops.HostBuffer(100), np.uint8)  # below the mapped size: memset
    assert small.size == 100 and not small.any()
    with pytest.raises(RuntimeError, match="size must be positive"):
        _ops.HostBuffer(0)
    with pytest.raises(RuntimeError, match="cannot map 1152921504606846976 bytes"):
        _ops.HostBuffer(1 << 60)
    lib = ctypes.CDLL(ho_onnx.library_path())
    lib.HoOnnx_HostFree.argtypes = [ctypes.c_void_p]
    lib.HoOnnx_LastError.restype = ctypes.c_char_p
    assert lib.HoOnnx_HostFree(ctypes.c_void_p(a.ctypes.data + 4096)) == -1
    assert b"not an address HoOnnx_HostAlloc returned" in lib.HoOnnx_LastError()
    p, pinned = ctypes.c_void_p(), ctypes.c_int(7)
    lib.HoOnnx_HostAlloc.argtypes = [ctypes.c_uint64, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.POINTER(ctypes.c_int)]
    assert lib.HoOnnx_HostAlloc(4096, ctypes.byref(p), ctypes.byref(pinned)) == 0
    assert p.value and pinned.value in (0, 1)
    assert lib.HoOnnx_HostFree(p) == 0
    assert lib.HoOnnx_HostFree(p) == -1  # twice


def test_a_failed_step_leaves_the_cache_as_it_was(tmp_path):
    """A run that fails (here the Guard refusing a prefill longer than the plan's range) does
    not swap the buffers: the next step reads the pasts of the last successful one and the
    tokens are the unmodified model's."""
    src = _decoder(tmp_path)
    out = _optimized(src, 4, 40)
    layout = kv_layout(out)
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    steps = [[3, 1, 4], [1], [5], [9]]
    want, presents = _reference(ref, kv_layout(src), steps)
    sess = ho_onnx.InferenceSession(out)
    cache, binding = KvBuffers(layout, 8), sess.io_binding()
    assert _step(sess, binding, layout, cache, steps[0]) == want[0]
    with pytest.raises(Exception, match=r"outside the range 1\.\.4"):
        _step(sess, binding, layout, cache, [2, 7, 1, 8, 2])
    assert cache.length == 3
    for p, _ in layout.pairs:
        np.testing.assert_array_equal(cache.past(p), presents[0][p])
    got = [_step(sess, binding, layout, cache, ids) for ids in steps[1:]]
    assert got == want[1:]


def test_host_buffers_from_many_threads():
    """HoOnnx_HostAlloc/HostFree from 8 threads at once (ctypes releases the GIL): each
    thread's bytes are its own and every block is freed exactly once."""
    from threads import run_threads

    lib = ctypes.CDLL(ho_onnx.library_path())
    lib.HoOnnx_HostAlloc.argtypes = [ctypes.c_uint64, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.POINTER(ctypes.c_int)]
    lib.HoOnnx_HostFree.argtypes = [ctypes.c_void_p]

    def worker(k: int) -> None:
        for i in range(200):
            size = (k + 1) * 4096 + i * 512 + (2 << 20) * (i % 3 == 0)
            p = ctypes.c_void_p()
            assert lib.HoOnnx_HostAlloc(size, ctypes.byref(p), None) == 0
            ctypes.memset(p, k + 1, size)
            view = (ctypes.c_ubyte * size).from_address(p.value)
            assert view[0] == view[size - 1] == k + 1
            assert lib.HoOnnx_HostFree(p) == 0

    run_threads(worker, 8)


def test_shrinking_an_arena_the_session_lacks_fails_the_run_in_words(tmp_path):
    """``shrink_arenas`` names ORT's arenas: a session without that arena refuses the run
    with ORT's message (why it is not a default); with the arena, the same tokens."""
    src = _decoder(tmp_path)
    layout = kv_layout(src)
    with_arena = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    want = greedy(with_arena, layout, [3, 1, 4, 1, 5], 6, chunk=2)
    assert greedy(with_arena, layout, [3, 1, 4, 1, 5], 6, chunk=2, shrink_arenas="cpu:0") == want
    so = ort.SessionOptions()
    so.enable_cpu_mem_arena = False
    bare = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="Did not find an arena based allocator"):
        greedy(bare, layout, [3, 1, 4, 1, 5], 6, chunk=2, shrink_arenas="cpu:0")


def test_shrinking_between_prefill_chunks_keeps_the_arena_small(tmp_path):
    """A prefill of 1,024 tokens in 32 chunks: each chunk's attention tensors outgrow the
    last's, and ORT's arena (grown by what is requested) adds regions for every chunk: 17.9
    MB held at the end for a 2.7 MB high-water mark here. Shrunk after every run it holds
    what the last run needs (3.1 MB here). Measured by the library's samples of ORT's arena
    at each Wait; the same tokens."""
    out = _optimized(_decoder(tmp_path, max_positions=1100), 32, 1040)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 97, 1024)]
    held, tokens = {}, {}
    for shrink in (None, "cpu:0"):
        so = ort.SessionOptions()
        so.add_session_config_entry("ho_onnx.sample_arena", "1")
        sess = ho_onnx.InferenceSession(out, sess_options=so, cpu_arena="as_requested")
        # first the arena as small as it goes: what an earlier test left free in it would
        # otherwise serve every chunk, and the growth measured would be that test's order
        greedy(sess, kv_layout(out), [3, 1], 1, chunk=1, shrink_arenas="cpu:0")
        tokens[shrink] = greedy(sess, kv_layout(out), prompt, 2, chunk=32, shrink_arenas=shrink)
        held[shrink] = ho_onnx.counters()["ort_arena_total_allocated"]
        del sess
    assert tokens[None] == tokens["cpu:0"]
    assert held["cpu:0"] < held[None] / 3, held


def test_two_generations_share_a_session(tmp_path):
    """Two requests on one session at once (a server's case), each loop with its own
    buffers, over the KV-offloaded model at other lengths than each other's: each gets the
    tokens it gets alone."""
    from threads import run_threads

    src = _decoder(tmp_path)
    out = _optimized(src, 8, 40, OffloadOptions(kv=True, min_bytes=0))
    sess, layout = ho_onnx.InferenceSession(out), kv_layout(out)
    prompts = {0: [3, 1, 4, 1, 5, 9, 2, 6], 1: [2, 7]}
    want = {k: greedy(sess, layout, p, 24, chunk=3) for k, p in prompts.items()}
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    assert want == {k: greedy(ref, kv_layout(src), p, 24, chunk=3) for k, p in prompts.items()}
    got: dict[int, list[list[int]]] = {0: [], 1: []}

    def worker(k: int) -> None:
        for _ in range(5):
            got[k].append(greedy(sess, layout, prompts[k], 24, chunk=3))

    run_threads(worker, 2)
    assert got == {k: [w] * 5 for k, w in want.items()}


def _arena_max(path: Path, order: str, prompt: list[int], chunk: int) -> int:
    """ORT's CPU arena MaxInUse over a greedy prefill of ``prompt`` (in ``chunk``-token runs)
    and two tokens, in a session of its own arena under ``order``."""
    from ho_onnx.contract import CONFIG_SAMPLE_ARENA
    from ho_onnx.target.ort import runtime

    so = ort.SessionOptions()
    so.add_session_config_entry(CONFIG_SAMPLE_ARENA, "1")
    sess = runtime.InferenceSession(str(path), sess_options=so, cpu_arena="ort",
                                    execution_order=order, providers=["CPUExecutionProvider"])
    _ops.set_trace(arena_trace=True)
    try:
        _ops.arena_trace()
        greedy(sess, kv_layout(path), prompt, 2, chunk=chunk)
        trace = _ops.arena_trace()
    finally:
        _ops.set_trace()
    if not trace or trace[-1]["max_in_use"] < 0:
        pytest.skip("this onnxruntime reports no arena statistics (needs >= 1.23)")
    return max(t["max_in_use"] for t in trace)


def test_default_order_frees_each_present_at_its_emit(tmp_path):
    """A present's Emit is read by nothing, so ORT's DEFAULT order (C API hosts, genai) ran it
    after the whole graph and held every layer's present to the end (stop 49: 44.6 against
    24.8 MiB on a 4-layer decoder at 4k context). Its ``done`` output is an ordering input of
    the next cache op: the arena under DEFAULT is then no larger than under PRIORITY_BASED,
    while the same model with those inputs dropped holds the presents of all but the last
    layer beside the rest."""
    import onnx

    out = _optimized(_decoder(tmp_path, layers=4, max_positions=512), 64, 400)
    model = onnx.load(str(out), load_external_data=False)
    done = {n.output[1] for n in model.graph.node if n.op_type == "Emit" and len(n.output) > 1}
    assert len(done) >= 3 * 2  # every layer's key and value but the last layer's
    for n in model.graph.node:
        kept = [x for x in n.input if x not in done]
        del n.input[:]
        n.input.extend(kept)
    unsignalled = tmp_path / "unsignalled.onnx"
    onnx.save(model, str(unsignalled))
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 97, 320)]
    priority = _arena_max(out, "priority", prompt, 64)
    default = _arena_max(out, "default", prompt, 64)
    held = _arena_max(unsignalled, "default", prompt, 64)
    present = 4 * 322 * 16 * 4  # one layer's key at the top of the prefill: heads x T x 16 x f32
    assert default <= priority + (64 << 10), (default, priority)
    assert held - default >= 5 * present, (held, default, present)  # (6 held: 3 layers x 2)


def test_a_run_after_an_empty_cache_keeps_its_own_loads(tmp_path):
    """A prompt's first run has a past of length 0: its PrefetchInputs load nothing. They
    skipped the library's run bookkeeping then, so the second run's PrefetchInputs were
    counted in the first run until a weight Prefetch seen there ran, and that Prefetch's
    start of a new run released their loads: the Wait failed with "no transfer pending"
    (stop 49, the LLM bench at 8k). Every cache op now enters its run first."""
    src = _decoder(tmp_path)
    # (only the MLP weights offloaded, 64 KiB each, and prefetched far ahead: the first load
    # of a run is a past's, waited after a weight Prefetch that the first run saw)
    out = _optimized(src, 16, 64, OffloadOptions(kv=True, min_bytes=60000, activations=False,
                                                 prefetch_distance=30))
    import onnx

    ops = [(n.op_type, n.name) for n in onnx.load(str(out), load_external_data=False).graph.node
           if n.op_type in ("Prefetch", "PrefetchInput", "Wait")]
    first = ops[0][1]
    assert ops[0][0] == "PrefetchInput" and any(
        op == "Prefetch" for op, _ in ops[1:[n for _, n in ops].index(
            first.replace("prefetch", "wait"))]), ops  # (else the case is not built)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    want = greedy(ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]),
                  kv_layout(src), prompt, 6, chunk=8)
    assert greedy(ho_onnx.InferenceSession(out), kv_layout(out), prompt, 6, chunk=8) == want


def _arena_after_decode(sess: ort.InferenceSession, layout, steps: int,
                        greedy_loop: bool, shrink: str | None = "auto") -> list[int]:
    """ORT's CPU arena total_allocated (sampled at the model's Waits) after a 96-token
    prompt and then every 8th of ``steps`` decode steps: through ``greedy``'s loop, or an
    Optimum-style loop (numpy pasts, the presents ORT allocated fed back)."""
    _ops.reset_counters()
    seen: list[int] = []
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 97, 96)]
    if greedy_loop:
        for n in range(1, steps + 1, 8):  # (a new generation each time: the same prefix)
            greedy(sess, layout, prompt, n, chunk=32, shrink_arenas=shrink)
            seen.append(_ops.counters()["ort_arena_total_allocated"])
        return seen
    tokens, presents = _reference(sess, layout, [prompt[:32], prompt[32:64], prompt[64:]])
    past, token = presents[-1], tokens[-1]
    for k in range(steps):
        token, past = run_numpy(sess, layout, past, [token])
        if k % 8 == 0:
            seen.append(_ops.counters()["ort_arena_total_allocated"])
    return seen


def test_an_arena_grown_as_requested_is_not_the_default_for_a_decode_loop(tmp_path):
    """A decode loop asks the arena for a one-position-longer cache at every step: an arena
    grown by what is requested (ho-onnx's shared CPU arena) keeps a region for each, and an
    Optimum-style loop (the presents ORT allocates, fed back) grew it at every step (10.3 GB
    after 255 steps of an 8-layer decoder at 2k context, stop 50). A model with symbolic
    input dims now gets ORT's own arena by default (``cpu_arena="auto"``), which stays flat;
    asked for explicitly, the shared one still grows (so the test can fail)."""
    src = _decoder(tmp_path, max_positions=240)
    out = _optimized(src, 32, 190, OffloadOptions(min_bytes=0, activations=False))
    layout = kv_layout(out)
    so = ort.SessionOptions()
    so.add_session_config_entry("ho_onnx.sample_arena", "1")
    auto = ho_onnx.InferenceSession(out, sess_options=so)
    assert ho_onnx.target.ort.runtime._config(auto.get_session_options(),
                                              "session.use_env_allocators") != "1"
    flat = _arena_after_decode(auto, layout, 64, greedy_loop=False)
    grown = _arena_after_decode(ho_onnx.InferenceSession(out, sess_options=so,
                                                         cpu_arena="as_requested"),
                                layout, 64, greedy_loop=False)
    assert flat[-1] <= flat[1] * 1.5, flat  # (powers of two: bounded)
    assert grown[-1] > 2 * grown[1], grown  # (a region a step: 0.84 -> 2.2 MB measured)


def test_greedy_shrinks_an_arena_grown_as_requested_after_every_run(tmp_path):
    """``greedy``'s default (``shrink_arenas="auto"``) shrinks the session's arenas that
    grow by what is requested after every run, decode steps included (its cache offloaded,
    each step's past loads are arena buffers one position longer than the last's): the
    arena stays at what one run uses; unshrunk it grows with every step. Same tokens."""
    src = _decoder(tmp_path, max_positions=240)
    out = _optimized(src, 32, 190)
    layout = kv_layout(out)
    so = ort.SessionOptions()
    so.add_session_config_entry("ho_onnx.sample_arena", "1")
    sess = ho_onnx.InferenceSession(out, sess_options=so, cpu_arena="as_requested")
    from ho_onnx.target.ort.generate import grown_as_requested

    assert grown_as_requested(sess) == "cpu:0"
    assert grown_as_requested(ort.InferenceSession(str(src),
                                                   providers=["CPUExecutionProvider"])) is None
    shrunk = _arena_after_decode(sess, layout, 64, greedy_loop=True)
    kept = _arena_after_decode(sess, layout, 64, greedy_loop=True, shrink=None)
    # (measured: 0.53 -> 0.56 MB shrunk, the last run's longer cache; 0.73 -> 1.17 MB kept)
    assert shrunk[-1] <= shrunk[1] * 1.2, shrunk
    assert kept[-1] > 1.5 * shrunk[-1] and kept[-1] > 1.3 * kept[1], (kept, shrunk)
    prompt = [3, 1, 4, 1, 5]
    assert greedy(sess, layout, prompt, 20) == greedy(sess, layout, prompt, 20,
                                                      shrink_arenas=None)
