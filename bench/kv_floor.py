"""The smallest feasible budget against the context length, with and without the KV cache in
host memory (issue 36, goal 1): planning only, no weight byte is read and nothing runs.

Two export layouts of the same kind of decoder (8 layers by default):

* ``optimum``  ``models.decoder`` with Optimum's cache layout (``present = Concat(past, new)``);
* ``genai``    the onnxruntime-genai builder's export of a random-weight Llama
  (``GroupQueryAttention`` with past/present; needs the ``genai`` extra, else skipped).

For each context (the past length of one decode step) the planner's smallest feasible budget
(``InfeasibleBudgetError.min_budget`` of a 1-byte budget) without and with
``OffloadOptions(kv=True)``, and one layer's context-dependent working set (its past and
present K and V, its attention scores and probabilities). Goal: from the first to the last
context the floor with the cache in host memory grows by at most one layer's working set;
without it, it grows by every layer's cache.

    python bench/kv_floor.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONTEXTS = (2048, 4096, 8192, 16384, 32768)
MIB = 1 << 20


def floor(src: Path, dims: dict[str, int], kv: bool) -> int:
    from ho_onnx.rewrite.pipeline import plan_model
    from ho_onnx.schedule.options import OffloadOptions
    from ho_onnx.schedule.planner import InfeasibleBudgetError

    try:
        plan_model(src, OffloadOptions(kv=kv, budget=1), dims)
    except InfeasibleBudgetError as e:
        return e.min_budget
    raise AssertionError("a 1-byte budget was met")


def layouts(root: Path, layers: int, hidden: int, heads: int, kv_heads: int
            ) -> dict[str, tuple[Path | None, str, Any]]:
    """Each layout's model (None: skipped, with the reason) and how to bind a decode step."""
    from models.decoder import build_decoder

    out: dict[str, tuple[Path | None, str, Any]] = {}
    dec = root / "optimum" / "model.onnx"
    dec.parent.mkdir()
    build_decoder(dec, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                  max_positions=max(CONTEXTS) + 1, kv_cache=True, cache_layout="optimum",
                  external_data=True)
    out["optimum"] = (dec, "", lambda c: {"batch": 1, "seq": 1, "past": c})
    try:
        from models.genai_export import build_hf_llama, export_genai

        hf = build_hf_llama(root / "hf", layers=layers, hidden=hidden, heads=heads,
                            kv_heads=kv_heads, max_positions=max(CONTEXTS) + 1)
        genai = export_genai(hf, root / "genai", "fp32") / "model.onnx"
        out["genai"] = (genai, "", lambda c: {
            "batch_size": 1, "sequence_length": 1, "past_sequence_length": c,
            "total_sequence_length": c + 1, "kv_cache_dim": hidden // heads})
    except ImportError as e:
        out["genai"] = (None, f"skipped: {e}", None)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    head_dim = args.hidden // args.heads
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kv_floor_") as tmp:
        for name, (src, why, dims_of) in layouts(Path(tmp), args.layers, args.hidden,
                                                  args.heads, args.kv_heads).items():
            if src is None:
                rows.append({"layout": name, "skipped": why})
                continue
            for c in CONTEXTS:
                # one layer's context-dependent working set: its past + present, K and V,
                # and its attention scores and probabilities over them (fp32)
                layer = (2 * 4 * args.kv_heads * head_dim * (2 * c + 1)
                         + 2 * 4 * args.heads * (c + 1))
                dims = dims_of(c)
                rows.append({"layout": name, "context": c, "floor": floor(src, dims, False),
                             "floor_kv": floor(src, dims, True), "layer_kv": layer})
                print(f"{name} {c}: {rows[-1]['floor'] / MIB:.1f} -> "
                      f"{rows[-1]['floor_kv'] / MIB:.1f} MiB", flush=True)
    print(f"\n{'layout':<9}{'context':>9}{'floor MiB':>11}{'with KV in host MiB':>21}"
          f"{'one layer KV MiB':>18}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['layout']:<9} {r['skipped']}")
            continue
        print(f"{r['layout']:<9}{r['context']:>9,}{r['floor'] / MIB:>11.1f}"
              f"{r['floor_kv'] / MIB:>21.1f}{r['layer_kv'] / MIB:>18.1f}")
    ok = True
    for name in {r["layout"] for r in rows if "skipped" not in r}:
        rs = [r for r in rows if r["layout"] == name and "skipped" not in r]
        grow, grow_kv = rs[-1]["floor"] - rs[0]["floor"], rs[-1]["floor_kv"] - rs[0]["floor_kv"]
        layer_grow = rs[-1]["layer_kv"] - rs[0]["layer_kv"]
        met = grow_kv <= layer_grow
        ok &= met
        print(f"{name}: from {rs[0]['context']:,} to {rs[-1]['context']:,} the floor grows "
              f"{grow / MIB:.1f} MiB without, {grow_kv / MIB:.1f} MiB with the cache in host "
              f"memory (one layer's working set grows {layer_grow / MIB:.1f} MiB): "
              f"{'goal met' if met else 'GOAL MISSED'}")
    if args.json:
        args.json.write_text(json.dumps({"config": vars(args) | {"json": str(args.json)},
                                         "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
