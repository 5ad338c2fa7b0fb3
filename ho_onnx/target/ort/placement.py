"""Predict where ONNX Runtime's CUDA execution provider places every cache op.

ORT's CUDA EP claims every node it has a kernel for, then hands some back to the CPU EP in
``GetCpuPreferredNodes`` (onnxruntime ``core/framework/fallback_cpu_capability.cc``):

* ORT turns every ``Constant`` node into an initializer when it loads the graph
  (``Graph::Graph``), so a small Constant's output counts as a small initializer;
* seeds: outputs that a CUDA kernel leaves in host memory (``Shape``, ``Size``) and every
  output of a node the CUDA EP cannot run; their consumers become candidates, visited in
  topological order;
* a candidate goes to the CPU when none of its inputs is float16/bfloat16/float8 and every
  input is a small initializer (<= 100 elements, which includes the empty ``[0]`` Prefetch
  source), a graph input, or a host tensor that its CUDA kernel does not itself take in host
  memory; its outputs become host tensors and its consumers candidates.

Our ops have CPU kernels too, so a cache op that meets that rule runs on the CPU EP while
the rest of its chain runs on CUDA: the CUDA ``Wait`` then finds no transfer ("no transfer
pending"), the CUDA ``Detach`` no store. :func:`predict_cuda_placement` replays the rule on
a rewritten graph; :func:`split_chains` names every chain whose ops would not all run on
one provider. The rewriter avoids the rule's trigger (no host tensor is offloaded for a
CUDA target and no ordering input is a host tensor), and ``ho-onnx inspect`` runs this
check on every model.

Approximations (documented, conservative): which standard ops lack a CUDA kernel is a
fixed list (:data:`NO_CUDA_KERNEL`, plus every op of a domain other than ONNX's, ORT's
contrib domain and ours), and per-type kernel gaps are ignored.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import onnx
import onnx_ir as ir
from onnx import TensorProto

from ... import contract
from ...graph.analyse import attribute_values, input_names, output_names

Model = ir.Model | onnx.ModelProto

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"

SMALL_INITIALIZER = 100  # kSmallInitializerThreshold
_NO_CPU_FALLBACK_TYPES = frozenset({
    TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT8E4M3FN,
    TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ,
})
# CUDA kernels whose outputs live in host memory (OutputMemoryType CPU).
HOST_OUTPUTS: Mapping[str, tuple[int, ...]] = {"Shape": (0,), "Size": (0,)}
# CUDA kernels that take these inputs in host memory (InputMemoryType CPU): a host tensor
# there does not pull the node to the CPU.
HOST_INPUTS: Mapping[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "Unsqueeze": (1,), "Squeeze": (1,), "Tile": (1,),
    "ConstantOfShape": (0,), "Range": (0, 1, 2), "Slice": (1, 2, 3, 4), "TopK": (1,),
    "OneHot": (1,), "Pad": (1, 2, 3), "Resize": (1, 2, 3), "Upsample": (1,),
    "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,), "ReduceMin": (1,),
    "ReduceProd": (1,), "ReduceL2": (1,), "Split": (1,), "CumSum": (1,),
    "NonMaxSuppression": (2, 3, 4),
}
# Standard ops the CUDA EP has no kernel for (they run on the CPU EP).
NO_CUDA_KERNEL = frozenset({
    "StringNormalizer", "TfIdfVectorizer", "RegexFullMatch", "StringConcat", "StringSplit",
    "Unique", "Bernoulli", "Multinomial", "BitShift", "DFT", "STFT", "MelWeightMatrix",
    "HannWindow", "HammingWindow", "BlackmanWindow", "Col2Im", "ImageDecoder", "MaxUnpool",
    "LpPool", "Hardmax", "SequenceInsert", "SequenceAt", "SequenceConstruct", "SequenceEmpty",
    "SequenceErase", "SequenceLength", "SplitToSequence", "ConcatFromSequence",
    "OptionalHasElement", "OptionalGetElement", "Optional", "Det", "Momentum", "Adagrad",
    "Adam", "AffineGrid",
})
_CUDA_DOMAINS = frozenset({"", "ai.onnx", "com.microsoft", contract.DOMAIN})


@dataclass(frozen=True)
class Placement:
    """Predicted provider of every node (by position) and the host tensors of the graph."""

    providers: tuple[str, ...]
    host_tensors: frozenset[str]
    names: tuple[str, ...]

    def cache_ops(self, model: Model) -> dict[str, str]:
        """Cache-op node name -> predicted provider."""
        return {n.name or "": p for n, p in zip(_ir(model).graph, self.providers, strict=True)
                if n.domain == contract.DOMAIN}


@dataclass(frozen=True)
class SplitChain:
    """Cache ops of one transfer that would run on different providers (or off CUDA)."""

    tensor: str
    nodes: tuple[tuple[str, str, str], ...]  # (op, node name, provider)

    def describe(self) -> str:
        parts = ", ".join(f"{op} '{name}' on {prov.removesuffix('ExecutionProvider')}"
                          for op, name, prov in self.nodes)
        return f"{self.tensor}: {parts}"


@dataclass
class PlacementReport:
    """What ``ho-onnx inspect`` prints: cache ops per provider and every split chain."""

    per_provider: dict[str, int] = field(default_factory=dict)
    split: list[SplitChain] = field(default_factory=list)
    off_cuda: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.split and not self.off_cuda


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every typed value (declared, inferred, and through the cache ops)."""
    g = model.graph
    types: dict[str, int] = {}
    for t in g.initializer:
        types[t.name] = t.data_type
    skeleton = onnx.ModelProto()
    skeleton.CopyFrom(model)
    for t in skeleton.graph.initializer:  # types only: no weight bytes needed
        t.ClearField("raw_data")
        t.ClearField("external_data")
        t.data_location = TensorProto.DEFAULT
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton, strict_mode=False).graph
        infos = list(inferred.value_info) + list(inferred.input) + list(inferred.output)
    except Exception:  # inference is a refinement; declared types still count
        infos = list(g.value_info) + list(g.input) + list(g.output)
    for vi in list(g.value_info) + list(g.input) + list(g.output) + infos:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types.setdefault(vi.name, vi.type.tensor_type.elem_type)
    for node in g.node:  # cache ops pass the element type of input 0 through
        if node.domain == contract.DOMAIN and node.input and node.input[0] in types:
            for o in node.output:
                types.setdefault(o, types[node.input[0]])
    return types


def kahn_order(deps: list[set[int]]) -> list[int]:
    """Kahn's algorithm over nodes ``0..n-1`` (``deps[i]``: the nodes ``i`` needs first),
    lowest index first among the ready ones; shorter than ``n`` when there is a cycle."""
    users: dict[int, list[int]] = {}
    for i, d in enumerate(deps):
        for j in d:
            users.setdefault(j, []).append(i)
    indeg = [len(d) for d in deps]
    heap = [i for i, k in enumerate(indeg) if k == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        i = heapq.heappop(heap)
        order.append(i)
        for u in users.get(i, ()):
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(heap, u)
    return order


def _ir(model: Model) -> ir.Model:
    return ir.from_proto(model) if isinstance(model, onnx.ModelProto) else model


def _has_cuda_kernel(node: ir.Node) -> bool:
    return node.domain in _CUDA_DOMAINS and not (
        node.domain in ("", "ai.onnx") and node.op_type in NO_CUDA_KERNEL) and not (
        node.domain == contract.DOMAIN and node.op_type in contract.CPU_ONLY)


def _small_constant(node: ir.Node) -> bool:
    """A ``Constant`` node of at most :data:`SMALL_INITIALIZER` elements (ORT loads it as an
    initializer)."""
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or not node.outputs:
        return False
    for name, attr in node.attributes.items():
        if name == "value":
            return attr.value.size <= SMALL_INITIALIZER
        if name in ("value_float", "value_int", "value_string"):
            return True
        if name in ("value_floats", "value_ints", "value_strings"):
            return len(attr.value) <= SMALL_INITIALIZER
    return False


def _host_input_positions(node: ir.Node) -> tuple[int, ...]:
    """The inputs ``node``'s CUDA kernel takes in host memory (:data:`HOST_INPUTS`)."""
    return HOST_INPUTS.get(node.op_type, ()) if node.domain in ("", "ai.onnx") else ()


def _falls_back(node: ir.Node, inputs: list[str], types: Mapping[str, int],
                cheap: set[str], host: set[str]) -> bool:
    """ORT's rule for a CUDA-capable candidate: to the CPU when no input is of a type with no
    CPU fallback and each is cheap to read there (a small initializer or a graph input:
    ``cheap``) or a host tensor its CUDA kernel does not itself take in host memory."""
    host_inputs = _host_input_positions(node)
    for k, x in enumerate(inputs):
        if not x:
            continue
        if types.get(x) in _NO_CPU_FALLBACK_TYPES:
            return False
        if x in cheap:
            continue
        if x not in host or k in host_inputs:
            return False
    return True


def predict_cuda_placement(model: Model, types: Mapping[str, int] | None = None
                           ) -> Placement:
    """Replay ORT's CUDA capability + CPU fallback on ``model``'s main graph (``types``:
    element types of its values when known, e.g. from the analysis; else inferred)."""
    if types is None:
        types = _elem_types(model if isinstance(model, onnx.ModelProto) else ir.to_proto(model))
    g = _ir(model).graph
    nodes = list(g)
    index = {n: i for i, n in enumerate(nodes)}
    ins = [input_names(n) for n in nodes]
    outs = [output_names(n) for n in nodes]
    consumers: dict[str, list[int]] = {}
    for i, names in enumerate(ins):
        for x in names:
            if x:
                consumers.setdefault(x, []).append(i)
    # Kahn's algorithm, ties by file position (ORT's priority queue uses its own order).
    order = kahn_order([{index[p] for v in n.inputs if v is not None
                         and (p := v.producer()) is not None and p in index} for n in nodes])
    rank = {i: r for r, i in enumerate(order)}
    small = {name for name, v in g.initializers.items()
             if v.const_value is not None and v.const_value.size <= SMALL_INITIALIZER}
    small |= {n.outputs[0].name for n in nodes if _small_constant(n)}
    inputs = {v.name for v in g.inputs} - set(g.initializers)
    cheap = small | inputs
    on_cuda = [_has_cuda_kernel(n) for n in nodes]

    host: set[str] = set()
    queue: list[tuple[int, int]] = []

    def push_consumers(name: str) -> None:
        for c in consumers.get(name, ()):
            heapq.heappush(queue, (rank.get(c, c), c))

    for i, n in enumerate(nodes):
        if on_cuda[i]:
            for k in HOST_OUTPUTS.get(n.op_type, ()) if n.domain in ("", "ai.onnx") else ():
                if k < len(outs[i]):
                    host.add(outs[i][k])
                    push_consumers(outs[i][k])
    visited: set[int] = set()
    cpu_nodes: set[int] = set()
    while queue:
        _, cur = heapq.heappop(queue)
        if cur in visited:
            continue
        visited.add(cur)
        # the CPU EP runs it (no CUDA kernel, or the fallback rule): outputs in host memory
        to_cpu = on_cuda[cur] and _falls_back(nodes[cur], ins[cur], types, cheap, host)
        if to_cpu:
            cpu_nodes.add(cur)
        if to_cpu or not on_cuda[cur]:
            for o in outs[cur]:
                host.add(o)
                push_consumers(o)
    providers = tuple(CUDA if on_cuda[i] and i not in cpu_nodes else CPU
                      for i in range(len(nodes)))
    return Placement(providers, frozenset(host), tuple(n.name or "" for n in nodes))


def cache_op_defect(node: ir.Node) -> str | None:
    """Why ONNX Runtime would refuse this cache op against the library's schema (a damaged
    model), or None: an unknown op, a required input or the first output missing."""
    need = contract.REQUIRED_INPUTS.get(node.op_type)
    if need is None:
        return f"{node.op_type!r} is no {contract.DOMAIN} operator"
    ins, outs = input_names(node), output_names(node)
    if sum(1 for name in ins[:need] if name) < need:
        return f"has {len(ins)} input(s), needs {need} (a damaged model?)"
    if not outs or not outs[0]:
        return "has no output (a damaged model?)"
    return None


def _chains(nodes: list[ir.Node]) -> list[tuple[str, list[int]]]:
    """Every transfer's cache ops: Store -> Detach -> Prefetch -> Wait, or Prefetch -> Wait
    (cache ops with a :func:`cache_op_defect` take no part)."""
    nodes_ok = [n.domain == contract.DOMAIN and cache_op_defect(n) is None for n in nodes]
    by_input: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        if nodes_ok[i]:
            names = input_names(n)
            by_input.setdefault(names[0], []).append(i)
            if n.op_type == contract.DETACH:  # (its second input: the token)
                by_input.setdefault(names[1], []).append(i)
    seen: set[int] = set()
    chains: list[tuple[str, list[int]]] = []
    for i, n in enumerate(nodes):
        if not nodes_ok[i] or i in seen:
            continue
        attrs = attribute_values(n)
        if n.op_type == contract.STORE:
            tensor = input_names(n)[0]
        elif n.op_type == contract.PREFETCH and contract.ATTR_LOCATION in attrs:
            tensor = str(attrs.get(contract.ATTR_NAME, n.name or ""))
        else:
            continue
        chain, frontier = [i], [output_names(n)[0]]
        while frontier:
            name = frontier.pop()
            for j in by_input.get(name, ()):
                if j not in chain:
                    chain.append(j)
                    frontier.extend(output_names(nodes[j]))
        seen.update(chain)
        chains.append((tensor, chain))
    return chains


def split_chains(model: Model, placement: Placement | None = None) -> PlacementReport:
    """Check that every transfer's cache ops all run on the CUDA EP (the ops registered for
    the CPU EP alone, ``contract.CPU_ONLY``, run on the CPU by design: not counted off it)."""
    placement = placement or predict_cuda_placement(model)
    nodes = list(_ir(model).graph)
    report = PlacementReport()
    for n, p in zip(nodes, placement.providers, strict=True):
        if n.domain == contract.DOMAIN:
            report.per_provider[p] = report.per_provider.get(p, 0) + 1
            if p != CUDA and n.op_type not in contract.CPU_ONLY:
                report.off_cuda.append(n.name or "")
    for tensor, chain in _chains(nodes):
        provs = {placement.providers[i] for i in chain}
        if len(provs) > 1:
            report.split.append(SplitChain(tensor, tuple(
                (nodes[i].op_type, nodes[i].name or "", placement.providers[i])
                for i in chain)))
    return report


HOST_TENSOR_REASON = ("lives in host memory on the CUDA EP (shape arithmetic): its cache ops "
                      "would run on the CPU EP and split from the rest of their chain")
HOST_INPUT_REASON = ("read in host memory by a CUDA kernel (e.g. Reshape's shape, Split's "
                     "sizes): reloaded to the device, ORT would copy it back with a stream sync")


def host_input_reads(nodes: Iterable[ir.Node]) -> set[str]:
    """Values some node reads at an input its CUDA kernel takes in host memory
    (:data:`HOST_INPUTS`), but initializers in external data: ORT's shape inference cannot
    read those (such a model does not load as it is), and a reload is what makes it load."""
    out: set[str] = set()
    for node in nodes:
        for k in _host_input_positions(node):
            if k < len(node.inputs) and (v := node.inputs[k]) is not None and v.name and \
                    not isinstance(v.const_value, ir.ExternalTensor):
                out.add(v.name)
    return out


def format_report(report: PlacementReport, limit: int = 20) -> str:
    """A few lines for ``ho-onnx inspect``."""
    per = ", ".join(f"{k.removesuffix('ExecutionProvider')} {v}"
                    for k, v in sorted(report.per_provider.items()))
    lines = [f"CUDA placement (ORT's CPU-fallback rule replayed): cache ops {per or 'none'}; "
             f"{len(report.split)} split chain(s)"]
    lines += [f"  SPLIT {s.describe()}" for s in report.split[:limit]]
    rest: Iterable[str] = [x for x in report.off_cuda
                           if not any(x == nm for s in report.split for _, nm, _ in s.nodes)]
    lines += [f"  on CPU {x}" for x in list(rest)[:limit]]
    return "\n".join(lines)
