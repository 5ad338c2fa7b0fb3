"""Speculative expert reads (issue 37, item 3; ``ho_onnx.schedule.speculate``): the next MoE
layer's router applied to this layer's router input predicts its experts, whose weights'
reads into the expert cache start a layer early (warm Prefetches). At every step of a greedy
generation the bytes read from the data file, the cache's hits and misses and the warm
counters equal, exactly, an LRU replay over the router's own TopK choice and the
speculation's own prediction (its MatMul and TopK added to a copy of the unmodified model:
ORT's kernels, the same indices); logits bit for bit those of the unmodified model."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from ho_onnx import InferenceSession, contract, counters, reset_counters
from ho_onnx.errors import ScheduleError
from ho_onnx.rewrite.invariants import check_schedule
from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.expert_cache import cacheable_bytes
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.schedule.speculate import ROUTER_REASON

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import moe_decode

pytestmark = [pytest.mark.usefixtures("no_debug_hooks"), pytest.mark.slow]

DIMS = {"batch_size": 1, "sequence_length": 1, "past_sequence_length": 24}
# Every expert weight (2 KiB) on the disk tier, the routers (1 KiB) resident.
MIN_BYTES = 2048


def _optimized(src: Path, out: Path, cache: int, speculate: str = "on"):
    out.mkdir()
    r = optimize(src, out / "model.onnx", OffloadOptions(
        activations=False, min_bytes=MIN_BYTES, weight_tier="disk", expert_cache=cache,
        speculate_experts=speculate), DIMS)
    return out / "model.onnx", r.choice


def _warms(model: Path) -> list[onnx.NodeProto]:
    return [n for n in onnx.load(str(model), load_external_data=False).graph.node
            if n.domain == contract.DOMAIN and any(
                a.name == contract.ATTR_WARM and a.i == 1 for a in n.attribute)]


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_speculated_generation_reads_what_the_replay_says(tmp_path, moe_export, share):
    """Qwen3-MoE (2 layers, 8 experts top-2): layer 1 speculated from layer 0's router
    input, the cache all or half of the experts' bytes; per step (a prompt of 8, then
    decode) the counters equal the replay's, the logits the unmodified model's, and the
    speculation read and was right at least once (warm hits)."""
    src = moe_export("qwen3_moe")
    full = cacheable_bytes(_optimized(src, tmp_path / "sizing", 0, "off")[1])
    model, choice = _optimized(src, tmp_path / "opt", int(full * share))
    assert [s.layer for s in choice.speculations] == ["/model/layers.1/mlp/TopK"]
    assert len(_warms(model)) == len(choice.speculations[0].warms) == 24  # 8 experts x 3
    probe, routers, routed = moe_decode.probe(src, DIMS, tmp_path / "probe.onnx")
    assert probe is not None
    spec_layers = moe_decode.speculation_probe(probe, choice.speculations)
    loads = moe_decode.disk_loads(model, routed)
    assert sum(ld.warm for ld in loads) == 24
    sim = moe_decode.LruSim(choice.expert_cache)
    so = moe_decode.session_options()
    ref = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    prb = ort.InferenceSession(str(probe), so, providers=["CPUExecutionProvider"])
    sess = InferenceSession(model, sess_options=so)
    from ho_onnx.target.ort.generate import _empty_past, greedy, kv_layout

    lay = kv_layout(src)
    names = [o.name for o in sess.get_outputs()]
    n_out = len(ref.get_outputs())
    past = {p: _empty_past(lay, p, 1) for p, _ in lay.pairs}
    tokens, out = [3, 1, 4, 1, 5, 9, 2, 6], []
    for step in range(12):
        feeds = moe_decode.decode_feeds(lay, tokens, past)
        got_probe = prb.run(None, feeds)[n_out:]
        chosen = {(r, int(e)) for r, v in zip(routers, got_probe[:len(routers)], strict=True)
                  for e in v.reshape(-1)}
        predicted = {(layer, int(e)) for layer, v in zip(
            spec_layers, got_probe[len(routers):], strict=True) for e in v.reshape(-1)}
        before = (sim.hits, sim.misses, sim.warm_reads, sim.warm_present, sim.warm_hits)
        reset_counters()
        got = sess.run(None, feeds)
        want = sim.step(loads, chosen, predicted)
        c = counters()
        # (less the embedding's rows, which its GatherRows reads from the file too)
        assert c["bytes_read_disk"] - c["bytes_gathered"] == want, step
        now = (sim.hits, sim.misses, sim.warm_reads, sim.warm_present, sim.warm_hits)
        assert (c["expert_cache_hits"], c["expert_cache_misses"], c["warm_reads"],
                c["warm_present"], c["warm_hits"]) == tuple(
                    b - a for a, b in zip(before, now, strict=True)), step
        np.testing.assert_array_equal(got[0], ref.run(None, feeds)[0])
        past = {p: got[names.index(q)] for p, q in lay.pairs}
        tokens = [int(np.argmax(got[0][0, -1]))]
        out.append(tokens[0])
    assert out == greedy(ref, lay, [3, 1, 4, 1, 5, 9, 2, 6], 12)
    assert sim.warm_reads > 0 and sim.warm_hits > 0, vars(sim)


def test_the_rewrite_orders_each_routed_reload_after_its_warm(tmp_path, moe_export):
    """The speculation's MatMul and TopK sit right after layer 0's router MatMul, its warm
    Prefetches after layer 0's own routed Prefetches (FIFO on the disk channel: before them
    they would delay the experts being computed) and before layer 1's router; each warm's
    empty output is read only by its weight's routed Prefetch; the invariant check refuses a
    warm output read by anything else."""
    src = moe_export("qwen3_moe")
    model, choice = _optimized(src, tmp_path / "opt", 1 << 20)
    m = ir.load(str(model))
    nodes = list(m.graph)
    spec = choice.speculations[0]
    mm = next(i for i, n in enumerate(nodes) if n.op_type == "MatMul"
              and n.inputs[1] is not None and n.inputs[1].name == spec.router_weight
              and n.name.startswith("ho.spec."))
    assert nodes[mm - 1].op_type == "MatMul"  # (layer 0's router, right before it)
    assert [n.op_type for n in nodes[mm:mm + 3]] == ["MatMul", "Constant", "TopK"]
    t1 = next(i for i, n in enumerate(nodes) if n.name == spec.layer)
    warms = [i for i, n in enumerate(nodes) if n.attributes.get(contract.ATTR_WARM) is not None]
    routed0 = [i for i, n in enumerate(nodes[:t1]) if n.op_type == contract.PREFETCH
               and n.attributes.get(contract.ATTR_GATED) is not None and i not in warms]
    assert routed0 and max(routed0) < min(warms) and max(warms) < t1
    for n in nodes:
        if n.attributes.get(contract.ATTR_WARM) is not None:
            assert list(n.outputs[0].shape) == [0]
            users = [u for u, _ in n.outputs[0].uses()]
            assert len(users) == 1 and users[0].op_type == contract.PREFETCH
            assert users[0].attributes[contract.ATTR_NAME].value == \
                n.attributes[contract.ATTR_NAME].value
            assert users[0].attributes.get(contract.ATTR_WARM) is None
    check_schedule(m)
    warm = next(n for n in nodes if n.attributes.get(contract.ATTR_WARM) is not None)
    bad = ir.node("Identity", [warm.outputs[0]])
    m.graph.append(bad)
    with pytest.raises(ScheduleError, match="reads warm Prefetch"):
        check_schedule(m)


def test_each_layer_left_out_says_why(tmp_path, moe_export):
    """No cache, a router weight offloaded with the experts, ``auto`` without the budget
    planner, ``off``: no speculation, a reason per layer (none for ``off``)."""
    src = moe_export("qwen3_moe")
    layer = "/model/layers.1/mlp/TopK"
    _, c = _optimized(src, tmp_path / "nocache", 0)
    assert not c.speculations and c.speculation_skipped == {}  # (nothing cacheable: no word)
    # min_bytes 0 would offload the routers too: the speculated layer's stays resident (with
    # its reason), the first layer's goes; with speculation off both go
    r = optimize(src, tmp_path / "router.onnx", OffloadOptions(
        activations=False, min_bytes=0, weight_tier="disk", expert_cache=1 << 20,
        speculate_experts="on"), DIMS)
    assert [s.layer for s in r.choice.speculations] == [layer]
    router = r.choice.speculations[0].router_weight
    assert r.choice.skipped[router] == ROUTER_REASON
    offloaded = {w.name for w in r.choice.weights}
    r = optimize(src, tmp_path / "router_off.onnx", OffloadOptions(
        activations=False, min_bytes=0, weight_tier="disk", expert_cache=1 << 20,
        speculate_experts="off"), DIMS)
    assert {w.name for w in r.choice.weights} - offloaded == {router}
    _, c = _optimized(src, tmp_path / "auto", 1 << 20, "auto")
    assert "cost model says it pays" in c.speculation_skipped[layer]
    model, c = _optimized(src, tmp_path / "off", 1 << 20, "off")
    assert not c.speculations and not c.speculation_skipped and not _warms(model)
    _, c = _optimized(src, tmp_path / "small", 4096)
    assert "holds less than both layers' selections for one token" in \
        c.speculation_skipped[layer]


def test_auto_speculates_where_the_cost_model_says_it_pays(tmp_path, moe_export):
    """``auto`` with a cost model: compute between the routers longer than half the
    expected misses' read time speculates; a slow disk under fast compute does not, and
    says so with both times."""
    from ho_onnx.cost.model import CostModel
    from ho_onnx.graph.analyse import analyse
    from ho_onnx.schedule.speculate import PRIOR, with_speculation

    src = moe_export("qwen3_moe")
    full = cacheable_bytes(_optimized(src, tmp_path / "sizing", 0, "off")[1])
    _, choice = _optimized(src, tmp_path / "opt", full // 2, "off")  # (half: misses expected)
    a = analyse(onnx.load(str(src), load_external_data=False), DIMS)
    n = len(a.nodes)

    def costs(node_s: float, disk_bw: float) -> CostModel:
        return CostModel(np.full(n, node_s), lambda b, _d: b / disk_bw, "test")

    assert with_speculation(a, choice, "auto", costs(1e-3, 1e9)).speculations
    c = with_speculation(a, choice, "auto", costs(1e-9, 1e3))
    assert not c.speculations
    why = c.speculation_skipped["/model/layers.1/mlp/TopK"]
    assert "does not pay" in why and f"{1 - PRIOR:.0%}" in why
    _, everything = _optimized(src, tmp_path / "all", full, "off")  # (expected to hit always)
    c = with_speculation(a, everything, "auto", costs(1e-3, 1e9))
    assert "nothing to gain" in c.speculation_skipped["/model/layers.1/mlp/TopK"]


def _timed(choice, costs, a):
    from ho_onnx.schedule.simulate import simulate

    sim = simulate(a, choice, costs.compute_s, costs.transfer_time, DIMS)
    disk = sum(ev.nbytes for ev in sim.transfers if ev.direction == "disk")
    return sim.total_s, disk


def test_the_simulated_time_counts_the_speculation(tmp_path, moe_export):
    """A speculated reload is timed in three parts: the share a right guess covers, issued
    after the earlier layer's own expert reads, the wrong guesses (as many bytes again less
    that share) on the channel with nobody waiting, and the rest at its own Prefetch. With
    the experts alone on the disk and compute to hide the early reads the plan is faster;
    with a slow disk under fast compute the wrong guesses only delay it."""
    import copy

    from ho_onnx.cost.model import CostModel
    from ho_onnx.graph.analyse import analyse
    from ho_onnx.schedule.expert_cache import cacheable
    from ho_onnx.schedule.speculate import PRIOR

    src = moe_export("qwen3_moe")
    full = cacheable_bytes(_optimized(src, tmp_path / "sizing", 0, "off")[1])
    _, choice = _optimized(src, tmp_path / "opt", full // 2, "on")  # (misses expected)
    assert choice.speculations
    # only the experts offloaded (the rest would keep the disk busy all along)
    choice.weights = [w for w in choice.weights if cacheable(w)]
    bare = copy.deepcopy(choice)
    bare.speculations.clear()
    a = analyse(onnx.load(str(src), load_external_data=False), DIMS)
    n = len(a.nodes)
    warmed = {(w.weight, w.consumer) for s in choice.speculations for w in s.warms}
    by_name = {w.name: w for w in choice.weights}
    misses = [int(by_name[w].nbytes * by_name[w].fraction * (1 - by_name[w].hit))
              for w, _k in warmed]
    for node_s, disk_bw, faster in ((1e-4, 1e6, True), (1e-6, 1e4, False)):
        costs = CostModel(np.full(n, node_s), lambda b, _d, bw=disk_bw: b / bw, "test")
        (with_s, with_b), (without_s, without_b) = _timed(choice, costs, a), \
            _timed(bare, costs, a)
        assert with_b - without_b == sum(m - int(m * PRIOR) for m in misses)
        assert (with_s < without_s) == faster, (with_s, without_s)


def test_auto_keeps_what_the_simulation_says_pays(tmp_path, moe_export):
    """The budget planner's ``auto`` checks the layers the cost model's rule kept against
    the simulated time (the wrong guesses timed on the channel): with 100 us a node the early
    reads hide behind compute and the speculation stays; with the cpu preset's compute the
    layer's other weights, on the same disk channel, would queue behind the wrong guesses,
    and it goes, with both times in its reason."""
    from ho_onnx.cost.machine import MACHINES
    from ho_onnx.cost.source import CostSource
    from ho_onnx.rewrite.pipeline import plan_model

    src = moe_export("qwen3_moe")
    layer = "/model/layers.1/mlp/TopK"
    full = cacheable_bytes(_optimized(src, tmp_path / "sizing", 0, "off")[1])

    def plan(**rates):
        path = tmp_path / f"m{len(rates)}.json"
        MACHINES["cpu"].with_overrides(name="test", **rates).to_json(path)
        return plan_model(src, OffloadOptions(activations=False, min_bytes=MIN_BYTES,
                                              weight_tier="disk", budget=120_000,
                                              expert_cache=full // 2), DIMS,
                          CostSource(str(path)))[2].choice

    kept = plan(launch_overhead_s=1e-4)
    assert [s.layer for s in kept.speculations] == [layer] and not kept.speculation_skipped
    dropped = plan()
    assert dropped.expert_cache and not dropped.speculations
    assert "does not pay in the simulated time" in dropped.speculation_skipped[layer]
