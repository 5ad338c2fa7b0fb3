"""Optimized vs original decoder models on the same inputs, in ORT on the CPU EP.

Tolerances: with pre-packing disabled in both sessions the computation path is identical,
so outputs must be bit-exact (``exact``); with pre-packing on, the original MatMul uses a
pre-packed constant weight and the optimized one does not, so ``atol=1e-5, rtol=1e-4``.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from native_util import testing_ops
from threads import run_threads

from ho_onnx import contract
from ho_onnx.cli import main
from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.target.ort import runtime
from ho_onnx.target.ort.verify import make_session, random_inputs, verify
from models.decoder import build_decoder

FORCE_ALL = OffloadOptions(min_bytes=0, min_gap=1, prefetch_distance=2)
DIMS = {"batch": 2, "seq": 7}


pytestmark = pytest.mark.usefixtures("no_debug_hooks")


def _decoder(tmp: Path, external: bool = True, **kw) -> Path:
    path = tmp / "dec.onnx"
    build_decoder(path, external_data=external, **kw)
    return path


@pytest.mark.parametrize("execution_order", ["priority", "default"])
@pytest.mark.parametrize(
    ("layers", "hidden", "heads", "external"),
    [(1, 32, 2, False), (2, 64, 4, True), (3, 48, 3, True)],
)
def test_decoder_bit_exact_everything_offloaded(tmp_path, layers, hidden, heads, external,
                                                execution_order):
    src = _decoder(tmp_path, external, layers=layers, hidden=hidden, heads=heads)
    r = optimize(src, tmp_path / "dec.ho.onnx", FORCE_ALL, DIMS)
    n_weights = len(onnx.load(str(src), load_external_data=False).graph.initializer)
    # every initializer and every activation with a consumer is off the fast tier
    assert len(r.choice.weights) == n_weights
    assert len(r.choice.activations) > 3 * layers
    for seq in (7, 1):
        rep = verify(src, tmp_path / "dec.ho.onnx", dims={"batch": 2, "seq": seq}, runs=2,
                     execution_order=execution_order)
        assert rep.exact, rep.outputs


@pytest.mark.parametrize("past", [0, 5])
def test_decoder_with_kv_cache_bit_exact(tmp_path, past):
    """A decode step: the cache is a graph input ([batch, heads, past, head_dim]) and the
    presents outputs whose dim is the expression ``past + seq``; everything offloaded.
    Level ``disable``: at ``all`` ORT folds Transposes into FusedMatMul in the original (4
    in this model) where cache ops separate the nodes in the rewrite (measured max abs
    9e-8)."""
    src = _decoder(tmp_path, layers=2, hidden=32, heads=2, max_positions=16, kv_cache=True)
    dims = {"batch": 2, "seq": 1, "past": past}
    r = optimize(src, tmp_path / "dec.ho.onnx", FORCE_ALL, dims)
    assert r.choice.weights and r.choice.activations
    rep = verify(src, tmp_path / "dec.ho.onnx", dims=dims, runs=2, opt_level="disable")
    assert [o.name for o in rep.outputs][1:3] == ["present_key.0", "present_value.0"]
    assert rep.outputs[1].shape == (2, 2, past + 1, 16)
    assert rep.exact, rep.outputs


# A LayerNormalization written out: ORT fuses it (one kernel) when its constants are
# resident; offloaded, the unfused ops round differently (measured max abs 3.6e-7).
LAYER_NORM = """
ln (float[N, 64] x) => (float[N, 64] y) {
  h = MatMul(x, W)
  m = ReduceMean<axes=[-1]>(h)
  d = Sub(h, m)
  p = Pow(d, two)
  v = ReduceMean<axes=[-1]>(p)
  ve = Add(v, eps)
  s = Sqrt(ve)
  n = Div(d, s)
  g = Mul(n, gamma)
  y = Add(g, beta)
}
"""


def _layer_norm(path: Path, gamma_ulps: int = 0) -> Path:
    from graphs import save, text_model

    m = text_model(LAYER_NORM, W=(64, 64), gamma=(64,), beta=(64,),
                   two=np.array(2.0, np.float32), eps=np.array(1e-5, np.float32))
    if gamma_ulps:  # a model that really differs, by less than the fusion tolerance
        g = next(t for t in m.graph.initializer if t.name == "gamma")
        a = onnx.numpy_helper.to_array(g)
        for _ in range(gamma_ulps):
            a = np.nextafter(a, np.float32(np.inf))
        g.CopyFrom(onnx.numpy_helper.from_array(a, "gamma"))
    return save(m, path, external=True)


@pytest.mark.parametrize("model", ["layer norm", "kv decoder"])
def test_a_fusion_offloading_prevents_is_said_not_a_mismatch(tmp_path, model):
    """An exact rewrite whose offloaded constants keep ORT from fusing (LayerNormalization;
    Transpose into FusedMatMul) is not bit-exact at ORT's default level: verify checks both
    with graph optimizations off (bit-exact), then holds the difference to the fusion
    tolerance and says why (was: MISMATCH, exit 1, for a correct rewrite; README promised
    bit-exact by default)."""
    from ho_onnx.target.ort.verify import FUSION_ATOL, FUSION_RTOL

    if model == "layer norm":
        src, dims = _layer_norm(tmp_path / "ln.onnx"), {"N": 32}
    else:
        src = _decoder(tmp_path, layers=2, hidden=32, heads=2, max_positions=16,
                       kv_cache=True)
        dims = {"batch": 2, "seq": 1, "past": 5}
    opt = tmp_path / "opt.onnx"
    optimize(src, opt, FORCE_ALL, dims)
    rep = verify(src, opt, dims=dims, runs=2)
    assert not rep.exact and rep.exact_unfused is True and rep.ok, rep.outputs
    assert (rep.atol, rep.rtol) == (FUSION_ATOL, FUSION_RTOL)
    assert 0 < max(o.max_abs for o in rep.outputs) < 1e-6
    dim_args = [a for k, v in dims.items() for a in ("--dim", f"{k}={v}")]
    r = CliRunner().invoke(main, ["verify", str(src), str(opt), *dim_args])
    assert r.exit_code == 0, r.output
    assert ("OK (bit-exact with ORT's graph optimizations off; at --opt-level all ORT fuses "
            "kernels around constants the optimized model offloads, which round "
            "differently: compared within atol=1e-05 rtol=0.0001)") in r.output
    # graph optimizations off, or a tolerance given: judged as asked, no second check
    assert verify(src, opt, dims=dims, opt_level="disable").exact
    rep = verify(src, opt, dims=dims, atol=1e-9)
    assert not rep.ok and rep.exact_unfused is None


def test_a_small_real_difference_stays_a_mismatch(tmp_path):
    """The fusion tolerance applies only to models bit-exact unfused: a model really
    different by less than it (gamma one ulp up) is a MISMATCH, exit 1."""
    src = _layer_norm(tmp_path / "ln.onnx")
    other = _layer_norm(tmp_path / "other.onnx", gamma_ulps=1)
    rep = verify(src, other, dims={"N": 32})
    assert not rep.ok and rep.exact_unfused is False and (rep.atol, rep.rtol) == (0, 0)
    assert max(o.max_abs for o in rep.outputs) < 1e-5  # within the fusion tolerance
    r = CliRunner().invoke(main, ["verify", str(src), str(other), "--dim", "N=32"])
    assert r.exit_code == 1 and "MISMATCH (not bit-exact with ORT's graph optimizations " \
        "off either)" in r.output, r.output


def test_decoder_with_prepacking_within_tolerance(tmp_path):
    src = _decoder(tmp_path, layers=2, hidden=64, heads=4)
    optimize(src, tmp_path / "dec.ho.onnx", FORCE_ALL, DIMS)
    rep = verify(src, tmp_path / "dec.ho.onnx", dims=DIMS, prepacking=True, atol=1e-5,
                 rtol=1e-4)
    assert rep.ok, rep.outputs


def test_every_offloaded_byte_moves_on_every_run(tmp_path):
    """Nothing is folded back into a resident constant: the counters see all bytes, per run."""
    src = _decoder(tmp_path, layers=2, hidden=64, heads=4)
    # min_bytes=1: every tensor whose size the analyses know (all but two position tensors)
    r = optimize(src, tmp_path / "dec.ho.onnx",
                 OffloadOptions(min_bytes=1, min_gap=1, prefetch_distance=2), DIMS)
    assert len(r.choice.activations) > 40
    weight_bytes = sum(w.nbytes * len(w.consumers) for w in r.choice.weights)
    act_bytes = sum(a.nbytes or 0 for a in r.choice.activations)
    assert all(a.nbytes for a in r.choice.activations)  # sizes known with DIMS bound
    model = onnx.load(str(src), load_external_data=False)
    sess = runtime.InferenceSession(tmp_path / "dec.ho.onnx")
    feeds = random_inputs(model, DIMS)
    for _ in range(3):
        runtime.reset_counters()
        sess.run(None, feeds)
        c = runtime.counters()
        assert c["bytes_loaded"] == weight_bytes + act_bytes
        assert c["bytes_stored"] == act_bytes
        assert c["prefetches"] == sum(len(w.consumers) for w in r.choice.weights) + len(
            r.choice.activations)
        assert c["host_pool_bytes_in_use"] == 0


def _without_waits(path: Path, out: Path) -> None:
    """The same model with every Wait removed: consumers read the Prefetch output directly."""
    m = onnx.load(str(path), load_external_data=False)
    alias = {n.output[0]: n.input[0] for n in m.graph.node
             if n.domain == contract.DOMAIN and n.op_type == contract.WAIT}
    keep = [n for n in m.graph.node
            if not (n.domain == contract.DOMAIN and n.op_type == contract.WAIT)]
    for n in keep:
        for i, name in enumerate(n.input):
            while name in alias:
                name = alias[name]
            n.input[i] = name
    del m.graph.node[:]
    m.graph.node.extend(keep)
    onnx.save(m, str(out))


def test_waits_matter(tmp_path):
    """With slow transfers a model without its Waits reads unfinished buffers, and so does a
    Wait that does not wait; the real schedule stays exact. (This is the test that would
    catch a missing wait in the rewriter or the engine.)"""
    src = _decoder(tmp_path, layers=1, hidden=32, heads=2)
    opt = tmp_path / "dec.ho.onnx"
    optimize(src, opt, FORCE_ALL, DIMS)
    _without_waits(opt, tmp_path / "nowait.onnx")
    ops_mod = testing_ops()
    ops_mod.set_debug(delay_us=2000, poison=True)
    assert _passes(src, opt)
    assert not _passes(src, tmp_path / "nowait.onnx")
    ops_mod.set_debug(delay_us=2000, poison=True, skip_wait=True)
    assert not _passes(src, opt)


def _passes(src: Path, opt: Path) -> bool:
    """Bit-exact against the original; an error in the run counts as not passing. (In this
    process: the engine's debug settings are this process's.)"""
    try:
        return verify(src, opt, dims=DIMS, isolate=False).exact
    except ort.capi.onnxruntime_pybind11_state.Fail:
        return False
    except ort.capi.onnxruntime_pybind11_state.InvalidArgument:
        return False
    except ort.capi.onnxruntime_pybind11_state.RuntimeException:  # older onnxruntime (1.24)
        return False


def test_concurrent_runs_on_one_session(tmp_path):
    src = _decoder(tmp_path, layers=2, hidden=64, heads=4)
    opt = tmp_path / "dec.ho.onnx"
    optimize(src, opt, FORCE_ALL, DIMS)
    model = onnx.load(str(src), load_external_data=False)
    ref = make_session(src, optimized=False, providers=["CPUExecutionProvider"])
    sess = make_session(opt, optimized=True, providers=["CPUExecutionProvider"])
    inputs = [random_inputs(model, {"batch": 1 + i % 3, "seq": 3 + i % 5}, seed=i)
              for i in range(8)]
    expected = [ref.run(None, f)[0] for f in inputs]
    errors: list[str] = []

    def worker(t: int) -> None:
        for k in range(25):
            i = (t * 7 + k) % len(inputs)
            out = sess.run(None, inputs[i])[0]
            if not np.array_equal(out, expected[i]):
                errors.append(f"thread {t} run {k} input {i}")

    run_threads(worker, 4)
    assert not errors
    assert runtime.counters()["host_pool_bytes_in_use"] == 0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_repeated_runs_keep_memory_stable(tmp_path):
    src = _decoder(tmp_path, layers=2, hidden=128, heads=4)
    opt = tmp_path / "dec.ho.onnx"
    optimize(src, opt, FORCE_ALL, {"batch": 2, "seq": 16})
    model = onnx.load(str(src), load_external_data=False)
    sess = runtime.InferenceSession(opt)
    feeds = random_inputs(model, {"batch": 2, "seq": 16})
    for _ in range(30):  # warm up arenas and pools
        sess.run(None, feeds)
    gc.collect()
    base = _rss()
    for _ in range(300):
        sess.run(None, feeds)
    gc.collect()
    assert _rss() - base < 8 << 20
    assert runtime.counters()["host_pool_bytes_in_use"] == 0


def test_engine_released_with_its_session(tmp_path):
    src = _decoder(tmp_path, layers=1, hidden=32, heads=2)
    opt = tmp_path / "dec.ho.onnx"
    optimize(src, opt, FORCE_ALL, DIMS)
    gc.collect()
    alive = runtime.counters()["engines_alive"]
    store_bytes = runtime.counters()["host_store_bytes"]
    sess = runtime.InferenceSession(opt)
    assert runtime.counters()["engines_alive"] == alive + 1
    assert runtime.counters()["host_store_bytes"] > store_bytes
    del sess
    gc.collect()
    assert runtime.counters()["engines_alive"] == alive
    assert runtime.counters()["host_store_bytes"] == store_bytes


def test_plain_onnxruntime_session_with_registered_library(tmp_path):
    src = _decoder(tmp_path, layers=1, hidden=32, heads=2)
    opt = tmp_path / "dec.ho.onnx"
    optimize(src, opt, FORCE_ALL, DIMS)
    model = onnx.load(str(src), load_external_data=False)
    feeds = random_inputs(model, DIMS)
    so = ort.SessionOptions()
    # the model folder must be named before registering (issue 9: never from the node)
    so.add_session_config_entry("ho_onnx.model_dir", str(tmp_path))
    so.register_custom_ops_library(runtime.library_path())
    so.add_session_config_entry("session.disable_prepacking", "1")
    got = ort.InferenceSession(str(opt), so, providers=["CPUExecutionProvider"]).run(None, feeds)
    so0 = ort.SessionOptions()
    so0.add_session_config_entry("session.disable_prepacking", "1")
    want = ort.InferenceSession(str(src), so0, providers=["CPUExecutionProvider"]).run(None, feeds)
    assert np.array_equal(got[0], want[0])


@pytest.mark.slow
def test_acceptance_12_layer_decoder_cli(tmp_path):
    """`ho-onnx optimize` + `ho-onnx verify` on a 12-layer decoder, all tensors offloaded."""
    src = _decoder(tmp_path, layers=12, hidden=64, heads=4)
    opt = tmp_path / "dec12.ho.onnx"
    runner = CliRunner()
    r = runner.invoke(main, ["optimize", str(src), str(opt), "--offload", "all",
                             "--min-bytes", "0", "--min-gap", "1", "--dim", "batch=2",
                             "--dim", "seq=16"])
    assert r.exit_code == 0, r.output
    n_init = len(onnx.load(str(src), load_external_data=False).graph.initializer)
    assert f"{n_init} weights" in r.output
    r = runner.invoke(main, ["verify", str(src), str(opt), "--dim", "batch=2",
                             "--dim", "seq=16", "--runs", "2"])
    assert r.exit_code == 0 and "bit-exact" in r.output, r.output
    r = runner.invoke(main, ["inspect", str(opt)])
    assert r.exit_code == 0 and "transfers per run" in r.output, r.output


def test_verify_cli_reports_mismatch(tmp_path):
    src = _decoder(tmp_path, layers=1, hidden=32, heads=2)
    other = tmp_path / "other.onnx"
    build_decoder(other, layers=1, hidden=32, heads=2, seed=1)
    r = CliRunner().invoke(main, ["verify", str(src), str(other), "--dim", "batch=1",
                                  "--dim", "seq=4"])
    assert r.exit_code == 1 and "MISMATCH" in r.output


_SEQUENCES = """
g (float[4, 64] x, string[n] s) => (float[4, 64] y, string[n] s2, seq(float[?, 64]) q) {
  a = MatMul(x, W1)
  b = Relu(a)
  y = MatMul(b, W2)
  st = Constant<value = int64[1] {0}>()
  en = Constant<value = int64[1] {END}>()
  a2 = Slice(a, st, en)
  q = SequenceConstruct(y, a2)
  s2 = Identity(s)
}
"""


def test_verify_compares_sequences_and_feeds_strings(tmp_path):
    """A sequence output of tensors of different shapes is compared tensor by tensor (it was
    "unexpected ValueError") and a string input is fed (it was refused): bit-exact after the
    rewrite; a sequence that differs in a tensor's shape or values is a mismatch."""
    from graphs import save, text_model

    def model(end: int, seed: int = 0) -> onnx.ModelProto:
        return text_model(_SEQUENCES.replace("END", str(end)), seed, W1=(64, 64), W2=(64, 64))

    src, out = save(model(2), tmp_path / "m.onnx"), tmp_path / "m.ho.onnx"
    r = optimize(src, out, OffloadOptions(min_bytes=0))
    assert len(r.choice.weights) == 2
    runner = CliRunner()
    r = runner.invoke(main, ["verify", str(src), str(out), "--dim", "n=3", "--json"])
    assert r.exit_code == 0, r.output
    rows = {o["name"]: o for o in json.loads(r.stdout)["outputs"]}
    assert rows["q"]["shape"] == [2] and rows["q"]["exact"] and rows["s2"]["exact"], rows
    for other in (model(3), model(2, seed=1)):  # a2 of 3 rows; other weights
        save(other, tmp_path / "o.onnx")
        r = runner.invoke(main, ["verify", str(src), str(tmp_path / "o.onnx"), "--dim", "n=3"])
        assert r.exit_code == 1 and "MISMATCH" in r.output, r.output
        assert [ln.split()[-1] for ln in r.output.splitlines() if ln.startswith("q ")] != \
            ["exact"], r.output


def test_compare_outputs_walks_sequences_and_maps():
    """ORT returns a seq(map) (ZipMap's) as a list of dicts: compared value by value; a
    different key set or length is a mismatch, never an error."""
    from ho_onnx.target.ort.verify import compare_outputs

    a = [{"x": np.float32(1.0), "y": np.float32(2.0)}, {"x": np.float32(3.0), "y": np.float32(0)}]
    same = compare_outputs("p", a, [dict(d) for d in a])
    assert same.exact and same.close and same.shape == (2,)
    off = compare_outputs("p", a, [a[0], {"x": np.float32(3.5), "y": np.float32(0)}])
    assert not off.exact and off.max_abs == 0.5
    assert compare_outputs("p", a, [a[0], {"x": np.float32(3.0)}]).max_abs == np.inf
    assert compare_outputs("p", a, a[:1]).max_abs == np.inf
    assert compare_outputs("p", a, np.zeros(2)).max_abs == np.inf  # a tensor for a sequence
    empty = compare_outputs("q", [], [])
    assert empty.exact and empty.shape == (0,)
    ragged = [np.ones((2, 3), np.float32), np.ones((1, 3), np.float32)]
    assert compare_outputs("r", ragged, [r.copy() for r in ragged]).exact
    near = compare_outputs("r", ragged, [ragged[0], ragged[1] + 1e-6], atol=1e-5)
    assert near.close and not near.exact


def test_a_scalar_output_that_differs_is_a_mismatch_not_an_error():
    """A 0-d output (ReduceSum keepdims=0) that differs: was "unexpected TypeError: 'numpy.
    float64' object does not support item assignment" on any mismatch."""
    from ho_onnx.target.ort.verify import compare_outputs

    d = compare_outputs("s", np.array(1.0, np.float32), np.array(1.5, np.float32))
    assert (d.shape, d.max_abs, d.exact, d.close) == ((), 0.5, False, False)
    assert compare_outputs("s", np.array(np.nan), np.array(np.nan)).exact
    assert compare_outputs("s", np.array(1.0), np.array(1.0 + 1e-9), atol=1e-6).close
