"""Real Hugging Face architectures (random weights, exported offline) rewritten with every
eligible tensor offloaded, against the unmodified export (pre-packing off in both).

Tolerances: bit-exact with ORT's graph optimizations at ``basic`` (identical kernels). At
``all``, ORT's extended fusions (FastGelu, SkipLayerNormalization, FusedMatMul on GPT-2)
need constant scalars and single-consumer intermediates; offloading those tensors leaves
the unfused ops, which round differently: ``atol=1e-5, rtol=1e-4``.
"""

from __future__ import annotations

import pytest

from ho_onnx.rewrite.pipeline import optimize
from ho_onnx.schedule.options import OffloadOptions
from ho_onnx.target.ort.verify import verify

pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[hf]')")
pytest.importorskip("transformers", reason="transformers is not installed")
from models.hf_export import export_hf

FORCE_ALL = OffloadOptions(min_bytes=0, min_gap=1, prefetch_distance=2)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_export_bit_exact(tmp_path_factory, arch):
    folder = tmp_path_factory.mktemp(arch)
    src = export_hf(arch, folder / f"{arch}.onnx", layers=2, hidden=64, heads=4, vocab=256,
                    seq=16, external_data=True)
    opt = folder / f"{arch}.ho.onnx"
    r = optimize(src, opt, FORCE_ALL, {"batch": 2, "seq": 9})
    assert len(r.choice.weights) >= 2 * 4  # attention + MLP weights of both layers at least
    assert len(r.choice.activations) > 20
    dims = {"batch": 2, "seq": 9}
    for order in ("priority", "default"):
        rep = verify(src, opt, dims=dims, runs=2, int_high=256, execution_order=order,
                     opt_level="basic")
        assert rep.exact, rep.outputs
    rep = verify(src, opt, dims=dims, runs=2, int_high=256, atol=1e-5, rtol=1e-4)
    assert rep.ok, rep.outputs
