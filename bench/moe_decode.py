"""MoE decode benchmark (issue 37, item 5): bytes moved per decode token against the bytes of
the experts the router chose, and tokens/s, for a Qwen3-MoE (``--arch``: Qwen2-MoE, Mixtral)
model built from a transformers config (random weights, nothing from a hub) and exported by
Optimum (``text-generation-with-past``; ``models.moe_export``).

Rows (every weight offloaded to the host tier, the KV cache left as exported):

* ``resident``         the unmodified model (ORT);
* ``all streamed``     every offloaded weight moves at every step (``OffloadOptions(routed=
  False)``: what ho-onnx did before routed transfers);
* ``routed``           an expert's weights move only when the router sent it a token (the
  gated reloads of ``ho_onnx.graph.moe.empty_gate``);
* ``routed, budget``   the planner at half the resident peak (or its smallest feasible
  budget when that is above), routed.
* ``routed + CPU experts``  routed, and every expert MatMul computed where its weights live
  (``cpu_experts="all"``: HostMatMul on the host store; no expert byte moves);
* ``CPU experts, budget``  the planner at the same budget with ``cpu_experts="auto"``.

``floor`` is the smallest budget the planner meets with each row's options (the fast-tier
memory the experts computed on the host leave free); ``peak`` the plan's predicted peak
(budget rows).

The same on the disk tier (every offloaded weight read from the data file at each use; moved
= bytes read from the file): ``all streamed, disk``, ``routed, disk`` (no cache), ``routed +
cache, disk`` (an LRU expert cache of ``--cache-share`` of the experts' bytes), ``routed +
cache + speculation, disk`` (the same cache, each layer's likely experts read into it a
layer early: the next router applied to this layer's router input, ``speculate_experts="on"``)
and ``routed + cache, budget, disk`` (the planner at the budget above plus half the experts'
bytes, with a cache of that half: the plan is made for the rest). The two ``routed + cache``
rows keep weights up to a router's size resident (the routers, the norms: a speculation
reads the next router's weight where it is), the others offload every weight.

Each decode step feeds every row the same inputs (the resident row's greedy tokens, teacher
forced), so each row's logits are compared with the resident row's (bit-exact at ORT's
optimizations off) and its bytes with the router's own choice: a copy of the unmodified
model with every router's TopK indices as extra outputs says which experts each step
selected; ``selected`` is their weights' bytes plus the bytes of the offloaded weights that
are not experts (moved at every step either way); with a cache, less the experts an LRU
simulation of its capacity over the router's choices held (``LruSim``). Goal: ``moved /
selected <= 1.1``.

``--arch contrib`` (``contrib_q``: 8-bit QMoE) runs the same rows on ``models.moe_contrib``:
the experts in ORT's ``MoE``/``QMoE`` contrib op, each layer's fc1/fc2 one stacked [E, ...]
tensor of which the routed rows move only the selected experts' slices; a running sum mixes
the tokens instead of attention (``past_sum`` carried between steps), and ``selected`` comes
from each op's router input (a probe copy's extra outputs, the op's selection recomputed in
numpy: ``models.moe_contrib.select``).

    python bench/moe_decode.py --json out.json            # CPU: 8 experts, top-2, 4 layers
    python bench/moe_decode.py --quick --json out.json    # tiny (CI)
    python bench/moe_decode.py --wide --json out.json     # experts wider than the lm_head
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from models.moe_export import ARCHS  # noqa: E402  (the repository root, just added)

PRESETS = {
    "cpu": {"layers": 4, "hidden": 256, "moe_ffn": 256, "experts": 8, "top_k": 2,
            "heads": 8, "kv_heads": 4, "vocab": 1024, "prompt": 64, "tokens": 24},
    # an expert projection (1 MiB) above the lm_head and embedding (256 KiB each): the experts
    # set the fast tier's floor, where computing them on the host shows
    "wide": {"layers": 2, "hidden": 256, "moe_ffn": 1024, "experts": 8, "top_k": 2,
             "heads": 8, "kv_heads": 4, "vocab": 256, "prompt": 64, "tokens": 24},
    "quick": {"layers": 2, "hidden": 32, "moe_ffn": 16, "experts": 4, "top_k": 2,
              "heads": 4, "kv_heads": 2, "vocab": 128, "prompt": 8, "tokens": 6},
    # --device cuda: 2.0 GiB fp32, experts 1.7 GiB (9 MiB each), 1/8 of them chosen per token
    "gpu": {"layers": 6, "hidden": 1024, "moe_ffn": 768, "experts": 32, "top_k": 4,
            "heads": 16, "kv_heads": 4, "vocab": 32000, "prompt": 64, "tokens": 16},
}


def export(cfg: dict[str, int], root: Path, arch: str) -> Path:
    """The Optimum export of a random-weight ``arch`` decoder of ``cfg``'s dims."""
    from models.moe_export import build_hf_moe, export_moe

    hf = build_hf_moe(root / "hf", arch, positions=512,
                      **{k: v for k, v in cfg.items() if k not in ("prompt", "tokens")})
    return export_moe(hf, root / "onnx", arch)


def step_dims(cfg: dict[str, int]) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
    """A decode step's dims (the analysis's) and the range plan's dims (prefill to the last
    decode step), for ``cfg``'s prompt and tokens."""
    last = cfg["prompt"] + cfg["tokens"]
    return ({"batch_size": 1, "sequence_length": 1, "past_sequence_length": last},
            {"sequence_length": (1, cfg["prompt"]), "past_sequence_length": (0, last)})


def probe(src: Path, dims: dict[str, int], out: Path | None
          ) -> tuple[Path | None, list[str], Any]:
    """A copy of ``src`` at ``out`` (None: none) with each router's TopK indices as extra
    outputs (beside ``src``: the graph alone, sharing its data file); the routers' TopK node
    names in that order; the model's routed reloads (``Routed``: each expert weight's router
    and column)."""
    import onnx
    from onnx import helper

    from ho_onnx.graph.analyse import analyse
    from ho_onnx.graph.moe import find_experts
    from ho_onnx.schedule.eligibility import Routed

    graph = onnx.load(str(src), load_external_data=False)
    a = analyse(graph, dims)
    layers = find_experts(a)
    if out is not None:
        beside = out.parent.resolve() == src.parent.resolve()  # (the same data file: no copy)
        model = graph if beside else onnx.load(str(src))
        names = [next(n for n in a.nodes if n.name == layer.node).outputs[1].name
                 for layer in layers]
        model.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.INT64, None)
                                  for n in names)
        if beside:
            onnx.save(model, out)
        else:
            onnx.save(model, out, save_as_external_data=True, location=out.name + ".data")
    return out, [layer.node for layer in layers], Routed.of(a, dims)


def selected_bytes(choice: Any, routed: Any, chosen: dict[str, set[int]]) -> int:
    """Bytes a step must move at least: every offloaded weight that is no expert's (once per
    reader) and the offloaded weights of the experts the routers chose."""
    total = 0
    for w in choice.weights:
        owner = routed.expert_of.get(w.name)
        if owner is None or owner[1] in chosen[owner[0]]:
            total += w.nbytes * len(w.consumers)
    return total


def floor(src: Path, opts: Any, ranges: dict[str, tuple[int, int]]) -> int:
    """The smallest budget the planner meets with ``opts`` (its budget aside)."""
    from dataclasses import replace

    from ho_onnx.rewrite.pipeline import plan_model
    from ho_onnx.schedule.planner import InfeasibleBudgetError

    cache = opts.expert_cache if isinstance(opts.expert_cache, int) else 0  # (in the budget)
    try:
        plan_model(src, replace(opts, budget=1, expert_cache=0), {"batch_size": 1},
                   dim_ranges=ranges)
    except InfeasibleBudgetError as e:
        return e.min_budget + cache
    return 1 + cache


class Load(NamedTuple):
    """One weight Prefetch of an optimized model that reads the data file (the disk tier)."""

    key: tuple[str, int, int]  # (location, offset, length): the library's cache key's range
    expert: tuple[str, int] | None  # gated: (its router's TopK node, its column), else None
    nbytes: int
    cached: int  # its ``expert_cache`` attribute (bytes), 0 when absent
    warm: bool = False  # a speculation's warm Prefetch: reads into the cache, moves nothing


def disk_loads(model: Path, routed: Any) -> list[Load]:
    """The disk-tier weight Prefetches of ``model`` in file order (the order they run in:
    ``ho_onnx.InferenceSession`` runs ORT's PRIORITY_BASED order, which follows the file),
    each with the expert whose gate it reads (``routed.expert_of``)."""
    import onnx
    from onnx import helper

    from ho_onnx import contract

    out = []
    for n in onnx.load(str(model), load_external_data=False).graph.node:
        a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        if n.domain != contract.DOMAIN or n.op_type != contract.PREFETCH \
                or a.get(contract.ATTR_TIER) != b"disk":
            continue
        expert = routed.expert_of[a["name"].decode()] if a.get(contract.ATTR_GATED) else None
        out.append(Load((a["location"].decode(), a["offset"], a["length"]), expert,
                        a["length"], a.get(contract.ATTR_EXPERT_CACHE, 0),
                        a.get(contract.ATTR_WARM, 0) == 1))
    return out


def speculation_probe(probe_model: Path, speculations: Any) -> list[str]:
    """Adds to the probe model at ``probe_model`` (in place: its graph; the data file is
    shared) each speculation's predicted expert indices as an output: the MatMul (+ Add) and
    TopK the rewrite inserts, on the same values, so ORT's kernels give the same indices.
    Returns the speculated layers (their TopK node names), in the outputs' order."""
    import onnx
    from onnx import helper

    model = onnx.load(str(probe_model), load_external_data=False)
    layers = []
    for i, s in enumerate(speculations):
        logits, k, picked = f"spec{i}.logits", f"spec{i}.k", f"spec{i}.experts"
        nodes = [helper.make_node("MatMul", [s.activation, s.router_weight], [logits])]
        if s.bias is not None:
            nodes.append(helper.make_node("Add", [logits, s.bias], [f"{logits}.b"]))
            logits = f"{logits}.b"
        nodes += [helper.make_node("Constant", [], [k], value=helper.make_tensor(
                      k, onnx.TensorProto.INT64, [1], [s.k])),
                  helper.make_node("TopK", [logits, k], [f"spec{i}.values", picked])]
        model.graph.node.extend(nodes)
        model.graph.output.append(helper.make_tensor_value_info(picked, onnx.TensorProto.INT64,
                                                                None))
        layers.append(s.layer)
    onnx.save(model, str(probe_model))
    return layers


class LruSim:
    """The expert cache's policy (``csrc/expert_cache.h``) replayed over the router's own
    choices: an LRU of ``capacity`` bytes, touched when a load asks for an entry, filled when
    it misses; an entry larger than the capacity is never kept."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: OrderedDict[tuple[str, int, int], int] = OrderedDict()
        self.hits = self.misses = 0
        # speculation (warm loads): reads started, requests already held, warmed entries a
        # routed load then asked for; the entries read by a warm load and not yet asked for
        self.warm_reads = self.warm_present = self.warm_hits = 0
        self.warmed: set[tuple[str, int, int]] = set()

    def _keep(self, ld: Load) -> None:
        while sum(self.held.values()) + ld.nbytes > self.capacity:
            self.warmed.discard(self.held.popitem(last=False)[0])
        self.held[ld.key] = ld.nbytes

    def step(self, loads: list[Load], chosen: set[tuple[str, int]],
             predicted: set[tuple[str, int]] = frozenset()) -> int:  # type: ignore[assignment]
        """Bytes one run reads from the file: every load whose gate is open (its expert is
        in ``chosen``: (router, column) pairs) and that the cache did not hold, and every
        warm load whose expert is in ``predicted`` (a speculation's pick) and that the cache
        did not hold (it is kept; a later load of it is a hit)."""
        read = 0
        for ld in loads:
            if ld.warm:
                if ld.expert not in predicted or not ld.cached or ld.nbytes > self.capacity:
                    continue
                if ld.key in self.held:
                    self.held.move_to_end(ld.key)
                    self.warm_present += 1
                else:
                    self.warm_reads += 1
                    read += ld.nbytes
                    self._keep(ld)
                    self.warmed.add(ld.key)
                continue
            if ld.expert is not None and ld.expert not in chosen:
                continue  # (a closed gate: nothing moves)
            if not ld.cached or not self.capacity:
                read += ld.nbytes
            elif ld.key in self.held:
                self.held.move_to_end(ld.key)
                self.hits += 1
                if ld.key in self.warmed:
                    self.warm_hits += 1
                    self.warmed.discard(ld.key)
            else:
                self.misses += 1
                read += ld.nbytes
                if ld.nbytes <= self.capacity:
                    self._keep(ld)
        return read


def session_options(sample_arena: bool = False) -> Any:
    """ORT's optimizations off (bit-exact), one thread; ``sample_arena``: every Wait samples
    ORT's arena (the ``arena`` column: its high-water mark at the step's last Wait)."""
    import onnxruntime as ort

    from ho_onnx.contract import CONFIG_SAMPLE_ARENA

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # bit-exact
    so.add_session_config_entry("session.disable_prepacking", "1")
    so.add_session_config_entry(CONFIG_SAMPLE_ARENA, "1" if sample_arena else "0")
    so.intra_op_num_threads = 1
    return so


def decode_feeds(lay: Any, tokens: list[int], past: dict[str, np.ndarray]) -> dict[str, Any]:
    n = next(iter(past.values())).shape[lay.seq_axis]
    ids = np.asarray([tokens], np.int64)
    feeds: dict[str, Any] = {lay.input_ids: ids} | past
    if lay.attention_mask:
        feeds[lay.attention_mask] = np.ones((1, n + ids.shape[1]), np.int64)
    if lay.position_ids:
        feeds[lay.position_ids] = np.arange(n, n + ids.shape[1], dtype=np.int64)[None, :]
    return feeds


def run(args: argparse.Namespace, cfg: dict[str, int], root: Path) -> dict[str, Any]:
    import onnxruntime as ort

    import ho_onnx
    from ho_onnx.rewrite.pipeline import optimize
    from ho_onnx.schedule.expert_cache import cacheable_bytes
    from ho_onnx.schedule.options import OffloadOptions
    from ho_onnx.target.ort.generate import _empty_past, kv_layout

    t0 = time.perf_counter()
    src = export(cfg, root, args.arch)
    print(f"exported {src} in {time.perf_counter() - t0:.0f} s", flush=True)
    dims, ranges = step_dims(cfg)
    prb, routers, routed = probe(src, dims, root / "probe.onnx")
    ref = ort.InferenceSession(str(prb), session_options(), providers=["CPUExecutionProvider"])
    lay = kv_layout(src)
    n_out = len(ref.get_outputs())
    configs = {"all streamed": OffloadOptions(activations=False, min_bytes=0, routed=False),
               "routed": OffloadOptions(activations=False, min_bytes=0)}
    from ho_onnx.rewrite.pipeline import plan_model

    peak = plan_model(src, OffloadOptions(budget=1 << 50), {"batch_size": 1},
                      dim_ranges=ranges)[2].baseline.peak_bytes
    from ho_onnx.schedule.planner import InfeasibleBudgetError

    try:  # half the resident peak, or the smallest budget the planner meets when above
        plan_model(src, OffloadOptions(activations=False, min_bytes=0, budget=peak // 2),
                   {"batch_size": 1}, dim_ranges=ranges)
        budget = peak // 2
    except InfeasibleBudgetError as e:
        budget = e.min_budget
    configs["routed, budget"] = OffloadOptions(activations=False, min_bytes=0, budget=budget)
    configs["routed + CPU experts"] = OffloadOptions(activations=False, min_bytes=0,
                                                     cpu_experts="all")
    configs["CPU experts, budget"] = OffloadOptions(activations=False, min_bytes=0,
                                                    budget=budget, cpu_experts="auto")
    disk = OffloadOptions(activations=False, min_bytes=0, weight_tier="disk", expert_cache=0)
    configs |= {"all streamed, disk": replace(disk, routed=False), "routed, disk": disk}
    sessions: dict[str, Any] = {"resident": ort.InferenceSession(
        str(src), session_options(), providers=["CPUExecutionProvider"])}
    choices: dict[str, Any] = {}
    plans: dict[str, dict[str, Any]] = {}
    loads: dict[str, list[Load]] = {}

    def make(name: str, opts: OffloadOptions) -> None:
        out = root / re.sub(r"[^a-z]+", "_", name) / "model.onnx"
        out.parent.mkdir()
        r = optimize(src, out, opts, {"batch_size": 1}, dim_ranges=ranges)
        choices[name] = r.choice
        plans[name] = {"floor": floor(src, opts, ranges),
                       "peak": r.plan.planned.peak_bytes if r.plan else None}
        loads[name] = disk_loads(out, routed)
        sessions[name] = ho_onnx.InferenceSession(out, sess_options=session_options(True))

    for name, opts in configs.items():
        make(name, opts)
    experts = cacheable_bytes(choices["routed, disk"])
    # (the routers, fp32 [hidden, experts], resident: a speculation reads the next one early)
    cached = replace(disk, expert_cache=int(experts * args.cache_share),
                     min_bytes=4 * cfg["hidden"] * cfg["experts"] + 1)
    make("routed + cache, disk", replace(cached, speculate_experts="off"))
    make(SPEC_ROW, replace(cached, speculate_experts="on"))
    from ho_onnx.schedule.speculate import describe as describe_speculation

    for line in describe_speculation(choices[SPEC_ROW]):
        print(f"  {SPEC_ROW}: {line}", flush=True)
    # (the budget above plus a cache of half the experts, planned for: the rest fits the
    # budget less the cache)
    make("routed + cache, budget, disk", replace(disk, budget=budget + experts // 2,
                                                 expert_cache=experts // 2))
    sims = {k: LruSim(c.expert_cache) for k, c in choices.items() if c.expert_cache}
    # the speculation's own picks: its MatMul and TopK added to the probe (ORT's kernels)
    speculated = speculation_probe(prb, choices[SPEC_ROW].speculations)
    ref = ort.InferenceSession(str(prb), session_options(), providers=["CPUExecutionProvider"])
    n_src = n_out  # (the probe's outputs before the speculation's)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg["vocab"], cfg["prompt"]).tolist()
    rows: dict[str, dict[str, Any]] = {k: {"row": k, "moved": [], "selected": [], "step_s": [],
                                           "host_matmuls": [], "arena": None, "ttft_s": None,
                                           "equal": True, "hits": 0, "misses": 0,
                                           "warm_reads": 0, "warm_hits": 0}
                                       | plans.get(k, {"floor": None, "peak": peak})
                                       for k in sessions}
    past = {p: _empty_past(lay, p, 1) for p, _ in lay.pairs}
    tokens = list(prompt)
    used: set[tuple[str, int]] = set()
    for step in range(cfg["tokens"] + 1):
        feeds = decode_feeds(lay, tokens, past)
        outs = ref.run(None, feeds)
        chosen = {r: set(v.reshape(-1).tolist())
                  for r, v in zip(routers, outs[n_src - len(routers):n_src], strict=True)}
        pairs = {(r, e) for r, es in chosen.items() for e in es}
        predicted = {(layer, int(e)) for layer, v in zip(speculated, outs[n_src:], strict=True)
                     for e in v.reshape(-1)}
        if step:
            used |= pairs  # (how repetitive the routing is: what a cache can exploit)
        for name, sess in sessions.items():
            got, dt = timed_run(sess, feeds)
            row = rows[name]
            row["equal"] &= bool(np.array_equal(got[0], outs[0]))
            c = ho_onnx.counters()
            sel = sims[name].step(loads[name], pairs, predicted) if name in sims else \
                selected_bytes(choices[name], routed, chosen) if name in choices else 0
            if step == 0:
                row["ttft_s"] = dt
            else:
                row["step_s"].append(dt)
                # (disk rows: what the Prefetches read; the embedding's GatherRows reads
                # its rows from the file too, on every row alike)
                row["moved"].append(c["bytes_read_disk"] - c["bytes_gathered"]
                                    if name.endswith("disk") else c["bytes_loaded"])
                row["host_matmuls"].append(c["host_matmuls"])
                if name in choices and c["waits"]:  # (no Wait: nothing sampled this run)
                    row["arena"] = max(row["arena"] or 0, c["ort_arena_max_in_use"])
                row["selected"].append(sel)
                row["hits"] += c["expert_cache_hits"]
                row["misses"] += c["expert_cache_misses"]
                row["warm_reads"] += c["warm_reads"]
                row["warm_hits"] += c["warm_hits"]
        names = [o.name for o in ref.get_outputs()]
        past = {p: outs[names.index(q)] for p, q in lay.pairs}
        tokens = [int(np.argmax(outs[0][0, -1]))]
    for row in rows.values():
        summarise(row)
        row["expert_cache"] = choices[row["row"]].expert_cache if row["row"] in choices else 0
    return {"arch": args.arch, "config": cfg, "rows": list(rows.values()), "complete": True,
            "resident_peak": peak, "budget": budget,
            "experts_chosen_at_decode": len(used), "experts": len(routers) * cfg["experts"],
            "onnxruntime": ort.__version__}


CONTRIB = ("contrib", "contrib_q")
SPEC_ROW = "routed + cache + speculation, disk"


def contrib_sessions(cfg: dict[str, int], root: Path, quant: bool
                     ) -> tuple[dict[str, Any], dict[str, Any], Any, list[str], int, int]:
    """The contrib-op decoder's rows (sessions), their choices, the probe session with the
    routers as outputs, their names, the resident peak and the budget row's budget."""
    import onnxruntime as ort

    import ho_onnx
    from ho_onnx.rewrite.pipeline import optimize, plan_model
    from ho_onnx.schedule.options import OffloadOptions
    from models.moe_contrib import build_contrib_moe, router_outputs

    src = build_contrib_moe(root / "src" / "moe.onnx", quant=quant, layers=cfg["layers"],
                            hidden=cfg["hidden"], moe_ffn=cfg["moe_ffn"],
                            experts=cfg["experts"], top_k=cfg["top_k"], vocab=cfg["vocab"])
    routers = router_outputs(src, root / "src" / "probe.onnx")
    probe = ort.InferenceSession(str(root / "src" / "probe.onnx"), session_options(),
                                 providers=["CPUExecutionProvider"])
    ranges = {"seq": (1, cfg["prompt"])}
    peak = plan_model(src, OffloadOptions(budget=1 << 50), {}, dim_ranges=ranges
                      )[2].baseline.peak_bytes
    budget = peak // 2
    configs = {"all streamed": OffloadOptions(activations=False, min_bytes=0, routed=False),
               "routed": OffloadOptions(activations=False, min_bytes=0),
               "routed, budget": OffloadOptions(activations=False, min_bytes=0,
                                                budget=budget)}
    sessions = {"resident": ort.InferenceSession(str(src), session_options(),
                                                 providers=["CPUExecutionProvider"])}
    choices = {}
    for name, opts in configs.items():
        out = root / name.replace(" ", "_").replace(",", "") / "model.onnx"
        out.parent.mkdir()
        choices[name] = optimize(src, out, opts, {}, dim_ranges=ranges).choice
        sessions[name] = ho_onnx.InferenceSession(out, sess_options=session_options())
    return sessions, choices, probe, routers, peak, budget


def contrib_selected(choice: Any, experts: dict[str, str], routers: list[str],
                     chosen: list[set[int]], e: int) -> int:
    """What a step must move: every offloaded weight that is no stacked expert tensor (per
    reader), and of each expert tensor (``experts``: its op's router input) the slices of the
    experts its op selected."""
    return sum(w.nbytes // e * len(chosen[routers.index(experts[w.name])])
               if w.name in experts else w.nbytes
               for w in choice.weights for _ in w.consumers)


def run_contrib(args: argparse.Namespace, cfg: dict[str, int], root: Path) -> dict[str, Any]:
    """``run`` for ``--arch contrib``/``contrib_q`` (module docstring)."""
    import onnxruntime as ort

    import ho_onnx
    from models.moe_contrib import select

    quant = args.arch == "contrib_q"
    sessions, choices, probe, routers, peak, budget = contrib_sessions(cfg, root, quant)
    rows = {k: {"row": k, "moved": [], "selected": [], "step_s": [], "ttft_s": None,
                "equal": True} for k in sessions}
    experts = {w.name: w.gates[0] for w in choices["routed"].weights if w.routes}
    prompt = np.random.default_rng(0).integers(0, cfg["vocab"], cfg["prompt"]).tolist()
    feeds = {"input_ids": np.asarray([prompt], np.int64),
             "past_sum": np.zeros((1, 1, cfg["hidden"]), np.float32)}
    for step in range(cfg["tokens"] + 1):
        outs = probe.run(None, feeds)
        chosen = [select(r, cfg["top_k"], softmax=not quant) for r in outs[2:]]
        for name, sess in sessions.items():
            got, dt = timed_run(sess, feeds)
            row = rows[name]
            row["equal"] &= all(np.array_equal(a, b) for a, b in zip(got, outs, strict=False))
            if step == 0:
                row["ttft_s"] = dt
                continue
            row["step_s"].append(dt)
            row["moved"].append(ho_onnx.counters()["bytes_loaded"])
            row["selected"].append(contrib_selected(choices[name], experts, routers, chosen,
                                                    cfg["experts"]) if name in choices else 0)
        feeds = {"input_ids": np.asarray([[int(np.argmax(outs[0][0, -1]))]], np.int64),
                 "past_sum": outs[1]}
    for row in rows.values():
        summarise(row)
    return {"arch": args.arch, "config": cfg, "rows": list(rows.values()), "complete": True,
            "resident_peak": peak, "budget": budget, "onnxruntime": ort.__version__}


CUDA_EP = "CUDAExecutionProvider"
PARTITION_KEY = "session.resource_cuda_partitioning_settings"
PARTITION_ROW = "ort partition, 1/4 experts"  # the peer: ORT's capacity-aware partitioning


def graph_model(args: argparse.Namespace, cfg: dict[str, int], root: Path) -> Path:
    """The model to measure: ``--graph DIR`` (a graph carried without its weights,
    ``models.regrow``: its data file regrown here when absent), else a fresh export."""
    if not args.graph:
        return export(cfg, root, args.arch)
    from ho_onnx.graph.load import data_files
    from models.regrow import regrow

    src = Path(args.graph) / "model.onnx"
    if not src.is_file():
        raise SystemExit(f"moe_decode: --graph {args.graph}: no model.onnx there")
    if any(not p.is_file() for p in data_files(src)):
        t0 = time.perf_counter()
        regrow(src)
        print(f"regrew the weights of {src} in {time.perf_counter() - t0:.0f} s", flush=True)
    return src


def cuda_options() -> Any:
    """ORT's optimizations off on CUDA too: the rows run the same kernels (bit-exact)."""
    import onnxruntime as ort

    from ho_onnx.contract import CONFIG_SAMPLE_ARENA

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.add_session_config_entry(CONFIG_SAMPLE_ARENA, "1")
    # (the CPU EP's pre-packed constants are another kernel path than an offloaded weight's:
    # off, so the CPU nodes of every row run the same kernels too)
    so.add_session_config_entry("session.disable_prepacking", "1")
    return so


def hf_accelerate(cfg: dict[str, int], prompt: list[int], tokens: int) -> dict[str, Any]:
    """The same architecture in transformers (random weights: its tokens are not comparable)
    under ``accelerate.cpu_offload``: TTFT and decode tokens/s."""
    import torch
    import transformers as tf
    from accelerate import cpu_offload

    conf = tf.Qwen3MoeConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
        intermediate_size=2 * cfg["hidden"], moe_intermediate_size=cfg["moe_ffn"],
        head_dim=cfg["hidden"] // cfg["heads"], num_experts=cfg["experts"],
        num_experts_per_tok=cfg["top_k"], max_position_embeddings=512)
    with torch.device("meta"):
        model = tf.Qwen3MoeForCausalLM(conf)
    model = model.to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.ones_(p) if p.dim() == 1 else torch.nn.init.normal_(p, std=0.02)
    model.model.rotary_emb = type(model.model.rotary_emb)(conf)
    cpu_offload(model.eval(), execution_device=torch.device("cuda:0"))
    sys.path.insert(0, str(ROOT / "bench"))
    from llm_generate import HfGenerator

    gen = HfGenerator(model, "cuda", offloaded=False)
    ids = np.asarray([prompt], np.int64)
    gen.generate(ids, len(prompt), 2)  # warm-up
    r = gen.generate(ids, len(prompt), tokens)
    return {"row": "hf + accelerate cpu_offload", "ttft_s": r["ttft_s"],
            "tok_s": tokens / r["decode_s"], "transformers": tf.__version__,
            "torch_max_allocated": torch.cuda.max_memory_allocated()}


class Weight(NamedTuple):
    """What ``selected_bytes`` reads of an offloaded weight (a manifest's row)."""

    name: str
    nbytes: int
    consumers: tuple[int, ...]  # (reader positions: selected_bytes counts them)


def prepare_cuda(src: Path, cfg: dict[str, int], out_dir: Path, machine: str) -> dict[str, Any]:
    """Plan and write the optimized models of the ``--device cuda`` rows into ``out_dir``
    (beside ``src``'s data when ``out_dir`` is its folder: they share it), each as
    ``<row>.onnx``; returns the manifest (rows: file, offloaded weights, predicted peak and
    time; the budget, the resident peak, the experts' bytes, the data file's fingerprint)."""
    from ho_onnx.cost.source import CostSource
    from ho_onnx.graph.fingerprint import data_fingerprint
    from ho_onnx.graph.load import data_files
    from ho_onnx.rewrite.pipeline import optimize, plan_model
    from ho_onnx.schedule.options import OffloadOptions
    from ho_onnx.schedule.planner import InfeasibleBudgetError

    dims, ranges = step_dims(cfg)
    costs = CostSource(machine=machine)
    _, _, routed = probe(src, dims, None)
    peak = plan_model(src, OffloadOptions(budget=1 << 50), {"batch_size": 1}, costs,
                      dim_ranges=ranges)[2].baseline.peak_bytes
    base = OffloadOptions(activations=False, min_bytes=0)
    rows: dict[str, Any] = {}

    def make(name: str, opts: OffloadOptions) -> Any:
        out = out_dir / (re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") + ".onnx")
        t0 = time.perf_counter()
        r = optimize(src, out, opts, {"batch_size": 1}, costs=costs, dim_ranges=ranges)
        rows[name] = {"file": out.name,
                      "weights": [[w.name, w.nbytes, list(w.consumers)] for w in r.choice.weights],
                      "peak": r.plan.planned.peak_bytes if r.plan else None,
                      "pred_s": r.plan.planned.total_s if r.plan else None}
        print(f"  {name}: optimized in {time.perf_counter() - t0:.0f} s", flush=True)
        return r.choice

    make("all streamed", replace(base, routed=False))
    choice = make("routed", base)
    experts = sum(w.nbytes for w in choice.weights if w.name in routed.expert_of)
    try:  # what holds a quarter of the experts resident (or the planner's floor, if above)
        budget = peak - experts * 3 // 4
        plan_model(src, replace(base, budget=budget), {"batch_size": 1}, costs,
                   dim_ranges=ranges)
    except InfeasibleBudgetError as e:
        budget = e.min_budget
    make("all streamed, 1/4 experts", replace(base, routed=False, budget=budget))
    make("routed, 1/4 experts", replace(base, budget=budget))
    make("CPU experts, 1/4 experts", replace(base, budget=budget, cpu_experts="auto"))
    make("routed + CPU experts", replace(base, cpu_experts="all"))
    return {"rows": rows, "budget": budget, "resident_peak": peak, "expert_bytes": experts,
            "machine": machine, "fingerprints": {
                str(p.relative_to(src.parent)): data_fingerprint(p)
                for p in sorted(data_files(src))}}


def prepared(src: Path) -> dict[str, Any] | None:
    """The manifest written beside ``src`` by ``--strip-to``, when its data files are the
    ones it was made with (the weights regrew to the same bytes); else None."""
    from ho_onnx.graph.fingerprint import data_fingerprint

    path = src.parent / "manifest.json"
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    for name, fp in doc["fingerprints"].items():
        if data_fingerprint(src.parent / name) != fp:
            print(f"{name} regrew to other bytes than the manifest's: optimizing here",
                  flush=True)
            return None
    return doc


def run_cuda(args: argparse.Namespace, cfg: dict[str, int], root: Path) -> dict[str, Any]:
    """``--device cuda``: every row on the CUDA EP, at a budget that holds a quarter of the
    experts (the issue's goal) and with everything offloaded; ORT's capacity-aware
    partitioning at that budget; transformers + accelerate (``--hf``). The rows' models
    come from ``--graph``'s manifest (optimized where the graph was stripped) or are
    optimized here."""
    import types

    import onnxruntime as ort

    import ho_onnx
    from ho_onnx.target.ort.generate import _empty_past, kv_layout

    if CUDA_EP not in ort.get_available_providers():
        raise SystemExit(f"moe_decode: onnxruntime {ort.__version__} has no {CUDA_EP}")
    providers = [(CUDA_EP, {"device_id": 0, "arena_extend_strategy": "kSameAsRequested"})]
    src = graph_model(args, cfg, root)
    dims, _ = step_dims(cfg)
    prb, routers, routed = probe(src, dims, src.parent / "probe.onnx")
    lay = kv_layout(src)
    pre = prepared(src) if args.graph else None
    man = pre or prepare_cuda(src, cfg, src.parent, args.machine)
    wanted = [r.strip() for r in args.rows.split(";")] if args.rows else list(man["rows"])
    unknown = [r for r in wanted if r not in man["rows"]]
    if unknown:
        raise SystemExit(f"moe_decode: --rows {unknown}: not rows of this bench "
                         f"({', '.join(man['rows'])})")
    where = src.parent
    budget = man["budget"]
    sessions: dict[str, Any] = {}
    choices: dict[str, Any] = {}
    plans: dict[str, dict[str, Any]] = {}
    sessions["resident"] = ort.InferenceSession(str(prb), cuda_options(), providers=providers)
    for name in wanted:
        r = man["rows"][name]
        t0 = time.perf_counter()
        c0 = ho_onnx.counters()
        sessions[name] = ho_onnx.InferenceSession(where / r["file"], providers=providers,
                                                  sess_options=cuda_options())
        c1 = ho_onnx.counters()
        choices[name] = types.SimpleNamespace(
            weights=[Weight(w, n, tuple(c)) for w, n, c in r["weights"]])
        # where the session's creation went: the library's kernels, their weight loads
        created = {"create_s": time.perf_counter() - t0,
                   "kernel_create_s": (c1["kernel_create_ns"] - c0["kernel_create_ns"]) / 1e9,
                   "weight_load_s": (c1["weight_load_ns"] - c0["weight_load_ns"]) / 1e9,
                   "pinned_bytes": c1["pinned_bytes"] - c0["pinned_bytes"]}
        plans[name] = {"peak": r["peak"], "pred_s": r["pred_s"]} | created
        print(f"  {name}: session in {created['create_s']:.1f} s (library kernels "
              f"{created['kernel_create_s']:.1f} s, of which weight loads "
              f"{created['weight_load_s']:.1f} s; pinned +{created['pinned_bytes'] / 2**20:.0f} "
              "MiB)", flush=True)
    print(f"rows (step times in this order): resident, {', '.join(wanted)}, "
          "ort partition", flush=True)
    so = cuda_options()
    so.add_session_config_entry(PARTITION_KEY, f"{max(1, budget >> 10)},")
    sessions[PARTITION_ROW] = ort.InferenceSession(str(src), so, providers=providers)
    for name, sess in sessions.items():
        if sess.get_providers()[0] != CUDA_EP:
            raise SystemExit(f"moe_decode: {name} runs on {sess.get_providers()}: refused")
    n_out = len(sessions["resident"].get_outputs())
    names = [o.name for o in sessions["resident"].get_outputs()]
    prompt = np.random.default_rng(0).integers(0, cfg["vocab"], cfg["prompt"]).tolist()
    rows: dict[str, dict[str, Any]] = {
        k: {"row": k, "moved": [], "selected": [], "step_s": [], "arena": None,
            "ttft_s": None, "equal": True, "same_tokens": True, "max_abs_diff": 0.0,
            "ops_cuda": 0, "ops_cpu": 0, "host_matmuls": []}
        | plans.get(k, {"peak": None, "pred_s": None}) for k in sessions}
    past = {p: _empty_past(lay, p, 1) for p, _ in lay.pairs}
    tokens = list(prompt)
    for sess in sessions.values():  # warm-up: kernels, handles, arenas (TTFT is a warm one)
        sess.run(None, decode_feeds(lay, tokens, past))
    for step in range(cfg["tokens"] + 1):
        feeds = decode_feeds(lay, tokens, past)
        outs = None
        took = []
        for name, sess in sessions.items():
            got, dt = timed_run(sess, feeds)
            took.append(f"{dt * 1e3:.1f}")
            c = ho_onnx.counters()
            if outs is None:  # the resident row: the reference and the router's choice
                outs = got
                chosen = {r: set(v.reshape(-1).tolist())
                          for r, v in zip(routers, outs[n_out - len(routers):], strict=True)}
            row = rows[name]
            row["equal"] &= bool(np.array_equal(got[0], outs[0]))
            row["same_tokens"] &= bool(got[0][0, -1].argmax() == outs[0][0, -1].argmax())
            row["max_abs_diff"] = max(row["max_abs_diff"],
                                      float(np.abs(got[0] - outs[0]).max()))
            row["ops_cuda"] += c["ops_cuda"]
            row["ops_cpu"] += c["ops_cpu"]
            if step == 0:
                row["ttft_s"] = dt
                continue
            row["step_s"].append(dt)
            row["moved"].append(c["bytes_loaded"])
            row["host_matmuls"].append(c["host_matmuls"])
            row["selected"].append(selected_bytes(choices[name], routed, chosen)
                                   if name in choices else 0)
            if name in choices and c["waits"]:
                row["arena"] = max(row["arena"] or 0, c["ort_arena_max_in_use"])
        past = {p: outs[names.index(q)] for p, q in lay.pairs}
        tokens = [int(np.argmax(outs[0][0, -1]))]
        print(f"  step {step} ms: {' '.join(took)}", flush=True)
    # (the counter of the provider the rows must run their cache ops on: the CPU EP's only
    # where a test stands it in for CUDA)
    on_device = "ops_cuda" if CUDA_EP == "CUDAExecutionProvider" else "ops_cpu"
    for name, row in rows.items():
        # bit-exact where the kernels are the same; the experts computed on the host (other
        # kernels) must give the same greedy tokens; an ho row's cache ops ran on the device
        # (ORT's partitioning, a peer, runs the overflow on the CPU EP's kernels: its tokens)
        row["ok"] = row["same_tokens"] and (
            row["equal"] or any(row["host_matmuls"]) or name == PARTITION_ROW) and (
            name not in choices or row[on_device] > 0)
        summarise(row)
    doc = {"arch": args.arch, "device": "cuda", "config": cfg, "rows": list(rows.values()),
           "complete": True, "resident_peak": man["resident_peak"], "budget": budget,
           "expert_bytes": man["expert_bytes"], "machine": man["machine"],
           "prepared": pre is not None,
           "onnxruntime": ort.__version__}
    doc["prompt"] = prompt
    return doc


def timed_run(sess: Any, feeds: dict[str, Any]) -> tuple[list[Any], float]:
    """One run with the library's counters reset first: its outputs and seconds."""
    import ho_onnx

    ho_onnx.reset_counters()
    t = time.perf_counter()
    got = sess.run(None, feeds)
    return got, time.perf_counter() - t


def summarise(row: dict[str, Any]) -> None:
    """Per-token means of a row's steps (in place)."""
    moved, sel = sum(row["moved"]), sum(row["selected"])
    row |= {"moved_per_token": moved / max(len(row["moved"]), 1),
            "selected_per_token": sel / max(len(row["selected"]), 1),
            "ratio": moved / sel if sel else None,
            "tok_s": 1 / statistics.median(row["step_s"]),
            "host_matmuls_per_token": statistics.mean(row.pop("host_matmuls", None) or [0])}
    hits, misses = row.pop("hits", 0), row.pop("misses", 0)
    row["hit_rate"] = hits / (hits + misses) if hits + misses else None
    del row["step_s"]


def print_table(doc: dict[str, Any]) -> None:
    cfg = doc["config"]
    name = {"qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE", "mixtral": "Mixtral",
            "contrib": "ORT MoE contrib op", "contrib_q": "ORT QMoE (8-bit) contrib op"}
    print(f"\n{name[doc.get('arch', 'qwen3_moe')]} {cfg['layers']} layers, {cfg['experts']} "
          f"experts top-{cfg['top_k']}, "
          f"hidden {cfg['hidden']}, expert width {cfg['moe_ffn']}; prompt {cfg['prompt']}, "
          f"{cfg['tokens']} decode steps")
    head = (f"{'row':<35}{'moved KiB/tok':>14}{'selected KiB/tok':>17}{'moved/sel':>10}"
            f"{'host MM/tok':>12}{'floor KiB':>10}{'peak KiB':>10}{'arena KiB':>10}"
            f"{'cache KiB':>10}{'hit rate':>9}{'spec':>9}{'tok/s':>8}{'TTFT ms':>9}  logits")
    print(head + "\n" + "-" * len(head))
    for r in doc["rows"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        sel = "-" if r["row"] == "resident" else f"{r['selected_per_token'] / 1024:.1f}"
        kib = {k: "-" if r.get(k) is None or r[k] < 0 else f"{r[k] / 1024:.0f}"
               for k in ("floor", "peak", "arena")}
        hit = "-" if r.get("hit_rate") is None else f"{r['hit_rate']:.0%}"
        cache = f"{r.get('expert_cache', 0) / 1024:.0f}" if r.get("expert_cache") else "-"
        spec = f"{r['warm_hits']}/{r['warm_reads']}" if r.get("warm_reads") else "-"
        print(f"{r['row']:<35}{r['moved_per_token'] / 1024:>14.1f}{sel:>17}{ratio:>10}"
              f"{r.get('host_matmuls_per_token', 0):>12.1f}{kib['floor']:>10}{kib['peak']:>10}"
              f"{kib['arena']:>10}{cache:>10}{hit:>9}{spec:>9}{r['tok_s']:>8.1f}"
              f"{r['ttft_s'] * 1e3:>9.1f}  {'= resident' if r['equal'] else 'MISMATCH'}")
    print("moved = bytes the library loaded per decode step (its counters; the rows on the "
          "disk tier: bytes read from the data file); selected = the bytes of the experts "
          "the router chose that step (its TopK indices) plus the offloaded weights that are "
          "not experts, and with an expert cache less the experts an LRU simulation of its "
          "capacity over the router's choices held; host MM = HostMatMul calls (experts "
          "computed on the host); floor = the smallest budget the planner meets with the "
          "row's options; peak = the plan's predicted peak (resident: the unmodified model's); "
          "arena = ORT's arena high-water mark, measured (sampled at each Wait, "
          "ho_onnx.sample_arena); hit rate = the library's cache hits / (hits + misses); "
          "spec = speculative reads a routed load then asked for / speculative reads "
          "(decode steps; their bytes are in moved and, replayed, in selected); "
          "logits compared bit for bit (ORT's optimizations off).")


def print_cuda_table(doc: dict[str, Any]) -> None:
    cfg = doc["config"]
    print(f"\nQwen3-MoE on CUDA: {cfg['layers']} layers, {cfg['experts']} experts top-"
          f"{cfg['top_k']}, hidden {cfg['hidden']}, expert width {cfg['moe_ffn']} (experts "
          f"{doc['expert_bytes'] / 2**30:.2f} GiB of a {doc['resident_peak'] / 2**30:.2f} GiB "
          f"resident peak); budget '1/4 experts' {doc['budget'] / 2**30:.2f} GiB; prompt "
          f"{cfg['prompt']}, {cfg['tokens']} decode steps")
    head = (f"{'row':<28}{'moved MiB/tok':>14}{'sel MiB/tok':>12}{'moved/sel':>10}"
            f"{'host MM':>8}{'peak MiB':>9}{'arena MiB':>10}{'tok/s':>8}{'x streamed':>11}"
            f"{'TTFT ms':>9}  logits")
    print(head + "\n" + "-" * len(head))
    streamed = next((r["tok_s"] for r in doc["rows"] if r["row"] == "all streamed, 1/4 experts"),
                    None)
    for r in doc["rows"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        mib = {k: "-" if r.get(k) is None else f"{r[k] / 2**20:.0f}" for k in ("peak", "arena")}
        sel = "-" if r["row"] in ("resident", PARTITION_ROW) else \
            f"{r['selected_per_token'] / 2**20:.1f}"
        xs = f"{r['tok_s'] / streamed:.2f}" if streamed else "-"
        logits = ("= resident" if r["equal"] else
                  f"tokens equal, max |d| {r['max_abs_diff']:.1e}" if r["same_tokens"] else
                  "MISMATCH")
        print(f"{r['row']:<28}{r['moved_per_token'] / 2**20:>14.1f}{sel:>12}{ratio:>10}"
              f"{r['host_matmuls_per_token']:>8.0f}{mib['peak']:>9}{mib['arena']:>10}"
              f"{r['tok_s']:>8.1f}{xs:>11}{r['ttft_s'] * 1e3:>9.1f}  {logits}")
    hf = doc.get("hf")
    if hf:
        print(f"{hf['row']:<28}" + (f"  error: {hf['error']}" if "error" in hf else
              f"{'':>63}{hf['tok_s']:>8.1f}{hf['tok_s'] / streamed if streamed else 0:>11.2f}"
              f"{hf['ttft_s'] * 1e3:>9.1f}  (random weights of its own: tokens not compared)"))
    print("CUDA EP, ORT's optimizations off in every ONNX row (the same kernels: logits bit for "
          "bit); moved = bytes the library loaded per decode step; sel = the offloaded bytes "
          "the router's own TopK chose that step plus the offloaded non-expert weights; "
          "x streamed = tok/s over the 'all streamed, 1/4 experts' row's; arena = ORT's CUDA "
          "arena high-water mark sampled at each Wait.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model (CI)")
    ap.add_argument("--wide", action="store_true",
                    help="experts wider than the lm_head (they set the fast tier's floor)")
    ap.add_argument("--arch", choices=ARCHS + CONTRIB, default="qwen3_moe",
                    help="the architecture (models.moe_export): Qwen3-MoE, Qwen2-MoE (a "
                         "shared expert beside the routed ones) or Mixtral; contrib, "
                         "contrib_q: ORT's MoE / QMoE op (models.moe_contrib)")
    ap.add_argument("--cache-share", type=float, default=0.5,
                    help="the 'routed + cache, disk' row's expert cache, as a share of the "
                         "experts' bytes (default 0.5)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the rows of the GPU goal (module docstring), Qwen3-MoE, preset "
                         "'gpu' unless --quick")
    ap.add_argument("--graph", default=None, metavar="DIR",
                    help="measure DIR/model.onnx, a graph carried without its weights "
                         "(--strip-to; the weights regrown here from a seed, models.regrow) "
                         "instead of exporting one (a GPU machine has no Optimum)")
    ap.add_argument("--strip-to", default=None, metavar="DIR",
                    help="export the model of --device's preset, write its graph without the "
                         "weights to DIR (for --graph on another machine; with --device cuda "
                         "also the rows' optimized models, planned for --machine, and "
                         "manifest.json) and stop")
    ap.add_argument("--keep-bytes", type=int, default=1 << 20,
                    help="--strip-to: tensors below this travel inside the graph, verbatim "
                         "(default 1 MiB: norms, routers, rotary tables)")
    ap.add_argument("--machine", default="h100",
                    help="--device cuda: the planner's machine (a preset or a calibrated "
                         "machine.json)")
    ap.add_argument("--hf", action="store_true",
                    help="--device cuda: also transformers' Qwen3-MoE under accelerate's "
                         "cpu_offload")
    ap.add_argument("--rows", default=None,
                    help="--device cuda: the ONNX rows to run besides resident and ORT's "
                         "partitioning, separated by semicolons (default: all; each session takes "
                         "long to create on a GPU machine, see docs/benchmarks.md)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="keep the models here (default: a temporary folder)")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if args.arch in CONTRIB and cuda:
        ap.error("--device cuda measures the Qwen3-MoE export (contrib routing moves whole "
                 "tensors on CUDA)")
    cfg = PRESETS["quick" if args.quick else "gpu" if cuda else "wide" if args.wide else "cpu"]
    if args.strip_to:
        from models.regrow import regrow, strip

        out = Path(args.strip_to)
        with tempfile.TemporaryDirectory(prefix="moe_decode_") as tmp:
            src = strip(export(cfg, Path(tmp), args.arch), out, args.keep_bytes)
        data = regrow(src)  # (the bytes the other machine regrows: the rows are made for them)
        if cuda:
            man = prepare_cuda(src, cfg, out, args.machine)
            (out / "manifest.json").write_text(json.dumps(man, indent=1) + "\n")
        for d in data:
            d.unlink()
        print(f"{out}: {sum(f.stat().st_size for f in out.iterdir()) / 2**20:.1f} MiB")
        return 0
    with tempfile.TemporaryDirectory(prefix="moe_decode_", dir=args.workdir) as tmp:
        doc = (run_cuda if cuda else run_contrib if args.arch in CONTRIB else run)(
            args, cfg, Path(tmp))
    (print_cuda_table if cuda else print_table)(doc)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    if cuda and args.hf:  # (after the table and the JSON: a bound that stops it loses only it)
        try:
            doc["hf"] = hf_accelerate(cfg, doc["prompt"], cfg["tokens"])
        except Exception as e:  # (a peer's failure is reported, not fatal)
            doc["hf"] = {"row": "hf + accelerate cpu_offload", "error": f"{type(e).__name__}: {e}"}
        print_cuda_table(doc)
        if args.json:
            args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if all(r.get("ok", r["equal"]) for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
