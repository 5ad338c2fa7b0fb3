"""A process that forks after running an optimized model (a preforking server, a process
pool): the child makes and runs its own sessions; the parent's session in the child is
refused with a clear error and dropping it is safe (the library's part: ORT's own exit
handlers in such a child are ORT's, so the child leaves with ``os._exit``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.options import OffloadOptions
from models.decoder import build_decoder

# Runs in a fresh interpreter: the parent runs the model, forks, and reports what its child
# saw (one word per step), ending the child itself after 60 s (the bug was a child waiting
# forever on transfer threads that exist only in the parent).
SCRIPT = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import onnxruntime as ort
    sys.path.insert(0, sys.argv[3])
    from native_util import load_ops_override
    load_ops_override()  # (HO_ONNX_TEST_OPS: the sanitizer build, as the other native tests)
    import ho_onnx

    path, step = sys.argv[1], sys.argv[2]
    feeds = {"input_ids": (np.arange(16, dtype=np.int64) % 7).reshape(1, 16)}
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1  # (ORT's own pool threads do not survive a fork either)
    s = ho_onnx.InferenceSession(path, sess_options=so)
    want = s.run(None, feeds)[0]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            if step == "new":
                got = ho_onnx.InferenceSession(path, sess_options=so).run(None, feeds)[0]
                word = "equal" if np.array_equal(got, want) else "different"
            elif step == "inherited":
                try:
                    s.run(None, feeds)
                    word = "ran"
                except Exception as e:
                    word = "refused" if "created before the process forked" in str(e) \\
                        else "other:" + str(e)[:300]
            else:  # drop the parent's session
                del s
                import gc; gc.collect()
                word = "dropped"
        except BaseException as e:
            word = "error:" + repr(e)[:300]
        os.write(w, word.encode())
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("HUNG")
            sys.exit(0)
        time.sleep(0.05)
    print(os.read(r, 4096).decode() or "DIED")
    print("parent", "equal" if np.array_equal(s.run(None, feeds)[0], want) else "different")
    sys.stdout.flush()
    os._exit(0)
""")


@pytest.fixture(scope="module")
def disk_model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fork")
    src = d / "dec.onnx"
    build_decoder(src, layers=2, hidden=64, heads=4, vocab=128, external_data=True)
    out = d / "dec.ho.onnx"
    optimize(src, out, OffloadOptions(min_bytes=0, min_gap=1, prefetch_distance=1,
                                      weight_tier="disk"), {"batch": 1, "seq": 16})
    return out


@pytest.mark.parametrize(("step", "child"), [
    ("new", "equal"),          # was: HUNG (the parent's disk threads were waited on)
    ("inherited", "refused"),  # was: HUNG
    ("drop", "dropped"),       # was: DIED (SIGSEGV joining the parent's threads)
])
def test_a_forked_child_runs_its_own_sessions(disk_model: Path, step: str, child: str):
    tests = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(disk_model), step, str(tests)],
                       capture_output=True, text=True, timeout=180, check=False)
    assert r.stdout.split("\n")[:2] == [child, "parent equal"], (r.stdout, r.stderr[-2000:])
