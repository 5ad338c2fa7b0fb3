"""Forward models for ``generate_artifacts`` (onnx helper, seeded random weights), and
training them through ``onnxruntime.training.api`` (needs onnxruntime-training): shared by
tests/training/test_train_api.py and bench/train_offload.py."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F = TensorProto.FLOAT


def mlp(layers: int = 6, hidden: int = 1024, batch: int = 512, classes: int = 10,
        seed: int = 0) -> onnx.ModelProto:
    """``layers`` Linear layers (MatMul + bias Add) with ReLU between, ``hidden`` wide."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        out = classes if i == layers - 1 else hidden
        inits += [numpy_helper.from_array(
            (rng.standard_normal((hidden, out)) / np.sqrt(hidden)).astype(np.float32), f"w{i}"),
            numpy_helper.from_array(np.zeros(out, np.float32), f"b{i}")]
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"mm{i}"]))
        y = "logits" if i == layers - 1 else f"a{i}"
        nodes.append(helper.make_node("Add", [f"mm{i}", f"b{i}"], [y]))
        if i < layers - 1:
            nodes.append(helper.make_node("Relu", [y], [f"h{i}"]))
            x = f"h{i}"
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", F, [batch, hidden])],
                          [helper.make_tensor_value_info("logits", F, [batch, classes])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def block(batch: int = 2, seq: int = 256, dim: int = 64, heads: int = 4, ffn: int = 256,
          vocab: int = 32, seed: int = 0) -> onnx.ModelProto:
    """A pre-norm transformer block (LayerNormalization, attention with Softmax, a GELU MLP
    with com.microsoft Gelu, residuals) and an output projection; at this ``seq`` the
    attention scores (``batch*heads*seq*seq``) dominate the activations."""
    rng = np.random.default_rng(seed)
    hd = dim // heads
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def weight(name: str, shape: tuple[int, int]) -> str:
        a = rng.standard_normal(shape) / np.sqrt(shape[0])
        inits.append(numpy_helper.from_array(a.astype(np.float32), name))
        return name

    def const(name: str, value: np.ndarray) -> str:
        nodes.append(helper.make_node("Constant", [], [name],
                                      value=numpy_helper.from_array(value, name)))
        return name

    def node(op: str, ins: list[str], out: str, domain: str = "", **kw: object) -> str:
        nodes.append(helper.make_node(op, ins, [out], domain=domain, **kw))
        return out

    for i in (1, 2):
        inits += [numpy_helper.from_array(np.ones(dim, np.float32), f"ln{i}.w"),
                  numpy_helper.from_array(np.zeros(dim, np.float32), f"ln{i}.b")]
    nodes.append(helper.make_node("LayerNormalization", ["x", "ln1.w", "ln1.b"],
                                  ["ln1", "ln1.mean", "ln1.rstd"], axis=-1))
    split = const("heads_shape", np.array([batch, seq, heads, hd], np.int64))
    for p in "qkv":
        node("MatMul", ["ln1", weight(f"w{p}", (dim, dim))], f"{p}0")
        node("Reshape", [f"{p}0", split], f"{p}1")
        node("Transpose", [f"{p}1"], p, perm=[0, 2, 3, 1] if p == "k" else [0, 2, 1, 3])
    node("MatMul", ["q", "k"], "scores")
    node("Mul", ["scores", const("scale", np.array(1 / np.sqrt(hd), np.float32))], "scaled")
    node("Softmax", ["scaled"], "probs", axis=-1)
    node("MatMul", ["probs", "v"], "ctx0")
    node("Transpose", ["ctx0"], "ctx1", perm=[0, 2, 1, 3])
    node("Reshape", ["ctx1", const("model_shape", np.array([batch, seq, dim], np.int64))],
         "ctx")
    node("MatMul", ["ctx", weight("wo", (dim, dim))], "attn")
    node("Add", ["x", "attn"], "r1")
    nodes.append(helper.make_node("LayerNormalization", ["r1", "ln2.w", "ln2.b"],
                                  ["ln2", "ln2.mean", "ln2.rstd"], axis=-1))
    node("MatMul", ["ln2", weight("w1", (dim, ffn))], "f0")
    node("Gelu", ["f0"], "f1", domain="com.microsoft")
    node("MatMul", ["f1", weight("w2", (ffn, dim))], "f2")
    node("Add", ["r1", "f2"], "r2")
    node("MatMul", ["r2", weight("wh", (dim, vocab))], "logits3")
    # (the loss wants [N, classes])
    node("Reshape", ["logits3", const("rows", np.array([batch * seq, vocab], np.int64))],
         "logits")
    g = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", F,
                                                                         [batch, seq, dim])],
                          [helper.make_tensor_value_info("logits", F, [batch * seq, vocab])],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                               helper.make_opsetid("com.microsoft", 1)],
                             ir_version=9)


def artifacts(model: onnx.ModelProto, out: Path) -> Path:
    """``generate_artifacts`` of ``model`` into ``out``: every initializer trained, mean
    cross-entropy loss, AdamW."""
    from onnxruntime.training import artifacts as art

    out.mkdir(parents=True, exist_ok=True)
    art.generate_artifacts(model, requires_grad=[t.name for t in model.graph.initializer],
                           loss=art.LossType.CrossEntropyLoss, optimizer=art.OptimType.AdamW,
                           artifact_directory=str(out))
    return out


@dataclass
class Trained:
    """What ``steps`` training steps gave: each step's loss, every parameter after, the
    eval model's loss on the last batch, and each step's seconds."""

    losses: list[float]
    params: np.ndarray
    eval_loss: float
    step_s: list[float] = field(default_factory=list)


def batches(model: onnx.ModelProto, steps: int, classes: int, seed: int = 1
            ) -> list[tuple[np.ndarray, np.ndarray]]:
    """``steps`` seeded (input, labels) pairs for ``model``'s input and output shapes."""
    rng = np.random.default_rng(seed)

    def dims(vi: onnx.ValueInfoProto) -> list[int]:
        return [d.dim_value for d in vi.type.tensor_type.shape.dim]

    x, logits = dims(model.graph.input[0]), dims(model.graph.output[0])
    return [(rng.standard_normal(x).astype(np.float32),
             rng.integers(0, classes, logits[:-1]).astype(np.int64)) for _ in range(steps)]


def train(folder: Path, train_model: Path, data: list[tuple[np.ndarray, np.ndarray]],
          options: Callable[[Path], object] | None = None,
          ready: Callable[[], None] | None = None,
          trained: Callable[[], None] | None = None) -> Trained:
    """Train from ``folder``'s checkpoint with ``train_model`` (and ``folder``'s eval and
    optimizer models): one optimizer step per batch. ``options(model_path)`` gives the
    session options (ho-onnx's, to load the library) or None; ``ready()`` is called once
    Module and Optimizer exist, before the first step, ``trained()`` after the last (the
    sessions still alive)."""
    from onnxruntime.training import api

    state = api.CheckpointState.load_checkpoint(os.fspath(folder / "checkpoint"))
    so = options(train_model) if options is not None else None
    module = api.Module(os.fspath(train_model), state, os.fspath(folder / "eval_model.onnx"),
                        "cpu", session_options=so)
    opt = api.Optimizer(os.fspath(folder / "optimizer_model.onnx"), module)
    if ready is not None:
        ready()
    losses, secs = [], []
    for x, y in data:
        module.train()
        t = time.perf_counter()
        loss = module(x, y)
        opt.step()
        module.lazy_reset_grad()
        secs.append(time.perf_counter() - t)
        losses.append(float(loss))
    if trained is not None:
        trained()
    module.eval()
    eval_loss = float(module(*data[-1]))
    return Trained(losses, module.get_contiguous_parameters(trainable_only=False).numpy(),
                   eval_loss, secs)


def offload_budget(path: Path) -> int:
    """A budget the planner must offload for: three quarters of ``path``'s peak, or halfway
    between its smallest feasible budget and its peak where that is below the smallest."""
    from ho_onnx import OffloadOptions, plan_model
    from ho_onnx.schedule.planner import InfeasibleBudgetError

    _, _, plan = plan_model(path, OffloadOptions(budget=1 << 40))
    peak = plan.baseline.peak_bytes
    try:
        plan_model(path, OffloadOptions(budget=peak * 3 // 4))
    except InfeasibleBudgetError as e:
        return (e.min_budget + peak) // 2
    return peak * 3 // 4


def kernels(path: Path, options: Callable[[Path], object]) -> dict[tuple[str, str], int]:
    """The operators ORT runs for ``path`` after its graph optimizations (cache ops left
    out), with their counts: two models run the same kernels when these are equal."""
    import collections
    import tempfile

    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        so = options(path)
        so.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
        ort.InferenceSession(os.fspath(path), so, providers=["CPUExecutionProvider"])
        m = onnx.load(so.optimized_model_filepath, load_external_data=False)
    return dict(collections.Counter((n.domain, n.op_type) for n in m.graph.node
                                    if n.domain != "ai.hyperoffload"))
