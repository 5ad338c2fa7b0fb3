"""Loading and validating inputs (graph.load): every bad input fails with one clear error and
leaves nothing behind."""

from __future__ import annotations

import os

import onnx
import pytest
from graphs import chain_model, save

from ho_onnx.errors import (
    ExternalDataError,
    ModelLoadError,
    UnboundDimError,
    UnsupportedModelError,
)
from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.options import OffloadOptions

ALL = OffloadOptions(min_bytes=0, min_gap=1, prefetch_distance=1)


@pytest.fixture(autouse=True, params=["in-process", "forked"])
def checks(request, monkeypatch):
    """Every case twice: the load's checks in this process, and in a forked child beside the
    onnx_ir deserialisation (graph.forked; normally only for graphs of 2,000+ nodes)."""
    if request.param == "forked":
        from ho_onnx.graph import forked, load

        monkeypatch.setattr(load, "FORK_MIN_NODES", 0)
        monkeypatch.setattr(forked, "forking_allowed", lambda: True)
    return request.param


def test_the_checks_of_a_big_graph_run_in_a_child(tmp_path, checks, monkeypatch):
    from ho_onnx.graph import forked
    from ho_onnx.graph.load import load_model

    forks: list[int] = []
    real = forked.os.fork
    monkeypatch.setattr(forked.os, "fork", lambda: forks.append(1) or real())
    loaded = load_model(save(chain_model(), tmp_path / "m.onnx", external=True))
    assert len(loaded.model.graph) == 6 and loaded.data_locations == {"m.onnx.data": "W1"}
    assert forks == ([1] if checks == "forked" else [])


def test_corrupt_file(tmp_path):
    p = tmp_path / "bad.onnx"
    p.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError, match=r"not a (readable|valid) ONNX model|not an ONNX"):
        optimize(p, tmp_path / "out.onnx", ALL)
    assert not (tmp_path / "out.onnx").exists()


def test_missing_and_truncated_external_data(tmp_path):
    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    data = tmp_path / "m.onnx.data"
    blob = data.read_bytes()
    data.write_bytes(blob[:100])
    with pytest.raises(ExternalDataError, match="truncated"):
        optimize(src, tmp_path / "out.onnx", ALL)
    data.unlink()
    with pytest.raises(ExternalDataError, match=r"'m\.onnx\.data' not found"):
        optimize(src, tmp_path / "out.onnx", ALL)
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize("location", ["../../etc/passwd", "/etc/passwd", "a/../../x.bin"])
def test_hostile_locations(tmp_path, location):
    m = chain_model()
    save(m, tmp_path / "m.onnx", external=True)
    m = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    for e in m.graph.initializer[0].external_data:
        if e.key == "location":
            e.value = location
    onnx.save(m, str(tmp_path / "evil.onnx"))
    with pytest.raises(ExternalDataError, match="location"):
        optimize(tmp_path / "evil.onnx", tmp_path / "out.onnx", ALL)


def test_unsupported_opset_and_already_optimized(tmp_path):
    m = chain_model()
    m.opset_import[0].version = 99
    onnx.save(m, str(tmp_path / "future.onnx"))
    with pytest.raises(UnsupportedModelError, match="opset 99"):
        optimize(tmp_path / "future.onnx", tmp_path / "out.onnx", ALL)
    src = save(chain_model(), tmp_path / "m.onnx")
    optimize(src, tmp_path / "m.ho.onnx", ALL)
    with pytest.raises(UnsupportedModelError, match="already contains"):
        optimize(tmp_path / "m.ho.onnx", tmp_path / "again.onnx", ALL)


def test_unknown_dim_error_names_the_dim(tmp_path):
    src = save(chain_model(), tmp_path / "m.onnx")
    with pytest.raises(UnboundDimError, match="'N'"):
        optimize(src, tmp_path / "out.onnx", OffloadOptions(weights=False, min_bytes=1))
    assert not (tmp_path / "out.onnx").exists()
