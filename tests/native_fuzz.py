"""Fuzzing session creation and run of the custom-op library on mutated optimized models.

Seeds: small models rewritten by ``ho_onnx.optimize`` (weights on the host and on
the disk tier, activations stored and reloaded). Mutations (seeded, one to four per case):
bytes of the serialized model, attributes of the cache ops (offset, length, shape, tier,
location, data_size, data_fingerprint, host_bytes, and the routing ones: gated, route,
route_k, expert_cache, warm, expert), graph edits (a node dropped, an input of
a cache op rewired to another tensor, an op type swapped) and the data file (truncated, a
symlink, bytes changed). Every mutant is loaded with the library and run a few times from
two threads with random feeds; a Python exception is fine, a crash (signal) is the bug.

Run it longer by hand (the regular test run uses HO_FUZZ_SECONDS, default 20):

    .venv/bin/python tests/native_fuzz.py --seconds 600 --seed 7
    scripts/test_native.sh -k fuzz          # under ASan + UBSan (HO_FUZZ_SECONDS=600 ...)

The loop runs in a child process; before each case the child writes the case (model and
data file) to ``<work>/inflight``. When the child dies of a signal, the parent copies that
folder to ``tests/fuzz_corpus/crash-<digest>/`` (commit it: ``test_fuzz_corpus`` replays every
case there) and fails.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import helper  # noqa: E402

CORPUS = HERE / "fuzz_corpus"
D = "ai.hyperoffload"


def make_seeds(work: Path) -> list[Path]:
    """Optimized models, each in its own folder with its data file."""
    from graphs import chain_model, save, text_model, two_weights_model

    from ho_onnx.rewrite.pipeline import optimize
    from ho_onnx.schedule.options import OffloadOptions

    seeds = []
    for name, make, dims in (("chain", chain_model, {"N": 4}), ("two", two_weights_model, {}),
                             ("ranged", chain_model, {})):
        for tier in ("host", "disk"):
            model = make()
            d = work / f"seed-{name}-{tier}"
            d.mkdir(parents=True, exist_ok=True)
            src = save(model, d / "src.onnx", external=True)
            out = d / "model.onnx"
            optimize(src, out, OffloadOptions(min_bytes=0, min_gap=1, prefetch_distance=1,
                                              weight_tier=tier), dims,
                     dim_ranges={"N": (1, 8)} if name == "ranged" else None)  # (Guards)
            src.unlink()
            seeds.append(d)
    # a recomputed activation: a LayerNormalization run again through a Fence
    d = work / "seed-recompute"
    d.mkdir(parents=True, exist_ok=True)
    src = save(text_model(recomputable(64, 64), g=(64,), b=(64,), W=(64, 64)), d / "src.onnx",
               external=True)
    r = optimize(src, d / "model.onnx", OffloadOptions(budget=RECOMPUTE_BUDGET, min_bytes=0,
                                                       weights=False, recompute="on"))
    assert r.choice.recomputes, "the recompute seed recomputes nothing"
    src.unlink()
    seeds.append(d)
    return seeds


def recomputable(rows: int | str, cols: int) -> str:
    """A graph (ONNX text; initializers g, b [cols], W [cols, cols]) whose n, a
    LayerNormalization of the input, is read before and after a peak it would sit through:
    the planner may recompute it (this fuzzer's and the optimize fuzzer's seed)."""
    shape = f"float[{rows}, {cols}]"
    return f"g ({shape} x) => ({shape} y) {{" + """
  n = LayerNormalization <axis = -1> (x, g, b)
  a = MatMul(n, W)
  big = Concat <axis = 0> (a, a, a, a)
  r = ReduceMean <keepdims = 1> (big)
  m = Mul(n, r)
  y = Add(m, a)
}
"""


RECOMPUTE_BUDGET = 104 << 10  # (its peak is 112.5 KiB, its floor 96.5)


# ---------------------------------------------------------------------------------------
# Mutations

_LOCATIONS = ["../src.onnx.data", "/etc/passwd", "a/../../x", "", ".", "sub", "x" * 300,
              "src.onnx.data/..", "./src.onnx.data", "src.onnx.data\x00junk", "\udcff"]
_INTS = [0, 1, -1, 3, 4, 7, 16, 4096, 2**31 - 1, 2**31, 2**32 + 5, 2**62, 2**63 - 1, -2**63]


def _ho_nodes(m: onnx.ModelProto):
    return [n for n in m.graph.node if n.domain == D]


def mutate_attr(m: onnx.ModelProto, rng: random.Random) -> None:
    nodes = _ho_nodes(m)
    if not nodes:
        return
    n = rng.choice(nodes)
    choice = rng.randrange(6)
    if choice == 0 and n.attribute:
        del n.attribute[rng.randrange(len(n.attribute))]
        return
    name = rng.choice(["offset", "length", "shape", "tier", "location", "data_size",
                       "data_fingerprint", "host_bytes", "name", "axes", "lo", "hi", "dims",
                       "input", "gated", "route", "route_k", "expert_cache", "warm", "expert"])
    for i, a in enumerate(n.attribute):
        if a.name == name:
            del n.attribute[i]
            break
    if name in ("offset", "length", "data_size", "host_bytes", "gated", "route_k",
                "expert_cache", "warm", "expert"):
        v = rng.choice(_INTS)
    elif name == "route":
        v = rng.choice(["softmax", "topk", "", "x" * 50])
    elif name in ("shape", "axes", "lo", "hi"):
        v = [rng.choice(_INTS) for _ in range(rng.randrange(0, 4))]
    elif name == "dims":
        v = rng.choice(["", "N", "N\nN", "\n", "x" * 300, "N\n"])
    elif name == "tier":
        v = rng.choice(["host", "disk", "flash", ""])
    elif name == "location":
        v = rng.choice(_LOCATIONS)
    else:
        v = rng.choice(["", "fnv1a64s16:0000000000000000", "x" * 100])
    with contextlib.suppress(Exception):
        n.attribute.append(helper.make_attribute(name, v))


def mutate_graph(m: onnx.ModelProto, rng: random.Random) -> None:
    g = m.graph
    if not g.node:
        return
    tensors = sorted({t for n in g.node for t in list(n.input) + list(n.output) if t}
                     | {i.name for i in g.input} | {i.name for i in g.initializer})
    choice = rng.randrange(5)
    ho = _ho_nodes(m)
    if choice == 0:
        del g.node[rng.randrange(len(g.node))]
    elif choice == 1 and ho:
        n = rng.choice(ho)
        if n.input:
            n.input[rng.randrange(len(n.input))] = rng.choice(tensors)
    elif choice == 2 and ho:
        rng.choice(ho).op_type = rng.choice(["Prefetch", "Wait", "Store", "Detach", "Fence"])
    elif choice == 3 and ho:
        n = rng.choice(ho)
        n.input.append(rng.choice(tensors))
    elif choice == 4:
        # move a node earlier (the graph may stop being sorted: ORT must refuse it cleanly)
        i = rng.randrange(len(g.node))
        node = g.node[i]
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        del g.node[i]
        g.node.insert(rng.randrange(len(g.node) + 1), copy)


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        if not b:
            break
        b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b)


def mutate_data(folder: Path, rng: random.Random) -> None:
    files = [p for p in folder.iterdir() if p.name.endswith(".data")]
    if not files:
        return
    f = rng.choice(files)
    choice = rng.randrange(3)
    if choice == 0:
        size = f.stat().st_size
        with open(f, "r+b") as fh:
            fh.truncate(rng.randrange(size + 1))
    elif choice == 1:
        f.unlink()
        os.symlink("/etc/hostname" if os.path.exists("/etc/hostname") else "/dev/null", f)
    else:
        with open(f, "r+b") as fh:
            size = f.stat().st_size
            if size:
                fh.seek(rng.randrange(size))
                fh.write(bytes([rng.randrange(256)]))


def make_case(seed_dir: Path, case_dir: Path, rng: random.Random) -> None:
    if case_dir.exists():
        shutil.rmtree(case_dir)
    shutil.copytree(seed_dir, case_dir)
    m = onnx.load(str(case_dir / "model.onnx"), load_external_data=False)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(10)
        if kind < 4:
            mutate_attr(m, rng)
        elif kind < 7:
            mutate_graph(m, rng)
        elif kind < 8:
            mutate_data(case_dir, rng)
    data = m.SerializeToString()
    if rng.randrange(4) == 0:
        data = mutate_bytes(data, rng)
    (case_dir / "model.onnx").write_bytes(data)


# ---------------------------------------------------------------------------------------
# Running one case


def _feeds(sess, rng: np.random.Generator) -> dict:
    feeds = {}
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) and 0 <= d <= 64 else 4 for d in i.shape]
        t = i.type
        if "int64" in t:
            feeds[i.name] = rng.integers(0, 4, shape, dtype=np.int64)
        elif "float" in t and "16" not in t:
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
        else:
            return {}
    return feeds


def run_case(case_dir: Path, arena: bool = True, order: str = "priority", threads: int = 2,
             runs: int = 3) -> str:
    """Load and run one case; returns "created"/"refused" (never raises for ORT errors)."""
    import onnxruntime as ort
    from native_util import session_options

    try:
        so = session_options(case_dir, arena=arena, order=order)
        sess = ort.InferenceSession(str(case_dir / "model.onnx"), so,
                                    providers=["CPUExecutionProvider"])
    except Exception:
        return "refused"
    rng = np.random.default_rng(0)
    try:
        feeds = _feeds(sess, rng)
    except Exception:
        return "created"

    def body():
        for _ in range(runs):
            with contextlib.suppress(Exception):
                sess.run(None, feeds)

    pool = [threading.Thread(target=body) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return "created"


def child(args: argparse.Namespace) -> int:
    work = Path(args.work)
    seeds = make_seeds(work)
    rng = random.Random(args.seed)
    inflight = work / "inflight"
    end = time.time() + args.seconds
    stats = {"cases": 0, "created": 0, "refused": 0}
    while time.time() < end:
        make_case(rng.choice(seeds), inflight, rng)
        (work / "inflight.ready").touch()
        stats[run_case(inflight, arena=bool(rng.getrandbits(1)),
                       order=rng.choice(["default", "priority"]))] += 1
        stats["cases"] += 1
    print(stats, flush=True)
    return 0


def replay(case_dir: Path) -> str:
    """Every arena setting and execution order, a few times each."""
    out = []
    for arena in (False, True):
        for order in ("default", "priority"):
            for _ in range(3):
                out.append(run_case(case_dir, arena=arena, order=order))
    return ",".join(sorted(set(out)))


def fuzz(seconds: float, seed: int, corpus: Path = CORPUS) -> tuple[int, str]:
    """Run the child for `seconds`; on a crash keep the case in `corpus`. Returns (exit
    status, message)."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", "--seconds", str(seconds), "--seed",
             str(seed), "--work", tmp],
            capture_output=True, text=True, env=os.environ.copy(),
            timeout=seconds + 300)
        if proc.returncode == 0:
            return 0, proc.stdout.strip()
        inflight = Path(tmp) / "inflight"
        kept = ""
        if inflight.exists():
            digest = hashlib.sha256((inflight / "model.onnx").read_bytes()).hexdigest()[:12]
            dest = corpus / f"crash-{digest}"
            if not dest.exists():
                shutil.copytree(inflight, dest, symlinks=True)
            kept = f"; case kept in {dest}"
        sig = -proc.returncode if proc.returncode < 0 else 0
        name = signal.Signals(sig).name if sig else f"exit {proc.returncode}"
        return proc.returncode, f"fuzz child died ({name}){kept}\n{proc.stderr[-4000:]}"


def fuzzer_main(doc: str, fuzz_fn, child_fn, before_child=None) -> int:  # type: ignore[no-untyped-def]
    """The command line both fuzzers share: ``--seconds/--seed`` run ``fuzz_fn`` (the
    parent, which starts children); ``--child --work DIR`` runs ``child_fn`` (after
    ``before_child``)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--work", default=None)
    args = ap.parse_args()
    if args.child:
        if before_child is not None:
            before_child()
        return child_fn(args)
    rc, msg = fuzz_fn(args.seconds, args.seed)
    print(msg)
    return 0 if rc == 0 else 1


def run_bounded(fuzz_fn, default_seconds: str) -> None:  # type: ignore[no-untyped-def]
    """Run ``fuzz_fn`` for HO_FUZZ_SECONDS (else ``default_seconds``) with HO_FUZZ_SEED, and
    require a clean run that actually tried cases (the pytest side of both fuzzers)."""
    seconds = float(os.environ.get("HO_FUZZ_SECONDS", default_seconds))
    seed = int(os.environ.get("HO_FUZZ_SEED", "0"))
    rc, msg = fuzz_fn(seconds, seed)
    assert rc == 0, msg
    assert "'cases'" in msg


def _load_ops() -> None:
    from native_util import load_ops_override

    load_ops_override()


def main() -> int:
    return fuzzer_main(__doc__, fuzz, child, _load_ops)


if __name__ == "__main__":
    sys.exit(main())
