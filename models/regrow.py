"""Carry a large random-weight export as its graph alone; regrow its weights where it runs.

A GPU machine here has no package index (no Optimum) and takes at most 64 MiB per call, so a
multi-GiB MoE export cannot be built there nor carried. :func:`strip` keeps the graph and
every small tensor (norm gains, rotary tables, routers: below ``keep_bytes``, inlined into
the graph verbatim) and drops the data file; :func:`regrow` writes the data file again at the
same locations, offsets and lengths, each large tensor drawn from ``normal(0, 0.02)`` (the
init transformers uses for these models) by a generator seeded with ``seed`` and the
tensor's name. The same stripped graph and seed give the same bytes on every machine, so
the model benchmarked on the GPU is the one tested here.

    python -m models.regrow strip /tmp/moe/onnx/model.onnx out/      # graph + small tensors
    python -m models.regrow regrow out/model.onnx                    # data file rewritten
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import zlib
from pathlib import Path

import numpy as np

from ho_onnx.errors import ExternalDataError
from ho_onnx.graph.load import resolve_data_path

__all__ = ["KEEP_BYTES", "RegrowError", "regrow", "strip"]

KEEP_BYTES = 1 << 20  # tensors below this travel inside the graph, verbatim
_CHUNK = 1 << 24  # elements drawn at a time (bounded memory for multi-GiB tensors)


def _external(t) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


class RegrowError(ExternalDataError, ValueError):
    """A model's external-data entry that cannot be regrown (or stripped)."""


def _safe_location(folder: Path, location: str, tensor: str) -> Path:
    """The project's own check (``resolve_data_path``): a relative path inside ``folder``."""
    return resolve_data_path(folder, location, f"tensor {tensor!r}", error=RegrowError)


def strip(model: str | Path, out_dir: str | Path, keep_bytes: int = KEEP_BYTES) -> Path:
    """``out_dir/<name>``: ``model``'s graph with every external tensor below ``keep_bytes``
    inlined and the rest naming their (now absent) data file; large inline tensors become
    external in ``<name>_data`` (4 KiB-aligned); the folder's small non-data files
    (``config.json``...) copied beside it. Returns the new model's path."""
    import onnx

    model, out_dir = Path(model), Path(out_dir)
    m = onnx.load(str(model), load_external_data=False)
    data: set[str] = set()
    grown = model.name + "_data"  # the large inline tensors (Optimum's name for it)
    end = 0
    for t in m.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            if len(t.raw_data) < keep_bytes:
                continue  # (small, or typed fields: stays in the graph)
            length = len(t.raw_data)
            t.ClearField("raw_data")
            t.data_location = onnx.TensorProto.EXTERNAL
            for k, v in (("location", grown), ("offset", str(end)), ("length", str(length))):
                t.external_data.add(key=k, value=v)
            end = (end + length + 4095) // 4096 * 4096
            continue
        ext = _external(t)
        data.add(ext["location"])
        length = int(ext.get("length", 0))
        if length >= keep_bytes:
            continue
        with open(_safe_location(model.parent, ext["location"], t.name), "rb") as f:
            f.seek(int(ext.get("offset", 0)))
            t.raw_data = f.read(length)
        del t.external_data[:]
        t.data_location = onnx.TensorProto.DEFAULT
    if end and grown in data:
        raise RegrowError(f"{model}: {grown} is already a data file of the model")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / model.name
    onnx.save(m, str(out))
    for f in model.parent.iterdir():
        if f.is_file() and f != model and f.name not in data and f.suffix in (".json", ".txt"):
            shutil.copy2(f, out_dir / f.name)
    return out


def _dtype(t) -> np.dtype:
    from onnx.helper import tensor_dtype_to_np_dtype

    return np.dtype(tensor_dtype_to_np_dtype(t.data_type))


def regrow(model: str | Path, seed: int = 0, std: float = 0.02) -> list[Path]:
    """Write every data file ``model``'s external tensors name, each tensor's range drawn
    from ``normal(0, std)`` seeded by ``seed`` and its name (integer tensors: zeros). Returns
    the files written; an inconsistent entry (a length that is not the tensor's size,
    ranges that overlap, a location outside the folder) raises :class:`RegrowError` (a
    ``ValueError``) before anything is written."""
    import onnx

    model = Path(model)
    m = onnx.load(str(model), load_external_data=False)
    ranges: dict[Path, list[tuple[int, int, object]]] = {}
    for t in m.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        ext = _external(t)
        dt = _dtype(t)
        n = int(np.prod(t.dims, dtype=np.int64))
        length = int(ext.get("length", n * dt.itemsize))
        if length != n * dt.itemsize:
            raise RegrowError(f"{t.name}: length {length} is not {n} x {dt.itemsize} bytes")
        ranges.setdefault(_safe_location(model.parent, ext["location"], t.name), []).append(
            (int(ext.get("offset", 0)), length, t))
    for path, rs in ranges.items():  # (every check before anything is written)
        rs.sort(key=lambda r: r[0])
        for (o1, l1, a), (o2, _, b) in itertools.pairwise(rs):
            if o1 + l1 > o2:
                raise RegrowError(f"{a.name} and {b.name} overlap in {path.name}")
    for path, rs in ranges.items():
        tmp = path.with_name(path.name + ".regrow")
        path.parent.mkdir(parents=True, exist_ok=True)  # (inside the folder: checked)
        with open(tmp, "wb") as f:
            for offset, length, t in rs:
                dt = _dtype(t)
                n = length // dt.itemsize
                rng = np.random.default_rng([seed, zlib.crc32(t.name.encode())])
                f.seek(offset)
                for lo in range(0, n, _CHUNK):
                    k = min(_CHUNK, n - lo)
                    if dt.kind == "f":
                        x = (rng.standard_normal(k, dtype=np.float32) * std).astype(dt)
                    else:
                        x = np.zeros(k, dt)
                    f.write(x.tobytes())
            f.truncate(max(o + ln for o, ln, _ in rs))
        tmp.replace(path)
    return list(ranges)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m models.regrow", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("strip", help="graph + small tensors, no data file")
    s.add_argument("model")
    s.add_argument("out_dir")
    s.add_argument("--keep-bytes", type=int, default=KEEP_BYTES)
    r = sub.add_parser("regrow", help="write the data files again from a seed")
    r.add_argument("model")
    r.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.cmd == "strip":
        print(strip(a.model, a.out_dir, a.keep_bytes))
    else:
        for p in regrow(a.model, a.seed):
            print(p, p.stat().st_size)


if __name__ == "__main__":
    main()
