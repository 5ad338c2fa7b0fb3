"""Host-side logic of the CUDA engine, tested without a GPU.

The event pool, the pinned ring of stored activations, the ring's sizing from the plan and
the pinned weight packing are header-only C++ (csrc/cuda/host_logic.h), CUDA build or not,
reached through the harnesses of ``ho_onnx._ops_testing`` (a testing build). Only the CUDA
event is stood in for: the pool's events are numbers, and a ring fence is a flag that the
test (or a completer thread, standing for the copy that reads the slot) sets.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest
from native_util import testing_ops

from ho_onnx import contract
from ho_onnx.target.ort import runtime

_ops = runtime._ops()
_testing = testing_ops()  # the harnesses (a testing build: native_util.testing_ops)
KIB = 1 << 10
MIB = 1 << 20


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


# ---- build facts ---------------------------------------------------------------------------

def test_build_reports_cuda():
    info = _ops.build_info()
    assert isinstance(info["cuda_compiled"], bool)
    n = _ops.cuda_device_count()
    assert isinstance(n, int) and n >= 0
    if not info["cuda_compiled"]:
        assert n == 0
        with pytest.raises(RuntimeError, match="without CUDA"):
            _ops.cuda_mem_info()
        with pytest.raises(RuntimeError, match="without CUDA"):
            _ops.cuda_calibrate(1 << 20)
    elif n == 0:
        # Compiled in, no usable device or driver: a CUDA error, never a crash.
        with pytest.raises(RuntimeError, match="CUDA error"):
            _ops.cuda_mem_info()
        with pytest.raises(RuntimeError, match="CUDA error"):
            _ops.cuda_calibrate(1 << 20)


def test_counters_have_cuda_gauges():
    c = _ops.counters()
    for key in ("pinned_bytes", "pinned_allocs", "cuda_events_created", "ring_segments",
                "registrations", "cuda_registrations"):
        assert key in c


# ---- event pool ----------------------------------------------------------------------------

def test_event_pool_acquire_release_reuse():
    p = _testing.EventPool()
    a, b = p.acquire(), p.acquire()
    assert a.id != b.id
    assert (p.created(), p.outstanding(), p.free_count()) == (2, 2, 0)
    aid = a.id
    a.release()
    assert (p.outstanding(), p.free_count()) == (1, 1)
    c = p.acquire()
    assert c.id == aid  # the released event is reused, not a new one created
    assert p.created() == 2
    b.release()
    c.release()
    assert (p.outstanding(), p.free_count()) == (0, 2)
    with pytest.raises(RuntimeError, match="released"):
        _ = c.id


def test_event_pool_prewarm_means_no_creation_on_the_hot_path():
    p = _testing.EventPool()
    p.prewarm(8)
    assert p.created() == 8
    for _ in range(100):  # "runs" that hold up to 8 events at a time
        held = [p.acquire() for _ in range(8)]
        for h in held:
            h.release()
    assert p.created() == 8


def test_event_pool_destroys_every_event_once():
    p = _testing.EventPool()
    p.prewarm(3)
    live = [p.acquire() for _ in range(5)]  # 3 reused + 2 created
    assert p.created() == 5
    p.close()  # the pool lives on while leases are out
    assert p.destroyed() == 0
    for x in live:
        x.release()
    assert p.destroyed() == 5


def test_event_pool_concurrent():
    p = _testing.EventPool()
    peak = p.stress(threads=8, iters=2000, hold=3)
    assert 1 <= peak <= 24
    assert p.outstanding() == 0
    # Never more events than were ever on loan at once.
    assert p.created() <= 24
    assert p.free_count() == p.created()


# ---- ring ----------------------------------------------------------------------------------

def test_ring_slots_are_aligned_and_in_order():
    r = _testing.SlotRing(align=256, growth=1 * MIB)
    r.reserve(4096)
    a = r.acquire(1000)
    b = r.acquire(1)
    assert (a["segment"], a["offset"], a["size"]) == (0, 0, 1024)
    assert (b["segment"], b["offset"], b["size"]) == (0, 1024, 256)
    st = r.stats()
    assert (st["segments"], st["capacity"], st["live"], st["in_use"]) == (1, 4096, 2, 1280)
    with pytest.raises(ValueError):
        r.acquire(0)



def _ring_with_slots(n: int) -> tuple[Any, list[dict]]:
    """A slot ring of one 4 KiB segment (256-byte alignment) with ``n`` 1 KiB slots taken."""
    r = _testing.SlotRing(align=256, growth=4096)
    r.reserve(4096)
    return r, [r.acquire(1024) for _ in range(n)]


def test_ring_reuse_only_after_the_fence_completed():
    r, slots = _ring_with_slots(4)  # full
    for i, s in enumerate(slots):
        r.release(s["id"], fence=i)
    st = r.stats()
    assert (st["live"], st["released"]) == (4, 4)
    # The copies reading the slots have not finished: the ring grows instead of reusing.
    extra = r.acquire(1024)
    assert extra["segment"] == 1
    r.release(extra["id"])  # no fence: free at once
    for i in range(4):
        r.complete(i)
    s = r.acquire(1024)
    assert (s["segment"], s["offset"]) == (0, 0)
    st = r.stats()
    assert st["segments"] == 2 and st["live"] == 1


def test_ring_tail_holds_later_slots_until_it_is_released():
    r, (a, b, c) = _ring_with_slots(3)
    r.release(b["id"])
    r.release(c["id"])
    assert r.stats()["live"] == 3  # a, the tail, is still in use
    d = r.acquire(1024)  # the last free quarter
    assert (d["segment"], d["offset"]) == (0, 3072)
    r.release(a["id"], fence=7)
    assert r.stats()["live"] == 4  # a's copy still running
    r.complete(7)
    r.reap()
    st = r.stats()
    assert (st["live"], st["in_use"]) == (1, 1024)  # only d
    assert st["reclaimed_total"] == 3


def test_ring_wraps_around():
    r, (a, b, _c) = _ring_with_slots(3)
    r.release(a["id"])
    r.release(b["id"])
    s = r.acquire(2048)  # no room at the head (3072 + 2048 > 4096): wraps to the start
    assert (s["segment"], s["offset"]) == (0, 0)
    big = r.acquire(8192 + 1)  # larger than any segment: a segment of its own
    assert (big["segment"], big["offset"]) == (1, 0)
    assert r.stats()["segment_bytes"] == [4096, 8448]
    with pytest.raises(RuntimeError, match="unknown slot"):
        r.release(10**9)


def test_ring_double_release_is_refused():
    r = _testing.SlotRing()
    s = r.acquire(100)
    r.release(s["id"])
    with pytest.raises(RuntimeError):
        r.release(s["id"])


STORE_SIZES = [64 * KIB + 4 * i * KIB + 12 for i in range(40)] + [3 * MIB, 5 * MIB + 7]


def test_ring_sized_from_the_plan_never_grows_over_sequential_runs():
    host_bytes = sum(STORE_SIZES)
    r = _testing.SlotRing()
    r.reserve(_testing.ring_capacity(host_bytes))
    fence = 0
    for _run in range(50):
        slots = [r.acquire(n) for n in STORE_SIZES]  # one Store per entry
        for s in reversed(slots):  # reloaded in another order than stored
            r.release(s["id"], fence=fence)
            fence += 1
        # The run ends: ORT synchronized the compute stream, every copy is done.
        for f in range(fence - len(slots), fence):
            r.complete(f)
    st = r.stats()
    assert st["segments"] == 1
    r.reap()
    assert r.stats()["live"] == 0


def test_ring_capacity_from_plan_bytes():
    assert _testing.ring_capacity(0) == 0
    for sizes in (STORE_SIZES, [64 * KIB + 1] * 1000, [1 << 30, 12345678]):
        total = sum(sizes)
        cap = _testing.ring_capacity(total)
        assert cap % (64 * KIB) == 0
        assert sum(_align(n, 256) for n in sizes) <= cap  # one run fits with padding
        assert cap <= total * 1.01 + 128 * KIB  # and not much more
    caps = [_testing.ring_capacity(n) for n in range(0, 10 * MIB, 333_333)]
    assert caps == sorted(caps)


def test_ring_concurrent_runs_grow_by_segments_without_deadlock_or_overlap():
    r = _testing.SlotRing()
    cap = _testing.ring_capacity(sum(STORE_SIZES))
    r.reserve(cap)
    threads = 8
    res = r.concurrent(threads=threads, runs=30, sizes=STORE_SIZES, fence_us=300,
                       timeout_s=60.0)
    assert res["finished_in_time"], res
    assert res["overlaps"] == 0, res
    assert res["acquired_total"] == threads * 30 * len(STORE_SIZES)
    assert res["reclaimed_total"] == res["acquired_total"]
    assert res["live"] == 0
    # Growth is by whole segments, driven by the bytes that were in use at once (acquired,
    # or released with their copy still running): slots reused in ring order can strand
    # free space behind a slow slot, hence the factor.
    assert res["segment_bytes"][0] == cap
    assert all(b >= 64 * MIB for b in res["segment_bytes"][1:])
    assert res["peak_busy"] > 0
    assert res["capacity"] <= cap + 4 * res["peak_busy"] + 64 * MIB, res


def test_ring_concurrent_tiny_ring_still_terminates():
    # A ring far too small for the demand: acquire never waits, it grows.
    r = _testing.SlotRing(align=256, growth=4096)
    r.reserve(4096)
    res = r.concurrent(threads=4, runs=20, sizes=[1000, 3000, 200, 4096], fence_us=100)
    assert res["finished_in_time"] and res["overlaps"] == 0
    assert res["live"] == 0 and res["segments"] > 1


# ---- pinned weight packing -------------------------------------------------------------------

def _decoder_sizes(**kw) -> list[int]:
    from models.decoder import decoder_weight_specs

    return [int(np.prod(shape)) * 2 for _name, shape, _init in decoder_weight_specs(**kw)]


def _no_overlap(sizes: list[int], res: dict[str, Any]) -> None:
    spans: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for n, p in zip(sizes, res["placements"], strict=True):
        if p["kind"] != "own":
            spans.setdefault((p["kind"], p["block"]), []).append((p["offset"], p["offset"] + n))
    for s in spans.values():
        s.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(s))


def _slab_bound(sizes: list[int], groups: list[str], res: dict[str, Any]) -> int:
    """The documented bound: 1.07x the weights, one chunk, and per group its last slab."""
    last: dict[str, int] = {}
    for g, p in zip(groups, res["placements"], strict=True):
        if p["kind"] == "slab" and p["block_bytes"]:
            last[g] = p["block_bytes"]
    return int(1.07 * sum(sizes)) + 4 * MIB + sum(last.values())


@pytest.mark.parametrize("cfg", [
    dict(layers=24, hidden=2048, vocab=32000, max_positions=2048),  # ~2.6 GB fp16
    dict(layers=4, hidden=512, vocab=8000, max_positions=1024),
])
def test_pinned_weights_within_1_1x(cfg):
    sizes = _decoder_sizes(**cfg)
    res = _testing.pack_weights(sizes)
    assert res["payload"] == sum(sizes)
    if sum(sizes) > 1 << 30:
        assert res["reserved"] <= 1.1 * res["payload"], res["reserved"] / res["payload"]
    assert res["reserved"] <= _slab_bound(sizes, [""] * len(sizes), res)
    # Large weights get their own block; medium ones share page-aligned slabs; small ones
    # share chunks at 256-byte alignment; nothing overlaps.
    for n, p in zip(sizes, res["placements"], strict=True):
        if n > 4 * MIB:
            assert p["own_block"] and p["block_bytes"] == _align(n, 4096)
        elif n >= 256 * KIB:
            assert p["kind"] == "slab" and p["offset"] % 4096 == 0
        else:
            assert p["kind"] == "chunk" and p["offset"] % 256 == 0
            assert p["offset"] + n <= 4 * MIB
    _no_overlap(sizes, res)


def test_pinned_weights_small_model_bound():
    # Tiny weights only: one partly filled 4 MiB chunk at most beyond 1.07x.
    sizes = [1024, 3000, 70_000, 200_000] * 10
    res = _testing.pack_weights(sizes)
    assert res["reserved"] <= 1.07 * sum(sizes) + 4 * MIB


def test_moe_experts_pin_few_slabs():
    """The stop-45 MoE (610 expert matrices of 3 MiB): 33 slabs growing 4 -> 64 MiB instead
    of 610 blocks (each cudaHostRegister is a call of its own), within 1.1x the bytes."""
    sizes = [3 * MIB] * 610
    res = _testing.pack_weights(sizes)
    assert res["slabs"] == 33 and res["chunks"] == 0
    firsts = [p["block_bytes"] for p in res["placements"] if p["block_bytes"]]
    assert firsts[:6] == [4 * MIB, 8 * MIB, 16 * MIB, 32 * MIB, 64 * MIB, 64 * MIB]
    assert res["reserved"] <= 1.1 * res["payload"]
    _no_overlap(sizes, res)


def test_slabs_belong_to_one_group_and_restart_when_forgotten():
    """Two data files' medium weights never share a slab (a version's slabs go with its
    weights); a group whose slab went starts again at 4 MiB."""
    sizes = [1 * MIB] * 12
    groups = ["a", "b"] * 6
    res = _testing.pack_weights(sizes, groups)
    by_slab: dict[int, set[str]] = {}
    for g, p in zip(groups, res["placements"], strict=True):
        by_slab.setdefault(p["block"], set()).add(g)
    assert all(len(gs) == 1 for gs in by_slab.values()), by_slab
    assert res["reserved"] <= _slab_bound(sizes, groups, res)
    _no_overlap(sizes, res)
    # "a" filled its 4 MiB slab and opened an 8 MiB one; forgotten, it opens 4 MiB again.
    sizes2 = [1 * MIB] * 6
    res2 = _testing.pack_weights(sizes2, ["a"] * 6, [""] * 5 + ["a"])
    opened = [p["block_bytes"] for p in res2["placements"] if p["block_bytes"]]
    assert opened == [4 * MIB, 8 * MIB, 4 * MIB]


# ---- registration in a CPU-only ONNX Runtime -------------------------------------------------

_CHILD = textwrap.dedent("""
    import sys
    import numpy as np, onnx, onnx.parser, onnxruntime as ort
    from ho_onnx.target.ort import runtime
    d = "ai.hyperoffload"
    text = '''
    <ir_version: 10, opset_import: ["" : 21, "ai.hyperoffload" : 1]>
    g (float[64] x) => (float[64] out) {
      t = ai.hyperoffload.Store(x)
      r = Relu(x)
      t2 = ai.hyperoffload.Detach(x, t, r)
      y = ai.hyperoffload.Prefetch(t2, r)
      z = ai.hyperoffload.Wait(y, r)
      out = Add(z, r)
    }
    '''
    path = sys.argv[1]
    onnx.save(onnx.parser.parse_model(text), path)
    before = runtime.counters()
    s = runtime.InferenceSession(path)
    x = np.linspace(-3, 3, 64, dtype=np.float32)
    (out,) = s.run(None, {"x": x})
    np.testing.assert_array_equal(out, x + np.maximum(x, 0))
    after = runtime.counters()
    print(after["registrations"] - before["registrations"],
          after["cuda_registrations"] - before["cuda_registrations"])
""")


@pytest.mark.parametrize("mode", ["auto", "0", "1"])
def test_cuda_ops_registration_leaves_cpu_sessions_working(tmp_path, mode):
    env = dict(os.environ)
    env.pop("HO_ONNX_CUDA_OPS", None)
    if mode != "auto":
        env["HO_ONNX_CUDA_OPS"] = mode
    p = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "m.onnx")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    regs, cuda_regs = map(int, p.stdout.split())
    assert regs == 1
    has_cuda_ep = "CUDAExecutionProvider" in ort.get_available_providers()
    compiled = _ops.build_info()["cuda_compiled"]
    expected = {"0": 0, "1": int(compiled), "auto": int(compiled and has_cuda_ep)}[mode]
    assert cuda_regs == expected


def test_errors_name_the_node(tmp_path):
    text = f"""
    <ir_version: 10, opset_import: ["" : 21, "{contract.DOMAIN}" : 1]>
    g (float[8] x) => (float[8] z) {{
      z = {contract.DOMAIN}.Wait(x)
    }}
    """
    m = onnx.parser.parse_model(text)
    m.graph.node[0].name = "the_wait"
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path))
    s = runtime.InferenceSession(str(path))
    with pytest.raises(Exception, match=r"ho_onnx Wait \(node 'the_wait'\): no transfer pending"):
        s.run(None, {"x": np.ones(8, np.float32)})
