"""Refinement after the greedy, the exact (CP-SAT) planner and the lower bound of a plan, on
h100-preset bench decoders (models/decoder.py, random weights, fp16)."""

from __future__ import annotations

import pytest

from ho_onnx.cost import analytic_costs, load_machine
from ho_onnx.cost.model import CostModel
from ho_onnx.graph.analyse import analyse
from ho_onnx.graph.load import load_model
from ho_onnx.report.text import plan_to_dict
from ho_onnx.rewrite.annotate import plan_metadata
from ho_onnx.schedule import exact
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.schedule.planner import _Basis, _Context, _space, plan
from ho_onnx.schedule.simulate import simulate
from models.decoder import build_decoder

needs_ortools = pytest.mark.skipif(not exact.available(), reason="ortools (the exact extra) "
                                   "is not installed")


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """A 2-layer hidden-1024 seq-512 fp16 decoder under the h100 preset: at half its peak
    the greedy plan stalls (1.22 ms) where the proven optimum of its space does not."""
    path = tmp_path_factory.mktemp("dec") / "d.onnx"
    build_decoder(path, layers=2, hidden=1024, heads=8, vocab=1024, seq=512, batch=1,
                  dtype="float16", external_data=True)
    a = analyse(load_model(path).model, {})
    m = load_machine("h100")
    costs = CostModel(analytic_costs(a, m, {}).seconds, m.transfer_time)
    return a, costs, simulate(a, None, costs.compute_s, costs.transfer_time, {}), path


def _opts(base, frac: float, **kw) -> OffloadOptions:
    return OffloadOptions(budget=int(base.peak_bytes * frac), arena_refits=0, **kw)


def _resimulated(a, costs, p) -> float:
    sim = simulate(a, p.choice, costs.compute_s, costs.transfer_time, {})
    assert sim.peak_bytes <= p.planned_for
    return sim.total_s


@pytest.mark.parametrize("frac", [0.25, 0.5, 0.75])
def test_refinement_never_worse_than_greedy_and_feasible(decoder, frac):
    a, costs, base, _ = decoder
    off = plan(a, _opts(base, frac, refine_s=0.0), costs, {})
    on = plan(a, _opts(base, frac), costs, {})
    assert off.planned.total_s == pytest.approx(on.greedy_s)  # the same greedy plan
    assert on.planned.total_s <= on.greedy_s
    assert _resimulated(a, costs, on) == pytest.approx(on.planned.total_s)
    assert on.planned.peak_bytes <= on.budget
    # the bound (weak here: no exact planner) is below every plan made
    assert on.bound is not None and on.bound.kind == "weak"
    assert on.bound.seconds <= on.planned.total_s <= on.greedy_s
    assert on.bound.seconds >= float(costs.compute_s.sum()) * (1 - 1e-9) or \
        on.bound.seconds == on.planned.total_s


def test_refinement_fixes_a_provably_suboptimal_greedy(decoder):
    """At 50% the greedy plan stalls; refinement removes most of it, and the exact planner
    proves the rest optimal (bound == its time)."""
    a, costs, base, _ = decoder
    p = plan(a, _opts(base, 0.5), costs, {})
    assert p.refined_s < 0.9 * p.greedy_s
    if not exact.available():
        pytest.skip("ortools (the exact extra) is not installed")
    q = plan(a, _opts(base, 0.5, exact_s=20), costs, {})
    assert "exact: optimal" in q.improved
    assert q.planned.total_s <= q.refined_s <= q.greedy_s
    assert q.bound is not None and q.bound.kind == "exact"
    assert q.bound.seconds <= q.planned.total_s < q.greedy_s * 0.8
    assert q.gap == pytest.approx(0.0, abs=1e-4)  # proven: the bound is its time (rounding)
    assert _resimulated(a, costs, q) == pytest.approx(q.planned.total_s)


@needs_ortools
@pytest.mark.parametrize("frac", [0.25, 0.75])
def test_solver_objective_is_the_simulators_time(decoder, frac):
    """The CP-SAT model's objective for its plan equals the simulation of that plan (up to
    its time unit per step and copy)."""
    a, costs, base, _ = decoder
    opts = _opts(base, frac)
    basis = _Basis.of(a, opts, costs, {})
    greedy = plan(a, replace_refine(opts), costs, {})
    ctx = _Context(a, opts, costs, {}, basis.candidates, basis.by_name, basis.residency,
                   basis.baseline.memory, basis.kv)
    space, seed, _ = _space(ctx, greedy.choice, basis.start)
    got = exact.solve(space, seed, 20)
    assert got.state is not None and got.status == "optimal"
    sim = space.score(got.state)
    assert sim is not None and sim.peak_bytes <= opts.budget
    steps = len(a.order) + len(sim.transfers)
    assert abs(sim.total_s - got.objective_s) <= steps * exact.UNIT
    assert got.bound.seconds <= sim.total_s <= greedy.planned.total_s + 1e-12


def replace_refine(opts: OffloadOptions) -> OffloadOptions:
    from dataclasses import replace
    return replace(opts, refine_s=0.0)


def test_json_and_metadata_carry_the_bound_and_gap(decoder):
    a, costs, base, _ = decoder
    p = plan(a, _opts(base, 0.5), costs, {})
    d = plan_to_dict(p, [n.name or n.op_type for n in map(a.node_at, range(len(a.order)))])
    lb = d["lower_bound"]
    assert lb["time_s"] == p.bound.seconds and lb["kind"] == "weak"
    assert lb["gap"] == pytest.approx(p.planned.total_s / p.bound.seconds - 1)
    assert lb["greedy_time_s"] == p.greedy_s and "refined" in lb["search"]
    meta = plan_metadata(p, {})
    assert float(meta["lower_bound_s"]) == pytest.approx(p.bound.seconds, rel=1e-5)
    assert float(meta["gap"]) == pytest.approx(p.gap, rel=1e-5, abs=1e-9)
    assert meta["lower_bound_kind"] == "weak"
    assert float(meta["greedy_time_s"]) == pytest.approx(p.greedy_s, rel=1e-5)


def test_exact_is_skipped_in_words_above_its_size(decoder):
    a, costs, base, _ = decoder
    p = plan(a, _opts(base, 0.5, exact_s=5, exact_nodes=10), costs, {})
    assert f"{len(a.order)} nodes > exact_nodes 10" in p.improved
    assert p.bound is not None and p.bound.kind == "weak"


def test_the_rewritten_models_metadata_records_bound_and_gap(decoder):
    """Through the passes: the annotated model carries ``ho_onnx.lower_bound_s`` and
    ``ho_onnx.gap`` as the plan computed them."""
    import onnx_ir as ir

    from ho_onnx import contract
    from ho_onnx.rewrite.passes import DECISION, AnalysePass, AnnotatePass, DecidePass
    from ho_onnx.schedule.planner import BudgetPlanner

    _, costs, base, path = decoder
    model = ir.load(path)
    planner = BudgetPlanner(_opts(base, 0.5), costs)
    ir.passes.Sequential(AnalysePass({}), DecidePass(planner, {}), AnnotatePass({}))(model)
    p = model.meta[DECISION]
    meta = dict(model.metadata_props)
    key = contract.META_PREFIX
    assert float(meta[key + "lower_bound_s"]) == pytest.approx(p.bound.seconds, rel=1e-5)
    assert float(meta[key + "gap"]) == pytest.approx(p.gap, rel=1e-5, abs=1e-9)
    assert meta[key + "lower_bound_kind"] == p.bound.kind
    assert float(meta[key + "predicted_time_s"]) >= float(meta[key + "lower_bound_s"])
