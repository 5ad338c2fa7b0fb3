"""Fuzzing ``ho-onnx optimize``, ``plan``, ``verify`` and ``profile`` on mutated input models
(issue 9).

Seeds: small models (inline and external weights, a Shape/Reshape chain, a Tile peak, a
contrib op beside a ConstantOfShape, weights read in nested If branches).
Mutations (seeded, one to four per case; shared with the session fuzzer, tests/native_fuzz.py,
where they apply): bytes of the serialized model, node attributes, dims of inputs, outputs
and initializers, element types, external-data references (location, offset, length), the
data file (truncated, a symbolic link, removed), node wiring (a node dropped or moved, an
input rewired, an output duplicated) and opset/IR versions; then ``optimize`` or ``plan``
with random options (``plan`` sometimes after ORT's own optimizations), or ``verify`` (the
mutant against itself) or ``profile`` at a random ORT optimization level: ORT loads and runs
the mutant, in the child process ``ho_onnx.target.ort.isolate`` gives it. Optimized seeds
(tests/native_fuzz.py's, their cache-op attributes mutated too) go to ``inspect``. Each case
must end in exit 0 (``verify``: or 1), or exit 2 with exactly one ``error:`` line (no
traceback, no "unexpected" error), within the per-case time limit, with the input folder
unchanged and nothing written outside the output folder.

Run it longer by hand (the regular test run uses HO_FUZZ_SECONDS, default 30):

    .venv/bin/python tests/optimize_fuzz.py --seconds 600 --seed 7

The cases run in one child process (the command line in-process, through click's runner);
before each it writes the case to ``<work>/inflight`` (``args.json``, the input folder
``in/``). A case that breaks a rule, or kills or hangs the child, is copied to
``tests/fuzz_corpus/optimize/<kind>-<digest>/`` (commit it: ``test_optimize_fuzz_corpus``
replays every case there with the installed ``ho-onnx`` script) and the run fails.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import hashlib
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import native_fuzz  # noqa: E402
import numpy as np  # noqa: E402
import onnx  # noqa: E402
from native_fuzz import (  # noqa: E402
    _INTS,
    _LOCATIONS,
    fuzzer_main,
    mutate_attr,
    mutate_bytes,
    mutate_data,
    mutate_graph,
)
from onnx import TensorProto, helper  # noqa: E402

CORPUS = HERE / "fuzz_corpus" / "optimize"
CASE_SECONDS = 60.0
# The child's bounds: shape inference and the whole process stay small on a shared machine;
# a mutant ORT would run forever (verify, profile) is ended as the user's limit would.
ENV = {"HO_ONNX_SHAPE_INFERENCE_MEMORY": "1GiB", "HO_ONNX_SHAPE_INFERENCE_TIMEOUT": "20",
       "HO_ONNX_ORT_TIMEOUT": "20"}
ADDRESS_SPACE = 6 << 30
OPTIMIZED_SEED = "seed-optimized-"


def make_seeds(work: Path) -> list[Path]:
    """Input folders, each with ``model.onnx`` (and its data file when external)."""
    from graphs import (
        chain_model,
        contrib_blowup_model,
        save,
        text_model,
        tile_model,
        two_weights_model,
    )

    shaped = text_model("""
    g (float[N, 16] x) => (float[N, 4, 4] y) {
      s = Shape(x)
      n = Gather <axis = 0> (s, zero)
      t = Concat <axis = 0> (n, four, four)
      h = MatMul(x, W)
      y = Reshape(h, t)
    }
    """, W=(16, 16), zero=np.array([0], np.int64), four=np.array([4], np.int64))
    # weights read inside nested subgraphs (implicit uses; a weight offloaded for a branch)
    branchy = text_model("""
    g (float[N, 16] x, bool c) => (float[N, 16] y) {
      h = MatMul(x, W1)
      y = If(c) <then_branch = t () => (float[N, 16] u) {
                   u = If(c) <then_branch = t2 () => (float[N, 16] p) { p = MatMul(h, W2) },
                              else_branch = e2 () => (float[N, 16] q) { q = Relu(h) }>
                 },
                 else_branch = e () => (float[N, 16] v) { v = Add(h, W3) }>
    }
    """, W1=(16, 16), W2=(16, 16), W3=(16,))
    # a stored activation the planner may recompute (a LayerNormalization of the input)
    recomputable = text_model(native_fuzz.recomputable("N", 256), g=(256,), b=(256,),
                              W=(256, 256))
    # a weight read inside a Loop body (reloaded before the Loop)
    loopy = text_model("""
    g (float[N, 16] x, int64 k) => (float[N, 16] y) {
      c = Constant <value = bool {1}> ()
      y = Loop(k, c, x) <body = b (int64 i, bool ci, float[N, 16] s) => (bool co,
                                                                     float[N, 16] s2) {
                          co = Identity(ci)
                          s2 = MatMul(s, W) }>
    }
    """, W=(16, 16))
    # a Loop walking stacked weights by its counter, and a Scan body reading two weights
    # (both planned per iteration under a budget)
    stacked = text_model("""
    g (float[N, 16] x, float[N, 16] xs) => (float[N, 16] y, float[N, 16] ys) {
      k = Constant <value = int64 {4}> ()
      c = Constant <value = bool {1}> ()
      y = Loop(k, c, x) <body = b (int64 i, bool ci, float[N, 16] s) => (bool co,
                                                                     float[N, 16] s2) {
                          co = Identity(ci)
                          w = Gather <axis = 0> (WS, i)
                          s2 = MatMul(s, w) }>
      z = Constant <value = float[16] {0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0}> ()
      zf, ys = Scan <num_scan_inputs = 1, body = sb (float[16] st, float[16] xt) => (
                       float[16] st2, float[16] yt) {
                          u = Add(st, xt)
                          v = MatMul(u, V1)
                          st2 = Tanh(v)
                          yt = MatMul(st2, V2) }> (z, xs)
    }
    """, WS=(4, 16, 16), V1=(16, 16), V2=(16, 16))
    # IR 3: every weight also listed as a graph input (ORT holds them constant)
    legacy = chain_model()
    legacy.ir_version = 3
    legacy.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                              for t in legacy.graph.initializer)
    seeds = []
    for name, model, external in (("chain", chain_model(), False),
                                  ("legacy-ir3", legacy, True),
                                  ("chain-ext", chain_model(), True),
                                  ("two-ext", two_weights_model(), True),
                                  ("tile", tile_model((64, 64), (64, 64)), False),
                                  ("shaped", shaped, True),
                                  ("branchy", branchy, True),
                                  ("recomputable", recomputable, False),
                                  ("loopy", loopy, True),
                                  ("stacked", stacked, True),
                                  # ORT's symbolic inference (a contrib op), a small
                                  # ConstantOfShape it computes: mutations make it big
                                  ("contrib", contrib_blowup_model(4), False)):
        d = work / f"seed-{name}"
        d.mkdir(parents=True, exist_ok=True)
        save(model, d / "model.onnx", external=external, size_threshold=64)
        seeds.append(d)
    # optimized models (cache ops, weights on the host and disk tiers), for ``inspect``
    for d in native_fuzz.make_seeds(work / "optimized"):
        seeds.append(d.rename(work / f"{OPTIMIZED_SEED}{d.name.removeprefix('seed-')}"))
    return seeds


# ---------------------------------------------------------------------------------------
# Mutations of input models (graph wiring, bytes and data files: tests/native_fuzz.py)

# (also dims no parser takes: 3,000 factors, nesting, a null byte; and a long name)
_DIMS = [*_INTS, "N", "", "M", "N+1", "2*N", "\u00b2", "*".join(["N"] * 3000),
         "(" * 300 + "N" + ")" * 300, "N\x00", "n" * 5000]


def mutate_dims(m: onnx.ModelProto, rng: random.Random) -> None:
    g = m.graph
    vis = [*g.input, *g.output, *g.value_info]
    if rng.randrange(3) == 0 and g.initializer:
        t = rng.choice(g.initializer)
        if rng.randrange(4) == 0:  # empty, of more dims than numpy holds (an output of it
            t.dims[:] = [0] + [1] * rng.choice([63, 64, 70, 300])  # too: found by hand)
            for f in ("raw_data", "float_data", "int32_data", "int64_data", "double_data",
                      "uint64_data", "string_data"):
                t.ClearField(f)
            if t.data_location != onnx.TensorProto.EXTERNAL and rng.randrange(2):
                t.raw_data = b""  # (else no field at all: read as typed values)
            if rng.randrange(2):
                g.output.add().CopyFrom(onnx.helper.make_tensor_value_info(
                    t.name, t.data_type, list(t.dims)))
        elif rng.randrange(2):
            t.dims[:] = [rng.choice([v for v in _INTS if isinstance(v, int)])
                         for _ in range(rng.randrange(4))]
        else:
            t.data_type = rng.randrange(0, 26)
        return
    if not vis:
        return
    vi = rng.choice(vis)
    tt = vi.type.tensor_type
    if rng.randrange(6) == 0:
        tt.elem_type = rng.randrange(0, 26)
        return
    dims = tt.shape.dim
    if rng.randrange(20) == 0:  # many huge dims: a size of thousands of digits
        for _ in range(300):
            dims.add().dim_value = 2**62
        return
    if not dims or rng.randrange(4) == 0:
        dims.add()
    d = rng.choice(dims)
    v = rng.choice(_DIMS)
    with contextlib.suppress(ValueError, TypeError):
        if isinstance(v, int):
            d.dim_value = v
        else:
            d.dim_param = v


def mutate_attrs(m: onnx.ModelProto, rng: random.Random) -> None:
    nodes = list(m.graph.node)
    if not nodes:
        return
    n = rng.choice(nodes)
    if n.attribute and rng.randrange(3) == 0:
        del n.attribute[rng.randrange(len(n.attribute))]
        return
    name = rng.choice([a.name for a in n.attribute] + ["axis", "axes", "keepdims", "perm",
                                                       "to", "value", "junk"])
    for i, a in enumerate(n.attribute):
        if a.name == name:
            del n.attribute[i]
            break
    value: object = rng.choice([
        rng.choice(_INTS), [rng.choice(_INTS) for _ in range(rng.randrange(5))], 1.5,
        "x" * rng.randrange(3), b"\xff\xfe",
        helper.make_tensor("v", TensorProto.INT64, [2], [rng.choice(_INTS), 3]),
    ])
    with contextlib.suppress(Exception):
        n.attribute.append(helper.make_attribute(name, value))


def mutate_external(m: onnx.ModelProto, rng: random.Random) -> None:
    inits = list(m.graph.initializer)
    if not inits:
        return
    t = rng.choice(inits)
    if t.data_location != TensorProto.EXTERNAL:
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        e = t.external_data.add()
        e.key, e.value = "location", rng.choice([*_LOCATIONS[:4], "model.onnx"])
        return
    key = rng.choice(["location", "offset", "length", "checksum", None])
    entries = {e.key: e for e in t.external_data}
    if key is None:
        if t.external_data:
            del t.external_data[rng.randrange(len(t.external_data))]
        return
    value = (rng.choice([*_LOCATIONS, "model.onnx", "model.onnx.data"]) if key == "location"
             else str(rng.choice(_INTS)) if key != "checksum" else "0" * 40)
    with contextlib.suppress(ValueError):
        if key in entries:
            entries[key].value = value
        else:
            e = t.external_data.add()
            e.key, e.value = key, value


def mutate_wiring(m: onnx.ModelProto, rng: random.Random) -> None:
    g = m.graph
    if not g.node:
        return
    names = sorted({t for n in g.node for t in [*n.input, *n.output]}
                   | {i.name for i in g.input} | {"", "nowhere"})
    n = rng.choice(g.node)
    choice = rng.randrange(4)
    if choice == 0 and n.input:
        n.input[rng.randrange(len(n.input))] = rng.choice(names)
    elif choice == 1 and n.output:
        n.output[rng.randrange(len(n.output))] = rng.choice(names)  # duplicate or cycle
    elif choice == 2:
        n.op_type = rng.choice(["Relu", "MatMul", "Prefetch", "Loop", "NoSuchOp", "Shape"])
    else:
        n.domain = rng.choice(["", "ai.hyperoffload", "com.microsoft", "x"])


def mutate_versions(m: onnx.ModelProto, rng: random.Random) -> None:
    if rng.randrange(2) and m.opset_import:
        m.opset_import[0].version = rng.choice([0, 1, 7, 13, 17, 21, 99, -1])
    else:
        m.ir_version = rng.choice([0, 1, 3, 7, 8, 10, 99])


_MUTATORS = [mutate_dims, mutate_attrs, mutate_external, mutate_wiring, mutate_graph,
             mutate_versions]


def make_case(seed_dir: Path, case_dir: Path, rng: random.Random) -> list[str]:
    """Write a mutant of ``seed_dir`` to ``case_dir/in`` and return the command's arguments
    (paths relative to ``case_dir``). An optimized seed's mutant (its cache ops' attributes
    too) goes to ``inspect``."""
    if case_dir.exists():
        shutil.rmtree(case_dir)
    shutil.copytree(seed_dir, case_dir / "in")
    src = case_dir / "in" / "model.onnx"
    m = onnx.load(str(src), load_external_data=False)
    optimized = seed_dir.name.startswith(OPTIMIZED_SEED)
    mutators = [mutate_attr, mutate_attr, *_MUTATORS] if optimized else _MUTATORS
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(len(mutators) + 1)
        if kind == len(mutators):
            mutate_data(case_dir / "in", rng)
        else:
            mutators[kind](m, rng)
    try:
        data = m.SerializeToString()
    except Exception:  # a mutation protobuf refuses to write: keep the original bytes
        data = src.read_bytes()
    if rng.randrange(4) == 0:
        data = mutate_bytes(data, rng)
    src.write_bytes(data)
    args = ["inspect", "in/model.onnx", *(["--json"] if rng.randrange(2) else [])] \
        if optimized else _options(rng)
    (case_dir / "args.json").write_text(json.dumps(args))
    return args


def _options(rng: random.Random) -> list[str]:
    dims = ["--dim", f"N={rng.choice([0, 1, 2, 3, 64, 2**40])}"] if rng.randrange(5) else []
    budget = rng.choice(["1", "4KiB", "64KiB", "350KiB", "1MiB", "1GiB"])
    level = ["--opt-level", rng.choice(["disable", "basic", "extended", "all"])]
    if rng.randrange(8) == 0:  # ORT runs the mutant (in a child process: it may crash)
        return ["verify", "in/model.onnx", "in/model.onnx", *level, *dims]
    if rng.randrange(8) == 0:
        return ["profile", "in/model.onnx", "--out", "out/p.json", "--runs", "1", *level, *dims]
    if rng.randrange(3) == 0:
        ort = ["--ort-optimize", rng.choice(["basic", "extended"])] if rng.randrange(4) == 0 \
            else []
        return ["plan", "in/model.onnx", "--budget", budget, *ort, *dims]
    opts = rng.choice([[], ["--budget", budget], ["--min-bytes", "0"],
                       ["--budget", budget, "--min-bytes", "0"],
                       ["--offload", rng.choice(["weights", "activations", "none"])],
                       ["--budget", budget, "--weight-tier", "disk"],
                       ["--budget", budget, "--min-bytes", "0", "--recompute",
                        rng.choice(["on", "off"])]])
    if rng.randrange(6) == 0:  # a range plan on the disk tier: its decode cache and Guards
        opts = ["--budget", budget, "--weight-tier", "disk", "--min-bytes", "0",
                "--dim", f"N=1..{rng.choice([1, 2, 64])}", "--point", "decode:N=1",
                "--decode-cache"]
        dims = []
    out = rng.choice(["out/m.ho.onnx", "out/deeper/m.ho.onnx", "in/m.ho.onnx"])
    return ["optimize", "in/model.onnx", out, *opts, *dims]


# ---------------------------------------------------------------------------------------
# The rules every case keeps


def snapshot(case_dir: Path) -> dict[str, str]:
    """Digest of every file, link and folder under ``case_dir`` (but the case's arguments)."""
    out: dict[str, str] = {}
    for p in sorted(case_dir.rglob("*")):
        rel = p.relative_to(case_dir).as_posix()
        if rel == "args.json":
            continue
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


def _may_write(args: list[str], rel: str) -> bool:
    """Whether a successful ``args`` may add ``rel`` (relative to the case folder): the
    output, its sidecar, and in a new folder whatever the output needs (data files)."""
    if args[0] == "profile":
        return rel in ("out", args[args.index("--out") + 1])
    if args[0] != "optimize":
        return False
    out = Path(args[2])
    if rel in (out.as_posix(), f"{out.as_posix()}.data"):
        return True
    if out.parent == Path("in"):
        return False
    return rel.startswith(f"{out.parent.as_posix()}/") or out.parent.as_posix() == rel or \
        out.parent.as_posix().startswith(f"{rel}/")


def check(args: list[str], before: dict[str, str], after: dict[str, str], code: int,
          stderr: str) -> str | None:
    """The broken rule, or None (``verify`` may also exit 1: a model with random ops
    differs from itself)."""
    if code not in (0, 2) and not (code == 1 and args[0] == "verify"):
        return f"exit {code}"
    if "Traceback" in stderr or "unexpected" in stderr.lower():
        return "traceback"
    errors = [x for x in stderr.splitlines() if x.startswith("error:")]
    if code == 2 and (len(errors) != 1 or stderr.rstrip().splitlines()[-1] != errors[0]):
        return "error lines"
    if code == 0 and errors:
        return "error line with exit 0"
    changed = sorted(k for k in before if after.get(k) != before[k])
    if changed:
        return f"input changed: {changed}"
    added = sorted(k for k in set(after) - set(before) if not (code == 0 and _may_write(args, k)))
    if added:
        return f"written outside the output: {added}"
    return None


def run_cli(case_dir: Path, args: list[str]) -> tuple[int, str]:
    """The installed ``ho-onnx`` on a case (for the corpus replay): (exit status, stderr)."""
    exe = Path(sys.executable).with_name("ho-onnx")
    proc = subprocess.run([str(exe), *args], cwd=case_dir, capture_output=True, text=True,
                          timeout=CASE_SECONDS, env={**os.environ, **ENV})
    return proc.returncode, proc.stderr


def replay(case_dir: Path) -> str | None:
    """Run a kept case again; the broken rule, or None."""
    args = json.loads((case_dir / "args.json").read_text())
    before = snapshot(case_dir)
    code, err = run_cli(case_dir, args)
    return check(args, before, snapshot(case_dir), code, err)


# ---------------------------------------------------------------------------------------
# The loop (child) and its parent


def _run_in_process(case_dir: Path, args: list[str]) -> tuple[int, str]:
    from click.testing import CliRunner

    from ho_onnx.cli import main

    cwd = os.getcwd()
    os.chdir(case_dir)
    try:
        r = CliRunner().invoke(main, args)
    finally:
        os.chdir(cwd)
    err = r.stderr if hasattr(r, "stderr") else r.output
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        return 1, err + f"\nTraceback: {r.exception!r}"
    return r.exit_code, err


def child(args: argparse.Namespace) -> int:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, resource.RLIM_INFINITY))
    os.environ.update(ENV)
    work = Path(args.work)
    seeds = make_seeds(work / "seeds")
    rng = random.Random(args.seed)
    inflight = work / "inflight"
    end = time.time() + args.seconds
    stats = {"cases": 0, "ok": 0, "refused": 0}
    while time.time() < end:
        cli_args = make_case(rng.choice(seeds), inflight, rng)
        before = snapshot(inflight)
        faulthandler.dump_traceback_later(CASE_SECONDS, exit=True)  # a hang ends the child
        code, err = _run_in_process(inflight, cli_args)
        faulthandler.cancel_dump_traceback_later()
        broken = check(cli_args, before, snapshot(inflight), code, err)
        if broken is not None:
            print(json.dumps({"broken": broken, "args": cli_args, "stderr": err[-2000:]}),
                  flush=True)
            return 3
        stats["cases"] += 1
        stats["ok" if code == 0 else "refused"] += 1
    print(stats, flush=True)
    return 0


def keep(case_dir: Path, kind: str, corpus: Path = CORPUS) -> Path:
    """Copy a case (its input folder and arguments, not its outputs) into ``corpus``."""
    digest = hashlib.sha256(json.dumps(snapshot(case_dir)).encode()
                            + (case_dir / "args.json").read_bytes()).hexdigest()[:12]
    dest = corpus / f"{kind}-{digest}"
    if not dest.exists():
        dest.mkdir(parents=True)
        shutil.copytree(case_dir / "in", dest / "in", symlinks=True)
        shutil.copy(case_dir / "args.json", dest / "args.json")
    return dest


def fuzz(seconds: float, seed: int, corpus: Path = CORPUS) -> tuple[int, str]:
    """Run the child for ``seconds``; a broken rule, a crash or a hang keeps the case in
    ``corpus``. Returns (exit status, message)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", "--seconds", str(seconds), "--seed",
                 str(seed), "--work", tmp], capture_output=True, text=True,
                timeout=seconds + CASE_SECONDS + 120, env={**os.environ, **ENV})
            rc, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = -9, str(e.stdout or ""), str(e.stderr or "")
        if rc == 0:
            return 0, out.strip()
        inflight = Path(tmp) / "inflight"
        kind = "broken" if rc == 3 else "crash" if rc < 0 else "hang-or-exit"
        kept = ""
        if (inflight / "args.json").exists():
            kept = f"; case kept in {keep(inflight, kind, corpus)}"
        return rc, f"fuzz child: {kind} (status {rc}){kept}\n{out[-3000:]}\n{err[-3000:]}"


def main() -> int:
    return fuzzer_main(__doc__, fuzz, child)


if __name__ == "__main__":
    sys.exit(main())
