"""The expert cache (issue 37, item 3): routed experts of the disk tier kept across runs by
the library, LRU (``csrc/expert_cache.h``). At every step of a greedy generation the bytes
read from the data file equal, exactly, those of the loads whose expert the router's own
TopK chose (indices made graph outputs of a copy of the unmodified model) and that an LRU
simulation of the same capacity over those choices did not hold (``bench/moe_decode.py``'s
``LruSim``); tokens and logits equal the unmodified model's."""

from __future__ import annotations

import sys
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from ho_onnx import InferenceSession, contract, counters, reset_counters
from ho_onnx.rewrite.pipeline import optimize, plan_model
from ho_onnx.schedule.expert_cache import cacheable_bytes, expected_hit
from ho_onnx.schedule.options import OffloadOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import moe_decode

pytestmark = [pytest.mark.usefixtures("no_debug_hooks"), pytest.mark.slow]

DIMS = {"batch_size": 1, "sequence_length": 1, "past_sequence_length": 24}


def _optimized(src: Path, out: Path, cache: int | str) -> tuple[Path, object]:
    out.mkdir()
    r = optimize(src, out / "model.onnx", OffloadOptions(
        activations=False, min_bytes=0, weight_tier="disk", expert_cache=cache), DIMS)
    return out / "model.onnx", r.choice


def _generate(sess: ort.InferenceSession, ref: ort.InferenceSession, probe: ort.InferenceSession,
              src: Path, routers: list[str], steps: int, on_step) -> list[int]:
    """Greedy tokens of ``sess`` (its own past), each step checked against the unmodified
    model ``ref`` fed the same inputs (logits bit-exact, ORT's optimizations off); the
    router's choice that step (``probe``: the TopK indices) is handed to ``on_step``."""
    from ho_onnx.target.ort.generate import _empty_past, kv_layout

    lay = kv_layout(src)
    names = [o.name for o in sess.get_outputs()]
    n = len(probe.get_outputs())
    past = {p: _empty_past(lay, p, 1) for p, _ in lay.pairs}
    tokens, out = [3, 1, 4, 1, 5, 9, 2, 6], []
    for _ in range(steps):
        feeds = moe_decode.decode_feeds(lay, tokens, past)
        idx = probe.run(None, feeds)[n - len(routers):]
        chosen = {(r, int(e)) for r, v in zip(routers, idx, strict=True) for e in v.reshape(-1)}
        reset_counters()
        got = sess.run(None, feeds)
        on_step(chosen)
        np.testing.assert_array_equal(got[0], ref.run(None, feeds)[0])
        past = {p: got[names.index(q)] for p, q in lay.pairs}
        tokens = [int(np.argmax(got[0][0, -1]))]
        out.append(tokens[0])
    return out


@pytest.mark.parametrize("share", [0.0, 0.3, 0.6, 1.0])
def test_bytes_read_are_the_routers_choice_less_what_lru_holds(tmp_path, moe_export, share):
    """Qwen3-MoE, every weight on the disk tier, the cache at 0, 30 %, 60 % and 100 % of the
    experts' bytes: per step (prefill, then decode) bytes_read_disk == the LRU simulation's
    reads over the router's own choice; hits and misses as simulated; greedy tokens those
    of the unmodified model; capacity 0 writes no attribute and counts no hit or miss."""
    src = moe_export("qwen3_moe")
    probe, routers, routed = moe_decode.probe(src, DIMS, tmp_path / "probe.onnx")
    full = _optimized(src, tmp_path / "sizing", 0)[1]
    capacity = int(cacheable_bytes(full) * share)
    model, choice = _optimized(src, tmp_path / "opt", capacity)
    assert choice.expert_cache == capacity
    loads = moe_decode.disk_loads(model, routed)
    assert any(ld.expert for ld in loads) and all(ld.cached == capacity for ld in loads
                                                  if ld.expert), loads
    sim = moe_decode.LruSim(capacity)
    so = moe_decode.session_options()
    ref = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    prb = ort.InferenceSession(str(probe), so, providers=["CPUExecutionProvider"])
    sess = InferenceSession(model, sess_options=so)
    seen: list[tuple[int, int]] = []

    def check(chosen: set[tuple[str, int]]) -> None:
        hits, misses = sim.hits, sim.misses
        want = sim.step(loads, chosen)
        c = counters()
        assert c["bytes_read_disk"] == want, (len(seen), c["bytes_read_disk"], want)
        assert (c["expert_cache_hits"], c["expert_cache_misses"]) == (
            sim.hits - hits, sim.misses - misses)
        seen.append((sim.hits - hits, want))

    got = _generate(sess, ref, prb, src, routers, 12, check)
    from ho_onnx.target.ort.generate import greedy, kv_layout

    assert got == greedy(ref, kv_layout(src), [3, 1, 4, 1, 5, 9, 2, 6], 12)
    if capacity:
        assert sum(h for h, _ in seen) > 0, seen  # (the cache was used)
    else:
        assert not any(contract.ATTR_EXPERT_CACHE in {a.name for a in n.attribute}
                       for n in onnx.load(str(model), load_external_data=False).graph.node)


def test_concurrent_sessions_sharing_the_engine_stay_exact(tmp_path, moe_export):
    """Two sessions of one model (one registration, so one engine and one cache) run by four
    threads at once, the cache a quarter of the experts (entries evicted under readers):
    every run's logits equal the unmodified model's for its inputs."""
    src = moe_export("qwen3_moe")
    capacity = cacheable_bytes(_optimized(src, tmp_path / "sizing", 0)[1]) // 4
    model, _ = _optimized(src, tmp_path / "opt", capacity)
    so = moe_decode.session_options()
    ref = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    sessions = [InferenceSession(model, sess_options=so) for _ in range(2)]
    from ho_onnx.target.ort.generate import _empty_past, kv_layout

    lay = kv_layout(src)
    past = {p: _empty_past(lay, p, 1) for p, _ in lay.pairs}
    feeds = [moe_decode.decode_feeds(lay, [t, (t * 7) % 128, 5], past) for t in range(16)]
    want = [ref.run(None, f)[0] for f in feeds]
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for i in range(40):
                j = (i * 5 + k) % len(feeds)
                got = sessions[k % 2].run(None, feeds[j])[0]
                np.testing.assert_array_equal(got, want[j])
        except BaseException as e:  # (reported by the main thread)
            errors.append(e)

    reset_counters()
    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    c = counters()
    assert c["expert_cache_hits"] > 0 and c["expert_cache_misses"] > 0, c
    assert 0 < c["expert_cache_bytes"] <= capacity


def test_the_planner_sizes_the_cache_from_the_budgets_slack(moe_export):
    """``auto`` with a budget: the cache is the slack the plan leaves (tensors' peak and ORT's
    arena, both within the budget with it), recorded in the metadata, and the predicted time
    uses its expected hit rate; an explicit size is planned for; without a budget, none."""
    src = moe_export("qwen3_moe")
    peak = plan_model(src, OffloadOptions(budget=1 << 50), DIMS)[2].baseline.peak_bytes
    opts = OffloadOptions(activations=False, min_bytes=0, weight_tier="disk")
    p = plan_model(src, replace(opts, budget=peak), DIMS)[2]
    c = p.choice
    # the model fits: nothing needs to leave, so no expert is streamed and no cache made
    assert c.expert_cache == 0
    budget = peak * 3 // 4
    low = plan_model(src, replace(opts, budget=budget, expert_cache=0), DIMS)[2]
    auto = plan_model(src, replace(opts, budget=budget), DIMS)[2]
    assert cacheable_bytes(low.choice) > 0
    slack = budget - max(low.planned.peak_bytes, low.arena_bytes)
    assert auto.choice.expert_cache == min(slack, cacheable_bytes(auto.choice)) > 0
    assert auto.fits and auto.planned.peak_bytes + auto.choice.expert_cache <= budget
    assert auto.metadata()["expert_cache_bytes"] == str(auto.choice.expert_cache)
    hit = expected_hit(auto.choice.expert_cache, auto.choice)
    assert all(w.hit == hit for w in auto.choice.weights if w.gates)
    assert auto.planned.total_s <= low.planned.total_s
    asked = cacheable_bytes(low.choice) // 2
    fixed = plan_model(src, replace(opts, budget=budget, expert_cache=asked), DIMS)[2]
    assert fixed.choice.expert_cache == asked and fixed.planned_for <= budget - asked
    assert fixed.planned.peak_bytes + asked <= budget
    with pytest.raises(ValueError, match="leaves nothing"):
        OffloadOptions(budget=100, expert_cache=100)
