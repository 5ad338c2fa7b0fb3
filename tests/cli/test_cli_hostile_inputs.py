"""The command line under bad and hostile inputs: one line on stderr, exit 2, nothing written,
no input ever overwritten, nothing left behind on failure or on SIGINT/SIGTERM.

Each case runs the installed ``ho-onnx`` script in a subprocess, as a user would.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.graphs import chain_model, contrib_blowup_model, doubling_model, text_model

HO = str(Path(sys.executable).with_name("ho-onnx"))


def ho(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([HO, *args], capture_output=True, text=True, timeout=timeout, **kw)


def one_line_error(r: subprocess.CompletedProcess[str], code: int = 2) -> str:
    """The failure is exit ``code`` with exactly one ``error:`` line on stderr (progress lines
    before it are fine), no traceback and no usage dump."""
    assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "Usage:" not in r.stderr, r.stderr
    errors = [x for x in r.stderr.splitlines() if x.lower().startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert r.stderr.rstrip().splitlines()[-1] == errors[0], r.stderr
    return errors[0]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def model(tmp_path: Path) -> Path:
    p = tmp_path / "m.onnx"
    onnx.save(chain_model(), p)
    return p


def test_profile_refuses_to_write_over_its_input(model: Path):
    before = digest(model)
    msg = one_line_error(ho("profile", str(model), "--out", str(model), "--dim", "N=2"))
    assert "input" in msg.lower()
    assert digest(model) == before


@pytest.mark.parametrize("cmd", ["optimize", "plan"])
def test_no_command_writes_over_an_input(model: Path, cmd: str):
    before = digest(model)
    if cmd == "optimize":
        r = ho("optimize", str(model), str(model), "--dim", "N=2")
    else:
        r = ho("plan", str(model), "--budget", "1MiB", "--dim", "N=2", "--json-out", str(model))
        if "no such option" in r.stderr.lower():
            r = ho("plan", str(model), "--budget", "1MiB", "--dim", "N=2", "--plot", str(model))
    one_line_error(r)
    assert digest(model) == before


@pytest.mark.parametrize("args", [
    ["--budget", "0"],
    ["--budget", "-1MiB"],
    ["--budget", "lots"],
    ["--dim", "N=²"],
    ["--dim", "N=99999999999999999999999"],
    ["--dim", "N=-3"],
    ["--dim", "=3"],
])
def test_bad_option_values_are_one_line(model: Path, tmp_path: Path, args: list[str]):
    out = tmp_path / "o" / "out.onnx"
    dim = ["--dim", "N=2"] if "--dim" not in args else []
    r = ho("optimize", str(model), str(out), *args, *dim)
    one_line_error(r)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind", ["fifo", "device", "folder", "huge"])
@pytest.mark.parametrize("option", ["--machine", "--profile"])
@pytest.mark.parametrize("cmd", ["optimize", "plan"])
def test_a_machine_or_profile_file_that_is_no_small_file_is_refused_up_front(
        model: Path, tmp_path: Path, kind: str, option: str, cmd: str):
    """--machine and --profile name small JSON files: was read whole after the model's
    analysis, so ``/dev/zero`` ran the process out of memory and a FIFO with no writer hung
    it. Now a device, FIFO, folder or runaway file is one line before the model is read."""
    f = {"device": Path("/dev/zero"), "folder": tmp_path}.get(kind, tmp_path / "f.json")
    if kind == "fifo":
        os.mkfifo(f)
    elif kind == "huge":
        with open(f, "wb") as h:  # (sparse: past the limit without a byte written)
            h.truncate(1 << 30)
    if option == "--profile" and kind == "folder":
        pytest.skip("click refuses a folder for --profile itself (dir_okay=False)")
    out = tmp_path / "o" / "out.onnx"
    args = [str(out)] if cmd == "optimize" else []
    r = ho(cmd, str(model), *args, "--budget", "1MiB", "--dim", "N=2", option, str(f),
           timeout=60)
    msg = one_line_error(r)
    assert ("not a regular file" if kind != "huge" else "larger than") in msg, msg
    assert "analysed" not in r.stderr + r.stdout  # (refused before the model was read)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("cmd", "out", "words"), [
    ("optimize", "new/", "names a folder: name the file to write (e.g. new/model.onnx)"),
    ("optimize", "-", "output to standard output is not supported"),
    ("profile", "new/", "names a folder"),
    ("plot", "new/", "names a folder"),
])
def test_an_output_named_like_a_folder_or_stdout_is_refused(model: Path, tmp_path: Path,
                                                            cmd: str, out: str, words: str):
    """Found by hand: ``optimize m.onnx out/`` wrote a model file named ``out`` (pathlib
    drops the slash) and ``-`` a file named ``-``. A folder's output (genai/Optimum) may end
    in ``/``."""
    args = {"optimize": ["optimize", str(model), out, "--dim", "N=2"],
            "profile": ["profile", str(model), "--out", out, "--dim", "N=2"],
            "plot": ["plan", str(model), "--budget", "1MiB", "--dim", "N=2", "--plot", out]}
    before = set(os.listdir(tmp_path))
    r = ho(*args[cmd], cwd=tmp_path)
    assert words in one_line_error(r)
    assert set(os.listdir(tmp_path)) == before


def test_a_folder_output_may_end_in_a_slash(tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    onnx.save(chain_model(), src / "model.onnx")
    (src / "config.json").write_text('{"model_type": "llama"}')
    r = ho("optimize", str(src), f"{tmp_path / 'out'}/", "--dim", "N=2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "out" / "model.onnx").is_file()


def test_a_folder_output_may_be_an_empty_folder_never_a_dangling_link(tmp_path: Path):
    """A model folder goes into a new or empty folder, as the library allows (found by hand:
    the command line refused an empty one as "is a directory"), also one reached through a
    link; a link to a folder not there yet, or a file, is one clear line."""
    src = tmp_path / "src"
    src.mkdir()
    onnx.save(chain_model(), src / "model.onnx")
    (src / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "empty").mkdir()
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to("target")
    (tmp_path / "dangling").symlink_to("target/missing")
    (tmp_path / "afile").write_text("x")
    for out, where in [("empty", "empty"), ("link", "target")]:
        r = ho("optimize", str(src), str(tmp_path / out), "--dim", "N=2")
        assert r.returncode == 0, r.stderr[-2000:]
        assert (tmp_path / where / "model.onnx").is_file()
    assert "which does not exist" in one_line_error(
        ho("optimize", str(src), str(tmp_path / "dangling"), "--dim", "N=2"))
    assert "exists and is not a folder" in one_line_error(
        ho("optimize", str(src), str(tmp_path / "afile"), "--dim", "N=2"))
    assert (tmp_path / "afile").read_text() == "x" and not (tmp_path / "target/missing").exists()


def test_output_under_a_file_is_one_line(model: Path, tmp_path: Path):
    f = tmp_path / "afile"
    f.write_text("x")
    one_line_error(ho("optimize", str(model), str(f / "out.onnx"), "--dim", "N=2"))
    assert f.read_text() == "x"


def test_output_under_proc_is_one_line(model: Path):
    one_line_error(ho("optimize", str(model), "/proc/self/ho_out.onnx", "--dim", "N=2"))


def test_failing_optimize_leaves_no_folder_behind(model: Path, tmp_path: Path):
    out = tmp_path / "new" / "deeper" / "out.onnx"
    # 1 byte cannot hold the activations: infeasible after the output folder was chosen.
    msg = one_line_error(ho("optimize", str(model), str(out), "--budget", "1", "--dim", "N=2"))
    assert "budget" in msg.lower()
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("cmd", ["verify", "profile", "optimize", "plan", "inspect"])
def test_corrupt_model_is_one_line(tmp_path: Path, model: Path, cmd: str):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07\x12\xff\xff\xff\xff\x0fgarbage" * 50)
    args = {
        "verify": ["verify", str(model), str(bad), "--dim", "N=2"],
        "profile": ["profile", str(bad), "--out", str(tmp_path / "p.json")],
        "optimize": ["optimize", str(bad), str(tmp_path / "o.onnx")],
        "plan": ["plan", str(bad), "--budget", "1MiB"],
        "inspect": ["inspect", str(bad)],
    }[cmd]
    one_line_error(ho(*args))
    assert not (tmp_path / "o.onnx").exists() and not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("cmd", ["verify", "profile", "plan", "optimize"])
def test_an_ort_crash_is_one_line(tmp_path: Path, ort_crash_model: Path, cmd: str):
    """ORT segfaults on this model (conftest checks it): the commands that hand it to ORT
    (``profile`` at level all, ``plan``/``optimize`` through ``--ort-optimize extended``)
    say so in one line."""
    m, out = str(ort_crash_model), tmp_path / "o.onnx"
    before = digest(ort_crash_model)
    args = {
        "verify": ["verify", m, m],
        "profile": ["profile", m, "--opt-level", "all", "--out", str(tmp_path / "p.json")],
        "plan": ["plan", m, "--budget", "1KiB", "--ort-optimize", "extended"],
        "optimize": ["optimize", m, str(out), "--budget", "1KiB", "--ort-optimize", "extended"],
    }[cmd]
    msg = one_line_error(ho(*args))
    assert "ONNX Runtime crashed (SIGSEGV)" in msg
    assert not out.exists() and not (tmp_path / "p.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert digest(ort_crash_model) == before


def test_calibrate_size_zero_is_one_line(tmp_path: Path):
    one_line_error(ho("calibrate", "--out", str(tmp_path / "m.json"), "--size", "0"))
    assert not (tmp_path / "m.json").exists()



def test_calibrate_test_file_past_the_file_size_limit_is_one_line_and_removed(tmp_path: Path):
    """Found by hand (``ulimit -f 4096``): the disk measurement's test file, written past the
    limit, stayed behind half-written and the error said only "File too large"."""
    import resource

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a write past it fails with EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))

    folder = tmp_path / "disk"
    folder.mkdir()
    msg = one_line_error(ho("calibrate", "--out", str(tmp_path / "m.json"), "--size", "8MiB",
                            "--dir", str(folder), preexec_fn=limit))
    assert msg == (f"error: cannot write the 8.00 MiB test file in {str(folder)!r}: File too "
                   "large; pass a smaller --size or another --dir")
    assert list(folder.iterdir()) == [] and not (tmp_path / "m.json").exists()


@pytest.mark.parametrize("data", ["copied", "sidecar"])
def test_optimize_past_the_file_size_limit_is_one_line_naming_the_folder(tmp_path: Path,
                                                                        data: str):
    """Found by hand (``ulimit -f``; a FAT32 drive's 4 GiB is the same EFBIG): the data
    file's copy into another folder, or the sidecar, failed with only "File too large"."""
    import resource

    from tests.graphs import folder_digest, save, two_weights_model

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a write past it fails with EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (3 << 19, 3 << 19))

    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    model = save(two_weights_model(), src / "m.onnx", external=data == "copied")  # 2 MiB
    before = folder_digest(src)
    msg = one_line_error(ho("optimize", str(model), str(out / "m.ho.onnx"), "--offload",
                            "weights", "--min-bytes", "0", preexec_fn=limit))
    assert msg == (f"error: cannot write the output in {str(out)!r}: File too large (this "
                   "process may write files of at most 1.50 MiB: ulimit -f); choose another "
                   "output folder")
    assert not out.exists() and folder_digest(src) == before

@pytest.mark.parametrize("kind, words", [("empty", "has 0 bytes"), ("small", "has 4096 bytes"),
                                         ("fifo", "is not a regular file"),
                                         ("device", "is not a regular file")])
def test_calibrate_file_that_is_no_file_of_data_is_one_line(tmp_path: Path, kind, words):
    """Found by hand: an empty file or /dev/zero was an unexpected ValueError, a FIFO waited
    for a writer forever."""
    f = tmp_path / "f.bin"
    if kind == "fifo":
        os.mkfifo(f)
    elif kind == "device":
        f = Path("/dev/zero")
    else:
        f.write_bytes(b"\0" * (0 if kind == "empty" else 4096))
    msg = one_line_error(ho("calibrate", "--out", str(tmp_path / "m.json"), "--file", str(f),
                            timeout=60))
    assert words in msg and "at least 1.00 MiB" in msg
    assert not (tmp_path / "m.json").exists()


def test_non_utf8_strings_in_a_model_do_not_crash(tmp_path: Path):
    m = chain_model()
    raw = m.SerializeToString()
    # Replace the graph name "chain" by invalid UTF-8 of the same length.
    assert raw.count(b"chain") == 1
    p = tmp_path / "m.onnx"
    p.write_bytes(raw.replace(b"chain", b"\xff\xfe\xfd\xfc\xfb"))
    for args in (["optimize", str(p), str(tmp_path / "o.onnx"), "--dim", "N=2"],
                 ["plan", str(p), "--budget", "1MiB", "--dim", "N=2"],
                 ["inspect", str(p)]):
        r = ho(*args)
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
        if r.returncode != 0:
            one_line_error(r)


@pytest.mark.parametrize("cmd", ["verify", "profile"])
def test_commands_that_run_ort_refuse_non_utf8_names(tmp_path: Path, cmd: str):
    """ORT's error about a dangling input quotes its name: not UTF-8, that was an unexpected
    UnicodeDecodeError (found by the fuzzer); the model's strings are checked first."""
    raw = chain_model().SerializeToString()
    assert raw.count(b"h4") == 2  # Relu's output and Sigmoid's input
    p = tmp_path / "m.onnx"
    p.write_bytes(raw.replace(b"h4", b"h\x87", 1))
    args = {"verify": ["verify", str(p), str(p), "--dim", "N=2"],
            "profile": ["profile", str(p), "--out", str(tmp_path / "p.json"), "--dim", "N=2"]}
    assert "not valid UTF-8" in one_line_error(ho(*args[cmd]))


@pytest.mark.parametrize("location", ["../outside.bin", "link.bin", "w.bin\0junk"])
@pytest.mark.parametrize("cmd", ["verify", "profile"])
def test_commands_that_run_ort_read_nothing_outside_the_model_folder(
        hostile_model_dir: Path, cmd: str, location: str):
    """The model's external data is checked before ORT is given it (whatever the installed
    ORT checks itself): outside the folder, through a link out of it, a NUL byte."""
    m = text_model("g (float[4,4] x) => (float[4,4] y) { y = Add (x, W) }", W=(4, 4))
    w = m.graph.initializer[0]
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    w.external_data.add(key="location", value=location.replace("\0", "_"))
    raw = m.SerializeToString()
    if "\0" in location:
        raw = raw.replace(b"w.bin_junk", location.encode())
    p = hostile_model_dir / "m.onnx"
    p.write_bytes(raw)
    args = {"verify": ["verify", str(p), str(p)],
            "profile": ["profile", str(p), "--out", str(hostile_model_dir / "p.json")]}
    msg = one_line_error(ho(*args[cmd]))
    assert "outside the model folder" in msg or "NUL byte" in msg, msg


def test_verify_exit_codes_tell_mismatch_from_error(tmp_path: Path, model: Path):
    other = chain_model()
    for t in other.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) + 1, t.name))
    p = tmp_path / "other.onnx"
    onnx.save(other, p)
    r = ho("verify", str(model), str(p), "--dim", "N=2")
    assert r.returncode == 1, r.stderr
    one_line_error(ho("verify", str(model), str(tmp_path / "missing.onnx"), "--dim", "N=2"))


def test_tensors_of_more_dims_than_numpy_holds_are_one_line(tmp_path: Path):
    """verify and profile go through numpy: an empty rank-70 input (found by the optimize
    fuzzer, seed 158, at rank 302) and an output of 70 dims (found by hand: ORT's "number of
    dimensions must be within [0, 64]") are one clear line each, not an unexpected error."""
    full = [0] + [1] * 69
    for case, body in [("input", "g (float[2] x) => (float[2] y) { y = Relu (x) }"),
                       ("output", "g (float[2] x) => (float[2] y) { y = Relu (x) "
                                  " z = Identity (e) }")]:
        m = onnx.parser.parse_model(f'<ir_version: 8, opset_import: ["" : 17]> {body}')
        if case == "input":
            m.graph.input.append(helper.make_tensor_value_info("big", TensorProto.FLOAT, full))
        else:
            m.graph.initializer.append(helper.make_tensor("e", TensorProto.FLOAT, full, []))
            m.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, full))
        p = tmp_path / f"{case}.onnx"
        onnx.save(m, p)
        for args in (["verify", str(p), str(p)], ["profile", str(p), "--out",
                                                  str(tmp_path / f"{case}.json")]):
            msg = one_line_error(ho(*args))
            assert "unexpected" not in msg, msg
            assert ("70 dimensions, more than numpy's" if case == "input"
                    else "numpy arrays, of at most") in msg, msg


def _one_file_per_weight(path: Path, n: int) -> Path:
    nodes, inits, prev = [], [], "x"
    for i in range(n):
        inits.append(numpy_helper.from_array(np.full(4, i, np.float32), f"w{i}"))
        nodes.append(helper.make_node("Add", [prev, f"w{i}"], [f"h{i}"]))
        prev = f"h{i}"
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [4])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path,
              save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=0)
    return path


@pytest.mark.parametrize("hard", [False, True])
def test_more_data_files_than_open_files_allowed(tmp_path: Path, hard: bool):
    """A model saved one file per weight (300 files) copied into another folder under a soft
    limit of 128 open files (found by hand: 1,500 files under ulimit -n 1024 failed with "Too
    many open files"): the soft limit is raised toward the hard one; a hard limit too low is
    one clear line, nothing written."""
    import resource

    src = _one_file_per_weight(tmp_path / "m.onnx", 300)
    _, cur_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = (128, 128 if hard else cur_hard)
    r = ho("optimize", str(src), str(tmp_path / "out" / "o.onnx"), "--min-bytes", "0",
           preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limit))
    if hard:
        assert "may open at most 128 files (ulimit -Hn)" in one_line_error(r)
        assert not (tmp_path / "out").exists()
    else:
        assert r.returncode == 0, r.stderr[-2000:]
        assert len(list((tmp_path / "out").iterdir())) == 301


@pytest.mark.parametrize("option, value", [
    ("--atol", "nan"), ("--atol", "-1"), ("--rtol", "inf"), ("--seed", "-1"),
    ("--int-high", str(1 << 64)), ("--timeout", "nan"), ("--timeout", "1e400"),
])
def test_verify_options_no_run_can_use_are_one_line(model: Path, option: str, value: str):
    """Found by hand: NaN or negative tolerances were taken (every difference a mismatch, or
    none), --seed -1, an --int-high past int64 and a NaN or infinite --timeout were
    unexpected ValueErrors."""
    msg = one_line_error(ho("verify", str(model), str(model), "--dim", "N=2", option, value))
    assert option in msg


def _special_file(path: Path, kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    else:  # a character device like /dev/null (1, 3): root only
        try:
            os.mknod(path, 0o666 | __import__("stat").S_IFCHR, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("making a device node needs root")


@pytest.mark.parametrize("kind", ["fifo", "device"])
@pytest.mark.parametrize("cmd", ["optimize", "optimize-sidecar", "profile", "calibrate", "plot"])
def test_an_output_that_is_a_device_or_fifo_is_refused_and_kept(tmp_path: Path, model: Path,
                                                                  cmd: str, kind: str):
    """Found by hand: outputs are renamed into place, so a FIFO given as the output was
    replaced by a file; as root, `--out /dev/null` would have replaced /dev/null itself."""
    out = tmp_path / ("m.ho.onnx.data" if cmd == "optimize-sidecar" else "out")
    _special_file(out, kind)
    before = os.lstat(out)
    if cmd.startswith("optimize"):
        name = tmp_path / "m.ho.onnx" if cmd == "optimize-sidecar" else out
        args = ["optimize", str(model), str(name), "--offload", "weights", "--min-bytes", "0",
                "--dim", "N=2"]
    elif cmd == "profile":
        args = ["profile", str(model), "--out", str(out), "--runs", "1", "--dim", "N=2"]
    elif cmd == "calibrate":
        args = ["calibrate", "--out", str(out), "--size", "1MiB", "--dir", str(tmp_path)]
    else:
        args = ["plan", str(model), "--budget", "1MiB", "--plot", str(out), "--dim", "N=2"]
    msg = one_line_error(ho(*args, timeout=120))
    assert "is not a regular file" in msg
    after = os.lstat(out)
    assert (after.st_mode, after.st_ino, after.st_rdev) == (before.st_mode, before.st_ino,
                                                           before.st_rdev)


def _unavailable_providers() -> list[str]:
    import onnxruntime as ort

    return ["BogusExecutionProvider"] + [
        p for p in ("CUDAExecutionProvider",) if p not in ort.get_available_providers()]


@pytest.mark.parametrize("provider", _unavailable_providers())
@pytest.mark.parametrize("cmd", ["verify", "profile"])
def test_a_provider_onnxruntime_lacks_is_one_line_not_a_cpu_run(tmp_path: Path, model: Path,
                                                                 cmd: str, provider: str):
    """Found by hand: ORT falls back to the CPU with only a warning, and `verify --provider
    CUDAExecutionProvider` on a CPU-only onnxruntime reported OK, `profile` wrote a CPU
    profile, for a comparison or measurement that was never the GPU's."""
    out = tmp_path / "p.json"
    args = ([str(model), str(model)] if cmd == "verify" else [str(model), "--out", str(out)])
    msg = one_line_error(ho(cmd, *args, "--provider", provider, "--dim", "N=2"))
    assert f"cannot use {provider}" in msg and "would run on CPUExecutionProvider" in msg
    assert not out.exists()


@pytest.mark.parametrize("cmd", ["optimize", "plan"])
def test_shape_inference_of_a_hostile_model_is_bounded(tmp_path: Path, cmd: str):
    p = tmp_path / "hostile.onnx"
    onnx.save(doubling_model(40), p)
    assert p.stat().st_size < 8 << 10
    args = (["optimize", str(p), str(tmp_path / "o.onnx")] if cmd == "optimize"
            else ["plan", str(p), "--budget", "1MiB"])
    t0 = time.monotonic()
    msg = one_line_error(ho(*args, timeout=300))
    assert time.monotonic() - t0 < 120
    assert "shape inference" in msg.lower()
    assert not (tmp_path / "o.onnx").exists()



def test_deeply_nested_subgraphs_are_read_in_linear_time(tmp_path: Path):
    """Found by hand: 30 nested Ifs (a 4 KB model; protobuf's depth limit is near 32) kept
    ``inspect`` and ``optimize`` busy for hours, each graph walked 2^depth times. Now both
    finish, and the output computes what the input does (bit-exact: nothing is offloaded,
    the path is ORT's own)."""
    import onnxruntime as ort

    from tests.graphs import nested_if_model

    p, out = tmp_path / "deep.onnx", tmp_path / "deep.ho.onnx"
    onnx.save(nested_if_model(30), p)
    assert p.stat().st_size < 8 << 10
    for args in (["inspect", str(p)], ["optimize", str(p), str(out), "--offload", "all",
                                        "--min-bytes", "0"]):
        r = ho(*args, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
    x = np.array([1, -2, 3, -4], np.float32)
    for c in (True, False):
        feed = {"x": x, "c": np.array(c)}
        want = ort.InferenceSession(str(p)).run(None, feed)
        got = ort.InferenceSession(str(out)).run(None, feed)
        np.testing.assert_array_equal(got[0], want[0])


def test_names_are_shown_never_obeyed_by_the_terminal(tmp_path: Path):
    """Found by hand: ``inspect`` and ``plan`` printed a weight's name raw, with its OSC
    sequence (sets a terminal's title) and its clear screen; click strips only colour codes,
    and only when the output is not a terminal. Every control character but newline and
    tab, and the bidirectional overrides, are printed as escapes, by every command."""
    from tests.graphs import save

    hostile = "W\x1b]0;pwned\x07\x1b[2J\r\x08\u202e\x9b"
    m = text_model("""
    g (float[2, 16] x) => (float[2, 16] y) {
      h = MatMul(x, W1)
      y = Relu(h)
    }
    """, W1=(16, 16))
    m.graph.initializer[0].name = m.graph.node[0].input[1] = hostile
    m.graph.node[0].name = "mm\x1b[31m"
    src = save(m, tmp_path / "m.onnx", external=True)
    out = tmp_path / "o.onnx"
    runs = [ho("optimize", str(src), str(out), "--offload", "all", "--min-bytes", "0"),
            ho("inspect", str(out)),
            ho("plan", str(src), "--budget", "1KiB")]  # (an error naming the weight)
    assert [r.returncode for r in runs] == [0, 0, 2], [r.stderr for r in runs]
    shown = "".join(r.stdout + r.stderr for r in runs)
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202e]", shown), ascii(shown)
    assert "W\\x1b]0;pwned" in runs[1].stdout  # (inspect's table shortens long names)
    assert ("W\\x1b]0;pwned\\x07\\x1b[2J \\x08\\u202e\\x9b (1.00 KiB, 1024 bytes < min_bytes)"
            in runs[2].stderr)
    assert "mm\\x1b[31m" in runs[2].stderr  # (the error's CR is a space: one line)


def test_hostile_names_keep_their_table_row_and_column(tmp_path: Path):
    """``inspect``'s and ``plan``'s tables cut a long name to its column: they cut it before
    it was escaped, so fifteen ESCs (60 characters escaped) overflowed the column, and a
    newline in a name split its row in two. Now the cell is escaped first, newline and tab
    included, then cut: every row's ``kind`` starts under the header's."""
    m = text_model("""
    g (float[2, 64] x) => (float[2, 64] y) {
      a = MatMul(x, W1)
      b = MatMul(a, W2)
      c = MatMul(b, W3)
      y = MatMul(c, W4)
    }
    """, W1=(64, 64), W2=(64, 64), W3=(64, 64), W4=(64, 64))
    from tests.graphs import save

    for i, name in enumerate(["line\none\ttab", "\x1b" * 15 + "W", "W3", "W4"]):
        m.graph.initializer[i].name = m.graph.node[i].input[1] = name
    src = save(m, tmp_path / "m.onnx", external=True)
    out = tmp_path / "o.onnx"
    offload = ["--offload", "all", "--min-bytes", "0"]
    assert ho("optimize", str(src), str(out), *offload).returncode == 0
    for r, rows in ((ho("inspect", str(out)), 4), (ho("plan", str(src), "--budget", "40KiB",
                                                      *offload), 3)):
        assert r.returncode == 0, r.stderr[-2000:]
        lines = r.stdout.splitlines()
        head = next(i for i, ln in enumerate(lines) if ln.startswith("tensor "))
        column = lines[head].index(" kind")
        table = lines[head + 1:head + 1 + rows]
        assert [ln[column:column + 5] for ln in table] == [" " + ln.split()[1][:4]
                                                            for ln in table], "\n".join(table)
        assert {ln.split()[1] for ln in table} == {"weight" if rows == 4 else "reload"}
        # (each name escaped: the plan, refined, may reload another weight first)
        assert table[0].startswith(("line\\none\\ttab ", "\\x1b" * 10 + " ")), table[0]
        assert not any(ch in ln for ln in table for ch in "\x1b\n\t"), table


def test_a_data_file_name_in_the_progress_is_shown_never_obeyed(tmp_path: Path):
    """The data file's name (the model's external-data location) labels the copy's progress
    (found by hand: "copying d<ESC>]0;pwned<BEL>.bin" was printed raw)."""
    from tests.graphs import two_weights_model

    src = tmp_path / "in" / "m.onnx"
    src.parent.mkdir()
    onnx.save_model(two_weights_model(), str(src), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="d\x1b]0;pwned\x07.bin",
                    size_threshold=0)
    r = ho("optimize", str(src), str(tmp_path / "out" / "o.onnx"), "--offload", "weights",
           "--min-bytes", "0")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "copying d\\x1b]0;pwned\\x07.bin" in r.stderr
    assert "\x1b" not in r.stdout + r.stderr


def test_a_library_warning_naming_a_value_is_shown_never_obeyed(tmp_path: Path):
    """onnx_ir logs a warning naming a graph output no node produces (inspect reads without
    the checker); logging's last-resort handler printed it raw (found by hand)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    z = helper.make_tensor_value_info("z\x1b]0;pwned\x07", TensorProto.FLOAT, [4])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y, z])
    p = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), p)
    r = ho("inspect", str(p))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Output 'z\\x1b]0;pwned\\x07' is not produced by any node" in r.stderr
    assert "\x1b" not in r.stdout + r.stderr


@pytest.mark.parametrize("cmd", ["verify", "profile"])
def test_ort_log_lines_quoting_a_name_are_shown_never_obeyed(tmp_path: Path, cmd: str):
    """ORT warns "Removing initializer '<name>'" for an unused weight, in the child process
    that runs it; the name's escape sequences reached the terminal (found by hand)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    unused = numpy_helper.from_array(np.ones(4, np.float32), "u\x1b]0;pwned\x07")
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y], [unused])
    p = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), p)
    args = [str(p), str(p)] if cmd == "verify" else [str(p), "--out", str(tmp_path / "p.json")]
    r = ho(cmd, *args, "--runs", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Removing initializer 'u\\x1b]0;pwned\\x07'" in r.stderr
    assert "\x1b" not in r.stdout + r.stderr

def test_ort_shape_inference_of_a_hostile_contrib_model_is_bounded(tmp_path: Path):
    """CONTRIB_BLOWUP passes ONNX's inference; ORT's (asked for its Gelu) would take gigabytes
    in this process: its child's limit stops it, one line."""
    p = tmp_path / "hostile.onnx"
    onnx.save(contrib_blowup_model(), p)
    r = ho("optimize", str(p), str(tmp_path / "o.onnx"), "--budget", "1MiB",
           env=dict(os.environ, HO_ONNX_SHAPE_INFERENCE_MEMORY="1.5GiB"))
    msg = one_line_error(r)
    assert "ORT's symbolic shape inference" in msg and "HO_ONNX_SHAPE_INFERENCE_MEMORY" in msg
    assert not (tmp_path / "o.onnx").exists()


def _relu_model(path: Path, dim: str, name: str = "X") -> Path:
    g = helper.make_graph([helper.make_node("Relu", [name], ["Y"])], "g",
                          [helper.make_tensor_value_info(name, TensorProto.FLOAT, [dim])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [dim])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize(("cmd", "advice"), [
    ("optimize", "too long to be an expression of names.*with --shape$"),
    ("verify", "has dims --dim cannot name.*--shape X=N$")])
def test_a_dim_no_parser_can_take_is_a_short_clear_error(tmp_path: Path, cmd: str,
                                                          advice: str):
    """A dim ``b*b*...*b`` of 3,000 factors was "unexpected RecursionError" (Python's
    parser); now a short message with what to do."""
    p = _relu_model(tmp_path / "deep.onnx", "*".join(["b"] * 3000))
    args = (["optimize", str(p), str(tmp_path / "o.onnx"), "--budget", "1MiB"]
            if cmd == "optimize" else ["verify", str(p), str(p)])
    msg = one_line_error(ho(*args, "--dim", "b=2"))
    assert "unexpected" not in msg and len(msg) < 400 and re.search(advice, msg), msg
    assert not (tmp_path / "o.onnx").exists()
    if cmd == "optimize":  # and that advice works
        r = ho("optimize", str(p), str(tmp_path / "o.onnx"), "--budget", "1MiB",
               "--shape", "X=4")
        assert r.returncode == 0, r.stderr


def test_a_long_message_keeps_its_advice(tmp_path: Path):
    """A model's names can be any length: past 2,000 characters the error line's middle is
    left out, not its end (was: the end, which says what to do)."""
    p = _relu_model(tmp_path / "long.onnx", "?", name="x" * 10_000)
    msg = one_line_error(ho("verify", str(p), str(p)))
    assert len(msg) < 2100 and "characters left out" in msg, msg[:200]
    assert msg.startswith("error: input 'xxx") and msg.endswith("xxx=N"), msg[-200:]


def _big_data_model(tmp_path: Path, mib: int) -> Path:
    """A model whose one weight lives in a non-sparse external data file of ``mib`` MiB."""
    src = tmp_path / "src"
    src.mkdir()
    n = (mib << 20) // 4
    w = numpy_helper.from_array(np.zeros(1, np.float32), "W")
    w.ClearField("raw_data")
    w.dims[:] = [n]
    w.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "w.bin"), ("offset", "0"), ("length", str(n * 4))):
        e = w.external_data.add()
        e.key, e.value = k, v
    with open(src / "w.bin", "wb") as f:
        block = os.urandom(1 << 20)
        for _ in range(mib):
            f.write(block)
    g = helper.make_graph([helper.make_node("Add", ["x", "W"], ["y"])], "big",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])], [w])
    p = src / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), p)
    return p


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_the_data_copy_leaves_nothing_behind(tmp_path: Path, sig: int):
    p = _big_data_model(tmp_path, 768)
    out_dir = tmp_path / "out"
    # (the signal's default disposition in the child: a run started as a shell's background
    # job inherits SIGINT ignored, and the command then rightly keeps it so)
    proc = subprocess.Popen([HO, "optimize", str(p), str(out_dir / "m.ho.onnx"), "--offload",
                             "none"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if out_dir.exists() and any(out_dir.iterdir()):
            break
        time.sleep(0.001)
    assert proc.poll() is None, "the copy finished before it could be interrupted"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "Traceback" not in err, err[-3000:]
    assert not out_dir.exists() or not any(out_dir.iterdir()), list(out_dir.iterdir())
    assert (p.parent / "w.bin").stat().st_size == 768 << 20


def test_optimize_of_a_folder_reads_nothing_outside_it(tmp_path: Path):
    """A model folder whose tokenizer is a link out of it (was: that file was copied into
    the output folder): one line, exit 2, no output folder."""
    src = tmp_path / "src"
    src.mkdir()
    onnx.save(chain_model(), src / "model.onnx")
    (src / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "secret.txt").write_text("private")
    (src / "tokenizer.json").symlink_to(tmp_path / "secret.txt")
    msg = one_line_error(ho("optimize", str(src), str(tmp_path / "out"), "--budget", "1KiB",
                            "--dim", "N=2"))
    assert "outside the folder" in msg and "tokenizer.json" in msg, msg
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cmd", ["verify", "profile"])
def test_a_model_that_runs_forever_ends_at_the_time_limit(tmp_path: Path, cmd: str):
    from tests.graphs import FOREVER_LOOP

    p = tmp_path / "forever.onnx"
    onnx.save(text_model(FOREVER_LOOP), p)
    args = {"verify": ["verify", str(p), str(p)],
            "profile": ["profile", str(p), "--out", str(tmp_path / "p.json")]}
    t0 = time.monotonic()
    msg = one_line_error(ho(*args[cmd], "--timeout", "2"))
    assert "did not finish" in msg and "within 2 s" in msg, msg
    assert time.monotonic() - t0 < 60 and not (tmp_path / "p.json").exists()
    r = ho(*args[cmd], env={**os.environ, "HO_ONNX_ORT_TIMEOUT": "2"})
    assert "within 2 s" in one_line_error(r)


@pytest.mark.parametrize("cmd", ["optimize", "profile"])
def test_a_long_legal_output_name_is_written(tmp_path: Path, model: Path, cmd: str):
    """Found by hand: the temporary file beside a 245-character output name (255 bytes is
    the limit) was too long, and the error named a file the user never gave."""
    out = tmp_path / ("é" * 120 + ("x.onnx" if cmd == "optimize" else "x.json"))
    assert len(os.fsencode(out.name)) == 246
    args = (["optimize", str(model), str(out), "--dim", "N=2"] if cmd == "optimize"
            else ["profile", str(model), "--out", str(out), "--runs", "1", "--dim", "N=2"])
    r = ho(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([model.name, out.name])


@pytest.mark.parametrize("cmd", [
    ["optimize", "{model}", "{bad}/o.onnx", "--dim", "N=2", "--min-bytes", "0"],
    ["verify", "{bad}/m.onnx", "{model}", "--dim", "N=2"],
    ["profile", "{bad}/m.onnx", "--out", "p.json", "--dim", "N=2"],
])
def test_a_path_that_is_not_utf8_is_refused_in_words(model: Path, tmp_path: Path, cmd):
    """onnx's checker and ORT take UTF-8 paths: a folder named with other bytes was an
    unexpected TypeError from their bindings (after the work, for an output)."""
    bad = os.fsdecode(os.fsencode(str(tmp_path)) + b"/d\xfd")
    os.mkdir(bad)
    onnx.save(chain_model(), os.path.join(bad, "m.onnx"))
    before = {p: digest(p) for p in tmp_path.rglob("*") if p.is_file()}
    r = ho(*(a.format(model=model, bad=bad) for a in cmd), cwd=tmp_path)
    msg = one_line_error(r)
    assert "is not valid UTF-8" in msg and "\\xfd" in msg, msg
    assert {p: digest(p) for p in tmp_path.rglob("*") if p.is_file()} == before


def test_the_library_refuses_an_output_path_that_is_not_utf8(model: Path, tmp_path: Path):
    from ho_onnx.errors import OutputPathError
    from ho_onnx.rewrite.pipeline import optimize
    from ho_onnx.schedule.options import OffloadOptions

    out = os.fsdecode(os.fsencode(str(tmp_path)) + b"/o\xfd.onnx")
    with pytest.raises(OutputPathError, match="not a UTF-8 path"):
        optimize(model, out, OffloadOptions(min_bytes=0), dims={"N": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
