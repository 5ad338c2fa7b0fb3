"""Run an original and an optimized model on the same random inputs and compare outputs.

Both sessions get the same options. Pre-packing is disabled in both by default: ORT
pre-packs a constant MatMul weight, an offloaded weight is no longer constant, and the two
kernels round differently (~1e-5); with pre-packing off the paths are identical and the
outputs are expected to be bit-exact.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx

from .errors import UnboundDimError, UnsupportedModelError

_NP_TYPES: dict[int, type] = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.DOUBLE: np.float64,
    onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.INT8: np.int8,
    onnx.TensorProto.INT16: np.int16,
    onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.UINT8: np.uint8,
    onnx.TensorProto.UINT16: np.uint16,
    onnx.TensorProto.UINT32: np.uint32,
    onnx.TensorProto.UINT64: np.uint64,
    onnx.TensorProto.BOOL: np.bool_,
}


def input_shape(vi: onnx.ValueInfoProto, dims: Mapping[str, int]) -> list[int]:
    """Concrete shape of a graph input: symbolic dims from ``dims``, unnamed ones 1."""
    shape = []
    for d in vi.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            shape.append(d.dim_value)
        elif d.dim_param:
            if d.dim_param not in dims:
                raise UnboundDimError(
                    f"input {vi.name!r} has symbolic dimension {d.dim_param!r}: "
                    f"pass --dim {d.dim_param}=N"
                )
            shape.append(dims[d.dim_param])
        else:
            shape.append(1)
    return shape


def random_inputs(model: onnx.ModelProto, dims: Mapping[str, int] | None = None, *,
                  seed: int = 0, int_high: int = 8) -> dict[str, np.ndarray]:
    """Random feeds for every graph input that is not an initializer.

    Floats are standard normal, integers uniform in ``[0, int_high)`` (keeps indices such
    as token ids in range), booleans fair coins.
    """
    dims = dict(dims or {})
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        if not vi.type.HasField("tensor_type"):
            raise UnsupportedModelError(f"input {vi.name!r} is not a tensor: cannot make data")
        elem = vi.type.tensor_type.elem_type
        if elem not in _NP_TYPES:
            raise UnsupportedModelError(
                f"input {vi.name!r} has element type "
                f"{onnx.TensorProto.DataType.Name(elem)}, for which no random data is made"
            )
        shape = input_shape(vi, dims)
        np_type = _NP_TYPES[elem]
        if np_type is np.bool_:
            arr = rng.random(shape) < 0.5
        elif np.issubdtype(np_type, np.floating):
            arr = rng.standard_normal(shape).astype(np_type)
        else:
            arr = rng.integers(0, int_high, size=shape).astype(np_type)
        feeds[vi.name] = np.asarray(arr)
    return feeds


@dataclass
class OutputDiff:
    """How one output of the optimized model differs from the original's."""

    name: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    exact: bool
    close: bool  # every element within atol + rtol * |original| (exact when both are 0)


@dataclass
class VerifyReport:
    """Comparison of all outputs over all runs."""

    outputs: list[OutputDiff] = field(default_factory=list)
    runs: int = 0
    seconds_original: list[float] = field(default_factory=list)  # per run
    seconds_optimized: list[float] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return all(o.exact for o in self.outputs)

    @property
    def ok(self) -> bool:
        return all(o.close for o in self.outputs)


def compare_arrays(name: str, a: np.ndarray, b: np.ndarray, *, atol: float = 0.0,
                   rtol: float = 0.0) -> OutputDiff:
    """Max abs/rel error of ``b`` against ``a`` (NaNs in the same places count as equal)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return OutputDiff(name, tuple(b.shape), float("inf"), float("inf"), False, False)
    exact = bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if a.size == 0 or exact or a.dtype.kind not in "fciub":
        bad = 0.0 if exact else float("inf")
        return OutputDiff(name, tuple(a.shape), bad, bad, exact, exact)
    af, bf = a.astype(np.complex128 if a.dtype.kind == "c" else np.float64), b.astype(
        np.complex128 if a.dtype.kind == "c" else np.float64)
    diff = np.abs(af - bf)
    both_nan = np.isnan(af) & np.isnan(bf)
    diff[both_nan] = 0.0
    diff[np.isnan(diff)] = np.inf
    max_abs = float(diff.max())
    rel = diff / np.maximum(np.abs(af), 1e-30)
    close = bool(np.all(diff <= atol + rtol * np.abs(af))) if (atol or rtol) else False
    return OutputDiff(name, tuple(a.shape), max_abs, float(rel.max()), False, close)


OPT_LEVELS = ("disable", "basic", "extended", "all")


def ort_opt_level(name: str):  # type: ignore[no-untyped-def]
    """ORT's GraphOptimizationLevel for ``disable``/``basic``/``extended``/``all``."""
    import onnxruntime as ort

    levels = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    if name not in levels:
        raise ValueError(f"optimization level must be one of {OPT_LEVELS}, not {name!r}")
    return levels[name]


def make_session(path: str | os.PathLike[str], *, optimized: bool, providers: list[str],
                 execution_order: str = "priority", prepacking: bool = False,
                 opt_level: str = "all"):  # type: ignore[no-untyped-def]
    """An ORT session; ``optimized`` registers the ho_onnx library.

    ``opt_level`` is ORT's graph optimization level (``disable`` ... ``all``, the default).
    """
    import onnxruntime as ort

    from .runtime import session_options

    so = ort.SessionOptions()
    so.graph_optimization_level = ort_opt_level(opt_level)
    if not prepacking:
        so.add_session_config_entry("session.disable_prepacking", "1")
    if optimized:
        so = session_options(path, base=so, execution_order=execution_order)
    elif execution_order == "priority":
        so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    return ort.InferenceSession(str(path), sess_options=so, providers=providers)


def verify(original: str | os.PathLike[str], optimized: str | os.PathLike[str], *,
           dims: Mapping[str, int] | None = None, runs: int = 1, seed: int = 0,
           int_high: int = 8, providers: list[str] | None = None,
           execution_order: str = "priority", prepacking: bool = False, atol: float = 0.0,
           rtol: float = 0.0, opt_level: str = "all") -> VerifyReport:
    """Run both models ``runs`` times on fresh random inputs; worst differences per output."""
    providers = providers or ["CPUExecutionProvider"]
    model = onnx.load(str(original), load_external_data=False)
    kw = {"providers": providers, "execution_order": execution_order,
          "prepacking": prepacking, "opt_level": opt_level}
    s_orig = make_session(original, optimized=False, **kw)  # type: ignore[arg-type]
    s_opt = make_session(optimized, optimized=True, **kw)  # type: ignore[arg-type]
    names = [o.name for o in s_orig.get_outputs()]
    if names != [o.name for o in s_opt.get_outputs()]:
        raise UnsupportedModelError("the two models have different outputs")
    worst: dict[str, OutputDiff] = {}
    report = VerifyReport()
    for r in range(runs):
        feeds = random_inputs(model, dims, seed=seed + r, int_high=int_high)
        t0 = time.perf_counter()
        a = s_orig.run(None, feeds)
        t1 = time.perf_counter()
        b = s_opt.run(None, feeds)
        report.seconds_optimized.append(time.perf_counter() - t1)
        report.seconds_original.append(t1 - t0)
        for name, x, y in zip(names, a, b, strict=True):
            d = compare_arrays(name, x, y, atol=atol, rtol=rtol)
            w = worst.get(name)
            if w is None or (w.close and not d.close) or (
                w.close == d.close and d.max_abs > w.max_abs
            ):
                worst[name] = d
        report.runs += 1
    report.outputs = [worst[n] for n in names]
    return report
