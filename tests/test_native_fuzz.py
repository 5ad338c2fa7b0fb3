"""Fuzz test of session creation and run on mutated optimized models (tests/native_fuzz.py),
time-bounded (HO_FUZZ_SECONDS, default 20; scripts/test_native.sh runs it under ASan +
UBSan), and the replay of every crash it ever found (tests/fuzz_corpus/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import native_fuzz
import pytest

CASES = sorted(p for p in native_fuzz.CORPUS.glob("crash-*") if p.is_dir())  # optimize/: its own


def test_fuzz_session_creation_and_run():
    native_fuzz.run_bounded(native_fuzz.fuzz, "20")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fuzz_corpus_case(case: Path, tmp_path):
    """A case that once crashed the process: now refused or run, in a child process."""
    import shutil

    work = tmp_path / "case"
    shutil.copytree(case, work, symlinks=True)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import native_fuzz; "
            "from native_util import load_ops_override; load_ops_override(); "
            "print(native_fuzz.replay(__import__('pathlib').Path(sys.argv[2])))")
    proc = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(work)],
                          capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr[-3000:]
