"""The command line (cli/): errors are one clear line with exit 2; every command has help."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from graphs import chain_model, save

from ho_onnx.cli import main


def test_cli_errors_are_one_clear_line(tmp_path):
    src = save(chain_model(), tmp_path / "m.onnx")
    runner = CliRunner()
    r = runner.invoke(main, ["optimize", str(src), str(tmp_path / "o.onnx"), "--min-bytes", "1"])
    assert r.exit_code == 2 and "error: " in r.output and "--dim N=" in r.output
    assert "Traceback" not in r.output
    r = runner.invoke(main, ["optimize", str(src), str(src)])
    assert r.exit_code == 2 and "is the input model" in r.output
    r = runner.invoke(main, ["optimize", str(src), str(tmp_path / "o.onnx"), "--dim", "N"])
    assert r.exit_code == 2 and "NAME=INTEGER" in r.output
    r = runner.invoke(main, ["optimize", str(src), str(tmp_path / "o.onnx"),
                             "--min-bytes", "lots"])
    assert r.exit_code == 2 and "is not a size" in r.output


@pytest.mark.parametrize("cmd", [[], *([c] for c in sorted(main.commands))])
def test_help(cmd):
    r = CliRunner().invoke(main, [*cmd, "--help"])
    assert r.exit_code == 0 and "Usage:" in r.output and len(r.output) > 200


@pytest.mark.parametrize(("args", "said"), [
    (["--budget", "1MiB", "--prefetch-distance", "3"],
     "error: --prefetch-distance=3 is for the explicit policy (no budget): with a budget the "
     "planner places every Prefetch; leave it unset"),
    (["--host-budget", "1MiB"], "error: --host-budget needs a budget (the planner)"),
    (["--min-gap", "-1"], "error: --min-gap must be >= 0, not -1"),
    (["--budget", "0"], "error: budget must be positive, not 0"),
])
def test_options_are_checked_by_offload_options(tmp_path, args, said):
    """The command line leaves the options' checks to OffloadOptions (one place): its error
    is the one line, exit 2, naming the flag; nothing is written."""
    src = save(chain_model(), tmp_path / "m.onnx")
    r = CliRunner().invoke(main, ["optimize", str(src), str(tmp_path / "o.onnx"), "--dim",
                                  "N=2", *args])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [said], r.output
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("module", ["ho_onnx", "ho_onnx.cli"])
def test_python_dash_m_runs_the_cli(module):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "ho-onnx, version 0.1.0", r.stderr


def test_plan_reports_and_fits_ort_arena(tmp_path):
    """``plan --json`` carries ORT's replayed arena; with refits (default) the plan fits the
    budget's arena, with ``--arena-refits 0`` the table says it is OVER; a negative count
    is a usage error."""
    import json

    from graphs import GAP, text_model

    src = save(text_model(GAP, W=(512, 512)), tmp_path / "gap.onnx")
    runner = CliRunner()
    args = ["plan", str(src), "--budget", "6MiB", "--min-bytes", "0"]
    r = runner.invoke(main, [*args, "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output[r.output.index("{"):])
    assert d["arena_fits"] and d["arena_bytes"] <= 6 << 20 < d["before"]["peak_bytes"] + (2 << 20)
    assert d["planned_for_bytes"] < d["budget_bytes"] == 6 << 20
    r = runner.invoke(main, [*args, "--arena-refits", "0"])
    assert r.exit_code == 0 and "ORT arena 7.0 MiB predicted" in r.output
    assert "OVER the budget by 1.0 MiB" in r.output, r.output
    r = runner.invoke(main, [*args, "--arena-refits", "-1"])
    assert r.exit_code == 2 and "-1" in r.output


def test_ort_reuse_off_plans_for_sessions_without_it(tmp_path):
    """``--ort-reuse off``: on a fixed-shape decoder ORT's buffer reuse holds buffers across
    gaps; planned without it the replayed arena is at least 1 MiB smaller at the same budget,
    the summary says which, and the written model records it (ho-onnx's sessions then turn
    the reuse off). Any other value is a usage error."""
    import json

    import onnx

    from ho_onnx.target.ort.runtime import session_options
    from models.decoder import build_decoder

    src = tmp_path / "dec.onnx"
    build_decoder(src, external_data=True, layers=2, hidden=256, heads=4, vocab=64, seq=128,
                  batch=1, max_positions=128)
    runner = CliRunner()
    args = ["plan", str(src), "--budget", "12MiB", "--min-bytes", "200000", "--offload",
            "weights", "--arena-refits", "0"]
    arena = {}
    for reuse in ("on", "off"):
        r = runner.invoke(main, [*args, "--ort-reuse", reuse, "--json"])
        assert r.exit_code == 0, r.output
        arena[reuse] = json.loads(r.output[r.output.index("{"):])["arena_bytes"]
    assert arena["on"] - arena["off"] >= 1 << 20, arena
    r = runner.invoke(main, [*args, "--ort-reuse", "off"])
    assert "predicted (no buffer reuse: --ort-reuse off" in r.output, r.output
    out = tmp_path / "dec.ho.onnx"
    r = runner.invoke(main, ["optimize", str(src), str(out), *args[2:], "--ort-reuse", "off"])
    assert r.exit_code == 0, r.output
    meta = {p.key: p.value for p in onnx.load(str(out), load_external_data=False).metadata_props}
    assert meta["ho_onnx.ort_reuse"] == "0"
    assert not session_options(out).enable_mem_reuse
    r = runner.invoke(main, [*args, "--ort-reuse", "maybe"])
    assert r.exit_code == 2 and "maybe" in r.output


def test_a_misspelt_dim_is_named(tmp_path):
    """``--dim btach=4`` (found by hand: ignored without a word): beside the missing
    ``batch`` in the error (exit 2), a note on stderr when the run needs no more; the
    note's absence with the right dims is checked too."""
    from graphs import text_model

    src = save(text_model("g (float[batch, 64] x) => (float[batch, 64] y) "
                          "{ y = MatMul(x, w) }", w=(64, 64)), tmp_path / "m.onnx")
    runner = CliRunner()
    args = ["plan", str(src), "--budget", "1MiB", "--dim", "seq=3"]
    r = runner.invoke(main, [*args, "--dim", "btach=4"])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines()[-1] == (
        "error: symbolic dimensions without a value: 'batch' (pass --dim batch=<value>); --dim seq "
        "names no dim of the model; --dim btach names no dim of the model (did you mean "
        "'batch'?)")
    r = runner.invoke(main, [*args, "--dim", "batch=4"])
    assert r.exit_code == 0 and "note: --dim seq names no dim of the model\n" in r.output
    r = runner.invoke(main, ["plan", str(src), "--budget", "1MiB", "--dim", "batch=4"])
    assert r.exit_code == 0 and "note:" not in r.output, r.output


def test_verify_and_profile_progress_goes_to_stderr(tmp_path):
    """Progress lines (sessions, each run) are on stderr: a --json report on stdout stays
    one JSON document."""
    import json

    src = save(chain_model(), tmp_path / "m.onnx")
    r = CliRunner().invoke(main, ["verify", str(src), str(src), "--dim", "N=2", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["exact"], r.output
    assert "sessions ready (" in r.stderr and "run 2/2: original" in r.stderr
    r = CliRunner().invoke(main, ["profile", str(src), "--out", str(tmp_path / "p.json"),
                                  "--dim", "N=2", "--runs", "2", "--warmup", "1"])
    assert r.exit_code == 0 and "warm-up run 1/1: " in r.stderr and "run 2/2: " in r.stderr
    assert "warm-up" not in r.stdout and "run 1/2" not in r.stdout


def test_protobuf_failing_to_encode_is_out_of_memory(tmp_path, monkeypatch):
    """Found by hand (``ulimit -v 400000``, a 43 MB model): protobuf could not encode the
    model for shape inference and the one line was its "Failed to serialize proto"."""
    from google.protobuf.message import EncodeError

    import ho_onnx.graph.analyse as analyse_mod

    def no_memory(*args, **kw):
        raise EncodeError("Failed to serialize proto")

    monkeypatch.setattr(analyse_mod, "_skeleton", no_memory)
    src = save(chain_model(), tmp_path / "m.onnx")
    r = CliRunner().invoke(main, ["optimize", str(src), str(tmp_path / "o.onnx"), "--dim",
                                  "N=2"])
    assert r.exit_code == 2
    assert r.output.splitlines()[-1] == ("error: out of memory: protobuf could not serialise "
                                         "the model")
    assert not (tmp_path / "o.onnx").exists()


def test_a_dim_past_the_models_positions_is_one_line_at_plan_time(tmp_path):
    """README's ``--dim seq=2048`` on a decoder of 1,024 positions was planned and written
    (verify then failed with ORT's Gather error): now one line naming the dim, exit 2."""
    import onnx

    from models.decoder import build_decoder

    src = tmp_path / "d.onnx"
    onnx.save_model(build_decoder(layers=1, hidden=16, heads=2, vocab=32, max_positions=64),
                    str(src))
    runner = CliRunner()
    # (verify and profile too: they ran into ORT's raw Gather error)
    for args in (["plan", str(src), "--budget", "1GiB"],
                 ["optimize", str(src), str(tmp_path / "o.onnx")],
                 ["verify", str(src), str(src)],
                 ["profile", str(src), "--out", str(tmp_path / "p.json")]):
        r = runner.invoke(main, [*args, "--dim", "batch=1", "--dim", "seq=65"])
        assert r.exit_code == 2, r.output
        assert r.output.splitlines()[-1].startswith(
            "error: dim seq=65 is past what the model allows: node 'embed.pos' (Gather) "
            "reads 0..64 along axis 0 of the constant 'embed.pos.weight', which has 64"), r.output
        assert [x for x in r.output.splitlines() if "error" in x] == r.output.splitlines()[-1:]
    assert not (tmp_path / "o.onnx").exists() and not (tmp_path / "p.json").exists()
    r = runner.invoke(main, ["plan", str(src), "--budget", "1GiB", "--dim", "batch=1",
                             "--dim", "seq=1..64"])
    assert r.exit_code == 0, r.output
