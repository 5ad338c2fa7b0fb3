"""Load an ONNX model for planning without reading weight bytes, and validate it.

External data stays on disk: only its references (location, offset, length) are read and
checked against the files' sizes, on the proto (the right tool for validating the file).
Every later pass works on the ``onnx_ir`` model made from it, whose external tensors are
never read while planning.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError, Message
from onnx import TensorProto

from ..contract import DOMAIN
from ..errors import ExternalDataError, HoOnnxError, ModelLoadError, UnsupportedModelError
from ..units import format_bytes
from .analyse import SOURCE_PROTO, all_graphs
from .check import check_attribute_types, check_standard, size_error, tensor_data_error
from .dtypes import ELEMENT_BITS, capped_nbytes
from .forked import MIN_NODES as FORK_MIN_NODES
from .forked import start_check
from .gcpause import gc_paused
from .protos import iter_graphs, iter_nodes


@dataclass(frozen=True)
class ExternalRef:
    """Where an initializer's bytes live on disk (location is relative to the model dir)."""

    location: str
    offset: int
    length: int | None


@dataclass
class LoadedModel:
    """A checked model without weight bytes, and the folder its external data is relative to.

    ``model`` is the ``onnx_ir`` model every step works on, from load to save (external
    tensors refer to files in ``base_dir``, never read while planning); the file as loaded
    serves the tools that read a proto while its graph is unchanged
    (:func:`~ho_onnx.graph.analyse.tool_proto`). ``training_info``: the entries of the
    file's ``training_info``, which ``onnx_ir`` does not read. ``keepalive``: an object that
    owns the files (a temporary folder), kept as long as this.
    """

    model: ir.Model
    path: Path
    base_dir: Path
    keepalive: object = field(default=None, repr=False)
    training_info: int = 0
    # The external-data files as loaded (location -> an initializer stored there), before
    # any pass moved initializers: what an output must never overwrite.
    data_locations: dict[str, str] = field(default_factory=dict, repr=False)


def to_ir(proto: onnx.ModelProto, base_dir: Path, what: str
          ) -> tuple[ir.Model, dict[str, str]]:
    """The ``onnx_ir`` model of a checked ``proto`` whose external data lies in ``base_dir``,
    and its external-data locations (location -> an initializer stored there)."""
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as e:  # a structure onnx_ir refuses (the checker let it through)
        _refuse_map_types(proto, what)
        seen = {id(e)}  # the innermost cause: onnx_ir's own words (a chain may loop)
        while (inner := e.__cause__ or e.__context__) is not None and id(inner) not in seen:
            seen.add(id(inner))
            e = inner  # type: ignore[assignment]
        raise ModelLoadError(f"{what!r} cannot be read as an ONNX graph: {e}") from None
    if model.ir_version < 4:
        _initializers_out_of_inputs(model)
    locations: dict[str, str] = {}
    for g in all_graphs(model.graph):
        for v in g.initializers.values():
            if isinstance(v.const_value, ir.ExternalTensor):
                v.const_value.base_dir = base_dir
                locations.setdefault(v.const_value.location, v.name or "")
    return model, locations


def _refuse_map_types(proto: onnx.ModelProto, what: str) -> None:
    """Refuse, naming them, values whose type holds a map (ZipMap's ``seq(map(...))``
    output, common in scikit-learn exports), which onnx_ir cannot read (found by hand: the
    error was onnx_ir's "Error calling _deserialize_graph with: g")."""
    def has_map(t: onnx.TypeProto) -> bool:
        while not t.HasField("map_type"):
            kind = t.WhichOneof("value")
            if kind not in ("sequence_type", "optional_type"):
                return False
            t = getattr(t, kind).elem_type
        return True

    names = [v.name for g in iter_graphs(proto.graph) for v in (*g.input, *g.output,
                                                                   *g.value_info)
             if has_map(v.type)]
    if names:
        shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
        raise UnsupportedModelError(
            f"{what!r}: {shown} {'has a map type' if len(names) == 1 else 'have map types'} "
            "(as ZipMap's output): not supported (onnx_ir, the graph library ho-onnx plans on, "
            "cannot read map types yet); export the model without maps (skl2onnx: "
            "options={'zipmap': False})")


def _initializers_out_of_inputs(model: ir.Model) -> None:
    """Say an IR < 4 model in IR 4's terms (in place): IR 3 lists every initializer among
    the graph inputs, and ORT holds them constant there (``Graph::CanOverrideInitializer``
    is ``ir_version >= 4``; feeding one is "Invalid input name"), so they leave the main
    graph's inputs and the IR version becomes 4, whose only change is that initializers
    need not be inputs. Found by hand with an opset-8 model: every weight was "initializer
    that is also a graph input (overridable)", so nothing could be offloaded."""
    g = model.graph
    kept = [v for v in g.inputs if v.name not in g.initializers]
    if len(kept) != len(g.inputs):
        g.inputs.clear()
        g.inputs.extend(kept)
    model.ir_version = 4


def external_ref(tensor: TensorProto) -> ExternalRef | None:
    """The external-data reference of ``tensor``, or None when its bytes are inline."""
    if tensor.data_location != TensorProto.EXTERNAL:
        return None
    kv = {e.key: e.value for e in tensor.external_data}
    if "location" not in kv:
        raise ExternalDataError(f"initializer {tensor.name!r} is external but has no location")
    try:
        offset = int(kv.get("offset", "0"))
        length = int(kv["length"]) if "length" in kv else None
    except ValueError as e:
        raise ExternalDataError(
            f"initializer {tensor.name!r}: offset/length are not integers ({e})"
        ) from None
    if offset < 0 or (length is not None and length < 0):
        raise ExternalDataError(f"initializer {tensor.name!r}: negative offset or length")
    return ExternalRef(kv["location"], offset, length)


def resolve_data_path(base_dir: Path, location: str, what: str, *,
                      kind: str = "external data location",
                      error: type[HoOnnxError] = ExternalDataError) -> Path:
    """The file ``location`` names, refusing absolute paths and escapes from ``base_dir``
    (``kind`` names the string in the ``error``: also the decoder a genai folder names).
    Resolved anew on every call (links can change between calls: a cached answer was a
    stale "inside" for a file since replaced by a link out of the folder)."""
    if "\0" in location:
        raise error(f"{what}: {kind} {location!r} has a NUL byte")
    if not location or os.path.isabs(location) or location.startswith(("\\", "/")):
        raise error(f"{what}: {kind} {location!r} must be a relative path inside the model "
                    f"folder {str(base_dir)!r}")
    base = base_dir.resolve()
    try:
        path = (base / location).resolve()
    except RuntimeError:  # (pathlib's word for a loop of symbolic links)
        raise error(f"{what}: {kind} {location!r} is a loop of symbolic links") from None
    if path != base and base not in path.parents:
        raise error(f"{what}: {kind} {location!r} points outside the model folder {str(base)!r}")
    return path


def expected_nbytes(tensor: TensorProto) -> int | None:
    """Bytes a dense tensor of this type and shape occupies (None for strings/unknown types,
    and over :data:`~ho_onnx.graph.dtypes.MAX_TENSOR_BYTES`)."""
    if tensor.data_type not in ELEMENT_BITS:
        return None
    return capped_nbytes(tensor.data_type, tensor.dims)


def _numeric_nbytes(tensor: TensorProto, what: str, error: type[HoOnnxError]) -> int | None:
    """:func:`expected_nbytes` of ``tensor``, refusing (``error``) a numeric tensor whose
    shape has a negative dim or claims over 1 PiB."""
    if tensor.data_type not in ELEMENT_BITS:
        return None
    nbytes = capped_nbytes(tensor.data_type, tensor.dims)
    if nbytes is None:
        raise error(f"{what}: {size_error(tensor)} (a malformed model?)")
    return nbytes


def validate_weight_data(model: onnx.ModelProto, base_dir: Path,
                         graphs: Sequence[onnx.GraphProto] | None = None) -> None:
    """Every initializer's data must be what its type and shape say: an external reference
    must name a file inside ``base_dir`` that is long enough, inline data must fit
    (:func:`~ho_onnx.graph.check.tensor_data_error`; tensor attributes:
    :func:`~ho_onnx.graph.check.check_attribute_types`). ``graphs``: ``iter_graphs`` of the
    main graph, when known."""
    sizes: dict[Path, int] = {}
    paths: dict[str, Path] = {}  # one or a few data files, thousands of initializers
    for graph in iter_graphs(model.graph) if graphs is None else graphs:
        for tensor in graph.initializer:
            ref = external_ref(tensor)
            what = f"initializer {tensor.name!r}"
            if ref is None:
                why = tensor_data_error(tensor)
                if why:
                    raise ModelLoadError(f"{what}: {why} (a malformed model?)")
                continue
            path = paths.get(ref.location)
            if path is None:
                path = paths[ref.location] = resolve_data_path(base_dir, ref.location, what)
                # as the system finds it, folder by folder (found by hand: 'sub/../w.bin'
                # without a folder 'sub' resolves to w.bin on paper only; ORT failed with
                # "SystemError : 2")
                if not (path.is_file() and (base_dir / ref.location).is_file()):
                    raise ExternalDataError(
                        f"{what}: external data file {ref.location!r} not found in "
                        f"{str(base_dir)!r}" + (" (a folder it names on the way is missing)"
                                                if path.is_file() else ""))
            if path not in sizes:
                sizes[path] = path.stat().st_size
            want = _numeric_nbytes(tensor, what, ExternalDataError)
            if ref.length is not None and want is not None and ref.length != want:
                raise ExternalDataError(
                    f"{what}: external data length {ref.length} does not match its type and "
                    f"shape ({want} bytes)"
                )
            length = ref.length if ref.length is not None else (want or 0)
            if ref.offset + length > sizes[path]:
                raise ExternalDataError(
                    f"{what}: needs bytes [{ref.offset}, {ref.offset + length}) of "
                    f"{ref.location!r}, but the file has only {sizes[path]} bytes "
                    "(truncated or wrong file?)"
                )


def check_opsets(model: onnx.ModelProto, allow_cache_ops: bool = False,
                 graphs: Sequence[onnx.GraphProto] | None = None) -> None:
    """Refuse opsets this onnx cannot interpret and (unless allowed) rewritten models
    (``graphs``: ``iter_graphs`` of the main graph, when known)."""
    max_onnx = onnx.defs.onnx_opset_version()
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx") and imp.version > max_onnx:
            raise UnsupportedModelError(
                f"the model imports ai.onnx opset {imp.version}, newer than the newest this "
                f"onnx ({onnx.__version__}) knows ({max_onnx}); upgrade onnx or convert the model"
            )
        if imp.domain in ("", "ai.onnx") and imp.version < 1:
            raise UnsupportedModelError(f"invalid ai.onnx opset version {imp.version}")
    # An opset import alone is harmless (ORT's saved optimized models import every domain it
    # knows, ours included once the library was loaded); cache operators are not.
    for g in iter_graphs(model.graph) if graphs is None else graphs:
        check_dense(g)
        if not allow_cache_ops and any(n.domain == DOMAIN for n in g.node):
            raise UnsupportedModelError(
                f"the model already contains {DOMAIN} cache operators: optimize the original "
                "model, not an optimized one"
            )


def check_dense(graph: onnx.GraphProto) -> None:
    """Refuse a graph with sparse initializers. onnx_ir does not read them (it sees their
    names as values nothing makes), so the plan would leave them out and the output would
    lose them (found by hand: ``plan`` of such a valid model planned without the weight,
    ``optimize`` failed on its own output's check)."""
    if graph.sparse_initializer:
        names = [t.values.name for t in graph.sparse_initializer]
        shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
        raise UnsupportedModelError(
            f"the model has {len(names)} sparse initializer(s) ({shown}): not supported "
            "(ONNX Runtime makes them dense when it loads the model; ho-onnx can neither plan "
            "nor write them yet); store them as dense initializers")


# Models up to this many bytes are checked for UTF-8 by one parse in C (which copies the
# bytes once more); bigger ones (inline weights) by the field walk, whose cost grows with the
# number of fields, not with bytes.
UTF8_PARSE_MAX_BYTES = 64 << 20


@functools.cache
def _utf8_verifying_model() -> type[Message] | None:
    """``onnx.ModelProto``'s schema restated as an editions-2023 file, whose string fields
    protobuf verifies as UTF-8 while parsing (proto2's, onnx's, are not verified); None
    where this protobuf cannot build it (no editions before 4.25) or does not verify (a
    known bad string is tried first)."""
    try:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

        fdp = descriptor_pb2.FileDescriptorProto()
        onnx.ModelProto.DESCRIPTOR.file.CopyToProto(fdp)
        fdp.syntax, fdp.edition = "editions", descriptor_pb2.EDITION_2023
        features = fdp.options.features  # proto2's behaviour, but for UTF-8 (2023: VERIFY)
        features.enum_type = descriptor_pb2.FeatureSet.CLOSED
        features.repeated_field_encoding = descriptor_pb2.FeatureSet.EXPANDED
        pool = descriptor_pool.DescriptorPool()
        pool.Add(fdp)
        cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("onnx.ModelProto"))
    except Exception:  # an older protobuf: the walk checks every model
        return None
    probe = onnx.ModelProto(producer_name="@").SerializeToString().replace(b"@", b"\xff")
    try:
        cls.FromString(probe)
    except DecodeError:
        return cls
    return None


def _walk_text(message: Message, what: str) -> None:
    for fd, value in message.ListFields():
        repeated = fd.is_repeated
        if fd.type == fd.TYPE_MESSAGE:
            for m in value if repeated else (value,):
                _walk_text(m, what)
        elif fd.type == fd.TYPE_STRING:
            try:
                bad = [v for v in (value if repeated else (value,)) if not isinstance(v, str)]
            except UnicodeDecodeError:
                bad = [fd.name]
            if bad:
                raise ModelLoadError(f"{what!r}: a {fd.full_name} string is not valid "
                                     f"UTF-8 ({bad[0]!r})")


def check_text(message: Message, what: str) -> None:
    """Refuse a string field that is not valid UTF-8 (protobuf parses it and hands it out
    as bytes, or fails, wherever it is read later).

    A model up to :data:`UTF8_PARSE_MAX_BYTES` is parsed once more by a verifying schema
    (C speed) where this protobuf has one; the field walk runs when that parse fails (it
    decides, and names the field), and for bigger models, other messages and older
    protobufs.
    """
    verifying = _utf8_verifying_model() if isinstance(message, onnx.ModelProto) and \
        message.ByteSize() <= UTF8_PARSE_MAX_BYTES else None
    if verifying is not None:
        try:
            verifying.FromString(message.SerializeToString())
            return
        except DecodeError:  # the walk decides (and names the field)
            pass
    _walk_text(message, what)


#: The largest message protobuf parses (``INT_MAX`` bytes): a bigger model file is no model.
MAX_PROTO_BYTES = 2**31 - 1
#: Bytes 4-8 of an ORT-format model (a FlatBuffer, ``.ort``): its file identifier.
ORT_FORMAT_MAGIC = b"ORTM"


def _refuse_unparsable(p: Path) -> None:
    """Refuse, unread, what protobuf can never parse as a model: a file over
    :data:`MAX_PROTO_BYTES` (was read whole, 3 GiB of memory for a 3 GiB file, then "Wire
    format was corrupt") and an ORT-format model (was "Wire format was corrupt")."""
    try:  # (without blocking: a FIFO swapped in after the is_file check is not waited on)
        with os.fdopen(os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
            size, head = os.fstat(f.fileno()).st_size, f.read(8)
    except OSError as e:
        raise ModelLoadError(f"cannot read {str(p)!r}: {e.strerror or e}") from None
    if size > MAX_PROTO_BYTES:
        raise ModelLoadError(
            f"{str(p)!r} is {format_bytes(size)}: protobuf cannot read a model file over 2 GiB, "
            "so this is no ONNX model file; keep the weights in external data "
            "(onnx.save_model(..., save_as_external_data=True))")
    if head[4:8] == ORT_FORMAT_MAGIC:
        raise ModelLoadError(
            f"{str(p)!r} is an ORT-format model (a FlatBuffer, .ort), which ORT runs but "
            "cannot convert back: give ho-onnx the ONNX model it was made from")


def read_proto(p: Path) -> onnx.ModelProto:
    """The model file ``p`` parsed (weight bytes stay on disk), or a :class:`ModelLoadError`
    saying why it is not one."""
    if not p.exists():
        raise ModelLoadError(f"model file {str(p)!r} does not exist")
    if not p.is_file():
        raise ModelLoadError(f"{str(p)!r} is not a file")
    _refuse_unparsable(p)
    try:
        model = onnx.load(str(p), load_external_data=False)
    except MemoryError:
        raise ModelLoadError(f"out of memory reading {str(p)!r}") from None
    except Exception as e:  # protobuf's DecodeError and friends
        raise ModelLoadError(f"{str(p)!r} is not a readable ONNX model: {e}") from None
    if not model.HasField("graph") or model.ir_version == 0:
        raise ModelLoadError(f"{str(p)!r} is not an ONNX model (no graph or IR version)")
    return model


def data_files(path: str | os.PathLike[str]) -> list[Path]:
    """The external-data files the model file ``path`` names beside it (relative locations;
    an absolute one is refused when the model is loaded), read without its weights or the
    checks of :func:`load_model`: for a caller that must not write over them before the
    work. A :class:`ModelLoadError` or :class:`ExternalDataError` when it cannot be read."""
    p = Path(path)
    model = read_proto(p)
    check_text(model, str(p))  # (a location that is not UTF-8 is bytes, no path)
    files: dict[Path, None] = {}
    for graph in iter_graphs(model.graph):
        for tensor in graph.initializer:
            ref = external_ref(tensor)
            if ref is not None and not os.path.isabs(ref.location):
                files[p.parent / ref.location] = None
    return list(files)


@gc_paused()
def load_model(path: str | os.PathLike[str], *, check: bool = True,
               allow_cache_ops: bool = False) -> LoadedModel:
    """Read ``path`` (weight bytes stay on disk), check it and its external data references."""
    p = Path(path)
    model = read_proto(p)
    check_dense(model.graph)  # (before onnx_ir reads it and warns of the names it lacks)
    base_dir = p.resolve().parent

    def validate() -> None:
        check_text(model, str(p))
        graphs = list(iter_graphs(model.graph))  # (walked once for all the checks)
        check_opsets(model, allow_cache_ops, graphs)
        validate_weight_data(model, base_dir, graphs)
        try:  # (external data was checked above; contrib and custom-domain ops pass here)
            check_attribute_types(iter_nodes(model, graphs))  # (what onnx_ir could not write)
            if check:
                check_standard(model, graphs=graphs)
        except onnx.checker.ValidationError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
            raise ModelLoadError(f"{str(p)!r} is not a valid ONNX model: {first}") from None

    # in a forked child while the onnx_ir model is built (big graphs: forked.MIN_NODES)
    checking = start_check(validate, worth_forking=len(model.graph.node) >= FORK_MIN_NODES)
    try:
        model_ir, locations = to_ir(model, base_dir, str(p))
    except ModelLoadError:
        checking.wait()  # a failed check explains more than what onnx_ir could not read
        raise
    except BaseException:  # interrupted: no child left behind
        checking.cancel()
        raise
    checking.wait()
    model_ir.meta[SOURCE_PROTO] = model  # (what the tools read until a pass changes the graph)
    return LoadedModel(model=model_ir, path=p, base_dir=base_dir, data_locations=locations,
                       training_info=len(model.training_info))
