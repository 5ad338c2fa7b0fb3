"""Registrations stay bounded however many model folders a process serves (issue 34 item 7).

Every distinct `ho_onnx.model_dir` used to cost one registration (an op domain and its op
structs, ~34 KB, never freed: ORT keeps raw pointers to them). On onnxruntime >= 1.24 each
kernel reads its own session's folder (KernelInfo_GetConfigEntries), so one registration
serves every folder; older runtimes (simulated with HO_ONNX_KERNEL_CONFIG=0) keep one per
folder up to HO_ONNX_MAX_REGISTRATIONS and then refuse with an error naming the cause.
Each case runs in a child process (registrations live as long as the process).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest

pytestmark = pytest.mark.usefixtures("no_debug_hooks")

_NEW_RUNTIME = tuple(int(p) for p in ort.__version__.split(".")[:2]) >= (1, 24)

_MANY = r"""
import gc, sys
import onnxruntime as ort
from ho_onnx.target.ort import runtime
lib = runtime.library_path()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
def register(i):
    so = ort.SessionOptions()
    so.add_session_config_entry("ho_onnx.model_dir", f"/nonexistent/tenant-{i}")
    so.register_custom_ops_library(lib)
for i in range(50):  # warm-up: ORT's own first-use allocations
    register(i)
gc.collect()
before = rss()
for i in range(50, 50 + int(sys.argv[1])):
    register(i)
gc.collect()
print(rss() - before, runtime.counters().get("registrations_held", -1))
"""

_FOLDERS = r"""
import sys, threading
sys.path[:0] = sys.argv[1].split(':')
from pathlib import Path
import numpy as np
import test_disk_tier as t
from ho_onnx.target.ort import runtime
root, n = Path(sys.argv[2]), 64
folders, want = [], []
for k in range(4):
    d = root / f"tenant{k}"
    d.mkdir()
    want.append(t._data(d, n, 0, seed=k))
    t._model(d, n=n, tier=sys.argv[3] if sys.argv[3] != "host" else None, copies=2)
    folders.append(d)
x = np.ones(n, np.float32)
errors = []
def worker(j):
    try:
        for r in range(6):
            k = (j + r) % 4
            sess = runtime.InferenceSession(str(folders[k] / "model.onnx"))
            np.testing.assert_array_equal(sess.run(None, {"x": x})[0], (x + want[k]) + want[k])
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=worker, args=(j,)) for j in range(4)]
for th in threads: th.start()
for th in threads: th.join()
assert not errors, errors
try:  # a folder that does not exist: refused naming it
    runtime.InferenceSession(str(folders[0] / "model.onnx"), model_dir=str(root / "missing"))
    print("NO ERROR")
except Exception as e:
    assert "missing" in str(e) and "does not exist" in str(e), e
print(runtime.counters()["registrations_held"])
"""


def _child(code: str, *args: str, env: dict[str, str] | None = None,
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args],
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.mark.skipif(not _NEW_RUNTIME, reason="needs onnxruntime >= 1.24 (KernelInfo config)")
def test_many_model_folders_cost_one_registration():
    n = 1500
    proc = _child(_MANY, str(n))
    assert proc.returncode == 0, proc.stderr[-3000:]
    grown, held = map(int, proc.stdout.split())
    # old code: one registration per folder, ~34 KB each (about 50 MB here)
    assert grown < 8 << 20, grown
    assert held == 1


@pytest.mark.skipif(not _NEW_RUNTIME, reason="needs onnxruntime >= 1.24 (KernelInfo config)")
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_each_session_reads_its_own_folder_with_one_registration(tmp_path, tier):
    """Threads creating sessions of four folders (same file names, different weights) at
    once: every session reads its own folder's weights, through one shared registration."""
    here = Path(__file__).parent
    proc = _child(_FOLDERS, f"{here}:{here.parents[1]}", str(tmp_path), tier)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "1"


def test_older_runtimes_keep_one_per_folder_and_refuse_past_the_bound(tmp_path):
    env = {"HO_ONNX_KERNEL_CONFIG": "0", "HO_ONNX_MAX_REGISTRATIONS": "6"}
    here = Path(__file__).parent
    proc = _child(_FOLDERS, f"{here}:{here.parents[1]}", str(tmp_path), "disk", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "5"  # four folders and the missing one
    proc = _child(_MANY, "10", env=env)
    assert proc.returncode != 0
    assert "HO_ONNX_MAX_REGISTRATIONS" in proc.stderr and "onnxruntime >= 1.24" in proc.stderr


_ORDER = r"""
import sys
sys.path[:0] = sys.argv[1].split(':')
from pathlib import Path
import numpy as np
import onnxruntime as ort
import test_disk_tier as t
from ho_onnx.target.ort import runtime
d, n = Path(sys.argv[2]), 64
want = t._data(d, n, 0, seed=3)
t._model(d, n=n, tier=None, copies=2)
so = ort.SessionOptions()
so.log_severity_level = 4
so.register_custom_ops_library(runtime.library_path())
so.add_session_config_entry("ho_onnx.model_dir", str(d))  # after the registration
try:
    s = ort.InferenceSession(str(d / "model.onnx"), so, providers=["CPUExecutionProvider"])
    x = np.ones(n, np.float32)
    np.testing.assert_array_equal(s.run(None, {"x": x})[0], (x + want) + want)
    print("OK")
except Exception as e:
    print("ERR", e)
"""


@pytest.mark.parametrize("kernel_config", ["1", "0"])
def test_model_dir_set_after_the_registration(tmp_path, kernel_config):
    """Issue 35: ``ho_onnx.model_dir`` set after ``register_custom_ops_library`` failed with
    a message asking for the entry just set. Runtimes >= 1.24 read it per session, so the
    order does not matter; older ones (simulated) say the order."""
    if kernel_config == "1" and not _NEW_RUNTIME:
        pytest.skip("needs onnxruntime >= 1.24 (KernelInfo config)")
    here = Path(__file__).parent
    proc = _child(_ORDER, f"{here}:{here.parents[1]}", str(tmp_path),
                  env={"HO_ONNX_KERNEL_CONFIG": kernel_config})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.strip().splitlines()[-1]
    if kernel_config == "1":
        assert out == "OK", out
    else:
        assert out.startswith("ERR") and "set it before register_custom_ops_library" in out, out
