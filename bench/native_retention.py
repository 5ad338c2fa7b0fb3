"""Memory a process keeps per session that registers the ho-onnx library (issue 9, item 5).

Creates, runs once and destroys N sessions (each with its own SessionOptions, as a server
that loads models on demand does) and reports the growth of the resident set per session,
for three cases in separate child processes: ORT alone (a plain model, no library), ORT
with a trivial registration overhead measured by registering the library without using it,
and the library used by the model (host-tier weight + stored activation).

    python bench/native_retention.py --sessions 1000 [--ops /path/to/_ops.so]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def child(case: str, n: int, warm: int) -> dict:
    import numpy as np
    import onnxruntime as ort
    from native_util import hnode, load_ops_override, make_model, save, weight_attrs
    from onnx import TensorProto, helper

    load_ops_override()
    from ho_onnx import _ops

    lib = os.path.abspath(_ops.__file__)
    tmp = Path(tempfile.mkdtemp())
    np.arange(1024, dtype=np.float32).tofile(tmp / "w.bin")
    if case == "ort":
        m = make_model([helper.make_node("Relu", ["x"], ["z"])],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1024])],
                       [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1024])])
    else:
        m = make_model(
            [hnode("Prefetch", ["s0"], ["wy"], **weight_attrs("w.bin", 0, 4096, [1024])),
             hnode("Wait", ["wy"], ["w"]),
             hnode("Store", ["x"], ["t"]), hnode("Detach", ["x", "t"], ["t2"]),
             hnode("Prefetch", ["t2"], ["y"]), hnode("Wait", ["y", "w"], ["z0"]),
             helper.make_node("Add", ["z0", "w"], ["z"])],
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1024])],
            [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1024])],
            [helper.make_tensor("s0", TensorProto.FLOAT, [0], [])])
    path = str(save(m, tmp))
    x = np.ones(1024, np.float32)

    def one() -> None:
        so = ort.SessionOptions()
        so.add_session_config_entry("ho_onnx.model_dir", str(tmp))
        if case != "ort":
            so.register_custom_ops_library(lib)
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        sess.run(None, {"x": x})
        del sess, so

    for _ in range(warm):
        one()
    gc.collect()
    before = rss_kib()
    for _ in range(n):
        one()
    gc.collect()
    after = rss_kib()
    return {"case": case, "sessions": n, "rss_growth_kib": after - before,
            "per_session_bytes": (after - before) * 1024 / n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--warm", type=int, default=100)
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.sessions, args.warm)))
        return 0
    for case in ("ort", "ho"):
        out = subprocess.run([sys.executable, __file__, "--child", case, "--sessions",
                              str(args.sessions), "--warm", str(args.warm)],
                             capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"{r['case']:4s} {r['sessions']} sessions: RSS +{r['rss_growth_kib']} KiB "
              f"({r['per_session_bytes']:.0f} B/session)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
