"""Routed transfers (issue 37, item 2): an expert's weights move only when the router sent
it a token. Each reload of an expert weight is gated by the NonZero that selects the
expert's tokens (``graph.moe.empty_gate``): an empty gate skips the copy. Checked against
the router's own output (the TopK indices, a graph output of the test model, or of a copy of
a real export), never only the library's counters."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from ho_onnx import InferenceSession, contract, counters, reset_counters
from ho_onnx.graph.analyse import analyse
from ho_onnx.graph.moe import empty_gate, find_experts, gate_column
from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.options import OffloadOptions
from tests.graphs import MOE_E as E
from tests.graphs import MOE_H as H
from tests.graphs import MOE_W as W
from tests.graphs import moe_model as _model

pytestmark = pytest.mark.usefixtures("no_debug_hooks")


def _so(level: str = "ORT_ENABLE_BASIC") -> ort.SessionOptions:
    """Bit-exact comparisons: ORT's basic level (the cache ops would otherwise keep some of
    its fusions from the rewritten graph) and no pre-packing, as ``verify`` runs; ``verify``'s
    reasoned exception (a fusion that needs an offloaded constant) compares with ORT's
    optimizations off."""
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    so.add_session_config_entry("session.disable_prepacking", "1")
    return so



def test_the_gate_of_an_expert_is_the_nonzero_that_selects_its_tokens(tmp_path):
    a = analyse(onnx.load(_model(tmp_path), load_external_data=False), {"N": 2})
    (layer,) = find_experts(a)
    assert len(layer.experts) == E and layer.top_k == 1
    for e in range(E):
        for w in ("G", "U", "D"):
            (reader,) = a.tensors[f"{w}{e}"].consumers
            assert empty_gate(a, reader) == f"nz{e}"
        assert gate_column(a, f"nz{e}") == e  # the router column: Equal(idx, c{e})
    # the router's own weight is read by every token: never gated
    assert empty_gate(a, a.tensors["R"].consumers[0]) is None


@pytest.mark.parametrize("budget", [False, True], ids=["explicit", "planner"])
def test_only_the_experts_the_router_chose_move(tmp_path, budget):
    src = _model(tmp_path)
    out = tmp_path / "moe.ho.onnx"
    opts = OffloadOptions(activations=False, min_bytes=0,
                          budget=(E * 3 * H * W * 4) // 2 if budget else None)
    r = optimize(src, out, opts, {"N": 1})
    gated = {w.name: w for w in r.choice.weights if w.gates}
    assert gated and all(w.fraction == pytest.approx(1 / E) for w in gated.values())
    nodes = onnx.load(str(out), load_external_data=False).graph.node
    assert any(a.name == contract.ATTR_GATED for n in nodes if n.op_type == "Prefetch"
               for a in n.attribute)
    ref = ort.InferenceSession(str(src), _so(), providers=["CPUExecutionProvider"])
    sess = InferenceSession(out, sess_options=_so())
    plain = sum(w.nbytes * len(w.consumers) for w in r.choice.weights if not w.gates)
    rng = np.random.default_rng(1)
    for n in (1, 1, 1, 2, 3, 8):
        x = rng.standard_normal((n, H)).astype(np.float32)
        want_y, idx = ref.run(None, {"x": x})
        chosen = set(idx.reshape(-1).tolist())  # the router's own output
        reset_counters()
        got_y, got_idx = sess.run(None, {"x": x})
        c = counters()
        np.testing.assert_array_equal(got_y, want_y)
        np.testing.assert_array_equal(got_idx, idx)
        moved = sum(w.nbytes for name, w in gated.items() if int(name[1:]) in chosen)
        assert c["bytes_loaded"] == plain + moved, (n, chosen)
        assert c["gated_skips"] == sum(len(w.consumers) for name, w in gated.items()
                                       if int(name[1:]) not in chosen)
        assert c["gated_skips"] > 0 or len(chosen) == E


def test_a_closed_gate_with_a_missing_input_is_refused(tmp_path):
    """A gated Prefetch needs its gate: a model whose node lost it fails the run clearly."""
    src = _model(tmp_path)
    out = tmp_path / "moe.ho.onnx"
    optimize(src, out, OffloadOptions(activations=False, min_bytes=0), {"N": 1})
    m = onnx.load(str(out), load_external_data=False)
    pf = next(n for n in m.graph.node if n.op_type == "Prefetch"
              and any(a.name == contract.ATTR_GATED for a in n.attribute))
    wait = next(n for n in m.graph.node if n.op_type == "Wait" and n.input[0] == pf.output[0])
    del pf.input[1:]
    wait.input[1:] = []
    if len(pf.output) > 1:  # (its chain successor still reads ``issued``)
        pass
    onnx.save(m, out)
    with pytest.raises(Exception, match="gated"):
        InferenceSession(out).run(None, {"x": np.ones((1, H), np.float32)})


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_a_moe_export_moves_only_the_routed_experts(tmp_path, moe_export, arch):
    """Real exports (Optimum, text-generation-with-past; Qwen2-MoE with its shared expert,
    Mixtral): greedy tokens identical with every weight offloaded, and at each decode step the
    expert bytes moved equal those of the experts the router chose (its TopK indices, made
    graph outputs of a copy of the unmodified model)."""
    from ho_onnx.target.ort.generate import greedy, kv_layout
    from models.moe_export import SMALL

    src = moe_export(arch)
    out = tmp_path / "opt" / "model.onnx"
    out.parent.mkdir()
    r = optimize(src, out, OffloadOptions(activations=False, min_bytes=0),
                 {"batch_size": 1, "sequence_length": 1, "past_sequence_length": 16})
    prompt = [3, 1, 4, 1, 5]
    want = greedy(ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]),
                  kv_layout(src), prompt, 12)
    assert len(set(want)) > 3, want
    assert greedy(InferenceSession(out), kv_layout(out), prompt, 12) == want
    # the router's own choice at each decode step: its TopK indices as extra outputs
    a = analyse(onnx.load(str(src), load_external_data=False),
                {"batch_size": 1, "sequence_length": 1, "past_sequence_length": 16})
    layers = find_experts(a)
    assert len(layers) == 2
    model = onnx.load(str(src))
    topk = [a.nodes[a.tensors[layer.router_logits].producer] for layer in layers]
    idx_names = []
    for layer in layers:
        node = next(n for n in a.nodes if n.name == layer.node)
        idx_names.append(node.outputs[1].name)
    model.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.INT64, None)
                              for n in idx_names)
    probe = tmp_path / "probe.onnx"
    onnx.save(model, probe, save_as_external_data=True, location="probe.data")
    del topk
    # each expert weight's router and column (where its gate's NonZero reads it from)
    from ho_onnx.schedule.eligibility import Routed

    gated = {w.name: w for w in r.choice.weights if w.gates}
    plain = sum(w.nbytes * len(w.consumers) for w in r.choice.weights if not w.gates)
    routed = Routed.of(a, {"batch_size": 1, "sequence_length": 1, "past_sequence_length": 16})
    router_index = {layer.node: li for li, layer in enumerate(layers)}
    expert_of = {w: (router_index[node], col) for w, (node, col) in routed.expert_of.items()}
    assert set(gated) <= set(expert_of)
    assert {c for _, c in expert_of.values()} == set(range(SMALL["experts"]))
    off = "ORT_DISABLE_ALL"  # (at basic: 4e-8 apart, the fused constant's rounding)
    ref, sess = (ort.InferenceSession(str(probe), _so(off), providers=["CPUExecutionProvider"]),
                 InferenceSession(out, sess_options=_so(off)))
    plain_ref = ort.InferenceSession(str(src), _so(off), providers=["CPUExecutionProvider"])
    lay = kv_layout(src)
    feeds = {"input_ids": np.array([[7]], np.int64)}
    past = 16
    rng = np.random.default_rng(0)
    for p, _ in lay.pairs:
        shape = [1 if k == 0 else past if k == lay.seq_axis else int(d)
                 for k, d in enumerate(lay.past_dims[p])]
        feeds[p] = rng.standard_normal(shape).astype(np.float32)
    feeds["attention_mask"] = np.ones((1, past + 1), np.int64)
    feeds["position_ids"] = np.array([[past]], np.int64)
    for token in (7, 99, 12, 64):
        feeds["input_ids"] = np.array([[token]], np.int64)
        outs = ref.run(None, feeds)
        chosen = {(li, int(e)) for li, v in enumerate(outs[-len(idx_names):])
                  for e in v.reshape(-1)}
        reset_counters()
        got = sess.run(None, feeds)
        # (the probe's extra outputs change ORT's plan: the logits are compared with the
        # unmodified model itself)
        np.testing.assert_array_equal(got[0], plain_ref.run(None, feeds)[0])
        moved = sum(w.nbytes for name, w in gated.items() if expert_of[name] in chosen)
        assert counters()["bytes_loaded"] == plain + moved, token


def test_a_contrib_moe_with_its_experts_offloaded_is_exact(tmp_path):
    """ORT's own MoE op (one stacked tensor per projection, all experts): its weights
    offloaded (whole: a stacked tensor is not routed per expert) give the same outputs."""
    text = f"""
<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
moe (float[N, {H}] x) => (float[N, {H}] y) {{
  logits = MatMul(x, R)
  y = com.microsoft.MoE<k = 2, activation_type = "silu">(x, logits, W1, B1, W2)
}}"""
    model = onnx.parser.parse_model(text)
    rng = np.random.default_rng(0)
    for name, shape in (("R", (H, E)), ("W1", (E, H, W)), ("B1", (E, W)), ("W2", (E, W, H))):
        model.graph.initializer.append(numpy_helper.from_array(
            rng.standard_normal(shape).astype(np.float32), name))
    src, out = tmp_path / "moe.onnx", tmp_path / "moe.ho.onnx"
    onnx.save(model, src, save_as_external_data=True, location="moe.onnx.data",
              size_threshold=0)
    r = optimize(src, out, OffloadOptions(activations=False, min_bytes=0), {"N": 4})
    assert {w.name for w in r.choice.weights} >= {"W1", "W2"}
    assert (layer := find_experts(analyse(model, {"N": 4}))[0]).form == "contrib"
    assert layer.top_k == 2
    ref = ort.InferenceSession(str(src), _so(), providers=["CPUExecutionProvider"])
    sess = InferenceSession(out, sess_options=_so())
    for n in (1, 4, 9):
        x = rng.standard_normal((n, H)).astype(np.float32)
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], ref.run(None, {"x": x})[0])


def test_the_verifier_refuses_a_wait_gated_apart_from_its_prefetch(tmp_path):
    """A closed gate skips the copy; a Wait not gated with its Prefetch would copy what never
    came (or skip what did): the schedule verifier names it."""
    import onnx_ir as ir

    from ho_onnx.errors import ScheduleError
    from ho_onnx.rewrite.invariants import check_schedule

    out = tmp_path / "moe.ho.onnx"
    optimize(_model(tmp_path), out, OffloadOptions(activations=False, min_bytes=0), {"N": 1})
    model = ir.load(out)
    check_schedule(model)  # as written: every routed pair gated together
    wait = next(n for n in model.graph if n.op_type == contract.WAIT
                and contract.ATTR_GATED in n.attributes)
    del wait.attributes[contract.ATTR_GATED]
    with pytest.raises(ScheduleError, match="not gated by the same value"):
        check_schedule(model)
