"""The cache operators (domain ai.hyperoffload) against docs/design.md, run in ORT on the CPU.

Graphs are written by hand (ONNX text or onnx.helper); no rewriter involved.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest
from native_util import hnode, make_model, testing_ops
from onnx import TensorProto, helper

from ho_onnx import contract
from ho_onnx.target.ort import runtime

D = contract.DOMAIN
OPSETS = f'["" : 21, "{D}" : 1]'

# Element types the library registers, and their bits. COMPLEX64/COMPLEX128 are refused by
# onnxruntime 1.31 for custom ops ("tensor type 14 is not supported"), so they are absent.
TYPES = {
    "float": (TensorProto.FLOAT, 32),
    "uint8": (TensorProto.UINT8, 8),
    "int8": (TensorProto.INT8, 8),
    "uint16": (TensorProto.UINT16, 16),
    "int16": (TensorProto.INT16, 16),
    "int32": (TensorProto.INT32, 32),
    "int64": (TensorProto.INT64, 64),
    "bool": (TensorProto.BOOL, 8),
    "float16": (TensorProto.FLOAT16, 16),
    "double": (TensorProto.DOUBLE, 64),
    "uint32": (TensorProto.UINT32, 32),
    "uint64": (TensorProto.UINT64, 64),
    "bfloat16": (TensorProto.BFLOAT16, 16),
    "float8e4m3fn": (TensorProto.FLOAT8E4M3FN, 8),
    "float8e4m3fnuz": (TensorProto.FLOAT8E4M3FNUZ, 8),
    "float8e5m2": (TensorProto.FLOAT8E5M2, 8),
    "float8e5m2fnuz": (TensorProto.FLOAT8E5M2FNUZ, 8),
    "uint4": (TensorProto.UINT4, 4),
    "int4": (TensorProto.INT4, 4),
    "float4e2m1": (TensorProto.FLOAT4E2M1, 4),
}


def nbytes(numel: int, bits: int) -> int:
    return (numel * bits + 7) // 8


def save(model: onnx.ModelProto, directory, name: str = "model.onnx") -> str:
    path = os.path.join(str(directory), name)
    onnx.save(model, path)
    return path


def raw_outputs(sess: ort.InferenceSession, names: list[str], feeds=None) -> list[bytes]:
    """Output bytes, for types numpy cannot hold (bfloat16, int4, float4...)."""
    values = sess.run_with_ort_values(names, feeds or {})
    return [ctypes.string_at(v.data_ptr(), v.tensor_size_in_bytes()) for v in values]


def weight_attrs(location, offset, length, shape, name="W"):
    return dict(location=location, offset=offset, length=length, shape=shape, name=name)


@pytest.fixture(autouse=True)
def _no_debug_hooks():
    testing_ops().set_debug()
    yield
    testing_ops().set_debug()


# --------------------------------------------------------------------------------------------
# The library and the runtime helper


def test_build_info_and_library():
    info = runtime.build_info()
    assert info["ort_api_version"] == 21
    assert isinstance(info["cuda_compiled"], bool)
    assert info["version"]
    assert info["cxx_compiler"]
    assert list(info["element_types"]) == list(TYPES)
    assert os.path.isfile(runtime.library_path())
    assert runtime._ops().cuda_device_count() >= 0
    keys = {
        "bytes_loaded",
        "bytes_stored",
        "prefetches",
        "stores",
        "waits",
        "wait_ns",
        "host_store_bytes",
        "host_pool_bytes_in_use",
        "host_pool_bytes_reserved",
        "engines_alive",
    }
    assert keys <= set(runtime.counters())


def test_session_options_copies_base_and_sets_model_dir(tmp_path):
    base = ort.SessionOptions()
    base.add_session_config_entry("session.disable_prepacking", "1")
    base.intra_op_num_threads = 2
    so = runtime.session_options(tmp_path / "m.onnx", base=base)
    assert so.get_session_config_entry("session.disable_prepacking") == "1"
    assert so.get_session_config_entry(contract.CONFIG_MODEL_DIR) == str(tmp_path.resolve())
    assert so.intra_op_num_threads == 2
    assert so.execution_order == ort.ExecutionOrder.PRIORITY_BASED
    assert base.execution_order == ort.ExecutionOrder.DEFAULT  # base untouched
    so2 = runtime.session_options(execution_order="default")
    assert so2.execution_order == ort.ExecutionOrder.DEFAULT
    with pytest.raises(ValueError):
        runtime.session_options(execution_order="fastest")


# --------------------------------------------------------------------------------------------
# Every element type: Store -> Detach -> Prefetch -> Wait, and a weight Prefetch -> Wait


@pytest.mark.parametrize("tname", list(TYPES))
def test_round_trip_every_type(tname, tmp_path):
    ttype, bits = TYPES[tname]
    rng = np.random.default_rng(abs(hash(tname)) % 2**32)
    n = 7  # odd: sub-byte types end in half a byte
    size = nbytes(n, bits)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    if tname == "bool":
        data = data % 2
    wdata = rng.integers(0, 256, size, dtype=np.uint8)
    if tname == "bool":
        wdata = wdata % 2
    offset = 5  # unaligned on purpose
    with open(tmp_path / "weights.bin", "wb") as f:
        f.write(b"\xee" * offset)
        wdata.tofile(f)
        f.write(b"\xee" * 3)

    inits = [
        helper.make_tensor("c", ttype, [n], data.tobytes(), raw=True),
        helper.make_tensor("s0", ttype, [0], b"", raw=True),
    ]
    nodes = [
        hnode("Store", ["c"], ["t"]),
        hnode("Detach", ["c", "t"], ["t2"]),
        hnode("Prefetch", ["t2"], ["y"]),
        hnode("Prefetch", ["s0", "t"], ["wy"], **weight_attrs("weights.bin", offset, size, [n])),
        hnode("Wait", ["y"], ["z"]),
        hnode("Wait", ["wy", "z"], ["w"]),
    ]
    outs = [
        helper.make_tensor_value_info("z", ttype, None),
        helper.make_tensor_value_info("w", ttype, None),
        helper.make_tensor_value_info("t2", ttype, None),
    ]
    path = save(make_model(nodes, [], outs, inits), tmp_path)
    for order in ("default", "priority"):
        sess = runtime.InferenceSession(path, execution_order=order)
        for _ in range(3):
            z, w, tok = raw_outputs(sess, ["z", "w", "t2"])
            assert z == data.tobytes()
            assert w == wdata.tobytes()
            assert len(tok) == 16
        shapes = {o.name: o.shape for o in sess.get_outputs()}
        assert shapes  # typed outputs were accepted


@pytest.mark.parametrize("order", ["default", "priority"])
def test_graph_inputs_numpy_types(order, tmp_path):
    for dtype in (np.float32, np.float64, np.int8, np.uint16, np.int64, np.bool_, np.float16):
        ttype = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        nodes = [
            hnode("Store", ["x"], ["t"]),
            hnode("Detach", ["x", "t"], ["t2"]),
            hnode("Prefetch", ["t2"], ["y"]),
            hnode("Wait", ["y"], ["z"]),
        ]
        m = make_model(
            nodes,
            [helper.make_tensor_value_info("x", ttype, [2, 3, 4])],
            [helper.make_tensor_value_info("z", ttype, None)],
        )
        sess = runtime.InferenceSession(save(m, tmp_path), execution_order=order)
        x = (np.random.default_rng(1).random((2, 3, 4)) * 100).astype(dtype)
        (z,) = sess.run(None, {"x": x})
        assert z.dtype == x.dtype and z.shape == x.shape
        assert z.tobytes() == x.tobytes()


# --------------------------------------------------------------------------------------------
# Shapes: scalars, empty tensors


def test_scalar_and_empty(tmp_path):
    np.arange(4, dtype=np.float32).tofile(tmp_path / "w.bin")
    inits = [helper.make_tensor("s0", TensorProto.FLOAT, [0], [])]
    nodes = [
        hnode("Store", ["x"], ["t"]),
        hnode("Detach", ["x", "t"], ["t2"]),
        hnode("Prefetch", ["t2"], ["y"]),
        hnode("Wait", ["y"], ["z"]),
        hnode("Store", ["e"], ["te"]),
        hnode("Detach", ["e", "te"], ["te2"]),
        hnode("Prefetch", ["te2"], ["ey"]),
        hnode("Wait", ["ey"], ["ez"]),
        hnode("Prefetch", ["s0"], ["sy"], location="w.bin", offset=8, length=4, name="S"),
        hnode("Wait", ["sy"], ["sz"]),
        hnode("Prefetch", ["s0"], ["ny"], **weight_attrs("w.bin", 16, 0, [0, 5], "N")),
        hnode("Wait", ["ny"], ["nz"]),
    ]
    # a scalar weight: shape=[] (an empty list needs its attribute type spelled out)
    nodes[8].attribute.append(
        helper.make_attribute("shape", [], attr_type=onnx.AttributeProto.INTS)
    )
    f = TensorProto.FLOAT
    m = make_model(
        nodes,
        [helper.make_tensor_value_info("x", f, []), helper.make_tensor_value_info("e", f, [0, 3])],
        [helper.make_tensor_value_info(n, f, None) for n in ("z", "ez", "sz", "nz")],
        inits,
    )
    sess = runtime.InferenceSession(save(m, tmp_path))
    before = runtime.counters()
    z, ez, sz, nz = sess.run(
        None, {"x": np.array(3.5, np.float32), "e": np.zeros((0, 3), np.float32)}
    )
    assert z.shape == () and z == np.float32(3.5)
    assert ez.shape == (0, 3)
    assert sz.shape == () and sz == np.float32(2.0)
    assert nz.shape == (0, 5)
    after = runtime.counters()
    assert after["host_pool_bytes_in_use"] == before["host_pool_bytes_in_use"] == 0


# --------------------------------------------------------------------------------------------
# Aliasing: Wait's output is its input when ORT honours GetAliasMap, a copy otherwise


def _alias_model(z_is_output: bool) -> onnx.ModelProto:
    outs = "float[64] out, float[64] z" if z_is_output else "float[64] out"
    return onnx.parser.parse_model(f"""
    <ir_version: 10, opset_import: {OPSETS}>
    g (float[64] x) => ({outs}) {{
      t = {D}.Store(x)
      h = Mul(x, x)
      t2 = {D}.Detach(x, t, h)
      y = {D}.Prefetch(t2)
      z = {D}.Wait(y)
      out = Add(z, h)
    }}
    """)


@pytest.mark.parametrize("order", ["default", "priority"])
@pytest.mark.parametrize("z_is_output", [False, True])
def test_wait_alias_and_copy(tmp_path, order, z_is_output):
    sess = runtime.InferenceSession(
        save(_alias_model(z_is_output), tmp_path), execution_order=order
    )
    x = np.random.default_rng(0).random(64).astype(np.float32)
    runtime.reset_counters()
    res = sess.run(None, {"x": x})
    np.testing.assert_array_equal(res[0], x + x * x)
    copies = runtime.counters()["alias_copies"]
    if z_is_output:
        np.testing.assert_array_equal(res[1], x)
        assert copies >= 1  # ORT gives a graph output its own buffer: the copy path ran
    else:
        assert copies == 0  # intermediate: z is y (sequential executor honours the alias)


def _fence_model(tname: str, y_is_output: bool) -> onnx.ModelProto:
    outs = f"{tname}[64] out, {tname}[64] y" if y_is_output else f"{tname}[64] out"
    return onnx.parser.parse_model(f"""
    <ir_version: 10, opset_import: {OPSETS}>
    g ({tname}[64] x) => ({outs}) {{
      a = Concat<axis = 0>(x)
      b = Identity(a)
      y = {D}.Fence(a, b)
      out = Concat<axis = 0>(y)
    }}
    """)


@pytest.mark.parametrize("tname", ["float", "int64", "bool", "float16", "double"])
@pytest.mark.parametrize("y_is_output", [False, True])
def test_fence_is_its_input(tmp_path, tname, y_is_output):
    """A Fence's output is its input: ORT aliases the two (no copy) for an intermediate, and
    the library copies where ORT gives the output its own buffer (a graph output; also a
    Fence of a graph input or an initializer, which ORT never aliases)."""
    sess = runtime.InferenceSession(save(_fence_model(tname, y_is_output), tmp_path))
    rng = np.random.default_rng(0)
    x = (rng.random(64) * 100).astype(helper.tensor_dtype_to_np_dtype(TYPES[tname][0]))
    runtime.reset_counters()
    res = sess.run(None, {"x": x})
    for r in res:
        np.testing.assert_array_equal(r, x)
    assert (runtime.counters()["alias_copies"] >= 1) == y_is_output


def test_fence_keeps_a_recomputation_apart_from_the_first(tmp_path):
    """Two Relus of the same input are one to ORT's common subexpression elimination; one
    reading its input through a Fence stays a second node at every optimization level (what
    a recomputed activation relies on: schedule/recompute.py)."""
    m = onnx.parser.parse_model(f"""
    <ir_version: 10, opset_import: {OPSETS}>
    g (float[64] x) => (float[64] out) {{
      a = Relu(x)
      s = Sigmoid(a)
      f = {D}.Fence(x, s)
      b = Relu(f)
      out = Add(s, b)
    }}
    """)
    plain = onnx.parser.parse_model(f"""
    <ir_version: 10, opset_import: {OPSETS}>
    g (float[64] x) => (float[64] out) {{
      a = Relu(x)
      s = Sigmoid(a)
      b = Relu(x)
      out = Add(s, b)
    }}
    """)
    x = np.random.default_rng(1).standard_normal(64).astype(np.float32)
    outs = []
    for model, relus in ((m, 2), (plain, 1)):
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.optimized_model_filepath = str(tmp_path / "opt.onnx")
        outs.append(runtime.InferenceSession(save(model, tmp_path), sess_options=so).run(
            None, {"x": x})[0])
        ops = [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]
        assert ops.count("Relu") == relus, ops
    np.testing.assert_array_equal(*outs)


def test_parallel_execution_mode(tmp_path):
    so = ort.SessionOptions()
    so.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    sess = runtime.InferenceSession(save(_alias_model(True), tmp_path), sess_options=so)
    x = np.random.default_rng(0).random(64).astype(np.float32)
    for _ in range(5):
        out, z = sess.run(None, {"x": x})
        np.testing.assert_array_equal(out, x + x * x)
        np.testing.assert_array_equal(z, x)


# --------------------------------------------------------------------------------------------
# Model directory: the session config entry, else the base_dir attribute


def _weight_model(location="w.bin", offset=0, length=64, shape=(16,), base_dir=None):
    attrs = weight_attrs(location, offset, length, list(shape), "layer.weight")
    if base_dir is not None:
        attrs["base_dir"] = str(base_dir)
    nodes = [hnode("Prefetch", ["s0"], ["wy"], **attrs), hnode("Wait", ["wy"], ["w"])]
    return make_model(
        nodes,
        [],
        [helper.make_tensor_value_info("w", TensorProto.FLOAT, None)],
        [helper.make_tensor("s0", TensorProto.FLOAT, [0], [])],
    )


def test_base_dir_is_never_used(tmp_path):
    # issue 9: the absolute base_dir written in the node is never read; a model given as
    # bytes with offloaded weights needs the folder set explicitly
    w = np.arange(16, dtype=np.float32)
    w.tofile(tmp_path / "w.bin")
    m = _weight_model(base_dir=tmp_path)
    with pytest.raises(Exception, match=r"ho_onnx\.model_dir"):
        runtime.InferenceSession(m.SerializeToString())


def test_config_entry_wins_over_base_dir(tmp_path):
    w = np.arange(16, dtype=np.float32) * 2
    w.tofile(tmp_path / "w.bin")
    path = save(_weight_model(base_dir="/nonexistent/dir"), tmp_path)
    sess = runtime.InferenceSession(path)
    np.testing.assert_array_equal(sess.run(None, {})[0], w)


def test_no_model_dir_at_all(tmp_path):
    m = _weight_model()
    with pytest.raises(Exception, match="no model directory"):
        runtime.InferenceSession(m.SerializeToString())
    # a plain ORT session with the library: the library's error names a function that exists
    # (found by hand: it named ho_onnx.runtime.session_options, a module since moved)
    path = save(_weight_model(), tmp_path)
    so = ort.SessionOptions()
    so.register_custom_ops_library(runtime.library_path())
    with pytest.raises(Exception, match=r"\(ho_onnx\.session_options\(model_path\) does;"):
        ort.InferenceSession(path, so)
    import ho_onnx
    assert ho_onnx.session_options is runtime.session_options


# --------------------------------------------------------------------------------------------
# Bad attributes fail at session creation with a message naming the weight and the problem


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(location="../../etc/passwd", length=64), "escapes the model directory"),
        (dict(location="sub/../../model/w.bin"), "escapes the model directory"),
        (dict(location="/etc/passwd"), "must be relative"),
        (dict(location="link.bin"), "symbolic links"),
        (dict(offset=64), "past the end"),
        (dict(offset=-1), "negative offset"),
        (dict(length=60), "does not match shape"),
        (dict(location="missing.bin"), "does not exist"),
        (dict(location="sub"), "not a regular file"),
    ],
)
def test_bad_weight_attributes(hostile_model_dir, kwargs, message):
    model_dir = hostile_model_dir
    path = save(_weight_model(**kwargs), model_dir)
    with pytest.raises(Exception, match=message) as info:
        runtime.InferenceSession(path)
    assert "layer.weight" in str(info.value)
    # the process is fine and a good model still loads afterwards
    sess = runtime.InferenceSession(save(_weight_model(), model_dir, "good.onnx"))
    assert sess.run(None, {})[0].shape == (16,)


def test_weight_inside_subdirectory(tmp_path):
    (tmp_path / "data").mkdir()
    w = np.arange(16, dtype=np.float32)
    w.tofile(tmp_path / "data" / "w.bin")
    sess = runtime.InferenceSession(save(_weight_model(location="data/../data/w.bin"), tmp_path))
    np.testing.assert_array_equal(sess.run(None, {})[0], w)


# --------------------------------------------------------------------------------------------
# Runtime errors become ORT errors (no crash), and the session stays usable


def test_wait_without_prefetch_is_an_error(tmp_path):
    m = onnx.parser.parse_model(f"""
    <ir_version: 10, opset_import: {OPSETS}>
    g (float[4] x) => (float[4] z) {{
      z = {D}.Wait(x)
    }}
    """)
    sess = runtime.InferenceSession(save(m, tmp_path))
    with pytest.raises(Exception, match="no transfer pending"):
        sess.run(None, {"x": np.zeros(4, np.float32)})


@pytest.mark.parametrize("op", ["Prefetch", "Detach"])
def test_bad_token_is_an_error(tmp_path, op):
    body = "y = {D}.Prefetch(tok)" if op == "Prefetch" else "y = {D}.Detach(tok, tok)"
    m = onnx.parser.parse_model(
        f"""
    <ir_version: 10, opset_import: {OPSETS}>
    g (float[{{n}}] tok) => (float[{{n}}] y) {{
      {body.format(D=D)}
    }}
    """.replace("{n}", "4")
    )
    sess = runtime.InferenceSession(save(m, tmp_path))
    with pytest.raises(Exception, match=r"no (stored tensor|pending store)"):
        sess.run(None, {"tok": np.zeros(4, np.float32)})
    with pytest.raises(Exception, match="16-byte"):
        sess2_model = onnx.parser.parse_model(
            onnx.printer.to_text(m).replace("float[4]", "float[3]")
        )
        runtime.InferenceSession(save(sess2_model, tmp_path, "m3.onnx")).run(
            None, {"tok": np.zeros(3, np.float32)}
        )
    # a forged token with the right magic but an unknown id
    forged = np.frombuffer(
        np.array([123456789, 0x4B545F584E4E4F48], np.uint64).tobytes(), np.float32
    )
    with pytest.raises(Exception, match=r"no (stored tensor|pending store)"):
        sess.run(None, {"tok": forged.copy()})


def test_token_reused_twice_is_an_error(tmp_path):
    m = onnx.parser.parse_model(f"""
    <ir_version: 10, opset_import: {OPSETS}>
    g (float[4] x) => (float[4] z1, float[4] z2) {{
      t = {D}.Store(x)
      t2 = {D}.Detach(x, t)
      y1 = {D}.Prefetch(t2)
      z1 = {D}.Wait(y1)
      y2 = {D}.Prefetch(t2, z1)
      z2 = {D}.Wait(y2)
    }}
    """)
    sess = runtime.InferenceSession(save(m, tmp_path))
    with pytest.raises(Exception, match="already reloaded"):
        sess.run(None, {"x": np.ones(4, np.float32)})


# --------------------------------------------------------------------------------------------
# Prefetch's optional second output `issued`: a [0] tensor of T that orders the next Prefetch
# of the channel (FIFO) without keeping the full-size `y` alive


def _issued_chain_model(n: int, ttype=TensorProto.FLOAT, bits=32, numel=16, declare_last=True):
    """n weight Prefetches, each taking the previous one's `issued` as its ordering input;
    then a Store/Detach/Prefetch reload that also chains on `issued`."""
    size = nbytes(numel, bits)
    nodes, outs = [], []
    prev = None
    for i in range(n):
        deps = ["s0"] + ([prev] if prev else [])
        issued = f"i{i}" if (declare_last or i < n - 1) else ""
        y_outs = [f"y{i}", issued] if issued else [f"y{i}"]
        nodes.append(hnode("Prefetch", deps, y_outs,
                           **weight_attrs("w.bin", i * size, size, [numel], f"W{i}")))
        nodes.append(hnode("Wait", [f"y{i}"], [f"w{i}"]))
        outs.append(helper.make_tensor_value_info(f"w{i}", ttype, None))
        prev = issued or prev
    nodes += [
        hnode("Store", ["x"], ["t"]),
        hnode("Detach", ["x", "t"], ["t2"]),
        hnode("Prefetch", ["t2", prev], ["ry", "ri"]),
        hnode("Wait", ["ry"], ["rz"]),
    ]
    outs += [helper.make_tensor_value_info("rz", ttype, None),
             helper.make_tensor_value_info("ri", ttype, None)]
    return make_model(nodes, [helper.make_tensor_value_info("x", ttype, [numel])], outs,
                      [helper.make_tensor("s0", ttype, [0], b"", raw=True)])


@pytest.mark.parametrize("order", ["default", "priority"])
@pytest.mark.parametrize("declare_last", [True, False])
def test_issued_output_orders_the_next_prefetch(tmp_path, order, declare_last):
    n, numel = 4, 16
    rng = np.random.default_rng(7)
    w = rng.random(n * numel).astype(np.float32)
    w.tofile(tmp_path / "w.bin")
    m = _issued_chain_model(n, numel=numel, declare_last=declare_last)
    sess = runtime.InferenceSession(save(m, tmp_path), execution_order=order)
    x = rng.random(numel).astype(np.float32)
    testing_ops().set_debug(delay_us=2000, poison=True)  # a late copy would show as NaN
    for _ in range(3):
        res = sess.run(None, {"x": x})
        for i in range(n):
            assert res[i].tobytes() == w[i * numel:(i + 1) * numel].tobytes()
        assert res[n].tobytes() == x.tobytes()
        issued = res[n + 1]
        assert issued.dtype == np.float32 and issued.shape == (0,)


@pytest.mark.parametrize("tname", ["float16", "int64", "bool", "uint4", "bfloat16"])
def test_issued_output_has_the_element_type_and_no_bytes(tmp_path, tname):
    ttype, bits = TYPES[tname]
    numel = 6
    size = nbytes(numel, bits)
    data = np.random.default_rng(3).integers(0, 2 if tname == "bool" else 256,
                                             2 * size, dtype=np.uint8)
    data.tofile(tmp_path / "w.bin")
    nodes = [
        hnode("Prefetch", ["s0"], ["y0", "i0"], **weight_attrs("w.bin", 0, size, [numel], "A")),
        hnode("Prefetch", ["s0", "i0"], ["y1", "i1"],
              **weight_attrs("w.bin", size, size, [numel], "B")),
        hnode("Wait", ["y0"], ["w0"]),
        hnode("Wait", ["y1"], ["w1"]),
    ]
    outs = [helper.make_tensor_value_info(n, ttype, None) for n in ("w0", "w1", "i1")]
    m = make_model(nodes, [], outs, [helper.make_tensor("s0", ttype, [0], b"", raw=True)])
    sess = runtime.InferenceSession(save(m, tmp_path))
    w0, w1, i1 = raw_outputs(sess, ["w0", "w1", "i1"])
    assert w0 == data[:size].tobytes() and w1 == data[size:].tobytes()
    assert i1 == b""
    (v,) = sess.run_with_ort_values(["i1"], {})
    assert v.shape() == [0]


def test_issued_is_optional_in_the_schema(tmp_path):
    """Only Prefetch has the optional second output: Wait, Store and Detach have one."""
    for op, args in (("Wait", "x"), ("Store", "x")):
        m = onnx.parser.parse_model(f"""
        <ir_version: 10, opset_import: {OPSETS}>
        g (float[4] x) => (float[4] z) {{
          z, extra = {D}.{op}({args})
        }}
        """)
        with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidGraph,
                           match="output size 2 not in range"):
            runtime.InferenceSession(save(m, tmp_path))
