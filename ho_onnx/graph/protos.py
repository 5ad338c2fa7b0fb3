"""Small helpers over ONNX protos shared by the graph passes: subgraph walk, graph shells."""

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
