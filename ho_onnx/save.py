"""Write a rewritten model atomically, its weights' data kept where the runtime finds it.

* Weights that were in external data stay there: beside the input nothing moves; written
  elsewhere, each data file is cloned into the output folder (copy-on-write, instant) where
  the filesystem can, else copied with progress, holes kept. Not linked: onnx.checker
  refuses hard- and symlinked data files. An existing different file is never overwritten.
* Offloaded weights that were inline go to a sidecar ``<output name>.data`` beside it.
* Everything is written to temporary files in the output folder and renamed into place
  last, so a failure leaves no partial output; the input is never opened for writing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from . import ops
from .errors import OutputPathError
from .insertion import RewrittenModel
from .loader import LoadedModel, expected_nbytes, external_ref, iter_graphs, resolve_data_path

Progress = Callable[[str, int, int], None]  # (what, done bytes, total bytes)

_CHUNK = 8 << 20
_ALIGN_BIG = 4096  # offsets of big sidecar tensors are page aligned (O_DIRECT reads later)
_ALIGN_SMALL = 64


@dataclass
class SaveReport:
    """What :func:`save_model` wrote and copied."""

    model_path: Path
    sidecar: Path | None = None
    copied: list[Path] = field(default_factory=list)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _inline_bytes(t: TensorProto) -> bytes:
    """The little-endian bytes ORT expects for an inline initializer."""
    if t.HasField("raw_data"):
        return t.raw_data
    arr = numpy_helper.to_array(t)
    packed = numpy_helper.from_array(np.asarray(arr), t.name)
    if packed.HasField("raw_data") and packed.data_type == t.data_type:
        return packed.raw_data
    raise OutputPathError(f"cannot serialise inline initializer {t.name!r} to raw bytes")


_FICLONE = 0x40049409  # linux/fs.h: share the extents (copy-on-write clone)


def _data_segments(fd: int, size: int) -> list[tuple[int, int]]:
    """(start, end) of the allocated regions of a file; the whole file if unsupported."""
    segs: list[tuple[int, int]] = []
    pos = 0
    try:
        while pos < size:
            start = os.lseek(fd, pos, os.SEEK_DATA)
            end = os.lseek(fd, start, os.SEEK_HOLE)
            segs.append((start, end))
            pos = end
    except OSError as e:
        if e.errno == errno.ENXIO:  # no data after pos
            return segs
        return [(0, size)]
    return segs


def copy_sparse(src: Path, dst: Path, progress: Progress | None = None) -> None:
    """Copy ``src`` to ``dst``: a copy-on-write clone where the filesystem can, else the data
    regions only (holes stay holes), reporting bytes done/total to ``progress``."""
    total = src.stat().st_size
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        try:
            fcntl.ioctl(fo.fileno(), _FICLONE, fi.fileno())
            if progress:
                progress(f"cloning {src.name}", total, total)
            return
        except OSError:
            pass
        segs = _data_segments(fi.fileno(), total)
        todo = sum(e - s for s, e in segs) or 1
        done = 0
        for start, end in segs:
            pos = start
            while pos < end:
                n = min(_CHUNK, end - pos)
                chunk = os.pread(fi.fileno(), n, pos)
                if not chunk:
                    raise OutputPathError(f"{str(src)!r} shrank while being copied")
                os.pwrite(fo.fileno(), chunk, pos)
                pos += len(chunk)
                done += len(chunk)
                if progress:
                    progress(f"copying {src.name}", done, todo)
        fo.truncate(total)
        if progress and done == 0:
            progress(f"copying {src.name}", todo, todo)
    shutil.copystat(src, dst)


def _place_data_file(src: Path, dst: Path, report: SaveReport, progress: Progress | None,
                     temps: list[Path]) -> None:
    if _same_file(src, dst):
        return
    if dst.exists():
        s, d = src.stat(), dst.stat()
        if s.st_size == d.st_size and s.st_mtime_ns == d.st_mtime_ns:
            return  # an earlier copy of the same file
        raise OutputPathError(
            f"{str(dst)!r} already exists and is not the model's data file {str(src)!r}; "
            "choose another output folder or remove it"
        )
    dst.parent.mkdir(parents=True, exist_ok=True)
    # Not a hard or symbolic link: onnx.checker refuses both as a possible attack.
    tmp = dst.with_name(f".{dst.name}.ho-tmp-{os.getpid()}")
    temps.append(tmp)
    copy_sparse(src, tmp, progress)
    os.replace(tmp, dst)
    temps.remove(tmp)
    report.copied.append(dst)


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _set_attr(node: onnx.NodeProto, name: str, value: object) -> None:
    for a in node.attribute:
        if a.name == name:
            node.attribute.remove(a)
            break
    node.attribute.append(helper.make_attribute(name, value))


def check_output_path(loaded: LoadedModel, out_path: str | os.PathLike[str]) -> Path:
    """Refuse an output that is the input (or one of its data files)."""
    out = Path(out_path)
    out_abs = out.resolve()
    if out_abs == loaded.path.resolve() or _same_file(out, loaded.path):
        raise OutputPathError(f"output {str(out)!r} is the input model: choose another path")
    if out.exists() and out.is_dir():
        raise OutputPathError(f"output {str(out)!r} is a directory")
    checked: set[str] = set()
    for graph in iter_graphs(loaded.model.graph):
        for t in graph.initializer:
            ref = external_ref(t)
            if ref is None or ref.location in checked:
                continue
            checked.add(ref.location)
            data = resolve_data_path(loaded.base_dir, ref.location, f"initializer {t.name!r}")
            if out_abs == data or _same_file(out, data):
                raise OutputPathError(
                    f"output {str(out)!r} is the external data file of the input model"
                )
    return out


def save_model(rewritten: RewrittenModel, loaded: LoadedModel,
               out_path: str | os.PathLike[str], *, progress: Progress | None = None,
               metadata: dict[str, str] | None = None) -> SaveReport:
    """Write ``rewritten`` to ``out_path`` (see module docstring)."""
    out = check_output_path(loaded, out_path)
    out_dir = out.resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    in_dir = loaded.base_dir
    model = rewritten.model
    report = SaveReport(model_path=out)
    temps: list[Path] = []
    sidecar = out_dir / f"{out.name}.data"
    try:
        # 1. data files the output keeps referencing
        referenced: dict[str, Path] = {}
        for graph in iter_graphs(model.graph):
            for t in graph.initializer:
                ref = external_ref(t)
                if ref is not None:
                    referenced[ref.location] = resolve_data_path(in_dir, ref.location, t.name)
        for t in rewritten.weights.values():
            ref = external_ref(t)
            if ref is not None:
                referenced[ref.location] = resolve_data_path(in_dir, ref.location, t.name)
        if any(p == sidecar for p in referenced.values()) or any(
            (out_dir / loc).resolve() == sidecar for loc in referenced
        ):
            raise OutputPathError(
                f"the sidecar {str(sidecar)!r} would overwrite external data of the model; "
                "choose another output name"
            )
        if out_dir != in_dir:
            for loc, src in referenced.items():
                _place_data_file(src, out_dir / loc, report, progress, temps)

        # 2. offloaded weights: where the runtime reads them
        inline = [t for t in rewritten.weights.values()
                  if external_ref(t) is None and rewritten.weight_prefetches.get(t.name)]
        sidecar_tmp = None
        if inline:
            fd, name = tempfile.mkstemp(prefix=f".{sidecar.name}.", dir=out_dir)
            sidecar_tmp = Path(name)
            temps.append(sidecar_tmp)
        offsets: dict[str, tuple[str, int, int]] = {}
        if sidecar_tmp is not None:
            with os.fdopen(fd, "wb") as f:
                pos = 0
                for t in inline:
                    data = _inline_bytes(t)
                    align = _ALIGN_BIG if len(data) >= (64 << 10) else _ALIGN_SMALL
                    pad = (-pos) % align
                    f.write(b"\0" * pad)
                    pos += pad
                    offsets[t.name] = (sidecar.name, pos, len(data))
                    f.write(data)
                    pos += len(data)
                f.flush()
                os.fsync(f.fileno())
        for name, t in rewritten.weights.items():
            ref = external_ref(t)
            if ref is not None:
                length = ref.length if ref.length is not None else expected_nbytes(t)
                offsets[name] = (ref.location, ref.offset, int(length or 0))
        by_name = {n.name: n for n in model.graph.node}
        for name, node_names in rewritten.weight_prefetches.items():
            loc, off, length = offsets[name]
            for node in (by_name[n] for n in node_names):
                _set_attr(node, ops.ATTR_LOCATION, loc)
                _set_attr(node, ops.ATTR_OFFSET, off)
                _set_attr(node, ops.ATTR_LENGTH, length)
                _set_attr(node, ops.ATTR_BASE_DIR, str(out_dir))

        # 3. metadata, check, write
        for k, v in (metadata or {}).items():
            key = ops.META_PREFIX + k
            for p in list(model.metadata_props):
                if p.key == key:
                    model.metadata_props.remove(p)
            model.metadata_props.append(onnx.StringStringEntryProto(key=key, value=str(v)))
        try:
            blob = model.SerializeToString()
        except ValueError as e:  # > 2 GiB protobuf
            raise OutputPathError(f"the rewritten model cannot be serialised: {e}") from e
        fd2, name2 = tempfile.mkstemp(prefix=f".{out.name}.", dir=out_dir)
        model_tmp = Path(name2)
        temps.append(model_tmp)
        with os.fdopen(fd2, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        try:  # by path, so external data is checked where the output will find it
            onnx.checker.check_model(str(model_tmp))
        except onnx.checker.ValidationError as e:
            raise OutputPathError(f"the rewritten model does not pass onnx.checker: {e}") from e
        mode = _umask_mode()
        os.chmod(model_tmp, mode)
        if sidecar_tmp is not None:
            os.chmod(sidecar_tmp, mode)
            os.replace(sidecar_tmp, sidecar)
            temps.remove(sidecar_tmp)
            temps.append(sidecar)  # removed again if the model's rename fails
            report.sidecar = sidecar
        os.replace(model_tmp, out)
        if report.sidecar is not None:
            temps.remove(sidecar)
        temps.remove(model_tmp)
        return report
    finally:
        for t in temps:
            with contextlib.suppress(OSError):
                t.unlink()
