"""Write a finished model atomically, with the data files it references.

Only writes: what goes where was decided before (:class:`OutputFiles`, made by
:func:`ho_onnx.rewrite.place.place_weight_data`).

* Data files the model references stay where they are when the output is beside the input;
  written elsewhere, each is cloned into the output folder (copy-on-write, instant) where the
  filesystem can, else copied with progress, holes kept. Not linked: onnx.checker refuses
  hard- and symlinked data files. An existing different file is never overwritten.
* The sidecar (offloaded weights that were inline) is written at the offsets laid out.
* Everything is written to temporary files in the output folder and renamed into place
  last, so a failure leaves no partial output; the input is never opened for writing.
* Saves into one folder at once share a data file they copy: threads of one process wait for
  the one copying it (:class:`_DataFiles`), other processes for the process (a ``flock`` on
  the source file, :class:`_SourceLock`); a failed save removes a copy only no other uses.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import secrets
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from .. import contract
from ..errors import ModelLoadError, OutputPathError
from ..units import format_bytes
from .analyse import all_graphs
from .dims import shape_text
from .fingerprint import data_fingerprint
from .gcpause import gc_paused
from .load import LoadedModel, external_ref, resolve_data_path
from .protos import iter_graphs

# (what, done bytes, total bytes); a total of 0: nothing to count (waiting for another
# process), said once
Progress = Callable[[str, int, int], None]
# Validates a finished model: (the written file or its proto, the folder of its data files).
Validation = Callable[[Path | onnx.ModelProto, Path], None]

_CHUNK = 8 << 20


@dataclass
class Sidecar:
    """A data file written beside the model: each tensor's bytes at its offset."""

    name: str  # file name in the output folder
    # (initializer name, its tensor, offset, length): the bytes read only when written
    tensors: list[tuple[str, ir.TensorProtocol, int, int]] = field(default_factory=list)


def onnx_validation(finished: Path | onnx.ModelProto, data_dir: Path) -> None:
    """``onnx.checker`` on the finished model (a :data:`Validation`): a written one by path,
    so that its external data is checked where the output will find it; one in memory (what
    :class:`~ho_onnx.rewrite.passes.OffloadPass` leaves) with its external tensors checked
    in ``data_dir`` here (the checker would look in the working directory)."""
    try:
        onnx.checker.check_model(str(finished) if isinstance(finished, Path) else
                                 _external_checked(finished, data_dir))
    except onnx.checker.ValidationError as e:
        raise OutputPathError(f"the rewritten model does not pass onnx.checker: {e}") from e


def _external_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of ``model`` in external data: initializers and node attributes, in
    every graph (:func:`~ho_onnx.graph.protos.iter_graphs`)."""
    for g in iter_graphs(model.graph):
        tensors = [*g.initializer, *(t for n in g.node for a in n.attribute
                                     for t in ([a.t] if a.HasField("t") else [])
                                     + list(a.tensors))]
        yield from (t for t in tensors if external_ref(t) is not None)


def _external_checked(model: onnx.ModelProto, data_dir: Path) -> onnx.ModelProto:
    """``model`` itself when no tensor is in external data; else a copy whose external
    tensors (each checked here as the checker checks a written model's: a regular file
    inside ``data_dir``, not a link, holding its range) carry a one-byte placeholder."""
    if next(_external_tensors(model), None) is None:
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for t in list(_external_tensors(copy)):
        ref = external_ref(t)
        what = f"tensor {t.name!r}"
        path = resolve_data_path(data_dir, ref.location, what, error=OutputPathError)
        if (data_dir / ref.location).is_symlink() or not path.is_file():
            raise OutputPathError(f"the rewritten model does not pass onnx.checker: data of "
                                  f"{what} should be in {ref.location!r}, which is not a "
                                  f"regular file of {str(data_dir)!r}")
        end = ref.offset + (ref.length or 0)
        if end > path.stat().st_size:
            raise OutputPathError(f"the rewritten model does not pass onnx.checker: {what} "
                                  f"reads bytes up to {end} of {ref.location!r}, which "
                                  f"holds {path.stat().st_size}")
        del t.external_data[:]
        t.data_location = onnx.TensorProto.DEFAULT
        t.raw_data = b"\0"  # (checked above; the checker looks for one value field)
    return copy


@dataclass
class OutputFiles:
    """What :func:`save_model` writes: the finished model, the data files it references
    (location relative to the output folder -> source file), the sidecar, and the nodes to
    stamp with each data file's final size and fingerprint (location -> the weight
    Prefetches that read it)."""

    model: ir.Model  # serialised only when written (:func:`to_written_proto`)
    data_files: dict[str, Path] = field(default_factory=dict)
    sidecar: Sidecar | None = None
    stamps: dict[str, list[ir.Node]] = field(default_factory=dict)
    # How the finished model is validated: (the written file or the proto, the folder its
    # data files are in); the rewrite's ValidatePass picks the target's check.
    validate: Validation = onnx_validation


def to_written_proto(model: ir.Model) -> onnx.ModelProto:
    """``model`` as the proto that is written (external tensors as references)."""
    # (a walk of the whole graph: the collector would traverse the live model again and
    # again; 1,266 nodes: 43 -> 39 ms a save, best of 12; median 51 -> 40)
    with gc_paused(), implied_types_hidden(model):
        return ir.to_proto(model)


@contextlib.contextmanager
def implied_types_hidden(model: ir.Model) -> Iterator[int]:
    """For the duration of the block, initializers whose type and shape say no more than
    their tensor (no symbolic dims, no doc string or metadata; not a graph input or output:
    those are written with their type) carry none, so that ``onnx_ir`` serialises no
    ``value_info`` for them (it writes one for every initializer: thousands of redundant
    entries in a big model, and ~7 µs each to write). Yields how many were hidden;
    everything is put back afterwards."""
    hidden: list[tuple[ir.Value, Any, Any]] = []
    for g in all_graphs(model.graph):
        ends = {*g.inputs, *g.outputs}  # (an output without a type fails the checker)
        for v in g.initializers.values():
            if v in ends or not _implied_by_tensor(v):
                continue
            hidden.append((v, v.type, v.shape))
            v.type, v.shape = None, None
    try:
        yield len(hidden)
    finally:
        for v, type_, shape in hidden:
            v.type, v.shape = type_, shape


def _implied_by_tensor(v: ir.Value) -> bool:
    """Whether initializer ``v``'s type and shape (and no doc string or metadata) are what
    its tensor says: same dtype, no denotation, the tensor's dims (the same object after
    ``onnx_ir``'s deserialisation, else equal, without dim denotations)."""
    t, type_, shape = v.const_value, v.type, v.shape
    if t is None or v.doc_string or v.metadata_props or type(type_) is not ir.TensorType \
            or type_.dtype != t.dtype or type_.denotation:
        return False
    return shape is t.shape or (shape == t.shape and not any(
        shape.get_denotation(i) for i in range(len(shape))))


def stamp_data_files(stamps: dict[str, list[ir.Node]], path_of: Callable[[str], Path]
                     ) -> None:
    """Record on each node of ``stamps`` its data file's size and fingerprint, read from
    ``path_of(location)`` (the finished file; at most 17 blocks of 4 KiB each)."""
    for loc, nodes in stamps.items():
        path = path_of(loc)
        size = ir.AttrInt64(contract.ATTR_DATA_SIZE, path.stat().st_size)
        fingerprint = ir.AttrString(contract.ATTR_DATA_FINGERPRINT, data_fingerprint(path))
        for node in nodes:
            node.attributes[size.name] = size
            node.attributes[fingerprint.name] = fingerprint


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


class NonStandardJSONError(ValueError):
    """A number standard JSON (RFC 8259) does not have: ``NaN``, ``Infinity``, or one
    beyond a double's range (Python reads ``1e400`` as infinity and writes ``Infinity``)."""


def _no_constant(name: str) -> Any:
    raise NonStandardJSONError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise NonStandardJSONError(f"the number {text[:40]} is beyond a double's range")
    return x


def read_json(path: Path, limit: int, *, follow: bool = True, standard: bool = False) -> Any:
    """The JSON value in the regular file ``path``, at most ``limit`` bytes (a link in its
    last part followed unless ``follow`` is false). A device, FIFO or folder, or a larger
    file, is an :class:`OSError` saying so (was: read whole, so ``/dev/zero`` ran out of
    memory and a FIFO waited for a writer); bad JSON is a ``ValueError`` (``UnicodeError``
    included) or a ``RecursionError`` (nested deeper than Python's parser goes); with
    ``standard``, a number standard JSON lacks is a :class:`NonStandardJSONError`."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # (before fdopen, which refuses a folder its way)
            raise OSError("not a regular file")
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        data = f.read(limit + 1)
    if max(st.st_size, len(data)) > limit:
        raise OSError(f"larger than {format_bytes(limit)}")
    if standard:
        return json.loads(data, parse_constant=_no_constant, parse_float=_finite)
    return json.loads(data)


def open_regular(path: Path, expect: tuple[int, int] | None = None) -> int:
    """A read-only descriptor of the regular file ``path``, opened without following a link
    in its last part and without blocking (a FIFO swapped in is refused, not waited on);
    with ``expect`` (``st_dev``, ``st_ino``), only the very file seen then. Otherwise a
    :class:`ModelLoadError`: an input that changed between its check and its copy."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:  # (O_NOFOLLOW's answer for a link)
            raise ModelLoadError(f"{str(path)!r} became a symbolic link while being copied; "
                                 "was the folder changed meanwhile?") from None
        raise
    st = os.fstat(fd)
    why = ("is not a regular file" if not stat.S_ISREG(st.st_mode)
           else "was replaced" if expect is not None and (st.st_dev, st.st_ino) != expect
           else "")
    if why:
        os.close(fd)
        raise ModelLoadError(f"{str(path)!r} {why} while being copied; was the folder "
                             "changed meanwhile?")
    return fd


def copy_sparse(src: Path, dst: Path, progress: Progress | None = None, *,
                expect: tuple[int, int] | None = None) -> None:
    """Copy ``src`` to ``dst``: a copy-on-write clone where the filesystem can, else the data
    regions only (holes stay holes), reporting bytes done/total to ``progress``. ``src``
    is opened by :func:`open_regular` (``expect``: the file it must be); ``dst`` gets its
    permission bits and times."""
    with os.fdopen(open_regular(src, expect), "rb") as fi, open(dst, "wb") as fo:
        st = os.fstat(fi.fileno())
        total = st.st_size
        try:
            fcntl.ioctl(fo.fileno(), _FICLONE, fi.fileno())
            if progress:
                progress(f"cloning {src.name}", total, total)
        except OSError:
            _copy_regions(fi.fileno(), fo, src, total, progress)
        os.fchmod(fo.fileno(), stat.S_IMODE(st.st_mode))
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def free_bytes(folder: Path) -> int | None:
    """Bytes an unprivileged write can still take in ``folder``'s filesystem (None when it
    does not say)."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def write_error(e: OSError, folder: Path) -> OutputPathError | None:
    """The error to raise for ``e`` when it says the output folder cannot take the output
    (a full filesystem or quota, with the space left; a file past the size limit of the
    process or of the filesystem; read-only; no permission to a file in it), naming the
    folder, not a temporary file in it; None for other errors (and for a file elsewhere
    that could not be read: an input data file's own error says more)."""
    full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    name = e.filename
    in_folder = not isinstance(name, str | bytes) or Path(os.fsdecode(name)).absolute().parent \
        == folder.absolute()
    if not (full or e.errno in (errno.EROFS, errno.EFBIG)
            or (e.errno in (errno.EACCES, errno.EPERM) and in_folder)):
        return None
    free = free_bytes(folder) if full else None
    return OutputPathError(
        f"cannot write the output in {str(folder)!r}: {e.strerror or e}"
        + (f" ({format_bytes(free)} free)" if free is not None else "")
        + (f" ({_file_size_limit()})" if e.errno == errno.EFBIG else "")
        + ("; free some space or choose another output folder" if full
           else "; choose another output folder"))


def _file_size_limit() -> str:
    """What limits a file's size when a write failed with EFBIG: this process's limit when it
    has one (found by hand: ``ulimit -f``), else the filesystem's (FAT32: 4 GiB)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        return f"this process may write files of at most {format_bytes(soft)}: ulimit -f"
    return "larger than the filesystem's largest file"


def _copy_regions(fd: int, fo: Any, src: Path, total: int, progress: Progress | None) -> None:
    segs = _data_segments(fd, total)
    todo = sum(e - s for s, e in segs) or 1
    folder = Path(fo.name).parent
    free = free_bytes(folder)
    if free is not None and free < todo:  # (found by hand: a full disk was a bare
        raise OutputPathError(  # "No space left on device" after copying what fit)
            f"cannot copy {src.name} ({format_bytes(todo)} of data) into {str(folder)!r}: "
            f"only {format_bytes(free)} free; free some space or choose another output "
            "folder")
    done = 0
    for start, end in segs:
        pos = start
        while pos < end:
            n = min(_CHUNK, end - pos)
            chunk = os.pread(fd, n, pos)
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


class _Placing:
    """A data file one save of this process is copying into an output folder (until that
    save ends): later saves wanting the same file wait for it and use it, and a failed
    placer leaves it for them."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.placed = False  # the copy is in place
        self.users = 0  # other saves using it (in flight or finished)


# Output data file -> its placing, while the save that copies it is in flight. Found with
# threads optimizing one model into one folder (a server): all but one failed with a bare
# FileNotFoundError (one temporary name per process), and a failed save would remove a
# data file another one's output had just been written beside.
_PLACING: dict[Path, _Placing] = {}
_PLACING_LOCK = threading.Lock()


class _SourceLock:
    """An exclusive ``flock`` on a source data file, held by this process while any of its
    saves places that file (one lock per process: its own saves share it and meet in
    :data:`_PLACING`). Another process's saves of the same file wait for it, so none sees
    a copy a failing save of this process is about to remove (found reading the thread fix:
    two ``ho-onnx optimize`` into one folder, the one that copied the data file interrupted,
    took it from under the other's finished output)."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()  # held while taking the flock
        self.fd: int | None = None  # -1: the filesystem has no flock (then unlocked)
        self.holders = 0


# (st_dev, st_ino) of a source file -> its lock (under _PLACING_LOCK). By file, not by path:
# two paths of one file (hard links) locked apart would wait for each other in one process.
_LOCKS: dict[tuple[int, int], _SourceLock] = {}


def _flock(src: Path, key: tuple[int, int], progress: Progress | None) -> int:
    """An open descriptor of ``src`` holding an exclusive flock (waits for other processes,
    saying so); -1 where the file cannot be locked (a filesystem without flock, or ``src``
    is no longer the file ``key``)."""
    try:
        fd = open_regular(src, key)  # (never waits on a FIFO swapped in)
    except (OSError, ModelLoadError):
        return -1  # (the copy will say why it cannot read it)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                progress(f"waiting for another process placing {src.name}", 0, 0)
            fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        return -1
    except BaseException:
        os.close(fd)
        raise
    return fd


class _DataFiles:
    """The data files one save places (or uses) in its output folder, as a context manager:
    when the block fails, those it copied that no other save uses are removed. Each source
    file is locked against other processes until the save ends (:class:`_SourceLock`)."""

    def __init__(self) -> None:
        self.mine: list[tuple[Path, _Placing]] = []
        self.used: list[_Placing] = []
        self.locked: list[tuple[int, int]] = []
        self.folders: list[Path] = []  # made for the copies (removed again, when empty)

    def __enter__(self) -> _DataFiles:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.end(ok=exc_type is None)

    def lock(self, srcs: Iterable[Path], progress: Progress | None) -> None:
        """Lock the source files against other processes' saves, in one global order (two
        processes locking the same two files can then never wait for each other)."""
        files: dict[tuple[int, int], Path] = {}
        for src in srcs:
            with contextlib.suppress(OSError):  # (the copy will say why it cannot read it)
                st = os.stat(src)
                files.setdefault((st.st_dev, st.st_ino), src)
        allow_open_files(len(files))
        for key in sorted(files):
            with _PLACING_LOCK:
                lock = _LOCKS.setdefault(key, _SourceLock())
                lock.holders += 1
            self.locked.append(key)
            with lock.mutex:
                if lock.fd is None:
                    lock.fd = _flock(files[key], key, progress)

    def place(self, src: Path, dst: Path, report: SaveReport, progress: Progress | None
              ) -> None:
        """Copy ``src`` to ``dst`` unless it is there already or another save of this
        process is copying it (then wait for it and use it). Call :meth:`lock` first."""
        while True:
            with _PLACING_LOCK:
                placing = _PLACING.get(dst)
                if placing is None:
                    _refuse_link(dst)
                    if _same_file(src, dst) or _earlier_copy(src, dst):
                        return
                    placing = _PLACING[dst] = _Placing()
                    break
            placing.done.wait()
            with _PLACING_LOCK:
                if _PLACING.get(dst) is placing and placing.placed:
                    placing.users += 1
                    self.used.append(placing)
                    return
            # (its save failed and took it away, or ended: look again)
        self.folders.extend(_missing_folders(dst.parent))
        try:
            _copy_into_place(src, dst, progress)
        except BaseException:
            with _PLACING_LOCK:
                del _PLACING[dst]
            placing.done.set()
            raise
        placing.placed = True
        self.mine.append((dst, placing))
        report.copied.append(dst)
        placing.done.set()

    def end(self, ok: bool) -> None:
        with _PLACING_LOCK:
            if not ok:
                for placing in self.used:
                    placing.users -= 1
            for dst, placing in self.mine:
                del _PLACING[dst]
                if not ok and placing.users == 0:
                    with contextlib.suppress(OSError):
                        dst.unlink()
            for folder in sorted(self.folders, key=lambda f: -len(f.parts)) if not ok else ():
                with contextlib.suppress(OSError):  # (one another save uses is not empty)
                    folder.rmdir()
            for key in self.locked:  # (after the removals: then other processes look)
                lock = _LOCKS[key]
                lock.holders -= 1
                if lock.holders == 0:
                    del _LOCKS[key]
                    if lock.fd is not None and lock.fd >= 0:
                        os.close(lock.fd)
            self.locked.clear()


def _refuse_link(dst: Path) -> None:
    """Refuse a symbolic link where a data file's copy goes (found by hand: a link there to
    the input's data file was taken as the copy, and the output failed when run: the library
    opens data files without following links, ORT refuses data outside the model's folder).
    A hard link to the input's data is a copy that shares its blocks: used as one (ONNX's
    checker refuses it, saying so, where the output keeps initializers in it)."""
    try:
        st = os.lstat(dst)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise OutputPathError(
            f"{str(dst)!r} already exists as a symbolic link (the ho-onnx library opens data "
            "files without following links); the output needs its own copy of the data "
            "there: remove it or choose another output folder")


# Files a save opens beside the locks it holds (the copy's source and destination, the
# model, the sidecar, the folder lock, a fingerprint), and what the process has open for
# other reasons is counted at the time.
_SAVE_FILES = 16


def allow_open_files(held: int) -> None:
    """Let this process hold ``held`` more files open (one lock per data file a save
    copies) and still work: the soft limit of open files (RLIMIT_NOFILE) is raised toward
    the hard one where it is lower, as Go's runtime does at start (found by hand: a model
    saved one file per weight, 1,500 files, failed with "Too many open files" under the
    common ``ulimit -n 1024``). A hard limit too low is an :class:`OutputPathError` saying
    what to do."""
    import resource

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        now = len(os.listdir("/proc/self/fd"))
    except (OSError, ValueError):
        return
    need = now + held + _SAVE_FILES
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise OutputPathError(
            f"the model's data is in {held} files, each held open while it is copied; this "
            f"process may open at most {hard} files (ulimit -Hn): raise that limit, or write "
            "the output into the input's folder (nothing is copied then)")
    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def _earlier_copy(src: Path, dst: Path) -> bool:
    """Whether ``dst`` is an earlier copy of ``src`` (same size and modification time, as
    copies keep them); False when there is none; an error when it is another file."""
    if not dst.exists():
        return False
    s, d = src.stat(), dst.stat()
    if s.st_size == d.st_size and s.st_mtime_ns == d.st_mtime_ns:
        return True
    raise OutputPathError(
        f"{str(dst)!r} already exists and is not the model's data file {str(src)!r}; "
        "choose another output folder or remove it"
    )


def _copy_into_place(src: Path, dst: Path, progress: Progress | None) -> None:
    """Copy ``src`` to ``dst`` through a temporary file of its own in ``dst``'s folder,
    removed if the copy fails or is interrupted (before the caller removes the folder).
    Not a hard or symbolic link: onnx.checker refuses both as a possible attack."""
    with temporary_files(dst.parent) as temps:
        fd, tmp = new_temp(dst.parent, f"{_temp_prefix(dst.name)}ho-tmp-", temps)
        os.close(fd)
        copy_sparse(src, tmp, progress)
        os.replace(tmp, dst)
        temps.clear()


_UMASK_LOCK = threading.Lock()


def _umask_mode() -> int:
    """0666 less the process's umask, read without changing it where Linux shows it (a
    umask(0)-and-back, as elsewhere, could leave another thread's files, or the process,
    with no umask at all)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    with _UMASK_LOCK:  # (at least this module's threads do not race)
        mask = os.umask(0)
        os.umask(mask)
    return 0o666 & ~mask


def refuse_special(path: str | os.PathLike[str], what: str = "output") -> None:
    """Refuse to write ``path`` when it exists and is neither a regular file nor a symbolic
    link: a device (``/dev/null``), a FIFO or a socket. Outputs are written by renaming a
    finished file over the name, which would replace such an entry (as root, /dev/null
    itself: found by hand, a FIFO given as the output was replaced by a file)."""
    try:
        mode = os.lstat(path).st_mode
    except (OSError, ValueError):  # missing (or unreadable: the write says why)
        return
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode) or stat.S_ISDIR(mode)):
        raise OutputPathError(
            f"{what} {os.fspath(path)!r} exists and is not a regular file (a device, FIFO or "
            "socket): outputs are written by replacing the file at that name; choose a file "
            "path")


def check_writable(path: str | os.PathLike[str], what: str = "output") -> None:
    """Refuse, before any work, an output ``path`` whose folder (or the nearest one that
    exists, where the missing ones will be made) is no folder or cannot be written (found by
    hand: a read-only folder failed after planning, naming a hidden temporary file)."""
    folder = Path(path).absolute().parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise OutputPathError(f"cannot write the {what} {os.fspath(path)!r}: {str(folder)!r} "
                              "is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputPathError(
            f"cannot write the {what} {os.fspath(path)!r}: {str(folder)!r} is not writable (a "
            "read-only filesystem, or no permission); choose another output folder")


def output_folder(out: str | os.PathLike[str]) -> Path:
    """The folder the output ``out`` is written in, with the data it needs: its parent's
    real path. A link at ``out`` itself is replaced by the output, never written through, so
    it does not move the output (found by hand: given a link to another folder, the model
    replaced the link and its data went beside the link's target, where it could not find
    them)."""
    return Path(out).absolute().parent.resolve()


def check_output_path(loaded: LoadedModel, out_path: str | os.PathLike[str]) -> Path:
    """Refuse an output that is the input (or one of its data files), one that a data file
    copied beside it would replace, or a device, FIFO or socket."""
    out = Path(out_path)
    refuse_special(out)
    out_abs = out.resolve()
    try:  # (onnx's checker and ORT take UTF-8 paths: was a TypeError after the work)
        str(out_abs).encode("utf-8")
    except UnicodeEncodeError:
        raise OutputPathError(f"output {os.fsencode(out)!r} is not a UTF-8 path, which onnx "
                              "and ONNX Runtime need: choose another name") from None
    if out_abs == loaded.path.resolve() or _same_file(out, loaded.path):
        raise OutputPathError(f"output {str(out)!r} is the input model: choose another path")
    if out.exists() and out.is_dir():
        raise OutputPathError(f"output {str(out)!r} is a directory")
    check_writable(out)
    folder = output_folder(out)
    for location, name in loaded.data_locations.items():
        data = resolve_data_path(loaded.base_dir, location, f"initializer {name!r}")
        if out_abs == data or _same_file(out, data):
            raise OutputPathError(
                f"output {str(out)!r} is the external data file of the input model")
        if (folder / location).resolve() == folder / out.name:  # (found by hand: a model
            # whose weights are read from the model file itself, written as out/m.onnx)
            raise OutputPathError(
                f"output {str(out)!r} has the name of the input model's data file "
                f"{location!r}, which is copied beside it: choose another name")
    return out


def save_model(files: OutputFiles, loaded: LoadedModel, out_path: str | os.PathLike[str], *,
               progress: Progress | None = None) -> SaveReport:
    """Write ``files`` for the output ``out_path`` of ``loaded`` (see module docstring).

    The written model is validated before it is renamed into place, by
    :attr:`OutputFiles.validate` (``onnx.checker``, or a runtime loading it for models with
    operators onnx cannot check), when its sidecar is already in place."""
    out = check_output_path(loaded, out_path)
    out_dir = output_folder(out)
    with new_folders(out_dir):
        return _save(files, loaded, out, out_dir, progress)


@contextlib.contextmanager
def new_folders(folder: Path) -> Iterator[Path]:
    """Make ``folder`` and its missing parents; those it made are removed again (when
    empty) if the block fails or is interrupted."""
    made = _missing_folders(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputPathError(f"cannot create the folder {str(folder)!r}: "
                              f"{e.strerror or e}") from None
    try:
        yield folder
    except BaseException:
        for d in made:  # deepest first
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


def _missing_folders(folder: Path) -> list[Path]:
    """``folder`` and its parents that do not exist yet, deepest first."""
    made: list[Path] = []
    p = folder.absolute()
    while not p.exists() and p != p.parent:
        made.append(p)
        p = p.parent
    return made


def _save(files: OutputFiles, loaded: LoadedModel, out: Path, out_dir: Path,
          progress: Progress | None) -> SaveReport:
    """The data files, the sidecar and the model, each renamed into place last."""
    report = SaveReport(model_path=out)
    with temporary_files(out_dir) as temps, _DataFiles() as data:
        if out_dir != loaded.base_dir:
            data.lock(files.data_files.values(), progress)
            for loc, src in files.data_files.items():
                data.place(src, out_dir / loc, report, progress)
        sidecar_tmp = None
        if files.sidecar is not None and files.sidecar.tensors:
            sidecar_tmp = _write_temp(out_dir, _temp_prefix(files.sidecar.name), temps,
                                      lambda f: _write_sidecar(f, files.sidecar))  # type: ignore[arg-type]
        sidecar_name = files.sidecar.name if files.sidecar is not None else None
        stamp_data_files(files.stamps,
                         lambda loc: sidecar_tmp if sidecar_tmp is not None and loc == sidecar_name
                         else out_dir / loc)
        blob = _serialise(to_written_proto(files.model))
        model_tmp = _write_temp(out_dir, _temp_prefix(out.name), temps,
                                lambda f: f.write(blob))
        mode = _umask_mode()
        os.chmod(model_tmp, mode)
        with _folder_locked(out_dir):  # (one whole model + sidecar pair at a time)
            if sidecar_tmp is not None:
                sidecar = out_dir / files.sidecar.name  # type: ignore[union-attr]
                refuse_special(sidecar, "the sidecar")
                os.chmod(sidecar_tmp, mode)
                os.replace(sidecar_tmp, sidecar)
                temps[temps.index(sidecar_tmp)] = sidecar  # removed if the model is not written
                report.sidecar = sidecar
            files.validate(model_tmp, out_dir)
            os.replace(model_tmp, out)
            temps.clear()  # everything is in place
    return report


@contextlib.contextmanager
def _folder_locked(folder: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``folder`` itself for the block, so that saves into one
    folder put their model and sidecar in place one whole pair at a time (found reading the
    save: two processes writing one output name could interleave their renames and leave
    one's model beside the other's sidecar, refused only later, by the data fingerprint).
    Nothing is locked where the filesystem has no flock; no lock file is made."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):  # (no flock here: unlocked, as before)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in its folder (made if missing)
    renamed into place: a failure or an interruption leaves no partial file or new folder."""
    out = Path(path)
    refuse_special(out)
    folder = out.absolute().parent
    with new_folders(folder), temporary_files(folder) as temps:
        tmp = _write_temp(folder, _temp_prefix(out.name), temps, lambda f: f.write(data))
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, out)
        temps.clear()
    return out


@contextlib.contextmanager
def temporary_files(folder: Path) -> Iterator[list[Path]]:
    """A list for the temporary files a block writes in ``folder``: those still in it when
    the block ends are removed (clear it once everything is in place), and an OSError of a
    full or read-only ``folder`` becomes an :class:`OutputPathError` naming the folder, not a
    temporary file (:func:`write_error`)."""
    temps: list[Path] = []
    try:
        yield temps
    except OSError as e:
        why = write_error(e, folder)
        if why is None:
            raise
        raise why from None
    finally:
        for t in temps:
            with contextlib.suppress(OSError):
                t.unlink()


def _serialise(model: onnx.ModelProto) -> bytes:
    try:
        return model.SerializeToString()
    except ValueError as e:  # > 2 GiB protobuf
        raise OutputPathError(f"the rewritten model cannot be serialised: {e}") from e


def _temp_prefix(name: str) -> str:
    """The start of a temporary file's name for the output ``name``: hidden, and short
    enough that the random end fits a file name (255 bytes) whatever ``name``'s length
    (found by hand: a legal 250-character output name was refused as too long)."""
    return f".{name[:32]}."  # (32 characters: at most 128 bytes of UTF-8)


def _write_temp(out_dir: Path, prefix: str, temps: list[Path],
                write: Callable[[Any], object]) -> Path:
    """A new temporary file in ``out_dir`` (recorded in ``temps``), written and synced."""
    fd, path = new_temp(out_dir, prefix, temps)
    with os.fdopen(fd, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    return path


def new_temp(folder: Path, prefix: str, temps: list[Path]) -> tuple[int, Path]:
    """A new file ``prefix`` + random in ``folder``, open for writing, whose path is in
    ``temps`` before the file exists: an interruption at any point leaves nothing the
    caller's clean-up misses (was: mkstemp, then the path recorded; a SIGTERM in between,
    sent as the file appeared, left it). ``folder`` is made again if missing: another save
    into it that made it and failed removes it when empty, and may do so just as this one
    writes (found with two threads: the second failed with a bare FileNotFoundError)."""
    for _ in range(100):
        path = folder / f"{prefix}{secrets.token_hex(4)}"
        temps.append(path)
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), path
        except FileNotFoundError:
            folder.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            pass
        temps.remove(path)
    raise OutputPathError(f"cannot make a temporary file in {str(folder)!r}")


def _write_sidecar(f: Any, sidecar: Sidecar) -> None:
    pos = 0
    for name, t, offset, length in sidecar.tensors:
        data = t.tobytes()  # (little-endian, as ORT reads it; typed fields read flat)
        if len(data) != length:  # (the input's fault: checked here, where the bytes are read)
            raise ModelLoadError(f"initializer {name!r}: holds {len(data)} bytes, its type "
                                 f"and shape {shape_text(list(t.shape.numpy()))} need {length} "
                                 "(a malformed model?)")
        if offset < pos:
            raise OutputPathError(f"inline initializer {name!r}: {length} bytes do not fit "
                                  f"the sidecar layout (at {offset}, after {pos})")
        f.write(b"\0" * (offset - pos))
        f.write(data)
        pos = offset + length
