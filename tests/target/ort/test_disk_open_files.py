"""The disk tier's open descriptors are bounded (issue 34 item 6).

A model saved one file per tensor and optimized to the disk tier once held two descriptors
per data file for the session's life: 300 files could not open under a descriptor limit of
256 ("Too many open files") while the host tier opened the same model. The descriptors now
live in a bounded, process-wide cache of open files (csrc/disk_io.h); a file the cache closed
is opened again by the session-creation rules and must still be the file validated then.

Each case runs in a child process: RLIMIT_NOFILE is lowered there, and the cache's bound is
read once per process (HO_ONNX_DISK_OPEN_FILES).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.options import OffloadOptions

pytestmark = pytest.mark.usefixtures("no_debug_hooks")

N_FILES = 300  # data files, one per weight
WIDTH = 8


def _per_tensor_model(directory: Path) -> Path:
    """y = ((x * w0 + b0) * w1 + b1) ... : N_FILES weights, each in a data file of its own."""
    rng = np.random.default_rng(0)
    inits, nodes, acc = [], [], "x"
    for i in range(N_FILES // 2):
        w = rng.uniform(0.5, 1.5, WIDTH).astype(np.float32)
        b = rng.standard_normal(WIDTH).astype(np.float32)
        inits += [onnx.numpy_helper.from_array(w, f"w{i}"),
                  onnx.numpy_helper.from_array(b, f"b{i}")]
        nodes += [helper.make_node("Mul", [acc, f"w{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"])]
        acc = f"a{i}"
    nodes.append(helper.make_node("Identity", [acc], ["y"]))
    graph = helper.make_graph(nodes, "per_tensor",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", WIDTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", WIDTH])],
                              inits)
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21)])
    path = directory / "src" / "model.onnx"
    path.parent.mkdir()
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=False,
                    size_threshold=0)
    assert len(list(path.parent.iterdir())) == N_FILES + 1
    return path


@pytest.fixture(scope="module")
def disk_model(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("per_tensor")
    src = _per_tensor_model(tmp)
    out = tmp / "opt" / "model.onnx"
    out.parent.mkdir()
    r = optimize(src, out, OffloadOptions(activations=False, min_bytes=0, weight_tier="disk"),
                 {"n": 3})
    assert len(r.choice.weights) == N_FILES and all(w.tier == "disk" for w in r.choice.weights)
    files = {a.s for nd in onnx.load(str(out), load_external_data=False).graph.node
             if nd.op_type == "Prefetch" for a in nd.attribute if a.name == "location"}
    assert len(files) == N_FILES  # still one data file per weight
    return src, out


_CHILD = r"""
import json, os, resource, sys, threading
import numpy as np
limit = int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from ho_onnx.target.ort import runtime
x = np.load(sys.argv[2])
sess = runtime.InferenceSession(sys.argv[1])
outs = [sess.run(None, {"x": x})[0] for _ in range(2)]
errors = []
def worker():
    try:
        for _ in range(3):
            outs.append(sess.run(None, {"x": x})[0])
    except Exception as e:  # (reported below)
        errors.append(repr(e))
threads = [threading.Thread(target=worker) for _ in range(3)]
for t in threads: t.start()
for t in threads: t.join()
assert not errors, errors
np.save(sys.argv[2] + ".out.npy", np.stack(outs))
c = runtime.counters()
print(json.dumps({"fds": len(os.listdir("/proc/self/fd")), "open": c["disk_files_open"],
                  "reopens": c["disk_reopens"], "disk": c["bytes_read_disk"]}))
"""


def _child(code: str, *args: str, env: dict[str, str] | None = None,
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args],
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=300, check=False)


def test_one_file_per_tensor_on_the_disk_tier_runs_under_a_low_descriptor_limit(
        disk_model, tmp_path):
    src, out = disk_model
    x = np.random.default_rng(1).standard_normal((3, WIDTH)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    proc = _child(_CHILD, str(out), str(tmp_path / "x.npy"), "256")
    assert proc.returncode == 0, proc.stderr[-3000:]  # old code: "Too many open files"
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    got = np.load(tmp_path / "x.npy.out.npy")
    assert got.shape[0] == 11
    for g in got:
        np.testing.assert_array_equal(g, want)  # the same kernels: bit-exact
    assert info["fds"] < 256
    assert 0 < info["open"] <= 256 // 8  # the default bound: an eighth of the limit
    assert info["reopens"] > 0  # the cache really closed and reopened files
    assert info["disk"] == 11 * N_FILES * WIDTH * 4


_SWAP = r"""
import os, shutil, sys
import numpy as np
from ho_onnx.target.ort import runtime
model, x = sys.argv[1], np.load(sys.argv[2])
sess = runtime.InferenceSession(model)
want = sess.run(None, {"x": x})[0]
folder = os.path.dirname(model)
victim = os.path.join(folder, sys.argv[3])
kind = sys.argv[4]
if kind == "replace":  # a new file (another inode) renamed over the data file
    shutil.copyfile(victim, victim + ".new")
    os.replace(victim + ".new", victim)
elif kind == "symlink":  # a symbolic link to an identical copy elsewhere
    shutil.copyfile(victim, model + ".elsewhere")
    os.remove(victim)
    os.symlink(model + ".elsewhere", victim)
elif kind == "remove":
    os.remove(victim)
try:
    got = sess.run(None, {"x": x})[0]
except Exception as e:
    print("ERROR", str(e).replace("\n", " "))
    sys.exit(0)
print("SAME" if np.array_equal(got, want) else "DIFFERENT")
"""


@pytest.mark.parametrize(("kind", "message"), [
    ("replace", "not the data file validated when the session was created"),
    ("symlink", "symbolic links inside the model directory are not followed"),
    ("remove", "does not exist"),
])
def test_a_data_file_reopened_must_be_the_validated_one(disk_model, tmp_path, kind, message):
    """With one cached file, every data file is reopened at every run: a file replaced (even
    by identical bytes), a symbolic link swapped in, or a file removed since the session was
    created fails the run naming the file; it is never read."""
    _, out = disk_model
    folder = tmp_path / "copy"
    folder.mkdir()
    for f in out.parent.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    victim = next(a.s.decode() for nd in onnx.load(str(out), load_external_data=False).graph.node
                  if nd.op_type == "Prefetch" for a in nd.attribute if a.name == "location")
    x = np.ones((3, WIDTH), np.float32)
    np.save(tmp_path / "x.npy", x)
    proc = _child(_SWAP, str(folder / out.name), str(tmp_path / "x.npy"), victim, kind,
                  env={"HO_ONNX_DISK_OPEN_FILES": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("ERROR") and message in line and victim in line, line


def test_unchanged_files_reopened_give_the_same_answer(disk_model, tmp_path):
    _, out = disk_model
    x = np.ones((3, WIDTH), np.float32)
    np.save(tmp_path / "x.npy", x)
    proc = _child(_SWAP, str(out), str(tmp_path / "x.npy"), "-", "none",
                  env={"HO_ONNX_DISK_OPEN_FILES": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "SAME"
