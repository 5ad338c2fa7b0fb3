"""The data-placement pass (rewrite.place) and the annotation (rewrite.annotate): where each
offloaded weight's bytes are, decided before anything is written."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir
import pytest
from graphs import chain_model, save, text_model

from ho_onnx import contract
from ho_onnx.errors import OutputPathError
from ho_onnx.graph.analyse import analyse, attribute_values
from ho_onnx.rewrite.annotate import annotate
from ho_onnx.rewrite.insert import insert_cache_ops
from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.rewrite.place import place_weight_data
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.schedule.policy import choose
from ho_onnx.target.ort.verify import verify

WEIGHTS = OffloadOptions(activations=False, min_bytes=0)


def _rewrite(model: onnx.ModelProto):
    a = analyse(model, {"N": 4})
    return insert_cache_ops(a, choose(a, WEIGHTS, {"N": 4}))


def test_inline_weights_get_aligned_sidecar_slots(tmp_path):
    m = text_model("""
    g (float[4, 16] x) => (float[4, 1024] y) {
      h = MatMul(x, Small)
      y = MatMul(h, Big)
    }
    """, Small=(16, 16), Big=(16, 1024))
    rw = _rewrite(m)
    files = place_weight_data(rw, tmp_path, tmp_path / "out.onnx")
    assert files.sidecar is not None and files.sidecar.name == "out.onnx.data"
    slots = {name: (off, n) for name, _, off, n in files.sidecar.tensors}
    # 64 KiB and more: page aligned (O_DIRECT reads); smaller: 64-byte aligned
    assert slots == {"Small": (0, 1024), "Big": (4096, 16 * 1024 * 4)}
    assert not files.data_files and not list(tmp_path.iterdir())  # nothing written
    graph_nodes = set(rw.model.graph)
    for name, nodes in rw.weight_prefetches.items():
        for node in nodes:
            a = attribute_values(node)
            assert a[contract.ATTR_LOCATION] == "out.onnx.data"
            assert (a[contract.ATTR_OFFSET], a[contract.ATTR_LENGTH]) == slots[name]
            assert "base_dir" not in a  # never an absolute path in the model (issue 9)
            assert files.stamps["out.onnx.data"].count(node) == 1
            # the node stamped is the one the save writes: in the finished model's graph
            assert node in graph_nodes and files.model is rw.model


def test_external_weights_keep_their_file(tmp_path):
    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    rw = _rewrite(onnx.load(str(src), load_external_data=False))
    files = place_weight_data(rw, tmp_path, tmp_path / "sub" / "m.ho.onnx")
    assert files.sidecar is None
    assert files.data_files == {"m.onnx.data": tmp_path / "m.onnx.data"}
    refs = sorted((attribute_values(n)[contract.ATTR_OFFSET],
                   attribute_values(n)[contract.ATTR_LENGTH])
                  for nodes in rw.weight_prefetches.values() for n in nodes)
    assert refs == [(0, 1024), (1024, 1024)]


def _linked_data(tmp_path) -> tuple[Path, onnx.ModelProto]:
    """A model whose data file ``m.onnx.data`` is a link to ``real.bin`` beside it."""
    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    (tmp_path / "m.onnx.data").rename(tmp_path / "real.bin")
    (tmp_path / "m.onnx.data").symlink_to("real.bin")
    return src, onnx.load(str(src), load_external_data=False)


def test_weights_beside_a_linked_data_file_name_the_file_itself(tmp_path):
    """The library opens weight data without following links: an output beside its input
    names the file a link leads to; elsewhere the data is copied under its own name."""
    _, model = _linked_data(tmp_path)
    for out, want in [(tmp_path / "m.ho.onnx", "real.bin"),
                      (tmp_path / "sub" / "m.ho.onnx", "m.onnx.data")]:
        rw = _rewrite(model)
        files = place_weight_data(rw, tmp_path, out)
        locs = {attribute_values(n)[contract.ATTR_LOCATION]
                for nodes in rw.weight_prefetches.values() for n in nodes}
        assert locs == {want} and set(files.stamps) == {want}


def test_an_output_beside_a_linked_data_file_runs(tmp_path):
    """Was: optimized without error, then refused by the library at session creation
    ("symbolic links inside the model directory are not followed")."""
    src, _ = _linked_data(tmp_path)
    out = tmp_path / "m.ho.onnx"
    optimize(src, out, WEIGHTS)
    assert verify(src, out, dims={"N": 4}, runs=2, opt_level="disable").exact


def test_a_sidecar_over_the_models_data_is_refused(tmp_path):
    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    model = onnx.load(str(src), load_external_data=False)
    inline = {t.name: t for t in chain_model().graph.initializer}
    model.graph.initializer[1].CopyFrom(inline[model.graph.initializer[1].name])
    rw = _rewrite(model)  # one offloaded weight inline: it needs the sidecar m.onnx.data
    with pytest.raises(OutputPathError, match="sidecar"):
        place_weight_data(rw, tmp_path, tmp_path / "m.onnx")


def test_no_sidecar_needed_no_refusal(tmp_path):
    # The onnxruntime-genai builder writes model.onnx + model.onnx.data: an optimized
    # model.onnx in another folder keeps referencing model.onnx.data and needs no sidecar.
    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    rw = _rewrite(onnx.load(str(src), load_external_data=False))
    files = place_weight_data(rw, tmp_path, tmp_path / "out" / "m.onnx")
    assert files.sidecar is None and set(files.data_files) == {"m.onnx.data"}


def test_annotate_replaces_entries():
    m = ir.from_proto(chain_model())
    annotate(m, {"policy": "a", "dims": "N=4"})
    annotate(m, {"policy": "b"})
    assert dict(m.metadata_props) == {contract.META_PREFIX + "dims": "N=4",
                                      contract.META_PREFIX + "policy": "b"}
    props = [(p.key, p.value) for p in ir.to_proto(m).metadata_props]
    assert sorted(props) == [(contract.META_PREFIX + "dims", "N=4"),
                             (contract.META_PREFIX + "policy", "b")]
