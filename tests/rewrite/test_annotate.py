"""The annotate step (rewrite.annotate, AnnotatePass): the decision recorded in the model's
``metadata_props`` (what ``ho-onnx inspect`` shows as the recorded plan), with the graph
itself untouched (the annotated model runs exactly as before in ORT)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from graphs import chain_model, save

import ho_onnx
from ho_onnx import contract
from ho_onnx.rewrite.annotate import annotate, plan_metadata
from ho_onnx.rewrite.passes import DECISION, AnalysePass, AnnotatePass, DecidePass
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.schedule.policy import ExplicitPolicy

ALL = ExplicitPolicy(OffloadOptions(min_bytes=0, min_gap=1, prefetch_distance=1))
P = contract.META_PREFIX


def test_annotate_sets_prefixed_entries_and_keeps_the_models_own():
    model = ir.from_proto(chain_model())
    model.metadata_props.update({"author": "me", P + "policy": "stale"})
    annotate(model, {"policy": "budget", "offloaded_weights": 3})  # type: ignore[dict-item]
    assert dict(model.metadata_props) == {"author": "me", P + "policy": "budget",
                                          P + "offloaded_weights": "3"}


def test_plan_metadata_is_the_deciders_entries_the_version_and_sorted_dims():
    model = ir.from_proto(chain_model())
    AnalysePass({"N": 4})(model)
    DecidePass(ALL, {"N": 4})(model)
    decision = model.meta[DECISION]
    meta = plan_metadata(decision, {"seq": 8, "N": 4})
    assert meta == decision.metadata() | {"version": ho_onnx.__version__, "dims": "N=4,seq=8"}
    assert meta["offloaded_weights"] == "2" and meta["policy"] == decision.choice.decided_by


def test_annotate_pass_changes_only_metadata_and_runs_exactly_as_before(tmp_path):
    import onnxruntime as ort

    src = save(chain_model(), tmp_path / "m.onnx")
    model = ir.load(src)
    before = ir.to_proto(model)
    ir.passes.Sequential(AnalysePass({"N": 4}), DecidePass(ALL, {"N": 4}),
                         AnnotatePass({"N": 4}))(model)
    after = ir.to_proto(model)
    recorded = {p.key: p.value for p in after.metadata_props}
    assert recorded[P + "dims"] == "N=4" and recorded[P + "offloaded_weights"] == "2"
    del after.metadata_props[:]
    assert after.SerializeToString() == before.SerializeToString()  # nothing else changed

    out = tmp_path / "annotated.onnx"
    onnx.save(ir.to_proto(model), str(out))
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    run = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x})
           for p in (src, out)]
    np.testing.assert_array_equal(run[0][0], run[1][0])  # bit-exact: the same graph
