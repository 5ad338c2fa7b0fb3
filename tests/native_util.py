"""Helpers of the native-library safety tests (issue 9): hand-written graphs of the cache
ops, sessions on plain onnxruntime with the library registered, and the override that runs
the tests against another build of the library (the sanitizer build, or an old commit's):

    HO_ONNX_TEST_OPS=/path/to/_ops.cpython-311-x86_64-linux-gnu.so pytest tests/...

loads that file as ``ho_onnx._ops`` before anything else imports it (conftest.py calls
``load_ops_override``), so the ops, the counters and the fault hooks (``testing_ops``, the
``_ops_testing`` beside it) all come from it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

D = "ai.hyperoffload"


def load_ops_override() -> None:
    path = os.environ.get("HO_ONNX_TEST_OPS")
    if not path or "ho_onnx._ops" in sys.modules:
        return
    import ho_onnx  # the package itself (Python only)

    spec = importlib.util.spec_from_file_location("ho_onnx._ops", path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ho_onnx._ops"] = mod
    spec.loader.exec_module(mod)
    ho_onnx._ops = mod  # type: ignore[attr-defined]


def ops():
    load_ops_override()
    from ho_onnx import _ops

    return _ops


def testing_ops():
    """``ho_onnx._ops_testing``: the fault hooks (``set_debug``) and the harnesses of the
    header-only C++ logic, built only in a testing build (HO_ONNX_TESTING=ON: an editable
    install, scripts/test_native.sh, scripts/gpu_run.sh). Loaded from beside the ``_ops`` in
    use (HO_ONNX_TEST_OPS's build too), so both reach one copy of the library; a build
    without it fails the test that asks for it."""
    mod = sys.modules.get("ho_onnx._ops_testing")
    if mod is not None:
        return mod
    beside = Path(ops().__file__).parent
    found = sorted(beside.glob("_ops_testing.*.so"))
    if not found:
        raise RuntimeError(f"no ho_onnx._ops_testing in {beside}: not a testing build of the "
                           "library (CMake HO_ONNX_TESTING=ON; editable installs are)")
    spec = importlib.util.spec_from_file_location("ho_onnx._ops_testing", found[0])
    assert spec is not None and spec.loader is not None, found[0]
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ho_onnx._ops_testing"] = mod
    spec.loader.exec_module(mod)
    return mod


def hnode(op: str, inputs: list[str], outputs: list[str], **attrs) -> onnx.NodeProto:
    # attributes built explicitly: make_node(name=...) would name the node instead
    node = helper.make_node(op, inputs, outputs, domain=D)
    node.attribute.extend(helper.make_attribute(k, v) for k, v in sorted(attrs.items()))
    return node


def make_model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(D, 1)],
        ir_version=10,
    )


def weight_attrs(location: str, offset: int, length: int, shape: list[int],
                 name: str = "w", tier: str | None = None, **extra) -> dict:
    a = dict(location=location, offset=offset, length=length, shape=list(shape), name=name)
    if tier is not None:
        a["tier"] = tier
    a.update(extra)
    return a


def session_options(model_dir=None, arena: bool = True, order: str = "priority",
                    config: dict[str, str] | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.enable_cpu_mem_arena = arena
    so.execution_order = (ort.ExecutionOrder.PRIORITY_BASED if order == "priority"
                          else ort.ExecutionOrder.DEFAULT)
    so.log_severity_level = 4  # expected failures: keep the log quiet
    if model_dir is not None:
        so.add_session_config_entry("ho_onnx.model_dir", str(model_dir))
    for k, v in (config or {}).items():
        so.add_session_config_entry(k, v)
    so.register_custom_ops_library(os.path.abspath(ops().__file__))
    return so


def session(path, so=None, **kw):
    import onnxruntime as ort

    if so is None:
        so = session_options(Path(path).parent, **kw)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def save(model: onnx.ModelProto, directory, name: str = "model.onnx") -> Path:
    p = Path(directory) / name
    onnx.save(model, str(p))
    return p


# ---------------------------------------------------------------------------------------
# The failure graph: a node that fails (Gather with an out-of-range index) between every
# cache op and its completion, in both execution orders (data edges force the order:
# Shape(wy) and Shape(t) feed the index; the failing Gather feeds the Detach and the Wait).

N = 1 << 16  # 256 KiB of float32: above malloc's mmap threshold (freed memory is unmapped)


# The failure graphs' constants: the empty weight placeholder, a zero and the table read by
# the failing node.
_FAILURE_INITS = (
    helper.make_tensor("s0", TensorProto.FLOAT, [0], []),
    helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
    helper.make_tensor("table", TensorProto.FLOAT, [4], [1, 2, 3, 4]),
)


def _after_store_and_prefetch(value: str, out: str) -> list[onnx.NodeProto]:
    """``out`` = ``value`` + 0 * Shape(wy) + 0 * Shape(t): the same value, computed only
    after the weight Prefetch (``wy``) and the Store (``t``) ran."""
    return [
        helper.make_node("Shape", ["wy"], ["sw"]),
        helper.make_node("Shape", ["t"], ["st"]),
        helper.make_node("Mul", ["sw", "zero"], ["sw0"]),
        helper.make_node("Mul", ["st", "zero"], ["st0"]),
        helper.make_node("Add", [value, "sw0"], ["i1"]),
        helper.make_node("Add", ["i1", "st0"], [out]),
    ]


def failure_model(tier: str = "host", n: int = N, with_wait: bool = True,
                  with_detach: bool = True) -> onnx.ModelProto:
    nodes = [
        hnode("Prefetch", ["s0"], ["wy"], **weight_attrs("w.bin", 0, 4 * n, [n], "w", tier)),
        helper.make_node("Relu", ["x"], ["h"]),
        hnode("Store", ["h"], ["t"]),
        *_after_store_and_prefetch("idx", "i2"),
        helper.make_node("Gather", ["table", "i2"], ["g"]),
    ]
    if with_detach:
        nodes.append(hnode("Detach", ["h", "t", "g"], ["t2"]))
    else:
        nodes.append(helper.make_node("Identity", ["t"], ["t2"]))
    nodes.append(hnode("Prefetch", ["t2"], ["y"]))
    nodes.append(hnode("Wait", ["y"], ["z"]))
    if with_wait:
        nodes.append(hnode("Wait", ["wy", "g"], ["w"]))
    else:
        nodes.append(helper.make_node("Identity", ["wy"], ["w"]))
    nodes.append(helper.make_node("Add", ["z", "w"], ["out"]))
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n]),
         helper.make_tensor_value_info("idx", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [n])],
        _FAILURE_INITS,
    )


def write_failure_model(folder, tier: str = "host", n: int = N, **kw) -> tuple[Path, np.ndarray]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    w = (np.arange(n, dtype=np.float32) % 1000) * 0.5 + 1.0
    w.tofile(folder / "w.bin")
    return save(failure_model(tier, n, **kw), folder), w


def moving_failure_model(m: int = 1024) -> onnx.ModelProto:
    """The failure graph with a stored activation of dynamic length ``n`` (``x`` -> ``z``)
    and a node that fails on every execution provider: ``Reshape(table, shp)`` with
    ``shp`` = [5] (good: [4]; Gather's index check is the CPU kernel's, not CUDA's). Failed
    runs of different lengths leave their records at different buffers, so a record can
    only be released by run tracking, not by the next run reusing its address. Outputs
    ``z`` (= relu(x)) and the weight ``w`` (``m`` floats of ``w.bin``, host tier)."""
    nodes = [
        hnode("Prefetch", ["s0"], ["wy"], **weight_attrs("w.bin", 0, 4 * m, [m], "w", "host")),
        helper.make_node("Relu", ["x"], ["h"]),
        hnode("Store", ["h"], ["t"]),
        *_after_store_and_prefetch("shp", "i2"),
        helper.make_node("Reshape", ["table", "i2"], ["g"]),
        hnode("Detach", ["h", "t", "g"], ["t2"]),
        hnode("Prefetch", ["t2"], ["y"]),
        hnode("Wait", ["y"], ["z"]),
        hnode("Wait", ["wy", "g"], ["w"]),
    ]
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("shp", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [m])],
        _FAILURE_INITS,
    )


def write_moving_failure_model(folder, m: int = 1024) -> tuple[Path, np.ndarray]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    w = np.arange(m, dtype=np.float32) * 0.25 - 3.0
    w.tofile(folder / "w.bin")
    return save(moving_failure_model(m), folder), w
