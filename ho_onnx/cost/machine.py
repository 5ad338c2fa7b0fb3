"""The machine a plan targets: its rates (presets or a JSON file) and transfer times.

Transfer time (:func:`transfer_time`) is ``latency + bytes / bandwidth`` for one direction
(``h2d``: slow tier to fast tier, ``d2h``: fast to slow, ``disk``: a read from disk).
Units everywhere: seconds, bytes, bytes/s, FLOP/s.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from .. import kinds
from ..errors import HoOnnxError
from ..graph.save import read_json
from .model import Direction

#: A machine file holds a few numbers; a device or a runaway file is refused unread.
MAX_MACHINE_FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class Machine:
    """Rates of one target. All fields are SI units (FLOP/s, bytes/s, seconds).

    ``peak_flops`` is for the dtype class the preset assumes: dense fp16/bf16 tensor-core
    math on GPUs (fp32 models run well below it: override, or lower ``efficiency``), fp32
    on the CPU. ``h2d_bw``/``d2h_bw`` are the two directions between the slow tier (host
    memory) and the fast tier: PCIe on a GPU, ``memcpy`` between ORT buffers and the
    library's host pool on the CPU EP. Every rate must lie in :data:`LIMITS` (any real
    machine does; a value outside is a file in other units, refused by name).
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
    # The host CPU's rates (ORT's CPU EP: a large MatMul's FLOP/s, a one-row MatMul's weight
    # read rate), what an MoE expert computed where its weights live runs at (HostMatMul,
    # ``--cpu-experts``); 0: the fast tier's compute is the host's (the CPU EP), use
    # ``peak_flops``/``mem_bw``.
    host_flops: float = 0.0
    host_mem_bw: float = 0.0
    # Bandwidth of the data-movement ops (Concat, Gather, ...: a KV cache's Concat(past,
    # new)), bytes/s; 0: mem_bw (calibrated on a 2-core VM: 58-62 GB/s over 1-8 MiB caches,
    # where one-row MatMuls read distinct weights at 27 GB/s).
    move_bw: float = 0.0
    # Bandwidth of a Transpose (a strided copy: the attention's K^T over a KV cache), bytes
    # read and written per second; 0: ``movement_bw``. On a CPU it runs well below a
    # Concat's contiguous copy (calibrated: 30 against 60 GB/s on a 2-core VM).
    transpose_bw: float = 0.0
    # Fixed seconds a MatMul costs beyond its roofline and ``launch_overhead_s`` (ORT's CPU
    # EP splits it over its thread pool: ~10 us a node on a 2-core VM, which a decode step's
    # 25 one-row MatMuls pay each); 0 on the presets.
    matmul_overhead_s: float = 0.0

    @property
    def movement_bw(self) -> float:
        """Bandwidth of the data-movement ops: ``move_bw``, else ``mem_bw``."""
        return self.move_bw or self.mem_bw

    @property
    def transposing_bw(self) -> float:
        """Bandwidth of a Transpose: ``transpose_bw``, else :attr:`movement_bw`."""
        return self.transpose_bw or self.movement_bw

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "name":
                continue
            v = getattr(self, f.name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"machine {self.name!r}: {f.name} must be a finite number, "
                                 f"got {v!r}")
            lo, hi, unit = LIMITS[f.name]
            if not lo <= v <= hi or (f.name in ("move_bw", "transpose_bw") and 0 < v < 1e3):
                raise ValueError(
                    f"machine {self.name!r}: {f.name} must be between {lo:g} and {hi:g}"
                    f"{' ' + unit if unit else ''}, got {v:g} (a value in other units?)")

    def with_overrides(self, **kw: Any) -> Machine:
        """A copy with some fields replaced (numbers may be given as strings)."""
        return replace(self, **_coerce(kw, self.name))

    def transfer_time(self, nbytes: float, direction: Direction | str) -> float:
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
            data = read_json(p, MAX_MACHINE_FILE_BYTES)
        except FileNotFoundError:
            raise MachineError(f"machine file {str(p)!r} does not exist") from None
        except (OSError, ValueError, RecursionError) as e:
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


# (low, high, unit) of each rate: any real machine with orders of magnitude to spare (the
# presets, calibrations of 0.1-100 GB/s). Outside them a file is in other units or broken,
# and the simulation's sums of times leave floating point (1e-300 B/s: inf and NaN times;
# an efficiency times peak that underflows to 0: a division by zero).
LIMITS: dict[str, tuple[float, float, str]] = {
    "peak_flops": (1e6, 1e19, "FLOP/s"),
    "mem_bw": (1e3, 1e15, "bytes/s"),
    "h2d_bw": (1e3, 1e15, "bytes/s"),
    "d2h_bw": (1e3, 1e15, "bytes/s"),
    "disk_bw": (1e3, 1e15, "bytes/s"),
    "transfer_latency_s": (0.0, 10.0, "s"),
    "launch_overhead_s": (0.0, 10.0, "s"),
    "efficiency": (1e-3, 1.0, ""),
    "move_bw": (0.0, 1e15, "bytes/s"),
    "transpose_bw": (0.0, 1e15, "bytes/s"),
    "matmul_overhead_s": (0.0, 1.0, "s"),
    "host_flops": (0.0, 1e19, "FLOP/s"),  # (0: the fast tier's compute is the host's)
    "host_mem_bw": (0.0, 1e15, "bytes/s"),
}


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
#    `ho-onnx calibrate` output or use a profile. The GPU presets' host CPU (host_flops,
#    host_mem_bw) is the cpu preset's; `ho-onnx calibrate --base h100` measures it.
MACHINES: dict[str, Machine] = {
    "h100": Machine(
        name="h100", peak_flops=989e12, mem_bw=3.35e12, h2d_bw=50e9, d2h_bw=50e9,
        disk_bw=3e9, transfer_latency_s=10e-6, launch_overhead_s=5e-6, efficiency=0.6,
        host_flops=100e9, host_mem_bw=10e9,
    ),
    "h200": Machine(
        name="h200", peak_flops=989e12, mem_bw=4.8e12, h2d_bw=50e9, d2h_bw=50e9,
        disk_bw=3e9, transfer_latency_s=10e-6, launch_overhead_s=5e-6, efficiency=0.6,
        host_flops=100e9, host_mem_bw=10e9,
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


def transfer_time(machine: Machine, nbytes: float, direction: Direction | str) -> float:
    """Seconds for one transfer: ``transfer_latency_s + nbytes / bandwidth``; 0 for 0 bytes.

    ``direction`` is a registered tier's copy direction (:func:`ho_onnx.kinds.links`:
    ``"h2d"``, slow to fast tier, ``"d2h"``, fast to slow, ``"disk"``), whose bandwidth is
    the machine field its link names.
    """
    bandwidth = kinds.bandwidths()
    if direction not in bandwidth:
        raise ValueError(f"direction must be one of {tuple(bandwidth)}, got {direction!r}")
    if nbytes <= 0:
        return 0.0
    bw: float = getattr(machine, bandwidth[direction])
    return machine.transfer_latency_s + float(nbytes) / bw
