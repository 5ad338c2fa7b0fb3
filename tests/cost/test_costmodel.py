"""The machine cost model: presets, machine files, analytic FLOPs/roofline, ORT profiles."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import pytest

from ho_onnx.cost import (
    MACHINES,
    Machine,
    MachineError,
    NodeCosts,
    analytic_costs,
    load_machine,
    node_flops_bytes,
    profile_costs,
    transfer_time,
)
from ho_onnx.cost.model import CostModel
from ho_onnx.cost.source import CostSource
from ho_onnx.errors import UnboundDimError
from ho_onnx.graph.analyse import analyse
from ho_onnx.target.ort.facts import never_runs
from ho_onnx.target.ort.profile import ProfileError, parse_trace, profile_model

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # `models` is a top-level folder, not part of the installed package
    sys.path.insert(0, _ROOT)

from models.decoder import build_decoder  # noqa: E402

HEADER = '<ir_version: 8, opset_import: ["" : 17]>'


def parse(body: str) -> onnx.ModelProto:
    m = onnx.parser.parse_model(f"{HEADER}\n{body}")
    onnx.checker.check_model(m)
    return m


def matmul_model(m: int | str, k: int, n: int, batch: int = 1) -> onnx.ModelProto:
    return parse(f"""
    g (float[{batch}, {m}, {k}] a, float[{k}, {n}] b) => (float[{batch}, {m}, {n}] y) {{
      y = MatMul(a, b)
    }}""")


# ---- machines ------------------------------------------------------------------------


def test_presets_units():
    h100, h200, cpu = MACHINES["h100"], MACHINES["h200"], MACHINES["cpu"]
    for g in (h100, h200):
        assert 5e14 < g.peak_flops < 2e15  # ~989 TFLOP/s dense bf16
        assert 1e12 < g.mem_bw < 1e13  # TB/s of HBM
        assert 1e10 < g.h2d_bw <= 64e9 and 1e10 < g.d2h_bw <= 64e9  # PCIe 5 x16
        assert g.transfer_latency_s < 1e-3 and g.launch_overhead_s < 1e-3
    assert h200.mem_bw > h100.mem_bw and h200.peak_flops == h100.peak_flops
    assert cpu.peak_flops < h100.peak_flops and cpu.mem_bw < h100.mem_bw
    assert all(0 < x.efficiency <= 1 for x in MACHINES.values())
    # 1 GB over the H100's PCIe takes ~20 ms, on the CPU "link" ~200 ms
    assert transfer_time(h100, 1e9, "h2d") == pytest.approx(1e9 / 50e9 + 10e-6)
    assert transfer_time(cpu, 1e9, "disk") == pytest.approx(1.0, rel=1e-3)
    assert transfer_time(h100, 0, "d2h") == 0.0
    assert h100.transfer_time(4096, "d2h") == transfer_time(h100, 4096, "d2h")
    with pytest.raises(ValueError, match="direction"):
        transfer_time(h100, 1, "up")


def test_machine_json_round_trip_and_partial(tmp_path: Path):
    m = MACHINES["h100"].with_overrides(h2d_bw="25e9", name="mine")
    assert m.h2d_bw == 25e9 and m.d2h_bw == 50e9
    m.to_json(tmp_path / "m.json")
    assert Machine.from_json(tmp_path / "m.json") == m
    assert load_machine(str(tmp_path / "m.json")) == m
    # a calibrate output: only some keys (+ metadata), merged onto a preset
    calib = tmp_path / "calib.json"
    calib.write_text(json.dumps({"base": "h200", "h2d_bw": 40e9, "d2h_bw": 45e9,
                                 "transfer_latency_s": 8e-6, "samples": [1, 2]}))
    c = load_machine(calib, {"efficiency": 0.5})
    assert (c.h2d_bw, c.d2h_bw, c.transfer_latency_s, c.efficiency) == (40e9, 45e9, 8e-6, 0.5)
    assert c.mem_bw == MACHINES["h200"].mem_bw
    assert Machine.from_json(calib, base="cpu").peak_flops == MACHINES["cpu"].peak_flops
    calib.write_text(json.dumps({"disk_bw": 2e9}))  # no base: cpu
    assert load_machine(calib).peak_flops == MACHINES["cpu"].peak_flops
    assert load_machine("H100", {"disk_bw": 7e9}).disk_bw == 7e9


def test_machine_errors(tmp_path: Path):
    with pytest.raises(MachineError, match=r"unknown machine 'a100'.*cpu, h100, h200"):
        load_machine("a100")
    with pytest.raises(MachineError, match="unknown field 'bw'"):
        load_machine("cpu", {"bw": 1})
    with pytest.raises(MachineError, match="h2d_bw must be a number"):
        load_machine("cpu", {"h2d_bw": "fast"})
    with pytest.raises(ValueError, match="mem_bw must be between 1000 and"):
        MACHINES["cpu"].with_overrides(mem_bw=0)
    with pytest.raises(MachineError, match="does not exist"):
        load_machine(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    for text in ("[1, 2", "[" * 200_000):  # (nested past the parser: was a RecursionError)
        bad.write_text(text)
        with pytest.raises(MachineError, match="not readable JSON"):
            load_machine(bad)
    bad.write_text(json.dumps({"base": "tpu"}))
    with pytest.raises(MachineError, match="unknown machine 'tpu'"):
        load_machine(bad)


@pytest.mark.parametrize("field, value, words", [
    ("h2d_bw", 5e-324, r"h2d_bw must be between 1000 and 1e\+15 bytes/s.*units"),
    ("h2d_bw", 25, r"h2d_bw must be between .* got 25"),  # GB/s written as bytes/s
    ("disk_bw", 1e300, "disk_bw must be between"),
    ("peak_flops", 5e-324, r"peak_flops must be between 1e\+06 and 1e\+19 FLOP/s"),
    ("transfer_latency_s", 1e308, r"transfer_latency_s must be between 0 and 10 s"),
    ("launch_overhead_s", 1e308, "launch_overhead_s must be between 0 and 10 s"),
    ("efficiency", 5e-324, r"efficiency must be between 0.001 and 1"),
])
def test_machine_values_out_of_any_real_range_are_refused(tmp_path, field, value, words):
    """Found by hand: tiny or huge rates gave plans of NaN and inf times, and a product
    that underflowed to 0 an unexpected ZeroDivisionError; the ranges hold any real machine
    (the presets, calibrations) with orders of magnitude to spare."""
    f = tmp_path / "m.json"
    f.write_text(json.dumps({field: value}))
    with pytest.raises(MachineError, match=words):
        load_machine(f)


def test_plans_stay_finite_at_the_corners_of_the_machine_ranges():
    from ho_onnx.cost.machine import LIMITS

    a = analyse(matmul_model(64, 64, 64, batch=2))
    for corner in ("low", "high"):
        kw = {k: (lo if corner == "low" else hi) for k, (lo, hi, _) in LIMITS.items()}
        m = Machine(name=corner, **kw)
        nc = analytic_costs(a, m, {})
        assert np.isfinite(nc.seconds).all()
        assert np.isfinite(m.transfer_time(1 << 50, "h2d"))


# ---- analytic ------------------------------------------------------------------------


def test_analytic_costs_remember_sizes_without_changing_a_cost(tmp_path):
    """analytic_costs asks each tensor's size once (``sizes``); every node's time is what
    node_flops_bytes says of it alone, symbolic dims included."""
    from ho_onnx.cost import node_time
    from ho_onnx.graph.load import load_model

    src = tmp_path / "d.onnx"
    build_decoder(src, layers=2, hidden=32, heads=2, vocab=64, external_data=True)
    dims = {"batch": 2, "seq": 7}
    a = analyse(load_model(src).model, dims)
    machine = MACHINES["cpu"]
    sizes: dict[str, int] = {}
    alone = [0.0 if never_runs(a.node_at(p))
             else node_time(machine, *node_flops_bytes(a, p, dims)) for p in range(len(a.order))]
    assert analytic_costs(a, machine, dims).seconds.tolist() == alone
    shared = [node_flops_bytes(a, p, dims, sizes) for p in range(len(a.order))]
    assert shared == [node_flops_bytes(a, p, dims) for p in range(len(a.order))]
    assert sizes and all(b == (a.tensors[n].nbytes(dims) or 0) for n, b in sizes.items())


def test_matmul_flops_exact():
    a = analyse(matmul_model(5, 7, 3, batch=2))
    flops, nbytes = node_flops_bytes(a, 0)
    assert flops == 2 * 2 * 5 * 3 * 7
    assert nbytes == 4 * (2 * 5 * 7 + 7 * 3 + 2 * 5 * 3)
    # symbolic dims come from dims; an unbound one is named
    s = analyse(matmul_model("M", 7, 3))
    assert node_flops_bytes(s, 0, {"M": 11})[0] == 2 * 11 * 3 * 7
    with pytest.raises(UnboundDimError, match="'M'"):
        node_flops_bytes(s, 0, {})


def test_other_ops_flops():
    m = parse("""
    g (float[2, 3, 8, 8] x, float[4, 3, 3, 3] w, float[6, 5] p, float[4, 6] q)
      => (float[2, 4, 6, 6] y, float[5, 4] g, float[2, 3, 64] r, float[2, 3, 8, 8] s) {
      w_in = Relu(x)
      y = Conv(w_in, w)
      g = Gemm<transA = 1, transB = 1>(p, q)
      shp = Constant<value = int64[3] {2, 3, 64}>()
      r = Reshape(x, shp)
      s = Softmax(x)
    }""")
    a = analyse(m)
    by_op = {a.node_at(i).op_type: node_flops_bytes(a, i) for i in range(len(a.order))}
    assert by_op["Conv"][0] == 2 * (2 * 4 * 6 * 6) * 3 * 3 * 3
    assert by_op["Gemm"][0] == 2 * 5 * 4 * 6
    assert by_op["Reshape"] == (0.0, 4 * 384 * 2 + 8 * 3)
    assert by_op["Softmax"][0] == 5 * 384
    assert by_op["Relu"][0] == 384
    c = analytic_costs(a, MACHINES["cpu"])
    assert c.seconds[[a.node_at(i).op_type for i in range(len(a.order))].index("Constant")] == 0


def test_unknown_shapes_do_not_crash():
    m = parse("""
    g (float[N, 4] x) => (float[M] y) {
      y = NonZero(x)
    }""")
    m.graph.output[0].type.tensor_type.ClearField("shape")
    a = analyse(m)
    flops, nbytes = node_flops_bytes(a, 0, {"N": 3})
    assert flops == 0 and nbytes >= 3 * 4 * 4


def test_roofline():
    cpu = MACHINES["cpu"]
    small = analyse(matmul_model(1, 1024, 1024))  # a vector-matrix product: memory bound
    big = analyse(matmul_model(1024, 1024, 1024))  # compute bound
    fs, bs = node_flops_bytes(small, 0)
    fb, _ = node_flops_bytes(big, 0)
    ts = analytic_costs(small, cpu).seconds[0]
    tb = analytic_costs(big, cpu).seconds[0]
    assert ts == pytest.approx(bs / cpu.mem_bw + cpu.launch_overhead_s)
    assert tb == pytest.approx(fb / (cpu.peak_flops * cpu.efficiency) + cpu.launch_overhead_s)
    assert fs / (cpu.peak_flops * cpu.efficiency) < bs / cpu.mem_bw
    # the same matmul on an H100 is far faster
    assert analytic_costs(big, MACHINES["h100"]).total < tb / 100


def test_movement_ops_at_the_movement_rate():
    """A Concat (a KV cache's) moves its bytes at ``move_bw`` where a machine has one, a
    MatMul reads at ``mem_bw``; without one both at ``mem_bw`` (the presets)."""
    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Concat", ["p", "n"], ["c"], axis=2),
         helper.make_node("MatMul", ["c", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, 8, 1024, 64]),
         helper.make_tensor_value_info("n", TensorProto.FLOAT, [1, 8, 1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(np.ones((64, 64), np.float32), "w")])
    a = analyse(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    cpu = MACHINES["cpu"]
    assert cpu.move_bw == 0 and cpu.movement_bw == cpu.mem_bw
    slow = cpu.with_overrides(move_bw=cpu.mem_bw / 4)
    base, moved = analytic_costs(a, cpu).seconds, analytic_costs(a, slow).seconds
    _, cat_bytes = node_flops_bytes(a, 0)
    assert moved[0] == pytest.approx(cat_bytes / slow.move_bw + cpu.launch_overhead_s)
    assert moved[0] > 3 * (base[0] - cpu.launch_overhead_s) and moved[1] == base[1]
    with pytest.raises(ValueError, match="move_bw"):
        cpu.with_overrides(move_bw=5)  # (0 or a real rate)


def test_transpose_at_the_transpose_rate():
    """A Transpose (a strided copy: K^T over a KV cache) moves its bytes at ``transpose_bw``
    where a machine has one, else at the movement rate; a Concat stays at ``move_bw``."""
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Concat", ["p", "n"], ["c"], axis=2),
         helper.make_node("Transpose", ["c"], ["t"], perm=[0, 1, 3, 2])], "g",
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, 8, 1024, 64]),
         helper.make_tensor_value_info("n", TensorProto.FLOAT, [1, 8, 1, 64])],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    a = analyse(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    cpu = MACHINES["cpu"].with_overrides(move_bw=40e9)
    assert cpu.transpose_bw == 0 and cpu.transposing_bw == cpu.move_bw
    same = analytic_costs(a, cpu).seconds
    slow = cpu.with_overrides(transpose_bw=10e9)
    got = analytic_costs(a, slow).seconds
    _, tr_bytes = node_flops_bytes(a, 1)
    assert got[1] == pytest.approx(tr_bytes / 10e9 + cpu.launch_overhead_s)
    assert got[1] > 3 * (same[1] - cpu.launch_overhead_s) and got[0] == same[0]
    with pytest.raises(ValueError, match="transpose_bw"):
        cpu.with_overrides(transpose_bw=5)


def test_a_matmul_pays_the_machines_matmul_overhead():
    """``matmul_overhead_s`` (ORT's thread-pool dispatch of a MatMul on the CPU EP) is added
    to every MatMul and to nothing else."""
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(np.ones((64, 64), np.float32), "w")])
    a = analyse(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    cpu = MACHINES["cpu"]
    assert cpu.matmul_overhead_s == 0
    base = analytic_costs(a, cpu).seconds
    got = analytic_costs(a, cpu.with_overrides(matmul_overhead_s=1e-5)).seconds
    assert got[0] == pytest.approx(base[0] + 1e-5) and got[1] == base[1]
    with pytest.raises(ValueError, match="matmul_overhead_s"):
        cpu.with_overrides(matmul_overhead_s=5.0)


# ---- profiles ------------------------------------------------------------------------

DIMS = {"batch": 2, "seq": 16}


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dec") / "tiny.onnx"
    build_decoder(path, layers=2, hidden=64, heads=4)
    return path


def test_profile_model_disable(decoder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "prof.json"
    r = profile_model(decoder, out, dims=DIMS, runs=3, warmup=1, opt_level="disable")
    assert list(tmp_path.iterdir()) == [out]  # ORT's raw trace is gone
    assert json.loads(out.read_text()) == r
    assert r["runs"] == 3 and r["provider"] == "CPUExecutionProvider"
    model = onnx.load(str(decoder))
    names = {n.name for n in model.graph.node}
    assert len(set(r["nodes"]) & names) >= 0.8 * len(names)
    e = r["nodes"]["layers.0.attn.qkv"]
    assert e["op"] == "MatMul" and e["runs"] == 3 and 0 < e["median_s"] < 1
    assert r["nodes_sum_s"] > 0 and r["total_median_s"] > 0

    a = analyse(model, DIMS)
    costs = profile_costs(a, out)
    assert isinstance(costs, NodeCosts) and costs.source == "profile"
    assert len(costs.seconds) == len(a.order) and costs.coverage == 1.0
    pos = [a.node_at(i).name for i in range(len(a.order))].index("layers.0.attn.qkv")
    assert costs.seconds[pos] == e["median_s"]

    # nodes missing from the profile get the analytic estimate (a profile without dims
    # needs them passed)
    data = json.loads(out.read_text())
    del data["nodes"]["layers.0.attn.qkv"]
    out.write_text(json.dumps(data))
    cpu = MACHINES["cpu"]
    costs = profile_costs(a, out, machine=cpu)
    assert costs.coverage < 1.0
    assert costs.seconds[pos] == pytest.approx(analytic_costs(a, cpu, DIMS).seconds[pos])
    assert costs.cumulative()[-1] == pytest.approx(costs.total)
    assert costs.between(pos, pos + 1) == costs.seconds[pos]


def test_profile_model_optimized(decoder: Path, tmp_path: Path):
    out = tmp_path / "prof.json"
    r = profile_model(decoder, out, dims=DIMS, runs=2, warmup=1, opt_level="all")
    a = analyse(onnx.load(str(decoder)), DIMS)
    costs = profile_costs(a, out)
    # fused nodes are mapped by name prefix; the total is the profile's
    assert costs.coverage > 0.6
    assert costs.total == pytest.approx(r["nodes_sum_s"])
    assert np.all(costs.seconds >= 0)


def test_profile_mapping_rules(tmp_path: Path):
    m = parse("""
    g (float[4, 8] x, float[8, 8] w) => (float[4, 8] y) {
      h = MatMul(x, w)
      s = Mul(h, h)
      y = Relu(s)
    }""")
    for node, name in zip(m.graph.node, ["mm", "", "relu"], strict=True):
        node.name = name
    a = analyse(m)
    prof = {"opt_level": "all", "model_nodes": 3, "nodes": {
        "mm/MatMulScaleFusion/": {"op": "FusedMatMul", "median_s": 3e-6, "index": 5},
        "Mul_1": {"op": "Mul", "median_s": 1e-6, "index": 1},
        "Gelu_7": {"op": "Gelu", "median_s": 2e-6, "index": 7},
        "MemcpyToHost": {"op": "MemcpyToHost", "median_s": 9.0},
    }}
    p = tmp_path / "p.json"
    p.write_text(json.dumps(prof))
    c = profile_costs(a, p)
    # fusion prefix -> mm, ORT name of the unnamed node by index -> Mul; Gelu_7 matches
    # nothing: its time goes to the unmatched relu; Memcpy is not compute
    assert list(c.seconds) == pytest.approx([3e-6, 1e-6, 2e-6])
    assert c.coverage == pytest.approx(2 / 3)
    del prof["nodes"]["Gelu_7"]
    p.write_text(json.dumps(prof))
    assert profile_costs(a, p).seconds[2] == 0.0  # optimized away: fused or folded
    prof["opt_level"] = "disable"
    p.write_text(json.dumps(prof))
    assert profile_costs(a, p).seconds[2] > 0  # not profiled: analytic


def test_a_profile_of_another_model_is_said(decoder: Path, tmp_path: Path):
    """A profile that times under half of the model's nodes (another model's) is said in
    the plan's output, with the model it was taken of; the model's own profile is not."""
    from graphs import save, text_model

    from ho_onnx.rewrite.pipeline import plan_model
    from ho_onnx.schedule.options import OffloadOptions

    out = tmp_path / "prof.json"
    profile_model(decoder, out, dims=DIMS, runs=1, warmup=0, opt_level="disable")
    other = save(text_model("g (float[4, 64] x) => (float[4, 64] y) "
                            "{ h = MatMul(x, W1) \n y = MatMul(h, W2) }",
                            W1=(64, 64), W2=(64, 64)), tmp_path / "other.onnx")
    for model, dims, said_low, budget in ((other, {}, True, 40 << 10),
                                          (decoder, DIMS, False, 1 << 30)):
        said: list[str] = []
        plan_model(model, OffloadOptions(budget=budget, min_bytes=0), dims=dims,
                   log=said.append, costs=CostSource(profile=out))
        assert f"costs: profile prof.json ({'0' if said_low else '100'}% of nodes by name); " \
            "transfers on cpu; copies inside the Waits and Stores (the CPU engine)" in said, said
        low = [s for s in said if s.startswith("note: the profile times ")]
        assert bool(low) == said_low, said
    c = profile_costs(analyse(onnx.load(str(other))), out)
    assert c.notes[0] == (f"the profile times 0% of this model's 2 nodes and was taken of a "
                          f"model of {len(onnx.load(str(decoder)).graph.node)} nodes "
                          f"({str(decoder)!r}): is it this model's? (`ho-onnx profile MODEL "
                          "--out FILE` makes one)")


def test_an_optimized_model_is_profiled_and_its_cache_ops_are_not_compute(decoder: Path,
                                                                          tmp_path: Path):
    """``profile`` runs an optimized model with the library (ORT refused its ops: found by
    hand); planning from such a profile leaves the cache operators' times out of compute
    (a Wait's time is a stall, not a node's work)."""
    from ho_onnx.rewrite.pipeline import optimize
    from ho_onnx.schedule.options import OffloadOptions

    out = tmp_path / "o.onnx"
    optimize(decoder, out, OffloadOptions(min_bytes=0))
    prof = profile_model(out, tmp_path / "p.json", dims=DIMS, runs=2, warmup=1)
    ops = {e["op"] for e in prof["nodes"].values()}
    assert prof["cache_ops"] is True and {"Prefetch", "Wait"} <= ops, ops
    cache_s = sum(e["median_s"] for e in prof["nodes"].values()
                  if e["op"] in ("Prefetch", "Wait", "Store", "Detach"))
    a = analyse(onnx.load(str(decoder)), DIMS)
    assert profile_costs(a, prof).total == pytest.approx(prof["nodes_sum_s"] - cache_s)
    assert profile_costs(a, {**prof, "cache_ops": False}).total == \
        pytest.approx(prof["nodes_sum_s"])
    assert profile_model(decoder, None, dims=DIMS, runs=1, warmup=0)["cache_ops"] is False


def test_launch_time_gpu_profile_scales_analytic_times_to_its_run_time(tmp_path: Path):
    """A CUDA profile of ORT's release build times launches, not kernels: its node times are
    ignored, the analytic estimates are scaled so they add up to its run time, and the cost
    model then times loads as the CUDA engine issues them (so does one with device kernels,
    whose node times are kept). A CPU profile keeps its node times and the default
    timing."""
    from ho_onnx.cost.source import CostSource

    m = parse("""
    g (float[64, 256] x, float[256, 256] w) => (float[64, 256] y) {
      h = MatMul(x, w)
      y = Relu(h)
    }""")
    for node, name in zip(m.graph.node, ["mm", "relu"], strict=True):
        node.name = name
    a = analyse(m)
    est = analytic_costs(a, MACHINES["h100"]).seconds
    prof = {"provider": "CUDAExecutionProvider", "time_basis": "host", "opt_level": "all",
            "model_nodes": 2, "total_median_s": 3e-3, "nodes": {
                "mm": {"op": "MatMul", "median_s": 5e-6, "index": 0},
                "relu": {"op": "Relu", "median_s": 5e-6, "index": 1}}}
    p = tmp_path / "cuda.json"
    p.write_text(json.dumps(prof))
    c = profile_costs(a, p, MACHINES["h100"])
    assert c.seconds.sum() == pytest.approx(3e-3)
    assert list(c.seconds / c.seconds.sum()) == pytest.approx(list(est / est.sum()))
    assert "launch times" in c.notes[0]
    cm = CostSource("h100", p).cost_model(a, {})
    assert cm.host_ahead and cm.compute_s.sum() == pytest.approx(3e-3)
    assert "scaled to the run time" in cm.description
    for change, gpu in (({"time_basis": "device"}, True),
                        ({"provider": "CPUExecutionProvider"}, False)):
        q = tmp_path / "other.json"
        q.write_text(json.dumps({**prof, **change}))
        other = CostSource("h100", q).cost_model(a, {})  # node times as profiled
        assert other.host_ahead == gpu and list(other.compute_s) == pytest.approx([5e-6, 5e-6])
    assert not CostSource("h100").cost_model(a, {}).host_ahead
    q = tmp_path / "no_run_time.json"  # nothing measured: analytic compute, default timing
    q.write_text(json.dumps({**prof, "total_median_s": 0}))
    bare = CostSource("h100", q).cost_model(a, {})
    assert not bare.host_ahead and list(bare.compute_s) == pytest.approx(list(est))
    with pytest.raises(ProfileError, match="GPU provider but the machine is 'cpu'"):
        CostSource("cpu", p).cost_model(a, {})  # a GPU's profile with a CPU's copy rates


def test_profile_errors(tmp_path: Path):
    a = analyse(matmul_model(2, 2, 2))
    with pytest.raises(ProfileError, match="does not exist"):
        profile_costs(a, tmp_path / "none.json")
    p = tmp_path / "p.json"
    for text in ("{oops", "[" * 200_000):
        p.write_text(text)
        with pytest.raises(ProfileError, match="not readable JSON"):
            profile_costs(a, p)
    p.write_text(json.dumps([{"cat": "Node"}]))
    with pytest.raises(ProfileError, match="raw trace"):
        profile_costs(a, p)
    p.write_text(json.dumps({"model": "x"}))
    with pytest.raises(ProfileError, match="'nodes'"):
        profile_costs(a, p)
    p.write_text(json.dumps({"nodes": {"n": {"op": "MatMul"}}}))
    with pytest.raises(ProfileError, match="'n' has no valid 'median_s'"):
        profile_costs(a, p)


@pytest.mark.parametrize("text, words", [
    ('{"nodes": {"n": {"median_s": NaN}}}', "'n' has no valid 'median_s'"),
    ('{"nodes": {"n": {"median_s": Infinity}}}', "'n' has no valid 'median_s'"),
    ('{"nodes": {"n": {"median_s": 1e308}}}', "'n' has no valid 'median_s'"),
    ('{"nodes": {"n": {"median_s": true}}}', "'n' has no valid 'median_s'"),
    ('{"nodes": {}, "total_median_s": "abc"}', "'total_median_s'"),
    ('{"nodes": {}, "total_median_s": NaN}', "'total_median_s'"),
    ('{"nodes": {}, "total_median_s": [1]}', "'total_median_s'"),
    ('{"nodes": {}, "dims": "ab"}', "'dims'"),
    ('{"nodes": {}, "dims": {"batch": "x"}}', "'dims'"),
    ('{"nodes": {}, "dims": {"batch": -1}}', "'dims'"),
    ('{"nodes": {}, "dims": {"batch": true}}', "'dims'"),
])
def test_hostile_profile_values_are_one_clear_error(tmp_path, text, words):
    """Found by hand: NaN, infinite or huge node times made plans of NaN times without a
    word; a string run time or dims were unexpected ValueErrors."""
    p = tmp_path / "p.json"
    p.write_text(text)
    with pytest.raises(ProfileError, match=words):
        profile_costs(analyse(matmul_model(2, 2, 2)), p)


def test_parse_trace_runs_and_nesting():
    def node(name: str, ts: int, dur: int, tid: int = 1) -> dict:
        return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur, "tid": tid,
                "args": {"op_name": "Op", "node_index": "0", "provider": "CPU"}}

    def run(ts: int, dur: int) -> dict:
        return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur}

    events = [node("a", 1, 50), run(0, 100),  # warm-up
              node("a", 101, 10), node("loop", 120, 30), node("body", 125, 5), run(100, 100),
              node("a", 201, 30), node("loop", 240, 20), run(200, 100),
              node("a", 301, 20), run(300, 100)]
    nodes, totals, basis = parse_trace(events, warmup=1)
    assert basis == "host" and totals == pytest.approx([1e-4] * 3)
    assert nodes["a"]["median_s"] == pytest.approx(20e-6) and nodes["a"]["runs"] == 3
    assert nodes["loop"]["runs"] == 2 and "body" not in nodes  # nested in loop
    assert nodes["a"]["index"] == 0
    # device kernels replace host launch times
    events.insert(3, {"cat": "Kernel", "name": "k", "ts": 105, "dur": 70, "args": {}})
    nodes, _, basis = parse_trace(events, warmup=1)
    assert basis == "device"
    assert nodes["a"]["median_s"] == pytest.approx(30e-6)  # runs: 70, 30, 20
    with pytest.raises(Exception, match="model_run"):
        parse_trace([node("a", 1, 5)])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0, 1e308])
def test_a_cost_model_refuses_times_no_plan_can_use(bad):
    """The planner's one entry for compute times: NaN, infinite, negative, or times whose
    sum leaves floating point never reach a simulation."""
    times = np.array([1e-3, bad, bad])
    with pytest.raises(ValueError, match="compute times must be finite"):
        CostModel(times, MACHINES["cpu"].transfer_time, "test")
    assert CostModel(np.array([0.0, 1e-3]), MACHINES["cpu"].transfer_time).compute_s.sum() > 0


def test_analytic_costs_of_shapes_no_tensor_has_are_unknown_not_an_overflow():
    """Found by the optimize fuzzer (seed 148): a MatMul input of 100 dims of 2**62 made its
    FLOPs an integer past what a float holds ("unexpected OverflowError"). A shape with more
    elements than any tensor holds (or a negative dim) is unknown: the node costs its
    launch, like any node of unknown shape."""
    m = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (string[2, 16] x, float[16, 16] w) => (float[2, 16] y) {
      y = MatMul(x, w)
    }
    """)  # (a string input, as the fuzzer's: a float one that big is refused by its size)
    machine = MACHINES["cpu"]
    fine = analytic_costs(analyse(m), machine).seconds[0]
    for dims in ([2**62] * 100, [-2, 16], [2**40, 2**40]):
        x = m.graph.input[0].type.tensor_type.shape
        del x.dim[:]
        for d in dims:
            x.dim.add().dim_value = d
        secs = analytic_costs(analyse(m), machine).seconds[0]
        assert np.isfinite(secs) and secs <= fine, (dims, secs)


def test_a_cost_source_reads_its_files_once(tmp_path: Path, monkeypatch):
    """The CLI checks the machine and profile files before the model (``check``) and plans
    with them after: each file is read once (was twice, a big model's profile too), and a
    bad one fails at ``check``."""
    from ho_onnx.cost import source
    from ho_onnx.cost.source import CostSource

    m = analyse(matmul_model(2, 2, 2))
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"nodes": {"mm": {"median_s": 1e-3}}}))
    reads: list[str] = []
    real_machine, real_profile = source.load_machine, source.read_profile
    monkeypatch.setattr(source, "load_machine", lambda s: reads.append("m") or real_machine(s))
    monkeypatch.setattr(source, "read_profile", lambda s: reads.append("p") or real_profile(s))
    costs = CostSource("cpu", p)
    costs.check()
    a = costs.cost_model(m, {})
    b = costs.cost_model(m, {})
    assert reads == ["m", "p"] and list(a.compute_s) == list(b.compute_s)
    assert list(a.compute_s) == list(CostSource("cpu", p).cost_model(m, {}).compute_s)
    p.write_text("{oops")
    with pytest.raises(ProfileError, match="not readable JSON"):
        CostSource("cpu", p).check()
