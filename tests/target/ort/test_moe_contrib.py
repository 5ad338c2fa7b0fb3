"""Routed transfers of ORT's MoE/QMoE contrib ops (issue 37, item 2): a stacked [E, ...]
expert tensor moves only the slices of the experts the op selects (csrc/routing.cc, the
op's own rule). Checked against the unmodified model (bit for bit: the same kernels read the
same bytes) and against the router's own output (``router_probs`` as an extra output of a
copy, the selection recomputed in numpy: ``models.moe_contrib.select``), never only the
library's counters. The fault hook ``poison`` fills every Prefetch output with 0xFF (NaN)
first, so a slice the op read but the library did not move would show."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import native_util
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ho_onnx import InferenceSession, contract, counters, reset_counters
from ho_onnx.report.inspect import summarize
from ho_onnx.rewrite.pipeline import optimize, plan_model
from ho_onnx.schedule.options import OffloadOptions
from models.moe_contrib import build_contrib_moe, greedy, router_outputs, select

E, K, HIDDEN = 8, 2, 32  # models.moe_contrib's defaults (SMALL of models.moe_export)
ALL = OffloadOptions(min_bytes=0, activations=False)  # every weight offloaded
RANGES = {"seq": (1, 64)}


def _so() -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    return so


@pytest.fixture(scope="module", params=[False, True], ids=["MoE", "QMoE"])
def built(request, tmp_path_factory) -> dict[str, Any]:
    """The decoder (QMoE: 8-bit experts), a copy with the routers as outputs, and the model
    optimized with every weight offloaded."""
    root = tmp_path_factory.mktemp("qmoe" if request.param else "moe")
    src = build_contrib_moe(root / "src.onnx", quant=request.param)
    routers = router_outputs(src, root / "probe.onnx")
    out = root / "ho" / "model.onnx"
    out.parent.mkdir()
    r = optimize(src, out, ALL, {}, dim_ranges=RANGES)
    return {"quant": request.param, "src": src, "probe": root / "probe.onnx",
            "routers": routers, "out": out, "choice": r.choice}


def _feeds(seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, 128, (1, seq)),
            "past_sum": rng.normal(0, 0.1, (1, 1, HIDDEN)).astype(np.float32)}


def _selected_bytes(choice: Any, routers: list[str], chosen: list[set[int]]) -> int:
    """What a step must move: each offloaded weight no router decides (per data reader), and
    of each routed stacked tensor the slices of the experts its op selected."""
    total = 0
    for w in choice.weights:
        for k, _ in enumerate(w.consumers):
            if w.routes and w.routes[k]:
                total += w.nbytes // E * len(chosen[routers.index(w.gates[k])])
            else:
                total += w.nbytes
    return total


def test_rewrite_routes_every_stacked_tensor(built):
    """Each stacked expert tensor (fc1/fc2, QMoE's scales too) is reloaded by a Prefetch
    gated by its op's router input, with the op's rule and k; ``inspect`` says so."""
    model = onnx.load(str(built["out"]), load_external_data=False)
    rule = contract.ROUTE_TOPK if built["quant"] else contract.ROUTE_SOFTMAX
    routed = {}
    for n in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type == contract.PREFETCH and contract.ATTR_ROUTE in attrs:
            routed[attrs["name"].decode()] = (n.input[1], attrs[contract.ATTR_ROUTE].decode(),
                                              attrs[contract.ATTR_ROUTE_K])
    want = {f"layers.{i}.experts.{w}": (f"layers.{i}.router_probs", rule, K)
            for i in range(2) for w in ("fc1", "fc2")
            + (("fc1_scales", "fc2_scales") if built["quant"] else ())}
    assert routed == want
    shown = {t.tensor: t.routed for t in summarize(built["out"]).transfers}  # (inspect)
    assert {n: r for n, r in shown.items() if r} == {n: f"{rule} top-{K} of {E}" for n in want}


@pytest.mark.parametrize("seq", [16, 1], ids=["prefill", "decode"])
def test_bit_exact_and_bytes_of_the_selected_experts(built, seq):
    """Prefill (16 tokens) and decode (1): outputs bit-exact with every Prefetch output
    poisoned; the bytes moved are the selected experts' slices (recomputed from the router's
    own output) plus the weights no router decides, and the rest is skipped."""
    ref = ort.InferenceSession(str(built["probe"]), _so(), providers=["CPUExecutionProvider"])
    ho = InferenceSession(built["out"], sess_options=_so())
    feeds = _feeds(seq)
    want = ref.run(None, feeds)
    try:
        native_util.testing_ops().set_debug(poison=True)
        reset_counters()
        got = ho.run(None, feeds)
        c = counters()
    finally:
        native_util.testing_ops().set_debug()
    for a, b in zip(got, want[:2], strict=True):
        np.testing.assert_array_equal(a, b)
    chosen = [select(r, K, softmax=not built["quant"]) for r in want[2:]]
    if seq == 1:
        assert all(len(s) == K for s in chosen)
    assert c["bytes_loaded"] == _selected_bytes(built["choice"], built["routers"], chosen)
    assert c["bytes_gated"] == sum(
        w.nbytes // E * (E - len(chosen[built["routers"].index(w.gates[0])]))
        for w in built["choice"].weights if w.routes)


def test_disk_tier_reads_only_the_selected_slices(built, tmp_path):
    """Every weight in the disk tier (read from the data file at each use): only the selected
    experts' slices are read, outputs bit-exact at prefill and decode."""
    out = tmp_path / "model.onnx"
    r = optimize(built["src"], out, OffloadOptions(min_bytes=0, activations=False,
                                                   weight_tier="disk"), {}, dim_ranges=RANGES)
    assert any(w.routes for w in r.choice.weights)
    ref = ort.InferenceSession(str(built["probe"]), _so(), providers=["CPUExecutionProvider"])
    ho = InferenceSession(out, sess_options=_so())
    for seq in (16, 1):
        feeds = _feeds(seq, seed=seq)
        want = ref.run(None, feeds)
        reset_counters()
        got = ho.run(None, feeds)
        c = counters()
        for a, b in zip(got, want[:2], strict=True):
            np.testing.assert_array_equal(a, b)
        chosen = [select(x, K, softmax=not built["quant"]) for x in want[2:]]
        # (the embedding's rows, which its GatherRows reads from the file, aside)
        assert c["bytes_read_disk"] - c["bytes_gathered"] == c["bytes_loaded"] == \
            _selected_bytes(r.choice, built["routers"], chosen)


def test_greedy_tokens_identical(built):
    """A prompt at once, then one token per call: the same greedy tokens."""
    ref = ort.InferenceSession(str(built["src"]), _so(), providers=["CPUExecutionProvider"])
    ho = InferenceSession(built["out"], sess_options=_so())
    prompt = _feeds(12, seed=3)["input_ids"][0].tolist()
    assert greedy(ho, prompt, 10, HIDDEN) == greedy(ref, prompt, 10, HIDDEN)


def test_budget_holds_and_costs_the_expected_share(built):
    """The planner at a budget under the resident peak: its peak within it, the routed
    tensors costed at 1 - (1 - k/E)^T of their bytes at decode, bit-exact."""
    peak = plan_model(built["src"], OffloadOptions(budget=1 << 40), {}, dim_ranges=RANGES)[2]
    budget = peak.baseline.peak_bytes * 3 // 4
    opts = OffloadOptions(min_bytes=0, activations=False, budget=budget)
    out = built["out"].parent.parent / "budget" / "model.onnx"
    out.parent.mkdir(exist_ok=True)
    r = optimize(built["src"], out, opts, {}, dim_ranges=RANGES)
    assert r.plan.planned.peak_bytes <= budget
    routed = [w for w in r.choice.weights if w.routes]
    assert routed
    assert all(w.fraction == pytest.approx(1 - (1 - K / E) ** 64) for w in routed)
    ref = ort.InferenceSession(str(built["src"]), _so(), providers=["CPUExecutionProvider"])
    ho = InferenceSession(out, sess_options=_so())
    for seq in (9, 1):
        for a, b in zip(ho.run(None, _feeds(seq)), ref.run(None, _feeds(seq)), strict=True):
            np.testing.assert_array_equal(a, b)


def test_non_finite_router_matches_the_op(built):
    """A NaN (and an infinity) reaching the router: the kernels' choice there is their
    sort's accident, so every expert moves; the outputs equal the op's own."""
    ref = ort.InferenceSession(str(built["src"]), _so(), providers=["CPUExecutionProvider"])
    ho = InferenceSession(built["out"], sess_options=_so())
    for bad in (np.nan, np.inf):
        feeds = _feeds(4)
        feeds["past_sum"][0, 0, 3] = bad
        want = ref.run(None, feeds)
        reset_counters()
        got = ho.run(None, feeds)
        assert counters()["bytes_gated"] == 0
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)


def _router_input_model(path: Path, quant: bool, dtype: type = np.float32) -> Path:
    """One MoE/QMoE node (its activations and router of ``dtype``) whose router is a graph
    input ``r`` [N, E] (ties, hostile values fed directly)."""
    rng = np.random.default_rng(1)
    t = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    fc1 = rng.normal(0, 0.1, (E, 2 * 16, HIDDEN)).astype(dtype)
    fc2 = rng.normal(0, 0.1, (E, HIDDEN, 16)).astype(dtype)
    inits = [numpy_helper.from_array(fc1, "fc1"), numpy_helper.from_array(fc2, "fc2")]
    ins = ["x", "r", "fc1", "", "fc2"]
    attrs = {"k": K, "activation_type": "swiglu", "swiglu_fusion": 1}
    if quant:  # (any 8-bit codes: the test compares with the op itself)
        inits = [numpy_helper.from_array(rng.integers(0, 255, (E, 32, HIDDEN), np.uint8), "fc1"),
                 numpy_helper.from_array(np.full((E, 32), 0.01, dtype), "s1"),
                 numpy_helper.from_array(rng.integers(0, 255, (E, HIDDEN, 16), np.uint8), "fc2"),
                 numpy_helper.from_array(np.full((E, HIDDEN), 0.01, dtype), "s2")]
        ins, attrs = ["x", "r", "fc1", "s1", "", "fc2", "s2"], attrs | {"expert_weight_bits": 8}
    node = helper.make_node("QMoE" if quant else "MoE", ins, ["y"], domain="com.microsoft",
                            **attrs)
    graph = helper.make_graph(
        [node], "moe", [helper.make_tensor_value_info("x", t, ["N", HIDDEN]),
                        helper.make_tensor_value_info("r", t, ["N", E])],
        [helper.make_tensor_value_info("y", t, ["N", HIDDEN])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, path, save_as_external_data=True, size_threshold=0,
              location=path.name + ".data")
    out = path.parent / "ho" / "model.onnx"
    out.parent.mkdir()
    optimize(path, out, ALL, {}, dim_ranges={"N": (1, 16)})
    return out


def _poisoned(session: Any, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, int]:
    """(output, bytes loaded) of a run whose Prefetch outputs start as 0xFF (NaN)."""
    try:
        native_util.testing_ops().set_debug(poison=True)
        reset_counters()
        got = session.run(None, feeds)[0]
        return got, counters()["bytes_loaded"]
    finally:
        native_util.testing_ops().set_debug()


ROWS = {"ties": np.full((4, E), 3.0),
        "pairs": np.tile(np.array([0, 5, 5, 1, 5, 0, 2, 5]), (4, 1)),
        "gaps": np.tile(np.array([0, 100, -200, -300, 90, 1, 2, 3]), (4, 1)),
        "nan": np.where(np.eye(4, E, dtype=bool), np.nan, 1.0)}


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float", "float16"])
@pytest.mark.parametrize("quant", [False, True], ids=["MoE", "QMoE"])
def test_ties_and_hostile_router_values(tmp_path, quant, dtype):
    """Rows of equal values (the op's partial sort gives a tie to the larger index), huge
    gaps (probabilities that underflow to 0), NaN rows; float and float16 routers:
    bit-exact with poisoned outputs and exactly the selected slices moved (NaN: all)."""
    src = tmp_path / "src.onnx"
    ho = InferenceSession(_router_input_model(src, quant, dtype), sess_options=_so())
    ref = ort.InferenceSession(str(src), _so(), providers=["CPUExecutionProvider"])
    stacked = sum(len(t.raw_data) for t in onnx.load(str(src)).graph.initializer)
    x = np.random.default_rng(2).normal(0, 1, (4, HIDDEN)).astype(dtype)
    for name, r in ROWS.items():
        feeds = {"x": x, "r": r.astype(dtype)}
        got, moved = _poisoned(ho, feeds)
        np.testing.assert_array_equal(got, ref.run(None, feeds)[0], err_msg=name)
        n = E if name == "nan" else len(select(r.astype(dtype), K, softmax=not quant))
        assert moved == stacked // E * n, name


def test_fewer_experts_moved_than_the_op_reads_would_show(tmp_path):
    """The check above can fail: the same model with route_k 1 (the op selects 2) moves too
    few slices, and the op reads poison."""
    src = tmp_path / "src.onnx"
    out = _router_input_model(src, False)
    model = onnx.load(str(out), load_external_data=False)
    for n in model.graph.node:
        for a in n.attribute:
            if a.name == contract.ATTR_ROUTE_K:
                a.i = 1
    onnx.save(model, out.parent / "k1.onnx")
    ho = InferenceSession(out.parent / "k1.onnx", sess_options=_so())
    feeds = {"x": np.ones((1, HIDDEN), np.float32), "r": ROWS["gaps"][:1].astype(np.float32)}
    got, _ = _poisoned(ho, feeds)
    assert np.isnan(got).any()


def test_router_of_another_shape_is_refused(tmp_path):
    """A router of another width or rank (the declared shape loosened, so that it reaches
    the kernels) is refused by the Prefetch with an error naming both, never read out of
    bounds."""
    out = _router_input_model(tmp_path / "src.onnx", False)
    model = onnx.load(str(out), load_external_data=False)
    r_in = next(i for i in model.graph.input if i.name == "r")
    r_in.type.tensor_type.shape.ClearField("dim")
    onnx.save(model, out.parent / "loose.onnx")
    ho = InferenceSession(out.parent / "loose.onnx", sess_options=_so())
    x = np.ones((4, HIDDEN), np.float32)
    for bad, dims in ((np.zeros((4, E + 1)), "4, 9"), (np.zeros((4, E, 1)), "4, 8, 1"),
                      (np.zeros(E), "8")):
        with pytest.raises(Exception, match=rf"router input has shape \[{dims}\] but the "
                                            rf"weight stacks {E} experts"):
            ho.run(None, {"x": x, "r": bad.astype(np.float32)})
