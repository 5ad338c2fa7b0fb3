"""The standalone custom-op library ``libho_onnx_ops.so``: no Python in it, a narrow exported
surface, the pybind11 module as its client, and a C host (ORT's C API, the onnxruntime
wheel's ``libonnxruntime``) that runs an optimized model bit-exactly like the original.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import ho_onnx
from ho_onnx import OffloadOptions, optimize
from models.decoder import build_decoder

HERE = Path(__file__).parent
FORCE_ALL = OffloadOptions(min_bytes=0, min_gap=1, prefetch_distance=2)
DIMS = {"batch": 2, "seq": 5}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not on PATH")
    return path


def _dynamic_symbols(lib: str, *flags: str) -> set[str]:
    out = subprocess.run([_tool("nm"), "-D", *flags, lib], check=True, capture_output=True,
                         text=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}


def _dynamic_section(lib: str) -> str:
    return subprocess.run([_tool("readelf"), "-d", lib], check=True, capture_output=True,
                          text=True).stdout


REPO = HERE.parent
# The testing C API (csrc/testing/ho_onnx_testing.h): exported by testing builds only.
TESTING_HEADER = REPO / "csrc" / "testing" / "ho_onnx_testing.h"


def _c_api_functions(header: Path | None = None) -> set[str]:
    text = Path(header or Path(ho_onnx.include_dir(), "ho_onnx_c_api.h")).read_text()
    return set(re.findall(r"HO_ONNX_EXPORT [^;(]*?\b(HoOnnx\w*_\w+)\(", text))


def _exported_surface() -> set[str]:
    """What the library should export: the ORT entry point, the documented C API and, in a
    testing build (build_info()["test_hooks"]), the testing C API."""
    testing = _c_api_functions(TESTING_HEADER) if ho_onnx.build_info()["test_hooks"] else set()
    return {"RegisterCustomOps", *_c_api_functions(), *testing}


def test_library_is_installed_with_its_headers():
    lib = ho_onnx.library_path()
    assert os.path.basename(lib) == "libho_onnx_ops.so"
    assert os.path.isfile(lib)
    inc = Path(ho_onnx.include_dir())
    assert (inc / "ho_onnx_c_api.h").is_file()
    assert (inc / "onnxruntime" / "onnxruntime_c_api.h").is_file()
    # the header the library was compiled against
    m = re.search(r"#define ORT_API_VERSION (\d+)",
                  (inc / "onnxruntime" / "onnxruntime_c_api.h").read_text())
    assert m is not None and int(m.group(1)) == ho_onnx.build_info()["ort_api_version"]


def test_exports_only_the_ort_entry_point_and_the_c_api():
    functions = _c_api_functions()
    assert len(functions) >= 9, functions  # the header parse found the API
    assert all(f.startswith("HoOnnx_") for f in functions), functions
    assert _c_api_functions(TESTING_HEADER) == {"HoOnnxTest_SetFault"}
    exported = _dynamic_symbols(ho_onnx.library_path(), "--defined-only")
    assert exported == _exported_surface()


@pytest.mark.slow
def test_the_shipped_library_has_no_fault_hooks(tmp_path):
    """The library as a wheel builds it (HO_ONNX_TESTING off; CPU part, no Python module):
    exactly the ORT entry point and the documented C API exported, no testing C API, no
    fault-hook table, and build_info says so (the tests' own library is a testing build)."""
    cmake = _tool("cmake")
    ort_inc = Path(ho_onnx.include_dir(), "onnxruntime")
    build = tmp_path / "shipped"
    configure = [cmake, "-S", str(REPO), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                 "-DHO_ONNX_WITH_CUDA=OFF", f"-DHO_ONNX_ORT_INCLUDE_DIR={ort_inc}",
                 "-DCMAKE_DISABLE_FIND_PACKAGE_Python=ON"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    for cmd in (configure, [cmake, "--build", str(build), "--target", "ho_onnx_ops"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    lib = build / "libho_onnx_ops.so"
    exported = _dynamic_symbols(str(lib), "--defined-only")
    assert exported == {"RegisterCustomOps", *_c_api_functions()}
    assert not [s for s in _dynamic_symbols(str(lib)) if "HoOnnxTest" in s]
    assert "hook_table" not in subprocess.run([_tool("nm"), "-C", str(lib)], text=True,
                                              capture_output=True, check=True).stdout
    # its build facts, read in a child (a second copy of the library stays out of this process)
    read = ("import ctypes, sys; so = ctypes.CDLL(sys.argv[1]); "
            "so.HoOnnx_BuildInfoJson.restype = ctypes.c_char_p; "
            "print(so.HoOnnx_BuildInfoJson().decode())")
    r = subprocess.run([sys.executable, "-c", read, str(lib)], capture_output=True, text=True,
                       timeout=60, check=True)
    info = json.loads(r.stdout)
    assert info["test_hooks"] is False and info["cuda_compiled"] is False


def test_library_has_no_python_in_it():
    lib = ho_onnx.library_path()
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", _dynamic_section(lib))
    assert needed, "readelf shows no NEEDED entries"
    assert not [n for n in needed if "python" in n.lower()], needed
    assert not [n for n in needed if "onnxruntime" in n], needed  # ORT hands us its API
    undefined = _dynamic_symbols(lib, "--undefined-only")
    assert not [s for s in undefined if s.startswith(("Py", "_Py"))]


def test_pybind_module_links_the_library_next_to_it():
    mod = importlib.import_module("ho_onnx._ops").__file__
    dyn = _dynamic_section(mod)
    assert "[libho_onnx_ops.so]" in dyn
    assert re.search(r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[\$ORIGIN\]", dyn), dyn
    # the copy in this process is library_path(): the one ORT is told to load. Other copies
    # are Triton repository entries' own libraries (each beside its ho_onnx.config, loaded
    # by test_triton.py in this process on purpose: an entry finds its folder by its copy)
    mapped = {os.path.realpath(line.split()[-1])
              for line in Path("/proc/self/maps").read_text().splitlines()
              if line.rstrip().endswith("libho_onnx_ops.so")}
    own = os.path.realpath(ho_onnx.library_path())
    assert own in mapped
    assert all((Path(p).parent / "ho_onnx.config").is_file() for p in mapped - {own}), mapped


def test_c_api_through_ctypes_matches_the_module():
    lib = ctypes.CDLL(ho_onnx.library_path())  # the already loaded copy
    lib.HoOnnx_ApiVersion.restype = ctypes.c_int
    assert lib.HoOnnx_ApiVersion() == ho_onnx.build_info()["c_api_version"] == 3
    lib.HoOnnx_BuildInfoJson.restype = ctypes.c_char_p
    assert json.loads(lib.HoOnnx_BuildInfoJson()) == ho_onnx.build_info()
    lib.HoOnnx_GetCounters.restype = ctypes.c_size_t
    n = lib.HoOnnx_GetCounters(None, None, ctypes.c_size_t(0))
    assert n == len(ho_onnx.counters())
    names = (ctypes.c_char_p * n)()
    values = (ctypes.c_int64 * n)()
    assert lib.HoOnnx_GetCounters(names, values, ctypes.c_size_t(n)) == n
    assert [s.decode() for s in names] == list(ho_onnx.counters())
    lib.HoOnnx_SetTrace.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.HoOnnx_LastError.restype = ctypes.c_char_p
    assert lib.HoOnnx_SetTrace(b"delay_us", 1) == -1  # a fault hook: not a switch of the API
    assert b"delay_us" in lib.HoOnnx_LastError()
    assert lib.HoOnnx_SetTrace(b"arena_trace", 0) == 0
    assert lib.HoOnnx_LastError() == b""
    # the testing C API of a testing build (the tests' own: editable install, test_native.sh)
    assert ho_onnx.build_info()["test_hooks"] is True
    lib.HoOnnxTest_SetFault.argtypes = [ctypes.c_char_p, ctypes.c_int64]
    assert lib.HoOnnxTest_SetFault(b"no_such_hook", 1) == -1
    assert b"no_such_hook" in lib.HoOnnx_LastError()
    assert lib.HoOnnxTest_SetFault(b"delay_us", 0) == 0
    assert lib.HoOnnx_LastError() == b""


# ---- a C host ------------------------------------------------------------------------------


# Another runtime for the C programs: HO_ONNX_TEST_LIBORT=/path/libonnxruntime.so.1.x.y
# (scripts/ort_matrix.sh runs this file against every onnxruntime release).
LIBORT_ENV = "HO_ONNX_TEST_LIBORT"


def _ort_shared_library() -> Path:
    if os.environ.get(LIBORT_ENV):
        return Path(os.environ[LIBORT_ENV])
    capi = Path(ort.__file__).parent / "capi"
    libs = sorted(capi.glob("libonnxruntime.so.*"))
    if not libs:
        pytest.skip(f"no libonnxruntime.so.* in {capi}")
    return libs[0]


def _c_runtime_version() -> tuple[int, int]:
    """(major, minor) of the runtime the C programs link (from the file name's suffix)."""
    m = re.search(r"\.so\.(\d+)\.(\d+)", _ort_shared_library().name)
    if m is None:
        m = re.match(r"(\d+)\.(\d+)", ort.__version__)
    assert m is not None
    return int(m.group(1)), int(m.group(2))


def _soname(lib: Path) -> str:
    m = re.search(r"\(SONAME\)\s+Library soname: \[([^\]]+)\]", _dynamic_section(str(lib)))
    assert m is not None, f"{lib} has no SONAME"
    return m.group(1)


def _compile(d: Path, source: str, *extra: str) -> Path:
    """tests/c_host/<source>.c compiled with ``cc`` and linked to the wheel's libonnxruntime.

    The wheel ships ``libonnxruntime.so.<version>`` but not its SONAME's link
    (``libonnxruntime.so.1``): a folder beside the program holds that link.
    """
    cc = _tool("cc")
    ort_lib = _ort_shared_library()
    link = d / _soname(ort_lib)
    if not link.exists():
        link.symlink_to(ort_lib)
    exe = d / source
    cmd = [cc, "-std=c99", "-O1", "-Wall", "-Wextra", "-Werror",
           "-I", ho_onnx.include_dir(), str(HERE / "c_host" / f"{source}.c"),
           "-o", str(exe), str(link), *extra, f"-Wl,-rpath,{d}", "-ldl"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr}"
    return exe


@pytest.fixture(scope="module")
def c_host(tmp_path_factory) -> Path:
    return _compile(tmp_path_factory.mktemp("c_host"), "run_model")


@pytest.fixture(scope="module")
def fake_runtime(tmp_path_factory) -> Path:
    return _compile(tmp_path_factory.mktemp("fake_runtime"), "fake_runtime")


def test_a_host_that_links_the_library(tmp_path):
    """Linked at build time and registered with RegisterCustomOpsUsingFunction: ORT finds
    RegisterCustomOps in the process; the host calls the C API directly."""
    lib = Path(ho_onnx.library_path())
    exe = _compile(tmp_path, "linked_host", str(lib), f"-Wl,-rpath,{lib.parent}")
    src = tmp_path / "dec.onnx"
    build_decoder(src, external_data=True, layers=1, hidden=32, heads=2)
    opt = tmp_path / "dec.ho.onnx"
    optimize(src, opt, FORCE_ALL, DIMS)
    p = subprocess.run([str(exe), str(opt), str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    counts = dict(kv.split("=") for kv in p.stdout.split())
    assert counts == {"registrations": "1", "engines_alive": "1"}  # the kernels hold one engine


def _token_ids(dims: dict[str, int], seed: int) -> dict[str, np.ndarray]:
    """Feeds of models/decoder.py: token ids in [0, 8)."""
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, 8, size=(dims["batch"], dims["seq"]), dtype=np.int64)}


def _write_tensors(path: Path, arrays: list[np.ndarray], types: list[int]) -> None:
    with open(path, "wb") as f:
        for a, t in zip(arrays, types, strict=True):
            f.write(struct.pack("<II", t, a.ndim))
            f.write(struct.pack(f"<{a.ndim}q", *a.shape))
            f.write(np.ascontiguousarray(a).tobytes())


_NP = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.INT64: np.int64,
       onnx.TensorProto.INT32: np.int32, onnx.TensorProto.BOOL: np.bool_,
       onnx.TensorProto.FLOAT16: np.float16, onnx.TensorProto.DOUBLE: np.float64}


def _read_tensors(path: Path) -> list[np.ndarray]:
    data = path.read_bytes()
    out, pos = [], 0
    while pos < len(data):
        t, rank = struct.unpack_from("<II", data, pos)
        pos += 8
        shape = struct.unpack_from(f"<{rank}q", data, pos)
        pos += 8 * rank
        dtype = np.dtype(_NP[t])
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        out.append(np.frombuffer(data[pos:pos + n], dtype).reshape(shape))
        pos += n
    return out


@pytest.mark.parametrize("external", [True, False])
def test_c_host_runs_an_optimized_model_bit_exact(tmp_path, c_host, external):
    src = tmp_path / "dec.onnx"
    build_decoder(src, external_data=external, layers=2, hidden=32, heads=2)
    opt_dir = tmp_path / "optimized"
    opt_dir.mkdir()
    opt = opt_dir / "dec.ho.onnx"
    r = optimize(src, opt, FORCE_ALL, DIMS)
    assert r.choice.weights  # the model the C host runs has cache ops

    model = onnx.load(str(src), load_external_data=False)
    feeds = _token_ids(DIMS, seed=3)
    names = [vi.name for vi in model.graph.input]
    inputs = tmp_path / "inputs.bin"
    _write_tensors(inputs, [feeds[n] for n in names],
                   [vi.type.tensor_type.elem_type for vi in model.graph.input])

    def run(path: Path, folder: Path, runs: int) -> tuple[list[np.ndarray], str]:
        out = tmp_path / f"{path.name}.out"
        # from another folder: weights resolve through ho_onnx.model_dir, not the cwd
        p = subprocess.run([str(c_host), ho_onnx.library_path(), str(path), str(folder),
                            str(inputs), str(out), str(runs)],
                           capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert p.returncode == 0, p.stderr
        return _read_tensors(out), p.stdout

    runs = 2
    got, stdout = run(opt, opt_dir, runs)
    # the original through the same C host and runtime
    expected, _ = run(src, tmp_path, 1)
    if not os.environ.get(LIBORT_ENV):  # and through Python's ORT (the same runtime)
        so = ort.SessionOptions()
        so.add_session_config_entry("session.disable_prepacking", "1")
        py = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"]).run(None, feeds)
        assert [a.tobytes() for a in py] == [a.tobytes() for a in expected]
    assert len(got) == runs * len(expected)
    for k, arr in enumerate(got):
        want = expected[k % len(expected)]
        assert arr.dtype == want.dtype and arr.shape == want.shape
        assert arr.tobytes() == want.tobytes(), f"output {k} differs"
    counts = dict(kv.split("=") for kv in stdout.split())
    # every offloaded weight went through Prefetch, on every run
    assert int(counts["prefetches"]) >= runs * len(r.choice.weights)
    assert int(counts["waits"]) >= int(counts["prefetches"])
    # ORT honoured GetAliasMap (declared with op version 18): Wait outputs were not copied
    assert int(counts["alias_copies"]) == 0


def test_c_host_reports_a_missing_model_dir(tmp_path, c_host):
    """A wrong ho_onnx.model_dir surfaces as ORT's error status, not a crash."""
    src = tmp_path / "dec.onnx"
    build_decoder(src, external_data=True, layers=1, hidden=32, heads=2)
    opt = tmp_path / "dec.ho.onnx"
    optimize(src, opt, FORCE_ALL, DIMS)
    feeds = _token_ids(DIMS, seed=0)
    inputs = tmp_path / "inputs.bin"
    _write_tensors(inputs, list(feeds.values()), [onnx.TensorProto.INT64] * len(feeds))
    empty = tmp_path / "empty"
    empty.mkdir()
    p = subprocess.run([str(c_host), ho_onnx.library_path(), str(opt), str(empty), str(inputs),
                        str(tmp_path / "out.bin"), "1"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "run_model:" in p.stderr and "ho_onnx Prefetch" in p.stderr, p.stderr
    assert "does not exist" in p.stderr, p.stderr


# ---- older runtimes (an OrtApiBase that serves fewer API versions) ----------------------------


def _wait_model(path: Path, elem: int) -> Path:
    from onnx import helper

    node = helper.make_node("Wait", ["x"], ["z"], domain="ai.hyperoffload", name="wait_x")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", elem, [4])],
                              [helper.make_tensor_value_info("z", elem, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("ai.hyperoffload", 1)])
    model.ir_version = 10
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize(
    ("version", "max_api", "elem", "register", "session"),
    [
        ("1.17.3", 17, onnx.TensorProto.FLOAT,
         "ho_onnx needs ONNX Runtime API version 18 (onnxruntime >= 1.18), this runtime is 1.17.3",
         None),
        ("1.18.0", 18, onnx.TensorProto.FLOAT, "ok", "ok"),
        # INT4 came with 1.19: a 1.18 runtime gets no INT4 ops (declaring one would break
        # every session), so only models using INT4 fail, as they would without ho-onnx
        ("1.18.0", 18, onnx.TensorProto.INT4, "ok", "Wait"),
        ("1.19.0", 19, onnx.TensorProto.INT4, "ok", "ok"),
        ("1.23.2", 23, onnx.TensorProto.FLOAT4E2M1, "ok", "Wait"),
        ("1.24.0", 24, onnx.TensorProto.FLOAT4E2M1, "ok", "ok"),
    ],
)
def test_runtime_versions(tmp_path, fake_runtime, version, max_api, elem, register, session):
    # the real runtime behind the fake one must know the model's element type
    needs = {onnx.TensorProto.INT4: (1, 19), onnx.TensorProto.FLOAT4E2M1: (1, 24)}.get(elem)
    if needs is not None and _c_runtime_version() < needs:
        pytest.skip(f"{_ort_shared_library().name} cannot load a model of this element type")
    model = _wait_model(tmp_path / "wait.onnx", elem)
    p = subprocess.run([str(fake_runtime), ho_onnx.library_path(), str(model), version,
                        str(max_api)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = dict(line.split(": ", 1) for line in p.stdout.splitlines())
    assert lines["register"] == register
    if session is None:
        assert "session" not in lines
    elif session == "ok":
        assert lines["session"] == "ok"
    else:
        assert lines["session"] != "ok" and session in lines["session"], lines
