"""Run an original and an optimized model on the same random inputs and compare outputs.

Both sessions get the same options. Pre-packing is disabled in both by default: ORT
pre-packs a constant MatMul weight, an offloaded weight is no longer constant, and the two
kernels round differently (~1e-5); with pre-packing off the paths are identical and the
outputs are expected to be bit-exact.

ORT's graph optimizations can still differ: a fusion (LayerNormalization, Gemm, FastGelu,
...) that needs a resident constant does not apply when that constant is offloaded, and the
unfused kernels round differently (~1e-7). So a strict comparison (no tolerance) at a level
that fuses, when not bit-exact, runs both again with graph optimizations off: bit-exact
there, the rewrite is exact and the difference is ORT's fusions, held to
:data:`FUSION_ATOL`/:data:`FUSION_RTOL` and said so (was: MISMATCH, exit 1, for a correct
rewrite, though the README promised bit-exact); not bit-exact there, a mismatch.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import Log, UnsupportedModelError, quiet
from .isolate import check_timeout, run_isolated
from .session import checked_inputs, make_session, model_for_ort, random_inputs, run_outputs


@dataclass
class OutputDiff:
    """How one output of the optimized model differs from the original's."""

    name: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    exact: bool
    close: bool  # every element within atol + rtol * |original| (exact when both are 0)


# What fused and unfused kernels may differ by (README "Correctness"; ~1e-7 seen).
FUSION_ATOL = 1e-5
FUSION_RTOL = 1e-4


@dataclass
class VerifyReport:
    """Comparison of all outputs over all runs."""

    outputs: list[OutputDiff] = field(default_factory=list)
    runs: int = 0
    seconds_original: list[float] = field(default_factory=list)  # per run
    seconds_optimized: list[float] = field(default_factory=list)
    atol: float = 0.0  # the tolerances ``close`` was judged by
    rtol: float = 0.0
    # Whether both models were bit-exact with ORT's graph optimizations off, checked only
    # when a strict comparison at a level that fuses was not (None: not checked).
    exact_unfused: bool | None = None

    @property
    def exact(self) -> bool:
        return all(o.exact for o in self.outputs)

    @property
    def ok(self) -> bool:
        return all(o.close for o in self.outputs)


def compare_arrays(name: str, a: np.ndarray, b: np.ndarray, *, atol: float = 0.0,
                   rtol: float = 0.0) -> OutputDiff:
    """Max abs/rel error of ``b`` against ``a`` (NaNs in the same places count as equal)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return OutputDiff(name, tuple(b.shape), float("inf"), float("inf"), False, False)
    exact = bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if a.size == 0 or exact or a.dtype.kind not in "fciub":
        bad = 0.0 if exact else float("inf")
        return OutputDiff(name, tuple(a.shape), bad, bad, exact, exact)
    # (flat: a 0-d output's difference was a numpy scalar, "does not support item
    # assignment" on any mismatch of a scalar output; found by a unit test of maps)
    af, bf = a.astype(np.complex128 if a.dtype.kind == "c" else np.float64).ravel(), \
        b.astype(np.complex128 if a.dtype.kind == "c" else np.float64).ravel()
    diff = np.abs(af - bf)
    both_nan = np.isnan(af) & np.isnan(bf)
    diff[both_nan] = 0.0
    diff[np.isnan(diff)] = np.inf
    max_abs = float(diff.max())
    rel = diff / np.maximum(np.abs(af), 1e-30)
    close = bool(np.all(diff <= atol + rtol * np.abs(af))) if (atol or rtol) else False
    return OutputDiff(name, tuple(a.shape), max_abs, float(rel.max()), False, close)


def _structure(x: Any, leaves: list[np.ndarray]) -> tuple[Any, ...]:
    """The structure of ORT output value ``x`` (a tensor; a sequence, which ORT returns as a
    list; a map, a dict), its tensors appended to ``leaves`` in order."""
    if isinstance(x, list):
        return ("seq", tuple(_structure(e, leaves) for e in x))
    if isinstance(x, dict):
        keys = sorted(x, key=repr)
        return ("map", tuple(keys), tuple(_structure(x[k], leaves) for k in keys))
    a = np.asarray(x)
    leaves.append(a)
    return (a.dtype.str, a.shape)


def _shape_of(x: Any) -> tuple[int, ...]:
    """A tensor's shape; a sequence's length and its tensors' shape when they share one (else
    its length alone); a map's number of keys."""
    if isinstance(x, dict):
        return (len(x),)
    if not isinstance(x, list):
        return tuple(np.shape(x))
    inner = {_shape_of(e) for e in x if not isinstance(e, (list, dict))}
    same = len(inner) == 1 and not any(isinstance(e, (list, dict)) for e in x)
    return (len(x), *inner.pop()) if same else (len(x),)


def compare_outputs(name: str, a: Any, b: Any, *, atol: float = 0.0,
                    rtol: float = 0.0) -> OutputDiff:
    """:func:`compare_arrays` of two values of output ``name`` as ORT returns them: tensors,
    or sequences and maps, compared tensor by tensor (found by hand: a sequence of tensors of
    different shapes was "unexpected ValueError" when made one array); a different structure
    (length, keys, a tensor's shape or type) is a mismatch."""
    if not isinstance(a, (list, dict)) and not isinstance(b, (list, dict)):
        return compare_arrays(name, a, b, atol=atol, rtol=rtol)
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    if _structure(a, xs) != _structure(b, ys):
        return OutputDiff(name, _shape_of(b), math.inf, math.inf, False, False)
    diffs = [compare_arrays(name, x, y, atol=atol, rtol=rtol) for x, y in zip(xs, ys, strict=True)]
    return OutputDiff(name, _shape_of(a), max((d.max_abs for d in diffs), default=0.0),
                      max((d.max_rel for d in diffs), default=0.0),
                      all(d.exact for d in diffs), all(d.close for d in diffs))


def _check_tolerances(atol: float, rtol: float) -> None:
    for name, tol in (("atol", atol), ("rtol", rtol)):
        if not (math.isfinite(tol) and tol >= 0):  # (NaN: every difference a mismatch)
            raise ValueError(f"{name} must be a finite number >= 0, not {tol!r}")


def _worse(d: OutputDiff, than: OutputDiff | None) -> bool:
    """Whether ``d`` is the worse difference: not close where ``than`` is, or farther."""
    return than is None or (than.close and not d.close) or (
        than.close == d.close and d.max_abs > than.max_abs)


def verify(original: str | os.PathLike[str], optimized: str | os.PathLike[str], *,
           dims: Mapping[str, int] | None = None, runs: int = 1, seed: int = 0,
           int_high: int = 8, providers: list[str] | None = None,
           execution_order: str = "priority", prepacking: bool = False, atol: float = 0.0,
           rtol: float = 0.0, opt_level: str = "all",
           shapes: Mapping[str, list[int]] | None = None, isolate: bool = True,
           timeout_s: float | None = None, log: Log | None = None) -> VerifyReport:
    """Run both models ``runs`` times on fresh random inputs; worst differences per output.

    Input shapes come from ``dims`` and whole ``shapes`` as for ``plan`` (expression dims
    evaluated, every missing dim named in one error, before any session is made). ORT runs
    in a child process unless ``isolate`` is false (:mod:`.isolate`), ended after ``timeout_s``
    seconds (None: ``HO_ONNX_ORT_TIMEOUT``, unset: no limit; 0: no limit; only
    a child process can be ended, so not with ``isolate=False``). ``log`` gets a line as
    the sessions are ready and after each run (from the child as it runs)."""
    check_timeout(timeout_s, isolate)
    _check_tolerances(atol, rtol)
    # strict at a level that fuses: outputs judged by the fusion tolerances, which apply
    # only if the models are bit-exact unfused (checked below; else judged bit-exact)
    fused = atol == 0 and rtol == 0 and opt_level != "disable"
    if isolate:  # (the checks below run there, once)
        return run_isolated(
            verify, original, optimized, dims=dims, runs=runs, seed=seed, int_high=int_high,
            providers=providers, execution_order=execution_order, prepacking=prepacking,
            atol=atol, rtol=rtol, opt_level=opt_level, shapes=shapes, isolate=False,
            timeout_s=timeout_s, log=log,
            what=f"running {os.fspath(original)!r} and {os.fspath(optimized)!r}")
    say = log or quiet
    providers = providers or ["CPUExecutionProvider"]
    model = model_for_ort(original)
    model_for_ort(optimized)
    checked_inputs(model, dims, shapes=shapes)  # unbound dims (or past the model's tables)
    # fail here, not after loading
    kw = {"providers": providers, "execution_order": execution_order,
          "prepacking": prepacking, "opt_level": opt_level}
    t = time.perf_counter()
    s_orig = make_session(original, optimized=False, **kw)  # type: ignore[arg-type]
    s_opt = make_session(optimized, optimized=True, **kw)  # type: ignore[arg-type]
    say(f"sessions ready ({time.perf_counter() - t:.2f} s, {s_opt.get_providers()[0]})")
    names = [o.name for o in s_orig.get_outputs()]
    if names != [o.name for o in s_opt.get_outputs()]:
        raise UnsupportedModelError("the two models have different outputs")
    if fused:
        atol, rtol = FUSION_ATOL, FUSION_RTOL
    report = _compare_runs(s_orig, s_opt, names, runs=runs, atol=atol, rtol=rtol,
                           say=say, feeds=lambda r: random_inputs(
                               model, dims, seed=seed + r, int_high=int_high, shapes=shapes))
    if fused:
        del s_orig, s_opt  # (before a second pair is made)
        _judge_unfused(report, opt_level, say, lambda: verify(
            original, optimized, dims=dims, runs=runs, seed=seed, int_high=int_high,
            providers=providers, execution_order=execution_order, prepacking=prepacking,
            opt_level="disable", shapes=shapes, isolate=False, log=log))
    return report


def _judge_unfused(report: VerifyReport, opt_level: str, say: Log,
                   unfused: Callable[[], VerifyReport]) -> None:
    """A strict comparison at a level that fuses: bit-exact passes; otherwise ``unfused()``
    runs both models with ORT's graph optimizations off, and only if they are bit-exact
    there does ``report`` keep the fusion tolerances (a fusion an offloaded constant
    prevents rounds differently); else it is judged bit-exact."""
    if not report.exact:
        say(f"not bit-exact at opt level {opt_level!r}: running both again with ORT's graph "
            "optimizations off (a fusion an offloaded constant prevents rounds differently)")
        report.exact_unfused = unfused().exact
        if report.exact_unfused:
            return
        for o in report.outputs:  # the rewrite itself differs
            o.close = o.exact
    report.atol = report.rtol = 0.0


def _compare_runs(s_orig: Any, s_opt: Any, names: list[str], *, runs: int,
                  atol: float, rtol: float, say: Log,
                  feeds: Callable[[int], dict[str, Any]]) -> VerifyReport:
    """Both sessions on ``feeds(r)`` for each run ``r``: the worst difference per output,
    judged with ``atol``/``rtol``, and the times."""
    worst: dict[str, OutputDiff] = {}
    report = VerifyReport()
    for r in range(runs):
        inputs = feeds(r)
        t0 = time.perf_counter()
        a = run_outputs(s_orig, inputs, "the original")
        t1 = time.perf_counter()
        b = run_outputs(s_opt, inputs, "the optimized model")
        report.seconds_optimized.append(time.perf_counter() - t1)
        report.seconds_original.append(t1 - t0)
        for name, x, y in zip(names, a, b, strict=True):
            d = compare_outputs(name, x, y, atol=atol, rtol=rtol)
            if _worse(d, worst.get(name)):
                worst[name] = d
        report.runs += 1
        say(f"run {r + 1}/{runs}: original {(t1 - t0) * 1e3:.1f} ms, optimized "
            f"{report.seconds_optimized[-1] * 1e3:.1f} ms"
            + ("" if all(worst[n].exact for n in names) else
               f", max_abs so far {max(worst[n].max_abs for n in names):.3g}"))
    report.outputs = [worst[n] for n in names]
    report.atol, report.rtol = atol, rtol
    return report
