"""Loop bodies planned per iteration (issue 38, item 4): ORT's arena, bytes moved and time per
run of a Loop whose body walks its weights, unmodified, with the body's weights reloaded once
before the Loop (the explicit policy: one reload per run, all of them resident during the
Loop), and planned per iteration under budgets (each iteration reloads what it reads).

Two models (random weights, seeded; float32; ``--tokens`` rows through ``--layers`` layers
of hidden ``--hidden``, an MLP of 4x that width):

* ``stack``: the layers' weights stacked ([L, H, 4H] and [L, 4H, H]) and read by the loop
  counter (``Gather(W, i)``): per iteration the planner gathers one layer's rows from the
  host store (``GatherRows``), so a run moves the stack once;
* ``whole``: a body that reads ``--layers`` whole weights in turn (the same weight at every
  iteration, ``--trips`` iterations): per iteration each is reloaded (Prefetch/Wait).

Each row runs in a fresh session with its own CPU arena (``cpu_arena="ort"``), pre-packing
off; ``max |diff|`` is the largest difference from the unmodified model's output at ORT's
default optimization level (where ORT's own rewrites of the unmodified graph can differ),
``exact`` whether they are bit-exact with graph optimizations off (the same kernels on the
same bytes, so they must be); a Fence on the output samples ORT's arena MaxInUse
at the end of each run (``ho_onnx.sample_arena``). ``memory`` is that arena plus the bytes of
the initializers the model still holds (ORT keeps them beside its arena); the budgets are
fractions of the unmodified model's planned peak (weights and activations). Prints a table;
``--json`` writes every number.

    python bench/loop_bodies.py [--layers 8] [--hidden 512] [--tokens 64] [--trips 4]
        [--fractions 0.5,0.25] [--runs 5] [--json out.json]
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

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MIB = 1 << 20


def build(work: Path, kind: str, layers: int, hidden: int, tokens: int) -> Path:
    """The ``stack`` or ``whole`` model, its weights in an external data file."""
    import numpy as np
    import onnx
    import onnx.parser
    from onnx import numpy_helper

    h, f, t = hidden, 4 * hidden, tokens
    if kind == "stack":
        body = """
      a = Gather<axis = 0>(A, i)
      b = Gather<axis = 0>(B, i)
      u = MatMul(s, a)
      r = Relu(u)
      v = MatMul(r, b)
      s2 = Add(s, v)"""
        trips, shapes = f"n = Constant<value = int64 {{{layers}}}>()", {
            "A": (layers, h, f), "B": (layers, f, h)}
    else:
        steps = [f"      u{k} = MatMul({'s' if k == 0 else f'r{k - 1}'}, W{k})\n"
                 f"      r{k} = Tanh(u{k})" for k in range(layers)]
        body = "\n" + "\n".join(steps) + f"\n      s2 = Add(s, r{layers - 1})"
        trips, shapes = "", {f"W{k}": (h, h) for k in range(layers)}
    n_input = "" if kind == "stack" else ", int64 n"
    text = f"""<ir_version: 9, opset_import: ["" : 17]>
g (float[{t}, {h}] x{n_input}) => (float[{t}, {h}] y) {{
  {trips}
  c = Constant<value = bool {{1}}>()
  y = Loop(n, c, x) <body = body (int64 i, bool ci, float[{t}, {h}] s) => (bool co,
                                                                      float[{t}, {h}] s2) {{
      co = Identity(ci){body}
  }}>
}}"""
    m = onnx.parser.parse_model(text)
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        scale = 1.0 / np.sqrt(shape[-2])
        m.graph.initializer.append(numpy_helper.from_array(
            (rng.standard_normal(shape) * scale).astype(np.float32), name))
    onnx.checker.check_model(m)
    path = work / kind / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(m, str(path), save_as_external_data=True, location="model.onnx.data",
              size_threshold=1024)
    return path


def with_fence(path: Path, out: Path) -> Path:
    """A copy of ``path`` whose output passes through a Fence (it samples ORT's arena)."""
    import onnx
    from onnx import helper

    from ho_onnx import contract

    m = onnx.load(str(path), load_external_data=False)
    y = m.graph.output[0]
    m.graph.node.append(helper.make_node(contract.FENCE, [y.name + "_pre"], [y.name],
                                         domain=contract.DOMAIN))
    for node in m.graph.node[:-1]:
        node.output[:] = [y.name + "_pre" if o == y.name else o for o in node.output]
    if not any(o.domain == contract.DOMAIN for o in m.opset_import):
        m.opset_import.append(helper.make_opsetid(contract.DOMAIN, contract.OPSET_VERSION))
    onnx.save(m, str(out))
    return out


def initializer_bytes(path: Path) -> int:
    """Bytes of the initializers ``path`` holds (read from their shapes, not their data)."""
    import onnx

    from ho_onnx.graph.dtypes import ELEMENT_BITS

    m = onnx.load(str(path), load_external_data=False)
    total = 0
    for t in m.graph.initializer:
        n = 1
        for d in t.dims:
            n *= d
        total += n * ELEMENT_BITS.get(t.data_type, 0) // 8
    return total


def session(path: Path, optimized_graph: bool = True) -> Any:
    """A session of the runtime helper with its own CPU arena, pre-packing off, sampling the
    arena (``optimized_graph``: ORT's default level; else graph optimizations off)."""
    import onnxruntime as ort

    from ho_onnx.contract import CONFIG_SAMPLE_ARENA
    from ho_onnx.target.ort import runtime

    so = ort.SessionOptions()
    so.add_session_config_entry(CONFIG_SAMPLE_ARENA, "1")
    so.add_session_config_entry("session.disable_prepacking", "1")
    if not optimized_graph:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return runtime.InferenceSession(str(path), sess_options=so, cpu_arena="ort",
                                    providers=["CPUExecutionProvider"])


def measure(path: Path, feeds: dict[str, Any], runs: int) -> dict[str, Any]:
    """Median run time, ORT's arena MaxInUse, memory (that and the initializers), bytes
    moved per run, the output (and the output with graph optimizations off)."""
    from ho_onnx.target.ort import runtime

    plain = session(path, optimized_graph=False).run(None, feeds)[0]
    sess = session(path)
    y = sess.run(None, feeds)[0]  # (warm-up)
    times = []
    for _ in range(runs):
        runtime.reset_counters()
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    c = runtime.counters()
    held = initializer_bytes(path)
    return {"ms": statistics.median(times) * 1e3, "arena_max_in_use": c["ort_arena_max_in_use"],
            "initializer_bytes": held, "memory": c["ort_arena_max_in_use"] + held,
            "bytes_moved": c["bytes_loaded"] + c["bytes_gathered"], "y": y, "plain": plain}


def rows_for(kind: str, src: Path, work: Path, feeds: dict[str, Any], fractions: list[float],
             runs: int) -> list[dict[str, Any]]:
    """The model's rows: unmodified, hoisted, and per iteration at each fraction."""
    import numpy as np

    from ho_onnx import OffloadOptions, optimize

    base = measure(with_fence(src, src.with_name("fenced.onnx")), feeds, runs)
    full = optimize(src, work / kind / "baseline" / "model.onnx",
                    OffloadOptions(budget=1 << 50, activations=False, min_bytes=0))
    peak = full.decision.baseline.peak_bytes
    rows = [dict(model=kind, row="unmodified", budget=None,
                 predicted_peak=peak, predicted_arena=full.decision.arena_bytes, **base)]
    plans: list[tuple[str, int | None, OffloadOptions]] = [
        ("hoisted", None, OffloadOptions(activations=False, min_bytes=0))]
    plans += [(f"per iteration {f:g}", int(peak * f),
               OffloadOptions(budget=int(peak * f), activations=False, min_bytes=0))
              for f in fractions]
    for name, budget, opts in plans:
        out = work / kind / name.replace(" ", "_") / "model.onnx"
        row: dict[str, Any] = {"model": kind, "row": name, "budget": budget}
        try:
            r = optimize(src, out, opts)
        except Exception as e:  # (a budget below the floor: its message is the row)
            rows.append(dict(row, error=str(e).splitlines()[0][:160]))
            continue
        row["predicted_arena"] = getattr(r.decision, "arena_bytes", None)
        row["predicted_peak"] = getattr(getattr(r.decision, "planned", None), "peak_bytes", None)
        row.update(measure(with_fence(out, out.with_name("fenced.onnx")), feeds, runs))
        row["max_abs_diff"] = float(np.abs(row["y"] - base["y"]).max())
        row["bit_exact"] = bool(np.array_equal(row["plain"], base["plain"]))
        rows.append(row)
    for row in rows:
        row.pop("y", None)
        row.pop("plain", None)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--trips", type=int, default=4, help="iterations of the whole model")
    ap.add_argument("--fractions", default="0.5,0.25",
                    help="budgets as fractions of the unmodified model's planned peak")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--workdir")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import numpy as np

    work = Path(a.workdir or tempfile.mkdtemp(prefix="ho_loops_"))
    fractions = [float(f) for f in a.fractions.split(",")]
    x = np.random.default_rng(1).standard_normal((a.tokens, a.hidden)).astype(np.float32)
    rows = []
    for kind in ("stack", "whole"):
        src = build(work, kind, a.layers, a.hidden, a.tokens)
        feeds = {"x": x} if kind == "stack" else {"x": x, "n": np.array(a.trips, np.int64)}
        rows += rows_for(kind, src, work, feeds, fractions, a.runs)
    print(f"{'model':<6} {'row':<18} {'budget MiB':>10} {'peak pred':>9} {'arena pred':>10} "
          f"{'arena MiB':>9} {'memory MiB':>10} {'moved MiB':>9} {'ms':>8} {'max |diff|':>10}"
          "  exact")
    for r in rows:
        def mib(v: Any) -> str:
            return "-" if v is None else f"{v / MIB:.1f}"
        if "error" in r:
            print(f"{r['model']:<6} {r['row']:<18} {mib(r['budget']):>10}  {r['error']}")
            continue
        print(f"{r['model']:<6} {r['row']:<18} {mib(r['budget']):>10} "
              f"{mib(r.get('predicted_peak')):>9} {mib(r.get('predicted_arena')):>10} "
              f"{mib(r['arena_max_in_use']):>9} {mib(r['memory']):>10} "
              f"{mib(r['bytes_moved']):>9} {r['ms']:>8.2f} "
              f"{r.get('max_abs_diff', float('nan')):>10.2g}  {r.get('bit_exact', '-')}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
