"""The simulation's load timing (``schedule/simulate.py``): the default (a load starts when the
GPU reaches its Prefetch), ``host_ahead`` (as the CUDA engine issues it: at once, after
its channel and the Wait copy that last used its staging buffer) and ``copy_in_compute``
(the CPU engine: every copy inside a Wait or a Store, on the compute stream)."""

from __future__ import annotations

import numpy as np
import pytest
from graphs import two_weights_model

from ho_onnx.graph.analyse import analyse
from ho_onnx.schedule.simulate import simulate
from ho_onnx.schedule.types import OffloadChoice, WeightOffload

MS = 1e-3
NBYTES = 512 * 512 * 4


def _run(w2_bytes: int, host_ahead: bool, copy_in_compute: bool = False, tier: str = "host"):
    """Steps Relu, Sigmoid, MatMul(W1), MatMul(W2) of 1 ms; W1 prefetched before step 0 and
    read at step 2, W2 prefetched right before its reader (step 3); copies 0.5 ms per
    NBYTES on one channel, no latency."""
    a = analyse(two_weights_model())
    choice = OffloadChoice(weights=[WeightOffload("W1", NBYTES, (2,), (0,), tier=tier),
                                    WeightOffload("W2", w2_bytes, (3,), (3,), tier=tier)])
    sim = simulate(a, choice, np.full(4, MS), lambda nbytes, d: 0.5 * MS * nbytes / NBYTES,
                   host_ahead=host_ahead, copy_in_compute=copy_in_compute)
    return sim, {t.tensor: t for t in sim.transfers}


def test_default_starts_a_load_when_the_gpu_reaches_its_prefetch():
    sim, t = _run(NBYTES, host_ahead=False)
    assert t["W1"].start_s == 0 and t["W2"].start_s == pytest.approx(3 * MS)
    assert t["W2"].stall_s == pytest.approx(0.5 * MS)
    assert sim.total_s == pytest.approx(4.5 * MS)


def test_host_ahead_load_waits_for_the_wait_copy_of_its_staging_buffer():
    """W2 has W1's size: the one staging buffer of that size is W1's until W1's Wait copied
    out of it (step 2, at 2 ms), so W2's copy starts then: not when its channel is free
    (0.5 ms: no fence) nor when the GPU reaches its Prefetch (3 ms)."""
    sim, t = _run(NBYTES, host_ahead=True)
    assert t["W1"].start_s == 0
    assert t["W2"].start_s == pytest.approx(2 * MS)
    assert t["W2"].stall_s == 0
    assert sim.total_s == pytest.approx(4 * MS)


def test_host_ahead_load_of_another_size_starts_when_its_channel_is_free():
    """A size no earlier load held gets a buffer of its own: only the channel orders it."""
    sim, t = _run(2 * NBYTES, host_ahead=True)
    assert t["W2"].start_s == pytest.approx(0.5 * MS)
    assert sim.total_s == pytest.approx(4 * MS)
    default, td = _run(2 * NBYTES, host_ahead=False)
    assert td["W2"].start_s == pytest.approx(3 * MS) and default.total_s == pytest.approx(5 * MS)


def test_host_ahead_changes_load_times_not_memory():
    """The memory per step is the schedule's, whatever the timing: the two timings start W2
    at different times (3 vs 2 ms) over the same bytes per step."""
    (a, ta), (b, tb) = _run(NBYTES, host_ahead=False), _run(NBYTES, host_ahead=True)
    assert ta["W2"].start_s != pytest.approx(tb["W2"].start_s)
    assert a.memory.max() >= NBYTES and np.array_equal(a.memory, b.memory)


def test_cpu_engine_copies_a_host_load_inside_its_wait():
    """The CPU engine copies a host-tier weight in its Wait: a Prefetch two steps ahead hides
    nothing, each load stalls the run for its whole copy (4 ms of compute + 2 x 0.5 ms)."""
    sim, t = _run(NBYTES, host_ahead=False, copy_in_compute=True)
    assert t["W1"].start_s == pytest.approx(2 * MS) and t["W1"].stall_s == pytest.approx(0.5 * MS)
    assert t["W2"].start_s == pytest.approx(3.5 * MS) and t["W2"].stall_s == pytest.approx(0.5 * MS)
    assert sim.total_s == pytest.approx(5 * MS)
    default, _ = _run(NBYTES, host_ahead=False)  # (a channel beside the compute: W1 hidden)
    assert default.total_s == pytest.approx(4.5 * MS)


def test_cpu_engine_reads_the_disk_ahead_then_copies_out_of_staging():
    """A disk read runs on its channel from the Prefetch (W1's is done by its Wait: no stall
    for it) and the Wait then copies out of staging at the host tier's rate (0.5 ms each)."""
    sim, t = _run(NBYTES, host_ahead=False, copy_in_compute=True, tier="disk")
    assert t["W1"].start_s == 0 and t["W1"].stall_s == pytest.approx(0.5 * MS)  # the copy
    assert t["W2"].stall_s == pytest.approx(0.5 * MS + 0.5 * MS)  # the read, then the copy
    assert sim.total_s == pytest.approx(4 * MS + 1.5 * MS)


def test_cpu_engine_cost_model_says_it_copies_in_compute():
    """The cpu machine (no host of its own: the CPU EP) makes a cost model that copies in
    the Waits; a GPU machine's does not."""
    from ho_onnx.cost.source import CostSource

    a = analyse(two_weights_model())
    assert CostSource(machine="cpu").cost_model(a, {}).copy_in_compute
    assert not CostSource(machine="h100").cost_model(a, {}).copy_in_compute


def test_the_planner_times_plans_as_its_cost_model_says():
    """A cost model with ``host_ahead`` (compute measured on a GPU) makes the planner report
    (and judge its look-ahead by) host-ahead timing; the default model keeps the default."""
    from ho_onnx.cost.model import CostModel
    from ho_onnx.schedule.options import OffloadOptions
    from ho_onnx.schedule.planner import plan

    a = analyse(two_weights_model())
    cs = np.full(4, MS)

    def tt(nbytes, direction):
        return 3 * MS * nbytes / NBYTES

    budget = simulate(a, None, cs, tt).peak_bytes - NBYTES // 2
    for host_ahead in (False, True):
        p = plan(a, OffloadOptions(budget=budget, activations=False, min_bytes=0,
                                   arena_refits=0),
                 CostModel(cs, tt, host_ahead=host_ahead))
        assert p.choice.weights
        want = simulate(a, p.choice, cs, tt, host_ahead=host_ahead).total_s
        other = simulate(a, p.choice, cs, tt, host_ahead=not host_ahead).total_s
        assert p.planned.total_s == pytest.approx(want)
        assert other != pytest.approx(want), "this plan does not tell the timings apart"


def test_an_initializer_the_graph_outputs_is_resident_for_the_whole_run():
    """ORT drops an initializer nothing reads, but not one the graph outputs (it was left
    out of the predicted memory: 1 KiB too little here)."""
    from graphs import text_model

    a = analyse(text_model("g (float[2, 4] x) => (float[2, 4] y, float[256] W) "
                           "{ h = Relu(x)\n y = Sigmoid(h) }", W=(256,)))
    sim = simulate(a, None, np.full(2, MS), lambda nbytes, d: 0.0)
    # x, h and W at step 0; h, y and W at step 1 (32 bytes each for x, h, y)
    assert sim.memory.tolist() == [1024 + 2 * 32, 1024 + 2 * 32]
