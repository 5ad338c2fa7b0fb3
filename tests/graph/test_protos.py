"""``graph.protos.graph_inputs``: a ModelProto's graph inputs read from its bytes without
parsing its initializers (what ``cpu_arena="auto"`` reads before a session is made)."""

from __future__ import annotations

import contextlib

import numpy as np
import onnx
import pytest
from graphs import chain_model, text_model
from onnx import helper, numpy_helper

from ho_onnx.graph.protos import graph_inputs, model_metadata


def _full(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {t.name for t in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in inits]


def test_the_inputs_are_those_a_full_parse_finds():
    legacy = chain_model()  # (IR 3: every initializer also listed as an input)
    legacy.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                              for t in legacy.graph.initializer)
    big = text_model("g (float[N, 1024] x, int64[2] s) => (float[N, 1024] y) "
                     "{ y = MatMul(x, W) }", W=(1024, 1024))  # (4 MiB inline)
    for m in (chain_model(), legacy, big):
        got = graph_inputs(m.SerializeToString())
        assert [v.SerializeToString() for v in got] == \
            [v.SerializeToString() for v in _full(m)]
    assert [v.name for v in graph_inputs(big.SerializeToString())] == ["x", "s"]


def test_the_initializers_data_is_skipped_not_read():
    """A tensor's data is skipped whole, never parsed (its raw_data here is no valid varint
    stream); its name still takes it out of the inputs."""
    m = chain_model()
    t = numpy_helper.from_array(np.zeros(4, np.float32), "x")
    t.raw_data = b"\xff" * 16  # (not a valid varint stream: it must be skipped whole)
    m.graph.initializer.append(t)
    m.graph.input.append(helper.make_tensor_value_info("x2", onnx.TensorProto.FLOAT, [4]))
    names = [v.name for v in graph_inputs(m.SerializeToString())]
    assert "x" not in names and "x2" in names


@pytest.mark.parametrize("cut", [1, 7, 40])
def test_truncated_bytes_are_a_value_error(cut):
    data = chain_model().SerializeToString()
    with pytest.raises(ValueError):
        graph_inputs(data[:-cut] + b"\x3a\xff\xff\xff\x0f")  # (a field longer than the rest)


def test_the_metadata_is_what_a_full_parse_finds():
    """``model_metadata`` (what a session reads of a model it is asked to load: the buffer
    reuse its plan counted) equals the parsed ``metadata_props``; truncated bytes are a
    ValueError, and ``runtime.ort_reuse_of`` takes an unreadable model for ORT's default."""
    from ho_onnx.target.ort.runtime import ort_reuse_of

    m = text_model("g (float[4] x) => (float[4] y) { y = Mul(x, W) }", W=(4,))
    helper.set_model_props(m, {"ho_onnx.ort_reuse": "0", "other": "é"})
    data = m.SerializeToString()
    assert model_metadata(data) == {p.key: p.value for p in m.metadata_props}
    assert not ort_reuse_of(data) and ort_reuse_of(chain_model().SerializeToString())
    with pytest.raises(ValueError):
        model_metadata(data[:-3] + b"\x72\xff\xff\xff\x0f")
    assert ort_reuse_of(b"\x72\xff") and ort_reuse_of(None)


def test_mutated_bytes_give_inputs_or_a_value_error():
    """Hostile bytes (flipped bytes, cuts, splices of a real model): a list (the metadata
    reader: a dict) or ValueError, never another exception (the reader runs on any file a
    session is asked to load)."""
    rng = np.random.default_rng(0)
    seed = text_model("g (float[N, 16] x, int64[2] s) => (float[N, 16] y) "
                      "{ y = MatMul(x, W) }", W=(16, 16)).SerializeToString()
    outcomes = {"list": 0, "ValueError": 0}
    for _ in range(3000):
        data = bytearray(seed)
        for _ in range(int(rng.integers(1, 6))):
            k = int(rng.integers(0, 3))
            at = int(rng.integers(0, len(data)))
            if k == 0:
                data[at] = int(rng.integers(0, 256))
            elif k == 1:
                del data[at:at + int(rng.integers(1, 32))]
            else:
                data[at:at] = seed[: int(rng.integers(1, 64))]
        try:
            graph_inputs(bytes(data))
            outcomes["list"] += 1
        except ValueError:
            outcomes["ValueError"] += 1
        with contextlib.suppress(ValueError):  # (the metadata reader: a dict, or ValueError)
            assert isinstance(model_metadata(bytes(data)), dict)
    assert outcomes["list"] and outcomes["ValueError"], outcomes
