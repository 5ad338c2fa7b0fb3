"""The budget planner's plans, written and run in ONNX Runtime (CPU) on random DAGs.

Hypothesis draws small DAGs of real ONNX ops (MatMul with random weight shapes so branches
have different widths, Add/Mul/Relu/Sigmoid/Tanh, bias Adds, Concat and Slice), random
per-node compute times, budgets (0.2-1.0 of the baseline peak), bandwidths, weight tiers
and execution orders. Every plan is then:

* within budget (the simulated peak) with a FIFO issue order per channel;
* written (insertion, data placement and save, as ``ho_onnx.rewrite.pipeline`` does) to a
  model that passes the checker and whose cache ops form a valid topological order in which
  every offloaded tensor is back (its Wait ran) before each reader;
* run in ORT next to the original: outputs bit-exact (graph optimizations and pre-packing
  off in both), and the library's counters show exactly the plan's traffic per run
  (``bytes_loaded`` = reloaded bytes, ``bytes_stored`` = stored bytes,
  ``bytes_read_disk`` = the disk-tier reloads, one Prefetch per reload).

An infeasible budget is a valid outcome only when the error's ``min_budget`` is above it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import graphs
import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from ho_onnx import contract
from ho_onnx.cost.model import CostModel
from ho_onnx.graph.analyse import analyse
from ho_onnx.graph.load import load_model
from ho_onnx.graph.save import save_model
from ho_onnx.rewrite.insert import insert_cache_ops
from ho_onnx.rewrite.place import place_weight_data
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.schedule.planner import InfeasibleBudgetError, plan
from ho_onnx.schedule.simulate import simulate
from ho_onnx.target.ort import runtime
from ho_onnx.target.ort.verify import verify

pytest.importorskip("onnxruntime")

ROWS = (8, 16, 32, 64)
WIDTHS = (8, 16, 32, 64, 128, 256, 512, 1024)
MAX_BYTES = 256 << 10  # per tensor
RUNS = 2
EXAMPLES = int(os.environ.get("HO_PLANNER_ORT_EXAMPLES", "60"))  # soak: set it higher


@dataclass
class Case:
    model: onnx.ModelProto
    dims: dict[str, int]
    costs: np.ndarray
    frac: float
    between: float | None  # budget between the smallest feasible and the peak
    bw: float
    latency: float
    weight_tier: str
    min_bytes: int
    min_gap: int
    overlap: tuple[float, float]  # preferred_overlap, max_overlap
    order: str
    external: bool

    def __repr__(self) -> str:  # what hypothesis prints for a failing example
        g = self.model.graph
        nodes = "; ".join(f"{n.output[0]}={n.op_type}({','.join(n.input)})" for n in g.node)
        inits = ", ".join(f"{t.name}{list(t.dims)}" for t in g.initializer)
        return (f"Case(nodes=[{nodes}], inits=[{inits}], outputs={[o.name for o in g.output]}, "
                f"input={helper.printable_value_info(g.input[0])}, dims={self.dims}, "
                f"costs={self.costs.tolist()}, frac={self.frac}, between={self.between}, "
                f"bw={self.bw}, latency={self.latency}, tier={self.weight_tier}, "
                f"min_bytes={self.min_bytes}, min_gap={self.min_gap}, overlap={self.overlap}, "
                f"order={self.order}, external={self.external})")

    def _repr_pretty_(self, p, cycle) -> None:  # hypothesis' printer
        p.text(repr(self))


@st.composite
def ort_dags(draw) -> Case:
    rows = draw(st.sampled_from(ROWS))
    widths = [w for w in WIDTHS if rows * w * 4 <= MAX_BYTES]
    symbolic = draw(st.booleans())
    n_nodes = draw(st.integers(3, 18))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    c0 = draw(st.sampled_from(widths))
    width = {"x": c0}  # tensor -> columns (every activation is [rows, width])
    order = ["x"]
    nodes: list[onnx.NodeProto] = []
    inits: list[TensorProto] = []
    weights: dict[tuple[int, int], list[str]] = {}  # (in, out) -> weight names

    def const(name: str, arr: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(arr, name))
        return name

    def weight(cin: int, cout: int) -> str:
        same = weights.get((cin, cout), [])
        if same and draw(st.booleans()):  # a weight read by several MatMuls
            return draw(st.sampled_from(same))
        name = f"W{len(inits)}"
        arr = (rng.standard_normal((cin, cout)) / math.sqrt(cin)).astype(np.float32)
        weights.setdefault((cin, cout), []).append(const(name, arr))
        return name

    # prefer recent tensors (chains with skips), sometimes far back (long gaps)
    def pick(pool: list[str]) -> str:
        if len(pool) > 1 and draw(st.booleans()):
            return pool[-1 - draw(st.integers(0, min(2, len(pool) - 1)))]
        return draw(st.sampled_from(pool))

    for i in range(n_nodes):
        out = f"t{i}"
        a = pick(order)
        ca = width[a]
        op = draw(st.sampled_from(["MatMul", "MatMul", "Add", "Mul", "Relu", "Sigmoid",
                                   "Tanh", "Bias", "Concat", "Slice"]))
        if op == "MatMul" or (op == "Concat" and 2 * ca not in widths):
            cout = draw(st.sampled_from([w for w in widths if ca * w * 4 <= MAX_BYTES]))
            node = helper.make_node("MatMul", [a, weight(ca, cout)], [out])
            width[out] = cout
        elif op in ("Add", "Mul"):
            same = [t for t in order if width[t] == ca]
            b = draw(st.sampled_from(same))
            node = helper.make_node(op, [a, b], [out])
            width[out] = ca
        elif op == "Bias":
            b = const(f"B{len(inits)}", rng.standard_normal(ca).astype(np.float32))
            node = helper.make_node("Add", [a, b], [out])
            width[out] = ca
        elif op == "Concat":
            same = [t for t in order if width[t] == ca]
            b = draw(st.sampled_from(same))
            node = helper.make_node("Concat", [a, b], [out], axis=1)
            width[out] = 2 * ca
        elif op == "Slice" and ca > widths[0]:
            cout = draw(st.sampled_from([w for w in widths if w < ca]))
            start = draw(st.integers(0, ca - cout))
            s0 = const(f"S{len(inits)}", np.array([start], np.int64))
            s1 = const(f"S{len(inits)}", np.array([start + cout], np.int64))
            ax = const(f"S{len(inits)}", np.array([1], np.int64))
            node = helper.make_node("Slice", [a, s0, s1, ax], [out])
            width[out] = cout
        else:
            node = helper.make_node("Relu" if op == "Slice" else op, [a], [out])
            width[out] = ca
        node.name = f"n{i}.{node.op_type}"
        nodes.append(node)
        order.append(out)
    # Merge the sinks into one small output (MatMul to 8 columns, then Adds): the peak is
    # then inside the graph, where offloading helps, not in outputs held to the end.
    used = {i for n in nodes for i in n.input}
    sinks = [t for t in order[1:] if t not in used]
    merged: list[str] = []
    for s in sinks:
        if width[s] != widths[0]:
            m = f"m{len(merged)}"
            nodes.append(helper.make_node("MatMul", [s, weight(width[s], widths[0])], [m],
                                          name=f"{m}.MatMul"))
            width[m] = widths[0]
            s = m
        if merged:
            y = f"s{len(merged)}"
            nodes.append(helper.make_node("Add", [merged[-1], s], [y], name=f"{y}.Add"))
            width[y] = widths[0]
            s = y
        merged.append(s)
    outputs = [merged[-1]]
    extra = draw(st.sampled_from([None, None, None, *order[1:]]))  # an output read inside
    if extra is not None and extra not in outputs:
        outputs.append(extra)
    n_nodes = len(nodes)
    dim: int | str = "N" if symbolic else rows
    graph = helper.make_graph(
        nodes, "ort_dag",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [dim, c0])],
        [helper.make_tensor_value_info(t, TensorProto.FLOAT, [dim, width[t]]) for t in outputs],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              ir_version=8)
    onnx.checker.check_model(model)
    costs = np.array(draw(st.lists(st.floats(1e-6, 1e-3), min_size=n_nodes,
                                   max_size=n_nodes)))
    return Case(
        model=model, dims={"N": rows} if symbolic else {}, costs=costs,
        frac=draw(st.floats(0.2, 1.0)),
        between=draw(st.sampled_from([None, 0.0, 1.0]) | st.floats(0.0, 1.0)),
        min_gap=draw(st.integers(1, 3)),
        overlap=draw(st.sampled_from([(1.0, 1.0), (1.5, 10.0), (3.0, 4.0)])),
        bw=draw(st.sampled_from([1e8, 1e9, 1e10, 1e11])),
        latency=draw(st.sampled_from([0.0, 1e-6, 2e-5])),
        weight_tier=draw(st.sampled_from(["host", "host", "disk"])),
        min_bytes=draw(st.sampled_from([0, 0, 4096])),
        order=draw(st.sampled_from(["priority", "default"])),
        external=draw(st.booleans()),
    )


def _save(model: onnx.ModelProto, path, external: bool):
    """Save ``model``; ``external``: tensors of 1 KiB or more in ``<name>.data`` (ORT cannot
    infer shapes from an external Slice start, so the small int64 ones stay inline)."""
    return graphs.save(model, path, external, size_threshold=1024)


def _check_written_order(m: onnx.ModelProto) -> None:
    """Topological order; every reader of an offloaded tensor reads a Wait's output, and no
    compute node reads a Prefetch's output (it is not there before the Wait)."""
    seen = {i.name for i in m.graph.input} | {t.name for t in m.graph.initializer}
    pf_out: set[str] = set()
    for node in m.graph.node:
        assert all(i in seen for i in node.input if i), f"{node.name} reads before producer"
        if node.domain == contract.DOMAIN and node.op_type == contract.PREFETCH:
            pf_out.add(node.output[0])
        elif node.domain == contract.DOMAIN and node.op_type == contract.WAIT:
            assert node.input[0] in pf_out, node.name
        elif node.domain != contract.DOMAIN:
            assert not set(node.input) & pf_out, f"{node.name} reads a Prefetch output"
        seen.update(node.output)


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=ort_dags())
def test_planned_model_runs_exact_in_ort(tmp_path_factory, case):
    d = tmp_path_factory.mktemp("ort_dag")
    src = _save(case.model, d / "m.onnx", external=case.external)
    loaded = load_model(src)
    a = analyse(loaded.model, case.dims)

    def tt(nbytes, direction):
        return case.latency + nbytes / case.bw

    base = simulate(a, None, case.costs, tt, case.dims)
    kw = {"min_bytes": case.min_bytes, "min_gap": case.min_gap,
          "weight_tier": case.weight_tier, "preferred_overlap": case.overlap[0],
          "max_overlap": case.overlap[1]}
    lowest = None
    if case.between is None:
        budget = max(1, int(base.peak_bytes * case.frac))
    else:  # somewhere from the smallest feasible budget (inclusive) to the peak
        with pytest.raises(InfeasibleBudgetError) as e:
            plan(a, OffloadOptions(budget=1, **kw), CostModel(case.costs, tt),  # type: ignore[arg-type]
                 case.dims)
        lowest = e.value.min_budget
        assert lowest <= base.peak_bytes
        budget = lowest + int(case.between * (base.peak_bytes - lowest))
    try:
        p = plan(a, OffloadOptions(budget=budget, **kw),  # type: ignore[arg-type]
                 CostModel(case.costs, tt), case.dims)
    except InfeasibleBudgetError as e:
        assert e.min_budget > budget
        # the smallest feasible budget the planner reports is one it can meet
        assert lowest is None, f"budget {budget} >= reported minimum {lowest}: {e}"
        event("infeasible")
        return
    event(f"offloads: {'w' if p.choice.weights else ''}{'a' if p.choice.activations else ''}"
          f"{' disk' if case.weight_tier == 'disk' and p.choice.weights else ''}"
          f"{' stall' if p.planned.stall_s > 0 else ''}")
    assert p.planned.peak_bytes <= budget
    assert p.min_budget <= budget
    again = sum(case.costs[list(r.nodes)].sum() for r in p.choice.recomputes)
    assert p.planned.total_s == pytest.approx(case.costs.sum() + again + p.planned.stall_s)
    for direction in ("h2d", "disk"):  # FIFO: issue positions follow reader order
        evs = sorted((e.wait_pos, e.issue_pos) for e in p.planned.transfers
                     if e.kind == "reload" and e.direction == direction)
        assert [i for _, i in evs] == sorted(i for _, i in evs)

    rw = insert_cache_ops(a, p.choice)
    out = d / "m.ho.onnx"
    save_model(place_weight_data(rw, loaded.base_dir, out), loaded, out)
    onnx.checker.check_model(str(out))
    written = onnx.load(str(out), load_external_data=False)
    _check_written_order(written)

    reloads = [e for e in p.planned.transfers if e.kind == "reload"]
    want_loaded = sum(e.nbytes for e in reloads)
    want_disk = sum(e.nbytes for e in reloads if e.direction == "disk")
    want_stored = sum(e.nbytes for e in p.planned.transfers if e.kind == "store")
    assert len(reloads) == sum(len(w.consumers) for w in p.choice.weights) + len(
        p.choice.activations)

    runtime.reset_counters()
    rep = verify(src, out, dims=case.dims, runs=RUNS, opt_level="disable",
                 execution_order=case.order, isolate=False)  # (this process's counters)
    assert rep.exact, [o for o in rep.outputs if not o.exact]
    c = runtime.counters()
    assert c["bytes_loaded"] == RUNS * want_loaded
    assert c["bytes_stored"] == RUNS * want_stored
    assert c["bytes_read_disk"] == RUNS * want_disk
    assert c["prefetches"] == RUNS * len(reloads)
    assert c["stores"] == RUNS * len(p.choice.activations)


def test_strategy_reaches_the_interesting_cases():
    """The generator makes plans with weight and activation offloads and disk reloads (a
    seeded sample, so a change that starves the property test is noticed)."""
    import random

    from hypothesis import find

    def offloads(case: Case, what: str) -> bool:
        a = analyse(case.model, case.dims)

        def tt(nbytes, direction):
            return case.latency + nbytes / case.bw

        base = simulate(a, None, case.costs, tt, case.dims)
        try:
            p = plan(a, OffloadOptions(budget=max(1, int(base.peak_bytes * case.frac)),
                                       min_bytes=case.min_bytes,
                                       weight_tier=case.weight_tier),  # type: ignore[arg-type]
                     CostModel(case.costs, tt), case.dims)
        except InfeasibleBudgetError:
            return False
        if what == "activation":
            return bool(p.choice.activations)
        if what == "disk":
            return any(e.direction == "disk" for e in p.planned.transfers)
        return bool(p.choice.weights) and p.planned.stall_s > 0

    s = settings(max_examples=400, database=None, deadline=None, phases=[Phase.generate],
                 suppress_health_check=list(HealthCheck))
    for what in ("activation", "disk", "weight"):
        find(ort_dags(), lambda c, w=what: offloads(c, w), settings=s,
             random=random.Random(0))
