"""Place the offloaded weights' bytes: finish each weight Prefetch with where its bytes are.

Weights that were in external data keep their file, offset and length; offloaded weights
that were inline go to a sidecar ``<output name>.data`` beside the output, page aligned when
big (O_DIRECT reads later). The result says what the save writes (:class:`OutputFiles`);
nothing is written here.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import contract
from ..errors import OutputPathError
from ..graph.load import expected_nbytes, external_ref, iter_graphs, resolve_data_path
from ..graph.save import OutputFiles, Sidecar, set_attr
from .insert import RewrittenModel

_ALIGN_BIG = 4096  # offsets of big sidecar tensors are page aligned (O_DIRECT reads later)
_ALIGN_SMALL = 64
_BIG = 64 << 10


def place_weight_data(rewritten: RewrittenModel, base_dir: Path,
                      out_path: str | os.PathLike[str]) -> OutputFiles:
    """Set ``location``/``offset``/``length`` on every weight Prefetch of ``rewritten`` (in
    place) for an output written to ``out_path``; ``base_dir`` is the input's folder, which
    external-data locations are relative to. The save stamps each of those nodes with its
    data file's final size and fingerprint (:attr:`OutputFiles.stamps`)."""
    out = Path(out_path)
    out_dir = out.resolve().parent
    referenced = _referenced_files(rewritten, base_dir)
    sidecar = Sidecar(f"{out.name}.data")
    where = _sidecar_layout(rewritten, sidecar)
    if sidecar.tensors and (any(p == out_dir / sidecar.name for p in referenced.values()) or any(
        (out_dir / loc).resolve() == out_dir / sidecar.name for loc in referenced
    )):  # (only when a sidecar is needed: the genai builder's data is model.onnx.data)
        raise OutputPathError(
            f"the sidecar {str(out_dir / sidecar.name)!r} would overwrite external data of the "
            "model; choose another output name"
        )
    for name, t in rewritten.weights.items():
        ref = external_ref(t)
        if ref is not None:
            length = ref.length if ref.length is not None else expected_nbytes(t)
            where[name] = (ref.location, ref.offset, int(length or 0))
    nodes = rewritten.model.graph.node
    stamps: dict[str, list[int]] = {}
    for name, positions in rewritten.weight_prefetches.items():
        loc, off, length = where[name]
        attrs = {contract.ATTR_LOCATION: loc, contract.ATTR_OFFSET: off,
                 contract.ATTR_LENGTH: length}
        for i in positions:
            for attr, value in attrs.items():
                set_attr(nodes[i], attr, value)
        stamps.setdefault(loc, []).extend(positions)
    return OutputFiles(rewritten.model, referenced, sidecar if sidecar.tensors else None,
                       stamps)


def _referenced_files(rewritten: RewrittenModel, base_dir: Path) -> dict[str, Path]:
    """Data files the output references (location -> file), its initializers' and the
    offloaded weights'."""
    tensors = [t for g in iter_graphs(rewritten.model.graph) for t in g.initializer]
    referenced: dict[str, Path] = {}
    for t in [*tensors, *rewritten.weights.values()]:
        ref = external_ref(t)
        if ref is not None:
            referenced[ref.location] = resolve_data_path(base_dir, ref.location, t.name)
    return referenced


def _sidecar_layout(rewritten: RewrittenModel, sidecar: Sidecar
                    ) -> dict[str, tuple[str, int, int]]:
    """Lay the inline offloaded weights out in ``sidecar``; (file, offset, length) of each."""
    where: dict[str, tuple[str, int, int]] = {}
    pos = 0
    for t in rewritten.weights.values():
        if external_ref(t) is not None or not rewritten.weight_prefetches.get(t.name):
            continue
        length = expected_nbytes(t)
        if length is None:
            raise OutputPathError(f"cannot serialise inline initializer {t.name!r} to raw bytes")
        pos += (-pos) % (_ALIGN_BIG if length >= _BIG else _ALIGN_SMALL)
        sidecar.tensors.append((t, pos, length))
        where[t.name] = (sidecar.name, pos, length)
        pos += length
    return where
