"""No command writes over one of its inputs, or over a file of another kind where it writes
JSON; every refusal is one error line and exit 2, before any work (issue 9)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from graphs import chain_model, save

from ho_onnx.cli import main


def _refused(args: list[str], *untouched: Path) -> str:
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in untouched}
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in r.output and "Usage:" not in r.output, r.output
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in untouched} == before
    return lines[0]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    m = save(chain_model(), tmp_path / "m.onnx", external=True)
    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps({"format": "x"}))
    return {"model": m, "data": tmp_path / "m.onnx.data", "profile": prof}


def test_profile_out_onto_the_models_data_file(files):
    msg = _refused(["profile", str(files["model"]), "--out", str(files["data"]), "--dim", "N=2"],
                   files["data"])
    assert "input" in msg


@pytest.mark.parametrize("target", ["model", "data"])
def test_json_outputs_never_replace_another_kind_of_file(files, tmp_path, target):
    out = str(files[target])
    assert "not a JSON file" in _refused(["calibrate", "--out", out, "--size", "1MiB"],
                                         files[target])
    other = save(chain_model(), tmp_path / "other.onnx")
    assert "not a JSON file" in _refused(["profile", str(other), "--out", out, "--dim", "N=2"],
                                         files[target])


def test_a_json_output_over_deeply_nested_text_is_refused(tmp_path):
    """Text nested past Python's JSON parser is not JSON (was an unexpected RecursionError
    while checking what the output would replace)."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000)
    assert "not a JSON file" in _refused(["calibrate", "--out", str(deep), "--size", "1MiB"],
                                         deep)


def test_calibrate_out_onto_its_measured_file(files):
    data = str(files["data"])
    assert "is an input" in _refused(["calibrate", "--out", data, "--file", data], files["data"])


def test_optimize_and_plan_outputs_onto_the_profile(files):
    p = str(files["profile"])
    assert "is an input" in _refused(["optimize", str(files["model"]), p, "--budget", "1MiB",
                                      "--profile", p, "--dim", "N=2"], files["profile"])
    assert "is an input" in _refused(["plan", str(files["model"]), "--budget", "1MiB",
                                      "--profile", p, "--plot", p, "--dim", "N=2"],
                                     files["profile"])


def test_a_json_output_may_replace_an_earlier_one(files, tmp_path):
    out = tmp_path / "t.json"
    out.write_text('{"earlier": 1}')
    r = CliRunner().invoke(main, ["profile", str(files["model"]), "--out", str(out), "--dim",
                                  "N=2", "--runs", "1", "--warmup", "0"])
    assert r.exit_code == 0, r.output
    assert "nodes" in json.loads(out.read_text())


def test_an_output_whose_sidecar_is_the_inputs_data_file(tmp_path):
    """``a.onnx`` keeps W2 in ``b.onnx.data`` and W1 inline; optimizing it into ``b.onnx``
    would write W1 to the sidecar ``b.onnx.data``. Refused in one line naming the sidecar
    (was: onnx_ir's "An error occurred when running the '<...PlaceDataPass object at
    0x...>' pass", the step's own message wrapped away), nothing written."""
    m = chain_model()
    w2 = next(t for t in m.graph.initializer if t.name == "W2")
    (tmp_path / "b.onnx.data").write_bytes(w2.raw_data)
    w2.ClearField("raw_data")
    for key, value in (("location", "b.onnx.data"), ("offset", "0"),
                       ("length", str((tmp_path / "b.onnx.data").stat().st_size))):
        w2.external_data.add(key=key, value=value)
    w2.data_location = w2.EXTERNAL
    src = tmp_path / "a.onnx"
    src.write_bytes(m.SerializeToString())
    msg = _refused(["optimize", str(src), str(tmp_path / "b.onnx"), "--dim", "N=2",
                    "--min-bytes", "0", "--min-gap", "1"], src, tmp_path / "b.onnx.data")
    assert "sidecar" in msg and "would overwrite external data" in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.onnx", "b.onnx.data"]


def test_only_errors_of_onnx_onnxruntime_and_protobuf_are_shown_as_known():
    """Their messages are about the input; onnx_ir's (it reads what onnx checked) are ours,
    shown as unexpected (was: every module starting with "onnx", so onnx_ir's PassError
    hid a pass's own error as if it were the model's fault)."""
    import onnx
    import onnx_ir as ir

    from ho_onnx.cli import _known_error

    assert _known_error(onnx.checker.ValidationError("bad model")) == "bad model"
    assert _known_error(ir.passes.PassError("a pass failed")) is None
    assert _known_error(ValueError("x")) is None


def test_verify_json_is_strict_json_when_a_difference_is_not_finite(tmp_path):
    """Found by hand: where one model gives NaN and the other a number, the difference is
    inf, and ``verify --json`` printed ``Infinity``, which strict JSON parsers refuse. Now it
    is null; the text report still says inf."""
    from graphs import text_model

    a = save(text_model("g (float[4] x) => (float[4] y) { y = Relu(x) }"), tmp_path / "a.onnx")
    b = save(text_model("g (float[4] x) => (float[4] y) { y = Log(x) }"), tmp_path / "b.onnx")
    r = CliRunner().invoke(main, ["verify", str(a), str(b), "--json"])
    assert r.exit_code == 1, r.output

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    out = json.loads(r.stdout, parse_constant=refuse)["outputs"][0]
    assert (out["max_abs"], out["exact"], out["close"]) == (None, False, False)
    text = CliRunner().invoke(main, ["verify", str(a), str(b)])
    assert "max_abs=inf" in text.output and "MISMATCH" in text.output
