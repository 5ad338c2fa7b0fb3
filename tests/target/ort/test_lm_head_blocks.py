"""A weight read whole by one MatMul/Gemm streamed in blocks (issue 38, item 3: the lm_head;
``ho_onnx/rewrite/blocks.py``): the rewrite's patterns, its decision, and outputs bit-exact
against the unmodified model (MLAS sums each output column alone: a column block gives the
same bits as the whole product)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from graphs import save, text_model

from ho_onnx import InferenceSession
from ho_onnx.errors import HoOnnxError
from ho_onnx.graph.analyse import analyse
from ho_onnx.graph.load import load_model
from ho_onnx.rewrite.blocks import apply_blocks, bounds, find_sites, ladder
from ho_onnx.rewrite.pipeline import optimize, plan_model
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.target.ort.verify import verify

pytestmark = pytest.mark.usefixtures("no_debug_hooks")

K, N = 64, 1001  # odd N: no block count divides it

MATMUL = f"""
g (float[M, {K}] x) => (float[M, {N}] y) {{
  h = Relu(x)
  y = MatMul(h, W)
}}"""
GEMM_T = f"""
g (float[M, {K}] x) => (float[M, {N}] y) {{
  h = Relu(x)
  y = Gemm<transB = 1, alpha = 0.5>(h, W, C)
}}"""
GEMM = f"""
g (float[M, {K}] x) => (float[M, {N}] y) {{
  h = Relu(x)
  y = Gemm<beta = 2.0>(h, W, C)
}}"""
TIED = f"""
g (int64[M] ids) => (float[M, {N}] y) {{
  e = Gather<axis = 0>(W, ids)
  h = Relu(e)
  t = Transpose<perm = [1, 0]>(W)
  y = MatMul(h, t)
}}"""
OTHER_READER = f"""
g (float[M, {K}] x) => (float[M, {N}] y, float[{N}] z) {{
  z = ReduceSum<keepdims = 0>(W, zero)
  v = Relu(V)
  r = ReduceMean<axes = [1], keepdims = 0>(v)
  c = Add(x, r)
  y = MatMul(c, W)
}}"""


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _save(tmp: Path, body: str, **inits: tuple[int, ...]) -> Path:
    return save(text_model(body, **inits), tmp / "m.onnx", external=True)


def _run(path: Path, feeds: dict[str, np.ndarray], library: bool) -> np.ndarray:
    if library:
        return InferenceSession(path).run(None, feeds)[0]
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(
        None, feeds)[0]


def _split_text(path: Path, k: int) -> tuple[onnx.ModelProto, list[str]]:
    """The model of ``path`` with its sites split in ``k`` (no cache ops), and the sites."""
    a = analyse(load_model(path).model, {"M": 4})
    sites, _ = find_sites(a, "host", {"M": 4}, 0)
    apply_blocks(a.model, sites, k)
    return ir.to_proto(a.model), [s.form for s in sites]


def test_bounds_cover_odd_widths_and_the_ladder_stops_at_the_widest():
    assert bounds(1001, 4) == [(0, 251), (251, 501), (501, 751), (751, 1001)]
    assert bounds(3, 3) == [(0, 1), (1, 2), (2, 3)]
    assert ladder([], 32) == []


@pytest.mark.parametrize("body,form,ops", [
    (MATMUL, "matmul", ["Relu", "MatMul", "MatMul", "MatMul", "Concat"]),
    (GEMM_T, "gemm_t", ["Relu", "Slice", "Gemm", "Slice", "Gemm", "Slice", "Gemm", "Concat"]),
    (GEMM, "gemm", ["Relu", "Gemm", "Gemm", "Gemm", "Concat"]),  # (a C of one: shared)
    (TIED, "matmul_t", ["Gather", "Relu", "Transpose", "MatMul", "Transpose", "MatMul",
                        "Transpose", "MatMul", "Concat"]),
])
def test_the_patterns_of_each_form(tmp_path, body, form, ops):
    shape = (N, K) if form in ("gemm_t", "matmul_t") else (K, N)
    bias = {"gemm_t": {"C": (N,)}, "gemm": {"C": (1,)}}.get(form, {})
    path = _save(tmp_path, body, W=shape, **bias)
    m, forms = _split_text(path, 3)
    assert forms == [form] and _ops(m) == ops
    widths = [list(i.dims) for i in m.graph.initializer
              if i.name.startswith("W.ho_block")]
    assert sorted(widths) == sorted([[334, K], [334, K], [333, K]] if shape == (N, K) else
                                    [[K, 334], [K, 334], [K, 333]])
    tied = {i.name for i in m.graph.initializer} & {"W"}
    assert tied == ({"W"} if form == "matmul_t" else set())  # the Gather keeps the table
    concat = m.graph.node[-1]
    assert concat.output == ["y"] and concat.attribute[0].i == -1
    onnx.save(m, tmp_path / "split.onnx")  # (resident blocks: ORT reads the byte ranges)
    x = np.random.default_rng(2).standard_normal((5, K)).astype(np.float32)
    feeds = {"ids": np.array([0, N - 1, 7, -2, 3])} if form == "matmul_t" else {"x": x}
    np.testing.assert_array_equal(_run(tmp_path / "split.onnx", feeds, False),
                                  _run(path, feeds, False))


def test_row_blocks_are_byte_ranges_of_the_weights_own_file(tmp_path):
    path = _save(tmp_path, TIED, W=(N, K))
    m, _ = _split_text(path, 3)
    ranges = [{e.key: e.value for e in i.external_data} for i in m.graph.initializer
              if i.name.startswith("W.ho_block")]
    assert [(r["location"], int(r.get("offset", 0)), int(r["length"])) for r in ranges] == [
        ("m.onnx.data", 0, 334 * K * 4), ("m.onnx.data", 334 * K * 4, 334 * K * 4),
        ("m.onnx.data", 668 * K * 4, 333 * K * 4)]


@pytest.mark.parametrize("body,shape,feed", [
    (MATMUL, (K, N), "x"), (GEMM_T, (N, K), "x"), (TIED, (N, K), "ids")])
def test_streamed_below_the_weight_and_bit_exact(tmp_path, body, shape, feed):
    extra = {"C": (N,)} if body is GEMM_T else {}
    src = _save(tmp_path, body, W=shape, **extra)
    table = N * K * 4
    with pytest.raises(HoOnnxError) as e:
        plan_model(src, OffloadOptions(budget=1, min_bytes=0, activations=False), {"M": 4})
    floor = e.value.min_budget  # type: ignore[attr-defined]
    assert floor < table  # was above it: the whole weight (and its transpose) resident
    out = tmp_path / "o.onnx"
    r = optimize(src, out, OffloadOptions(budget=floor, min_bytes=0, activations=False),
                 {"M": 4})
    (split,) = [s for s in r.choice.splits if s.blocks]
    assert split.name == "W" and len(split.blocks) > 1 and "blocks: predicted" in split.reason
    meta = {p.key: p.value for p in onnx.load(str(out), load_external_data=False).metadata_props}
    assert meta["ho_onnx.split_weights"] == f"W:{len(split.blocks)}"  # recorded
    rng = np.random.default_rng(1)
    for m in (4, 7):  # the planned length, and another
        x = rng.integers(-N, N, m) if feed == "ids" else rng.standard_normal((m, K))
        feeds = {feed: x.astype(np.int64 if feed == "ids" else np.float32)}
        np.testing.assert_array_equal(_run(out, feeds, True), _run(src, feeds, False))


def test_blocks_go_through_the_decider_seam(tmp_path):
    """Blocks are chosen for any decider with budgeted options whose decisions are predicted
    plans (the seam, not the class: a planner wrapped by a decider of one's own gets the same
    blocks), and a decider whose decisions are not plans gets none, and no error."""
    from dataclasses import dataclass

    from ho_onnx.cost.source import CostSource
    from ho_onnx.schedule.planner import BudgetPlanner
    from ho_onnx.schedule.policy import ExplicitPolicy

    src = _save(tmp_path, TIED, W=(N, K))
    opts = OffloadOptions(budget=N * K * 2, min_bytes=0, activations=False)

    @dataclass(frozen=True)
    class Wrapped:  # a decider of its own, delegating to the planner
        options: OffloadOptions

        def decide(self, analysis, dims):
            return BudgetPlanner(self.options, CostSource()).decide(analysis, dims)

        def sized(self, t):
            return True

    want = optimize(src, tmp_path / "a.onnx", opts, {"M": 4}).choice.splits
    got = optimize(src, tmp_path / "b.onnx", Wrapped(opts), {"M": 4}).choice.splits
    assert [(s.name, s.blocks) for s in got] == [(s.name, s.blocks) for s in want]
    assert any(s.blocks for s in got)

    @dataclass(frozen=True)
    class Explicit:  # budgeted options, but decisions that are no predicted plans
        options: OffloadOptions

        def decide(self, analysis, dims):
            return ExplicitPolicy(OffloadOptions(min_bytes=0)).decide(analysis, dims)

        def sized(self, t):
            return True

    r = optimize(src, tmp_path / "c.onnx", Explicit(opts), {"M": 4})
    assert not r.choice.splits


def test_another_reader_keeps_it_whole_with_the_reason(tmp_path):
    src = save(text_model(OTHER_READER, W=(K, N), V=(K, N), zero=np.array([0])),
               tmp_path / "m.onnx", external=True)  # (V's Relu is the peak: W must move)
    r = optimize(src, tmp_path / "o.onnx",
                 OffloadOptions(budget=600_000, min_bytes=0, activations=False), {"M": 4})
    assert "W" in {w.name for w in r.choice.weights}
    why = {s.name: s.reason for s in r.choice.splits if not s.blocks}
    assert "read whole by 2 nodes" in why["W"] and "read whole by Relu" in why["V"]
    assert not any(s.blocks for s in r.choice.splits)


def test_max_blocks_0_keeps_the_old_floor(tmp_path):
    src = _save(tmp_path, TIED, W=(N, K))
    with pytest.raises(HoOnnxError) as e:
        plan_model(src, OffloadOptions(budget=1, min_bytes=0, activations=False, max_blocks=0),
                   {"M": 4})
    assert e.value.min_budget >= N * K * 4  # type: ignore[attr-defined]


def test_plan_says_what_was_split(tmp_path):
    from click.testing import CliRunner

    from ho_onnx.cli import main

    src = _save(tmp_path, TIED, W=(N, K))
    args = ["plan", str(src), "--budget", "100KiB", "--dim", "M=4", "--min-bytes", "0",
            "--offload", "weights"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "blocks: W (250.25 KiB in " in r.output and "predicted" in r.output
    r = CliRunner().invoke(main, [*args, "--max-blocks", "0", "--json"])
    assert r.exit_code != 0 and "smallest feasible budget" in r.output  # whole: over 100 KiB


def test_offload_pass_streams_row_blocks_only(tmp_path):
    """``OffloadPass`` writes no data: row blocks (byte ranges of the weight's file) only."""
    from ho_onnx.cost.source import CostSource
    from ho_onnx.rewrite.passes import OffloadPass
    from ho_onnx.schedule.planner import BudgetPlanner

    for body, shape, split in ((TIED, (N, K), True), (MATMUL, (K, N), False)):
        src = _save(tmp_path, body, W=shape)
        decider = BudgetPlanner(OffloadOptions(budget=N * K * 2, min_bytes=0,
                                               activations=False), CostSource())
        if split:
            out = OffloadPass(decider, {"M": 4})(ir.load(src)).model
            assert "Concat" in [n.op_type for n in out.graph]
        else:
            with pytest.raises(HoOnnxError, match="smallest feasible"):
                OffloadPass(decider, {"M": 4})(ir.load(src))


def test_where_whole_is_feasible_the_choice_is_timed_and_said(tmp_path):
    src = _save(tmp_path, TIED, W=(N, K))
    whole = N * K * 4 * 2 + 4 * N * 4  # the table, its transpose and the product: feasible
    r = optimize(src, tmp_path / "o.onnx",
                 OffloadOptions(budget=whole, min_bytes=0, activations=False), {"M": 4})
    (s,) = r.choice.splits
    assert s.name == "W" and "predicted" in s.reason and "whole" in s.reason, s.reason
    assert ladder([], 8) == [] and ladder(find_sites(
        analyse(load_model(src).model, {"M": 4}), "host", {"M": 4}, 0)[0], 5) == [2, 4, 5]


def test_a_range_plan_streams_blocks_exact_at_both_ends(tmp_path):
    src = _save(tmp_path, TIED, W=(N, K))
    out = tmp_path / "o.onnx"
    r = optimize(src, out, OffloadOptions(budget=N * K * 2, min_bytes=0, activations=False),
                 dim_ranges={"M": (1, 8)})
    assert any(s.blocks for s in r.choice.splits)
    assert r.plan is not None and "bottom of the ranges" in (r.plan.costs or "").description
    for m in (1, 8):
        for level in ("disable", "basic"):
            assert verify(src, out, dims={"M": m}, opt_level=level, int_high=N,
                          isolate=False).exact, (m, level)
        # at ``all`` ORT fuses a block's Transpose + MatMul into FusedMatMul (transB), whose
        # one-row path rounds otherwise (~1e-6 at M = 1): verify's fusion tolerance
        assert verify(src, out, dims={"M": m}, int_high=N, isolate=False).ok


def test_a_tied_tables_row_blocks_share_its_host_copy(tmp_path):
    """The table the GatherRows holds in the host store serves its lm_head's row blocks (byte
    ranges inside it) loaded after it (kernels are made in the file's order): its bytes are
    held once, not twice, but for a block whose Prefetch comes before the GatherRows."""
    from ho_onnx import counters

    src = _save(tmp_path, TIED, W=(N, K))
    out = tmp_path / "o.onnx"
    r = optimize(src, out, OffloadOptions(budget=N * K * 2, min_bytes=0, activations=False),
                 {"M": 4})
    moved = {w.name for w in r.choice.weights}
    (split,) = [s for s in r.choice.splits if s.blocks]
    assert "W" in moved and set(split.blocks) & moved  # (the table, and blocks of it)
    early = 0  # bytes of the blocks read before the table
    for node in onnx.load(str(out), load_external_data=False).graph.node:
        if node.op_type == "GatherRows":
            break
        attrs = {a.name: a for a in node.attribute}
        if node.op_type == "Prefetch" and attrs["name"].s.decode() in split.blocks:
            early += attrs["length"].i
    assert early < N * K * 4 / 2
    before = counters()["host_store_bytes"]
    sess = InferenceSession(out)
    assert counters()["host_store_bytes"] - before == N * K * 4 + early  # (was twice the table)
    feeds = {"ids": np.array([1, 2, N - 1, 0])}
    np.testing.assert_array_equal(sess.run(None, feeds)[0], _run(src, feeds, False))


def test_host_bytes_count_a_tied_tables_row_blocks_as_the_library_holds_them(tmp_path):
    """The plan's host_bytes is what the host store holds: the table once, its row blocks
    loaded after it inside its copy, those loaded before it on their own (was: table and
    every block, twice the table)."""
    from ho_onnx import counters

    src = _save(tmp_path, TIED, W=(N, K))
    out = tmp_path / "o.onnx"
    r = optimize(src, out, OffloadOptions(budget=N * K * 2, min_bytes=0, activations=False),
                 {"M": 4})
    before = counters()["host_store_bytes"]
    sess = InferenceSession(out)
    assert r.plan is not None and sess is not None
    assert r.plan.host_bytes == counters()["host_store_bytes"] - before


def test_resident_column_blocks_are_external_in_the_sidecar(tmp_path):
    """Column blocks the plan keeps resident are written to the output's sidecar as external
    data (was: inline in the model proto, toward its 2 GiB limit, and copied to ORT's heap
    instead of mapped); outputs exact."""
    src = _save(tmp_path, MATMUL, W=(K, N))
    out = tmp_path / "o.onnx"
    r = optimize(src, out, OffloadOptions(budget=200_000, min_bytes=0, activations=False),
                 {"M": 4})
    (split,) = [s for s in r.choice.splits if s.blocks]
    moved = {w.name for w in r.choice.weights}
    resident = [b for b in split.blocks if b not in moved]
    assert resident and moved  # (both kinds of block at this budget)
    m = onnx.load(str(out), load_external_data=False)
    inits = {t.name: t for t in m.graph.initializer}
    for b in resident:
        assert not inits[b].raw_data and {e.key: e.value for e in inits[b].external_data}[
            "location"] == "o.onnx.data"
    assert out.stat().st_size < N * K  # (no block's bytes in the proto)
    x = np.random.default_rng(2).standard_normal((4, K)).astype(np.float32)
    np.testing.assert_array_equal(_run(out, {"x": x}, True), _run(src, {"x": x}, False))


def test_a_resident_weight_is_tried_in_blocks_when_the_arena_does_not_fit():
    """The plan without blocks keeps a weight resident: blocks are tried for it only when
    ORT's replayed arena misses the budget (stop 46: the 2.75 GB decoder at 15 %, its 250 MiB
    lm_head kept whole and the arena 111 MiB over; in 2 blocks the arena fits), and only
    over the share of the budget."""
    from types import SimpleNamespace

    from ho_onnx.rewrite.blocks import SPLIT_SHARE, Site, _Trial, _tried_sites

    big = Site("lm_head", 5, None, "matmul", 64, 600)
    small = Site("w", 3, None, "matmul", 64, int(SPLIT_SHARE * 1000) - 1)
    planner = SimpleNamespace(options=SimpleNamespace(budget=1000))

    def base(fits: bool) -> _Trial:
        plan = SimpleNamespace(choice=SimpleNamespace(weights=[]), arena_fits=fits)
        return _Trial(0, plan)  # type: ignore[arg-type]

    assert _tried_sites(None, planner, base(True), [big, small]) == []  # type: ignore[arg-type]
    assert _tried_sites(None, planner, base(False), [big, small]) == [big]  # type: ignore[arg-type]
