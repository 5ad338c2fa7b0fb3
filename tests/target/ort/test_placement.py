"""The CUDA placement prediction (ORT's CPU-fallback rule replayed), on hand-worked graphs.

Each case states the assignment worked out by hand from onnxruntime's
``GetCpuPreferredNodes``: Shape outputs are host tensors; a consumer whose inputs are all
host tensors, small initializers or graph inputs goes to the CPU unless an input is float16.
"""

from __future__ import annotations

import onnx
import onnx.parser
import pytest

from ho_onnx.target.ort.placement import (
    CPU,
    CUDA,
    format_report,
    predict_cuda_placement,
    split_chains,
)

HEADER = '<ir_version: 9, opset_import: ["" : 17, "ai.hyperoffload" : 1]>'
WEIGHT = '<location: string = "w.bin", offset: int = 0, length: int = 64, name: string = "W">'


def parse(body: str) -> onnx.ModelProto:
    m = onnx.parser.parse_model(f"{HEADER}\n{body}")
    for i, node in enumerate(m.graph.node):
        node.name = node.name or f"n{i}"
    return m


def providers(model: onnx.ModelProto) -> dict[str, str]:
    p = predict_cuda_placement(model)
    return dict(zip(p.names, p.providers, strict=True))


def _weight_prefetch_after(dep: str) -> onnx.ModelProto:
    """A weight Prefetch whose ordering input is ``dep`` (``s``: a Shape, ``r``: a Relu)."""
    return parse(f"""
    g (float[4, 4] x) => (float[4, 4] out)
    <float[0] src0 = {{}}> {{
      r = Relu (x)
      s = Shape (x)
      y = ai.hyperoffload.Prefetch {WEIGHT} (src0, {dep})
      z = ai.hyperoffload.Wait (y, r)
      out = MatMul (r, z)
    }}""")


def test_weight_prefetch_ordered_after_a_shape_goes_to_the_cpu_and_splits():
    m = _weight_prefetch_after("s")
    for i, name in enumerate(["relu", "shape", "pf", "wait", "mm"]):
        m.graph.node[i].name = name
    assert providers(m) == {"relu": CUDA, "shape": CUDA, "pf": CPU, "wait": CUDA, "mm": CUDA}
    report = split_chains(m)
    assert [s.tensor for s in report.split] == ["W"]
    assert report.off_cuda == ["pf"]


def test_the_same_prefetch_ordered_after_a_device_tensor_stays_on_cuda():
    m = _weight_prefetch_after("r")
    report = split_chains(m)
    assert report.ok and report.per_provider == {CUDA: 2}


def test_float16_inputs_keep_a_shape_ordered_prefetch_on_cuda():
    m = parse(f"""
    g (float16[4, 4] x) => (float16[4, 4] out)
    <float16[0] src0 = {{}}> {{
      r = Relu (x)
      s = Shape (x)
      y = ai.hyperoffload.Prefetch {WEIGHT} (src0, s)
      z = ai.hyperoffload.Wait (y, r)
      out = MatMul (r, z)
    }}""")
    assert split_chains(m).ok


def test_store_of_a_shape_output_goes_to_the_cpu_and_its_device_ordered_detach_does_not():
    m = parse("""
    g (float[4, 4] x) => (float[4, 4] out)
    <int64[1] idx = {0}> {
      s = Shape (x)
      r = Relu (x)
      t = ai.hyperoffload.Store (s)
      t2 = ai.hyperoffload.Detach (s, t, r)
      y = ai.hyperoffload.Prefetch (t2, r)
      z = ai.hyperoffload.Wait (y, r)
      out = Reshape (r, z)
    }""")
    for i, name in enumerate(["shape", "relu", "store", "detach", "pf", "wait", "reshape"]):
        m.graph.node[i].name = name
    got = providers(m)
    assert got["store"] == CPU
    assert got["detach"] == got["pf"] == got["wait"] == got["reshape"] == CUDA
    assert [s.tensor for s in split_chains(m).split] == ["s"]


def test_a_damaged_cache_op_is_named_and_ends_no_chain():
    """A Store without its output, a Detach without its second input, an op our domain lacks
    (fuzzer, seed 130: ``inspect`` of such a model was an unexpected IndexError)."""
    import onnx_ir as ir

    from ho_onnx.target.ort.placement import cache_op_defect

    m = parse(f"""
    g (float[4, 4] x) => (float[4, 4] out)
    <float[0] src0 = {{}}> {{
      r = Relu (x)
      t = ai.hyperoffload.Store (r)
      t2 = ai.hyperoffload.Detach (r, "")
      q = ai.hyperoffload.Relu (r)
      y = ai.hyperoffload.Prefetch {WEIGHT} (src0, r)
      z = ai.hyperoffload.Wait (y, r)
      out = MatMul (r, z)
    }}""")
    del m.graph.node[1].output[:]  # (ONNX text cannot write a node without outputs)
    defects = {n.name: cache_op_defect(n) for n in ir.from_proto(m).graph
               if n.domain == "ai.hyperoffload"}
    assert defects == {"n1": "has no output (a damaged model?)",
                       "n2": "has 2 input(s), needs 2 (a damaged model?)",
                       "n3": "'Relu' is no ai.hyperoffload operator", "n4": None, "n5": None}
    report = split_chains(m)  # the weight's chain is whole and on CUDA
    assert report.ok and not report.split, report


def test_shape_arithmetic_runs_on_the_cpu_but_reshape_takes_its_shape_in_host_memory():
    m = parse("""
    g (float[4, 4] x) => (float[16] out)
    <int64[1] idx = {0}, int64[1] minus1 = {-1}> {
      s = Shape (x)
      d = Gather <axis = 0> (s, idx)
      n = Mul (d, d)
      r = Relu (x)
      out = Reshape (r, n)
    }""")
    got = providers(m)
    assert [got[n.name] for n in m.graph.node] == [CUDA, CPU, CPU, CUDA, CUDA]
    assert {"s", "d", "n"} <= predict_cuda_placement(m).host_tensors


@pytest.mark.parametrize(("size", "where"), [(1, CPU), (100, CPU), (101, CUDA)])
def test_a_small_constant_node_counts_as_a_small_initializer(size, where):
    """ORT loads Constant nodes as initializers (Graph::Graph): a Gather of a Shape with a
    Constant index runs on the CPU exactly as with an initializer index (measured on an H100:
    the old replay called its output a device tensor, the rewriter offloaded it and ORT
    added a device-to-host copy for ConstantOfShape)."""
    vals = ", ".join(["0"] * size)
    m = parse(f"""
    g (float[4, 4] x) => (float[4] out)
    {{
      s = Shape (x)
      idx = Constant <value = int64[{size}] {{{vals}}}> ()
      d = Gather <axis = 0> (s, idx)
      c = ConstantOfShape (d)
      out = ReduceSum <keepdims = 0> (c)
    }}""")
    got = providers(m)
    assert got["n2"] == where
    assert ("d" in predict_cuda_placement(m).host_tensors) == (where == CPU)


def test_an_op_cuda_cannot_run_seeds_the_fallback_only_when_it_is_reached():
    m = parse("""
    g (float[8] x) => (float[8] out, int64[M] u, float[K] v)
    {
      s = Shape (x)
      u0 = Unique (s)
      t = ai.hyperoffload.Store (u0)
      t2 = ai.hyperoffload.Detach (u0, t)
      y = ai.hyperoffload.Prefetch (t2)
      u = ai.hyperoffload.Wait (y)
      v0 = Unique (x)
      out = Relu (x)
      v = Relu (v0)
    }""")
    got = [providers(m)[n.name] for n in m.graph.node]
    # Unique has no CUDA kernel. Reached from Shape's host output, it makes its output a host
    # tensor and the whole chain follows it to the CPU (consistent, not split). Unique of a
    # graph input is never a candidate: ORT copies its output to the device for Relu.
    assert got == [CUDA, CPU, CPU, CPU, CPU, CPU, CPU, CUDA, CUDA]
    report = split_chains(m)
    assert not report.split and len(report.off_cuda) == 4


@pytest.mark.parametrize(("size", "where"), [(100, CPU), (101, CUDA)])
def test_small_initializers_have_at_most_100_elements(size, where):
    m = parse(f"""
    g (float[4, 4] x) => (float[4, 4] out)
    <int64[{size}] big = {{{", ".join(["1"] * size)}}}> {{
      s = Shape (x)
      c = Concat <axis = 0> (s, big)
      out = Relu (x)
    }}""")
    # Concat reads a host tensor and an initializer: small (<= 100 elements) -> CPU.
    assert providers(m)["n1"] == where


# ---- the rewriter keeps every chain on CUDA ---------------------------------------------------

def _dims_of(model: onnx.ModelProto) -> dict[str, int]:
    return {d.dim_param: 8 for i in model.graph.input for d in i.type.tensor_type.shape.dim
            if d.dim_param}


def _optimized(src, tmp_path, options) -> onnx.ModelProto:
    import ho_onnx

    out = tmp_path / f"{src.stem}.ho.onnx"
    ho_onnx.optimize(src, out, options, dims=_dims_of(onnx.load(src, load_external_data=False)))
    return onnx.load(out, load_external_data=False)


def _assert_every_chain_on_cuda(m: onnx.ModelProto) -> None:
    report = split_chains(m)
    assert report.split == [] and report.off_cuda == [], format_report(report)
    assert report.per_provider.get(CUDA, 0) > 0
    host = predict_cuda_placement(m).host_tensors
    for n in m.graph.node:  # no ordering input of a cache op lives in host memory
        if n.domain == "ai.hyperoffload":
            assert not host.intersection(n.input[1:]), (n.name, host.intersection(n.input[1:]))


def _source(kind: str, tmp_path):
    if kind == "decoder":
        from models.decoder import build_decoder

        src = tmp_path / "decoder.onnx"
        build_decoder(src, layers=2, hidden=64, heads=4, external_data=True)
        return src
    from models.hf_export import export_hf

    return export_hf(kind, tmp_path / f"{kind}.onnx", layers=2, hidden=64, heads=4, vocab=256)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["decoder", "gpt2", "llama"])
def test_no_split_chain_forced_all_and_planned(kind, tmp_path):
    from ho_onnx import OffloadOptions

    if kind != "decoder":
        pytest.importorskip("torch")
    src = _source(kind, tmp_path)
    forced = _optimized(src, tmp_path / "all", OffloadOptions(min_bytes=0, min_gap=1))
    _assert_every_chain_on_cuda(forced)
    from ho_onnx.rewrite.pipeline import plan_model
    from ho_onnx.schedule.planner import InfeasibleBudgetError

    dims = _dims_of(onnx.load(src, load_external_data=False))
    with pytest.raises(InfeasibleBudgetError) as e:  # the smallest feasible budget
        plan_model(src, OffloadOptions(min_bytes=0, budget=1), dims)
    _, _, plan = plan_model(src, OffloadOptions(min_bytes=0, budget=1 << 40), dims)
    budget = (e.value.min_budget + plan.baseline.peak_bytes) // 2  # halfway: a real plan
    planned = _optimized(src, tmp_path / "plan", OffloadOptions(min_bytes=0, budget=budget))
    assert any(n.domain == "ai.hyperoffload" for n in planned.graph.node)
    _assert_every_chain_on_cuda(planned)
