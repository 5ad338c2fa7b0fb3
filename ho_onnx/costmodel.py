"""The planner's model of the machine: compute time per node and transfer time per tensor.

Compute time comes from one of two sources:

* **analytic** (:func:`analytic_costs`): a roofline per node, FLOPs and bytes moved from the
  analysed shapes against the machine's peak rate and memory bandwidth, plus a fixed
  per-node launch/dispatch overhead;
* **profile** (:func:`profile_costs`): per-node median times measured by ORT's profiler on
  the target (``ho-onnx profile``, :mod:`ho_onnx.profile`), mapped back onto the nodes of
  the unmodified model; nodes the profile does not name are filled in as described there.

Transfer time (:func:`transfer_time`) is ``latency + bytes / bandwidth`` for one direction
(``h2d``: slow tier to fast tier, ``d2h``: fast to slow, ``disk``: a read from disk).

Units everywhere: seconds, bytes, bytes/s, FLOP/s.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from .analysis import GraphAnalysis, TensorInfo, eval_dim
from .errors import HoOnnxError

# --------------------------------------------------------------------------------------
# Machine


@dataclass(frozen=True)
class Machine:
    """Rates of one target. All fields are SI units (FLOP/s, bytes/s, seconds).

    ``peak_flops`` is for the dtype class the preset assumes: dense fp16/bf16 tensor-core
    math on GPUs (fp32 models run well below it: override, or lower ``efficiency``), fp32
    on the CPU. ``h2d_bw``/``d2h_bw`` are the two directions between the slow tier (host
    memory) and the fast tier: PCIe on a GPU, ``memcpy`` between ORT buffers and the
    library's host pool on the CPU EP.
    """

    name: str
    peak_flops: float  # FLOP/s
    mem_bw: float  # fast-tier (device) memory bandwidth, bytes/s
    h2d_bw: float  # slow -> fast, bytes/s
    d2h_bw: float  # fast -> slow, bytes/s
    disk_bw: float  # disk read, bytes/s
    transfer_latency_s: float  # fixed cost of one transfer (any direction)
    launch_overhead_s: float  # fixed cost of one node: kernel launch / ORT dispatch
    efficiency: float = 0.6  # achievable fraction of peak_flops

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "name":
                continue
            v = getattr(self, f.name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"machine {self.name!r}: {f.name} must be a finite number, "
                                 f"got {v!r}")
            if f.name in _NONNEG_FIELDS:
                if v < 0:
                    raise ValueError(f"machine {self.name!r}: {f.name} must be >= 0, got {v}")
            elif v <= 0:
                raise ValueError(f"machine {self.name!r}: {f.name} must be > 0, got {v}")
        if self.efficiency > 1:
            raise ValueError(f"machine {self.name!r}: efficiency must be in (0, 1], "
                             f"got {self.efficiency}")

    def with_overrides(self, **kw: Any) -> Machine:
        """A copy with some fields replaced (numbers may be given as strings)."""
        return replace(self, **_coerce(kw, self.name))

    def transfer_time(self, nbytes: float, direction: str) -> float:
        """:func:`transfer_time` on this machine (fits the planner's ``TransferTime``)."""
        return transfer_time(self, nbytes, direction)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write every field as a JSON object."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | os.PathLike[str],
                  base: Machine | str | None = None) -> Machine:
        """Read a machine file; keys it lacks come from a preset.

        The file is a JSON object with any subset of the fields (a ``ho-onnx calibrate``
        output may carry only ``h2d_bw``, ``d2h_bw``, ``disk_bw``, ``transfer_latency_s``).
        The preset it is merged onto is ``base`` if given, else the file's ``"base"`` key,
        else its ``"name"`` if that names a preset, else ``"cpu"``. Keys that are not
        fields (metadata such as sample sizes) are ignored.
        """
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise MachineError(f"machine file {str(p)!r} does not exist") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise MachineError(f"machine file {str(p)!r} is not readable JSON: {e}") from None
        if not isinstance(data, dict):
            raise MachineError(f"machine file {str(p)!r} must hold a JSON object")
        if base is None:
            base = data.get("base")
            if base is None and data.get("name") in MACHINES:
                base = data["name"]
            base = base or "cpu"
        base_m = base if isinstance(base, Machine) else _preset(str(base))
        known = {f.name for f in fields(cls)} - {"name"}
        kw = {k: v for k, v in data.items() if k in known}
        name = data.get("name") or f"{base_m.name}+{p.name}"
        try:
            return replace(base_m, name=str(name), **_coerce(kw, str(name)))
        except ValueError as e:
            raise MachineError(f"machine file {str(p)!r}: {e}") from None


_NONNEG_FIELDS = {"transfer_latency_s", "launch_overhead_s"}


class MachineError(HoOnnxError, ValueError):
    """A machine preset or file cannot be used."""


def _coerce(kw: Mapping[str, Any], who: str) -> dict[str, Any]:
    names = {f.name for f in fields(Machine)}
    out: dict[str, Any] = {}
    for k, v in kw.items():
        if k not in names:
            raise MachineError(f"machine {who!r}: unknown field {k!r} "
                               f"(fields: {', '.join(sorted(names))})")
        if k == "name":
            out[k] = str(v)
            continue
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            raise MachineError(f"machine {who!r}: {k} must be a number, got {v!r}") from None
    return out


# Presets. Sources:
#  * H100 SXM5 80 GB (NVIDIA H100 Tensor Core GPU datasheet): 989 TFLOP/s dense FP16/BF16
#    tensor core (1,979 "with sparsity"), HBM3 3.35 TB/s. Host link PCIe Gen5 x16:
#    ~64 GB/s theoretical per direction; 50 GB/s is an assumed achievable rate for pinned
#    cudaMemcpyAsync (measure with `ho-onnx calibrate`).
#  * H200 SXM 141 GB (NVIDIA H200 datasheet): same GH100 compute, 989 TFLOP/s dense
#    FP16/BF16; HBM3e 4.8 TB/s; PCIe Gen5 x16 as above.
#  * GPU launch overhead ~5 us (CUDA kernel launch + ORT dispatch), transfer latency ~10 us
#    (cudaMemcpyAsync issue + completion event); disk 3 GB/s (a PCIe 4 NVMe, sequential).
#  * cpu: deliberately modest defaults for the CPU EP (100 GFLOP/s fp32, 10 GB/s memory,
#    5 GB/s memcpy to/from the library's host pool, 1 GB/s disk): override them with
#    `ho-onnx calibrate` output or use a profile.
MACHINES: dict[str, Machine] = {
    "h100": Machine(
        name="h100", peak_flops=989e12, mem_bw=3.35e12, h2d_bw=50e9, d2h_bw=50e9,
        disk_bw=3e9, transfer_latency_s=10e-6, launch_overhead_s=5e-6, efficiency=0.6,
    ),
    "h200": Machine(
        name="h200", peak_flops=989e12, mem_bw=4.8e12, h2d_bw=50e9, d2h_bw=50e9,
        disk_bw=3e9, transfer_latency_s=10e-6, launch_overhead_s=5e-6, efficiency=0.6,
    ),
    "cpu": Machine(
        name="cpu", peak_flops=100e9, mem_bw=10e9, h2d_bw=5e9, d2h_bw=5e9, disk_bw=1e9,
        transfer_latency_s=5e-6, launch_overhead_s=2e-6, efficiency=0.6,
    ),
}


def _preset(name: str) -> Machine:
    key = name.lower()
    if key not in MACHINES:
        raise MachineError(f"unknown machine {name!r}: presets are "
                           f"{', '.join(sorted(MACHINES))}, or give a JSON machine file")
    return MACHINES[key]


def load_machine(name_or_path: str | os.PathLike[str] | Machine,
                 overrides: Mapping[str, Any] | None = None) -> Machine:
    """A preset name (``h100``, ``h200``, ``cpu``), a JSON machine file (see
    :meth:`Machine.from_json`) or a Machine, with ``overrides`` applied on top."""
    if isinstance(name_or_path, Machine):
        m = name_or_path
    else:
        s = os.fspath(name_or_path)
        if s.lower() in MACHINES:
            m = MACHINES[s.lower()]
        elif s.endswith(".json") or os.sep in s or os.path.exists(s):
            m = Machine.from_json(s)
        else:
            m = _preset(s)  # raises, listing the presets
    if overrides:
        m = m.with_overrides(**dict(overrides))
    return m


_DIRECTIONS = ("h2d", "d2h", "disk")


def transfer_time(machine: Machine, nbytes: float, direction: str) -> float:
    """Seconds for one transfer: ``transfer_latency_s + nbytes / bandwidth``; 0 for 0 bytes.

    ``direction`` is ``"h2d"`` (slow to fast tier), ``"d2h"`` (fast to slow) or ``"disk"``.
    """
    if direction not in _DIRECTIONS:
        raise ValueError(f"direction must be one of {_DIRECTIONS}, got {direction!r}")
    if nbytes <= 0:
        return 0.0
    bw = {"h2d": machine.h2d_bw, "d2h": machine.d2h_bw, "disk": machine.disk_bw}[direction]
    return machine.transfer_latency_s + float(nbytes) / bw


# --------------------------------------------------------------------------------------
# Analytic FLOPs and bytes

# FLOPs per output element of elementwise / normalization ops (rough; these ops are
# memory bound on every preset, so the constants rarely decide anything).
_ELEMENTWISE_FLOPS: dict[str, float] = {
    **dict.fromkeys(
        ("Add", "Sub", "Mul", "Div", "Neg", "Abs", "Relu", "LeakyRelu", "PRelu", "Max", "Min",
         "Sum", "Mean", "Clip", "Where", "Equal", "Less", "Greater", "LessOrEqual",
         "GreaterOrEqual", "And", "Or", "Xor", "Not", "Sign", "Floor", "Ceil", "Round",
         "Cast", "CastLike", "Mod", "BitShift", "IsNaN", "IsInf", "Reciprocal", "ThresholdedRelu",
         "BiasAdd", "Trilu", "QuantizeLinear", "DequantizeLinear"), 1.0),
    **dict.fromkeys(
        ("Exp", "Log", "Sqrt", "Pow", "Erf", "Tanh", "Sigmoid", "HardSigmoid", "HardSwish",
         "Softplus", "Softsign", "Elu", "Selu", "Celu", "Mish", "Sin", "Cos", "Tan", "Asin",
         "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Gelu", "FastGelu",
         "BiasGelu", "QuickGelu"), 8.0),
    **dict.fromkeys(("Softmax", "LogSoftmax", "Hardmax"), 5.0),
    **dict.fromkeys(
        ("LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
         "SkipSimplifiedLayerNormalization", "RMSNormalization", "BatchNormalization",
         "InstanceNormalization", "GroupNormalization", "LpNormalization",
         "MeanVarianceNormalization"), 8.0),
}
# FLOPs per *input* element.
_REDUCE_FLOPS: dict[str, float] = {
    **dict.fromkeys(
        ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
         "ReduceSumSquare", "ArgMax", "ArgMin", "GlobalAveragePool", "GlobalMaxPool",
         "CumSum", "TopK"), 1.0),
    **dict.fromkeys(("ReduceL2", "ReduceLogSum", "ReduceLogSumExp"), 2.0),
}
# No arithmetic, only data movement (bytes = inputs + outputs).
_MOVEMENT_OPS = frozenset((
    "Reshape", "Transpose", "Concat", "Split", "Expand", "Tile", "Pad", "Squeeze", "Unsqueeze",
    "Flatten", "Identity", "Dropout", "DepthToSpace", "SpaceToDepth", "ScatterND",
    "ScatterElements", "Scatter", "Compress", "ReverseSequence", "Resize", "Upsample",
    "ConcatFromSequence", "SplitToSequence", "MemcpyFromHost", "MemcpyToHost", "Range",
    "ConstantOfShape", "EyeLike", "OneHot", "NonZero", "Unique",
))
# Read only the part of the data input they output: bytes = 2 * output + index inputs.
_GATHER_OPS = frozenset(("Gather", "GatherElements", "GatherND", "Slice"))
# Metadata only: bytes = outputs.
_META_OPS = frozenset(("Shape", "Size", "Constant"))
_MATMUL_OPS = frozenset(("MatMul", "MatMulInteger", "QLinearMatMul", "FusedMatMul"))


def _dims_of(t: TensorInfo | None, dims: Mapping[str, int]) -> list[int] | None:
    """Concrete shape of ``t`` (None if unknown); raises UnboundDimError for unbound dims."""
    if t is None or t.shape is None:
        return None
    out: list[int] = []
    for d in t.shape:
        if isinstance(d, int):
            out.append(d)
        elif isinstance(d, str):
            out.append(eval_dim(d, dims, t.name))
        else:
            return None
    return out


def _numel(shape: list[int] | None) -> int | None:
    return None if shape is None else math.prod(shape)


def _broadcast(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    a = [1] * (n - len(a)) + a
    b = [1] * (n - len(b)) + b
    return [max(x, y) for x, y in zip(a, b, strict=True)]


def node_flops_bytes(analysis: GraphAnalysis, pos: int,
                     dims: Mapping[str, int] | None = None) -> tuple[float, float]:
    """Analytic ``(FLOPs, bytes moved)`` of the node at schedule position ``pos``.

    Bytes are the node's distinct inputs plus outputs whose size is known (Gather/Slice
    count only the part they read; Shape/Size/Constant only their outputs). FLOPs:
    MatMul-like ``2*M*N*K`` times the broadcast batch, Gemm ``2*M*N*K``, Conv
    ``2 * out_elems * Cin/group * prod(kernel)``, Attention ``4 * elems(Q) * kv_len``,
    elementwise/normalization/softmax a few per output element, reductions one per input
    element, data movement 0, unknown ops one per output element. Unknown shapes count as 0
    (never an error); an unbound symbolic dim raises :class:`UnboundDimError` naming it.
    """
    dims = dims or {}
    node = analysis.node_at(pos)
    op = node.op_type
    tensors = analysis.tensors

    def info(name: str) -> TensorInfo | None:
        return tensors.get(name) if name else None

    def nbytes(name: str) -> int:
        t = info(name)
        if t is None:
            return 0
        return t.nbytes(dims) or 0

    in_names = list(dict.fromkeys(n for n in node.input if n))
    out_names = [n for n in node.output if n]
    in_b = sum(nbytes(n) for n in in_names)
    out_b = sum(nbytes(n) for n in out_names)
    if op in _META_OPS:
        return 0.0, float(out_b)
    if op in _GATHER_OPS:
        idx_b = sum(nbytes(n) for n in in_names[1:])
        return 0.0, float(2 * out_b + idx_b)
    bytes_moved = float(in_b + out_b)
    if op in _MOVEMENT_OPS:
        return 0.0, bytes_moved

    shape = [_dims_of(info(n), dims) for n in node.input]
    out_shape = _dims_of(info(node.output[0]), dims) if node.output else None
    out_elems = _numel(out_shape)
    flops: float | None = None
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}

    if op in _MATMUL_OPS:
        ia, ib = (0, 3) if op == "QLinearMatMul" else (0, 1)
        a = shape[ia] if len(shape) > ia else None
        b = shape[ib] if len(shape) > ib else None
        if a and b:
            ta, tb = bool(attrs.get("transA", 0)), bool(attrs.get("transB", 0))
            a2 = [1, *a] if len(a) == 1 else a
            b2 = [*b, 1] if len(b) == 1 else b
            if ta:
                a2 = [*a2[:-2], a2[-1], a2[-2]]
            if tb:
                b2 = [*b2[:-2], b2[-1], b2[-2]]
            m, k, n = a2[-2], a2[-1], b2[-1]
            batch = math.prod(_broadcast(a2[:-2], b2[:-2]))
            flops = 2.0 * batch * m * n * k
    elif op == "Gemm":
        a = shape[0] if shape else None
        b = shape[1] if len(shape) > 1 else None
        if a and b and len(a) == 2 and len(b) == 2:
            m, k = (a[1], a[0]) if attrs.get("transA", 0) else (a[0], a[1])
            n = b[0] if attrs.get("transB", 0) else b[1]
            flops = 2.0 * m * n * k + (m * n if len(node.input) > 2 and node.input[2] else 0)
    elif op in ("Conv", "ConvInteger", "QLinearConv", "FusedConv", "NhwcConv"):
        w = shape[3] if op == "QLinearConv" and len(shape) > 3 else (
            shape[1] if len(shape) > 1 else None)
        if w and out_elems is not None:
            flops = 2.0 * out_elems * math.prod(w[1:])
    elif op == "ConvTranspose":
        x = shape[0] if shape else None
        w = shape[1] if len(shape) > 1 else None
        if x and w:
            flops = 2.0 * math.prod(x) * math.prod(w[1:])
    elif op in ("Attention", "MultiHeadAttention", "GroupQueryAttention"):
        q = shape[0] if shape else None
        k = shape[1] if len(shape) > 1 else None
        if op == "Attention" and node.domain not in ("", "ai.onnx"):
            # com.microsoft Attention: input [B, S, hidden] and packed QKV weights
            if q and k:
                flops = 2.0 * math.prod(q[:-1]) * math.prod(k) + 4.0 * math.prod(q) * q[-2]
        elif q and k:  # Q, K, V given: [B, S, hidden] or [B, heads, S, head_dim]
            kv = k[-2] if len(k) == 4 else k[1] if len(k) > 1 else 1
            flops = 4.0 * math.prod(q) * kv
    elif op in ("MaxPool", "AveragePool", "LpPool"):
        k = attrs.get("kernel_shape")
        if k and out_elems is not None:
            flops = float(out_elems * math.prod(k))
    elif op in _ELEMENTWISE_FLOPS:
        if out_elems is not None:
            flops = _ELEMENTWISE_FLOPS[op] * out_elems
    elif op in _REDUCE_FLOPS:
        x = _numel(shape[0]) if shape else None
        if x is not None:
            flops = _REDUCE_FLOPS[op] * x
    elif out_elems is not None:  # unknown op: one FLOP per output element
        flops = float(out_elems)
    return float(flops or 0.0), bytes_moved


# --------------------------------------------------------------------------------------
# Per-node costs


@dataclass
class NodeCosts:
    """Compute seconds per schedule position (``seconds[pos]``, positions of
    ``GraphAnalysis.order``)."""

    seconds: np.ndarray  # float64, len(analysis.order)
    source: str  # "analytic" | "profile"
    coverage: float = 1.0  # fraction of nodes whose time came from the profile by name
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return float(self.seconds.sum())

    def between(self, start: int, stop: int) -> float:
        """Compute seconds of positions ``start <= pos < stop``."""
        return float(self.seconds[max(start, 0):max(stop, 0)].sum())

    def cumulative(self) -> np.ndarray:
        """``c[i]`` = seconds of positions ``< i`` (length ``len(seconds) + 1``)."""
        return np.concatenate(([0.0], np.cumsum(self.seconds)))


def node_time(machine: Machine, flops: float, nbytes: float) -> float:
    """Roofline seconds of one node: ``max(compute, memory) + launch overhead``."""
    return max(flops / (machine.peak_flops * machine.efficiency),
               nbytes / machine.mem_bw) + machine.launch_overhead_s


def analytic_costs(analysis: GraphAnalysis, machine: Machine,
                   dims: Mapping[str, int] | None = None) -> NodeCosts:
    """Roofline time of every node (see :func:`node_flops_bytes`, :func:`node_time`);
    Constant nodes cost 0 (ORT makes them initializers)."""
    secs = np.array([0.0 if _is_constant(analysis, pos)
                     else node_time(machine, *node_flops_bytes(analysis, pos, dims))
                     for pos in range(len(analysis.order))], dtype=np.float64)
    return NodeCosts(secs, "analytic", 1.0)


def _is_constant(analysis: GraphAnalysis, pos: int) -> bool:
    # ORT turns Constant nodes into initializers at load time: they never run.
    node = analysis.node_at(pos)
    return node.op_type == "Constant" and node.domain in ("", "ai.onnx")


class ProfileError(HoOnnxError):
    """A per-node profile file is missing or not in the expected format."""


PROFILE_FORMAT = "ho-onnx-profile"
_FUSION_SEPARATORS = ("/", "_", ":")
_TRANSFER_OPS = frozenset(("MemcpyFromHost", "MemcpyToHost"))


def read_profile(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load and check a per-node times file written by :func:`ho_onnx.profile.profile_model`."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ProfileError(f"profile file {str(p)!r} does not exist "
                           "(make one with `ho-onnx profile MODEL`)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"profile file {str(p)!r} is not readable JSON: {e}") from None
    if isinstance(data, list) or (isinstance(data, dict) and "traceEvents" in data):
        raise ProfileError(f"profile file {str(p)!r} looks like ORT's raw trace; convert it "
                           "with `ho-onnx profile` (per-node medians) first")
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), dict):
        raise ProfileError(f"profile file {str(p)!r} is not a ho-onnx profile: "
                           "expected a JSON object with a 'nodes' object")
    for name, e in data["nodes"].items():
        if not isinstance(e, dict) or not isinstance(e.get("median_s"), int | float) \
                or e["median_s"] < 0:
            raise ProfileError(f"profile file {str(p)!r}: node {name!r} has no valid "
                               "'median_s' (seconds)")
    return data


def profile_costs(analysis: GraphAnalysis, profile_json_path: str | os.PathLike[str],
                  machine: Machine | None = None,
                  dims: Mapping[str, int] | None = None) -> NodeCosts:
    """Per-node seconds from a profile file, mapped onto ``analysis``'s positions.

    Mapping rule, in order, for each profiled entry:

    1. **index**: the entry's ORT ``node_index`` names an original node with the same op
       type whose name is the entry's name or empty (ORT invents ``<Op>_<i>`` names for
       unnamed nodes); used only when the profile recorded the same node count as the model;
    2. **name**: the entry's name equals an original node's name;
    3. **fusion**: the entry's name starts with an original node's name followed by ``/``,
       ``_`` or ``:`` (ORT names most fused nodes after the node it fused into, e.g.
       ``fc2/MatMulScaleFusion/``); the longest such name wins and the time is *added*
       to that node.

    Nodes matched by 1–3 count towards ``coverage``, and so do Constant nodes (0 s: ORT
    makes them initializers, they never run). Entries left over (nodes ORT created
    with invented names, e.g. ``Gelu`` or ``LayerNormalization`` fusions) form a pool whose
    time is spread over the unmatched nodes in proportion to their analytic estimates, so
    the total equals the profile's. With no pool, unmatched nodes cost 0 when the profile
    ran with ORT optimizations (they were fused into a matched node or folded away) and
    their analytic estimate when it ran with ``opt_level="disable"``. ORT's own copy nodes
    (``MemcpyFromHost``/``MemcpyToHost``) are transfers, not compute, and are skipped.

    ``machine`` (for the analytic weights) defaults to ``h100`` for a CUDA profile and
    ``cpu`` otherwise; ``dims`` defaults to the dims the profile was taken with.
    """
    prof = read_profile(profile_json_path)
    entries: dict[str, dict[str, Any]] = prof["nodes"]
    graph = analysis.model.graph
    n = len(analysis.order)
    pos_of_index = {idx: pos for pos, idx in enumerate(analysis.order)}
    pos_of_name: dict[str, int] = {}
    for pos, idx in enumerate(analysis.order):
        name = graph.node[idx].name
        if name:
            pos_of_name.setdefault(name, pos)
    same_model = prof.get("model_nodes") == len(graph.node)

    secs = np.zeros(n, dtype=np.float64)
    matched = np.zeros(n, dtype=bool)
    pool = 0.0
    pool_entries = 0
    names_by_len = sorted(pos_of_name, key=len, reverse=True)
    for ename, e in entries.items():
        t = float(e["median_s"])
        op = e.get("op")
        if op in _TRANSFER_OPS:
            continue
        pos = None
        idx = e.get("index")
        if same_model and isinstance(idx, int) and idx in pos_of_index:
            node = graph.node[idx]
            if node.op_type == op and node.name in (ename, ""):
                pos = pos_of_index[idx]
        if pos is None:
            pos = pos_of_name.get(ename)
        if pos is None:
            for cand in names_by_len:
                if ename.startswith(cand) and ename[len(cand):len(cand) + 1] in \
                        _FUSION_SEPARATORS:
                    pos = pos_of_name[cand]
                    break
        if pos is None:
            pool += t
            pool_entries += 1
            continue
        secs[pos] += t
        matched[pos] = True
    for pos in range(n):  # Constant nodes never run (ORT makes them initializers): 0 s
        if not matched[pos] and _is_constant(analysis, pos):
            matched[pos] = True

    notes: list[str] = []
    unmatched = np.flatnonzero(~matched)
    if len(unmatched):
        optimized = prof.get("opt_level", "all") != "disable"
        if pool > 0 or not optimized:
            if machine is None:
                prov = str(prof.get("provider", ""))
                machine = MACHINES["h100" if prov.startswith("CUDA") else "cpu"]
            use_dims = dict(prof.get("dims") or {}) if dims is None else dims
            est = np.array([node_time(machine, *node_flops_bytes(analysis, int(p), use_dims))
                            for p in unmatched])
            if pool > 0:
                w = est / est.sum() if est.sum() > 0 else np.full(len(est), 1.0 / len(est))
                secs[unmatched] = pool * w
                notes.append(f"{pool_entries} profiled entries ({pool:.3g} s) matched no node: "
                             f"spread over {len(unmatched)} unmatched nodes")
            else:
                secs[unmatched] = est
                notes.append(f"{len(unmatched)} nodes not in the profile: analytic estimate")
        else:
            notes.append(f"{len(unmatched)} nodes not in the optimized profile: 0 s "
                         "(fused or folded by ORT)")
    elif pool > 0:
        notes.append(f"{pool_entries} profiled entries ({pool:.3g} s) matched no node: dropped")
    coverage = float(matched.mean()) if n else 1.0
    return NodeCosts(secs, "profile", coverage, notes)
