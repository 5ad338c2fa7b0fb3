"""Model folders: genai and Optimum folders in, ready folders out (library, config entries)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from graphs import chain_model, save
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ho_onnx.contract import ATTR_HOST_BYTES, CONFIG_HOST_BYTES, CONFIG_MODEL_DIR
from ho_onnx.errors import HoOnnxError, ModelLoadError, OutputPathError
from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.lifetimes import stored_peak_bytes
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.target.ort.folders import detect_folder, optimize_folder, optimum_session_options
from ho_onnx.target.ort.runtime import library_path, session_options
from models.decoder import build_decoder


def _optimize(src: Path, dst: Path) -> None:
    optimize(src, dst, OffloadOptions(activations=False, min_bytes=0))


def genai_folder(root: Path) -> Path:
    root.mkdir()
    save(chain_model(), root / "model.onnx", external=True)
    cfg = {"model": {"type": "llama", "decoder": {
        "filename": "model.onnx", "session_options": {"log_id": "onnxruntime-genai",
                                                      "provider_options": []}}}}
    (root / "genai_config.json").write_text(json.dumps(cfg))
    (root / "tokenizer.json").write_text("{}")
    return root


def optimum_folder(root: Path) -> Path:
    root.mkdir()
    save(chain_model(), root / "model.onnx")
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "generation_config.json").write_text("{}")
    return root


def test_detect(tmp_path):
    g = detect_folder(genai_folder(tmp_path / "g"))
    assert (g.kind, g.model.name) == ("genai", "model.onnx")
    o = detect_folder(optimum_folder(tmp_path / "o"))
    assert (o.kind, o.model.name) == ("optimum", "model.onnx")
    (tmp_path / "e").mkdir()
    with pytest.raises(ModelLoadError, match="neither an onnxruntime-genai folder") as e:
        detect_folder(tmp_path / "e")
    assert "holds" not in str(e.value)
    # an older Optimum export (several models, no model.onnx): what to do instead
    older = optimum_folder(tmp_path / "older")
    (older / "model.onnx").rename(older / "decoder_model.onnx")
    save(chain_model(), older / "decoder_with_past_model.onnx")
    with pytest.raises(ModelLoadError, match=r"\(config\.json \+ model\.onnx\); it holds "
                       r"decoder_model\.onnx, decoder_with_past_model\.onnx: optimize each"):
        detect_folder(older)
    save(chain_model(), older / "decoder_model_merged.onnx")  # what Optimum loads there
    assert detect_folder(older).model.name == "decoder_model_merged.onnx"
    (tmp_path / "e" / "genai_config.json").write_text('{"model": {"decoder": '
                                                      '{"filename": "nope.onnx"}}}')
    with pytest.raises(ModelLoadError, match=r"'nope\.onnx', which is not in"):
        detect_folder(tmp_path / "e")


@pytest.mark.parametrize(("model", "message"), [
    (5, "names no model.decoder.filename"),
    ({"decoder": []}, "names no model.decoder.filename"),
    ({"decoder": {"filename": "../outside.onnx"}}, "points outside the model folder"),
    ({"decoder": {"filename": "{abs}"}}, "must be a relative path inside the model folder"),
    ({"decoder": {"filename": "m\0.onnx"}}, "has a NUL byte"),
    ({"decoder": {"filename": "."}}, "which is not in"),
    ({"decoder": {"filename": "model.onnx", "session_options": []}},
     "session_options must be a JSON object"),
])
def test_a_genai_config_names_only_a_file_inside_its_folder(tmp_path, model, message):
    """Its decoder is read there and written at the same place in the output folder: a
    name out of the folder would read, and write, elsewhere (was: an unexpected
    AttributeError for a non-object ``model``, and ``../x.onnx`` read the file beside the
    folder and aimed the output beside the output folder)."""
    save(chain_model(), tmp_path / "outside.onnx")
    g = genai_folder(tmp_path / "g")
    if isinstance(model, dict) and model.get("decoder", {}) == {"filename": "{abs}"}:
        model = {"decoder": {"filename": str(tmp_path / "outside.onnx")}}
    (g / "genai_config.json").write_text(json.dumps({"model": model}))
    with pytest.raises(ModelLoadError, match=message):
        detect_folder(g)
    with pytest.raises(ModelLoadError, match=message):
        optimize_folder(g, tmp_path / "out", _optimize)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("config", ["genai_config.json", "config.json"])
@pytest.mark.parametrize(("bad", "message"), [
    ("link out", "points outside the model folder"),
    ("link in", ""),
    ("deep", "not readable JSON: nested too deeply"),
    ("huge", "larger than 16.00 MiB"),
    ("not utf-8", "not readable JSON"),
])
def test_a_hostile_configuration_file_is_one_clear_error(tmp_path, config, bad, message):
    """The configuration is read before anything else: was followed out of the folder, read
    whole whatever its size, and a ``[[[...`` of 200,000 levels an unexpected
    RecursionError."""
    src = (genai_folder if config == "genai_config.json" else optimum_folder)(tmp_path / "s")
    path = src / config
    if bad == "link out":
        (tmp_path / "elsewhere.json").write_text(path.read_text())
        path.unlink()
        path.symlink_to(tmp_path / "elsewhere.json")
    elif bad == "link in":  # read as its file: the folder is optimized
        (src / "real.json").write_text(path.read_text())
        path.unlink()
        path.symlink_to("real.json")
        optimize_folder(src, tmp_path / "out", _optimize)
        return
    elif bad == "deep":
        path.write_text("[" * 200_000)
    elif bad == "huge":
        with open(path, "ab") as f:  # (sparse: nothing of it is read)
            f.truncate(17 << 20)
    else:
        path.write_bytes(b'{"model": "\xff"}')
    with pytest.raises(ModelLoadError, match=message):
        optimize_folder(src, tmp_path / "out", _optimize)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400", "-1E+999"])
def test_a_genai_config_must_be_standard_json(tmp_path, number):
    """``genai_config.json`` is written again: a number standard JSON lacks is refused, one
    line, exit 2, nothing written (was: copied into the output as ``NaN``/``Infinity``,
    ``1e400`` too, which Python reads as infinity; genai's own parser refuses them, and no
    finite stand-in would be the user's value)."""
    from click.testing import CliRunner

    from ho_onnx.cli import main

    src = genai_folder(tmp_path / "src")
    text = (src / "genai_config.json").read_text()
    (src / "genai_config.json").write_text(
        text[:-1] + f', "search": {{"temperature": {number}, "top_p": 1e-300}}}}')
    with pytest.raises(ModelLoadError, match=r"genai_config\.json' is not standard JSON: "
                       rf"(the number )?{re.escape(number)} is "):
        optimize_folder(src, tmp_path / "out", _optimize, library=library_path())
    assert not (tmp_path / "out").exists()
    r = CliRunner().invoke(main, ["optimize", str(src), str(tmp_path / "out"), "--offload",
                                  "weights", "--min-bytes", "0"])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert "is not standard JSON" in r.output and not (tmp_path / "out").exists()
    # finite numbers, however small or large, are kept as they were
    (src / "genai_config.json").write_text(
        text[:-1] + ', "search": {"temperature": 1.5e308, "top_p": 1e-300}}')
    optimize_folder(src, tmp_path / "out", _optimize, library=library_path())
    written = (tmp_path / "out" / "genai_config.json").read_text()
    assert json.loads(written)["search"] == {"temperature": 1.5e308, "top_p": 1e-300}
    # an Optimum folder's config.json is copied as it is (transformers reads NaN): kept
    opt = optimum_folder(tmp_path / "o")
    (opt / "config.json").write_text('{"model_type": "llama", "x": NaN}')
    optimize_folder(opt, tmp_path / "o-out", _optimize)
    assert (tmp_path / "o-out" / "config.json").read_text() == (opt / "config.json").read_text()


def _run(path: Path, so: ort.SessionOptions) -> np.ndarray:
    s = ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    return s.run(None, {"x": x})[0]


def test_genai_folder_is_ready(tmp_path):
    src = genai_folder(tmp_path / "src")
    lib = tmp_path / "libfake_ops.so"
    lib.write_bytes(Path(library_path()).read_bytes())
    r = optimize_folder(src, tmp_path / "out", _optimize, library=lib)
    out = tmp_path / "out"
    assert r.kind == "genai" and r.library == out / "libfake_ops.so" and r.library.is_file()
    assert sorted(p.name for p in out.iterdir()) == [
        "genai_config.json", "libfake_ops.so", "model.onnx", "model.onnx.data",
        "tokenizer.json"]
    so_cfg = json.loads((out / "genai_config.json").read_text())["model"]["decoder"][
        "session_options"]
    assert so_cfg["custom_ops_library"] == "libfake_ops.so"
    assert so_cfg["enable_mem_pattern"] is False  # ORT's pattern block is not in the budget
    assert so_cfg[CONFIG_MODEL_DIR] == str(out.resolve())
    assert so_cfg["log_id"] == "onnxruntime-genai"  # what was there stays
    assert json.loads((src / "genai_config.json").read_text())["model"]["decoder"][
        "session_options"] == {"log_id": "onnxruntime-genai", "provider_options": []}
    # What genai does with that config: config entries first, then the library.
    so = ort.SessionOptions()
    for k, v in so_cfg.items():
        if k.startswith("ho_onnx."):
            so.add_session_config_entry(k, v)
    copied = out / so_cfg["custom_ops_library"]
    assert copied.read_bytes() == lib.read_bytes()
    # (the same bytes, registered from library_path(): a second copy mapped in the test
    # process would be a second library state; the genai tests load the copy in a child)
    so.register_custom_ops_library(library_path())
    want = _run(src / "model.onnx", ort.SessionOptions())
    np.testing.assert_array_equal(_run(out / "model.onnx", so), want)


@pytest.mark.parametrize("taken", ["folder", "decoder in it", "decoder", "written", "file"])
def test_the_library_name_is_never_a_folder_or_another_file(tmp_path, taken):
    """genai loads ``custom_ops_library`` by name from the output folder: an input holding a
    folder of that name (or the decoder under it) is refused before anything is written (was:
    the library copied into the folder, ``custom_ops_library`` naming a folder, no error), a
    file the optimize step wrote there is never overwritten; a plain file of that name in
    the input is replaced by the library."""
    src = genai_folder(tmp_path / "src")
    lib = tmp_path / "libfake_ops.so"
    lib.write_bytes(Path(library_path()).read_bytes())
    out = tmp_path / "out"
    optimize_file = _optimize
    if taken == "folder":
        (src / lib.name).mkdir()
        (src / lib.name / "readme.txt").write_text("x")
    elif taken in ("decoder in it", "decoder"):
        name = f"{lib.name}/model.onnx" if taken == "decoder in it" else lib.name
        (src / name).parent.mkdir(exist_ok=True)
        save(chain_model(), src / name)
        cfg = json.loads((src / "genai_config.json").read_text())
        cfg["model"]["decoder"]["filename"] = name
        (src / "genai_config.json").write_text(json.dumps(cfg))
    elif taken == "written":
        def optimize_file(a: Path, b: Path) -> None:
            _optimize(a, b)
            (b.parent / lib.name).write_text("the optimize step's")
    else:
        (src / lib.name).write_text("an old library")
    if taken == "file":
        optimize_folder(src, out, _optimize, library=lib)
        assert (out / lib.name).read_bytes() == lib.read_bytes()
        return
    with pytest.raises(ModelLoadError, match=rf"{'wrote' if taken == 'written' else 'holds'} "
                       rf".*'{lib.name}' goes \(genai loads it by that name"):
        optimize_folder(src, out, optimize_file, library=lib)
    assert not out.exists()


def test_cli_refuses_a_folder_named_like_the_library(tmp_path):
    """The CLI: one error line, exit 2, no output folder."""
    from click.testing import CliRunner

    from ho_onnx.cli import main

    src = genai_folder(tmp_path / "src")
    (src / Path(library_path()).name).mkdir()
    (src / Path(library_path()).name / "x").write_text("x")
    r = CliRunner().invoke(main, ["optimize", str(src), str(tmp_path / "out"), "--offload",
                                  "weights", "--min-bytes", "0"])
    assert r.exit_code == 2, r.output
    assert r.output.count("\n") == 1 and r.output.startswith("error: the input holds the folder")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tier", ["disk", "host"])
def test_genai_host_bytes_is_the_stored_activations_only(tmp_path, tier):
    """``ho_onnx.host_bytes`` in the output's genai config sizes the CUDA pinned ring for
    stored activations and wins over the Stores' own attribute: it must be their planned
    stored peak, never the offloaded weights (was: the metadata's ``host_bytes``, every
    offloaded weight counted, disk tier included: ~30x the ring, pinning what the disk tier
    keeps out of memory). Without stored activations there is no entry."""
    src = tmp_path / "src"
    src.mkdir()
    build_decoder(src / "model.onnx", layers=2, hidden=64, heads=4, external_data=True)
    (src / "genai_config.json").write_text(json.dumps(
        {"model": {"decoder": {"filename": "model.onnx"}}}))
    dims = {"batch": 1, "seq": 64}
    choices = []

    def opt(activations: bool):
        def run(a: Path, b: Path) -> None:
            choices.append(optimize(a, b, OffloadOptions(min_bytes=0, weight_tier=tier,
                                                         activations=activations),
                                    dims).choice)
        return run

    for activations in (True, False):
        out = tmp_path / f"out-{activations}"
        optimize_folder(src, out, opt(activations), library=library_path())
        so_cfg = json.loads((out / "genai_config.json").read_text())["model"]["decoder"][
            "session_options"]
        c = choices[-1]
        weights = sum(w.nbytes for w in c.weights)
        assert c.weights and weights > 0
        if not activations:
            assert CONFIG_HOST_BYTES not in so_cfg
            continue
        stored = stored_peak_bytes(c)
        assert c.activations and 0 < stored < weights
        m = onnx.load(str(out / "model.onnx"), load_external_data=False)
        on_stores = {a.i for n in m.graph.node if n.op_type == "Store"
                     for a in n.attribute if a.name == ATTR_HOST_BYTES}
        assert on_stores == {stored}
        assert so_cfg[CONFIG_HOST_BYTES] == str(stored)


def test_optimum_folder_is_ready(tmp_path):
    src = optimum_folder(tmp_path / "src")
    r = optimize_folder(src, tmp_path / "out", _optimize)
    out = tmp_path / "out"
    assert r.kind == "optimum" and r.library is None
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "generation_config.json", "model.onnx", "model.onnx.data"]
    want = _run(src / "model.onnx", ort.SessionOptions())
    np.testing.assert_array_equal(_run(out / "model.onnx", optimum_session_options(out)), want)


def test_output_folder_must_be_new_or_empty(tmp_path):
    src = optimum_folder(tmp_path / "src")
    with pytest.raises(OutputPathError, match="is the input folder"):
        optimize_folder(src, src, _optimize)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    with pytest.raises(OutputPathError, match="not empty"):
        optimize_folder(src, tmp_path / "busy", _optimize)


@pytest.mark.parametrize("existing", [False, True])
def test_a_failure_leaves_the_output_folder_as_it_was(tmp_path, existing):
    """Absent, or empty: nothing half-written (was: the library and the model stayed when a
    later step failed)."""
    src = genai_folder(tmp_path / "g")
    out = tmp_path / "new" / "out"
    if existing:
        out.mkdir(parents=True)

    def fails_after_writing(a: Path, b: Path) -> None:
        _optimize(a, b)
        (b.parent / "sub").mkdir()
        (b.parent / "sub" / "x").write_text("x")
        raise OutputPathError("disk full (simulated after the model was written)")

    with pytest.raises(OutputPathError, match="simulated"):
        optimize_folder(src, out, fails_after_writing)
    if existing:
        assert list(out.iterdir()) == []
    else:
        assert not (tmp_path / "new").exists()


def _add_entry(src: Path, kind: str) -> None:
    """Put one entry of ``kind`` (:data:`REFUSED` or :data:`COPIED`) in folder ``src``;
    ``secret.txt`` beside the folder is what a link out names."""
    sub = src / "sub"
    if kind == "file":
        (src / "extra.txt").write_text("extra")
    elif kind == "sub/file":
        sub.mkdir(exist_ok=True)
        (sub / "extra.txt").write_text("extra")
    elif kind == "link in":
        (src / "link_in.onnx").symlink_to("model.onnx")
    elif kind == "link out":
        (src / "link_out.onnx").symlink_to(src.parent / "secret.txt")
    elif kind == "link out, in a subfolder":
        sub.mkdir(exist_ok=True)
        (sub / "merges.txt").symlink_to(Path("..") / ".." / "secret.txt")
    elif kind == "link to a device":  # (not /dev/zero: a regression would copy forever)
        (src / "vocab.txt").symlink_to("/dev/null")
    elif kind == "fifo":
        os.mkfifo(src / "special_tokens_map.json")
    elif kind == "dangling link":
        (src / "gone.json").symlink_to("nothing-here")
    elif kind == "link loop":
        (src / "a").symlink_to("b")
        (src / "b").symlink_to("a")
    elif kind == "link to a folder":
        sub.mkdir(exist_ok=True)
        (src / "alias").symlink_to("sub")
    else:
        raise AssertionError(kind)


# the entries a folder may not have, with the words that refuse them; those it may have
REFUSED = {"link out": "outside the folder", "link out, in a subfolder": "outside the folder",
           "link to a device": "outside the folder", "fifo": "not a regular file",
           "dangling link": "leads nowhere", "link loop": "leads nowhere",
           "link to a folder": "a link to a folder"}
COPIED = ["file", "sub/file", "link in"]


@pytest.mark.parametrize("kind", sorted(REFUSED))
@pytest.mark.parametrize("make", [genai_folder, optimum_folder])
def test_nothing_outside_the_folder_is_copied(tmp_path, make, kind):
    """Was: every entry copied with links followed: a link to ``/etc/passwd`` put that file in
    the output folder, one to ``/dev/zero`` filled the disk, a FIFO blocked forever. Refused
    before the model is optimized: nothing is written."""
    src = make(tmp_path / "src")
    (tmp_path / "secret.txt").write_text("not the model's")
    _add_entry(src, kind)
    calls = []

    def records(a: Path, b: Path) -> None:
        calls.append(a)
        _optimize(a, b)

    with pytest.raises(ModelLoadError, match=REFUSED[kind]):
        optimize_folder(src, tmp_path / "out", records)
    assert not calls and not (tmp_path / "out").exists()


def _swap(src: Path, how: str) -> None:
    """Change ``src/sub/vocab.txt`` (or its folder) the way a writer racing the copy could."""
    sub, outside = src / "sub", src.parent / "outside"
    if how == "link out":
        (sub / "vocab.txt").unlink()
        (sub / "vocab.txt").symlink_to(outside / "vocab.txt")
    elif how == "fifo":
        (sub / "vocab.txt").unlink()
        os.mkfifo(sub / "vocab.txt")
    elif how == "folder linked out":
        (sub / "vocab.txt").unlink()
        sub.rmdir()
        sub.symlink_to(outside)
    else:  # "replaced": another file at the same path
        (sub / "new").write_text("new")
        os.replace(sub / "new", sub / "vocab.txt")


@contextlib.contextmanager
def _deadline(seconds: float):
    """A blocking call that outlives ``seconds`` raises TimeoutError (a regression that
    waited on a FIFO forever fails instead of hanging the suite)."""
    def expire(*_: object) -> None:
        raise TimeoutError("still blocked")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("how", ["link out", "fifo", "folder linked out", "replaced"])
def test_a_file_changed_between_the_check_and_the_copy_is_refused(tmp_path, how):
    """The folder is walked before the model is optimized and copied after: a file swapped
    meanwhile (here by the optimize step, standing in for another writer) for a link out of
    the folder or a FIFO was followed or waited on. Now the copy opens only the very file the
    walk saw (no link followed, no blocking open, same inode)."""
    src = optimum_folder(tmp_path / "src")
    (src / "sub").mkdir()
    (src / "sub" / "vocab.txt").write_text("the model's")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "vocab.txt").write_text("not the model's")

    def optimize_then_swap(a: Path, b: Path) -> None:
        _optimize(a, b)
        _swap(src, how)

    with _deadline(20), pytest.raises(ModelLoadError, match="while being copied"):
        optimize_folder(src, tmp_path / "out", optimize_then_swap)
    assert not (tmp_path / "out").exists()


def test_links_and_subfolders_inside_the_folder_are_copied(tmp_path):
    """A link to a file of the folder is copied as that file; subfolders are copied whole,
    also the one holding the decoder (was: a subfolder the optimize step had written to was
    skipped, and the decoder's data was looked for beside the folder, not the decoder)."""
    src = tmp_path / "src"
    (src / "dec").mkdir(parents=True)
    save(chain_model(), src / "dec" / "model.onnx", external=True)
    (src / "dec" / "notes.txt").write_text("kept")
    (src / "assets").mkdir()
    (src / "assets" / "vocab.txt").write_text("a b c")
    (src / "vocab.txt").symlink_to(Path("assets") / "vocab.txt")
    (src / "genai_config.json").write_text(json.dumps(
        {"model": {"decoder": {"filename": "dec/model.onnx"}}}))
    r = optimize_folder(src, tmp_path / "out", _optimize, library=library_path())
    out = tmp_path / "out"
    assert sorted(r.copied) == ["assets/vocab.txt", "dec/notes.txt", "vocab.txt"]
    assert not (out / "vocab.txt").is_symlink() and (out / "vocab.txt").read_text() == "a b c"
    assert (out / "dec" / "notes.txt").read_text() == "kept"
    assert "Prefetch" in {n.op_type for n in onnx.load(str(out / "dec" / "model.onnx"),
                                                       load_external_data=False).graph.node}
    want = _run(src / "dec" / "model.onnx", ort.SessionOptions())
    np.testing.assert_array_equal(_run(out / "dec" / "model.onnx",
                                       session_options(out / "dec" / "model.onnx")), want)


def test_a_file_that_cannot_be_copied_is_an_error_leaving_no_output(tmp_path, monkeypatch):
    import errno

    from ho_onnx.target.ort import folders

    def disk_full(src: Path, dst: Path, **kw: object) -> None:
        dst.write_text("partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(folders, "copy_sparse", disk_full)
    src = optimum_folder(tmp_path / "src")
    with pytest.raises(OutputPathError, match=r"cannot copy .*/config\.json.*space"):
        optimize_folder(src, tmp_path / "out", _optimize)
    assert not (tmp_path / "out").exists()


def test_a_hugging_face_cache_snapshot_is_refused_with_what_to_do(tmp_path):
    """Its files are links into ``../../blobs``, outside the snapshot folder."""
    repo = tmp_path / "models--org--name"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    save(chain_model(), blobs / "m")
    (blobs / "c").write_text('{"model_type": "llama"}')
    (blobs / "t").write_text("{}")
    for name, blob in [("model.onnx", "m"), ("config.json", "c"), ("tokenizer.json", "t")]:
        (snap / name).symlink_to(Path("..") / ".." / "blobs" / blob)
    with pytest.raises(ModelLoadError, match=r"points outside the model folder.*cp -rL"):
        optimize_folder(snap, tmp_path / "out", _optimize)
    (snap / "model.onnx").unlink()
    save(chain_model(), snap / "model.onnx")
    with pytest.raises(ModelLoadError, match=r"outside the (model )?folder.*cp -rL"):
        optimize_folder(snap, tmp_path / "out", _optimize)
    assert not (tmp_path / "out").exists()


def test_an_unreadable_model_in_a_folder_is_a_load_error(tmp_path):
    src = optimum_folder(tmp_path / "src")
    (src / "model.onnx").write_bytes(b"\x08\x07garbage")
    with pytest.raises(ModelLoadError, match=r"not a readable ONNX model|not an ONNX model"):
        optimize_folder(src, tmp_path / "out", _optimize)
    assert not (tmp_path / "out").exists()


_SECRET = "ho-onnx test: a file outside the model folder\n"
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda kids: st.lists(kids, max_size=3)
                     | st.dictionaries(st.text(max_size=6), kids, max_size=3), max_leaves=8)
_DECODER_NAMES = st.sampled_from(["model.onnx", "sub/model.onnx", "../outside.onnx", "/abs",
                                  "", ".", "sub", "tokenizer.json", "m\0.onnx", "mödel.onnx",
                                  "link_in.onnx", "link_out.onnx", "sub/../model.onnx"])
_ENTRIES = st.lists(st.sampled_from([*COPIED, *REFUSED]), max_size=4, unique=True)


@st.composite
def _genai_configs(draw: st.DrawFn) -> object:
    if draw(st.integers(0, 4)) == 0:
        return draw(_JSON)
    decoder: dict[str, object] = {"filename": draw(_DECODER_NAMES)}
    if draw(st.booleans()):
        decoder["session_options"] = draw(_JSON)
    if draw(st.integers(0, 5)) == 0:
        decoder = draw(_JSON)  # type: ignore[assignment]
    return {"model": {"decoder": decoder, **draw(st.dictionaries(st.text(max_size=4), _JSON,
                                                                 max_size=2))}}


def _snapshot(folder: Path) -> dict[str, str]:
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        out[rel] = ("-> " + os.readlink(p) if p.is_symlink() else
                    p.read_text(errors="replace") if p.is_file() else
                    "dir" if p.is_dir() else "special")
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["genai", "optimum"]), config=_genai_configs(), entries=_ENTRIES,
       out_exists=st.booleans())
def test_any_folder_is_optimized_or_refused_cleanly(kind, config, entries, out_exists):
    """Property: whatever the genai config and the folder's entries, ``optimize_folder``
    either writes a folder holding only regular files from inside the input folder, or
    raises a :class:`HoOnnxError` and leaves the output as it was; the input never changes."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "secret.txt").write_text(_SECRET)
        save(chain_model(), root / "outside.onnx")
        src = (genai_folder if kind == "genai" else optimum_folder)(root / "src")
        if kind == "genai":
            (src / "genai_config.json").write_text(json.dumps(config))
        (src / "sub").mkdir()
        save(chain_model(), src / "sub" / "model.onnx")
        for entry in entries:
            _add_entry(src, entry)
        before = _snapshot(src)
        out = root / "out"
        if out_exists:
            out.mkdir()
        try:
            optimize_folder(src, out, _optimize, library=library_path())
        except HoOnnxError:
            assert (sorted(out.iterdir()) == []) if out_exists else not out.exists()
        else:
            for p in out.rglob("*"):
                assert not p.is_symlink() and (p.is_dir() or p.is_file()), p
                if p.is_file() and p.stat().st_size < 4096:
                    assert p.read_bytes() != _SECRET.encode(), p
        assert _snapshot(src) == before


def test_genai_and_triton_refuse_a_plan_without_ort_buffer_reuse(tmp_path):
    """ORT's C API has no call to turn its buffer reuse off: a model planned without it is
    refused for a genai folder and a Triton entry, in one clear error, nothing written."""
    from ho_onnx.errors import ModelLoadError
    from ho_onnx.target.ort.triton import TritonEntryError, write_triton_entry

    options = OffloadOptions(activations=False, min_bytes=0, ort_reuse=False)
    src = genai_folder(tmp_path / "g")
    out = tmp_path / "g.out"
    with pytest.raises(ModelLoadError, match="onnxruntime-genai cannot turn off"):
        optimize_folder(src, out, lambda i, o: optimize(i, o, options),
                        library=library_path())
    assert not out.exists() or not any(out.iterdir())
    model = tmp_path / "m.ho.onnx"
    optimize(src / "model.onnx", model, options)
    with pytest.raises(TritonEntryError, match="Triton's onnxruntime backend cannot turn"):
        write_triton_entry(model, tmp_path / "repo", "m", ort_version="1.24.4")
    assert not (tmp_path / "repo" / "m").exists()
    optimize(src / "model.onnx", model, OffloadOptions(activations=False, min_bytes=0))
    write_triton_entry(model, tmp_path / "repo", "m", ort_version="1.24.4")  # (reuse on)
