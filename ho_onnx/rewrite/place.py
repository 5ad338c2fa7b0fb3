"""Place the offloaded weights' bytes: finish each weight Prefetch with where its bytes are.

Weights that were in external data keep their file, offset and length; offloaded weights
that were inline go to a sidecar ``<output name>.data`` beside the output, page aligned when
big (O_DIRECT reads later), and so do the resident blocks cut out of a weight's external data
(:mod:`.blocks`' lazy slices: inline they would grow the model proto, toward its 2 GiB limit,
and ORT would copy them to its heap instead of mapping them). The result says what the save
writes (:class:`OutputFiles`); nothing is written here.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx_ir as ir

from .. import contract
from ..errors import OutputPathError
from ..graph.analyse import all_graphs
from ..graph.dtypes import dense_nbytes
from ..graph.gcpause import gc_paused
from ..graph.load import ExternalRef, resolve_data_path
from ..graph.save import OutputFiles, Sidecar, output_folder
from .insert import RewrittenModel

_ALIGN_BIG = 4096  # offsets of big sidecar tensors are page aligned (O_DIRECT reads later)
_ALIGN_SMALL = 64
_BIG = 64 << 10


@gc_paused()
def place_weight_data(rewritten: RewrittenModel, base_dir: Path,
                      out_path: str | os.PathLike[str]) -> OutputFiles:
    """Set ``location``/``offset``/``length`` on every weight Prefetch of ``rewritten`` (in
    place) for an output written to ``out_path``; ``base_dir`` is the input's folder, which
    external-data locations are relative to. The result holds the finished model (serialised
    to a proto only when the save writes it); the save stamps each weight Prefetch with its
    data file's final size and fingerprint (:attr:`OutputFiles.stamps`)."""
    out = Path(out_path)
    out_dir = output_folder(out)
    referenced = _referenced_files(rewritten, base_dir)
    sidecar = Sidecar(f"{out.name}.data")
    where = _sidecar_layout(rewritten, sidecar, out_dir)
    if sidecar.tensors and (any(p == out_dir / sidecar.name for p in referenced.values()) or any(
        (out_dir / loc).resolve() == out_dir / sidecar.name for loc in referenced
    )):  # (only when a sidecar is needed: the genai builder's data is model.onnx.data)
        raise OutputPathError(
            f"the sidecar {str(out_dir / sidecar.name)!r} would overwrite external data of the "
            "model; choose another output name"
        )
    kept = out_dir == base_dir.resolve()  # the data files stay where they are
    for name, v in rewritten.weights.items():
        ref = ir_external_ref(v.const_value)
        if ref is not None:
            loc = _unlinked(ref.location, out_dir, referenced[ref.location]) if kept else (
                ref.location)
            where[name] = (loc, ref.offset, int(ref.length or 0))
    stamped: dict[str, list[ir.Node]] = {}
    for name, nodes in rewritten.weight_prefetches.items():
        loc, off, length = where[name]
        for node in nodes:
            for attr in (ir.AttrString(contract.ATTR_LOCATION, loc),
                         ir.AttrInt64(contract.ATTR_OFFSET, off),
                         ir.AttrInt64(contract.ATTR_LENGTH, length)):
                node.attributes[attr.name] = attr
        stamped.setdefault(loc, []).extend(nodes)
    return OutputFiles(rewritten.model, referenced,
                       sidecar if sidecar.tensors else None, stamped)


def _unlinked(location: str, folder: Path, file: Path) -> str:
    """``location`` in ``folder``, or, when a symbolic link leads there (to ``file``, inside
    the folder: :func:`~ho_onnx.graph.load.resolve_data_path`), the path of ``file``
    itself: the library opens weight data without following links (was: the output of an
    optimization beside a linked data file failed to load)."""
    if os.path.normpath(folder / location) == str(file):
        return location
    return file.relative_to(folder).as_posix()


def ir_external_ref(tensor: ir.TensorProtocol | None) -> ExternalRef | None:
    """Where an external tensor's bytes are (length filled in from its type and shape), or
    None for an inline one."""
    if not isinstance(tensor, ir.ExternalTensor):
        return None
    length = tensor.length if tensor.length is not None else _nbytes(tensor)
    return ExternalRef(tensor.location, tensor.offset or 0, length)


def _nbytes(tensor: ir.TensorProtocol) -> int:
    return dense_nbytes(int(tensor.dtype), tuple(int(d) for d in tensor.shape))


def _referenced_files(rewritten: RewrittenModel, base_dir: Path) -> dict[str, Path]:
    """Data files the output references (location -> file), its initializers' and the
    offloaded weights'."""
    values = [v for g in all_graphs(rewritten.model.graph) for v in g.initializers.values()]
    named: dict[str, str] = {}  # location -> an initializer stored there
    for v in [*values, *rewritten.weights.values()]:
        if isinstance(v.const_value, ir.ExternalTensor):
            named.setdefault(v.const_value.location, v.name or "")
    return {loc: resolve_data_path(base_dir, loc, f"initializer {name!r}")
            for loc, name in named.items()}


def _sidecar_layout(rewritten: RewrittenModel, sidecar: Sidecar, out_dir: Path
                    ) -> dict[str, tuple[str, int, int]]:
    """Lay the inline offloaded weights out in ``sidecar``, (file, offset, length) of each,
    and the resident blocks (made external there, in ``out_dir``: module docstring)."""
    where: dict[str, tuple[str, int, int]] = {}
    pos = 0
    for name, v in rewritten.weights.items():
        if ir_external_ref(v.const_value) is not None or not rewritten.weight_prefetches.get(name):
            continue
        if v.const_value is None:
            raise OutputPathError(f"offloaded weight {name!r} has no value")
        length = _nbytes(v.const_value)
        pos += (-pos) % (_ALIGN_BIG if length >= _BIG else _ALIGN_SMALL)
        sidecar.tensors.append((name, v.const_value, pos, length))
        where[name] = (sidecar.name, pos, length)
        pos += length
    for g in all_graphs(rewritten.model.graph):  # resident blocks: external in the sidecar
        for name, v in g.initializers.items():
            t = v.const_value
            if not isinstance(t, ir.LazyTensor):
                continue
            length = _nbytes(t)
            pos += (-pos) % (_ALIGN_BIG if length >= _BIG else _ALIGN_SMALL)
            sidecar.tensors.append((name, t, pos, length))
            v.const_value = ir.ExternalTensor(sidecar.name, pos, length, t.dtype, shape=t.shape,
                                              name=name, base_dir=str(out_dir))
            pos += length
    return where
