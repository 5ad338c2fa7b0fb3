"""Small helpers over ONNX protos shared by the graph passes: subgraph walk, graph shells, a
model's graph inputs read from its bytes without parsing its weights."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import onnx


def iter_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph (If/Loop/Scan bodies), depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from iter_graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from iter_graphs(g)


def iter_nodes(model: onnx.ModelProto, graphs: Sequence[onnx.GraphProto] | None = None
               ) -> Iterator[onnx.NodeProto]:
    """Every node of ``model``: its graph's and the model functions' bodies', with their
    subgraphs' (``graphs``: :func:`iter_graphs` of the main graph, when known: its nodes are
    then not walked again, and come graph by graph)."""
    def walk(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.NodeProto]:
        for node in nodes:
            yield node
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    yield from walk(attr.g.node)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for g in attr.graphs:
                        yield from walk(g.node)

    if graphs is None:
        yield from walk(model.graph.node)
    else:
        for g in graphs:
            yield from g.node
    for f in model.functions:
        yield from walk(f.node)


def graph_shell(graph: onnx.GraphProto) -> onnx.GraphProto:
    """A copy of ``graph`` without its nodes, initializers and value_info (name, doc, inputs,
    outputs, sparse initializers, metadata and quantization annotations kept)."""
    g = onnx.GraphProto()
    g.name = graph.name
    g.doc_string = graph.doc_string
    g.input.extend(graph.input)
    g.output.extend(graph.output)
    g.sparse_initializer.extend(graph.sparse_initializer)
    g.metadata_props.extend(graph.metadata_props)
    g.quantization_annotation.extend(graph.quantization_annotation)
    return g


def _varint(buf: memoryview, i: int) -> tuple[int, int]:
    """The varint at ``buf[i:]`` and the position after it."""
    shift = value = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("truncated or overlong varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _fields(buf: memoryview) -> Iterator[tuple[int, int, memoryview | int]]:
    """(field number, wire type, bytes of a length-delimited field or the value of a varint)
    of the message ``buf``; fixed-width fields are skipped past, never read."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
            yield field, wire, value
        elif wire == 2:
            n, i = _varint(buf, i)
            if i + n > len(buf):
                raise ValueError("a field runs past its message")
            yield field, wire, buf[i:i + n]
            i += n
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise ValueError(f"wire type {wire} (groups) not expected in an ONNX model")


_MODEL_GRAPH, _GRAPH_INITIALIZER, _GRAPH_INPUT, _TENSOR_NAME = 7, 5, 11, 8
_MODEL_METADATA, _ENTRY_KEY, _ENTRY_VALUE = 14, 1, 2


def model_metadata(data: bytes | memoryview) -> dict[str, str]:
    """The model's ``metadata_props``, read from a serialized ModelProto without parsing its
    graph (skipped whole). ValueError where the bytes are not a well-formed message."""
    out: dict[str, str] = {}
    for field, wire, entry in _fields(memoryview(data)):
        if field != _MODEL_METADATA or wire != 2:
            continue
        assert isinstance(entry, memoryview)
        kv = {f: bytes(v).decode("utf-8", "replace") for f, w, v in _fields(entry)
              if w == 2 and isinstance(v, memoryview)}
        out[kv.get(_ENTRY_KEY, "")] = kv.get(_ENTRY_VALUE, "")
    return out


def graph_inputs(data: bytes | memoryview) -> list[onnx.ValueInfoProto]:
    """The main graph's inputs that are not initializers, read from a serialized ModelProto
    without parsing its initializers (only each one's name: its data is skipped, so a model
    with gigabytes of inline weights costs a walk over their headers). ValueError where the
    bytes are not a well-formed message."""
    buf = memoryview(data)
    inputs: list[onnx.ValueInfoProto] = []
    inits: set[str] = set()
    for field, wire, graph in _fields(buf):
        if field != _MODEL_GRAPH or wire != 2:
            continue
        assert isinstance(graph, memoryview)
        for f, w, v in _fields(graph):
            if w != 2:
                continue
            assert isinstance(v, memoryview)
            if f == _GRAPH_INPUT:
                try:
                    inputs.append(onnx.ValueInfoProto.FromString(bytes(v)))
                except Exception as e:  # (protobuf's DecodeError)
                    raise ValueError(f"a graph input is not a ValueInfoProto: {e}") from None
            elif f == _GRAPH_INITIALIZER:
                inits.update(bytes(n).decode("utf-8", "replace") for g, gw, n in _fields(v)
                             if g == _TENSOR_NAME and gw == 2 and isinstance(n, memoryview))
    return [v for v in inputs if v.name not in inits]
