"""Writing the output (graph.save, with rewrite.place): data kept where the runtime finds
it, atomic, the input never touched."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from graphs import chain_model, folder_digest, save, text_model
from threads import run_threads

from ho_onnx import contract
from ho_onnx.errors import ModelLoadError, OutputPathError
from ho_onnx.graph.save import copy_sparse, read_json, write_atomic
from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.options import OffloadOptions

ALL = OffloadOptions(min_bytes=0, min_gap=1, prefetch_distance=1)


def _weight_attrs(path: Path) -> dict[str, tuple[str, int, int]]:
    m = onnx.load(str(path), load_external_data=False)
    out = {}
    for n in m.graph.node:
        if n.op_type == contract.PREFETCH and any(a.name == contract.ATTR_LOCATION
                                                  for a in n.attribute):
            a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
            out[a["name"].decode()] = (a["location"].decode(), a["offset"], a["length"])
    return out


def _read(folder: Path, ref: tuple[str, int, int]) -> bytes:
    loc, off, length = ref
    with open(folder / loc, "rb") as f:
        f.seek(off)
        return f.read(length)


def test_external_data_beside_input_is_reused(tmp_path):
    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    before = folder_digest(tmp_path)
    optimize(src, tmp_path / "m.ho.onnx", ALL)
    assert {k: v for k, v in folder_digest(tmp_path).items() if k in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.ho.onnx", "m.onnx", "m.onnx.data"]
    full = onnx.load(str(src))
    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in full.graph.initializer}
    for name, ref in _weight_attrs(tmp_path / "m.ho.onnx").items():
        assert ref[0] == "m.onnx.data"
        assert _read(tmp_path, ref) == arrays[name].tobytes()


def test_inline_weights_go_to_an_aligned_sidecar(tmp_path):
    src = save(chain_model(), tmp_path / "m.onnx")
    optimize(src, tmp_path / "out.onnx", ALL)
    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in chain_model().graph.initializer}
    refs = _weight_attrs(tmp_path / "out.onnx")
    assert set(refs) == {"W1", "W2"}
    for name, ref in refs.items():
        assert ref[0] == "out.onnx.data" and ref[1] % 64 == 0
        assert np.array_equal(np.frombuffer(_read(tmp_path, ref), np.float32).reshape(16, 16),
                              arrays[name])


def test_typed_weights_of_more_dims_than_numpy_holds_reach_the_sidecar(tmp_path):
    """Inline weights in typed fields (float_data) of rank 70, empty or not, are written as
    their values' bytes (found by hand: numpy's "maximum supported dimension" ValueError when
    an empty rank-70 weight was offloaded); the outputs equal the original's, bit for bit."""
    import onnxruntime as ort

    from ho_onnx.target.ort.runtime import InferenceSession

    full = [1] * 69 + [2]
    model = onnx.parser.parse_model(
        '<ir_version: 8, opset_import: ["" : 17]> g (float[2] x) => (float[2] y, float[0] z) '
        "{ w1 = Reshape (w, two)  y = Add (x, w1)  z = Reshape (e, flat) }")
    model.graph.initializer.extend([
        onnx.helper.make_tensor("w", onnx.TensorProto.FLOAT, full, [1.5, -2.0]),
        onnx.helper.make_tensor("e", onnx.TensorProto.FLOAT, [0, *full], []),
        onnx.numpy_helper.from_array(np.array([2], np.int64), "two"),
        onnx.numpy_helper.from_array(np.array([-1], np.int64), "flat")])
    src = save(model, tmp_path / "m.onnx")
    optimize(src, tmp_path / "out.onnx", OffloadOptions(activations=False, min_bytes=0))
    refs = _weight_attrs(tmp_path / "out.onnx")
    assert _read(tmp_path, refs["w"]) == np.array([1.5, -2.0], np.float32).tobytes()
    assert refs["e"][2] == 0  # offloaded, with nothing to read
    x = np.array([3.0, 4.0], np.float32)
    want = ort.InferenceSession(str(src)).run(None, {"x": x})
    got = InferenceSession(tmp_path / "out.onnx").run(None, {"x": x})
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
        assert g.shape == w.shape


def test_an_output_that_is_a_link_is_replaced_with_its_data_beside_it(tmp_path):
    """A link at the output name is replaced by the model, never written through, and the
    data goes beside the model, not beside the link's target (found by hand: the data went
    to the target's folder and the output could not find it); a folder reached through a
    link is that folder. The link's target is untouched; the outputs run bit-exact."""
    import onnxruntime as ort

    from ho_onnx.target.ort.runtime import InferenceSession

    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "target.onnx").write_text("keep")
    (tmp_path / "a" / "out.onnx").symlink_to("../b/target.onnx")
    (tmp_path / "via").symlink_to("b", target_is_directory=True)
    x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    want = ort.InferenceSession(str(src)).run(None, {"x": x})[0]
    for out, folder in [(tmp_path / "a" / "out.onnx", "a"), (tmp_path / "via" / "o.onnx", "b")]:
        optimize(src, out, ALL, dims={"N": 2})
        assert not out.is_symlink() and (tmp_path / folder / "m.onnx.data").is_file()
        np.testing.assert_array_equal(InferenceSession(out).run(None, {"x": x})[0], want)
    assert (tmp_path / "b" / "target.onnx").read_text() == "keep"


def test_a_link_where_the_data_copy_goes_is_refused_and_kept(tmp_path):
    """A symbolic link to the input's data file where its copy goes was taken as the copy
    (found by hand: the output failed when run, the library not following links): one clear
    error before anything is written, the link kept; without it the output runs. A hard
    link there is a copy sharing its blocks, used as one: the output runs bit-exact."""
    import onnxruntime as ort

    from ho_onnx.target.ort.runtime import InferenceSession

    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    out = tmp_path / "out"
    out.mkdir()
    data = out / "m.onnx.data"
    data.symlink_to("../m.onnx.data")
    with pytest.raises(OutputPathError, match="already exists as a symbolic link"):
        optimize(src, out / "o.onnx", ALL, dims={"N": 2})
    assert sorted(p.name for p in out.iterdir()) == ["m.onnx.data"] and data.is_symlink()
    data.unlink()
    os.link(tmp_path / "m.onnx.data", data)
    optimize(src, out / "o.onnx", ALL, dims={"N": 2})
    x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    np.testing.assert_array_equal(InferenceSession(out / "o.onnx").run(None, {"x": x})[0],
                                  ort.InferenceSession(str(src)).run(None, {"x": x})[0])
    assert data.stat().st_nlink == 2  # (used, not copied over)


def test_output_elsewhere_copies_data_with_progress_keeping_holes(tmp_path, monkeypatch):
    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    with open(tmp_path / "m.onnx.data", "ab") as f:  # a hole of 64 MiB at the end
        f.truncate(f.tell() + (64 << 20))
    out = tmp_path / "other" / "dir" / "m.ho.onnx"
    seen = []
    r = optimize(src, out, ALL, progress=lambda what, done, total: seen.append((done, total)))
    copied = out.parent / "m.onnx.data"
    assert r.report.copied == [copied]
    assert copied.read_bytes() == (tmp_path / "m.onnx.data").read_bytes()
    assert seen and seen[-1][0] == seen[-1][1]  # progress reached 100%
    assert copied.stat().st_blocks * 512 < (8 << 20)  # the hole stayed a hole
    assert copied.stat().st_nlink == 1  # onnx.checker refuses hard-linked data
    optimize(src, out, ALL)  # again: the earlier copy is recognised, not an error


def test_copy_reads_only_the_regular_file_it_was_given(tmp_path):
    """copy_sparse opens its source without following a link, without blocking on a FIFO,
    and (``expect``) only as the file seen before; the copy keeps permission bits and times
    (a later save recognises an earlier copy by size and mtime)."""
    src = tmp_path / "w.bin"
    src.write_bytes(os.urandom(3000))
    src.chmod(0o640)
    os.utime(src, ns=(1_000_000_000, 2_000_000_123))
    st = src.stat()
    copy_sparse(src, tmp_path / "c.bin", expect=(st.st_dev, st.st_ino))
    c = (tmp_path / "c.bin").stat()
    assert (tmp_path / "c.bin").read_bytes() == src.read_bytes()
    assert (c.st_mode & 0o777, c.st_mtime_ns) == (0o640, 2_000_000_123)
    (tmp_path / "link").symlink_to(src)
    os.mkfifo(tmp_path / "fifo")
    other = tmp_path / "other.bin"
    other.write_bytes(b"x")
    for path, why in [(tmp_path / "link", "became a symbolic link"),
                      (tmp_path / "fifo", "is not a regular file"),
                      (other, "was replaced")]:
        with pytest.raises(ModelLoadError, match=why):
            copy_sparse(path, tmp_path / "d.bin", expect=(st.st_dev, st.st_ino))
    assert not (tmp_path / "d.bin").exists()


def test_existing_different_data_file_is_not_overwritten(tmp_path):
    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "m.onnx.data").write_bytes(b"someone else's")
    with pytest.raises(OutputPathError, match="already exists"):
        optimize(src, tmp_path / "o" / "m.ho.onnx", ALL)
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["m.onnx.data"]


def test_output_equal_to_input_is_refused(tmp_path):
    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    before = folder_digest(tmp_path)
    for target in (src, tmp_path / "." / "m.onnx", tmp_path / "m.onnx.data"):
        with pytest.raises(OutputPathError):
            optimize(src, target, ALL)
    assert folder_digest(tmp_path) == before


@pytest.mark.parametrize("fail_at", [1, 2])
def test_failure_while_saving_leaves_nothing(tmp_path, monkeypatch, fail_at):
    """The sidecar's rename (1) or the model's (2) fails: no output, no temporary file."""
    src = save(chain_model(), tmp_path / "m.onnx")
    before = folder_digest(tmp_path)
    real, calls = os.replace, []

    def flaky(a, b):
        calls.append(b)
        if len(calls) == fail_at:
            raise OSError(28, "No space left on device (simulated)")
        return real(a, b)

    monkeypatch.setattr(os, "replace", flaky)
    with pytest.raises(OutputPathError, match=r"cannot write the output in .*: No space left "
                       r"on device \(simulated\) \(.* free\); free some space"):
        optimize(src, tmp_path / "out.onnx", ALL)
    assert folder_digest(tmp_path) == before
    calls.clear()
    for err, want in [(PermissionError(13, "Permission denied (simulated)"),
                       r"in .*: Permission denied \(simulated\); choose another output"),
                      (OSError(5, "Input/output error (simulated)"), None)]:
        monkeypatch.setattr(os, "replace", lambda a, b, err=err: (_ for _ in ()).throw(err))
        with pytest.raises(OutputPathError if want else OSError, match=want or "simulated") \
                as e:  # (other errors pass as they are)
            optimize(src, tmp_path / "out.onnx", ALL)
        assert want or e.value is err
        assert folder_digest(tmp_path) == before


def test_an_unreadable_input_data_file_is_not_blamed_on_the_output_folder(tmp_path,
                                                                          monkeypatch):
    """A permission error reading the input's data file (copied to another folder) keeps its
    own words and path; only errors of files in the output folder name the folder."""
    from ho_onnx.graph import save as save_mod

    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    (tmp_path / "o").mkdir()
    data = tmp_path / "m.onnx.data"

    def unreadable(path, expect=None):
        raise PermissionError(13, "Permission denied (simulated)", str(path))

    monkeypatch.setattr(save_mod, "open_regular", unreadable)
    with pytest.raises(PermissionError) as e:
        optimize(src, tmp_path / "o" / "m.ho.onnx", ALL)
    assert e.value.filename == str(data)
    assert list((tmp_path / "o").iterdir()) == []


def test_a_data_file_that_cannot_fit_is_refused_before_copying(tmp_path, monkeypatch):
    """Found by hand: an output folder on a nearly full disk got a bare "No space left on
    device" once the copy had filled it; now the copy is refused first, saying how much
    it needs and what is free, and nothing is left behind."""
    from ho_onnx.graph import save as save_mod

    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    (tmp_path / "o").mkdir()
    before = folder_digest(tmp_path)
    monkeypatch.setattr(save_mod, "free_bytes", lambda folder: 1000)
    with pytest.raises(OutputPathError, match=r"cannot copy m\.onnx\.data \(2\.00 KiB of "
                       r"data\) into .*/o': only 1000 B free; free some space"):
        optimize(src, tmp_path / "o" / "m.ho.onnx", ALL)
    assert folder_digest(tmp_path) == before


def test_a_full_filesystem_is_one_clear_error(tmp_path):
    """The same on a real full filesystem (a 256 KiB tmpfs; as root where mounting works)."""
    import subprocess

    mnt = tmp_path / "full"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
            capture_output=True, check=False).returncode != 0:
        pytest.skip("needs root and a tmpfs mount")
    try:
        src = save(text_model_big(), tmp_path / "m.onnx", external=True)
        with pytest.raises(OutputPathError, match=r"cannot copy m\.onnx\.data \(1\.00 MiB "
                           r"of data\) into .*: only .* free"):
            optimize(src, mnt / "m.ho.onnx", ALL)
        src = save(text_model_big(), tmp_path / "inline.onnx")  # the sidecar does not fit
        with pytest.raises(OutputPathError, match=r"cannot write the output in .*: No space "
                           r"left on device \(.* free\)"):
            optimize(src, mnt / "m.ho.onnx", ALL)
        with pytest.raises(OutputPathError, match=r"cannot write the output in .*: No space "
                           r"left on device"):
            write_atomic(mnt / "p.json", b"x" * (512 << 10))  # (profile's, calibrate's JSON)
        assert not list(mnt.iterdir())
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_read_only_output_folder_is_refused_before_any_work(tmp_path):
    """Found by hand: a read-only output folder failed only after planning, naming a hidden
    temporary file ("Read-only file system: '/out/.o.onnx.data.ho-tmp-29460'"). Now the
    folder (or the nearest one that exists) is checked first, for the model and the CLI's
    other outputs (--out of profile)."""
    import subprocess

    from click.testing import CliRunner

    from ho_onnx.cli import main

    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:  # (root writes through permission bits: a read-only mount)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(ro)],
                          capture_output=True, check=False).returncode != 0:
            pytest.skip("needs a tmpfs mount as root")
    else:
        ro.chmod(0o555)
    try:
        for out in (ro / "o.onnx", ro / "sub" / "o.onnx"):
            with pytest.raises(OutputPathError, match=r"is not writable \(a read-only "
                               r"filesystem, or no permission\); choose another"):
                optimize(src, out, ALL)
        r = CliRunner().invoke(main, ["profile", str(src), "--out", str(ro / "p.json"),
                                      "--dim", "N=2"])
        assert r.exit_code == 2 and "is not writable" in r.stderr and "--out" in r.stderr
        assert ".p.json." not in r.stderr, r.stderr  # (no temporary name)
        assert not list(ro.iterdir())
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], check=False)
        ro.chmod(0o755)


def text_model_big():
    """A MatMul whose weight is 1 MiB."""
    from graphs import text_model

    return text_model("g (float[2, 512] x) => (float[2, 512] y) { y = MatMul(x, w) }",
                      w=(512, 512))


def test_no_value_info_for_what_an_initializer_says_itself(tmp_path):
    """onnx_ir writes a value_info for every initializer; the output keeps only those that
    say more than the tensor (here a symbolic dim, a doc string, a type denotation), the
    model being saved keeps every type and shape (hidden only while serialising), and ORT
    runs the output."""
    import onnx_ir as ir
    import onnxruntime as ort

    from ho_onnx.graph.load import load_model
    from ho_onnx.graph.save import OutputFiles, implied_types_hidden, save_model

    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 3] x) => (float[2, 3] y) <float[2, 3] a = {1,2,3,4,5,6},
                                              float[2, 3] b = {1,1,1,1,1,1},
                                              float[2, 3] c = {2,2,2,2,2,2},
                                              float[2, 3] e = {0,0,0,0,0,0}> {
            t = Add(x, a)
            u = Mul(t, b)
            s = Sub(u, c)
            y = Add(s, e)
        }""")
    denoted = onnx.helper.make_tensor_value_info("e", onnx.TensorProto.FLOAT, [2, 3])
    denoted.type.denotation = "TENSOR"
    model.graph.value_info.extend([
        onnx.helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, ["n", 3]),
        onnx.helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, [2, 3], "documented"),
        denoted])
    src = save(model, tmp_path / "m.onnx")
    loaded = load_model(src)
    before = {n: (v.type, v.shape) for n, v in loaded.model.graph.initializers.items()}
    with implied_types_hidden(loaded.model) as hidden:
        assert hidden == 1  # a: nothing beyond its tensor
        assert loaded.model.graph.initializers["a"].type is None
    assert {n: (v.type, v.shape) for n, v in loaded.model.graph.initializers.items()} == before
    save_model(OutputFiles(loaded.model), loaded, tmp_path / "out.onnx")
    out = onnx.load(str(tmp_path / "out.onnx"))
    infos = {vi.name: vi for vi in out.graph.value_info}
    assert "a" not in infos and infos["c"].doc_string == "documented"
    assert infos["e"].type.denotation == "TENSOR"
    assert [d.dim_param or d.dim_value for d in infos["b"].type.tensor_type.shape.dim] == ["n", 3]
    assert {n: (v.type, v.shape) for n, v in loaded.model.graph.initializers.items()} == before
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = ort.InferenceSession(str(tmp_path / "out.onnx")).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, (x + np.arange(1, 7, dtype=np.float32).reshape(2, 3)) - 2)
    assert ir.load(str(tmp_path / "out.onnx")).graph.initializers["a"].shape == [2, 3]



@pytest.mark.parametrize("body", [
    "g (float[N, 16] x) => (float[N, 16] y, float[16, 16] W1, float[16, 16] W2) "
    "{ h = MatMul(x, W1)\n y = MatMul(h, W2) }",
    "g (float[N, 16] x) => (float[N, 16] y, float[16, 16] W2) { h = MatMul(x, W1)\n y = Relu(h) }",
    "g (float[N, 16] x) => (float[16, 16] W2) { }",
])
def test_an_initializer_that_is_a_graph_output_keeps_its_type(tmp_path, body):
    """An initializer the graph outputs is written with its type: its type was hidden from
    the serialiser as one its tensor implies, and the output failed onnx.checker ("Field
    'type' of 'value_info' is required but missing", found by hand with a graph whose only
    output is a weight). The outputs equal the original's, bit for bit."""
    import onnxruntime as ort

    from ho_onnx.target.ort.runtime import InferenceSession

    src = save(text_model(body, W1=(16, 16), W2=(16, 16)), tmp_path / "m.onnx")
    optimize(src, tmp_path / "o.onnx", ALL, dims={"N": 2})
    onnx.checker.check_model(str(tmp_path / "o.onnx"), full_check=True)
    x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    want = ort.InferenceSession(str(src)).run(None, {"x": x})
    got = InferenceSession(tmp_path / "o.onnx").run(None, {"x": x})
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("ulimit", [None, 1 << 20])
def test_a_file_past_the_size_limit_names_the_folder_and_the_limit(tmp_path, monkeypatch,
                                                                  ulimit):
    """EFBIG: the process's ``ulimit -f`` when it has one (the CLI test hits it for real),
    else the filesystem's largest file (FAT32's 4 GiB)."""
    import errno
    import resource

    from ho_onnx.graph import save as save_mod

    soft = resource.RLIM_INFINITY if ulimit is None else ulimit
    monkeypatch.setattr(resource, "getrlimit", lambda what: (soft, resource.RLIM_INFINITY))
    e = save_mod.write_error(OSError(errno.EFBIG, "File too large", str(tmp_path / ".t")),
                             tmp_path)
    assert isinstance(e, OutputPathError)
    assert str(e) == (f"cannot write the output in {str(tmp_path)!r}: File too large ("
                      + ("larger than the filesystem's largest file" if ulimit is None else
                         "this process may write files of at most 1.00 MiB: ulimit -f")
                      + "); choose another output folder")


def test_temporary_files_are_removed_and_a_full_folder_is_named(tmp_path):
    """The block's temporary files go when it fails (or is interrupted), a full folder is
    one error naming the folder, other errors pass unchanged; cleared files stay."""
    import errno

    from ho_onnx.graph.save import temporary_files

    full = pytest.raises(OutputPathError, match=r"cannot write the output in .*No space left")
    with full, temporary_files(tmp_path) as temps:
        temps.append(tmp_path / ".t1")
        temps[0].write_bytes(b"1")
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / ".t1"))
    with pytest.raises(KeyboardInterrupt), temporary_files(tmp_path) as temps:
        temps.append(tmp_path / ".t2")
        temps[0].write_bytes(b"2")
        raise KeyboardInterrupt
    with pytest.raises(FileNotFoundError), temporary_files(tmp_path) as temps:
        raise FileNotFoundError(errno.ENOENT, "gone", "/elsewhere/x")
    with temporary_files(tmp_path) as temps:
        temps.append(tmp_path / "kept")
        temps[0].write_bytes(b"3")
        temps.clear()
    assert sorted(f.name for f in tmp_path.iterdir()) == ["kept"]


def test_saves_from_several_threads_copy_a_shared_data_file_once(tmp_path, monkeypatch):
    """Threads optimizing one model into one other folder at the same moment (a slow copy,
    so that they overlap): every output is written, the data file is copied once and the
    others use it, no temporary file is left. Failed before: all but one thread with a bare
    FileNotFoundError (the copy's temporary file had one name per process)."""
    import threading
    import time

    from ho_onnx.graph import save as save_mod

    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    copies = []
    real_copy = save_mod.copy_sparse

    def slow_copy(*args, **kwargs):
        copies.append(args[1])
        time.sleep(0.3)
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(save_mod, "copy_sparse", slow_copy)
    start = threading.Barrier(4)

    def one(t: int) -> None:
        start.wait()
        optimize(src, tmp_path / "out" / f"m{t}.onnx", ALL, dims={"N": 2})

    run_threads(one, 4)
    assert len(copies) == 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "m.onnx.data", "m0.onnx", "m1.onnx", "m2.onnx", "m3.onnx"]


def test_a_failed_save_leaves_a_data_file_another_save_uses(tmp_path):
    """The save that copied a data file fails: the copy goes, unless another save of this
    process is using it (its output is, or will be, written beside it)."""
    from ho_onnx.graph.save import SaveReport, _DataFiles

    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    data, dst = tmp_path / "m.onnx.data", tmp_path / "out" / "m.onnx.data"
    report = SaveReport(model_path=tmp_path / "out" / "x.onnx")

    def placed(*saves: _DataFiles) -> None:
        for s in saves:
            s.place(data, dst, report, None)

    first, second = _DataFiles(), _DataFiles()
    placed(first, second)  # the second waits for the first's copy and uses it
    first.end(ok=False)
    assert dst.read_bytes() == data.read_bytes()  # kept: the second uses it
    second.end(ok=True)
    assert dst.exists()

    dst.unlink()
    first, second = _DataFiles(), _DataFiles()
    placed(first, second)
    second.end(ok=False)  # the user failed too: nobody needs the copy
    first.end(ok=False)
    assert not dst.exists() and src.exists()
    assert [p.name for p in (tmp_path / "out").iterdir()] == []


def test_the_umask_is_read_without_being_changed(monkeypatch):
    """Files get 0666 less the umask; reading it by setting it (umask(0), then back) left
    other threads a window with no umask, and two saves at once could leave the process
    without one for good."""
    from ho_onnx.graph import save as save_mod

    mask = os.umask(0o027)
    try:
        def no_umask(_mask):
            raise AssertionError("os.umask called")

        monkeypatch.setattr(save_mod.os, "umask", no_umask)
        assert save_mod._umask_mode() == 0o640
    finally:
        monkeypatch.undo()
        os.umask(mask)


def _fail_renames_onto(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """``os.replace`` onto a path ending in ``name`` fails as on a full disk."""
    real = os.replace

    def rename(a, b):
        if str(b).endswith(name):
            raise OSError(28, "No space left on device (simulated)", str(b))
        return real(a, b)

    monkeypatch.setattr(os, "replace", rename)


def test_a_failed_save_into_another_folder_removes_the_data_file_it_copied(tmp_path,
                                                                         monkeypatch):
    """The model's rename fails after the data file was copied into the output folder: the
    copy goes too (and the folder the save made), the input is untouched."""
    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    before = folder_digest(tmp_path)
    _fail_renames_onto(monkeypatch, "m.ho.onnx")
    with pytest.raises(OutputPathError, match="No space left on device"):
        optimize(src, tmp_path / "out" / "m.ho.onnx", ALL, dims={"N": 2})
    assert not (tmp_path / "out").exists()
    assert folder_digest(tmp_path) == before


_SAVER = """
import os, sys, time
from pathlib import Path
from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.options import OffloadOptions
src, out, ready, role = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
if role == "fails":  # copies the data file, says so, then fails while renaming its model
    real = os.replace
    def replace(a, b):
        if str(b) == str(out):
            ready.write_text("copied")
            time.sleep(3)
            raise OSError(28, "No space left on device (simulated)", str(b))
        return real(a, b)
    os.replace = replace
else:  # starts once the other's copy is in place
    while not ready.exists():
        time.sleep(0.01)
try:
    optimize(src, out, OffloadOptions(min_bytes=0, min_gap=1, prefetch_distance=1),
             dims={"N": 2}, progress=lambda what, done, total: total or print(what))
except Exception as e:
    print(type(e).__name__, e)
    sys.exit(1)
"""


def test_a_process_whose_save_fails_leaves_another_process_its_data_file(tmp_path):
    """Two processes optimize one model into one folder: the first copies the data file and
    fails (interrupted, disk full) after the second has started. The second's output still
    finds its data file. Failed before: the second saw the first's copy, finished within
    the first's failure and lost the file when the first removed what it had copied."""
    import subprocess
    import sys

    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    out, ready = tmp_path / "out", tmp_path / "ready"
    out.mkdir()

    def start(name: str, role: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", _SAVER, str(src), str(out / name),
                                 str(ready), role], text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)

    second = start("b.onnx", "second")
    first = start("a.onnx", "fails")
    assert first.wait(60) == 1 and "No space left" in first.stdout.read()  # type: ignore[union-attr]
    said = second.stdout.read()  # type: ignore[union-attr]
    assert second.wait(60) == 0, said
    assert "waiting for another process placing m.onnx.data" in said
    assert sorted(p.name for p in out.iterdir()) == ["b.onnx", "m.onnx.data"]
    onnx.checker.check_model(str(out / "b.onnx"))  # by path: its data file is there
    ref = next(iter(_weight_attrs(out / "b.onnx").values()))
    assert (out / ref[0]).read_bytes() == (tmp_path / "m.onnx.data").read_bytes()


def test_source_locks_are_shared_in_a_process_and_taken_in_one_order(tmp_path, monkeypatch):
    """Saves of one process share the lock on a source file (a second save neither waits for
    the first nor frees the lock early); another process can lock it once the last ends;
    several files are locked sorted, whatever order a model names them in (two processes
    could otherwise each hold one and wait for the other)."""
    import subprocess
    import sys

    from ho_onnx.graph import save as save_mod
    from ho_onnx.graph.save import _DataFiles

    a, b = tmp_path / "a.data", tmp_path / "b.data"
    a.write_bytes(b"a")
    b.write_bytes(b"b")
    probe = ("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDONLY)\n"
             "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
             "except BlockingIOError:\n    sys.exit(3)\n")

    def free(path: Path) -> bool:  # another process can lock it now
        r = subprocess.run([sys.executable, "-c", probe, str(path)], timeout=60, check=False)
        assert r.returncode in (0, 3)
        return r.returncode == 0

    first, second = _DataFiles(), _DataFiles()
    first.lock([a], None)
    run_threads(lambda _: second.lock([a], None), 1, timeout=10)  # shared: returns at once
    first.end(ok=True)
    assert not free(a)  # the second still holds it
    second.end(ok=True)
    assert free(a) and not save_mod._LOCKS

    order: list[str] = []
    real = save_mod._flock
    monkeypatch.setattr(save_mod, "_flock",
                        lambda p, key, pr: order.append(p.name) or real(p, key, pr))
    first_file, last_file = sorted((a, b), key=lambda f: (f.stat().st_dev, f.stat().st_ino))
    third = _DataFiles()
    third.lock([last_file, first_file, last_file], None)
    assert order == [first_file.name, last_file.name]  # by (device, inode), each once
    assert not free(a) and not free(b)
    third.end(ok=False)
    assert free(a) and free(b)


def test_a_source_swapped_for_a_fifo_is_not_waited_on_by_the_lock(tmp_path):
    """Locking a source data file opens it without blocking: one swapped for a FIFO after
    the model was checked is left unlocked (the copy then refuses it), not waited on."""
    from ho_onnx.graph.save import _DataFiles

    fifo = tmp_path / "m.onnx.data"
    os.mkfifo(fifo)
    files = _DataFiles()
    run_threads(lambda _: files.lock([fifo], None), 1, timeout=10)
    files.end(ok=False)


def test_a_save_into_a_folder_a_failed_save_made_and_removed_still_writes(tmp_path,
                                                                         monkeypatch):
    """Two saves into a new folder: the first makes it, the second finds it, the first
    fails and removes it (empty, its own), then the second writes. Failed before: the
    second with a bare FileNotFoundError for its temporary file."""
    import contextlib
    import threading

    from ho_onnx.graph import save as save_mod

    src = save(chain_model(), tmp_path / "m.onnx")  # inline weights: a sidecar, no data file
    out = tmp_path / "out"
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    role = threading.local()
    real = save_mod.new_folders

    @contextlib.contextmanager
    def staged(folder):
        with real(folder) as f:
            if role.name == "a":  # made the folder; fails once the other has found it
                a_in.set()
                assert b_in.wait(30)
                raise OSError(28, "No space left on device (simulated)", str(folder))
            b_in.set()
            assert a_done.wait(30)  # the folder is gone again
            yield f

    monkeypatch.setattr(save_mod, "new_folders", staged)

    def one(k: int) -> None:
        role.name = "ab"[k]
        if k == 0:
            with pytest.raises(OSError, match="No space left"):
                optimize(src, out / "a.onnx", ALL, dims={"N": 2})
            assert not out.exists()
            a_done.set()
        else:
            assert a_in.wait(30)
            optimize(src, out / "b.onnx", ALL, dims={"N": 2})

    run_threads(one, 2, timeout=60)
    assert sorted(p.name for p in out.iterdir()) == ["b.onnx", "b.onnx.data"]
    onnx.checker.check_model(str(out / "b.onnx"))


def test_a_temporary_file_is_made_in_a_folder_removed_just_before(tmp_path, monkeypatch):
    """The folder goes just before the temporary file's creation (another save's failure):
    it is made once more."""
    from ho_onnx.graph import save as save_mod

    folder, real, calls = tmp_path / "out", os.open, []

    def racing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            folder.rmdir()
        return real(*args, **kwargs)

    folder.mkdir()
    monkeypatch.setattr(save_mod.os, "open", racing)
    temps: list[Path] = []
    fd, path = save_mod.new_temp(folder, ".x.", temps)
    os.close(fd)
    assert path.parent == folder and path.exists() and len(calls) == 2 and path in temps


def test_an_interruption_as_a_temporary_file_appears_leaves_nothing(tmp_path, monkeypatch):
    """A SIGTERM (here KeyboardInterrupt) right after the file was created: its path is
    already recorded, so the clean-up removes it (was: created by mkstemp, recorded after:
    found by CI, a signal sent as the copy's temporary file appeared left it behind)."""
    from ho_onnx.graph import save as save_mod

    real = os.open

    def interrupted(*args, **kwargs):
        os.close(real(*args, **kwargs))
        raise KeyboardInterrupt

    monkeypatch.setattr(save_mod.os, "open", interrupted)
    with pytest.raises(KeyboardInterrupt), save_mod.temporary_files(tmp_path) as temps:
        save_mod.new_temp(tmp_path, ".x.", temps)
    assert list(tmp_path.iterdir()) == []


def _weights_read_from_the_model_file(path: Path) -> Path:
    """chain_model whose W2 reads its bytes from the model file itself (W1's raw data)."""
    m = chain_model()
    w1, w2 = (next(t for t in m.graph.initializer if t.name == n) for n in ("W1", "W2"))
    w2.ClearField("raw_data")
    for key, value in (("location", path.name), ("offset", "0000"),
                       ("length", str(len(w1.raw_data)))):
        w2.external_data.add(key=key, value=value)
    w2.data_location = w2.EXTERNAL
    offset = m.SerializeToString().find(w1.raw_data)
    w2.external_data[1].value = str(offset).zfill(4)  # (same length: W1 stays where it was)
    blob = m.SerializeToString()
    assert blob.find(w1.raw_data) == offset
    path.write_bytes(blob)
    return path


def test_an_output_a_copied_data_file_would_replace_is_refused(tmp_path):
    """A model whose weight is read from the model file itself, written into another folder
    under its own name: the data file copied there ('m.onnx') and the output are one path.
    Refused before any work (was: written, the copy replaced by the output, and the model
    failed in ORT with a data file of the wrong size). Under another name it is written
    and bit-exact."""
    import onnxruntime as ort

    from ho_onnx.target.ort.runtime import InferenceSession

    src = _weights_read_from_the_model_file(tmp_path / "m.onnx")
    before = folder_digest(tmp_path)
    with pytest.raises(OutputPathError, match="has the name of the input model's data file"):
        optimize(src, tmp_path / "out" / "m.onnx", ALL, dims={"N": 2})
    assert not (tmp_path / "out").exists() and folder_digest(tmp_path) == before
    optimize(src, tmp_path / "out" / "o.onnx", ALL, dims={"N": 2})
    x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    want = ort.InferenceSession(str(src)).run(None, {"x": x})[0]
    np.testing.assert_array_equal(InferenceSession(tmp_path / "out" / "o.onnx").run(
        None, {"x": x})[0], want)


def test_a_failed_save_removes_the_folders_it_made_for_data_files(tmp_path, monkeypatch):
    """The data file lives in a subfolder ('weights/m.data'), copied into the output folder
    under the same subfolder; the model's rename, or the copy, fails: the copy, its
    subfolder and the output folder all go (the subfolder stayed, and so the output folder
    with it)."""
    m = chain_model()
    (tmp_path / "weights").mkdir()
    onnx.save_model(m, str(tmp_path / "m.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="weights/m.data", size_threshold=0)
    _fail_renames_onto(monkeypatch, "o.onnx")
    with pytest.raises(OutputPathError, match="No space left on device"):
        optimize(tmp_path / "m.onnx", tmp_path / "out" / "o.onnx", ALL, dims={"N": 2})
    assert not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()  # an existing output folder stays, without the subfolder
    with pytest.raises(OutputPathError, match="No space left on device"):
        optimize(tmp_path / "m.onnx", tmp_path / "out" / "o.onnx", ALL, dims={"N": 2})
    assert list((tmp_path / "out").iterdir()) == []
    monkeypatch.undo()
    from ho_onnx.graph import save as save_mod

    def copy_fails(src, dst, *args, **kwargs):  # a full disk halfway through the copy
        Path(dst).write_bytes(b"partial")
        raise OSError(28, "No space left on device (simulated)", str(dst))

    monkeypatch.setattr(save_mod, "copy_sparse", copy_fails)
    with pytest.raises(OutputPathError, match="No space left on device"):
        optimize(tmp_path / "m.onnx", tmp_path / "out" / "o.onnx", ALL, dims={"N": 2})
    assert list((tmp_path / "out").iterdir()) == []
    monkeypatch.undo()
    optimize(tmp_path / "m.onnx", tmp_path / "out" / "o.onnx", ALL, dims={"N": 2})
    assert sorted(p.relative_to(tmp_path / "out").as_posix()
                  for p in (tmp_path / "out").rglob("*")) == ["o.onnx", "weights", "weights/m.data"]


def test_two_names_of_one_data_file_do_not_wait_for_each_other(tmp_path):
    """A model whose two weights name two hard links of one data file: the file is locked
    once (locked by path, the second lock waited forever for the first, in one process:
    optimize hung)."""
    import subprocess
    import sys

    m = chain_model()
    w1, w2 = (next(t for t in m.graph.initializer if t.name == n) for n in ("W1", "W2"))
    (tmp_path / "a.data").write_bytes(w1.raw_data + w2.raw_data)
    os.link(tmp_path / "a.data", tmp_path / "b.data")
    for t, loc, offset in ((w1, "a.data", 0), (w2, "b.data", len(w1.raw_data))):
        size = len(t.raw_data)
        t.ClearField("raw_data")
        for key, value in (("location", loc), ("offset", str(offset)), ("length", str(size))):
            t.external_data.add(key=key, value=value)
        t.data_location = t.EXTERNAL
    (tmp_path / "m.onnx").write_bytes(m.SerializeToString())
    r = subprocess.run([sys.executable, "-m", "ho_onnx", "optimize", "m.onnx", "out/o.onnx",
                        "--dim", "N=2", "--min-bytes", "0", "--min-gap", "1"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.data", "b.data", "o.onnx"]


def test_read_json_reads_a_small_regular_file_and_refuses_the_rest(tmp_path: Path):
    """``read_json`` serves every small JSON input (machine, profile, folder configs): a
    device, FIFO or folder is refused without reading or waiting, a file past the limit
    unread (was: ``Path.read_text``, whole)."""
    ok = tmp_path / "ok.json"
    ok.write_text('{"a": [1, 2]}')
    assert read_json(ok, 100) == {"a": [1, 2]}
    link = tmp_path / "link.json"
    link.symlink_to(ok)
    assert read_json(link, 100) == {"a": [1, 2]}
    with pytest.raises(OSError):  # (O_NOFOLLOW: ELOOP)
        read_json(link, 100, follow=False)
    with pytest.raises(OSError, match="larger than 12 B"):
        read_json(ok, 12)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for p in (fifo, Path("/dev/zero"), tmp_path):
        with pytest.raises(OSError, match="not a regular file"):
            read_json(p, 1 << 20)
    ok.write_text("[" * 100_000)
    with pytest.raises(RecursionError):
        read_json(ok, 1 << 20)
    ok.write_bytes(b"\xff\xfe{")
    with pytest.raises(ValueError):
        read_json(ok, 100)


_PAIR_SAVER = """
import os, sys, time
from pathlib import Path
from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.options import OffloadOptions
src, out, ready, role = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
if role == "first":  # puts its sidecar in place, says so, and is slow to rename its model
    real = os.replace
    def replace(a, b):
        real(a, b)
        if str(b) != str(out):
            ready.write_text("sidecar in place")
            time.sleep(2)
    os.replace = replace
else:  # starts once the other's sidecar is in place
    while not ready.exists():
        time.sleep(0.01)
optimize(src, out, OffloadOptions(min_bytes=0, min_gap=1, prefetch_distance=1), dims={"N": 2})
"""


def test_two_processes_writing_one_output_leave_a_matching_model_and_sidecar(tmp_path):
    """Two processes optimize different models (inline weights: each writes a sidecar) to
    one output name. Before: the second's sidecar and model went in place while the first
    was between its own two renames, and the first's model then replaced the second's:
    the first's model beside the second's sidecar (refused only when a session opened it).
    Now a save puts its pair in place under a lock on the folder: the last pair wins, whole."""
    import subprocess
    import sys

    from ho_onnx.graph.fingerprint import data_fingerprint

    srcs = []
    for i in range(2):
        m = chain_model()
        for t in m.graph.initializer:
            t.raw_data = np.full(16 * 16, i + 1, np.float32).tobytes()
        srcs.append(save(m, tmp_path / f"m{i}.onnx"))
    out, ready = tmp_path / "out" / "o.onnx", tmp_path / "ready"
    out.parent.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _PAIR_SAVER, str(src), str(out),
                               str(ready), role], text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
             for src, role in zip(srcs, ["first", "second"], strict=True)]
    for p in procs:
        assert p.wait(60) == 0, p.stdout.read()  # type: ignore[union-attr]
    m = onnx.load(str(out), load_external_data=False)
    stamps = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
              for n in m.graph.node if n.op_type == contract.PREFETCH
              and any(a.name == contract.ATTR_LOCATION for a in n.attribute)]
    locations = {s[contract.ATTR_LOCATION].decode() for s in stamps}
    assert len(stamps) == 2 and len(locations) == 1
    sidecar = out.parent / locations.pop()
    assert {s[contract.ATTR_DATA_FINGERPRINT].decode() for s in stamps} == \
        {data_fingerprint(sidecar)}
    import onnxruntime as ort

    import ho_onnx

    x = np.ones((2, 16), np.float32)
    got = ho_onnx.InferenceSession(str(out)).run(None, {"x": x})[0]
    want = [ort.InferenceSession(str(src)).run(None, {"x": x})[0] for src in srcs]
    assert not np.array_equal(*want) and any(np.array_equal(got, w) for w in want)
