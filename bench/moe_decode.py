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

Each decode step feeds every row the same inputs (the resident row's greedy tokens, teacher
forced), so each row's logits are compared with the resident row's (bit-exact at ORT's
optimizations off) and its bytes with the router's own choice: a copy of the unmodified
model with every router's TopK indices as extra outputs says which experts each step
selected; ``selected`` is their weights' bytes plus the bytes of the offloaded weights that
are not experts (moved at every step either way). Goal: ``moved / selected <= 1.1``.

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
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
}


def export(cfg: dict[str, int], root: Path, arch: str) -> Path:
    """The Optimum export of a random-weight ``arch`` decoder of ``cfg``'s dims."""
    from models.moe_export import build_hf_moe, export_moe

    hf = build_hf_moe(root / "hf", arch, positions=512,
                      **{k: v for k, v in cfg.items() if k not in ("prompt", "tokens")})
    return export_moe(hf, root / "onnx", arch)


def probe(src: Path, dims: dict[str, int], out: Path) -> tuple[Path, list[str], Any]:
    """A copy of ``src`` with each router's TopK indices as extra outputs; the routers' TopK
    node names in that order; the model's routed reloads (``Routed``: each expert weight's
    router and column)."""
    import onnx
    from onnx import helper

    from ho_onnx.graph.analyse import analyse
    from ho_onnx.graph.moe import find_experts
    from ho_onnx.schedule.eligibility import Routed

    a = analyse(onnx.load(str(src), load_external_data=False), dims)
    layers = find_experts(a)
    model = onnx.load(str(src))
    names = [next(n for n in a.nodes if n.name == layer.node).outputs[1].name
             for layer in layers]
    model.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.INT64, None)
                              for n in names)
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

    try:
        plan_model(src, replace(opts, budget=1), {"batch_size": 1}, dim_ranges=ranges)
    except InfeasibleBudgetError as e:
        return e.min_budget
    return 1


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
    from ho_onnx.schedule.options import OffloadOptions
    from ho_onnx.target.ort.generate import _empty_past, kv_layout

    t0 = time.perf_counter()
    src = export(cfg, root, args.arch)
    print(f"exported {src} in {time.perf_counter() - t0:.0f} s", flush=True)
    dims = {"batch_size": 1, "sequence_length": 1,
            "past_sequence_length": cfg["prompt"] + cfg["tokens"]}
    ranges = {"sequence_length": (1, cfg["prompt"]),
              "past_sequence_length": (0, cfg["prompt"] + cfg["tokens"])}
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
    sessions: dict[str, Any] = {"resident": ort.InferenceSession(
        str(src), session_options(), providers=["CPUExecutionProvider"])}
    choices: dict[str, Any] = {}
    plans: dict[str, dict[str, Any]] = {}
    for name, opts in configs.items():
        out = root / name.replace(" ", "_").replace(",", "").replace("%", "") / "model.onnx"
        out.parent.mkdir()
        r = optimize(src, out, opts, {"batch_size": 1}, dim_ranges=ranges)
        choices[name] = r.choice
        plans[name] = {"floor": floor(src, opts, ranges),
                       "peak": r.plan.planned.peak_bytes if r.plan else None}
        sessions[name] = ho_onnx.InferenceSession(out, sess_options=session_options(True))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg["vocab"], cfg["prompt"]).tolist()
    rows: dict[str, dict[str, Any]] = {k: {"row": k, "moved": [], "selected": [], "step_s": [],
                                           "host_matmuls": [], "arena": None, "ttft_s": None,
                                           "equal": True}
                                       | plans.get(k, {"floor": None, "peak": peak})
                                       for k in sessions}
    past = {p: _empty_past(lay, p, 1) for p, _ in lay.pairs}
    tokens = list(prompt)
    for step in range(cfg["tokens"] + 1):
        feeds = decode_feeds(lay, tokens, past)
        outs = ref.run(None, feeds)
        chosen = {r: set(v.reshape(-1).tolist())
                  for r, v in zip(routers, outs[n_out - len(routers):], strict=True)}
        for name, sess in sessions.items():
            ho_onnx.reset_counters()
            t = time.perf_counter()
            got = sess.run(None, feeds)
            dt = time.perf_counter() - t
            row = rows[name]
            row["equal"] &= bool(np.array_equal(got[0], outs[0]))
            if step == 0:
                row["ttft_s"] = dt
            else:
                row["step_s"].append(dt)
                row["moved"].append(ho_onnx.counters()["bytes_loaded"])
                row["host_matmuls"].append(ho_onnx.counters()["host_matmuls"])
                c = ho_onnx.counters()
                if name in choices and c["waits"]:  # (no Wait: nothing sampled this run)
                    row["arena"] = max(row["arena"] or 0, c["ort_arena_max_in_use"])
                row["selected"].append(selected_bytes(choices[name], routed, chosen)
                                       if name in choices else 0)
        names = [o.name for o in ref.get_outputs()]
        past = {p: outs[names.index(q)] for p, q in lay.pairs}
        tokens = [int(np.argmax(outs[0][0, -1]))]
    for row in rows.values():
        summarise(row)
    return {"arch": args.arch, "config": cfg, "rows": list(rows.values()), "complete": True,
            "resident_peak": peak, "budget": budget,
            "onnxruntime": ort.__version__}


CONTRIB = ("contrib", "contrib_q")


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
            ho_onnx.reset_counters()
            t = time.perf_counter()
            got = sess.run(None, feeds)
            dt = time.perf_counter() - t
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


def summarise(row: dict[str, Any]) -> None:
    """Per-token means of a row's steps (in place)."""
    moved, sel = sum(row["moved"]), sum(row["selected"])
    row |= {"moved_per_token": moved / max(len(row["moved"]), 1),
            "selected_per_token": sel / max(len(row["selected"]), 1),
            "ratio": moved / sel if sel else None,
            "tok_s": 1 / statistics.median(row["step_s"]),
            "host_matmuls_per_token": statistics.mean(row.pop("host_matmuls", None) or [0])}
    del row["step_s"]


def print_table(doc: dict[str, Any]) -> None:
    cfg = doc["config"]
    name = {"qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE", "mixtral": "Mixtral",
            "contrib": "ORT MoE contrib op", "contrib_q": "ORT QMoE (8-bit) contrib op"}
    print(f"\n{name[doc.get('arch', 'qwen3_moe')]} {cfg['layers']} layers, {cfg['experts']} "
          f"experts top-{cfg['top_k']}, "
          f"hidden {cfg['hidden']}, expert width {cfg['moe_ffn']}; prompt {cfg['prompt']}, "
          f"{cfg['tokens']} decode steps")
    head = (f"{'row':<22}{'moved KiB/tok':>15}{'selected KiB/tok':>18}{'moved/selected':>16}"
            f"{'host MM/tok':>12}{'floor KiB':>11}{'peak KiB':>10}{'arena KiB':>11}{'tok/s':>9}"
            f"{'TTFT ms':>9}"
            "  logits")
    print(head + "\n" + "-" * len(head))
    for r in doc["rows"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        sel = "-" if r["row"] == "resident" else f"{r['selected_per_token'] / 1024:.1f}"
        kib = {k: "-" if r.get(k) is None or r[k] < 0 else f"{r[k] / 1024:.0f}"
               for k in ("floor", "peak", "arena")}
        print(f"{r['row']:<22}{r['moved_per_token'] / 1024:>15.1f}{sel:>18}{ratio:>16}"
              f"{r.get('host_matmuls_per_token', 0):>12.1f}{kib['floor']:>11}{kib['peak']:>10}"
              f"{kib['arena']:>11}"
              f"{r['tok_s']:>9.1f}{r['ttft_s'] * 1e3:>9.1f}  "
              f"{'= resident' if r['equal'] else 'MISMATCH'}")
    print("moved = bytes the library loaded per decode step (its counters); selected = the "
          "bytes of the experts the router chose that step (its TopK indices) plus the "
          "offloaded weights that are not experts; host MM = HostMatMul calls (experts computed "
          "on the host); floor = the smallest budget the planner meets with the row's options; "
          "peak = the plan's predicted peak (resident: the unmodified model's); arena = ORT's "
          "arena high-water mark, measured (sampled at each Wait, ho_onnx.sample_arena); logits "
          "compared bit for bit (ORT's optimizations off).")


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
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    cfg = PRESETS["quick" if args.quick else "wide" if args.wide else "cpu"]
    with tempfile.TemporaryDirectory(prefix="moe_decode_") as tmp:
        doc = (run_contrib if args.arch in CONTRIB else run)(args, cfg, Path(tmp))
    print_table(doc)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(r["equal"] for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
