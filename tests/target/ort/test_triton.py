"""A Triton model repository entry (ho_onnx.target.ort.triton, ``ho-onnx triton``) and the
op library's folder configuration it relies on (``ho_onnx.config`` beside a library copy:
csrc/registration.cc). Triton itself is not installable here: its onnxruntime backend's
session set-up is replayed from its source (triton_like_session), and config.pbtxt is
checked against Triton's schema (tritonclient's model_config_pb2)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from graphs import chain_model, save, text_model, two_weights_model

import ho_onnx
from ho_onnx import OffloadOptions
from ho_onnx.target.ort.triton import (
    FOLDER_CONFIG,
    TritonEntryError,
    container_ort_version,
    write_triton_entry,
)

FORCE = OffloadOptions(min_bytes=0, min_gap=1, prefetch_distance=2)
LIB = "libho_onnx_ops.so"


def model_config_pb2() -> Any:
    """Triton's ModelConfig schema, from the tritonclient wheel (loaded by file: its
    package's ``__init__`` wants grpc, which the schema does not)."""
    spec = importlib.util.find_spec("tritonclient")
    if spec is None or spec.origin is None:
        pytest.skip("tritonclient is not installed (the test extra has it)")
    path = Path(spec.origin).parent / "grpc" / "model_config_pb2.py"
    s = importlib.util.spec_from_file_location("_triton_model_config_pb2", path)
    assert s is not None and s.loader is not None
    module = importlib.util.module_from_spec(s)
    s.loader.exec_module(module)
    return module


def parse_config(text: str) -> Any:
    """``text`` parsed strictly (an unknown field or a bad value is an error) into
    Triton's ``inference.ModelConfig``."""
    from google.protobuf import text_format

    return text_format.Parse(text, model_config_pb2().ModelConfig())


def _bool(v: str) -> bool:  # the backend's ParseBoolValue
    if v.lower() in ("true", "1", "on"):
        return True
    if v.lower() in ("false", "0", "off"):
        return False
    raise ValueError(v)


def triton_like_session(cfg: Any, repo: Path) -> ort.InferenceSession:
    """A session made as Triton's onnxruntime backend makes one
    (triton-inference-server/onnxruntime_backend src/onnxruntime.cc: ModelState's
    constructor and ModelState::LoadModel): graph level ORT_ENABLE_ALL, the parameters it
    knows (nothing else of ``parameters`` reaches ORT), each op_library_filename
    registered, then the session from ``<repo>/<name>/<version>/model.onnx`` by path."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    if "execution_mode" in params:
        so.execution_mode = (ort.ExecutionMode.ORT_PARALLEL if params["execution_mode"] == "1"
                             else ort.ExecutionMode.ORT_SEQUENTIAL)
    if "intra_op_thread_count" in params:
        so.intra_op_num_threads = int(params["intra_op_thread_count"])
    if "inter_op_thread_count" in params:
        so.inter_op_num_threads = int(params["inter_op_thread_count"])
    key = "session.use_device_allocator_for_initializers"
    if key in params:
        so.add_session_config_entry(key, params[key])
    if "enable_mem_arena" in params:
        so.enable_cpu_mem_arena = _bool(params["enable_mem_arena"])
    if "enable_mem_pattern" in params:
        so.enable_mem_pattern = _bool(params["enable_mem_pattern"])
    for lib in cfg.model_operations.op_library_filename:
        so.register_custom_ops_library(lib)
    version = cfg.version_policy.specific.versions[0]
    path = repo / cfg.name / str(version) / (cfg.default_model_filename or "model.onnx")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def reference(model: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The unmodified model's outputs (prepacking off: the optimized model's weights are
    not constants, so its MatMul runs unpacked, the same kernel as this)."""
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"]).run(
        None, feeds)


@pytest.fixture(scope="module")
def optimized(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(unmodified, optimized) two-weight model, every weight and activation offloaded."""
    d = tmp_path_factory.mktemp("opt")
    src = save(two_weights_model(), d / "m.onnx")
    out = d / "out" / "m.ho.onnx"
    r = ho_onnx.optimize(src, out, FORCE)
    assert r.choice.weights  # weights read from the folder by the library
    return src, out


def feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(7).standard_normal((8, 512)).astype(np.float32)}


def entry(optimized: tuple[Path, Path], repo: Path, name: str = "tiny", **kw: Any) -> Any:
    kw.setdefault("triton_release", "26.08")
    return write_triton_entry(optimized[1], repo, name, container_repo=str(repo), **kw)


# "0": the registration path of onnxruntime < 1.24 (no per-kernel config entries), where
# the folder is part of the registration's configuration.
@pytest.mark.parametrize("kernel_config", ["1", "0"])
def test_repository_round_trip_as_triton_loads_it(optimized, tmp_path, monkeypatch,
                                                  kernel_config):
    monkeypatch.setenv("HO_ONNX_KERNEL_CONFIG", kernel_config)
    repo = tmp_path / "repo"
    e = entry(optimized, repo, version=3)
    assert sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file()) == [
        "tiny/3/ho_onnx.config", f"tiny/3/{LIB}", "tiny/3/m.ho.onnx.data", "tiny/3/model.onnx",
        "tiny/config.pbtxt"]
    cfg = parse_config(e.config.read_text())
    assert cfg.name == "tiny" and cfg.backend == "onnxruntime" and cfg.max_batch_size == 0
    assert list(cfg.version_policy.specific.versions) == [3]
    assert [(t.name, t.data_type, list(t.dims)) for t in cfg.input] == [
        ("x", model_config_pb2().TYPE_FP32, [8, 512])]
    assert [(t.name, list(t.dims)) for t in cfg.output] == [("y", [8, 512])]
    assert list(cfg.model_operations.op_library_filename) == [str(repo / "tiny" / "3" / LIB)]
    assert not any(k.startswith("ho_onnx.") for k in cfg.parameters)  # the backend drops them
    sess = triton_like_session(cfg, repo)
    f = feeds()
    for got, want in zip(sess.run(None, f), reference(optimized[0], f), strict=True):
        np.testing.assert_array_equal(got, want)


def test_config_types_dims_and_names(tmp_path):
    m = chain_model()  # float[N, 16] x: a symbolic dim
    m.graph.input[0].name = 'x"\u00e9\\'
    m.graph.node[0].input[0] = m.graph.input[0].name
    src = save(m, tmp_path / "chain.onnx")
    e = write_triton_entry(src, tmp_path / "repo", "chain", ort_version="1.24.4")
    assert e.library is None  # no cache ops: no op library
    cfg = parse_config(e.config.read_text())
    assert [(t.name, list(t.dims)) for t in cfg.input] == [('x"\u00e9\\', [-1, 16])]
    assert not cfg.model_operations.op_library_filename
    assert sorted(os.listdir(e.folder / "1")) == ["model.onnx"]


def test_ort_versions():
    assert container_ort_version("25.05") == "1.22.0"
    assert container_ort_version(None, "1.24.4") == "1.24.4"
    assert container_ort_version("26.04", "1.24.4") == "1.24.4"
    with pytest.raises(TritonEntryError, match=r"ships onnxruntime 1\.22\.0, not 1\.24"):
        container_ort_version("25.05", "1.24.4")
    with pytest.raises(TritonEntryError, match="not in the table"):
        container_ort_version("19.01")
    with pytest.raises(TritonEntryError, match="name the Triton release"):
        container_ort_version()
    with pytest.raises(TritonEntryError, match="not an onnxruntime version"):
        container_ort_version(None, "latest")


def test_old_container_and_bad_arguments_write_nothing(optimized, tmp_path):
    repo = tmp_path / "repo"
    with pytest.raises(TritonEntryError, match=r"onnxruntime 1\.17\.3 is older than"):
        entry(optimized, repo, triton_release="24.04")
    for bad in ({"name": "../x"}, {"name": ".hidden"}, {"version": 0}, {"instances": 0}):
        with pytest.raises(TritonEntryError):
            entry(optimized, repo, **bad)
    assert not repo.exists() or not any(repo.iterdir())
    entry(optimized, repo)
    with pytest.raises(ho_onnx.errors.OutputPathError, match="exists"):
        entry(optimized, repo)
    assert sorted(os.listdir(repo)) == ["tiny"]  # no temporary folder left


def test_cli_writes_the_entry_and_refuses_in_one_line(optimized, tmp_path):
    import subprocess

    repo = tmp_path / "repo"
    cmd = [sys.executable, "-m", "ho_onnx.cli", "triton", str(optimized[1]), str(repo),
           "--name", "tiny", "--container-repo", str(repo)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "--triton-release" in r.stderr and not repo.exists()
    r = subprocess.run([*cmd, "--triton-release", "26.08", "--host-pool-limit", "1GiB"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "ho_onnx.host_pool_limit_bytes=1073741824" in (
        repo / "tiny" / "1" / FOLDER_CONFIG).read_text().splitlines()
    r = subprocess.run([*cmd, "--triton-release", "26.08"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "exists" in r.stderr


# ---- the library's folder configuration (csrc/registration.cc) ----------------------------

def _session(folder: Path, **entries: str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    for k, v in entries.items():
        so.add_session_config_entry(k, v)
    so.register_custom_ops_library(str(folder / LIB))
    return ort.InferenceSession(str(folder / "model.onnx"), so,
                                providers=["CPUExecutionProvider"])


@pytest.fixture
def version_dir(optimized, tmp_path) -> Path:
    return entry(optimized, tmp_path / "repo").model.parent


def test_folder_config_absent_means_no_model_folder(version_dir):
    (version_dir / FOLDER_CONFIG).unlink()
    with pytest.raises(Exception, match="no model directory is known"):
        _session(version_dir)


def test_folder_config_cannot_name_another_folder(version_dir, optimized):
    (version_dir / FOLDER_CONFIG).write_text(f"ho_onnx.model_dir={optimized[1].parent}\n")
    with pytest.raises(Exception, match="cannot be set here: the model folder is always"):
        _session(version_dir)


@pytest.mark.parametrize("text, message", [
    ("ho_onnx.budget=1\n", "unknown entry 'ho_onnx.budget'"),
    ("ho_onnx.host_pool_limit_bytes=-5\n", "in '.*ho_onnx.config' must be a positive byte"),
    ("ho_onnx.sample_arena=1\nho_onnx.sample_arena=0\n", "line 2: 'ho_onnx.sample_arena' is "
                                                         "set twice"),
    ("no equals sign\n", "line 1: expected key=value"),
    ("a\0b", "not a text file"),
])
def test_folder_config_bad_lines_are_refused(version_dir, text, message):
    (version_dir / FOLDER_CONFIG).write_text(text)
    with pytest.raises(Exception, match=message):
        _session(version_dir)


def test_folder_config_link_is_refused(version_dir, tmp_path):
    outside = tmp_path / "elsewhere.config"
    (version_dir / FOLDER_CONFIG).rename(outside)
    os.symlink(outside, version_dir / FOLDER_CONFIG)
    with pytest.raises(Exception, match="symbolic link"):
        _session(version_dir)


def test_folder_data_rules_still_hold(version_dir, tmp_path):
    data = version_dir / "m.ho.onnx.data"
    outside = tmp_path / "outside.data"
    shutil.copyfile(data, outside)
    data.unlink()
    with pytest.raises(Exception, match=r"1/m\.ho\.onnx\.data' does not exist"):
        _session(version_dir)
    os.symlink(outside, data)  # the same bytes, through a link out of the folder
    with pytest.raises(Exception, match="symbolic link"):
        _session(version_dir)


@pytest.mark.parametrize("kernel_config", ["1", "0"])
def test_folder_config_entries_apply_and_the_session_wins(version_dir, optimized, monkeypatch,
                                                          kernel_config):
    """The file's host pool bound is the library's (a run that stores more fails naming
    it); a session config entry of the same name overrides it."""
    monkeypatch.setenv("HO_ONNX_KERNEL_CONFIG", kernel_config)
    (version_dir / FOLDER_CONFIG).write_text("ho_onnx.host_pool_limit_bytes=1024\n")
    with pytest.raises(Exception, match=r"ho_onnx\.host_pool_limit_bytes"):
        _session(version_dir).run(None, feeds())
    f = feeds()
    got = _session(version_dir, **{"ho_onnx.host_pool_limit_bytes": str(1 << 30)}).run(None, f)
    np.testing.assert_array_equal(got[0], reference(optimized[0], f)[0])



BIAS = """
g (float[8, 512] x) => (float[8, 512] y) {
  h = MatMul(x, W)
  y = Add(h, B)
}
"""


def test_resident_weights_data_is_copied_too(tmp_path):
    """A weight that stays resident in an external data file of its own (``b.bin``, which
    ORT itself reads) is copied with the offloaded one's (``m.ho.onnx.data``)."""
    from onnx.external_data_helper import set_external_data

    m = text_model(BIAS, W=(512, 512), B=(512,))
    b = next(t for t in m.graph.initializer if t.name == "B")
    (tmp_path / "b.bin").write_bytes(b.raw_data)
    set_external_data(b, "b.bin")
    b.ClearField("raw_data")
    b.data_location = onnx.TensorProto.EXTERNAL
    src = tmp_path / "m.onnx"
    onnx.save(m, str(src))
    opt = tmp_path / "out" / "m.ho.onnx"
    r = ho_onnx.optimize(src, opt, OffloadOptions(activations=False, min_bytes=64 << 10))
    assert r.choice.weights and sorted(os.listdir(opt.parent)) == [
        "b.bin", "m.ho.onnx", "m.ho.onnx.data"]
    repo = tmp_path / "repo"
    e = write_triton_entry(opt, repo, "bias", ort_version="1.24.4", container_repo=str(repo))
    assert {"b.bin", "m.ho.onnx.data"} <= set(e.files)
    f = feeds()
    got = triton_like_session(parse_config(e.config.read_text()), repo).run(None, f)
    np.testing.assert_array_equal(got[0], reference(src, f)[0])


def test_a_library_linked_from_another_entry_serves_that_entry(optimized, tmp_path):
    """The dynamic loader returns the library already loaded from the same file (a link,
    symbolic or hard, is that file), with the folder it was first loaded from: an entry
    whose library is a link to another entry's gets that entry's folder, where the other
    model's weights are not found (or, of the same name, fail the fingerprint check): an
    error, not a wrong answer. The writer copies the library for this reason."""
    from graphs import TWO_WEIGHTS

    first = entry(optimized, tmp_path / "repo").model.parent
    other = save(text_model(TWO_WEIGHTS, seed=1, W1=(512, 512), W2=(512, 512)),
                 tmp_path / "other.onnx")
    opt = tmp_path / "other_out" / "other.ho.onnx"
    ho_onnx.optimize(other, opt, FORCE)
    second = write_triton_entry(opt, tmp_path / "repo", "other", triton_release="26.08",
                                container_repo=str(tmp_path / "repo")).model.parent
    (second / LIB).unlink()
    os.symlink(first / LIB, second / LIB)
    f = feeds()
    np.testing.assert_array_equal(_session(first).run(None, f)[0],
                                  reference(optimized[0], f)[0])
    with pytest.raises(Exception, match=r"repo/tiny/1/other\.ho\.onnx\.data' does not exist"):
        _session(second)
