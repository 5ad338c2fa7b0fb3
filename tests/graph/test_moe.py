"""Issue 37, item 1: the experts of a mixture-of-experts model found by structure (patterns in
ONNX text for each form and near-misses; a real Optimum export of a transformers config)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx.parser
import pytest
from click.testing import CliRunner
from graphs import text_model
from onnx import numpy_helper

from ho_onnx.cli import main
from ho_onnx.graph.analyse import analyse
from ho_onnx.graph.moe import find_experts

H, W, E = 8, 6, 3  # hidden, expert width, experts


def _expert(e: int, x: str, tag: str = "") -> str:
    """A SwiGLU MLP over ``x``: y{tag}{e}."""
    n = f"{tag}{e}"
    return f"""
  g{n} = MatMul({x}, G{n})
  u{n} = MatMul({x}, U{n})
  s{n} = Sigmoid(g{n})
  a{n} = Mul(g{n}, s{n})
  h{n} = Mul(a{n}, u{n})
  y{n} = MatMul(h{n}, D{n})"""


def _expert_weights(tag: str = "", n: int = E) -> dict[str, tuple[int, ...]]:
    return {f"{w}{tag}{e}": s for e in range(n)
            for w, s in (("G", (H, W)), ("U", (H, W)), ("D", (W, H)))}


def _routed(softmax_first: bool = True, shared: bool = False) -> onnx.ModelProto:
    """Every expert computed on every token, scaled by its routing weight (0 unless chosen);
    a Softmax then TopK (Qwen) or TopK then Softmax on the values (Mixtral)."""
    route = ("p = Softmax<axis=-1>(logits)\n  v, idx = TopK<axis=-1>(p, k)" if softmax_first
             else "t, idx = TopK<axis=-1>(logits, k)\n  v = Softmax<axis=-1>(t)")
    body = [f"""
moe (float[N, {H}] x) => (float[N, {H}] y) {{
  k = Constant<value = int64[1] {{2}}>()
  ax = Constant<value = int64[1] {{1}}>()
  logits = MatMul(x, R)
  {route}"""]
    for e in range(E):
        body.append(f"""
  c{e} = Constant<value = int64 {{{e}}}>()
  m{e} = Equal(idx, c{e})
  f{e} = Cast<to = 1>(m{e})
  vf{e} = Mul(v, f{e})
  w{e} = ReduceSum<keepdims = 1>(vf{e}, ax)""" + _expert(e, "x") + f"\n  z{e} = Mul(y{e}, w{e})")
    out = [f"z{e}" for e in range(E)]
    if shared:
        body.append(_expert(0, "x", "s") + "\n  sg = MatMul(x, SG)\n  ss = Sigmoid(sg)"
                    "\n  zs = Mul(ys0, ss)")
        out.append("zs")
    body.append(f"\n  y = Sum({', '.join(out)})\n}}")
    inits = {"R": (H, E), **_expert_weights()}
    if shared:
        inits |= {**_expert_weights("s", 1), "SG": (H, 1)}
    return text_model("".join(body), **inits)


def _layers(model: onnx.ModelProto) -> tuple:
    return find_experts(analyse(model, {"N": 4}))


@pytest.mark.parametrize("softmax_first", [True, False])
def test_a_router_and_experts_computed_on_every_token(softmax_first):
    (layer,) = _layers(_routed(softmax_first))
    assert (layer.form, layer.top_k, len(layer.experts), layer.router_logits) == (
        "unrolled", 2, E, "logits")
    assert [e.weights for e in layer.experts] == [(f"D{e}", f"G{e}", f"U{e}") for e in range(E)]
    assert all(e.nbytes == 3 * H * W * 4 for e in layer.experts)
    assert layer.per_token_bytes == 2 * 3 * H * W * 4


def test_a_shared_expert_is_not_a_routed_one():
    (layer,) = _layers(_routed(shared=True))
    assert len(layer.experts) == E
    assert not any(w.startswith(("Gs", "Us", "Ds", "SG")) for e in layer.experts
                   for w in e.weights)


def test_stacked_experts_gathered_by_the_selected_indices():
    m = text_model(f"""
moe (float[N, {H}] x) => (float[N, {H}] y) {{
  k = Constant<value = int64[1] {{2}}>()
  one = Constant<value = int64[1] {{1}}>()
  two = Constant<value = int64[1] {{2}}>()
  logits = MatMul(x, R)
  p = Softmax<axis=-1>(logits)
  v, idx = TopK<axis=-1>(p, k)
  gw = Gather<axis=0>(GS, idx)
  dw = Gather<axis=0>(DS, idx)
  x1 = Unsqueeze(x, one)
  x2 = Unsqueeze(x1, two)
  # [N, k, 1, W]: each token through the gate of the k experts it chose
  g = MatMul(x2, gw)
  s = Sigmoid(g)  a = Mul(g, s)
  # the down projection of the same k experts
  d = MatMul(a, dw)
  # weighted by the routing weights, summed over the k experts
  d2 = Squeeze(d, two)  v2 = Unsqueeze(v, two)
  z = Mul(d2, v2)
  y = ReduceSum<keepdims = 0>(z, one)
}}""", R=(H, E), GS=(E, H, W), DS=(E, W, H))
    (layer,) = _layers(m)
    assert (layer.form, layer.top_k, len(layer.experts)) == ("stacked", 2, E)
    assert layer.experts[1].weights == ("DS", "GS")
    assert layer.experts[1].nbytes == 2 * H * W * 4


def _contrib(op: str = "MoE") -> onnx.ModelProto:
    text = f"""
<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
moe (float[N, {H}] x) => (float[N, {H}] y) {{
  logits = MatMul(x, R)
  y = com.microsoft.{op}<k = 2, activation_type = "silu">(x, logits, W1, B1, W2)
}}"""
    m = onnx.parser.parse_model(text)
    rng = np.random.default_rng(0)
    for name, shape in (("R", (H, E)), ("W1", (E, H, W)), ("B1", (E, W)), ("W2", (E, W, H))):
        m.graph.initializer.append(numpy_helper.from_array(
            rng.standard_normal(shape).astype(np.float32), name))
    return m


def test_ort_contrib_moe():
    (layer,) = _layers(_contrib())
    assert (layer.form, layer.top_k, len(layer.experts), layer.router_logits) == (
        "contrib", 2, E, "logits")
    assert layer.experts[0].weights == ("W1", "B1", "W2")
    assert layer.experts[2].nbytes == (2 * H * W + W) * 4


def test_near_misses_are_not_experts():
    # Sampling: a Softmax and TopK over an LM head's logits (nothing routed).
    sampling = text_model(f"""
lm (float[N, {H}] x) => (float[N, 2] v, int64[N, 2] idx) {{
  k = Constant<value = int64[1] {{2}}>()
  logits = MatMul(x, W)
  p = Softmax<axis=-1>(logits)
  v, idx = TopK<axis=-1>(p, k)
}}""", W=(H, 16))
    # One MLP scaled by a routing weight: a router over 3 "experts" with one MLP behind it.
    single = text_model(f"""
one (float[N, {H}] x) => (float[N, {H}] y) {{
  k = Constant<value = int64[1] {{1}}>()
  logits = MatMul(x, R)
  p = Softmax<axis=-1>(logits)
  v, idx = TopK<axis=-1>(p, k)""" + _expert(0, "x") + """
  y = Mul(y0, v)
}""", R=(H, E), **_expert_weights(n=1))
    # A plain MLP beside an unrelated Softmax+TopK of the input.
    mlp = text_model(f"""
mlp (float[N, {H}] x) => (float[N, {H}] y, int64[N, 2] idx) {{
  k = Constant<value = int64[1] {{2}}>()
  p = Softmax<axis=-1>(x)
  v, idx = TopK<axis=-1>(p, k)""" + _expert(0, "x") + """
  y = Identity(y0)
}""", **_expert_weights(n=1))
    for m in (sampling, single, mlp):
        assert _layers(m) == ()


def test_plan_says_what_it_recognised(tmp_path):
    path = tmp_path / "moe.onnx"
    onnx.save(_routed(), path)
    args = ["plan", str(path), "--budget", "1MiB", "--dim", "N=4"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert (f"mixture of experts: 1 layers, {E} experts, top-k 2, "
            f"{E * 3 * H * W * 4 / 1024:.2f} KiB of expert weights") in r.output
    r = CliRunner().invoke(main, [*args, "--json"])
    moe = json.loads(r.stdout)["moe"]
    assert moe["experts"] == E and moe["layers"][0]["top_k"] == 2
    plain = tmp_path / "plain.onnx"
    onnx.save(text_model(f"""
mlp (float[N, {H}] x) => (float[N, {H}] y) {{""" + _expert(0, "x") + "\n  y = Identity(y0)\n}",
                         **_expert_weights(n=1)), plain)
    r = CliRunner().invoke(main, ["plan", str(plain), "--budget", "1MiB", "--dim", "N=4"])
    assert r.exit_code == 0 and "mixture" not in r.output
    r = CliRunner().invoke(main, ["plan", str(plain), "--budget", "1MiB", "--dim", "N=4",
                                  "--json"])
    assert json.loads(r.stdout)["moe"] is None


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_an_optimum_moe_export_from_a_transformers_config(moe_export, arch):
    """Real exports (Optimum, each expert's tokens gathered and scattered back; initializers
    named onnx::MatMul_N) of three architectures: the layers, k and expert count the config
    has, each expert's gate/up/down weights, the router's own weight. Qwen2-MoE's shared
    expert (every token, a sigmoid gate) is no routed expert."""
    from models.moe_export import SMALL as cfg

    model = onnx.load(moe_export(arch), load_external_data=False)
    a = analyse(model, {"batch_size": 1, "sequence_length": 8, "past_sequence_length": 4})
    layers = find_experts(a)
    assert len(layers) == cfg["layers"]
    h, f = cfg["hidden"], cfg["moe_ffn"]
    weights = set()
    for layer in layers:
        assert (layer.form, layer.top_k, len(layer.experts)) == (
            "unrolled", cfg["top_k"], cfg["experts"])
        router = a.nodes[a.tensors[layer.router_logits].producer]
        assert [a.tensors[n].shape for n in (v.name for v in router.inputs)
                if a.tensors[n].is_initializer] == [(h, cfg["experts"])]
        for e in layer.experts:
            assert sorted(a.tensors[w].shape for w in e.weights) == [(f, h), (h, f), (h, f)]
            assert e.nbytes == 3 * h * f * 4
            weights.update(e.weights)
    assert len(weights) == cfg["layers"] * cfg["experts"] * 3  # none counted twice


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_the_export_patch_keeps_the_blocks_arithmetic(tmp_path, arch):
    """``models.moe_export.all_experts`` (every expert traced, as Optimum does for
    Qwen3-MoE) computes what transformers' own block computes."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from models.moe_export import all_experts, build_hf_moe

    model = AutoModelForCausalLM.from_pretrained(build_hf_moe(tmp_path / "hf", arch)).eval()
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        with all_experts(arch):
            got = model(ids, use_cache=False).logits
    assert torch.equal(got, want)
