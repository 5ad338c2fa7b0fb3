"""``bench/plan_scale.py`` side by side with other git trees, alternated in one run.

Issue 13's check ("no slower than before, same run, side by side with the old tree"): each
``--tree REV`` is checked out into a temporary git worktree and its own
``bench/plan_scale.py`` runs there with this checkout's Python (the installed ``ho_onnx``
hidden, so the tree's own package is imported); this checkout runs once per ``--variant``
(extra plan_scale arguments, e.g. ``--arena-refits 0`` for the planner without the arena
fit older trees lack). Runs alternate ``--rounds`` times; each phase keeps its best.
Prints the total per graph size and tree with ratios to the first tree; ``--json`` writes
every phase.

    python bench/plan_scale_compare.py --tree 46b76cd --variant "" --variant "--arena-refits 0"
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Runs a tree's bench with its own package: the editable install's finder (which maps
# ``ho_onnx`` to this checkout) is removed and the tree's root goes first on sys.path.
_RUN_TREE = """import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path
                    if 'Editable' not in type(f).__name__ and 'Scikit' not in type(f).__name__]
sys.path.insert(0, '.')
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def _run(cwd: Path, argv: list[str], layers: list[str], repeat: int, out: Path) -> list[dict]:
    cmd = [sys.executable, *argv, "--layers", *layers, "--repeat", str(repeat), "--json",
           str(out)]
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} in {cwd} failed:\n{r.stderr[-2000:]}")
    return json.loads(out.read_text())["rows"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", default=[], metavar="REV",
                    help="a git revision to compare (repeatable)")
    ap.add_argument("--variant", action="append", default=None, metavar="ARGS",
                    help="extra plan_scale arguments for this checkout (repeatable; "
                         "default: one run without any)")
    ap.add_argument("--layers", nargs="+", default=["1", "10", "20", "40", "80", "161", "322"])
    ap.add_argument("--rounds", type=int, default=3, help="alternations (default 3)")
    ap.add_argument("--repeat", type=int, default=3, help="plan_scale's best of N per phase")
    ap.add_argument("--json", type=Path, help="write every tree's best phases here")
    args = ap.parse_args(argv)

    best: dict[str, dict[int, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="ho_plan_compare_") as tmp:
        work = Path(tmp)
        (work / "run_tree.py").write_text(_RUN_TREE)
        runs: list[tuple[str, Path, list[str]]] = []
        try:
            for rev in args.tree:
                wt = work / f"tree-{len(runs)}"
                added = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach",
                                        str(wt), rev], capture_output=True, text=True,
                                       check=False)
                if added.returncode != 0:
                    err = (added.stderr.strip().splitlines() or ["git failed"])[-1]
                    raise SystemExit(f"cannot check out {rev!r}: {err}")
                runs.append((rev, wt, [str(work / "run_tree.py"), "bench/plan_scale.py"]))
            for v in args.variant if args.variant is not None else [""]:
                runs.append((f"this {v}".strip(), ROOT, ["bench/plan_scale.py", *shlex.split(v)]))
            for r in range(args.rounds):
                for name, cwd, run_argv in runs:
                    rows = _run(cwd, run_argv, args.layers, args.repeat, work / "rows.json")
                    for row in rows:
                        b = best.setdefault(name, {}).setdefault(row["nodes"], {})
                        for key, s in [("total", row["total_s"]), *row["seconds"].items()]:
                            b[key] = min(b.get(key, float("inf")), s)
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            for _, wt, _ in runs:
                if wt != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                    str(wt)], check=False, capture_output=True)
    names = [n for n, _, _ in runs]
    ref = names[0]
    print(f"best of {args.rounds} alternations x {args.repeat}; total ms (ratio to {ref})")
    print(f"{'nodes':>6} " + " ".join(f"{n[:22]:>22}" for n in names))
    for nodes in sorted(best[ref]):
        cells = []
        for n in names:
            t = best[n][nodes]["total"]
            cells.append(f"{t * 1e3:>12.1f} ({t / best[ref][nodes]['total']:.2f})")
        print(f"{nodes:>6} " + " ".join(f"{c:>22}" for c in cells))
    if args.json:
        args.json.write_text(json.dumps({"layers": args.layers, "rounds": args.rounds,
                                         "repeat": args.repeat, "best_s": best}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
