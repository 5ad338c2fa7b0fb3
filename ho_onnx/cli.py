"""The ``ho-onnx`` command line: optimize, verify, inspect."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import click

from . import __version__
from .errors import HoOnnxError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def parse_size(text: str) -> int:
    """``'8GiB'`` → 8589934592; plain integers are bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (examples: 4096, 64MiB, 8GiB, 1.5GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_dims(items: tuple[str, ...]) -> dict[str, int]:
    """``('batch=1', 'seq=128')`` → ``{'batch': 1, 'seq': 128}``."""
    dims: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value.strip().isdigit():
            raise click.BadParameter(f"{item!r}: expected NAME=INTEGER, e.g. seq=2048",
                                     param_hint="--dim")
        dims[name.strip()] = int(value)
    return dims


class SizeType(click.ParamType):
    name = "size"

    def convert(self, value, param, ctx):  # type: ignore[no-untyped-def]
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


@contextmanager
def _errors() -> Iterator[None]:
    try:
        yield
    except HoOnnxError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


def _log(msg: str) -> None:
    click.echo(msg, err=True)


_DIM_HELP = "Value of a symbolic dimension, NAME=N (repeatable), e.g. --dim seq=2048."


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ho-onnx")
def main() -> None:
    """ho-onnx: offload tensors of an ONNX model off the device with explicit cache operators.

    \b
    Typical use:
      ho-onnx optimize model.onnx model.ho.onnx --offload all --dim batch=1 --dim seq=512
      ho-onnx inspect model.ho.onnx
      ho-onnx verify model.onnx model.ho.onnx --dim batch=1 --dim seq=512

    Run the optimized model with ho_onnx.InferenceSession(path), or register
    ho_onnx.library_path() with onnxruntime.SessionOptions.register_custom_ops_library.
    """


@main.command()
@click.argument("input_model", type=click.Path(dir_okay=False))
@click.argument("output_model", type=click.Path(dir_okay=False))
@click.option("--offload", "what", type=click.Choice(["all", "weights", "activations", "none"]),
              default="all", show_default=True,
              help="Which tensors may leave the fast tier: initializers (weights), "
                   "intermediate tensors with a gap between uses (activations), or both.")
@click.option("--min-bytes", type=SizeType(), default="1MiB", show_default=True,
              help="Tensors smaller than this stay resident (e.g. 0, 64KiB, 1MiB).")
@click.option("--min-gap", type=click.IntRange(min=1), default=2, show_default=True,
              help="Offload an activation only across a gap of at least this many nodes "
                   "between two of its uses.")
@click.option("--prefetch-distance", type=click.IntRange(min=0), default=2, show_default=True,
              help="Compute nodes between a Prefetch and its Wait (the prefetch window).")
@click.option("--dim", "dims", multiple=True, metavar="NAME=N", help=_DIM_HELP)
def optimize(input_model: str, output_model: str, what: str, min_bytes: int, min_gap: int,
             prefetch_distance: int, dims: tuple[str, ...]) -> None:
    """Rewrite INPUT_MODEL into OUTPUT_MODEL with Prefetch/Wait/Store/Detach cache ops.

    Weight bytes are never loaded while planning. External data stays where it is; when
    OUTPUT_MODEL is in another folder the data files are cloned (copy-on-write) or copied
    there, with progress. The input is never modified and nothing is left behind on failure.
    """
    from .choice import OffloadPolicy
    from .pipeline import optimize as run

    with _errors():
        policy = OffloadPolicy(what, min_bytes, min_gap, prefetch_distance)  # type: ignore[arg-type]
        bars: dict[str, object] = {}

        def progress(label: str, done: int, total: int) -> None:
            bar = bars.get(label)
            if bar is None:
                bar = click.progressbar(length=total, label=label, file=sys.stderr)
                bar.__enter__()  # type: ignore[attr-defined]
                bars[label] = bar
            bar.update(done - bar.pos)  # type: ignore[attr-defined]
            if done >= total:
                bar.__exit__(None, None, None)  # type: ignore[attr-defined]

        result = run(input_model, output_model, policy, parse_dims(dims), log=_log,
                     progress=progress)
    click.echo(f"{output_model}: {len(result.choice.weights)} weights, "
               f"{len(result.choice.activations)} activations offloaded, "
               f"{result.choice.offloaded_bytes:,} bytes")


@main.command()
@click.argument("original", type=click.Path(exists=True, dir_okay=False))
@click.argument("optimized", type=click.Path(exists=True, dir_okay=False))
@click.option("--dim", "dims", multiple=True, metavar="NAME=N", help=_DIM_HELP)
@click.option("--runs", type=click.IntRange(min=1), default=2, show_default=True,
              help="Runs, each on fresh random inputs.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--int-high", type=click.IntRange(min=1), default=8, show_default=True,
              help="Integer inputs are drawn from [0, INT_HIGH) (keeps token ids in range).")
@click.option("--atol", type=float, default=0.0, show_default=True,
              help="Absolute tolerance; with --rtol 0 and --atol 0 outputs must be bit-exact.")
@click.option("--rtol", type=float, default=0.0, show_default=True, help="Relative tolerance.")
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
              show_default=True, help="ORT execution provider (repeatable, in priority order).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def verify(original: str, optimized: str, dims: tuple[str, ...], runs: int, seed: int,
           int_high: int, atol: float, rtol: float, execution_order: str, prepacking: bool,
           opt_level: str, providers: tuple[str, ...], as_json: bool) -> None:
    """Run ORIGINAL and OPTIMIZED on the same random inputs and compare every output.

    Exits 1 when an output differs beyond the tolerances (bit-exact by default).
    """
    from .verify import verify as run

    with _errors():
        report = run(original, optimized, dims=parse_dims(dims), runs=runs, seed=seed,
                     int_high=int_high, providers=list(providers),
                     execution_order=execution_order, prepacking=prepacking, atol=atol,
                     rtol=rtol, opt_level=opt_level)
    if as_json:
        click.echo(json.dumps({"ok": report.ok, "exact": report.exact, "runs": report.runs,
                               "seconds_original": report.seconds_original,
                               "seconds_optimized": report.seconds_optimized,
                               "outputs": [vars(o) for o in report.outputs]}, indent=2))
    else:
        for o in report.outputs:
            status = "exact" if o.exact else ("close" if o.close else "MISMATCH")
            click.echo(f"{o.name:<24} {list(o.shape)!s:<18} max_abs={o.max_abs:.3g} "
                       f"max_rel={o.max_rel:.3g}  {status}")
        med = sorted(report.seconds_original)[len(report.seconds_original) // 2]
        med_opt = sorted(report.seconds_optimized)[len(report.seconds_optimized) // 2]
        click.echo(f"median run: original {med * 1e3:.1f} ms, optimized {med_opt * 1e3:.1f} ms "
                   "(first runs include warm-up)")
        click.echo(f"{report.runs} run(s): " + ("OK" if report.ok else "MISMATCH")
                   + (" (bit-exact)" if report.exact else ""))
    sys.exit(0 if report.ok else 1)


@main.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def inspect(model: str, as_json: bool) -> None:
    """Show what MODEL offloads: each transfer, its bytes, its prefetch window, the plan."""
    from .inspect_model import format_summary, summarize

    with _errors():
        s = summarize(model)
    click.echo(json.dumps(s.to_dict(), indent=2) if as_json else format_summary(s))


if __name__ == "__main__":
    main()
