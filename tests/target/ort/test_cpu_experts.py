"""Experts computed where their weights live (issue 37, item 4): an offloaded routed expert's
MatMuls become ``HostMatMul``, ORT's own CPU MatMul kernel run on the weight's bytes in the
library's host store (no copy into ORT's buffers). Checked against the unmodified model bit
for bit (the same kernel), against the router's own output (which experts ran, on how many
rows) and against the library's transfer counters (the experts' bytes never move)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from ho_onnx import InferenceSession, contract, counters, reset_counters
from ho_onnx.cost.model import CostModel
from ho_onnx.cost.source import CostSource
from ho_onnx.rewrite.pipeline import optimize, plan_model
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.schedule.planner import InfeasibleBudgetError
from tests.graphs import MOE_E as E
from tests.graphs import MOE_H as H
from tests.graphs import MOE_W as W
from tests.graphs import moe_model

pytestmark = pytest.mark.usefixtures("no_debug_hooks")

def _so(level: str = "ORT_ENABLE_BASIC") -> ort.SessionOptions:
    """As ``verify`` compares: no pre-packing (a pre-packed MatMul is another kernel path)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    so.add_session_config_entry("session.disable_prepacking", "1")
    return so


def _ops(path) -> list[onnx.NodeProto]:
    return list(onnx.load(str(path), load_external_data=False).graph.node)


def _least_budget(src, **kw) -> int:
    """The smallest budget the planner meets for ``kw``'s options."""
    try:
        plan_model(src, OffloadOptions(activations=False, min_bytes=0, budget=1, **kw),
                   {"N": 1})
    except InfeasibleBudgetError as e:
        return e.min_budget
    raise AssertionError("a 1-byte budget was met")


@pytest.mark.parametrize("mode", ["all", "auto"])
def test_experts_computed_on_the_host_are_exact_and_move_nothing(tmp_path, mode):
    """Expert MatMuls run as HostMatMul (``all``: every one; ``auto`` on the CPU machine,
    where the host's MatMul is the same kernel without the copy: every offloaded one);
    outputs equal the unmodified model's bit for bit; the experts the router chose ran, on
    its tokens, and no other did; no expert computed on the host moved a byte."""
    src, out = moe_model(tmp_path), tmp_path / "moe.ho.onnx"
    budget = _least_budget(src, cpu_experts="auto") if mode == "auto" else None
    r = optimize(src, out, OffloadOptions(activations=False, min_bytes=0, budget=budget,
                                          cpu_experts=mode), {"N": 1})
    host = {w.name: w for w in r.choice.weights if w.host_readers}
    assert len(host) >= (3 * E if mode == "all" else 3)
    assert all(len(w.host_readers) == 1 and not w.consumers for w in host.values())
    assert all(r.choice.cpu_experts[n].startswith("computed on the host") for n in host)
    nodes = _ops(out)
    assert sum(n.op_type == contract.HOST_MATMUL for n in nodes) == len(host)
    assert not any(n.op_type == "MatMul" and n.input[1] in host for n in nodes)
    assert not any(n.op_type == contract.PREFETCH and any(
        a.name == contract.ATTR_NAME and a.s.decode() in host for a in n.attribute)
        for n in nodes)
    plain = sum(w.nbytes * len(w.consumers) for w in r.choice.weights if not w.gates)
    gated = [w for w in r.choice.weights if w.gates]  # experts still streamed (none here)
    ref = ort.InferenceSession(str(src), _so(), providers=["CPUExecutionProvider"])
    sess = InferenceSession(out, sess_options=_so())
    rng = np.random.default_rng(1)
    ran = set()
    for n in (1, 1, 2, 3, 8, 0):
        x = rng.standard_normal((n, H)).astype(np.float32)
        want_y, idx = ref.run(None, {"x": x})
        tokens = np.bincount(idx.reshape(-1), minlength=E)  # the router's own choice
        reset_counters()
        got_y, got_idx = sess.run(None, {"x": x})
        c = counters()
        np.testing.assert_array_equal(got_y, want_y)
        np.testing.assert_array_equal(got_idx, idx)
        expert = {name: int(name[1:]) for name in host}
        assert c["host_matmuls"] == sum(tokens[e] > 0 for e in expert.values()), tokens
        assert c["host_matmul_rows"] == sum(tokens[e] for e in expert.values())
        moved = sum(w.nbytes for w in gated if tokens[int(w.name[1:])] > 0)
        assert c["bytes_loaded"] == plain + moved
        ran |= {e for e in expert.values() if tokens[e]}
    assert len(ran) > 1


def test_the_host_keeps_expert_weights_out_of_the_fast_tier(tmp_path):
    """The smallest budget the planner meets falls when the experts are computed on the host
    (no reload of an expert's weight ever enters ORT's buffers), below routed streaming's."""
    src = moe_model(tmp_path)
    streamed, on_host = _least_budget(src), _least_budget(src, cpu_experts="auto")
    # streaming holds an expert weight at its reader; the host's floor is below one
    assert on_host < H * W * 4 <= streamed, (streamed, on_host)
    opts = OffloadOptions(activations=False, min_bytes=0, budget=streamed, cpu_experts="auto")
    p = plan_model(src, opts, {"N": 1})[2]
    q = plan_model(src, OffloadOptions(activations=False, min_bytes=0, budget=streamed),
                   {"N": 1})[2]
    assert p.planned.peak_bytes <= q.planned.peak_bytes


def test_auto_moves_an_expert_where_the_host_is_slower(tmp_path):
    """On a GPU machine the host's MatMul costs its activations' copies each way: for this
    tiny expert moving its weight is cheaper, and the plan says so per expert; on the CPU
    machine the same experts are computed on the host."""
    src = moe_model(tmp_path)
    dims = {"N": 1}
    opts = OffloadOptions(activations=False, min_bytes=0, budget=_least_budget(src),
                          cpu_experts="auto")
    gpu = plan_model(src, opts, dims, CostSource("h100"))[2].choice
    offloaded = {w.name for w in gpu.weights if w.gates}  # experts, streamed
    assert len(offloaded) >= 3 and set(gpu.cpu_experts) == offloaded
    assert all(why.startswith("moved (cpu_experts=auto)") for why in gpu.cpu_experts.values())
    assert not any(w.host_readers for w in gpu.weights)
    # computed on the host anyway: the plan's time counts each HostMatMul's copies there
    on_host = plan_model(src, replace(opts, cpu_experts="all"), dims, CostSource("h100"))[2]
    n = sum(len(w.host_readers) for w in on_host.choice.weights)
    assert n >= 3 and on_host.planned.total_s >= on_host.baseline.total_s + n * 2 * 10e-6
    cpu = plan_model(src, opts, dims, CostSource("cpu"))[2].choice
    assert {w.name for w in cpu.weights if w.host_readers} == set(cpu.cpu_experts)
    assert cpu.cpu_experts and all(why.startswith("computed on the host")
                                   for why in cpu.cpu_experts.values())


def test_host_times_replace_the_devices_only_where_computed_on_the_host():
    cm = CostModel(np.ones(3), lambda b, d: 0.0, host_time=lambda p: 10.0 * p)
    np.testing.assert_array_equal(cm.with_host([2]), [1.0, 1.0, 20.0])
    np.testing.assert_array_equal(cm.compute_s, [1.0, 1.0, 1.0])
    assert cm.on_host_s(1) == 10.0
    same = CostModel(np.ones(3), lambda b, d: 0.0)  # the CPU EP: the host is the device
    assert same.with_host([2]) is same.compute_s and same.on_host_s(2) == 1.0


def test_cpu_experts_options_are_checked():
    with pytest.raises(ValueError, match=r"cpu_experts must be off\|auto\|all"):
        OffloadOptions(cpu_experts="some")
    with pytest.raises(ValueError, match="give a budget"):
        OffloadOptions(cpu_experts="auto")
    with pytest.raises(ValueError, match="routed=True"):
        OffloadOptions(cpu_experts="all", routed=False)


def _host_model(tmp_path):
    out = tmp_path / "moe.ho.onnx"
    optimize(moe_model(tmp_path), out, OffloadOptions(activations=False, min_bytes=0,
                                                      cpu_experts="all"), {"N": 1})
    return out, onnx.load(str(out), load_external_data=False)


def _attr(node: onnx.NodeProto, name: str) -> onnx.AttributeProto:
    return next(a for a in node.attribute if a.name == name)


@pytest.mark.parametrize("damage, match", [
    ("location", "nope.data"),
    ("shape", "2-D weight"),
    ("tier", "host-tier"),
])
def test_a_hostile_host_matmul_fails_session_creation(tmp_path, damage, match):
    """A HostMatMul whose weight is not where it says, not 2-D or not in the host store
    fails session creation with its reason, never a crash."""
    out, m = _host_model(tmp_path)
    node = next(n for n in m.graph.node if n.op_type == contract.HOST_MATMUL)
    if damage == "location":
        _attr(node, contract.ATTR_LOCATION).s = b"nope.data"
    elif damage == "shape":
        shape = _attr(node, contract.ATTR_SHAPE)
        dims = list(shape.ints)
        del shape.ints[:]
        shape.ints.extend([dims[0] * dims[1]])
    else:
        node.attribute.append(onnx.helper.make_attribute(contract.ATTR_TIER, "disk"))
    onnx.save(m, out)
    with pytest.raises(Exception, match=match):
        InferenceSession(out)


def test_a_host_matmul_given_the_wrong_input_fails_the_run(tmp_path):
    """An x whose last dim is not the weight's K fails the run, naming both, never reads
    past the weight."""
    out, m = _host_model(tmp_path)
    node = next(n for n in m.graph.node if n.op_type == contract.HOST_MATMUL
                and any(a.name == contract.ATTR_NAME and a.s == b"D0" for a in n.attribute))
    node.input[1] = "x"  # [N, 16] where D0 is [32, 16]
    onnx.save(m, out)
    sess = InferenceSession(out)
    with pytest.raises(Exception, match=r"last dim 16 .* MatMul needs x's last dim to be 32"):
        sess.run(None, {"x": np.ones((2, H), np.float32)})


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_moe_export_with_its_experts_on_the_host(tmp_path, moe_export, arch):
    """Real exports (Optimum): every weight offloaded, the experts computed on the host;
    logits bit-exact to the unmodified model at prefill and at decode (ORT's optimizations
    off, no pre-packing), greedy tokens identical, the expert MatMuls ran as HostMatMul and
    none of the experts' bytes moved."""
    from ho_onnx.target.ort.generate import greedy, kv_layout

    src = moe_export(arch)
    out = tmp_path / "opt" / "model.onnx"
    out.parent.mkdir()
    r = optimize(src, out, OffloadOptions(activations=False, min_bytes=0, cpu_experts="all"),
                 {"batch_size": 1, "sequence_length": 1, "past_sequence_length": 16})
    host = [w for w in r.choice.weights if w.host_readers]
    assert host and not any(w.consumers for w in host)
    plain = sum(w.nbytes * len(w.consumers) for w in r.choice.weights)
    prompt = [3, 1, 4, 1, 5]
    want = greedy(ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]),
                  kv_layout(src), prompt, 12)
    assert len(set(want)) > 3, want
    assert greedy(InferenceSession(out), kv_layout(out), prompt, 12) == want
    off = "ORT_DISABLE_ALL"
    ref = ort.InferenceSession(str(src), _so(off), providers=["CPUExecutionProvider"])
    sess = InferenceSession(out, sess_options=_so(off))
    lay = kv_layout(src)
    rng = np.random.default_rng(0)
    for seq, past in ((7, 0), (1, 16), (1, 16)):  # a prefill, then decode steps
        feeds = {"input_ids": rng.integers(0, 100, (1, seq)).astype(np.int64),
                 "attention_mask": np.ones((1, past + seq), np.int64),
                 "position_ids": np.arange(past, past + seq, dtype=np.int64)[None, :]}
        for p, _ in lay.pairs:
            shape = [1 if k == 0 else past if k == lay.seq_axis else int(d)
                     for k, d in enumerate(lay.past_dims[p])]
            feeds[p] = rng.standard_normal(shape).astype(np.float32)
        reset_counters()
        got = sess.run(None, feeds)
        c = counters()
        np.testing.assert_array_equal(got[0], ref.run(None, feeds)[0])
        assert c["host_matmuls"] > 0 and c["host_matmul_rows"] >= c["host_matmuls"]
        assert c["bytes_loaded"] == plain  # the non-expert weights only, every step


def test_the_command_line_computes_experts_on_the_host(tmp_path):
    """``--cpu-experts``: ``optimize`` writes HostMatMuls, ``plan --json`` says per expert
    weight where it is computed and why, and ``auto`` without a budget is refused by flag."""
    import json

    from click.testing import CliRunner

    from ho_onnx.cli import main

    src, out = moe_model(tmp_path), tmp_path / "o.onnx"
    r = CliRunner().invoke(main, ["optimize", str(src), str(out), "--offload", "weights",
                                  "--min-bytes", "0", "--cpu-experts", "all", "--dim", "N=1"])
    assert r.exit_code == 0, r.output
    assert sum(n.op_type == contract.HOST_MATMUL for n in _ops(out)) == 3 * E
    r = CliRunner().invoke(main, ["plan", str(src), "--budget", "1KiB", "--offload", "weights",
                                  "--min-bytes", "0", "--cpu-experts", "auto", "--dim", "N=1",
                                  "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output[r.output.index("{"):])
    assert doc["cpu_experts"] and all(why.startswith("computed on the host")
                                      for why in doc["cpu_experts"].values())
    assert all(w["host_readers"] for w in doc["offloaded"]["weights"]
               if w["name"] in doc["cpu_experts"])
    r = CliRunner().invoke(main, ["plan", str(src), "--budget", "1KiB", "--offload", "weights",
                                  "--min-bytes", "0", "--cpu-experts", "auto", "--dim", "N=1"])
    assert r.exit_code == 0, r.output
    assert f"experts: {len(doc['cpu_experts'])} expert weights computed on the host" in r.output
    r = CliRunner().invoke(main, ["optimize", str(src), str(tmp_path / "p.onnx"),
                                  "--cpu-experts", "auto", "--dim", "N=1"])
    assert r.exit_code != 0 and "--cpu-experts" in r.output and "budget" in r.output


def test_what_a_host_matmul_computes_has_no_shape_for_ort(tmp_path):
    """A HostMatMul declares no output shape (the library gives ORT no inference): the arena
    replay keys neither its output nor what reads it (``schedule.arena._shapeless``); the
    experts streamed instead keep their keys."""
    from ho_onnx.schedule.arena import _shapeless
    from ho_onnx.target.ort.arena import ORT

    src = moe_model(tmp_path)
    r = optimize(src, tmp_path / "moe.ho.onnx", OffloadOptions(
        activations=False, min_bytes=0, cpu_experts="all"), {"N": 1})
    a = r.analysis
    host = [p for w in r.choice.weights for p in w.host_readers]
    assert host
    dark = _shapeless(a, r.choice, ORT)
    outs = {t.name for t in a.tensors.values() if t.producer in host}
    assert outs and outs <= dark
    readers = {a.tensors[o].consumers[0] for o in outs if a.tensors[o].consumers}
    assert all(any(t.producer == c for t in a.tensors.values() if t.name in dark)
               for c in readers)
    none = optimize(src, tmp_path / "moe.streamed.onnx", OffloadOptions(
        activations=False, min_bytes=0), {"N": 1})
    assert not _shapeless(none.analysis, none.choice, ORT)  # (no op that declares none)
