"""Fuzz test of ``ho-onnx optimize``/``plan`` on mutated input models
(tests/optimize_fuzz.py), time-bounded (HO_FUZZ_SECONDS, default 30), and the replay of
every case it ever found (tests/fuzz_corpus/optimize/)."""

from __future__ import annotations

import shutil
from pathlib import Path

import native_fuzz
import optimize_fuzz
import pytest

CASES = sorted(p for p in optimize_fuzz.CORPUS.iterdir() if p.is_dir()) \
    if optimize_fuzz.CORPUS.exists() else []


def test_fuzz_optimize_and_plan():
    native_fuzz.run_bounded(optimize_fuzz.fuzz, "30")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_optimize_fuzz_corpus_case(case: Path, tmp_path: Path):
    """A case that once broke a rule: now exit 0 or one error line with exit 2, input
    untouched, nothing written outside the output (the installed script, in a copy)."""
    work = tmp_path / "case"
    shutil.copytree(case, work, symlinks=True)
    assert optimize_fuzz.replay(work) is None


def test_rules_catch_what_they_should():
    """The checker itself: a traceback, two error lines, a changed input or a stray file is
    each a broken rule."""
    args = ["optimize", "in/model.onnx", "out/m.ho.onnx"]
    before = {"in/model.onnx": "a"}
    assert optimize_fuzz.check(args, before, before, 0, "") is None
    new = {"out": "dir", "out/m.ho.onnx": "b", "out/model.onnx.data": "c"}
    assert optimize_fuzz.check(args, before, {**before, **new}, 0, "") is None
    assert optimize_fuzz.check(args, before, before, 1, "Traceback") == "exit 1"
    assert optimize_fuzz.check(args, before, before, 2, "Traceback\nerror: x") == "traceback"
    assert optimize_fuzz.check(args, before, before, 2, "error: a\nerror: b") == "error lines"
    assert optimize_fuzz.check(args, before, {"in/model.onnx": "c"}, 2, "error: x") \
        .startswith("input changed")
    assert optimize_fuzz.check(args, before, {**before, "in/.tmp": "d"}, 0, "") \
        .startswith("written outside")
    assert optimize_fuzz.check(args, before, {**before, "out": "dir"}, 2, "error: x") \
        .startswith("written outside")  # a failure leaves no folder
    beside = ["optimize", "in/model.onnx", "in/m.ho.onnx"]
    assert optimize_fuzz.check(beside, before, {**before, "in/m.ho.onnx": "b"}, 0, "") is None
    assert optimize_fuzz.check(beside, before, {**before, "in/x.data": "b"}, 0, "") \
        .startswith("written outside")
