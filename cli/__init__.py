"""The ``ho-onnx`` command line: a thin click layer over the library's public API.

Lives in the top-level ``cli/`` folder and is installed as ``ho_onnx.cli`` (pyproject's
``wheel.packages`` mapping); the library never imports it. Option defaults come from
:class:`ho_onnx.schedule.options.OffloadOptions`, not from here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from google.protobuf.message import EncodeError

from ho_onnx import __version__, kinds
from ho_onnx.errors import HoOnnxError, printable
from ho_onnx.schedule.options import (
    CPU_EXPERTS,
    MIN_BYTES_BUDGET,
    MIN_BYTES_EXPLICIT,
    RECOMPUTE,
    SPECULATE_EXPERTS,
    OffloadOptions,
    offload_kinds,
)
from ho_onnx.units import INT64_MAX, format_bytes, parse_size

if TYPE_CHECKING:
    from ho_onnx.cost.source import CostSource

_DEFAULTS = OffloadOptions()


def parse_dims(items: tuple[str, ...],
               ranges: dict[str, tuple[int, int]] | None = None) -> dict[str, int]:
    """``('batch=1', 'seq=128')`` → ``{'batch': 1, 'seq': 128}``. With ``ranges``, also
    ``seq=1..2048``: into ``ranges`` (``{'seq': (1, 2048)}``); the dim is then planned at the
    range's top."""
    dims: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        lo, dots, hi = value.partition("..")
        if dots and sep and name.strip():
            if ranges is None:
                raise click.BadParameter(f"{item!r}: a range is for optimize and plan; this "
                                         "command runs at one point: NAME=INTEGER",
                                         param_hint="--dim")
            if not all(re.fullmatch(r"\s*[0-9]+\s*", x) for x in (lo, hi)):
                raise click.BadParameter(f"{item!r}: expected NAME=LO..HI with integers, e.g. "
                                         "seq=1..2048", param_hint="--dim")
            if name.strip() in ranges or name.strip() in dims:
                raise click.BadParameter(f"{name.strip()!r} given twice", param_hint="--dim")
            ranges[name.strip()] = (int(lo), int(hi))
            continue
        if name.strip() in (ranges or {}):
            raise click.BadParameter(f"{name.strip()!r} given twice", param_hint="--dim")
        if not sep or not name.strip() or not re.fullmatch(r"\s*[0-9]+\s*", value):
            raise click.BadParameter(f"{item!r}: expected NAME=INTEGER, e.g. seq=2048",
                                     param_hint="--dim")
        if int(value) > INT64_MAX:
            raise click.BadParameter(f"{item!r}: {value.strip()} is past int64",
                                     param_hint="--dim")
        if dims.get(name.strip(), int(value)) != int(value):
            raise click.BadParameter(f"{name.strip()!r} given twice, as {dims[name.strip()]} "
                                     f"and {int(value)}", param_hint="--dim")
        dims[name.strip()] = int(value)
    return dims


def parse_points(items: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """``('decode:seq=1,past=4095',)`` → ``{'decode': {'seq': 1, 'past': 4095}}``
    (``--point``; checked against the ranges by the pipeline)."""
    points: dict[str, dict[str, int]] = {}
    for item in items:
        name, sep, rest = item.partition(":")
        if not sep or not name.strip() or name.strip() in points:
            raise click.BadParameter(
                f"{item!r}: expected NAME:DIM=N[,DIM=N...] with a new name, e.g. "
                "decode:seq=1,past=4095", param_hint="--point")
        try:
            points[name.strip()] = parse_dims(tuple(x for x in rest.split(",") if x.strip())
                                              or ("",))
        except click.BadParameter as e:
            raise click.BadParameter(f"{item!r}: {e.message}", param_hint="--point") from None
    return points


def parse_shape_options(items: tuple[str, ...]) -> dict[str, list[int]]:
    """``('x=1,3,48,320',)`` → ``{'x': [1, 3, 48, 320]}`` (``--shape``)."""
    from ho_onnx.graph.dims import parse_shapes

    try:
        return parse_shapes(items)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--shape") from None


def _model_in(path: str) -> str:
    """The model file of ``path``: itself, or the model of a genai/Optimum folder."""
    from pathlib import Path

    if not Path(path).is_dir():
        return path
    from ho_onnx.target.ort.folders import detect_folder

    return str(detect_folder(path).model)


class SizeType(click.ParamType):
    """A byte size (``8GiB``, ``4096``) of at least ``minimum`` bytes."""

    name = "size"

    def __init__(self, minimum: int = 0) -> None:
        self.minimum = minimum

    def convert(self, value, param, ctx):  # type: ignore[no-untyped-def]
        try:
            size = value if isinstance(value, int) else parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        if size < self.minimum:
            self.fail(f"{value!r} is less than {format_bytes(self.minimum)}", param, ctx)
        if size > INT64_MAX:
            self.fail(f"{value!r} is past int64", param, ctx)
        return size


class FiniteFloatRange(click.FloatRange):
    """A float in the range that is finite (click's range lets NaN through, and infinity
    where there is no maximum)."""

    def convert(self, value, param, ctx):  # type: ignore[no-untyped-def]
        v = super().convert(value, param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return v


_NON_NEGATIVE = FiniteFloatRange(min=0)  # seconds, tolerances
_SEED = click.IntRange(min=0, max=INT64_MAX)
_INT_HIGH = click.IntRange(min=1, max=INT64_MAX)


class _Interrupted(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so that cleanups run."""


def _terminate(signum: int, _frame: object) -> None:
    raise _Interrupted(signum)


def _one_line(text: str, limit: int = 2000) -> str:
    """``text`` on one line; past ``limit`` characters (a model's names can be any length)
    its middle is left out, so the end, which says what to do, stays."""
    line = " ".join(str(text).split())
    if len(line) <= limit:
        return line
    cut = len(line) - limit
    return f"{line[:limit * 3 // 4]} ... [{cut} characters left out] ... {line[-(limit // 4):]}"


def _echo(text: str, err: bool = False) -> None:
    """Print a line of the command's output (stdout, or stderr with ``err``); every line
    the CLI prints goes through here (a progress bar's label through :func:`printable`), so
    a model's names are shown, never obeyed (found by hand: ``inspect`` and ``plan`` printed
    a weight's name raw, with its OSC sequence that sets a terminal's title and its clear
    screen; click strips only colour codes, and only when the output is not a terminal)."""
    click.echo(printable(text), err=err)


class _PrintableLog(logging.Handler):
    """Python logging's warnings as the CLI's lines, through :func:`_echo` (found by hand:
    onnx_ir's warning naming a graph output with an escape sequence reached the terminal
    raw, through logging's last-resort handler)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            _echo(self.format(record), err=True)
        except Exception:
            self.handleError(record)


@contextmanager
def _printable_logging() -> Iterator[None]:
    """For the block, warnings logged by the libraries are printed by :class:`_PrintableLog`."""
    root = logging.getLogger()
    handler = _PrintableLog(logging.WARNING)
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)


def _fail(message: str, code: int = 2) -> None:
    _echo(f"error: {_one_line(message)}", err=True)
    sys.exit(code)


def _refuse_non_utf8(argv: Iterable[str]) -> None:
    """Refuse an argument that is not UTF-8 (a path's bytes, as Python keeps them): onnx's
    checker and ONNX Runtime take UTF-8 paths (was: an unexpected TypeError from their
    bindings, after the work, for an output or a model to verify or profile)."""
    for arg in argv:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            raise click.UsageError(
                f"{os.fsencode(arg)!r} is not valid UTF-8: onnx and ONNX Runtime take UTF-8 "
                "paths and names; rename it") from None


class _Main(click.Group):
    """Every failure is one ``error: ...`` line on stderr and exit 2 (no traceback, no usage
    dump); SIGINT and SIGTERM end the command through its cleanups (exit 130/143).
    ``HO_ONNX_TRACEBACK=1`` shows the traceback of an unexpected error."""

    def main(self, *args: Any, **kw: Any) -> Any:  # type: ignore[override]
        kw.pop("standalone_mode", None)
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
        try:
            argv = kw.get("args", args[0] if args else None)
            _refuse_non_utf8(sys.argv[1:] if argv is None else argv)
            with _printable_logging():
                code = super().main(*args, standalone_mode=False, **kw)
        except click.exceptions.Exit as e:
            code = e.exit_code
        except click.ClickException as e:
            _fail(e.format_message())
        except (KeyboardInterrupt, click.Abort):
            _fail("interrupted", 130)
        except _Interrupted:
            _fail("terminated", 143)
        except HoOnnxError as e:
            _fail(str(e))
        except OSError as e:
            _fail(f"{e.strerror or e}" + (f": {e.filename!r}" if e.filename else ""))
        except MemoryError:
            _fail("out of memory")
        except EncodeError:
            # Found by hand (ulimit -v): protobuf's "Failed to serialize proto". For a message
            # read from a file that is memory running out: ONNX's messages have no required
            # fields, and what was decoded is within the encoder's depth limit (both 100); a
            # message over 2 GiB is a ValueError of its own.
            _fail("out of memory: protobuf could not serialise the model")
        except Exception as e:
            if os.environ.get("HO_ONNX_TRACEBACK"):
                raise
            _fail(_known_error(e) or f"unexpected {type(e).__name__}: {e} (set "
                  "HO_ONNX_TRACEBACK=1 for the traceback)")
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, previous)
        sys.exit(code or 0)


def _known_error(e: Exception) -> str | None:
    """The message of an error of ONNX Runtime, onnx or protobuf about the input (not of
    onnx_ir, which reads only what onnx checked: its error is ours, shown as unexpected)."""
    module = type(e).__module__ or ""
    if module.split(".")[0] in ("onnx", "onnxruntime") or module.startswith("google.protobuf"):
        return str(e)
    return None


@contextmanager
def _errors() -> Iterator[None]:
    try:
        yield
    except HoOnnxError as e:
        _fail(str(e))


_EXAMPLE_NAME = {"OUTPUT_MODEL": "model.onnx", "--plot": "plan.png"}


def _refuse_overwriting_inputs(outputs: dict[str, str | None], inputs: list[str | None],
                               *, folder: bool = False) -> None:
    """Refuse before any work an output (option -> path) that is one of the inputs, one of
    an input model's data files, a directory, or a device, FIFO or socket (checked again
    when written); and a file named ``-`` or ending in ``/`` (was written as ``-`` and, for
    ``out/``, a file ``out``), unless the output is a ``folder``."""
    from ho_onnx.graph.load import data_files
    from ho_onnx.graph.save import check_writable, refuse_special

    files: list[Path] = []
    for path in filter(None, inputs):
        files.append(Path(path))
        if files[-1].is_file():
            with suppress(HoOnnxError):  # (not a model: the command reports it itself)
                files.extend(data_files(path))
    for option, out in outputs.items():
        if out is None:
            continue
        if out == "-":
            raise click.UsageError(f"{option} '-': output to standard output is not "
                                   "supported; name a file")
        if out.endswith(os.sep) and not folder:
            raise click.UsageError(f"{option} {out!r} names a folder: name the file to write "
                                   f"(e.g. {out}{_EXAMPLE_NAME.get(option, 'out.json')})")
        try:
            refuse_special(out, option)
            check_writable(out, option)
        except HoOnnxError as e:
            raise click.UsageError(str(e)) from None
        o = Path(out)
        for f in files:
            if _same(o, f):
                raise click.UsageError(f"{option} {out!r} is an input ({str(f)!r}): refusing "
                                       "to write over it")
        if folder:  # a new or empty folder (found by hand: an empty one was refused as "a
            _refuse_folder_output(option, out)  # directory", as the library allows it)
        elif o.is_dir():
            raise click.UsageError(f"{option} {out!r} is a directory")


def _refuse_folder_output(option: str, out: str) -> None:
    """A model folder's output must be a folder (new, or empty: the library checks that) or
    not exist yet; a link to a folder not there yet was "cannot create the folder ...: File
    exists" (found by hand)."""
    if os.path.islink(out) and not os.path.exists(out):
        raise click.UsageError(f"{option} {out!r} is a link to {os.readlink(out)!r}, which does "
                               "not exist: create that folder or choose another path")
    if os.path.exists(out) and not os.path.isdir(out):
        raise click.UsageError(f"{option} {out!r} exists and is not a folder: a model folder "
                               "is optimized into a new or empty folder")


def _costs(machine: str, profile_path: str | None) -> CostSource:
    """The plan's cost source, its machine and profile files read now: a missing or bad one
    fails before the model is read (was: after its analysis)."""
    from ho_onnx.cost.source import CostSource

    costs = CostSource(machine, profile_path)
    costs.check()
    return costs


def _refuse_overwriting_non_json(option: str, out: str) -> None:
    """A JSON output may replace an earlier JSON file, never another kind of file."""
    o = Path(out)
    if not o.is_file() or o.stat().st_size == 0:
        return
    try:
        with open(o, "rb") as f:
            json.loads(f.read(64 << 20))
    except (ValueError, OSError, RecursionError):
        raise click.UsageError(f"{option} {out!r} exists and is not a JSON file: refusing to "
                               "write over it") from None


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except (OSError, ValueError):  # (ValueError: a NUL byte in a path)
        return False


def _log(msg: str) -> None:
    _echo(msg, err=True)


_DIM_HELP = ("Value of a symbolic dimension, NAME=N (repeatable), e.g. --dim seq=2048; a "
             "NAME the model does not use is named (a note, or beside a missing dim).")
_DIM_RANGE_HELP = (_DIM_HELP[:-1] + ". Or a range, NAME=LO..HI, e.g. --dim seq=1..2048: one "
                   "plan for every value, made at the top (memory's worst case), recorded in "
                   "the model and enforced by the library (a run outside is refused).")
_SHAPE_HELP = ("Whole shape of an input, NAME=D0,D1,... (repeatable), for dims without a name "
               "or with an odd one, e.g. --shape x=1,3,48,320; also binds the dims it names.")
_TIMEOUT_HELP = ("End ONNX Runtime's child process after SECONDS (a model can make it run "
                 "forever: a Loop whose condition stays true); one error line, exit 2. "
                 "Default: HO_ONNX_ORT_TIMEOUT, unset: no limit; 0: no limit.")


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ho-onnx")
def main() -> None:
    """ho-onnx: offload tensors of an ONNX model off the device with explicit cache operators.

    \b
    Typical use:
      ho-onnx plan     model.onnx --budget 6GiB --dim batch=1 --dim seq=512
      ho-onnx optimize model.onnx model.ho.onnx --budget 6GiB --dim batch=1 --dim seq=512
      ho-onnx inspect  model.ho.onnx
      ho-onnx verify   model.onnx model.ho.onnx --dim batch=1 --dim seq=512

    Run the optimized model with ho_onnx.InferenceSession(path), or register
    ho_onnx.library_path() with onnxruntime.SessionOptions.register_custom_ops_library
    (and set enable_mem_pattern = False: the budget does not count ORT's memory-pattern
    block).
    """


def _progress_bars():  # type: ignore[no-untyped-def]
    bars: dict[str, object] = {}

    def progress(label: str, done: int, total: int) -> None:
        if total == 0:  # nothing to count (a wait): a line
            _echo(f"{label} ...", err=True)
            return
        bar = bars.get(label)
        if bar is None:
            bar = click.progressbar(length=total, label=printable(label), file=sys.stderr)
            bar.__enter__()  # type: ignore[attr-defined]
            bars[label] = bar
        bar.update(done - bar.pos)  # type: ignore[attr-defined]
        if done >= total:
            bar.__exit__(None, None, None)  # type: ignore[attr-defined]

    return progress


_CPU_EXPERTS_OPTION = click.option(
    "--cpu-experts", type=click.Choice(list(CPU_EXPERTS)), default=_DEFAULTS.cpu_experts,
    show_default=True,
    help="Compute offloaded MoE experts where their weights live: each routed expert MatMul "
         "runs on the CPU EP against the host store (HostMatMul; on a GPU the activations "
         "move instead of the weights). all: every expert; auto (needs --budget): per "
         "expert, where the cost model (--machine, its host_flops/host_mem_bw from "
         "`ho-onnx calibrate`) finds it cheaper than moving the weight.")
# The search after the greedy plan (both commands with a budget; _planner_options).
_SEARCH_OPTIONS = [
    click.option("--refine-s", type=float, default=_DEFAULTS.refine_s,
                 show_default=True,
                 help="Seconds at most the refinement after the greedy plan may search "
                      "(add, drop and swap offloads, issue stalled reloads earlier; each "
                      "move scored by the simulator; a count of tries that grows with the "
                      "graph stops it first unless the machine is overloaded). 0: the "
                      "greedy plan."),
    click.option("--exact-s", type=float, default=_DEFAULTS.exact_s, show_default=True,
                 help="Seconds the exact planner (CP-SAT; pip install ho-onnx[exact]) may "
                      "search the same plan space, on graphs of at most "
                      f"{_DEFAULTS.exact_nodes} nodes; its bound is then the plan's "
                      "lower bound. 0: off."),
]


def _tier_options() -> list:  # type: ignore[type-arg]
    """Options of where offloaded weights wait (for `_planner_options`)."""
    return [
        click.option("--weight-tier", type=click.Choice(list(kinds.tier_names())),
                     default=_DEFAULTS.weight_tier,
                     show_default=True,
                     help="Where offloaded weights wait: the library's host store, or the "
                          "model's data file (read at every reload)."),
        click.option("--host-budget", type=SizeType(), default=None,
                     help="Host (slow-tier) memory budget: offloaded weights that do not fit "
                          "stay in the model's data file and are read from disk at each use."),
        click.option("--expert-cache", default=_DEFAULTS.expert_cache, show_default=True,
                     metavar="BYTES|auto|0",
                     help="The library's expert cache for routed MoE experts on the disk tier "
                          "(kept across tokens, least recently used first out: a hit is "
                          "not read from the file again): its size, 'auto' (with --budget "
                          "the slack the plan leaves under it, counted in the budget; without "
                          "a budget none), or 0 (none)."),
        click.option("--decode-cache/--no-decode-cache", default=_DEFAULTS.decode_cache,
                     show_default=True,
                     help="With --dim ranges and --weight-tier disk: where a run's dims "
                          "leave room under the budget (a decode step of a plan made for "
                          "prefills), keep streamed weights in library memory across runs, so "
                          "they are not read from the file again, or read the next ones ahead "
                          "(the planner splits the room by its simulation); each run's Guards "
                          "size it from that run's dims (a prefill empties it). `plan` says "
                          "what each point of the ranges keeps and reads ahead. Off by "
                          "default: the room is the plan's, and ORT's CPU arena keeps what a "
                          "prefill allocated, so the process holds the cache on top of it."),
        click.option("--speculate-experts", type=click.Choice(list(SPECULATE_EXPERTS)),
                     default=_DEFAULTS.speculate_experts, show_default=True,
                     help="Read the next MoE layer's likely experts into the expert cache a "
                          "layer early (its router applied to this layer's router input, as "
                          "mixtral-offloading does); the outputs are unchanged whatever the "
                          "guess. auto (with --budget): where the cost model says it pays; "
                          "on: wherever the graph and the cache allow; off. `plan` says why "
                          "a layer was left out."),
    ]


_RECOMPUTE_OPTION = click.option(
    "--recompute", type=click.Choice(list(RECOMPUTE)), default=_DEFAULTS.recompute,
    show_default=True,
    help="A stored activation whose producer (and the few deterministic, cheap nodes it "
         "needs: elementwise, layout, normalization) can run again before its late readers is "
         "computed again instead of stored and reloaded. auto (with --budget): where the "
         "simulated run is faster and the plan still fits; on: wherever it fits; off. `plan "
         "--json` says why each stored one was not.")


_ORT_REUSE_HELP = (
    "ORT's buffer reuse in the sessions that run the model (a freed buffer given to a later "
    "value of the same shape, held across the gap: on a fixed-shape decoder up to ~2x the "
    "tensors' peak). off plans for sessions without it, recorded in the model, which "
    "ho-onnx's Python sessions then set; genai and Triton cannot (no C API call), so their "
    "folders are refused.")


def _planner_options(f):  # type: ignore[no-untyped-def]
    """Options shared by `optimize --budget` and `plan`."""
    opts = [
        click.option("--machine", default="cpu", show_default=True, metavar="NAME|FILE",
                     help="Target the cost model describes: a preset (h100, h200, cpu) or a "
                          "JSON machine file (e.g. from `ho-onnx calibrate`)."),
        click.option("--profile", "profile_path", type=click.Path(exists=True, dir_okay=False),
                     default=None,
                     help="Per-node times from `ho-onnx profile` of the unmodified model "
                          "(default: analytic roofline estimates on --machine)."),
        click.option("--min-gap", type=int, default=_DEFAULTS.min_gap,
                     show_default=True,
                     help="Offload an activation only across a gap of at least this many "
                          "nodes between two of its uses."),
        *_tier_options(),
        click.option("--arena-refits", type=int,
                     default=_DEFAULTS.arena_refits, show_default=True,
                     help="ORT's arena holds more than the live tensors (it keeps reused "
                          "buffers): while its replayed peak exceeds --budget, plan again for "
                          "a lower budget, at most this many times; 0 fits the tensors only."),
        click.option("--ort-reuse", type=click.Choice(["on", "off"]), default="on",
                     show_default=True, help=_ORT_REUSE_HELP),
        click.option("--max-blocks", type=int, default=_DEFAULTS.max_blocks, show_default=True,
                     help="A weight read whole by one MatMul/Gemm (an lm_head, a tied "
                          "embedding's) may be streamed in up to this many column blocks, "
                          "where the planner predicts it pays: the budget can then fall "
                          "below the weight. 0 keeps every weight whole."),
        *_SEARCH_OPTIONS,
        _RECOMPUTE_OPTION,
        click.option("--offload-kv", "offload_kv", is_flag=True,
                     help="Keep the KV cache of a decoder exported with past in the caller's "
                          "host memory: each layer's past is copied in just before its "
                          "attention and each present leaves right after its last reader "
                          "(found by structure; see docs/llm.md). The budget then holds one "
                          "layer's cache, not every layer's."),
        _CPU_EXPERTS_OPTION,
        click.option("--dim", "dims", multiple=True, metavar="NAME=N|NAME=LO..HI",
                     help=_DIM_RANGE_HELP),
        click.option("--shape", "shapes", multiple=True, metavar="NAME=D0,D1,...",
                     help=_SHAPE_HELP),
        click.option("--point", "points", multiple=True, metavar="NAME:DIM=N[,DIM=N...]",
                     help="A named point of the ranges (repeatable), like a TensorRT "
                          "optimization profile, e.g. --point decode:seq=1,past=4095 --point "
                          "prefill:seq=2048,past=0: the ranged dims it leaves out at their "
                          "bottom. The plan's times, so its prefetch windows, are taken at the "
                          "first point (default: the bottom of the ranges; memory stays "
                          "planned at the top); its peak and time at every point are shown "
                          "and recorded (ho_onnx.range_points)."),
        click.option("--ort-optimize", "ort_level", type=click.Choice(["basic", "extended"]),
                     default=None,
                     help="First apply ONNX Runtime's own graph optimizations (fusions, "
                          "constant folding) and plan the graph ORT will run; reads the "
                          "weights once. 'extended' adds ORT-only contrib ops."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _options(offload: str, **kw: object) -> OffloadOptions:
    """Options from the command line; options not given keep OffloadOptions' defaults.
    OffloadOptions checks them (one place); its error names a field given here by its flag."""
    given = {k: v for k, v in kw.items() if v is not None}
    try:
        return OffloadOptions(**offload_kinds(offload), **given)  # type: ignore[arg-type]
    except ValueError as e:
        flags = {k: "--" + k.replace("_", "-") for k in given if "_" in k}
        raise click.UsageError(re.sub(r"\b[a-z]+(?:_[a-z]+)+\b",
                                      lambda m: flags.get(m[0], m[0]), str(e))) from None


@main.command()
@click.argument("input_model", type=click.Path())
@click.argument("output_model", type=click.Path())
@click.option("--budget", type=SizeType(), default=None,
              help="Fast-tier memory budget (e.g. 6GiB): the planner chooses what to offload "
                   "and when, so the simulated peak fits with the least predicted stall. "
                   "Without it, the explicit --offload policy applies to every tensor.")
@click.option("--offload", type=click.Choice(["all", "weights", "activations", "none"]),
              default="all", show_default=True,
              help="Which tensors may leave the fast tier: initializers (weights), "
                   "intermediate tensors with a gap between uses (activations), or both.")
@click.option("--min-bytes", type=SizeType(), default=None,
              help="Tensors smaller than this stay resident [default: "
                   f"{format_bytes(MIN_BYTES_EXPLICIT, 'MiB', 0)}, "
                   f"{format_bytes(MIN_BYTES_BUDGET, 'KiB', 0)} with --budget].")
@click.option("--prefetch-distance", type=int, default=None,
              help="Without --budget: compute nodes between a Prefetch and its Wait "
                   f"[default: {_DEFAULTS.prefetch_distance}]. Refused with --budget: the "
                   "planner places every Prefetch.")
@_planner_options
def optimize(input_model: str, output_model: str, budget: int | None, offload: str,
             min_bytes: int | None, prefetch_distance: int | None, machine: str,
             profile_path: str | None, min_gap: int, weight_tier: str,
             host_budget: int | None, expert_cache: str, decode_cache: bool,
             speculate_experts: str,
             arena_refits: int, ort_reuse: str, max_blocks: int,
             refine_s: float, exact_s: float, recompute: str, offload_kv: bool,
             cpu_experts: str,
             dims: tuple[str, ...], shapes: tuple[str, ...], points: tuple[str, ...],
             ort_level: str | None) -> None:
    """Rewrite INPUT_MODEL into OUTPUT_MODEL with Prefetch/Wait/Store/Detach cache ops.

    INPUT_MODEL may be a model folder: onnxruntime-genai (genai_config.json + model) or
    Optimum (config.json + model.onnx); OUTPUT_MODEL is then a new (or empty) folder, ready
    to run: the optimized model, its data, every other file, and for genai the op library
    copied in with genai_config.json's session options set (see docs/llm.md). Only files
    inside the folder are copied: a link out of it, a FIFO or a device is refused up front.

    Weight bytes are never loaded while planning. External data stays where it is; when
    OUTPUT_MODEL is in another folder the data files are cloned (copy-on-write) or copied
    there, with progress. The input is never modified and nothing is left behind on failure;
    a budget below the smallest feasible one fails first, naming that budget.
    """
    from ho_onnx.rewrite.pipeline import optimize as run

    _refuse_overwriting_inputs({"OUTPUT_MODEL": output_model},
                               [profile_path, machine if os.path.isfile(machine) else None],
                               folder=os.path.isdir(input_model))
    with _errors():
        options = _options(offload, budget=budget, min_bytes=min_bytes, min_gap=min_gap,
                           weight_tier=weight_tier, host_budget=host_budget,
                           prefetch_distance=prefetch_distance, arena_refits=arena_refits,
                           ort_reuse=ort_reuse == "on", max_blocks=max_blocks, kv=offload_kv,
                           cpu_experts=cpu_experts, refine_s=refine_s, exact_s=exact_s,
                           expert_cache=expert_cache, decode_cache=decode_cache,
                           speculate_experts=speculate_experts, recompute=recompute)
        costs = _costs(machine, profile_path)
        ranges: dict[str, tuple[int, int]] = {}
        bound = parse_dims(dims, ranges)
        named = parse_points(points)

        def run_file(src: object, dst: object):  # type: ignore[no-untyped-def]
            return run(src, dst, options, bound,  # type: ignore[arg-type]
                       costs=costs, ort_level=ort_level, log=_log,
                       progress=_progress_bars(), shapes=parse_shape_options(shapes),
                       dim_ranges=ranges, dim_points=named)

        if Path(input_model).is_dir():
            from ho_onnx.target.ort.folders import optimize_folder

            results = []
            folder = optimize_folder(input_model, output_model,
                                     lambda a, b: results.append(run_file(a, b)))
            result = results[0]
            _log(f"{folder.kind} folder {output_model}: {folder.model.name}"
                 + (f", library {folder.library.name}" if folder.library else "")
                 + (f", copied {', '.join(folder.copied)}" if folder.copied else ""))
        else:
            result = run_file(input_model, output_model)
    _say_result(output_model, result)


def _say_result(output_model: str, result: Any) -> None:
    """What optimize wrote, and the plan's prediction."""
    c = result.choice
    kv = f"; the KV cache ({len(c.inputs)} past, {len(c.outputs)} present) in host memory" \
        if c.inputs or c.outputs else ""
    _echo(f"{output_model}: {len(c.weights)} weights, {len(c.activations)} activations "
          f"offloaded, {c.offloaded_bytes:,} bytes{kv}")
    if result.plan is not None:
        p = result.plan
        _echo(f"predicted peak {format_bytes(p.planned.peak_bytes, 'MiB', 1)} (budget "
              f"{format_bytes(p.budget, 'MiB', 1)}), time x"
              f"{p.planned.total_s / p.baseline.total_s if p.baseline.total_s else 1:.3f}")
        _echo(p.arena_summary())


@main.command()
@click.argument("input_model", type=click.Path())
@click.option("--budget", type=SizeType(), required=True,
              help="Fast-tier memory budget, e.g. 6GiB.")
@click.option("--offload", type=click.Choice(["all", "weights", "activations"]),
              default="all", show_default=True, help="Which tensors may leave the fast tier.")
@click.option("--min-bytes", type=SizeType(), default=None,
              help="Tensors smaller than this stay resident [default: "
                   f"{format_bytes(MIN_BYTES_BUDGET, 'KiB', 0)}].")
@_planner_options
@click.option("--json", "as_json", is_flag=True,
              help="Print the plan as JSON (with the simulator's per-step trace).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of device memory over the schedule, before and after, with "
                   "the transfers on their copy channels (needs matplotlib).")
def plan(input_model: str, budget: int, offload: str, min_bytes: int | None, machine: str,
         profile_path: str | None, min_gap: int, weight_tier: str, host_budget: int | None,
         expert_cache: str, decode_cache: bool, speculate_experts: str, arena_refits: int,
         ort_reuse: str, max_blocks: int,
         refine_s: float,
         exact_s: float, recompute: str, offload_kv: bool, cpu_experts: str,
         dims: tuple[str, ...],
         shapes: tuple[str, ...], points: tuple[str, ...], ort_level: str | None,
         as_json: bool, plot_path: str | None) -> None:
    """Plan INPUT_MODEL under --budget and print the plan; nothing is written.

    The table lists every transfer (bytes, prefetch window in steps and compute ms, copy
    time, predicted stall), the peak and the predicted time before and after.
    """
    from ho_onnx.graph.moe import find_experts
    from ho_onnx.rewrite.pipeline import cache_budget, plan_model, range_points

    _refuse_overwriting_inputs({"--plot": plot_path}, [input_model, profile_path,
                                                       machine if os.path.isfile(machine)
                                                       else None])
    with _errors():
        if plot_path:  # (before planning: a format matplotlib cannot write, or no matplotlib)
            from ho_onnx.report.plot import image_format

            image_format(plot_path)
        costs = _costs(machine, profile_path)
        ranges: dict[str, tuple[int, int]] = {}
        bound = parse_dims(dims, ranges)
        named = parse_points(points)
        loaded, analysis, p = plan_model(
            _model_in(input_model),
            _options(offload, budget=budget, min_bytes=min_bytes, min_gap=min_gap,
                     weight_tier=weight_tier, host_budget=host_budget,
                     arena_refits=arena_refits, ort_reuse=ort_reuse == "on",
                     max_blocks=max_blocks, kv=offload_kv,
                     cpu_experts=cpu_experts, refine_s=refine_s, exact_s=exact_s,
                     expert_cache=expert_cache, decode_cache=decode_cache,
                     speculate_experts=speculate_experts,
                     recompute=recompute),
            bound, costs, ort_level=ort_level, log=_log, shapes=parse_shape_options(shapes),
            dim_ranges=ranges, dim_points=named)
        names = [analysis.node_at(i).name or analysis.node_at(i).op_type
                 for i in range(len(analysis.order))]
        if plot_path:
            from ho_onnx.report.plot import plot_timeline

            plot_timeline(p, names, plot_path)
            _log(f"wrote {plot_path}")
        moe = find_experts(analysis)
        figures = range_points(loaded, p.choice, bound, ranges, parse_shape_options(shapes),
                               named, costs, cache_budget(p.options),
                               p.options.ort_reuse) if ranges else {}
    _print_plan(p, names, moe, ranges, named, figures, as_json)


def _print_plan(p: Any, names: list[str], moe: Any, ranges: dict[str, tuple[int, int]],
                named: dict[str, Any], figures: dict[str, Any], as_json: bool) -> None:
    """`plan`'s output: the table, the experts and the range points, or all as JSON."""
    from ho_onnx.graph.dims import format_ranges
    from ho_onnx.report.text import format_moe, format_plan, moe_to_dict, plan_to_dict
    from ho_onnx.rewrite.pipeline import format_points
    from ho_onnx.schedule.decode_cache import describe as describe_decode_cache

    if as_json:
        _echo(json.dumps(plan_to_dict(p, names, steps=True) | {"moe": moe_to_dict(moe)}
                         | ({"dim_ranges": {k: list(v) for k, v in ranges.items()},
                             "range_points": {k: dataclasses.asdict(f)
                                              for k, f in figures.items()}}
                            if ranges else {}), indent=1))
    else:
        _echo(format_plan(p, names))
        if moe:
            _echo(format_moe(moe))
        if ranges:
            _echo(f"ranges: {format_ranges(ranges)}, planned at the top of each, timed at "
                  + (f"point {next(iter(named))!r}" if named else "the bottom") + "; "
                  + format_points(figures))
            c = p.choice
            if c.decode_cache is not None or c.decode_cache_skipped:
                _echo(describe_decode_cache(c.decode_cache) if c.decode_cache is not None
                      else f"decode cache: none ({c.decode_cache_skipped})")



@main.command()
@click.argument("model", type=click.Path(exists=True))
@click.option("--out", "out_json", type=click.Path(dir_okay=False), required=True,
              help="Where to write the per-node times (JSON).")
@click.option("--provider", default="CPUExecutionProvider", show_default=True,
              help="ORT execution provider to profile on; one this onnxruntime lacks is an "
                   "error (ORT itself would run on the CPU instead).")
@click.option("--dim", "dims", multiple=True, metavar="NAME=N", help=_DIM_HELP)
@click.option("--shape", "shapes", multiple=True, metavar="NAME=D0,D1,...", help=_SHAPE_HELP)
@click.option("--runs", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True)
@click.option("--opt-level", type=click.Choice(["disable", "basic", "extended", "all"]),
              default="disable", show_default=True,
              help="ORT graph optimizations while profiling: 'disable' times every original "
                   "node; 'all' times what really runs (fused nodes).")
@click.option("--int-high", type=_INT_HIGH, default=8, show_default=True,
              help="Integer inputs are drawn from [0, INT_HIGH).")
@click.option("--timeout", "timeout_s", type=_NON_NEGATIVE, default=None,
              metavar="SECONDS", help=_TIMEOUT_HELP)
def profile(model: str, out_json: str, provider: str, dims: tuple[str, ...],
            shapes: tuple[str, ...], runs: int, warmup: int, opt_level: str,
            int_high: int, timeout_s: float | None) -> None:
    """Run the unmodified MODEL under ORT's profiler and save median per-node times, for
    `optimize --budget ... --profile FILE` and `plan --profile FILE`.

    On a GPU provider ORT's release builds time kernel launches, not kernels: the planner
    then uses the profile's run time (analytic node times scaled to it) and times loads as
    the CUDA engine issues them.

    An optimized MODEL runs with the ho-onnx library (its Prefetch/Wait times show where
    transfers stall); planning from such a profile leaves those out of compute."""
    from ho_onnx.target.ort.profile import profile_model

    _refuse_overwriting_inputs({"--out": out_json}, [model])
    _refuse_overwriting_non_json("--out", out_json)
    with _errors():
        _log(f"profiling {model}: {warmup} warm-up + {runs} measured runs on {provider}")
        r = profile_model(_model_in(model), out_json, providers=[provider], dims=parse_dims(dims),
                          runs=runs, warmup=warmup, opt_level=opt_level, int_high=int_high,
                          shapes=parse_shape_options(shapes), timeout_s=timeout_s, log=_log)
    _echo(f"{out_json}: {len(r['nodes'])} nodes, median run "
          f"{r['total_median_s'] * 1e3:.3f} ms")


@main.command()
@click.argument("original", type=click.Path(exists=True))
@click.argument("optimized", type=click.Path(exists=True))
@click.option("--dim", "dims", multiple=True, metavar="NAME=N", help=_DIM_HELP)
@click.option("--shape", "shapes", multiple=True, metavar="NAME=D0,D1,...", help=_SHAPE_HELP)
@click.option("--runs", type=click.IntRange(min=1), default=2, show_default=True,
              help="Runs, each on fresh random inputs.")
@click.option("--seed", type=_SEED, default=0, show_default=True,
              help="Seed of the random inputs.")
@click.option("--int-high", type=_INT_HIGH, default=8, show_default=True,
              help="Integer inputs are drawn from [0, INT_HIGH) (keeps token ids in range).")
@click.option("--atol", type=_NON_NEGATIVE, default=0.0, show_default=True,
              help="Absolute tolerance; with --rtol 0 and --atol 0 outputs must be bit-exact "
                   "(where ORT's fusions differ: bit-exact with graph optimizations off, "
                   "then within atol 1e-5 rtol 1e-4, said in the verdict).")
@click.option("--rtol", type=_NON_NEGATIVE, default=0.0, show_default=True,
              help="Relative tolerance.")
@click.option("--execution-order", type=click.Choice(["priority", "default"]),
              default="priority", show_default=True, help="ORT execution order of both runs.")
@click.option("--prepacking/--no-prepacking", default=False, show_default=True,
              help="Let ORT pre-pack constant weights (the optimized model then differs by "
                   "rounding: use a tolerance).")
@click.option("--opt-level", type=click.Choice(["disable", "basic", "extended", "all"]),
              default="all", show_default=True,
              help="ORT graph optimization level of both sessions. Fusions that need constant "
                   "weights do not apply to offloaded ones; 'disable' makes the paths "
                   "identical.")
@click.option("--provider", "providers", multiple=True, default=("CPUExecutionProvider",),
              show_default=True, help="ORT execution provider (repeatable, in priority order); "
                                      "one this onnxruntime lacks is an error (ORT itself "
                                      "would run on the CPU instead).")
@click.option("--timeout", "timeout_s", type=_NON_NEGATIVE, default=None,
              metavar="SECONDS", help=_TIMEOUT_HELP)
@click.option("--json", "as_json", is_flag=True,
              help="Print the report as JSON (a difference that is not finite, where one "
                   "model gives NaN or inf and the other does not, is null).")
def verify(original: str, optimized: str, dims: tuple[str, ...], shapes: tuple[str, ...],
           runs: int, seed: int, int_high: int, atol: float, rtol: float,
           execution_order: str, prepacking: bool, opt_level: str,
           providers: tuple[str, ...], timeout_s: float | None, as_json: bool) -> None:
    """Run ORIGINAL and OPTIMIZED on the same random inputs and compare every output.

    Either may be a genai or Optimum model folder (its model is compared). Input shapes
    come from --dim and --shape as for `plan` (expression dims evaluated; every missing
    dim named in one error); attention masks are ones, strings "s<integer>". Sequence and
    map outputs are compared tensor by tensor. Exits 1 when an output differs
    beyond the tolerances (bit-exact by default; where ORT fuses kernels around a constant
    the optimized model offloads, bit-exact with graph optimizations off and then within
    atol 1e-5 rtol 1e-4, as the verdict says). ONNX Runtime runs in a child process:
    if it crashes on a model, that is one error line (exit 2).
    """
    from ho_onnx.target.ort.verify import verify as run

    with _errors():
        report = run(_model_in(original), _model_in(optimized), dims=parse_dims(dims),
                     runs=runs, seed=seed, int_high=int_high, providers=list(providers),
                     execution_order=execution_order, prepacking=prepacking, atol=atol,
                     rtol=rtol, opt_level=opt_level, shapes=parse_shape_options(shapes),
                     timeout_s=timeout_s, log=_log)
    if as_json:
        _echo(json.dumps({"ok": report.ok, "exact": report.exact,
                          "exact_unfused": report.exact_unfused, "atol": report.atol,
                          "rtol": report.rtol, "runs": report.runs,
                          "seconds_original": report.seconds_original,
                          "seconds_optimized": report.seconds_optimized,
                          "outputs": [{k: v if not isinstance(v, float) or math.isfinite(v)
                                       else None for k, v in vars(o).items()}
                                      for o in report.outputs]}, indent=2))
    else:
        for o in report.outputs:
            status = "exact" if o.exact else ("close" if o.close else "MISMATCH")
            _echo(f"{printable(o.name, cell=True):<24} {list(o.shape)!s:<18} "
                  f"max_abs={o.max_abs:.3g} max_rel={o.max_rel:.3g}  {status}")
        med = sorted(report.seconds_original)[len(report.seconds_original) // 2]
        med_opt = sorted(report.seconds_optimized)[len(report.seconds_optimized) // 2]
        _echo(f"median run: original {med * 1e3:.1f} ms, optimized {med_opt * 1e3:.1f} ms "
              "(first runs include warm-up)")
        _echo(f"{report.runs} run(s): " + ("OK" if report.ok else "MISMATCH")
              + (" (bit-exact)" if report.exact else _why_not_exact(report, opt_level)))
    sys.exit(0 if report.ok else 1)


def _why_not_exact(report: Any, opt_level: str) -> str:
    """The verdict's reason when ``report`` (a VerifyReport) is not bit-exact."""
    tol = f"atol={report.atol:g} rtol={report.rtol:g}"
    if report.exact_unfused is None:
        return f" (within {tol})" if report.ok else ""
    if report.exact_unfused:
        return (f" (bit-exact with ORT's graph optimizations off; at --opt-level "
                f"{opt_level} ORT fuses kernels around constants the optimized model "
                f"offloads, which round differently: compared within {tol})")
    return " (not bit-exact with ORT's graph optimizations off either)"


@main.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.argument("repository", type=click.Path(file_okay=False))
@click.option("--name", required=True, help="Model name: the entry's folder in REPOSITORY.")
@click.option("--version", "model_version", type=click.IntRange(min=1), default=1,
              show_default=True, help="The version folder (the only version served).")
@click.option("--triton-release", default=None,
              help="Triton release of the container, e.g. 26.08: gives its onnxruntime "
                   "(a table from Triton's build.py, 23.12 to 26.08).")
@click.option("--ort-version", default=None,
              help="The container's onnxruntime, e.g. 1.24.4 (for releases not in the table).")
@click.option("--container-repo", default="/models", show_default=True,
              help="Where the container sees REPOSITORY (op_library_filename is absolute).")
@click.option("--kind", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True,
              help="Instance kind (instance_group).")
@click.option("--instances", type=click.IntRange(min=1, max=1024), default=1,
              show_default=True, help="Instances (sessions) of the model.")
@click.option("--host-pool-limit", type=SizeType(1), default=None,
              help="Bound of the library's host pool of stored activations for this model "
                   "(ho_onnx.host_pool_limit_bytes; default: half the machine's memory).")
def triton(model: str, repository: str, name: str, model_version: int,
           triton_release: str | None, ort_version: str | None, container_repo: str,
           kind: str, instances: int, host_pool_limit: int | None) -> None:
    """Write MODEL as the Triton model repository entry REPOSITORY/NAME.

    \b
    REPOSITORY/NAME/config.pbtxt            backend onnxruntime, inputs/outputs, op library
    REPOSITORY/NAME/VERSION/model.onnx      with its data files
    REPOSITORY/NAME/VERSION/libho_onnx_ops.so + ho_onnx.config

    Triton's onnxruntime backend passes no ho_onnx.* session config entry, so the op
    library copy finds its model folder itself: its own folder, marked by ho_onnx.config
    (see docs/serving.md). The container's onnxruntime (--triton-release or
    --ort-version) is checked against the library's. NAME must not exist yet.
    """
    from ho_onnx.target.ort.triton import write_triton_entry

    with _errors():
        entry = write_triton_entry(model, repository, name, version=model_version,
                                   triton_release=triton_release, ort_version=ort_version,
                                   container_repo=container_repo, kind=kind,
                                   instances=instances, host_pool_limit=host_pool_limit)
    _echo(f"{entry.folder}: config.pbtxt, {model_version}/ {', '.join(entry.files)} "
          f"(container onnxruntime {entry.ort_version})")


@main.command()
@click.argument("model", type=click.Path(exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def inspect(model: str, as_json: bool) -> None:
    """Show what MODEL offloads: each transfer, its bytes, its prefetch window, the plan.

    Also checks what would fail at run time: ORT's CUDA placement is replayed (every
    transfer's cache ops must run on one provider, else SPLIT chains are named), and cache
    ops ONNX Runtime would refuse (a damaged model) are listed. MODEL may be a genai or
    Optimum folder. Reads no weight bytes.
    """
    from ho_onnx.report.inspect import format_summary, summarize

    with _errors():
        s = summarize(_model_in(model))
    _echo(json.dumps(s.to_dict(), indent=2) if as_json else format_summary(s))


@main.command()
@click.option("--out", "out_json", type=click.Path(dir_okay=False), required=True,
              help="Machine file to write (use it with --machine FILE).")
@click.option("--base", type=click.Choice(["cpu", "h100", "h200"]), default="cpu",
              show_default=True, help="Preset the measured rates are merged onto.")
@click.option("--file", "data_file", type=click.Path(exists=True, dir_okay=False),
              default=None, help="Measure disk reads of this file (e.g. a model's data file) "
                                 "instead of a temporary one.")
@click.option("--size", type=SizeType(1 << 20), default="1GiB", show_default=True,
              help="Size of the temporary file for the disk measurement.")
@click.option("--dir", "directory", type=click.Path(file_okay=False, exists=True), default=None,
              help="Folder for the temporary file (the disk you will stream from).")
def calibrate(out_json: str, base: str, data_file: str | None, size: int,
              directory: str | None) -> None:
    """Measure host->device / device->host copy rates (pinned, on a GPU; host memcpy on the
    CPU) and the disk read rate (O_DIRECT), and write them as a machine file. With --base
    cpu (the CPU EP) also ONNX Runtime's own compute rates: a MatMul's FLOP/s, the rate
    one-row MatMuls read distinct weights at (a decode step's memory term) and what each
    MatMul costs beyond it, a KV cache's Concat and Transpose rates, and the cost of one
    node, so that plans are timed as this machine runs them."""
    from ho_onnx.target.ort.calibrate import calibrate as run

    _refuse_overwriting_inputs({"--out": out_json}, [data_file])
    _refuse_overwriting_non_json("--out", out_json)
    with _errors():
        r = run(out_json, base=base, file=data_file, size=size, directory=directory, log=_log)
    _echo(f"{out_json}: h2d {float(r['h2d_bw']) / 1e9:.2f} GB/s, d2h "  # type: ignore[arg-type]
          f"{float(r['d2h_bw']) / 1e9:.2f} GB/s, disk {float(r['disk_bw']) / 1e9:.2f} GB/s"  # type: ignore[arg-type]
          + (f"; compute {float(r['peak_flops']) / 1e9:.1f} GFLOP/s, weight reads "  # type: ignore[arg-type]
             f"{float(r['mem_bw']) / 1e9:.1f} GB/s, "  # type: ignore[arg-type]
             f"{float(r['launch_overhead_s']) * 1e6:.2f} us per node"  # type: ignore[arg-type]
             if "peak_flops" in r else ""))
