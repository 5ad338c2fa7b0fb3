"""A Triton Inference Server model repository entry for an optimized model (``ho-onnx triton``).

Triton's onnxruntime backend creates each instance's session from
``<repo>/<name>/<version>/model.onnx`` and registers the libraries that ``config.pbtxt``
names in ``model_operations { op_library_filename: ... }``; of the config's ``parameters``
it forwards only those it knows (``session.use_device_allocator_for_initializers`` is its
only session config entry), never ``ho_onnx.*`` (docs/serving.md quotes the source). So the
entry carries a copy of the op library in the version folder, with ``ho_onnx.config``
beside it: a library loaded from a folder with that file takes the folder as its model
folder (and the file's entries, such as the host pool's bound) without any session config
entry. Written::

    <repo>/<name>/config.pbtxt
    <repo>/<name>/<version>/model.onnx, its data files, libho_onnx_ops.so, ho_onnx.config

The entry is written beside the target under a temporary name and renamed into place last
(a failure leaves no partial entry).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from ... import contract
from ...contract import CONFIG_HOST_BYTES, CONFIG_HOST_POOL_LIMIT
from ...errors import HoOnnxError, ModelLoadError, OutputPathError
from ...graph.load import external_ref, read_proto, resolve_data_path
from ...graph.protos import iter_nodes
from ...graph.save import copy_sparse
from .folders import _stored_bytes

FOLDER_CONFIG = "ho_onnx.config"  # csrc/registration.cc: kFolderConfigName
MODEL_FILE = "model.onnx"  # the backend's default_model_filename

# Triton release -> the onnxruntime inside its container: "ort_version" of TRITON_VERSION_MAP
# (DEFAULT_TRITON_VERSION_MAP from 24.12 on) in build.py of the rYY.MM branch of
# github.com/triton-inference-server/server (read for 23.12 through 26.08).
TRITON_ORT_VERSIONS: dict[str, str] = {
    "23.12": "1.16.3", "24.01": "1.16.3", "24.02": "1.16.3", "24.03": "1.17.2",
    "24.04": "1.17.3", "24.05": "1.18.0", "24.06": "1.18.0", "24.07": "1.18.1",
    "24.08": "1.19.0", "24.09": "1.19.2", "24.10": "1.19.2", "24.11": "1.19.2",
    "24.12": "1.20.1", "25.01": "1.20.1", "25.02": "1.20.1", "25.03": "1.21.0",
    "25.04": "1.21.0", "25.05": "1.22.0", "25.06": "1.22.0", "25.07": "1.22.0",
    "25.08": "1.23.0", "25.09": "1.23.0", "25.10": "1.23.1", "25.11": "1.23.2",
    "25.12": "1.23.2", "26.01": "1.23.2", "26.02": "1.24.1", "26.03": "1.24.2",
    "26.04": "1.24.4", "26.05": "1.24.4", "26.06": "1.24.4", "26.07": "1.27.0",
    "26.08": "1.28.0",
}

# ONNX element type -> Triton DataType (model_config.proto); others have none.
_TRITON_TYPES = {
    onnx.TensorProto.BOOL: "TYPE_BOOL", onnx.TensorProto.UINT8: "TYPE_UINT8",
    onnx.TensorProto.UINT16: "TYPE_UINT16", onnx.TensorProto.UINT32: "TYPE_UINT32",
    onnx.TensorProto.UINT64: "TYPE_UINT64", onnx.TensorProto.INT8: "TYPE_INT8",
    onnx.TensorProto.INT16: "TYPE_INT16", onnx.TensorProto.INT32: "TYPE_INT32",
    onnx.TensorProto.INT64: "TYPE_INT64", onnx.TensorProto.FLOAT16: "TYPE_FP16",
    onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.DOUBLE: "TYPE_FP64",
    onnx.TensorProto.STRING: "TYPE_STRING", onnx.TensorProto.BFLOAT16: "TYPE_BF16",
}
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")


class TritonEntryError(HoOnnxError):
    """A Triton repository entry cannot be written as asked (name, version, runtime)."""


@dataclass
class TritonEntry:
    """What :func:`write_triton_entry` wrote."""

    folder: Path  # <repo>/<name>
    config: Path  # <repo>/<name>/config.pbtxt
    model: Path  # <repo>/<name>/<version>/model.onnx
    ort_version: str  # the container's onnxruntime the entry was checked against
    library: Path | None = None  # the op library copy (None: the model has no cache ops)
    files: list[str] = field(default_factory=list)  # the version folder's files


def _version_tuple(v: str, what: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)\.(\d+)(?:\.\d+)?", v.strip())
    if m is None:
        raise TritonEntryError(f"{what} {v!r} is not an onnxruntime version such as 1.24.4")
    return int(m.group(1)), int(m.group(2))


def container_ort_version(triton_release: str | None = None,
                          ort_version: str | None = None) -> str:
    """The onnxruntime version of the container: ``ort_version`` as given, else the one of
    ``triton_release`` (e.g. ``"26.08"``) in :data:`TRITON_ORT_VERSIONS`; both given must
    agree. Raises :class:`TritonEntryError` when neither is known."""
    from_release = None
    if triton_release is not None:
        from_release = TRITON_ORT_VERSIONS.get(triton_release.strip())
        if from_release is None:
            raise TritonEntryError(
                f"Triton release {triton_release!r} is not in the table "
                f"({min(TRITON_ORT_VERSIONS)} to {max(TRITON_ORT_VERSIONS)}): name the "
                "container's onnxruntime with --ort-version (its release notes list it)")
    if ort_version is not None:
        _version_tuple(ort_version, "--ort-version")
        if from_release is not None and _version_tuple(from_release, "") != _version_tuple(
                ort_version, "--ort-version"):
            raise TritonEntryError(f"Triton {triton_release} ships onnxruntime {from_release}, "
                                   f"not {ort_version}")
        return ort_version.strip()
    if from_release is None:
        raise TritonEntryError("name the Triton release (--triton-release, e.g. 26.08) or the "
                               "container's onnxruntime (--ort-version): the op library must "
                               "match it")
    return from_release


def check_ort_version(container: str) -> None:
    """Refuse a container onnxruntime older than the op library needs (its C API version)."""
    from .runtime import build_info

    need = str(build_info()["ort_min_version"])
    if _version_tuple(container, "onnxruntime") < _version_tuple(need, "the library's minimum"):
        raise TritonEntryError(
            f"the container's onnxruntime {container} is older than the ho-onnx op library "
            f"needs ({need}: its C API version {build_info()['ort_api_required']}); use a "
            "newer Triton release")


def _pb_string(s: str) -> str:
    """``s`` as a protobuf text-format string literal (bytes outside printable ASCII as
    octal escapes, as protobuf's CEscape writes them)."""
    out = []
    for b in s.encode("utf-8"):
        c = chr(b)
        out.append("\\" + c if c in '"\\' else c if 0x20 <= b < 0x7F else f"\\{b:03o}")
    return '"' + "".join(out) + '"'


def _tensor_spec(v: onnx.ValueInfoProto, what: str) -> str:
    t = v.type
    if not t.HasField("tensor_type"):
        raise TritonEntryError(f"{what} {v.name!r} is not a tensor: Triton's onnxruntime "
                               "backend serves tensors only")
    dtype = _TRITON_TYPES.get(t.tensor_type.elem_type)
    if dtype is None:
        raise TritonEntryError(
            f"{what} {v.name!r} has element type "
            f"{onnx.TensorProto.DataType.Name(t.tensor_type.elem_type)}, which Triton has no "
            "DataType for")
    if not t.tensor_type.HasField("shape"):
        raise TritonEntryError(f"{what} {v.name!r} has no rank: Triton needs its dims")
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.tensor_type.shape.dim]
    # A scalar is dims [1] reshaped to [] (Triton's dims may not be empty).
    shape = (f"dims: [ {', '.join(map(str, dims))} ]" if dims
             else "dims: [ 1 ] reshape: { shape: [ ] }")
    return f"  {{ name: {_pb_string(v.name)} data_type: {dtype} {shape} }}"


def model_config(model: onnx.ModelProto, name: str, version: int, *,
                 library: str | None, kind: str = "cpu", instances: int = 1) -> str:
    """``config.pbtxt`` (Triton's ModelConfig in protobuf text format) for ``model``:
    the onnxruntime backend, every graph input and output with its type and dims (-1 for a
    symbolic dim; no batching: ``max_batch_size: 0``, the dims are the whole shape), only
    ``version`` served, ``instances`` instances of ``kind`` (cpu or gpu), ORT's memory
    patterns off (the plan's budget does not count their block) and, with ``library``
    (its path inside the container), the op library."""
    inits = {t.name for t in model.graph.initializer}
    inputs = [_tensor_spec(v, "input") for v in model.graph.input if v.name not in inits]
    outputs = [_tensor_spec(v, "output") for v in model.graph.output]
    lines = [
        f"name: {_pb_string(name)}",
        'backend: "onnxruntime"',
        "max_batch_size: 0",
        f"version_policy: {{ specific: {{ versions: [ {version} ] }} }}",
        "input [", ",\n".join(inputs), "]",
        "output [", ",\n".join(outputs), "]",
        f"instance_group [ {{ kind: KIND_{kind.upper()} count: {instances} }} ]",
        'parameters { key: "enable_mem_pattern" value: { string_value: "0" } }',
    ]
    if library is not None:
        lines.append(f"model_operations {{ op_library_filename: [ {_pb_string(library)} ] }}")
    return "\n".join(lines) + "\n"


def _data_locations(model: onnx.ModelProto) -> list[str]:
    """The files the model's folder must hold besides the model: its initializers' external
    data and the files its weight ``Prefetch`` nodes read."""
    out: dict[str, None] = {}
    for t in model.graph.initializer:
        ref = external_ref(t)
        if ref is not None:
            out[ref.location] = None
    for n in iter_nodes(model):
        if n.domain == contract.DOMAIN:
            for a in n.attribute:
                if a.name == "location" and a.s:
                    out[a.s.decode("utf-8", "replace")] = None
    return list(out)


def _folder_config(model: onnx.ModelProto, host_pool_limit: int | None) -> str:
    lines = ["# ho-onnx: the op library beside this file takes this folder as its model folder",
             "# (docs/serving.md); lines key=value, the library's session config entries."]
    stored = _stored_bytes(model)
    if stored > 0:
        lines.append(f"{CONFIG_HOST_BYTES}={stored}")
    if host_pool_limit is not None:
        lines.append(f"{CONFIG_HOST_POOL_LIMIT}={host_pool_limit}")
    return "\n".join(lines) + "\n"


def _check_arguments(name: str, version: int, kind: str, instances: int,
                     container_repo: str) -> None:
    if not _NAME.fullmatch(name):
        raise TritonEntryError(f"model name {name!r}: use letters, digits, '_', '-' and '.', "
                               "not starting with '.' or '-' (it is a folder name)")
    if version < 1:
        raise TritonEntryError(f"version {version}: Triton's versions are positive integers")
    if kind not in ("cpu", "gpu"):
        raise TritonEntryError(f"instance kind {kind!r}: cpu or gpu")
    if instances < 1:
        raise TritonEntryError(f"instances {instances}: at least 1")
    if not container_repo.startswith("/"):
        raise TritonEntryError(f"container repository {container_repo!r} must be an absolute "
                               "path (the backend loads op_library_filename as given)")


def _fill(vdir: Path, src: Path, data: list[str], lib_src: Path | None,
          folder_config: str) -> list[str]:
    """The version folder's files: the model, its data, the library and its config."""
    vdir.mkdir()
    files = [MODEL_FILE]
    copy_sparse(src, vdir / MODEL_FILE)
    for loc in data:
        dst = vdir / loc
        dst.parent.mkdir(parents=True, exist_ok=True)
        copy_sparse(src.parent / loc, dst)
        files.append(Path(loc).as_posix())
    if lib_src is not None:
        shutil.copyfile(lib_src, vdir / lib_src.name)
        (vdir / FOLDER_CONFIG).write_text(folder_config)
        files += [lib_src.name, FOLDER_CONFIG]
    return files


def _refuse_no_reuse(model: onnx.ModelProto) -> None:
    """A model planned without ORT's buffer reuse: the backend cannot turn it off."""
    from .runtime import planned_reuse, refuse_no_reuse

    refuse_no_reuse(planned_reuse({p.key: p.value for p in model.metadata_props}),
                    "Triton's onnxruntime backend", TritonEntryError)


def write_triton_entry(model_path: str | os.PathLike[str], repo: str | os.PathLike[str],
                       name: str, *, version: int = 1, triton_release: str | None = None,
                       ort_version: str | None = None, container_repo: str = "/models",
                       kind: str = "cpu", instances: int = 1,
                       host_pool_limit: int | None = None,
                       library: str | os.PathLike[str] | None = None) -> TritonEntry:
    """Write ``<repo>/<name>`` for the model at ``model_path`` (an optimized model, or any
    ONNX model: one without cache ops gets no op library). ``container_repo`` is where the
    container sees ``repo`` (``op_library_filename`` must be absolute there); the container's
    onnxruntime (``ort_version``, else that of ``triton_release``) is checked against the
    library's minimum. ``host_pool_limit`` bounds the library's host pool of stored
    activations (``ho_onnx.host_pool_limit_bytes``; default half the machine's memory, per
    model). ``library`` defaults to :func:`ho_onnx.library_path`. ``<repo>/<name>`` must not
    exist."""
    _check_arguments(name, version, kind, instances, container_repo)
    ort_v = container_ort_version(triton_release, ort_version)
    src = Path(model_path)
    if not src.is_file():
        raise ModelLoadError(f"{str(src)!r} is not a model file")
    model = read_proto(src)
    _refuse_no_reuse(model)
    lib_src = None
    if any(n.domain == contract.DOMAIN for n in iter_nodes(model)):
        check_ort_version(ort_v)
        from .runtime import library_path

        lib_src = Path(library if library is not None else library_path())
    reserved = {MODEL_FILE, FOLDER_CONFIG} | ({lib_src.name} if lib_src else set())
    data = _data_locations(model)
    for loc in data:
        resolve_data_path(src.parent, loc, f"model {str(src)!r}")  # inside, or refused
        if Path(loc).parts[0] in reserved:
            raise TritonEntryError(f"the model's data file {loc!r} has a name the entry "
                                   f"needs for its own files ({', '.join(sorted(reserved))})")
    repo_dir = Path(repo)
    target = repo_dir / name
    if target.exists() or target.is_symlink():
        raise OutputPathError(f"{str(target)!r} exists: remove it or choose another --name")
    config = model_config(model, name, version, kind=kind, instances=instances,
                          library=(f"{container_repo.rstrip('/')}/{name}/{version}/"
                                   f"{lib_src.name}" if lib_src is not None else None))
    try:
        repo_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=repo_dir))
    except OSError as e:
        raise OutputPathError(f"cannot write into {str(repo_dir)!r}: {e.strerror or e}") from None
    try:
        files = _fill(tmp / str(version), src, data, lib_src,
                      _folder_config(model, host_pool_limit))
        (tmp / "config.pbtxt").write_text(config)
        os.rename(tmp, target)  # fails if the target appeared meanwhile: nothing replaced
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise OutputPathError(f"cannot write {str(target)!r}: {e.strerror or e}") from None
        raise
    vdir = target / str(version)
    return TritonEntry(target, target / "config.pbtxt", vdir / MODEL_FILE, ort_v,
                       vdir / lib_src.name if lib_src is not None else None, files)
