"""ONNX backend node tests, rewritten: every case ORT runs must still match after optimize().

onnx's wheel ships ``onnx/backend/test/data/node``: one folder per case with ``model.onnx``
and ``test_data_set_*/{input,output}_*.pb``. For each case the original model runs in plain
ONNX Runtime (CPU EP); a case ORT cannot load or run, or whose original output already
differs from the expected one, is skipped with that reason. Otherwise the model is rewritten
with every eligible tensor offloaded (``OffloadOptions(min_bytes=0, min_gap=1,
prefetch_distance=1)``), run with
``ho_onnx.InferenceSession`` (PRIORITY_BASED order) and compared to the expected
outputs with the backend suite's tolerances, and to the original's outputs bit for bit
(both a bit-exact and an only-within-tolerance result pass; they are counted apart).

Each case runs in two variants. ``inputs``: the model as shipped, its test data fed as graph
inputs (these models have no initializers, so only activations are offloaded). ``weights``:
every tensor graph input becomes an initializer holding its value in the case's first data
set, all initializers go to one external-data file, and the rewrite then also offloads them
as weights: each consumer reloads its weight through a weight ``Prefetch`` (``location``
attribute) from the library's host store, for every element type ONNX has, int4, float8 and
bfloat16 included. The weights variant also checks the library's counters: every run must
load at least the bytes of all weight Prefetches (a Prefetch ORT constant-folded at session
creation would load nothing at run time).

The cases run in worker processes (this file run as a script), a few at a time, so that a
crash or a hang in the custom-op library is reported against the case that caused it and
the other cases still run. Each case gets its own folder and its own sessions.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

NODE_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "node"
HERE = Path(__file__).resolve().parent
CHUNK = 80  # (variant, case) jobs per worker process
CHUNK_TIMEOUT_S = 240.0  # a worker that runs longer is killed: its current case hangs
# Cases rewritten and compared, so that the suite cannot silently shrink: ~5% under what
# onnx 1.22.0 + onnxruntime 1.31.1 give (inputs: 1613 compared, 348 with cache ops;
# weights: 1609 compared, 1550 with weight Prefetches).
MIN_COMPARED = 1530  # inputs variant
MIN_WITH_CACHE_OPS = 330  # of those, cases whose rewritten model has cache ops
MIN_WEIGHTS_COMPARED = 1530  # weights variant
MIN_WITH_WEIGHT_PREFETCHES = 1470  # of those, cases whose rewritten model has weight Prefetches

# The variants every case runs in (see the module docstring).
INPUTS, WEIGHTS = "inputs", "weights"
VARIANTS = (INPUTS, WEIGHTS)

# Element types numpy has no dtype for: ORT's Python binding neither takes nor returns them
# as arrays, so such models are fed and read through OrtValues (packed bytes).
EXOTIC_TYPES = frozenset(
    getattr(onnx.TensorProto, n) for n in (
        "BFLOAT16", "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ",
        "UINT4", "INT4", "FLOAT4E2M1", "FLOAT8E8M0", "UINT2", "INT2")
    if hasattr(onnx.TensorProto, n))

# Result statuses.
BITEXACT, TOLERANCE, SKIP, FAIL = "bitexact", "tolerance", "skip", "fail"


def case_names() -> list[str]:
    if not NODE_DIR.is_dir():
        return []
    return sorted(p.name for p in NODE_DIR.iterdir()
                  if (p / "model.onnx").is_file() and any(p.glob("test_data_set_*")))


# --------------------------------------------------------------------------------------
# One case (runs in a worker process)
# --------------------------------------------------------------------------------------


def _tolerances(case_dir: Path) -> tuple[float, float]:
    rtol, atol = 1e-3, 1e-7  # onnx.backend.test.loader's defaults
    data = case_dir / "data.json"
    if data.is_file():
        d = json.loads(data.read_text())
        rtol, atol = d.get("rtol", rtol), d.get("atol", atol)
    return rtol, atol


def _load_value(path: Path, tp: onnx.TypeProto) -> Any:
    """A .pb of the test data as onnx.backend.test.runner reads it (type from the graph)."""
    kind = tp.WhichOneof("value")
    if kind not in _PB_READERS:
        raise _Skip("test data", f"cannot load a .pb of type {kind}")
    proto_type, convert = _PB_READERS[kind]
    proto = proto_type()
    proto.ParseFromString(path.read_bytes())
    return convert(proto)


# TypeProto kind -> (message of its .pb files, its conversion to Python values)
_PB_READERS: dict[str | None, tuple[Any, Any]] = {
    "tensor_type": (onnx.TensorProto, numpy_helper.to_array),
    "sequence_type": (onnx.SequenceProto, numpy_helper.to_list),
    "optional_type": (onnx.OptionalProto, numpy_helper.to_optional),
    "map_type": (onnx.MapProto, numpy_helper.to_dict),
}


class _Skip(Exception):  # a control-flow signal, not an error
    def __init__(self, category: str, reason: str) -> None:
        super().__init__(reason)
        self.category, self.reason = category, reason


class _Fail(Exception):
    def __init__(self, category: str, reason: str) -> None:
        super().__init__(reason)
        self.category, self.reason = category, reason


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    line = text.splitlines()[0]
    # ORT prefixes messages with a source location and a C++ signature: keep what follows.
    line = re.sub(r"/onnxruntime_src/\S+:\d+ .*?\) (?=\S)", "", line)
    line = line.replace(str(NODE_DIR), "<node>")
    return f"{type(e).__name__}: {line[:300]}"


def _ort_code(e: BaseException) -> str:
    m = re.search(r"\[ONNXRuntimeError\] : \d+ : (\w+)", str(e))
    return m.group(1) if m else type(e).__name__


def _mismatch(expected: Any, actual: Any, rtol: float, atol: float, where: str) -> str | None:
    """None if ``actual`` matches ``expected`` as the backend runner's assert_similar_outputs
    checks it (NaNs equal), else the first line of what differs."""
    if expected is None or actual is None:
        return None if expected is None and actual is None else (
            f"{where}: expected {type(expected).__name__}, got {type(actual).__name__}")
    if isinstance(expected, dict) or isinstance(actual, dict):
        if not (isinstance(expected, dict) and isinstance(actual, dict)):
            return f"{where}: expected {type(expected).__name__}, got {type(actual).__name__}"
        if sorted(expected) != sorted(actual):
            return f"{where}: map keys differ"
        for k in expected:
            r = _mismatch(np.asarray(expected[k]), np.asarray(actual[k]), rtol, atol,
                          f"{where}[{k!r}]")
            if r:
                return r
        return None
    if isinstance(expected, (list, tuple)) or isinstance(actual, (list, tuple)):
        if not (isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple))):
            return f"{where}: expected {type(expected).__name__}, got {type(actual).__name__}"
        if len(expected) != len(actual):
            return f"{where}: sequence length {len(actual)}, expected {len(expected)}"
        for j, (e, a) in enumerate(zip(expected, actual, strict=True)):
            r = _mismatch(e, a, rtol, atol, f"{where}[{j}]")
            if r:
                return r
        return None
    expected, actual = np.asarray(expected), np.asarray(actual)
    if expected.shape != actual.shape:
        return f"{where}: shape {actual.shape}, expected {expected.shape}"
    try:
        if expected.dtype == object:
            np.testing.assert_array_equal(actual, expected)
        else:
            if expected.dtype != actual.dtype:
                return f"{where}: dtype {actual.dtype}, expected {expected.dtype}"
            if expected.dtype.kind == "V":  # ml_dtypes (bfloat16, float8, int4...)
                expected, actual = expected.astype(np.float32), actual.astype(np.float32)
            np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)
    except (AssertionError, TypeError, ValueError) as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        detail = "; ".join(ln for ln in lines if ln.startswith(("Mismatched", "Max")))
        return f"{where}: values differ ({detail or (lines[0] if lines else type(e).__name__)})"
    return None


def _identical(a: Any, b: Any) -> bool:
    """Bit for bit: same structure, dtypes, shapes and bytes."""
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and sorted(a) == sorted(b)
                and all(_identical(np.asarray(a[k]), np.asarray(b[k])) for k in a))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))
                and len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b, strict=True)))
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == object:
        return bool(np.array_equal(a, b))
    return a.tobytes() == b.tobytes()


def _ops_in(graph: onnx.GraphProto) -> set[tuple[str, str]]:
    found = set()
    for n in graph.node:
        found.add((n.domain if n.domain != "ai.onnx" else "", n.op_type))
        for attr in n.attribute:
            for g in [attr.g] if attr.HasField("g") else list(attr.graphs):
                found |= _ops_in(g)
    return found


def _session_options() -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    so.log_severity_level = 3
    so.intra_op_num_threads = 1  # the workers already run side by side
    so.inter_op_num_threads = 1
    return so


def _data_sets(case_dir: Path, model: onnx.ModelProto) -> list[tuple[dict, list]]:
    sets = []
    for ds in sorted(case_dir.glob("test_data_set_*")):
        n_in = len(list(ds.glob("input_*.pb")))
        n_out = len(list(ds.glob("output_*.pb")))
        feeds = {model.graph.input[i].name:
                 _load_value(ds / f"input_{i}.pb", model.graph.input[i].type)
                 for i in range(n_in)}
        expected = [_load_value(ds / f"output_{i}.pb", model.graph.output[i].type)
                    for i in range(n_out)]
        sets.append((feeds, expected))
    return sets


def _elem_type(tp: onnx.TypeProto) -> int | None:
    return tp.tensor_type.elem_type if tp.WhichOneof("value") == "tensor_type" else None


def _run(sess: Any, model: onnx.ModelProto, feeds: dict[str, Any]) -> list[Any]:
    """``sess.run``; through OrtValues when an input or output has an element type numpy
    lacks (bytes are packed as in ONNX's raw_data, which is ORT's layout)."""
    import onnxruntime as ort

    graph_values = [*model.graph.input, *model.graph.output]
    if not any(_elem_type(v.type) in EXOTIC_TYPES for v in graph_values):
        return sess.run(None, feeds)
    types = {v.name: _elem_type(v.type) for v in model.graph.input}
    keep, ovs = [], {}
    for name, value in feeds.items():
        if not isinstance(value, np.ndarray):
            raise _Skip("test data not loadable",
                        f"input {name!r}: a non-tensor beside a type numpy lacks")
        if types.get(name) in EXOTIC_TYPES:
            raw = numpy_helper.from_array(value).raw_data
            ov = ort.OrtValue.ortvalue_from_shape_and_type(list(value.shape), types[name])
            assert ov.tensor_size_in_bytes() == len(raw), name
            if raw:
                ctypes.memmove(ov.data_ptr(), raw, len(raw))
        else:
            arr = np.ascontiguousarray(value)
            keep.append(arr)  # the OrtValue borrows the array's memory
            ov = ort.OrtValue.ortvalue_from_numpy(arr)
        ovs[name] = ov
    got = []
    for ov in sess.run_with_ort_values(None, ovs):
        if not ov.is_tensor():
            raise _Skip("test data not loadable", "a non-tensor output beside a type numpy lacks")
        et = ov.element_type()
        if et in EXOTIC_TYPES:
            size = ov.tensor_size_in_bytes()
            raw = ctypes.string_at(ov.data_ptr(), size) if size else b""
            got.append(numpy_helper.to_array(
                onnx.helper.make_tensor("out", et, ov.shape(), raw, raw=True)))
        else:
            got.append(ov.numpy())
    return got


def _ort_category(what: str, e: BaseException) -> str:
    """A short reason category for an ORT error on the original model."""
    text = str(e)
    for pattern, cat in (
        (r"is not a registered function/op", "op not registered in ORT"),
        (r"ValidateOpsetForDomain", "opset newer than ORT supports"),
        (r"Could not find an implementation|Failed to find kernel", "no ORT CPU kernel"),
        (r"Numpy_type \d+ can't be converted|No corresponding Numpy type",
         "element type without a numpy dtype"),
        (r"Exception during initialization", "ORT kernel refuses the node's attributes"),
        (r"Non-zero status code returned while running", "ORT kernel fails at run time"),
    ):
        if re.search(pattern, text):
            return f"ORT cannot {what} the original: {cat}"
    return f"ORT cannot {what} the original: {_ort_code(e)}"


def _offloaded_types(model: onnx.ModelProto, rewritten: onnx.ModelProto) -> list[str]:
    """Element types of the tensors the cache ops move (Store inputs, weight Prefetches)."""
    from ho_onnx import contract

    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in
             [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    found = set()
    for n in rewritten.graph.node:
        if n.domain != contract.DOMAIN:
            continue
        if n.op_type == contract.STORE and n.input[0] in types:
            found.add(types[n.input[0]])
        if n.op_type == contract.PREFETCH:
            a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
            if contract.ATTR_NAME in a and a[contract.ATTR_NAME].decode() in types:
                found.add(types[a[contract.ATTR_NAME].decode()])
    return sorted(onnx.TensorProto.DataType.Name(t) for t in found if t)


def _compare_all(expected: list, got: list, rtol: float, atol: float) -> str | None:
    if len(got) < len(expected):
        return f"{len(got)} outputs, expected {len(expected)}"
    for i, e in enumerate(expected):
        r = _mismatch(e, got[i], rtol, atol, f"output {i}")
        if r:
            return r
    return None


def _weights_variant(case_dir: Path, model: onnx.ModelProto, feeds: dict[str, Any],
                     out: Path) -> tuple[onnx.ModelProto, dict[str, Any], dict[str, Any]]:
    """The weights variant of a case, written to ``out`` (data in ``out.name + '.data'``).

    Every tensor graph input fed by the first data set becomes an initializer with the bytes
    of its ``input_<i>.pb`` (re-encoded as raw data where the file holds typed fields, so
    that it can go to external data); other inputs (sequences, optionals, maps) stay inputs.
    Returns the model as written (without its data), the feeds still needed, and facts."""
    from onnx.external_data_helper import uses_external_data

    ds = sorted(case_dir.glob("test_data_set_*"))[0]
    m = onnx.ModelProto()
    m.CopyFrom(model)
    facts: dict[str, Any] = {}
    if m.ir_version < 4:  # IR < 4: every initializer must also be a graph input
        facts["ir_version_raised_from"] = m.ir_version
        m.ir_version = 4
    keep, rest = [], {}
    for i, vi in enumerate(model.graph.input):
        if vi.name not in feeds:
            keep.append(vi)
            continue
        if vi.type.WhichOneof("value") != "tensor_type":
            keep.append(vi)
            rest[vi.name] = feeds[vi.name]
            continue
        t = onnx.TensorProto()
        t.ParseFromString((ds / f"input_{i}.pb").read_bytes())
        t.name = vi.name
        if t.data_type != vi.type.tensor_type.elem_type:
            raise _Skip("weights variant: test data type differs from the graph input",
                        f"input {vi.name!r}: {t.data_type} vs {vi.type.tensor_type.elem_type}")
        if not t.HasField("raw_data") and t.data_type != onnx.TensorProto.STRING:
            r = numpy_helper.from_array(numpy_helper.to_array(t), vi.name)
            if r.data_type != t.data_type or list(r.dims) != list(t.dims):
                raise _Skip("weights variant: test data not expressible as raw data",
                            f"input {vi.name!r}")
            t = r
        m.graph.initializer.append(t)
    del m.graph.input[:]
    m.graph.input.extend(keep)
    facts["initializers"] = len(m.graph.initializer)
    facts["non_tensor_inputs"] = len(keep)
    for f in (out, out.with_name(out.name + ".data")):
        f.unlink(missing_ok=True)
    onnx.save_model(m, str(out), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=out.name + ".data", size_threshold=0)
    written = onnx.load(str(out), load_external_data=False)
    facts["external_initializers"] = sum(
        1 for t in written.graph.initializer if uses_external_data(t))
    return written, rest, facts


def _weight_prefetches(rewritten: onnx.ModelProto) -> list[tuple[str, int, int]]:
    """(weight name, element type, length) of each weight Prefetch of the main graph."""
    from ho_onnx import contract

    inits = {t.name: t.data_type for t in rewritten.graph.initializer}
    found = []
    for n in rewritten.graph.node:
        if n.domain != contract.DOMAIN or n.op_type != contract.PREFETCH:
            continue
        a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
        if contract.ATTR_LOCATION in a:
            found.append((a.get(contract.ATTR_NAME, b"?").decode(), inits.get(n.input[0], 0),
                          int(a.get(contract.ATTR_LENGTH, 0))))
    return found


def run_case(name: str, work: Path, variant: str = INPUTS) -> dict[str, Any]:
    """Run one case in one variant; returns {"status", "category", "reason", "cache_ops", ...}."""
    import onnxruntime as ort
    from backend_skips import CASE_SKIPS, NONDETERMINISTIC_OPS, WEIGHTS_CASE_SKIPS

    from ho_onnx import contract
    from ho_onnx.errors import HoOnnxError
    from ho_onnx.rewrite.pipeline import optimize
    from ho_onnx.schedule.options import OffloadOptions
    from ho_onnx.target.ort import runtime as ho_runtime
    from ho_onnx.target.ort.runtime import InferenceSession

    case_dir = NODE_DIR / name
    res: dict[str, Any] = {"case": name, "variant": variant, "cache_ops": 0}
    try:
        if name in CASE_SKIPS:
            raise _Skip("listed in backend_skips.CASE_SKIPS", CASE_SKIPS[name])
        if variant == WEIGHTS and name in WEIGHTS_CASE_SKIPS:
            raise _Skip("listed in backend_skips.WEIGHTS_CASE_SKIPS", WEIGHTS_CASE_SKIPS[name])
        model = onnx.load(str(case_dir / "model.onnx"))
        random_ops = sorted(op for d, op in _ops_in(model.graph) if (d, op) in NONDETERMINISTIC_OPS)
        if random_ops:
            raise _Skip("nondeterministic op (backend_skips.NONDETERMINISTIC_OPS)",
                        f"uses {', '.join(random_ops)}: "
                        f"{NONDETERMINISTIC_OPS[('', random_ops[0])]}")
        rtol, atol = _tolerances(case_dir)
        try:
            data = _data_sets(case_dir, model)
        except _Skip:
            raise
        except Exception as e:
            raise _Skip("test data not loadable", _first_line(e)) from None
        model_path = case_dir / "model.onnx"
        if variant == WEIGHTS:
            model_path = work / "weights.onnx"
            try:
                model, feeds, facts = _weights_variant(case_dir, model, data[0][0], model_path)
            except _Skip:
                raise
            except Exception as e:
                raise _Fail("weights variant cannot be built", _first_line(e)) from None
            res.update(facts)
            data = [(feeds, data[0][1])]

        # (1) the original in plain ORT
        try:
            sess = ort.InferenceSession(str(model_path), _session_options(),
                                        providers=["CPUExecutionProvider"])
        except Exception as e:
            if variant != WEIGHTS:
                raise _Skip(_ort_category("load", e), _first_line(e)) from None
            # ORT cannot load every model whose initializers all live in external data (its
            # shape inference does not read external shape inputs, it refuses zero-length
            # external tensors, If-folding loses the model path...): the reference is then
            # the same model with its data inline.
            try:
                inline = onnx.load(str(model_path))  # external data read into raw_data
                sess = ort.InferenceSession(inline.SerializeToString(), _session_options(),
                                            providers=["CPUExecutionProvider"])
            except Exception:
                raise _Skip(_ort_category("load", e), _first_line(e)) from None
            res["original_inline"] = _first_line(e)
        originals = []
        for feeds, expected in data:
            try:
                got = _run(sess, model, feeds)
            except _Skip:
                raise
            except Exception as e:
                raise _Skip(_ort_category("run", e), _first_line(e)) from None
            res["ort_runs_original"] = True
            r = _compare_all(expected, got, rtol, atol)
            if r:
                raise _Skip("original mismatches expected", f"original mismatches expected: {r}")
            originals.append(got)
        del sess

        # (2) rewrite, forcing every eligible tensor off the fast tier
        out = work / "model.ho.onnx"
        try:
            optimize(model_path, out,
                     OffloadOptions(min_bytes=0, min_gap=1, prefetch_distance=1))
        except HoOnnxError as e:
            raise _Fail(f"optimize raised {type(e).__name__}", _first_line(e)) from None
        except Exception as e:
            raise _Fail(f"optimize crashed with {type(e).__name__}", _first_line(e)) from None
        rewritten = onnx.load(str(out), load_external_data=False)
        kinds = collections.Counter(n.op_type for n in rewritten.graph.node
                                    if n.domain == contract.DOMAIN)
        res["cache_ops"] = sum(kinds.values())
        res["cache_op_kinds"] = dict(kinds)
        res["offloaded_types"] = _offloaded_types(model, rewritten)
        weight_pfs = _weight_prefetches(rewritten)
        weight_bytes = sum(length for _, _, length in weight_pfs)
        if variant == WEIGHTS:
            res["weight_prefetches"] = len(weight_pfs)
            res["weight_bytes"] = weight_bytes
            res["weight_types"] = sorted({onnx.TensorProto.DataType.Name(t)
                                          for _, t, _ in weight_pfs if t})
            res["bytes_loaded"] = []

        # (3) the rewritten model with the custom ops, PRIORITY_BASED order; run twice
        try:
            hsess = InferenceSession(out, providers=["CPUExecutionProvider"],
                                     sess_options=_session_options(),
                                     execution_order="priority")
        except Exception as e:
            raise _Fail(f"rewritten model does not load: {_ort_code(e)}",
                        _first_line(e)) from None
        exact = True
        for (feeds, expected), orig in zip(data, originals, strict=True):
            for attempt in ("run 1", "run 2"):
                ho_runtime.reset_counters()
                try:
                    got = _run(hsess, model, feeds)
                except Exception as e:
                    raise _Fail(f"rewritten model does not run: {_ort_code(e)}",
                                f"{attempt}: {_first_line(e)}") from None
                r = _compare_all(expected, got, rtol, atol)
                if r:
                    raise _Fail("rewritten mismatches expected", f"{attempt}: {r}")
                if variant == WEIGHTS:
                    c = ho_runtime.counters()
                    res["bytes_loaded"].append(c["bytes_loaded"])
                    if c["bytes_loaded"] < weight_bytes:
                        raise _Fail(
                            "weight bytes not loaded on every run "
                            "(a weight Prefetch folded or removed by ORT)",
                            f"{attempt}: bytes_loaded {c['bytes_loaded']} < {weight_bytes} "
                            f"bytes of {len(weight_pfs)} weight Prefetches "
                            f"({c['prefetches']} prefetches ran, "
                            f"{res['initializers']} initializers, "
                            f"{res['non_tensor_inputs']} graph inputs left)")
                exact = exact and len(got) == len(orig) and all(
                    _identical(a, b) for a, b in zip(orig, got, strict=True))
        res["status"] = BITEXACT if exact else TOLERANCE
    except _Skip as s:
        res.update(status=SKIP, category=s.category, reason=s.reason)
    except _Fail as f:
        res.update(status=FAIL, category=f.category, reason=f.reason)
    except Exception as e:
        res.update(status=FAIL, category=f"test harness error {type(e).__name__}",
                   reason=_first_line(e))
    return res


def _job(variant: str, case: str) -> str:
    return f"{variant}:{case}"


def _worker(out_file: str, work_root: str, jobs: list[str]) -> None:
    sys.path.insert(0, str(HERE))
    with open(out_file, "a", encoding="utf-8") as out:
        for job in jobs:
            variant, name = job.split(":", 1)
            out.write(json.dumps({"job": job, "started": True}) + "\n")
            out.flush()
            work = Path(work_root) / variant / name
            work.mkdir(parents=True, exist_ok=True)
            t = time.perf_counter()
            res = run_case(name, work, variant)
            res["seconds"] = round(time.perf_counter() - t, 4)
            res["job"] = job
            out.write(json.dumps(res) + "\n")
            out.flush()


# --------------------------------------------------------------------------------------
# Driver (pytest process)
# --------------------------------------------------------------------------------------


def _run_chunk(idx: int, names: list[str], root: Path) -> dict[str, dict]:
    """Run the jobs ``names`` ("variant:case") in worker processes; a job that kills or hangs
    its worker fails and the worker is restarted after it. Results are keyed by job."""
    import ho_onnx

    env = dict(os.environ)
    src = str(Path(ho_onnx.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([src, str(HERE), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    results: dict[str, dict] = {}
    todo = list(names)
    attempt = 0
    while todo:
        out_file = root / f"chunk{idx:03d}.{attempt}.jsonl"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(out_file),
               str(root / "cases"), *todo]
        started: str | None = None
        why = ""
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                               timeout=CHUNK_TIMEOUT_S)
            if p.returncode != 0:
                tail = (p.stderr or "").strip().splitlines()[-1:] or [""]
                code = (signal.Signals(-p.returncode).name if p.returncode < 0
                        else str(p.returncode))
                why = f"worker exited with {code} ({tail[0][:200]})"
        except subprocess.TimeoutExpired:
            why = f"worker hung (killed after {CHUNK_TIMEOUT_S:.0f} s)"
        if out_file.exists():
            for line in out_file.read_text(encoding="utf-8").splitlines():
                r = json.loads(line)
                if r.get("started"):
                    started = r["job"]
                else:
                    results[r["job"]] = r
                    started = None
        todo = [n for n in todo if n not in results]
        if started is not None and started in todo:
            results[started] = _failed_job(started, "process crash or hang",
                                           why or "worker stopped in this case")
            todo.remove(started)
        elif todo:  # died before starting anything: do not loop forever
            for n in todo:
                results[n] = _failed_job(n, "worker failed to start", why)
            todo = []
        attempt += 1
    return results


def _failed_job(job: str, category: str, reason: str) -> dict[str, Any]:
    variant, case = job.split(":", 1)
    return {"job": job, "case": case, "variant": variant, "status": FAIL, "cache_ops": 0,
            "category": category, "reason": reason}


def _run_all(jobs: list[str], root: Path) -> dict[str, dict[str, dict]]:
    """Runs the jobs; returns {variant: {case: result}}."""
    chunks = [jobs[i:i + CHUNK] for i in range(0, len(jobs), CHUNK)]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    results: dict[str, dict[str, dict]] = {v: {} for v in VARIANTS}
    with ThreadPoolExecutor(max(1, min(cpus or 1, 8))) as pool:
        for part in pool.map(lambda a: _run_chunk(a[0], a[1], root), enumerate(chunks)):
            for r in part.values():
                results[r["variant"]][r["case"]] = r
    return results


CASES = case_names()


@pytest.fixture(scope="module")
def backend_results(request, tmp_path_factory) -> dict[str, Any]:
    """Runs the selected (variant, case) jobs (all of them when the summary test is selected);
    returns {"results": {variant: {case: result}}, "seconds", "root"}."""
    if not CASES:
        pytest.skip(f"onnx {onnx.__version__} ships no backend node data at {NODE_DIR}")
    items = [it for it in request.session.items if it.module is request.module]
    if any(it.originalname == "test_summary" for it in items):
        wanted = {(v, c) for v in VARIANTS for c in CASES}
    else:
        variant_of = {"test_case": INPUTS, "test_weights_case": WEIGHTS}
        wanted = {(variant_of[it.originalname], it.callspec.params["case"]) for it in items
                  if it.originalname in variant_of and getattr(it, "callspec", None)
                  and "case" in it.callspec.params}
    # a case's variants side by side, so that one worker reads the case's files once
    jobs = [_job(v, c) for c in CASES for v in VARIANTS if (v, c) in wanted]
    root = tmp_path_factory.mktemp("backend_nodes")
    t = time.perf_counter()
    results = _run_all(jobs, root)
    return {"results": results, "seconds": time.perf_counter() - t, "root": root}


def _check(r: dict[str, Any]) -> None:
    if r["status"] == SKIP:
        pytest.skip(f"{r['category']}: {r['reason']}")
    if r["status"] == FAIL:
        pytest.fail(f"{r['category']}: {r['reason']}", pytrace=False)


@pytest.mark.parametrize("case", CASES)
def test_case(case, backend_results):
    """The ``inputs`` variant: the model as shipped."""
    _check(backend_results["results"][INPUTS][case])


@pytest.mark.parametrize("case", CASES)
def test_weights_case(case, backend_results):
    """The ``weights`` variant: the test inputs as initializers in external data."""
    _check(backend_results["results"][WEIGHTS][case])


def summarize(results: dict[str, dict], seconds: float) -> dict[str, Any]:
    """The summary of one variant's results ({case: result})."""
    by = collections.Counter(r["status"] for r in results.values())
    skips = collections.Counter(r["category"] for r in results.values() if r["status"] == SKIP)
    fails: dict[str, list[str]] = collections.defaultdict(list)
    for r in results.values():
        if r["status"] == FAIL:
            fails[r["category"]].append(f"{r['case']}: {r['reason']}")
    compared = [r for r in results.values() if r["status"] in (BITEXACT, TOLERANCE, FAIL)]
    kinds: collections.Counter = collections.Counter()
    types: collections.Counter = collections.Counter()
    weight_types: collections.Counter = collections.Counter()
    for r in compared:
        kinds.update(r.get("cache_op_kinds", {}))
        types.update(r.get("offloaded_types", []))
        weight_types.update(r.get("weight_types", []))
    with_weights = [r for r in compared if r.get("weight_prefetches", 0) > 0]
    return {
        "onnx": onnx.__version__,
        "total_cases": len(results),
        "ort_runs_original": sum(1 for r in results.values() if r.get("ort_runs_original")),
        "original_only_inline": sum(1 for r in results.values() if r.get("original_inline")
                                    and r.get("ort_runs_original")),
        "original_matches_expected": len(compared),
        "skipped": by[SKIP],
        "skipped_by_reason": dict(skips.most_common()),
        "rewritten_ok_bitexact": by[BITEXACT],
        "rewritten_ok_within_tolerance_only": by[TOLERANCE],
        "failures": by[FAIL],
        "failures_by_reason": dict(fails),
        "compared_with_cache_ops": sum(1 for r in compared if r.get("cache_ops", 0) > 0),
        "cache_ops_by_kind": dict(kinds),
        "cases_by_offloaded_element_type": dict(types.most_common()),
        "compared_with_weight_prefetches": len(with_weights),
        "weight_prefetches": sum(r["weight_prefetches"] for r in with_weights),
        "weight_bytes_per_run": sum(r["weight_bytes"] for r in with_weights),
        "cases_by_weight_element_type": dict(weight_types.most_common()),
        "tolerance_only_cases": sorted(r["case"] for r in results.values()
                                       if r["status"] == TOLERANCE),
        "case_seconds": round(sum(r.get("seconds", 0.0) for r in results.values()), 1),
        "seconds": round(seconds, 1),
    }


def _summary_lines(variant: str, s: dict[str, Any]) -> list[str]:
    lines = [
        f"  [{variant}] {s['total_cases']} cases ({s['case_seconds']} s in workers)",
        f"  ORT runs the original: {s['ort_runs_original']}, "
        f"and it matches the expected outputs: {s['original_matches_expected']}",
        f"  rewritten OK, bit-exact with the original: {s['rewritten_ok_bitexact']}",
        f"  rewritten OK, within tolerance only: {s['rewritten_ok_within_tolerance_only']}",
        f"  compared cases with cache ops inserted: {s['compared_with_cache_ops']} "
        f"{s['cache_ops_by_kind']}",
        f"    by element type offloaded (cases): {s['cases_by_offloaded_element_type']}",
    ]
    if variant == WEIGHTS:
        lines.insert(2, f"    of which ORT runs only with the initializers inline: "
                     f"{s['original_only_inline']}")
        lines += [
            f"  compared cases with weight Prefetches: {s['compared_with_weight_prefetches']} "
            f"({s['weight_prefetches']} Prefetches, {s['weight_bytes_per_run']} bytes a run)",
            f"    by weight element type (cases): {s['cases_by_weight_element_type']}",
        ]
    lines += [
        f"  failures: {s['failures']}",
        *[f"    {cat}: {len(v)} e.g. {v[0]}" for cat, v in s["failures_by_reason"].items()],
        f"  skipped: {s['skipped']}",
        *[f"    {n:5d}  {cat}" for cat, n in s["skipped_by_reason"].items()],
    ]
    return [lines[0], *("  " + ln for ln in lines[1:])]


def test_summary(backend_results, capsys):
    results = backend_results["results"]
    sums = {v: summarize(results[v], backend_results["seconds"]) for v in VARIANTS}
    path = backend_results["root"] / "summary.json"
    path.write_text(json.dumps({"summary": sums, "cases": results}, indent=1, sort_keys=True))
    lines = [f"\nONNX {onnx.__version__} backend node cases, {len(VARIANTS)} variants, in "
             f"{backend_results['seconds']:.1f} s (details: {path})"]
    for v in VARIANTS:
        lines += _summary_lines(v, sums[v])
    with capsys.disabled():
        print("\n".join(lines))
    failures = [f"[{v}] {cat}: {case}" for v in VARIANTS
                for cat, cases in sums[v]["failures_by_reason"].items() for case in cases]
    assert not failures, "\n".join(failures)
    for v, minimum in ((INPUTS, MIN_COMPARED), (WEIGHTS, MIN_WEIGHTS_COMPARED)):
        s = sums[v]
        compared = s["rewritten_ok_bitexact"] + s["rewritten_ok_within_tolerance_only"]
        assert compared >= minimum, f"[{v}] only {compared} cases compared"
    assert sums[INPUTS]["compared_with_cache_ops"] >= MIN_WITH_CACHE_OPS
    assert sums[WEIGHTS]["compared_with_weight_prefetches"] >= MIN_WITH_WEIGHT_PREFETCHES


if __name__ == "__main__" and len(sys.argv) > 3 and sys.argv[1] == "--worker":
    _worker(sys.argv[2], sys.argv[3], sys.argv[4:])
