"""ORT sessions and inputs for the tools that run models (verify, profile, optimize).

Optimization levels by name, a session with or without the op library, and random feeds
for a model's inputs.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from ...errors import HoOnnxError, PastTableError, UnsupportedModelError
from ...graph.dims import graph_inputs, input_shapes, is_mask_input, shape_text
from ...graph.load import check_text, read_proto, validate_weight_data
from ...units import INT64_MAX, format_bytes

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


def model_for_ort(path: str | os.PathLike[str]) -> onnx.ModelProto:
    """The model at ``path`` (weights left on disk), checked before ORT is given it: its
    strings are UTF-8 (ORT's errors quote them) and its external data lies inside its folder
    (whatever this ORT version checks itself). Unreadable: :class:`ModelLoadError`."""
    p = Path(path)
    model = read_proto(p)
    check_text(model, os.fspath(p))
    validate_weight_data(model, p.resolve().parent)
    return model


@functools.cache
def numpy_max_ndim() -> int:
    """The most dimensions a numpy array may have here (64 from numpy 2, 32 before)."""
    ndim = 1
    while ndim < 1024:
        try:
            np.empty((0,) * (ndim + 1))
        except ValueError:
            break
        ndim += 1
    return ndim


def _check_feed_shape(name: str, shape: list[int], itemsize: int) -> None:
    """Refuse a negative dim, more dims than numpy holds, or a feed larger than this
    machine's memory."""
    if any(d < 0 for d in shape):
        raise UnsupportedModelError(
            f"input {name!r} declares the shape {shape_text(shape)}: a negative dim is not a "
            "valid ONNX shape (a dim is a value >= 0 or a name)")
    # the bytes of the dims but the zero ones: what numpy indexes even for an empty array
    others = int(np.prod([d for d in shape if d], dtype=object)) * itemsize
    nbytes = 0 if 0 in shape else others
    try:
        memory: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # unknown here: numpy decides
        memory = None
    if memory is not None and nbytes > memory:
        raise UnsupportedModelError(
            f"input {name!r} of shape {shape_text(shape)} needs {format_bytes(nbytes)}, more "
            f"than this machine's memory ({format_bytes(memory)}): choose smaller dims")
    # numpy, through which ORT's Python API takes inputs, refuses more dims than it holds
    # and, even for an empty array, other dims whose bytes exceed its index type (found by
    # the optimize fuzzer, seed 158: an empty rank-302 input was an "unexpected ValueError")
    why = (f"has {len(shape)} dimensions, more than numpy's {numpy_max_ndim()}"
           if len(shape) > numpy_max_ndim()
           else f"of shape {shape_text(shape)} is empty, but numpy cannot index its other "
           "dims; choose other dims"
           if others > np.iinfo(np.intp).max else "")
    if why:
        raise UnsupportedModelError(
            f"input {name!r} {why} (ONNX Runtime's Python API takes inputs as numpy arrays: "
            "no data can be made for it)")


def signature(model: onnx.ModelProto | ir.Model) -> ir.Model:
    """The inputs a caller feeds ``model`` (a file ORT is given), as an ``onnx_ir`` model of
    no nodes: what :func:`~ho_onnx.graph.dims.input_shapes` reads, without reading the
    graph."""
    if isinstance(model, ir.Model):
        return model
    inits = {t.name for t in model.graph.initializer}
    inputs = [ir.serde.deserialize_value_info_proto(vi, None) for vi in model.graph.input
              if vi.name not in inits]
    return ir.Model(ir.Graph(inputs, [], nodes=[]), ir_version=model.ir_version)


def checked_inputs(model: onnx.ModelProto, dims: Mapping[str, int] | None = None, *,
                   shapes: Mapping[str, list[int]] | None = None,
                   **kw: Any) -> dict[str, np.ndarray]:
    """:func:`random_inputs`, after refusing bound dims past the model's own position or
    mask tables with ``plan``'s one-line error (:class:`~ho_onnx.errors.PastTableError`,
    found by the analysis): ``verify`` and ``profile`` ran into ORT's raw Gather and
    broadcast errors. A model the analysis cannot read is left to ORT, as before (found by
    the optimize fuzzer: a damaged model on which onnx_ir raises)."""
    feeds = random_inputs(model, dims, shapes=shapes, **kw)  # (unbound dims: its error)
    if dims or shapes:
        from ...graph.analyse import analyse

        try:
            analyse(model, dims, shapes=shapes)
        except PastTableError:
            raise
        except Exception:  # (any other defect: ORT's own error, as before)
            pass
    return feeds


def random_inputs(model: onnx.ModelProto | ir.Model, dims: Mapping[str, int] | None = None,
                  *, seed: int = 0, int_high: int = 8,
                  shapes: Mapping[str, list[int]] | None = None) -> dict[str, np.ndarray]:
    """Random feeds for every graph input that is not an initializer.

    Shapes: :func:`~ho_onnx.graph.dims.input_shapes` (``dims``, whole ``shapes``, dims
    without a name 1; every missing dim named in one error). Floats are standard normal,
    integers uniform in ``[0, int_high)`` (keeps indices such as token ids in range),
    booleans fair coins, strings ``"s<integer>"`` of such integers; attention masks are ones.
    """
    sig = signature(model)
    all_shapes = input_shapes(sig, dict(dims or {}), shapes, unnamed=1)
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for v in graph_inputs(sig):
        name = str(v.name)
        if not isinstance(v.type, ir.TensorType):
            raise UnsupportedModelError(f"input {name!r} is not a tensor: cannot make data")
        elem = int(v.type.dtype)
        shape = all_shapes.get(name, [])
        if elem == onnx.TensorProto.STRING:  # (found by hand: refused, so no verify)
            _check_feed_shape(name, shape, 16)
            words = rng.integers(0, int_high, size=shape).ravel()
            feeds[name] = np.array([f"s{w}" for w in words], dtype=object).reshape(shape)
            continue
        if elem not in _NP_TYPES:
            raise UnsupportedModelError(
                f"input {name!r} has element type "
                f"{onnx.TensorProto.DataType.Name(elem)}, for which no random data is made"
            )
        np_type = _NP_TYPES[elem]
        _check_feed_shape(name, shape, np.dtype(np_type).itemsize)
        if is_mask_input(name):
            arr = np.ones(shape, dtype=np_type)
        elif np_type is np.bool_:
            arr = rng.random(shape) < 0.5
        elif np.issubdtype(np_type, np.floating):
            arr = rng.standard_normal(shape).astype(np_type)
        else:  # (high never past the type: values wrapped around were negative token ids)
            # (and never past int64: numpy draws them as int64)
            high = min(int_high, int(np.iinfo(np_type).max) + 1, INT64_MAX + 1)
            arr = rng.integers(0, high, size=shape).astype(np_type)
        feeds[name] = np.asarray(arr)
    return feeds


def run_outputs(session: Any, feeds: Mapping[str, Any], what: str) -> list[Any]:
    """``session.run(None, feeds)``; a ValueError of ORT's Python layer, which hands the
    outputs over as numpy arrays, is an :class:`UnsupportedModelError` naming ``what``
    (found by hand: an output of 70 dims, more than numpy holds, was ORT's "number of
    dimensions must be within [0, 64]" shown as an unexpected error). ORT's own errors (a
    kernel that fails) pass as they are."""
    try:
        return session.run(None, dict(feeds))
    except ValueError as e:
        hint = (f" (it hands outputs over as numpy arrays, of at most {numpy_max_ndim()} dims)"
                if "dimensions" in str(e) else "")
        raise UnsupportedModelError(
            f"running {what}, ONNX Runtime's Python API failed: {e}{hint}") from None


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


def require_providers(session: Any, requested: Sequence[str], what: str) -> None:
    """Raise :class:`~ho_onnx.errors.HoOnnxError` when ``session`` (ORT's) left out a
    provider of ``requested``: ORT then runs on the others (the CPU) with only a warning,
    and a GPU's comparison or measurement would silently be the CPU's. ``what`` names the
    work ("verifying", "profiling", ...)."""
    used = list(session.get_providers())
    missing = [p for p in requested if p not in used]
    if missing:
        import onnxruntime as ort

        raise HoOnnxError(
            f"ONNX Runtime cannot use {', '.join(missing)} here (this onnxruntime has "
            f"{', '.join(ort.get_available_providers())}): {what} would run on "
            f"{', '.join(used)} instead")


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
    sess = ort.InferenceSession(str(path), sess_options=so, providers=providers)
    require_providers(sess, providers, f"running {os.fspath(path)!r}")
    return sess


