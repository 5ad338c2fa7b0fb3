"""The decode cache (issue 36, item 3; ho_onnx/schedule/decode_cache.py): a range plan on the
disk tier keeps streamed weights in library memory across runs where a run's dims leave
room under the budget (decode steps), sized per run by its Guards (a prefill empties it).
Checked against the unmodified model token for token, and through the library's counters
against a model planned the same way without the cache."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from ho_onnx import InferenceSession, contract, counters, reset_counters
from ho_onnx.cli import main
from ho_onnx.errors import ScheduleError
from ho_onnx.rewrite.invariants import check_schedule
from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule import decode_cache
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.schedule.types import OffloadChoice, WeightOffload
from ho_onnx.target.ort.generate import greedy, kv_layout
from models.decoder import build_decoder

pytestmark = pytest.mark.usefixtures("no_debug_hooks")

RANGES = {"batch": (1, 1), "seq": (1, 64), "past": (0, 200)}
POINTS = {"decode": {"seq": 1, "past": 200}}
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6] * 3
BUDGET = 3_200_000  # (the plan at the top of the ranges offloads most weights to disk)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path, Path]:
    """The unmodified decoder, its range plan on the disk tier with the decode cache, and
    the same plan without it."""
    tmp = tmp_path_factory.mktemp("decode_cache")
    src = tmp / "dec.onnx"
    build_decoder(src, external_data=True, kv_cache=True, layers=4, hidden=128, heads=4,
                  max_positions=512, vocab=97, std=0.2)
    outs = []
    for cache in (True, False):
        out = tmp / f"dec{'' if cache else '.nocache'}.ho.onnx"
        r = optimize(src, out, OffloadOptions(budget=BUDGET, min_bytes=0, weight_tier="disk",
                                              decode_cache=cache),
                     {}, dim_ranges=RANGES, dim_points=POINTS)
        assert (r.choice.decode_cache is not None) == cache, r.choice.decode_cache_skipped
        outs.append(out)
    return src, outs[0], outs[1]


def _reference(src: Path, prompt: list[int], n: int) -> list[int]:
    return greedy(ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]),
                  kv_layout(src), prompt, n)


def _points(path: Path) -> dict[str, tuple[int, int]]:
    """The decode cache's bytes kept and read ahead at each point (the model's metadata)."""
    meta = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    text = meta["ho_onnx.decode_cache"]
    out = {}
    for part in text.split("; ")[1:]:
        kept, ahead = part.rsplit(": ", 1)[1].split(", ")
        out[part.split(" (")[0].strip()] = (int(kept.split()[0]), int(ahead.split()[0]))
    return out


def test_decode_steps_read_less_and_generate_the_same_tokens(models):
    src, cached, plain = models
    want = _reference(src, PROMPT, 24)
    assert len(set(want)) > 3, want
    read = {}
    for path in (cached, plain):
        sess = InferenceSession(path)
        layout = kv_layout(path)
        reset_counters()
        assert greedy(sess, layout, PROMPT, 24) == want
        c = counters()
        read[path] = c["bytes_read_disk"]
        if path == cached:
            assert c["expert_cache_hits"] > 0
            # the last run was a decode step: what it keeps fits the decode point's room
            assert 0 < c["expert_cache_bytes"] <= _points(cached)["decode"][0]
    # 23 decode steps after the prefill: each reads what the cache does not hold
    held = _points(cached)["decode"][0]
    assert read[plain] - read[cached] >= 20 * held * 0.9


def test_a_prefill_empties_the_cache_and_decode_fills_it_again(models):
    """The Guard limits the cache at every run from that run's dims: a prefill at the top
    of the ranges (room 0) holds nothing after its Guard; without the per-run limit the
    cache would keep the decode steps' bytes through the prefill."""
    _, cached, _ = models
    sess = InferenceSession(cached)
    layout = kv_layout(cached)
    greedy(sess, layout, PROMPT, 6)  # (fills it)
    reset_counters()
    assert counters()["expert_cache_bytes"] > 0
    greedy(sess, layout, list(range(2, 50)), 1)  # one run of 48 tokens: a prefill
    c = counters()
    assert c["expert_cache_bytes"] == 0 and c["expert_cache_hits"] == 0
    greedy(sess, layout, [5], 4)
    assert 0 < counters()["expert_cache_bytes"] <= _points(cached)["decode"][0]


def test_steady_decode_steps_hit_every_kept_weight(models):
    """No eviction among the kept weights: every decode step after the first hits what the
    cache holds (an LRU cache smaller than a step's reads would miss every one)."""
    _, cached, _ = models
    sess = InferenceSession(cached)
    layout = kv_layout(cached)
    greedy(sess, layout, PROMPT, 3)
    reset_counters()
    greedy(sess, layout, [7], 12)  # a one-token prompt: every run is a decode step
    c = counters()
    held = c["expert_cache_bytes"]
    assert held > 0
    # 12 runs, the first after the previous generation's decode steps: each hit all it holds
    assert c["bytes_expert_cache_hit"] >= 11 * held


def test_concurrent_generations_share_the_cache_and_stay_exact(models):
    src, cached, _ = models
    sess = InferenceSession(cached)
    layout = kv_layout(cached)
    prompts = [PROMPT, [2, 7, 1, 8, 2, 8], list(range(3, 40))]
    want = [_reference(src, p, 12) for p in prompts]
    got: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            got[k] = [greedy(sess, layout, prompts[(k + i) % 3], 12) for i in range(3)]
        except BaseException as e:  # (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(3):
        assert got[k] == [want[(k + i) % 3] for i in range(3)]


def _guard_with(path: Path, tmp: Path, **attrs: list[int]) -> Path:
    model = onnx.load(str(path), load_external_data=False)
    guard = next(n for n in model.graph.node if n.op_type == contract.GUARD)
    for a in guard.attribute:
        if a.name in attrs:
            del a.ints[:]
            a.ints.extend(attrs[a.name])
    for f in path.parent.iterdir():  # (its data files: a link out of the folder is refused)
        if f.is_file():
            (tmp / f.name).write_bytes(f.read_bytes())
    out = tmp / path.name
    onnx.save(model, str(out))
    return out


@pytest.mark.parametrize("attrs", [{"cache_bytes": [5, -1, 0]}, {"cache_points": [1, 2]},
                                   {"cache_bytes": []}])
def test_a_hostile_guard_fails_session_creation(models, tmp_path, attrs):
    _, cached, _ = models
    bad = _guard_with(cached, tmp_path, **attrs)
    with pytest.raises(Exception, match=r"decode cache|cache_bytes"):
        InferenceSession(bad)


def test_the_verifier_refuses_a_cache_a_guard_does_not_limit(models):
    _, cached, _ = models
    model = ir.load(str(cached))
    check_schedule(model)
    guard = next(n for n in model.graph if n.op_type == contract.GUARD)
    del guard.attributes[contract.ATTR_CACHE_GROUP]
    with pytest.raises(ScheduleError, match="not every Guard"):
        check_schedule(model)


def test_plan_says_what_it_keeps_at_each_point(models):
    src, _, _ = models
    args = ["plan", str(src), "--budget", str(BUDGET), "--min-bytes", "0", "--weight-tier",
            "disk", "--dim", "batch=1", "--dim", "seq=1..64", "--dim", "past=0..200",
            "--point", "decode:seq=1,past=200"]
    r = CliRunner().invoke(main, [*args, "--decode-cache"])
    assert r.exit_code == 0, r.output
    assert "decode cache:" in r.output and "decode cache" in r.output.split("ranges:")[1]
    for off in ([], ["--no-decode-cache"]):  # (off by default)
        r = CliRunner().invoke(main, [*args, *off])
        assert r.exit_code == 0 and "decode cache" not in r.output, r.output
    r = CliRunner().invoke(main, [*args[:7], "host", *args[8:], "--decode-cache"])
    assert r.exit_code == 0 and "decode cache: none (no weight of the main graph is reloaded" \
        in r.output, r.output


def _w(name: str, nbytes: int, at: int, tier: str = "disk", gates: tuple[str, ...] = ()
       ) -> WeightOffload:
    return WeightOffload(name, nbytes, (at + 1,), (at,), tier=tier,
                         gates=gates or ("",))


def test_decide_keeps_the_first_reloads_that_fit_the_most_room():
    c = OffloadChoice(weights=[_w("b", 300, 5), _w("a", 200, 1), _w("c", 100, 9),
                               _w("h", 100, 0, tier="host"), _w("r", 50, 2, gates=("g",))])
    d = decode_cache.decide(c, [("bottom", {"seq": 1}, 600), ("decode", {"seq": 1}, 250),
                                ("top", {"seq": 8}, -40)])
    assert not isinstance(d, str)
    assert d.weights == ("a", "b", "c") and d.capacity == 600
    assert [(b, a) for _, _, b, a in d.points] == [(600, 0), (200, 0), (0, 0)]
    assert decode_cache.kept_at(d, c, 250) == {"a"}
    assert decode_cache.kept_at(d, c, 420) == {"a", "c"}  # (b does not fit, c still does)
    assert decode_cache.guard_rows(d, ["seq"]) == ([1, 1, 8], [600, 200, 0], [0, 0, 0])
    assert "no point" in decode_cache.decide(c, [("top", {"seq": 8}, 0)])
    assert "holds none" in decode_cache.decide(c, [("top", {"seq": 8}, 99)])
    assert "streamed" in decode_cache.decide(OffloadChoice(weights=[c.weights[3]]), [])


def _no_prepacking() -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opts.add_session_config_entry("session.disable_prepacking", "1")
    return opts


def test_runs_at_other_points_are_bit_exact(models):
    """The cache's bytes are the file's: a step at any past length in the range, with hits
    and misses, gives the unmodified model's outputs exactly where the kernels are the same:
    ORT's basic optimizations and pre-packing off (MLAS packs the unmodified model's constant
    MatMul weights, not the offloaded ones; either differs by up to 5e-6)."""
    src, cached, _ = models
    ref = ort.InferenceSession(str(src), _no_prepacking(), providers=["CPUExecutionProvider"])
    sess = InferenceSession(cached, sess_options=_no_prepacking())
    reset_counters()
    rng = np.random.default_rng(1)
    names = [i.name for i in ref.get_inputs()]
    for past in (0, 37, 200, 37):
        feeds = {}
        for i in ref.get_inputs():
            if i.name == "input_ids":
                feeds[i.name] = np.array([[5]], np.int64)
            else:
                shape = [1, 4, past, 32]
                feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
        assert set(feeds) == set(names)
        for a, b in zip(sess.run(None, feeds), ref.run(None, feeds), strict=True):
            np.testing.assert_array_equal(a, b)
    assert counters()["expert_cache_hits"] > 0


AHEAD_BUDGET = 2_200_000


@pytest.fixture(scope="module")
def split_models(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A decoder whose plan puts some of the cache's weights in a second data file (the
    rewriter's own, beside the model: the lm_head's blocks), the KV cache in host memory:
    at 3 MB its decode point keeps weights (and reads ahead), at 2.2 MB it only reads
    ahead (the planner's split)."""
    tmp = tmp_path_factory.mktemp("decode_cache_split")
    src = tmp / "dec.onnx"
    build_decoder(src, external_data=True, kv_cache=True, layers=2, hidden=128, heads=4,
                  max_positions=512, vocab=4096, std=0.2)
    outs = []
    for budget in (3_000_000, AHEAD_BUDGET):
        out = tmp / f"dec.{budget}.ho.onnx"
        r = optimize(src, out, OffloadOptions(budget=budget, min_bytes=0, weight_tier="disk",
                                              kv=True, decode_cache=True),
                     {}, dim_ranges=RANGES, dim_points=POINTS)
        assert r.choice.decode_cache is not None, r.choice.decode_cache_skipped
        outs.append(out)
    return src, outs[0], outs[1]


def _cache_files(path: Path) -> set[str]:
    model = onnx.load(str(path), load_external_data=False)
    return {a.s.decode() for n in model.graph.node if n.op_type == contract.PREFETCH
            and any(x.name == contract.ATTR_CACHE_GROUP for x in n.attribute)
            for a in n.attribute if a.name == "location"}


def test_one_limit_holds_for_weights_of_two_data_files(split_models):
    """The cache is one per plan, not one per data file: the bytes kept stay within the
    decode point's room though its weights come from two files (a cache per file held the
    room once per file: 1.5x it on the bench's decoder)."""
    src, kept_model, _ = split_models
    assert len(_cache_files(kept_model)) == 2
    kept, _ = _points(kept_model)["decode"]
    assert kept > 0
    sess = InferenceSession(kept_model)
    reset_counters()
    assert greedy(sess, kv_layout(kept_model), PROMPT, 10) == _reference(src, PROMPT, 10)
    c = counters()
    assert 0 < c["expert_cache_bytes"] <= kept and c["expert_cache_hits"] > 0


def _staging_settled() -> int:
    """The library's disk staging between runs, once the I/O threads let go of the reads
    the run waited for (a chunk job's closure can outlive its Wait by a moment)."""
    import time

    last, deadline = counters()["disk_staging_bytes"], time.monotonic() + 2.0
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = counters()["disk_staging_bytes"]
        if now == last:
            return now
        last = now
    return last


def _decode_steps(sess, layout, n: int) -> tuple[list[int], list[int]]:
    """``n`` greedy tokens after PROMPT, with the library's staging after each run."""
    from ho_onnx.target.ort.generate import KvBuffers, _step, prefill

    cache = KvBuffers(layout, len(PROMPT) + n, device="cpu")
    binding = sess.io_binding()
    tokens = [prefill(sess, binding, layout, cache, PROMPT)]
    staged = [_staging_settled()]
    for _ in range(n - 1):
        tokens.append(_step(sess, binding, layout, cache, [tokens[-1]]))
        staged.append(_staging_settled())
    return tokens, staged


def test_decode_steps_read_ahead_across_the_step_boundary(split_models):
    """Where the planner gives a decode point's room to reads ahead, each Prefetch of the
    cache starts the next ones' reads, the last of a step those of the next step's first
    (held between the runs, within the room), a prefill (no room) drops them, and so does
    the end of the session."""
    import gc

    src, kept_model, ahead_model = split_models
    kept, ahead = _points(ahead_model)["decode"]
    assert ahead > 0
    other = InferenceSession(kept_model)  # (keeps the library's engine beyond `sess`)
    base = _staging_settled()  # (the process's: caches of other live sessions)
    sess = InferenceSession(ahead_model)
    layout = kv_layout(ahead_model)
    reset_counters()
    tokens, staged = _decode_steps(sess, layout, 12)
    assert tokens == _reference(src, PROMPT, 12)
    c = counters()
    assert c["read_aheads"] > 0 and c["read_ahead_used"] > 0
    assert staged[0] == base  # (the prefill: nothing read ahead)
    held = [s - base for s in staged[2:]]
    assert all(0 < h <= kept + ahead + 64 * 1024 for h in held), held  # (staging pads)
    greedy(sess, layout, list(range(2, 50)), 1)  # a prefill of 48: no room
    assert _staging_settled() == base
    greedy(sess, layout, [7], 4)
    assert _staging_settled() > base
    del sess
    gc.collect()
    assert _staging_settled() == base
    del other


def test_a_failed_run_leaves_reads_ahead_that_the_next_runs_use_exactly(split_models):
    """A run that fails in its second layer (its pasts disagree on their length) after the
    first layer's Prefetches read ahead: the runs after it still give the unmodified
    model's tokens."""
    src, _, ahead_model = split_models
    sess = InferenceSession(ahead_model)
    layout = kv_layout(ahead_model)
    _decode_steps(sess, layout, 4)
    feeds = {"input_ids": np.array([[5]], np.int64)}
    for i in sess.get_inputs()[1:]:
        past = 11 if i.name.endswith(".1") else 10
        feeds[i.name] = np.zeros((1, 4, past, 32), np.float32)
    with pytest.raises(Exception):  # noqa: B017  (ORT's own error for the mismatch)
        sess.run(None, feeds)
    assert _decode_steps(sess, layout, 8)[0] == _reference(src, PROMPT, 8)


def test_inspect_marks_the_cache_s_transfers(models):
    _, cached, plain = models
    shown = CliRunner().invoke(main, ["inspect", str(cached)])
    assert shown.exit_code == 0 and "[decode cache]" in shown.output, shown.output
    assert "ho_onnx.decode_cache" not in shown.output and "decode_cache=" in shown.output
    assert "[decode cache]" not in CliRunner().invoke(main, ["inspect", str(plain)]).output


def test_two_models_of_one_plan_interleaved_keep_their_own_weights(split_models, tmp_path):
    """A model re-optimized in place beside a session of the old one: the same plan (one
    decode cache group: the same weights' names, sizes and points) over other weight
    bytes. Decode steps of the two, interleaved, each read ahead for the next step: each
    must get its own bytes (a read ahead is taken only by the weight it was read for)."""
    from ho_onnx.target.ort.generate import KvBuffers, _step, prefill

    src, _, ahead_model = split_models
    other = tmp_path / "other.onnx"
    build_decoder(other, external_data=True, kv_cache=True, layers=2, hidden=128, heads=4,
                  max_positions=512, vocab=4096, std=0.2, seed=1)
    other_out = tmp_path / "other.ho.onnx"
    optimize(other, other_out, OffloadOptions(budget=AHEAD_BUDGET, min_bytes=0, weight_tier="disk",
                                              kv=True, decode_cache=True),
             {}, dim_ranges=RANGES, dim_points=POINTS)

    def group(path: Path) -> int:
        m = onnx.load(str(path), load_external_data=False)
        guard = next(n for n in m.graph.node if n.op_type == contract.GUARD)
        return next(a.i for a in guard.attribute if a.name == contract.ATTR_CACHE_GROUP)

    assert group(other_out) == group(ahead_model) and _points(other_out)["decode"][1] > 0
    runs = []
    for path in (ahead_model, other_out):
        sess, layout = InferenceSession(path), kv_layout(path)
        cache = KvBuffers(layout, len(PROMPT) + 10, device="cpu")
        binding = sess.io_binding()
        runs.append([sess, layout, cache, binding, [prefill(sess, binding, layout, cache,
                                                            PROMPT)]])
    reset_counters()
    for _ in range(9):
        for sess, layout, cache, binding, tokens in runs:
            tokens.append(_step(sess, binding, layout, cache, [tokens[-1]]))
    assert counters()["read_ahead_used"] > 0
    assert runs[0][4] == _reference(src, PROMPT, 10)
    assert runs[1][4] == _reference(other, PROMPT, 10)
