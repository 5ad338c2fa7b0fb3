"""Model folders: an onnxruntime-genai folder or an Optimum folder in, a ready folder out.

* **onnxruntime-genai** (``genai_config.json`` + the decoder model it names): the output
  folder holds the optimized decoder, its data, the ho-onnx custom-op library (genai loads a
  library named relative to the model folder) and ``genai_config.json`` with
  ``model.decoder.session_options`` extended by ``custom_ops_library``,
  ``enable_mem_pattern: false`` (ORT's pattern block is not in the budget) and the session
  config entries the library reads (``ho_onnx.model_dir``; unknown string keys of genai's
  session options are session config entries).
* **Optimum** (``config.json`` + ``model.onnx``, or a legacy folder's merged decoder
  ``decoder_model_merged.onnx``): the output folder holds the optimized model, its data and
  every other file; load it with
  ``ORTModelForCausalLM.from_pretrained(folder, session_options=optimum_session_options(folder))``
  (:func:`optimum_session_options`: ho-onnx's session options for ``folder/model.onnx``).

Every other file of the input folder and its subfolders (tokenizer, generation config, ...)
is copied; model data files are written by the optimize step itself. Nothing outside the
input folder is read (a link out of it, a FIFO or a device is refused before anything is
written), and the input folder is never modified.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import onnx

from ... import contract
from ...contract import CONFIG_MODEL_DIR
from ...errors import ModelLoadError, OutputPathError
from ...graph.load import read_proto, resolve_data_path
from ...graph.protos import iter_nodes
from ...graph.save import NonStandardJSONError, copy_sparse, new_folders, read_json

FolderKind = Literal["genai", "optimum"]
GENAI_CONFIG = "genai_config.json"
MAX_CONFIG_BYTES = 16 << 20  # genai_config.json and config.json hold kilobytes
OPTIMUM_CONFIG = "config.json"
OPTIMUM_MODEL = "model.onnx"
# A legacy Optimum folder's merged decoder (one If over the decoders without and with past),
# what ORTModelForCausalLM loads there when it finds no model.onnx.
OPTIMUM_MERGED = "decoder_model_merged.onnx"

OptimizeFile = Callable[[Path, Path], Any]  # (input model, output model) -> anything


@dataclass
class ModelFolder:
    """A recognised model folder: its kind and the model file ho-onnx optimizes."""

    kind: FolderKind
    path: Path
    model: Path  # the decoder (genai) or model.onnx (Optimum)
    config: dict[str, Any] = field(default_factory=dict)


def _read_json(folder: Path, name: str, *, standard: bool = False) -> dict[str, Any]:
    """The JSON object in file ``name`` of ``folder``: a regular file inside it (a link out
    of it is refused), at most :data:`MAX_CONFIG_BYTES`, nested no deeper than Python's
    parser goes (was: followed anywhere, read whole, and a ``[[[...`` of 200,000 levels an
    unexpected RecursionError); ``standard``: a file ho-onnx writes again, so standard JSON
    only (was: ``NaN``, ``Infinity`` and ``1e400`` written back as ``NaN``/``Infinity``,
    which genai's parser refuses too; no finite value would be the user's)."""
    path = folder / name
    _inside(folder, name, repr(str(folder)), "configuration file")
    try:
        # (a link inside the folder is read as its file, like the files copied)
        data = read_json(path.resolve(), MAX_CONFIG_BYTES, follow=False, standard=standard)
    except NonStandardJSONError as e:
        raise ModelLoadError(f"{str(path)!r} is not standard JSON: {e} (write a finite "
                             "number, or null)") from None
    except (OSError, ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else e
        raise ModelLoadError(f"{str(path)!r} is not readable JSON: {why}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{str(path)!r} must hold a JSON object")
    return data


def detect_folder(path: str | os.PathLike[str]) -> ModelFolder:
    """Recognise ``path`` as a genai folder (``genai_config.json``, checked first) or an
    Optimum folder (``config.json`` + ``model.onnx``); raises :class:`ModelLoadError`
    saying what is missing otherwise."""
    p = Path(path)
    if not p.is_dir():
        raise ModelLoadError(f"{str(p)!r} is not a folder")
    if (p / GENAI_CONFIG).is_file():
        cfg = _read_json(p, GENAI_CONFIG, standard=True)  # (written again, extended)
        section = cfg.get("model")
        decoder = section.get("decoder") if isinstance(section, dict) else None
        if not isinstance(decoder, dict) or not isinstance(decoder.get("filename"), str):
            raise ModelLoadError(f"{str(p / GENAI_CONFIG)!r} names no model.decoder.filename")
        if not isinstance(decoder.get("session_options", {}), dict):
            raise ModelLoadError(f"{str(p / GENAI_CONFIG)!r}: model.decoder.session_options "
                                 "must be a JSON object")
        name = decoder["filename"]  # read there, written at the same place in the output
        _inside(p, name, repr(str(p / GENAI_CONFIG)), "decoder file name")
        model = p / name
        if not model.is_file():
            raise ModelLoadError(f"{str(p / GENAI_CONFIG)!r} names decoder "
                                 f"{decoder['filename']!r}, which is not in {str(p)!r}")
        return ModelFolder("genai", p, model, cfg)
    for name in (OPTIMUM_MODEL, OPTIMUM_MERGED):
        if (p / OPTIMUM_CONFIG).is_file() and (p / name).is_file():
            _inside(p, name, repr(str(p)), "model file")  # (not a link out of it)
            return ModelFolder("optimum", p, p / name, _read_json(p, OPTIMUM_CONFIG))
    models = sorted(f.name for f in p.glob("*.onnx") if f.is_file())[:4]
    hint = ""
    if models and (p / OPTIMUM_CONFIG).is_file():  # (older Optimum exports: several models)
        hint = (f"; it holds {', '.join(models)}: optimize each model file on its own "
                "(ho-onnx optimize FOLDER/FILE.onnx OUT.onnx) and copy the rest of the folder")
    raise ModelLoadError(
        f"{str(p)!r} is neither an onnxruntime-genai folder ({GENAI_CONFIG}) nor an Optimum "
        f"folder ({OPTIMUM_CONFIG} + {OPTIMUM_MODEL}){hint}")


def _snapshot_hint(folder: Path) -> str:
    """What to do, when ``folder`` is a Hugging Face cache snapshot (its files are links
    into ``../../blobs``, outside it); else nothing."""
    if folder.resolve().parent.name != "snapshots":
        return ""
    return ("; a Hugging Face cache snapshot links its files from outside it: make a real "
            "copy first (`cp -rL SNAPSHOT DIR`, or download with `--local-dir`)")


def _inside(folder: Path, name: str, what: str, kind: str) -> None:
    """Refuse a file name that is not a path inside ``folder`` (links resolved)."""
    try:
        resolve_data_path(folder, name, what, kind=kind, error=ModelLoadError)
    except ModelLoadError as e:
        raise ModelLoadError(f"{e}{_snapshot_hint(folder)}") from None


def _model_files(model: Path) -> set[Path]:
    """The model file and every external data file it references (not copied as-is;
    references the optimize step will refuse are left to it)."""
    out = {model.resolve()}
    for t in read_proto(model).graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                with contextlib.suppress(ValueError, OSError, RuntimeError):
                    out.add((model.parent / e.value).resolve())
    return out


class _Entry(NamedTuple):
    """A file :func:`_files_to_copy` found: where to read it, where it goes in the output
    folder, and which file it was (``st_dev``, ``st_ino``)."""

    src: Path
    rel: Path
    seen: tuple[int, int]


def _files_to_copy(folder: Path, skip: set[Path]) -> list[_Entry]:
    """Every file copied as it is: all but the model, its data files (``skip``, resolved)
    and ``genai_config.json``, in every subfolder.

    Nothing outside the folder is read: a symbolic link must resolve to a regular file inside
    it (was: followed anywhere, so a link to ``/etc/passwd`` or ``/dev/zero`` was copied);
    FIFOs, sockets and devices (a read could block or never end) and links to folders are
    refused with a :class:`ModelLoadError`, before anything is written. The copy reads each
    file only if it is still the one seen here (a file swapped for a link or FIFO meanwhile
    is refused: :func:`~ho_onnx.graph.save.open_regular`)."""
    root = folder.resolve()
    out: list[_Entry] = []

    def refuse(item: Path, why: str) -> ModelLoadError:
        return ModelLoadError(f"{str(item)!r} {why}: model folders are copied only from "
                              f"files inside {str(folder)!r}{_snapshot_hint(folder)}")

    def walk(d: Path, rel: Path) -> None:
        try:
            items = sorted(d.iterdir())
        except OSError as e:
            raise refuse(d, f"cannot be listed ({e.strerror or e})") from None
        for item in items:
            try:
                st = item.lstat()
                src = item
                if stat.S_ISLNK(st.st_mode):
                    try:
                        src = item.resolve(strict=True)
                    except (OSError, RuntimeError):  # dangling, or a loop
                        raise refuse(item, "is a link that leads nowhere") from None
                    if root not in src.parents:
                        raise refuse(item, f"is a link to {str(src)!r}, outside the folder")
                    st = src.lstat()  # (resolved: not a link)
                    if stat.S_ISDIR(st.st_mode):
                        raise refuse(item, "is a link to a folder")
            except OSError as e:  # (gone meanwhile, or not ours to read)
                raise refuse(item, f"cannot be read ({e.strerror or e})") from None
            if stat.S_ISDIR(st.st_mode):
                walk(item, rel / item.name)
            elif not stat.S_ISREG(st.st_mode):
                raise refuse(item, "is not a regular file (a FIFO, socket or device)")
            elif src.resolve() not in skip and rel / item.name != Path(GENAI_CONFIG):
                out.append(_Entry(src, rel / item.name, (st.st_dev, st.st_ino)))

    walk(folder, Path())
    return out


def _copy_rest(dst: Path, files: list[_Entry]) -> list[str]:
    """Copy :func:`_files_to_copy`'s files (never over what the optimize step wrote)."""
    copied = []
    for src, rel, seen in files:
        target = dst / rel
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            copy_sparse(src, target, expect=seen)
        except OSError as e:  # (the output folder is emptied by the caller)
            raise OutputPathError(f"cannot copy {str(src)!r} to {str(target)!r}: "
                                  f"{e.strerror or e}") from None
        copied.append(rel.as_posix())
    return copied


def _stored_bytes(model: onnx.ModelProto) -> int:
    """The planned stored peak of a rewritten ``model``: the ``host_bytes`` attribute its
    ``Store`` nodes carry (bytes of activations stored at once per run); 0 without Stores."""
    return max((a.i for n in iter_nodes(model)
                if n.domain == contract.DOMAIN and n.op_type == contract.STORE
                for a in n.attribute if a.name == contract.ATTR_HOST_BYTES), default=0)


def _plan_entries(model: Path) -> dict[str, str]:
    """Session config entries for a written optimized model: its folder and, when it stores
    activations, :func:`_stored_bytes` (what ``ho_onnx.host_bytes`` means: the stored
    activations that size the CUDA engine's pinned ring; was: the metadata's ``host_bytes``,
    every offloaded weight counted, disk-tier ones included, overriding the Stores' value)."""
    entries = {CONFIG_MODEL_DIR: str(model.resolve().parent)}
    stored = _stored_bytes(onnx.load(str(model), load_external_data=False))
    if stored > 0:
        entries[contract.CONFIG_HOST_BYTES] = str(stored)
    return entries


@dataclass
class FolderResult:
    """What :func:`optimize_folder` wrote."""

    kind: FolderKind
    folder: Path
    model: Path
    library: Path | None = None
    copied: list[str] = field(default_factory=list)
    session_config: dict[str, str] = field(default_factory=dict)


def optimize_folder(src: str | os.PathLike[str], dst: str | os.PathLike[str],
                    optimize_file: OptimizeFile, library: str | os.PathLike[str] | None = None
                    ) -> FolderResult:
    """Optimize the model of folder ``src`` into a ready folder ``dst``.

    ``optimize_file(in_model, out_model)`` writes the optimized model (and its data) at
    ``out_model`` inside ``dst``. ``library`` is the custom-op library copied into a genai
    folder (default: :func:`ho_onnx.library_path`). ``dst`` must not exist or be
    an empty folder, and must not be ``src``.
    """
    folder = detect_folder(src)
    out = Path(dst)
    if out.resolve() == folder.path.resolve():
        raise OutputPathError(f"the output folder {str(out)!r} is the input folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise OutputPathError(f"the output folder {str(out)!r} exists and is not empty")
    files = _files_to_copy(folder.path, _model_files(folder.model))
    if folder.kind == "genai":
        if library is None:
            from .runtime import library_path

            library = library_path()
        _check_library_name(folder, Path(library).name, files)
    with new_folders(out):  # a failure leaves it as it was: absent, or empty
        try:
            return _fill_folder(folder, out, files, optimize_file, library)
        except BaseException:
            _empty(out)  # (empty before: everything in it is this call's)
            raise


def _library_taken(name: str, what: str) -> ModelLoadError:
    return ModelLoadError(
        f"{what}, where the output's custom-op library {name!r} goes (genai loads it by that "
        "name from the model folder): rename or move it in the input folder")


def _check_library_name(folder: ModelFolder, name: str, files: list[_Entry]) -> None:
    """Refuse a genai input whose decoder, or a folder of it, has the library's name (was:
    the library copied into that folder, ``custom_ops_library`` naming a folder, exit 0); a
    file of that name is replaced by the library."""
    decoder = folder.model.relative_to(folder.path).parts
    inside = [e.rel for e in files if len(e.rel.parts) > 1 and e.rel.parts[0] == name]
    if decoder[0] == name or inside:
        kind = "file" if decoder == (name,) else "folder"
        raise _library_taken(name, f"the input holds the {kind} {str(folder.path / name)!r}")


def _empty(folder: Path) -> None:
    for item in folder.iterdir():
        if item.is_dir() and not item.is_symlink():
            shutil.rmtree(item, ignore_errors=True)
        else:
            item.unlink(missing_ok=True)


def _fill_folder(folder: ModelFolder, out: Path, files: list[_Entry],
                 optimize_file: OptimizeFile, library: str | os.PathLike[str] | None
                 ) -> FolderResult:
    out_model = out / folder.model.relative_to(folder.path)
    out_model.parent.mkdir(parents=True, exist_ok=True)
    optimize_file(folder.model, out_model)
    result = FolderResult(folder.kind, out, out_model)
    result.copied = _copy_rest(out, files)
    result.session_config = _plan_entries(out_model)
    if folder.kind == "genai":
        assert library is not None  # (optimize_folder's default, checked there)
        from .runtime import ort_reuse_of, refuse_no_reuse

        refuse_no_reuse(ort_reuse_of(out_model), "onnxruntime-genai")
        lib = Path(library)
        result.library = out / lib.name
        if result.library.is_symlink() or (result.library.exists()
                                           and lib.name not in result.copied):
            # (written by the optimize step, say a data file of that name: never overwritten)
            raise _library_taken(lib.name, f"the optimized model wrote {str(result.library)!r}")
        shutil.copy2(lib, result.library)
        cfg = json.loads(json.dumps(folder.config))
        so = cfg["model"]["decoder"].setdefault("session_options", {})
        so["custom_ops_library"] = lib.name
        so["enable_mem_pattern"] = False  # as ho_onnx.InferenceSession: the budget's arena
        so.update(result.session_config)
        (out / GENAI_CONFIG).write_text(json.dumps(cfg, indent=4, allow_nan=False) + "\n")
    return result


def optimum_session_options(folder: str | os.PathLike[str], **kw: Any) -> Any:
    """``onnxruntime.SessionOptions`` for ``ORTModelForCausalLM.from_pretrained(folder,
    session_options=...)`` on an optimized Optimum folder (ho-onnx's ops registered, weights
    resolved in ``folder``); ``kw`` goes to :func:`ho_onnx.session_options`."""
    from .runtime import session_options

    return session_options(Path(folder) / OPTIMUM_MODEL, **kw)
