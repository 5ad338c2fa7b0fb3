"""How fast this machine pins host memory for the GPU, by method and block size.

The CUDA engine pins the host tier's weights at session creation (``csrc/cuda/
pinned_weights.h``). On the H200 of stop 45 an offloaded 2 GiB MoE session took 24-33 s to
create; this probe says where such time goes, without ORT or the op library: only the CUDA
runtime (``libcudart`` through ctypes) and anonymous memory.

Each row pins ``--mib`` MiB in blocks of one size by one method, times it and frees it:

* ``register``: ``mmap`` + ``cudaHostRegister`` (what the engine does), fresh pages;
* ``register, faulted``: the same after touching every page (so the time is the pinning
  alone; the touch is reported as ``touch s``);
* ``register, huge``: 2 MiB-aligned mappings with ``madvise(MADV_HUGEPAGE)`` first;
* ``hostalloc``: ``cudaHostAlloc`` (the driver allocates and pins).

A row stops after ``--row-s`` seconds and reports the rate of what it pinned so far.
Prints a table; ``--json`` writes the rows with the machine's facts (THP, hypervisor, GPU).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import glob
import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20
HUGE = 2 * MIB
MADV_HUGEPAGE = 14
PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
MAP_PRIVATE_ANON = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_HOST_ALLOC_PORTABLE = 1


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime: the toolkit's, else one a Python package ships (torch's nvidia/*)."""
    names = [ctypes.util.find_library("cudart")]
    names += sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so*"))
    for site in sys.path:
        names += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcudart.so*")))
    for name in names:
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("pin_probe: no libcudart found (CUDA toolkit or torch's nvidia packages)")


class Probe:
    def __init__(self) -> None:
        self.rt = _cudart()
        self.libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_long]
        self.libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        self.libc.memset.restype = ctypes.c_void_p
        self.rt.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self.rt.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        self.rt.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                          ctypes.c_uint]
        self.rt.cudaFreeHost.argtypes = [ctypes.c_void_p]
        self.rt.cudaFree.argtypes = [ctypes.c_void_p]

    def check(self, err: int, what: str) -> None:
        if err != 0:
            self.rt.cudaGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what}: CUDA error {err} {self.rt.cudaGetErrorString(err)!r}")

    def map(self, size: int, huge: bool) -> tuple[int, int, int]:
        """(address, mapped base, mapped length); 2 MiB-aligned with MADV_HUGEPAGE if `huge`."""
        length = size + (HUGE if huge else 0)
        base = self.libc.mmap(None, length, PROT_RW, MAP_PRIVATE_ANON, -1, 0)
        if base in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        addr = base
        if huge:
            addr = (base + HUGE - 1) // HUGE * HUGE
            self.libc.madvise(addr, size, MADV_HUGEPAGE)
        return addr, base, length

    def row(self, method: str, block: int, total: int, limit_s: float) -> dict[str, Any]:
        huge = "huge" in method
        held: list[tuple[str, int, int, int]] = []
        pinned = 0
        touch_s = 0.0
        t_pin = 0.0
        t_all0 = time.perf_counter()
        try:
            while pinned < total and time.perf_counter() - t_all0 < limit_s:
                if method.startswith("hostalloc"):
                    p = ctypes.c_void_p()
                    t0 = time.perf_counter()
                    self.check(self.rt.cudaHostAlloc(ctypes.byref(p), block,
                                                     CUDA_HOST_ALLOC_PORTABLE), "cudaHostAlloc")
                    t_pin += time.perf_counter() - t0
                    held.append(("host", p.value or 0, 0, 0))
                else:
                    addr, base, length = self.map(block, huge)
                    held.append(("map", addr, base, length))
                    if "faulted" in method:
                        t0 = time.perf_counter()
                        self.libc.memset(addr, 1, block)
                        touch_s += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    self.check(self.rt.cudaHostRegister(addr, block, CUDA_HOST_REGISTER_PORTABLE),
                               "cudaHostRegister")
                    t_pin += time.perf_counter() - t0
                    held[-1] = ("reg", addr, base, length)
                pinned += block
        finally:
            for kind, addr, base, length in held:
                if kind == "host":
                    self.rt.cudaFreeHost(addr)
                else:
                    if kind == "reg":
                        self.rt.cudaHostUnregister(addr)
                    self.libc.munmap(base, length)
        calls = len(held)
        return {"method": method, "block_mib": block / MIB, "calls": calls,
                "pinned_mib": pinned / MIB, "pin_s": t_pin, "touch_s": touch_s,
                "pin_gb_s": pinned / t_pin / 1e9 if t_pin > 0 else None,
                "ms_per_call": 1e3 * t_pin / calls if calls else None,
                "complete": pinned >= total}


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "?"


def machine_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {
        "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_defrag": _read("/sys/kernel/mm/transparent_hugepage/defrag"),
        "hugepages_2m": _read("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"),
        "hypervisor": "hypervisor" in _read("/proc/cpuinfo"),
        "iommu_groups": len(glob.glob("/sys/kernel/iommu_groups/*")),
        "cpus": os.cpu_count(),
    }
    try:
        facts["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pcie.link.gen.current,"
             "pcie.link.width.current", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        facts["gpu"] = f"nvidia-smi: {e}"
    return facts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512, help="MiB pinned per row (default 512)")
    ap.add_argument("--row-s", type=float, default=20.0,
                    help="stop a row after this many seconds (default 20)")
    ap.add_argument("--json", type=Path, help="write the rows and the machine's facts here")
    args = ap.parse_args(argv)
    facts = machine_facts()
    print("machine:", json.dumps(facts), flush=True)
    p = Probe()
    t0 = time.perf_counter()
    try:
        p.check(p.rt.cudaFree(None), "cudaFree(0) (context creation)")
    except RuntimeError as e:
        print(f"pin_probe: no usable GPU: {e}", file=sys.stderr)
        return 2
    facts["context_s"] = time.perf_counter() - t0
    total = args.mib * MIB
    plan = [("register", 3 * MIB), ("register, huge", 3 * MIB), ("register", 64 * MIB),
            ("register, faulted", 64 * MIB), ("register, huge", 64 * MIB),
            ("register, huge", total), ("hostalloc", 3 * MIB), ("hostalloc", 64 * MIB)]
    rows = []
    print(f"{'method':<20} {'block MiB':>9} {'calls':>6} {'MiB':>6} {'pin s':>7} {'touch s':>7} "
          f"{'GB/s':>7} {'ms/call':>8}")
    for method, block in plan:
        try:
            r = p.row(method, block, total, args.row_s)
        except (RuntimeError, OSError) as e:
            r = {"method": method, "block_mib": block / MIB, "error": str(e)}
            print(f"{method:<20} {block / MIB:>9.0f} error: {e}", flush=True)
            rows.append(r)
            continue
        rows.append(r)
        gbs = f"{r['pin_gb_s']:.2f}" if r["pin_gb_s"] else "-"
        ms = f"{r['ms_per_call']:.2f}" if r["ms_per_call"] else "-"
        print(f"{method:<20} {r['block_mib']:>9.0f} {r['calls']:>6} {r['pinned_mib']:>6.0f} "
              f"{r['pin_s']:>7.2f} {r['touch_s']:>7.2f} {gbs:>7} {ms:>8}"
              + ("" if r["complete"] else "  (stopped at --row-s)"), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": facts, "mib": args.mib, "rows": rows},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
