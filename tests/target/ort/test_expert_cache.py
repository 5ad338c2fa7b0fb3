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


def test_the_expected_hit_rate_and_the_capacity_rules():
    """C/N for a cache that holds one step's expected selection, 0 below it (each step would
    evict the last), 1 at N; a capacity above N is cut to N, one below the smallest entry is
    none; host-tier and ungated weights are never cached."""
    from ho_onnx.schedule.expert_cache import with_cache
    from ho_onnx.schedule.types import OffloadChoice, WeightOffload

    def choice() -> OffloadChoice:
        experts = [WeightOffload(f"e{i}", 100, (5,), (4,), (), "disk", ("g",), 0.25)
                   for i in range(8)]
        return OffloadChoice("t", [*experts, WeightOffload("attn", 500, (1,), (0,), (), "disk"),
                                   WeightOffload("h", 100, (5,), (4,), (), "host", ("g",), 0.25)])

    c = choice()
    assert cacheable_bytes(c) == 800  # (not attn: ungated; not h: host tier)
    assert [expected_hit(b, c) for b in (0, 199, 200, 400, 800, 900)] == [
        0.0, 0.0, 0.25, 0.5, 1.0, 1.0]
    assert with_cache(choice(), 5000).expert_cache == 800
    assert with_cache(choice(), 99).expert_cache == 0
    c = with_cache(choice(), 400)
    assert c.expert_cache == 400
    assert [w.hit for w in c.weights] == [0.5] * 8 + [0.0, 0.0]


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
        # (less the embedding's rows, which its GatherRows reads from the file too)
        got = c["bytes_read_disk"] - c["bytes_gathered"]
        assert got == want, (len(seen), got, want)
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


def test_two_models_in_one_process_keep_caches_of_their_own(tmp_path, moe_export):
    """Two optimized copies of the model (their own data files), caches of 60 % and 30 % of
    the experts, run one after the other at every step in one process (one engine): each
    reads exactly what an LRU of its own capacity over the router's choice did not hold (one
    cache per data file: before, the two shared one cache of the larger size)."""
    src = moe_export("qwen3_moe")
    probe, routers, routed = moe_decode.probe(src, DIMS, tmp_path / "probe.onnx")
    experts = cacheable_bytes(_optimized(src, tmp_path / "sizing", 0)[1])
    models = [_optimized(src, tmp_path / f"opt{k}", int(experts * share))
              for k, share in enumerate((0.6, 0.3))]
    so = moe_decode.session_options()
    prb = ort.InferenceSession(str(probe), so, providers=["CPUExecutionProvider"])
    runs = [(InferenceSession(m, sess_options=so), moe_decode.disk_loads(m, routed),
             moe_decode.LruSim(c.expert_cache)) for m, c in models]
    from ho_onnx.target.ort.generate import _empty_past, kv_layout

    lay = kv_layout(src)
    past = {p: _empty_past(lay, p, 1) for p, _ in lay.pairs}
    n = len(prb.get_outputs())
    rng = np.random.default_rng(1)
    for step in range(16):
        feeds = moe_decode.decode_feeds(lay, [int(rng.integers(0, 128))], past)
        chosen = {(r, int(e)) for r, v in zip(routers, prb.run(None, feeds)[n - len(routers):],
                                                strict=True) for e in v.reshape(-1)}
        for sess, loads, sim in runs:
            reset_counters()
            sess.run(None, feeds)
            c = counters()  # (the embedding's rows, read by GatherRows, aside)
            assert c["bytes_read_disk"] - c["bytes_gathered"] == sim.step(loads, chosen), step
    assert all(sim.hits for _, _, sim in runs)


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
    """``auto`` with a budget: the cache is the slack the plan leaves (its tensors' peak and
    ORT's arena; none when it cannot hold one expert weight), within the budget with them,
    recorded in the metadata, the predicted time at its expected hit rate; an explicit size
    is planned for (the rest fits the budget less it); an oversized one is refused."""
    src = moe_export("qwen3_moe")
    peak = plan_model(src, OffloadOptions(budget=1 << 50), DIMS)[2].baseline.peak_bytes
    opts = OffloadOptions(activations=False, min_bytes=0, weight_tier="disk")
    sizes = []
    for budget in range(peak * 3 // 10, peak, peak // 8):
        low = plan_model(src, replace(opts, budget=budget, expert_cache=0), DIMS)[2]
        auto = plan_model(src, replace(opts, budget=budget), DIMS)[2]
        slack = budget - max(low.planned.peak_bytes, low.arena_bytes)
        entry = min((w.nbytes for w in low.choice.weights if w.gates), default=1 << 62)
        want = min(slack, cacheable_bytes(low.choice)) if slack >= entry else 0
        assert auto.choice.expert_cache == want, budget
        assert auto.fits and auto.planned.peak_bytes + want <= budget
        assert auto.planned.total_s <= low.planned.total_s
        if want:
            assert auto.metadata()["expert_cache_bytes"] == str(want)
            hit = expected_hit(want, auto.choice)
            assert all(w.hit == hit for w in auto.choice.weights if w.gates)
        sizes.append(slack)
    # (the planner fills the budget: here the slack never held one 2 KiB expert weight, so
    # auto made no cache; an explicit size is planned for)
    assert sizes and max(sizes) < 1 << 20
    budget = peak // 2
    half = plan_model(src, replace(opts, budget=budget, expert_cache=0), DIMS)[2]
    asked = 8 * min(w.nbytes for w in half.choice.weights if w.gates)
    fixed = plan_model(src, replace(opts, budget=budget, expert_cache=asked), DIMS)[2]
    assert fixed.choice.expert_cache == asked and fixed.planned_for <= budget - asked
    assert fixed.fits and fixed.planned.peak_bytes + asked <= budget
    with pytest.raises(Exception, match="with the expert cache"):
        plan_model(src, replace(opts, budget=budget, expert_cache=budget - 1024), DIMS)
    with pytest.raises(ValueError, match="leaves nothing"):
        OffloadOptions(budget=100, expert_cache=100)


def test_the_command_line_records_the_cache_and_refuses_a_bad_one(tmp_path, moe_export):
    """``--expert-cache 16KiB`` (explicit policy, disk tier) is written on every gated
    Prefetch; a word that is no size is a usage error naming the flag."""
    from click.testing import CliRunner

    from ho_onnx.cli import main

    src, out = moe_export("qwen3_moe"), tmp_path / "o" / "model.onnx"
    out.parent.mkdir()
    args = ["optimize", str(src), str(out), "--offload", "weights", "--min-bytes", "0",
            "--weight-tier", "disk", "--dim", "batch_size=1", "--dim", "sequence_length=1",
            "--dim", "past_sequence_length=24"]
    r = CliRunner().invoke(main, [*args, "--expert-cache", "16KiB"])
    assert r.exit_code == 0, r.output
    gated = [n for n in onnx.load(str(out), load_external_data=False).graph.node
             if any(a.name == contract.ATTR_GATED for a in n.attribute)
             and n.op_type == contract.PREFETCH]
    assert gated and all(onnx.helper.get_attribute_value(next(
        a for a in n.attribute if a.name == contract.ATTR_EXPERT_CACHE)) == 16 << 10
        for n in gated)
    r = CliRunner().invoke(main, [*args, "--expert-cache", "lots"])
    assert r.exit_code != 0 and "--expert-cache" in r.output, r.output
