"""The rewrite as an onnx_ir pass (rewrite.passes): structure of the result, composition in
a PassManager, and the rewritten model checked numerically in ORT."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import onnx_ir.passes.common
import pytest
from graphs import chain_model, save

from ho_onnx import contract
from ho_onnx.rewrite.passes import OffloadPass
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.schedule.policy import ExplicitPolicy
from ho_onnx.target.ort.runtime import InferenceSession, counters, reset_counters

ALL = ExplicitPolicy(OffloadOptions(min_bytes=0, min_gap=1, prefetch_distance=1))


def _cache_ops(model: ir.Model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph:
        if node.domain == contract.DOMAIN:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def test_pass_is_functional_and_offloads(tmp_path):
    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    model = ir.load(src)
    result = OffloadPass(ALL, {"N": 4})(model)
    assert result.modified and result.model is not model
    assert not _cache_ops(model)  # the input is untouched
    ops = _cache_ops(result.model)
    n_act = ops[contract.STORE]
    assert n_act >= 1 and ops == {contract.PREFETCH: 2 + n_act, contract.WAIT: 2 + n_act,
                                  contract.STORE: n_act, contract.DETACH: n_act}
    assert set(result.model.graph.initializers).isdisjoint({"W1", "W2"})
    assert result.model.metadata_props[contract.META_PREFIX + "offloaded_weights"] == "2"


def test_pass_composes_and_runs_exact_in_ort(tmp_path):
    m = chain_model()
    w1, w2 = (onnx.numpy_helper.to_array(t) for t in m.graph.initializer)
    src = save(m, tmp_path / "m.onnx", external=True)
    manager = ir.passes.PassManager([OffloadPass(ALL, {"N": 4}),
                                     ir.passes.common.RemoveUnusedNodesPass()])
    result = manager(ir.load(src))
    out = tmp_path / "m.ho.onnx"  # beside the input: the data file resolves as before
    onnx.save(ir.to_proto(result.model), str(out))
    onnx.checker.check_model(str(out))
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    reset_counters()
    got = InferenceSession(out).run(None, {"x": x})[0]
    assert counters()["bytes_loaded"] >= 2 * 16 * 16 * 4
    h1 = x @ w1
    want = 1 / (1 + np.exp(-np.maximum(np.maximum(h1, 0) @ w2, 0))) + h1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_pass_without_offloads_changes_nothing(tmp_path):
    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    model = ir.load(src)
    none = ExplicitPolicy(OffloadOptions(weights=False, activations=False))
    result = OffloadPass(none, {"N": 4})(model)
    assert not result.modified and result.model is not model
    assert not _cache_ops(result.model) and len(result.model.graph) == len(model.graph)


def test_a_resident_external_weight_is_checked_in_its_folder(tmp_path, monkeypatch):
    """The pass validates its result in memory: a weight that stays resident in external
    data (the small W1; the large W2 is offloaded) is checked in the model's folder, not in
    the working directory (found: the checker looked there and refused every such model);
    its data file gone or a link is refused by name."""
    rng = np.random.default_rng(0)
    g = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "W1"], ["h"]),
         onnx.helper.make_node("MatMul", ["h", "W2"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 16])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 64])],
        [onnx.numpy_helper.from_array(rng.standard_normal((16, 16), np.float32), "W1"),
         onnx.numpy_helper.from_array(rng.standard_normal((16, 64), np.float32), "W2")])
    src = save(onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 17)]),
               tmp_path / "m.onnx", external=True)
    monkeypatch.chdir(tmp_path.parent)  # (not the model's folder)
    big = ExplicitPolicy(OffloadOptions(activations=False, min_bytes=2048))
    out = OffloadPass(big, {})(ir.load(src)).model
    assert "W1" in out.graph.initializers and "W2" not in out.graph.initializers
    model = ir.load(src)
    (tmp_path / "m.onnx.data").rename(tmp_path / "moved.data")
    (tmp_path / "m.onnx.data").symlink_to(tmp_path / "moved.data")
    with pytest.raises(Exception, match="not a regular file"):
        OffloadPass(big, {})(model)


def test_inline_weights_are_refused_by_the_precondition():
    model = ir.from_proto(chain_model())
    with pytest.raises(ir.passes.PreconditionError, match="'W1' is not in external data"):
        OffloadPass(ExplicitPolicy(OffloadOptions(activations=False, min_bytes=0)),
                    {"N": 4})(model)


def test_the_steps_are_passes_with_one_signature_and_compose(tmp_path):
    """Analyse -> decide -> insert -> annotate -> place: each an in-place onnx_ir pass whose
    result the next reads from ``model.meta``; run by a PassManager, then written like the
    pipeline writes it, and checked in ORT."""
    from ho_onnx.graph.load import load_model
    from ho_onnx.graph.save import save_model
    from ho_onnx.rewrite.passes import OUTPUT_FILES, REWRITTEN, rewrite_passes

    m = chain_model()
    w1, w2 = (onnx.numpy_helper.to_array(t) for t in m.graph.initializer)
    loaded = load_model(save(m, tmp_path / "m.onnx"))
    out = tmp_path / "out" / "m.ho.onnx"
    steps = rewrite_passes(ALL, {"N": 4}, loaded.base_dir, out)
    assert all(isinstance(s, ir.passes.InPlacePass) for s in steps)
    result = ir.passes.PassManager(steps)(loaded.model)
    assert result.model is loaded.model and result.modified
    assert loaded.model.meta[REWRITTEN].cache_nodes == sum(_cache_ops(loaded.model).values())
    save_model(loaded.model.meta[OUTPUT_FILES], loaded, out)
    x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    got = InferenceSession(out).run(None, {"x": x})[0]
    h1 = x @ w1
    want = 1 / (1 + np.exp(-np.maximum(np.maximum(h1, 0) @ w2, 0))) + h1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_one_ir_from_load_to_save(tmp_path):
    """The loaded model is the onnx_ir model alone (issue 35): the tools that read a proto
    get the file as loaded while the graph is unchanged, a serialisation once the insertion
    changed it, and the save stamps the weight Prefetches of the model itself."""
    from ho_onnx.graph.analyse import tool_proto
    from ho_onnx.graph.load import load_model
    from ho_onnx.rewrite.passes import OUTPUT_FILES, analysis_steps, rewrite_steps, run_steps

    loaded = load_model(save(chain_model(), tmp_path / "m.onnx", external=True))
    assert not hasattr(loaded, "proto")
    source = tool_proto(loaded.model)
    run_steps(loaded.model, *analysis_steps(ALL, {"N": 4}))
    assert tool_proto(loaded.model) is source  # (not serialised again to analyse)
    run_steps(loaded.model, *rewrite_steps({"N": 4}, loaded.base_dir, tmp_path / "o.onnx"))
    assert {n.domain for n in tool_proto(loaded.model).graph.node} >= {contract.DOMAIN}
    files = loaded.model.meta[OUTPUT_FILES]
    stamped = [n for nodes in files.stamps.values() for n in nodes]
    assert stamped and files.model is loaded.model
    assert all(isinstance(n, ir.Node) and n.graph is loaded.model.graph for n in stamped)


@pytest.mark.parametrize("step,missing", [("DecidePass", "AnalysePass"),
                                          ("InsertPass", "DecidePass"),
                                          ("GuardPass", "InsertPass"),
                                          ("AnnotatePass", "DecidePass"),
                                          ("PlaceDataPass", "InsertPass"),
                                          ("ValidatePass", "PlaceDataPass")])
def test_a_step_without_its_input_names_the_pass_to_run_first(tmp_path, step, missing):
    from ho_onnx.rewrite.passes import AnalysePass, DecidePass, rewrite_passes

    steps = {type(s).__name__: s for s in rewrite_passes(ALL, {"N": 4}, tmp_path,
                                                          tmp_path / "o.onnx")}
    assert list(steps) == ["CheckOpsPass", "AnalysePass", "SplitWeightsPass", "PlanBranchesPass",
                           "DecidePass", "ReportBranchesPass", "InsertPass", "InsertBranchesPass",
                           "GuardPass", "VerifySchedulePass", "AnnotatePass", "PlaceDataPass",
                           "ValidatePass"]
    model = ir.from_proto(chain_model())
    if missing != "AnalysePass":
        AnalysePass({"N": 4})(model)
    if missing == "InsertPass":
        DecidePass(ALL, {"N": 4})(model)
    with pytest.raises(ir.passes.PreconditionError, match=missing):
        steps[step](model)


def test_analyse_pass_changes_nothing_in_a_sorted_graph_and_sorts_an_unsorted_one():
    from ho_onnx.rewrite.passes import ANALYSIS, AnalysePass

    model = ir.from_proto(chain_model())
    before = [n.op_type for n in model.graph]
    result = AnalysePass({"N": 4})(model)
    assert not result.modified and [n.op_type for n in model.graph] == before
    assert model.meta[ANALYSIS].tensors["h1"].consumers == [1, 5]
    m = chain_model()
    nodes = list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(reversed(nodes))
    unsorted = ir.from_proto(m)
    assert AnalysePass({"N": 4})(unsorted).modified
    assert [n.op_type for n in unsorted.graph] == before


def test_the_offload_pass_fails_with_its_steps_own_error(tmp_path):
    """An unbound dimension fails the pass with the decision step's UnboundDimError (a
    HoOnnxError naming the dim), not onnx_ir's PassError wrapping it (was: "An error
    occurred when running the '<...AnalysePass object at 0x...>' pass")."""
    from ho_onnx.errors import UnboundDimError
    from ho_onnx.rewrite.passes import AnnotatePass, run_steps
    from ho_onnx.rewrite.pipeline import decider_for

    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    planner = decider_for(OffloadOptions(budget=1000, min_bytes=0))
    with pytest.raises(UnboundDimError, match="'N'"):
        OffloadPass(planner)(ir.load(src))
    with pytest.raises(ir.passes.PreconditionError, match="first"):
        run_steps(ir.load(src), AnnotatePass())  # (a precondition stays onnx_ir's own)


def test_offload_pass_names_every_missing_dim_at_once():
    """Issue 35: the dims check lived in the pipeline only, so ``OffloadPass`` users got the
    planner's first failing size instead of one error naming every missing dim. It is now
    part of ``DecidePass``, which both compose."""
    from ho_onnx.cost.source import CostSource
    from ho_onnx.errors import UnboundDimError
    from ho_onnx.schedule.planner import BudgetPlanner
    from models.decoder import build_decoder

    model = ir.from_proto(build_decoder(layers=1, hidden=32, heads=2))
    decider = BudgetPlanner(OffloadOptions(budget=1 << 30), CostSource())
    with pytest.raises(UnboundDimError) as e:
        OffloadPass(decider, {})(model)
    assert "'batch'" in str(e.value) and "'seq'" in str(e.value), str(e.value)


def test_offload_pass_is_the_pipelines_composition(tmp_path):
    """Issue 35: OffloadPass runs the pipeline's own steps. It used to skip the op check (an
    op neither onnx nor ORT knows went through), the types ORT infers for its own ops, and
    the Guards of a range plan."""
    from ho_onnx.errors import UnsupportedModelError

    bad = chain_model()
    bad.graph.node[1].op_type = "NoSuchOp"  # (the Relu: a standard-domain op nobody defines)
    with pytest.raises(UnsupportedModelError, match="NoSuchOp"):
        OffloadPass(ALL, {"N": 4})(ir.load(save(bad, tmp_path / "bad.onnx", external=True)))
    model = ir.load(save(chain_model(), tmp_path / "m.onnx", external=True))
    result = OffloadPass(ALL, {}, ranges={"N": (1, 8)})(model)
    assert _cache_ops(result.model)["Guard"] == 1
    assert result.model.metadata_props["ho_onnx.dim_ranges"] == "N=1..8"


def test_offload_pass_validates_the_result_in_ort(tmp_path):
    """OffloadPass runs the pipeline's ValidatePass too (issue 35: ORT's validation of a model
    with contrib ops ran only when the pipeline saved one): a result ORT refuses (FastGelu
    of int32, which onnx cannot judge) is an error naming ORT's reason, not a model handed
    back."""
    from ho_onnx.errors import OutputPathError

    m = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 18, "com.microsoft" : 1]>
    g (float[N, 16] x) => (int32[N, 16] y) {
      h = MatMul(x, W1)
      c = Cast<to = 6>(h)
      y = com.microsoft.FastGelu(c)
    }""")
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.ones((16, 16), np.float32), "W1"))
    model = ir.load(save(m, tmp_path / "m.onnx", external=True))
    with pytest.raises(OutputPathError, match=r"does not load in onnxruntime: .*FastGelu"):
        OffloadPass(ALL, {"N": 4})(model)
