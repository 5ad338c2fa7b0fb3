"""Small models for the tests, written in ONNX text with random initializers."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
from onnx import TensorProto, helper, numpy_helper

HEADER = '<ir_version: 8, opset_import: ["" : 17]>'


def text_model(body: str, seed: int = 0, **inits: tuple[int, ...] | np.ndarray) -> onnx.ModelProto:
    """Parse ``body`` (a graph in ONNX text) and add initializers: shapes get random floats."""
    model = onnx.parser.parse_model(f"{HEADER}\n{body}")
    rng = np.random.default_rng(seed)
    for name, value in inits.items():
        arr = value if isinstance(value, np.ndarray) else (
            rng.standard_normal(value).astype(np.float32) * 0.5)
        model.graph.initializer.append(numpy_helper.from_array(arr, name))
    onnx.checker.check_model(model)
    return model


# A Loop whose body reads four weights W1-W4 in turn (a stack of layers; its trip count an
# input), W0 and W5 read by the main graph: under a budget the body is planned per iteration.
LOOP_N = 256
LOOP_LAYERS = f"""
ly (float[{LOOP_N}, {LOOP_N}] x, int64 n) => (float[{LOOP_N}, {LOOP_N}] y) {{
  a = MatMul(x, W0)
  cond = Constant<value = bool {{1}}>()
  out = Loop(n, cond, a) <body = body (int64 i, bool c, float[{LOOP_N}, {LOOP_N}] h) => (
                                        bool c2, float[{LOOP_N}, {LOOP_N}] h2) {{
      c2 = Identity(c)
      t1 = MatMul(h, W1)
      r1 = Tanh(t1)
      t2 = MatMul(r1, W2)
      r2 = Tanh(t2)
      t3 = MatMul(r2, W3)
      r3 = Tanh(t3)
      t4 = MatMul(r3, W4)
      h2 = Tanh(t4)
  }}>
  y = MatMul(out, W5)
}}
"""


# x -> MatMul W1 -> Relu -> MatMul W2 -> Relu -> Add(h4, h1): h1 has a gap (used at 1 and 4).
CHAIN = """
chain (float[N, 16] x) => (float[N, 16] y) {
  h1 = MatMul(x, W1)
  h2 = Relu(h1)
  h3 = MatMul(h2, W2)
  h4 = Relu(h3)
  h5 = Sigmoid(h4)
  y = Add(h5, h1)
}
"""


def chain_model() -> onnx.ModelProto:
    return text_model(CHAIN, W1=(16, 16), W2=(16, 16))


def save(model: onnx.ModelProto, path: Path, external: bool = False,
         size_threshold: int = 0) -> Path:
    """Save ``model`` to ``path``; ``external`` puts initializers of at least
    ``size_threshold`` bytes (default: all) in ``<name>.data``."""
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=f"{path.name}.data",
                        size_threshold=size_threshold)
    else:
        onnx.save_model(model, str(path))
    return path


def folder_digest(folder: Path) -> dict[str, str]:
    """SHA-256 of every file in ``folder`` by name (to show a folder was left untouched)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file()}



def nested_if_model(depth: int) -> onnx.ModelProto:
    """``depth`` Ifs nested in each other's then-branch; the innermost reads ``a``, a value of
    the main graph: y = Neg(Relu(x)) when ``c``, else Abs(x)."""
    body = "u = Neg(a)"
    for d in range(depth, 0, -1):
        body = (f"{'y' if d == 1 else 'u'} = If(c) <then_branch = t{d} () => (float[4] u) "
                f"{{ {body} }}, else_branch = e{d} () => (float[4] v{d}) {{ v{d} = Abs(x) }}>")
    return text_model(f"deep (float[4] x, bool c) => (float[4] y) {{ a = Relu(x)\n {body} }}")


def tile_model(w1: tuple[int, int], w2: tuple[int, int]) -> onnx.ModelProto:
    """x[1,64] → a 1 MiB Tile (the early peak) → ReduceMean → Mul → MatMul W1 → MatMul W2."""
    return text_model(f"""
    g (float[1, 64] x) => (float[1, {w2[1]}] y) {{
      a = Tile(x, reps)
      b = ReduceMean <axes = [1], keepdims = 1> (a)
      c = Mul(x, b)
      e = MatMul(c, W1)
      y = MatMul(e, W2)
    }}
    """, W1=w1, W2=w2, reps=np.array([1, 4096], np.int64))


# Two weights read back to back at the end: the FIFO-channel case.
TWO_WEIGHTS = """
g (float[8, 512] x) => (float[8, 512] y) {
  a = Relu(x)
  b = Sigmoid(a)
  c = MatMul(b, W1)
  y = MatMul(c, W2)
}
"""


def two_weights_model() -> onnx.ModelProto:
    return text_model(TWO_WEIGHTS, W1=(512, 512), W2=(512, 512))


# A valid model ONNX Runtime crashes on (measured: onnxruntime 1.32, SIGSEGV while creating a
# CPU session at the extended and all optimization levels; basic and disable load it): a
# LayerNormalization whose optional bias is passed as the empty name. (onnxruntime#18967,
# "LayerNormalization without bias throws segfault", was closed as fixed in 2024.)
ORT_CRASH = """
ln (float[3,4] X, float[4] W) => (float[3,4] Y) {
    Y = LayerNormalization <axis: int = 1> (X, W, "")
}
"""


# Another: ``Max`` with an empty optional input, at run time, at every level (measured:
# onnxruntime 1.32, SIGSEGV in the first run; onnx.checker's full check passes it).
ORT_RUN_CRASH = """
mx (float[3,4] X) => (float[3,4] Y) {
    Y = Max (X, "")
}
"""


# A model ORT runs forever: a Loop without a trip count whose condition stays true (each
# iteration copies a 2-float state; nothing accumulates, so memory stays flat).
FOREVER_LOOP = """
forever (float[2] X) => (float[2] Y) {
    go = Constant <value = bool {1}> ()
    Y = Loop ("", go, X) <body = step (int64 i, bool c, float[2] a) => (bool c2, float[2] b) {
        c2 = Identity (c)
        b = Identity (a)
    }>
}
"""


# A model ORT's symbolic shape inference (run for models with contrib ops) blows up on: it
# computes int64 tensors of known shape in numpy, and ConstantOfShape's output here is
# N x N int64 (N=15000: 1.8 GB, twice over, from ~250 bytes of model; measured in-process
# with N=16000: 4.3 GB and 10 s). ONNX's own inference does not compute it.
CONTRIB_BLOWUP = """
<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
blowup (float[2, 3] x) => (float[2, 3] y, int64 s) {
    shp = Constant <value = int64[2] {N, N}> ()
    c = ConstantOfShape <value = int64[1] {7}> (shp)
    s = ReduceSum <keepdims = 0> (c)
    g = com.microsoft.Gelu (x)
    y = Relu (g)
}
"""


def contrib_blowup_model(n: int = 15000) -> onnx.ModelProto:
    return onnx.parser.parse_model(CONTRIB_BLOWUP.replace("{N, N}", f"{{{n}, {n}}}"))


def ort_crash_model() -> onnx.ModelProto:
    return text_model(ORT_CRASH)


def ort_run_crash_model() -> onnx.ModelProto:
    return text_model(ORT_RUN_CRASH)


def doubling_model(n: int) -> onnx.ModelProto:
    """7 KB for n=40: Shape(x) concatenated with itself ``n`` times; ONNX's data propagation
    would materialize 2**n integers (a hostile model for shape inference)."""
    nodes = [helper.make_node("Shape", ["x"], ["s0"])]
    nodes += [helper.make_node("Concat", [f"s{i}", f"s{i}"], [f"s{i + 1}"], axis=0)
              for i in range(n)]
    nodes.append(helper.make_node("Reshape", ["x", f"s{n}"], ["y"]))
    g = helper.make_graph(nodes, "hostile",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["D"])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


# t1 and t2 ([512, 512] f32, 1 MiB each) die at steps 1 and 2; Split's two [512, 512] outputs
# at step 4 take their buffers from ORT's free list, so ORT holds both through steps 2-3,
# where t3 and t4 (2 MiB each, a shape nothing else has) are live. Tensors at step 3:
# t3 + t4 = 4 MiB; ORT's buffers: t1 + t2 + t3 + t4 = 6 MiB. None of these ops writes in
# place. W (1 MiB) is read last, so with weights offloaded its Wait samples ORT's arena
# after the peak.
GAP = """
gap (float[512, 512] x) => (float[512, 512] y) {
  t1 = Transpose<perm = [1, 0]>(x)
  t2 = MatMul(t1, t1)
  t3 = Concat<axis = 0>(t2, t2)
  t4 = Transpose<perm = [1, 0]>(t3)
  s1, s2 = Split<axis = 1>(t4)
  m = MatMul(s1, W)
  y = MatMul(m, s2)
}
"""


MOE_H, MOE_W, MOE_E = 16, 32, 4  # hidden, expert width, experts (top-1)


def moe_text() -> str:
    """An MoE layer in ONNX text: tokens gathered per expert (NonZero of the routing
    mask), the expert's SwiGLU on them, scattered back; ``idx`` (the router's choice) is a
    graph output."""
    body = [f"""
moe (float[N, {MOE_H}] x) => (float[N, {MOE_H}] y, int64[N, 1] idx) {{
  k = Constant<value = int64[1] {{1}}>()
  zero = Constant<value = int64 {{0}}>()
  last = Constant<value = int64[1] {{-1}}>()
  logits = MatMul(x, R)
  p = Softmax<axis=-1>(logits)
  v, idx = TopK<axis=-1>(p, k)
  base = Mul(x, zeros)"""]
    acc = "base"
    for e in range(MOE_E):
        body.append(f"""
  c{e} = Constant<value = int64 {{{e}}}>()
  m{e} = Equal(idx, c{e})
  nz{e} = NonZero(m{e})
  tok{e} = Gather<axis=0>(nz{e}, zero)
  xe{e} = Gather<axis=0>(x, tok{e})
  g{e} = MatMul(xe{e}, G{e})
  u{e} = MatMul(xe{e}, U{e})
  s{e} = Sigmoid(g{e})
  a{e} = Mul(g{e}, s{e})
  h{e} = Mul(a{e}, u{e})
  d{e} = MatMul(h{e}, D{e})
  ti{e} = Unsqueeze(tok{e}, last)
  o{e} = ScatterND({acc}, ti{e}, d{e})""")
        acc = f"o{e}"
    body.append(f"  y = Identity({acc})\n}}")
    return "\n".join(body)


def moe_model(tmp: Path) -> Path:
    """:func:`moe_text` with random weights, saved as ``tmp/moe.onnx`` with external data."""
    model = onnx.parser.parse_model(f"{HEADER}\n" + moe_text())
    rng = np.random.default_rng(0)
    inits = {"R": (MOE_H, MOE_E), "zeros": (1, MOE_H)} | {
        f"{w}{e}": s for e in range(MOE_E)
        for w, s in (("G", (MOE_H, MOE_W)), ("U", (MOE_H, MOE_W)), ("D", (MOE_W, MOE_H)))}
    for name, shape in inits.items():
        arr = np.zeros(shape, np.float32) if name == "zeros" else \
            rng.standard_normal(shape).astype(np.float32)
        model.graph.initializer.append(numpy_helper.from_array(arr, name))
    onnx.checker.check_model(model)
    path = tmp / "moe.onnx"
    onnx.save(model, path, save_as_external_data=True, location="moe.onnx.data",
              size_threshold=0)
    return path
