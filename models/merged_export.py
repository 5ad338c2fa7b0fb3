"""An Optimum merged decoder (``decoder_model_merged.onnx``: one ``If`` whose branches are the
decoder without past and the decoder with past, reading the weights as outer-scope
initializers) of a local random-weight Llama, built with Optimum's own ``merge_decoders``.

Needs the ``hf`` extra (optimum-onnx); nothing is downloaded: the model folder comes from
:func:`models.genai_export.build_hf_llama`.

    python -m models.merged_export out/llama-merged
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["MERGED", "export_merged", "main"]

MERGED = "decoder_model_merged.onnx"


def _export(hf_dir: Path, out: Path, *, past_in_inputs: bool, optimize: str | None) -> Path:
    """One decoder export: with past inputs, or without (present outputs in both)."""
    from optimum.exporters.onnx import main_export
    from optimum.exporters.tasks import TasksManager
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(hf_dir))
    ctor = TasksManager.get_exporter_config_constructor(
        "onnx", model_type=config.model_type, task="text-generation-with-past",
        library_name="transformers")
    onnx_config = ctor(config, use_past=True, use_past_in_inputs=past_in_inputs)
    main_export(str(hf_dir), output=str(out), task="text-generation-with-past", device="cpu",
                do_validation=False, custom_onnx_configs={"model": onnx_config},
                **({"optimize": optimize} if optimize else {}))
    return out / "model.onnx"


def export_merged(hf_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                  optimize: str | None = None) -> Path:
    """Export ``hf_dir`` twice (without and with past) and merge the two with Optimum's
    ``merge_decoders`` into ``out_dir/decoder_model_merged.onnx`` (weights in one external
    data file); the folder also gets ``config.json`` and the tokenizer files. Returns it.
    ``optimize``: ORT transformer optimizations of each export (``O2``: contrib ops)."""
    import onnx
    from optimum.onnx.graph_transformations import merge_decoders

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    hf, out = Path(hf_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        no_past = _export(hf, Path(tmp) / "no_past", past_in_inputs=False, optimize=optimize)
        with_past = _export(hf, Path(tmp) / "with_past", past_in_inputs=True, optimize=optimize)
        raw = Path(tmp) / "merged.onnx"  # (merge_decoders 0.1.0 needs a save_path)
        merge_decoders(onnx.load(str(no_past)), onnx.load(str(with_past)), save_path=raw)
        merged = onnx.load(str(raw))
        onnx.save(merged, str(out / MERGED), save_as_external_data=True,
                  all_tensors_to_one_file=True, location=MERGED + "_data", size_threshold=1024)
        for f in (Path(tmp) / "with_past").iterdir():
            if f.suffix != ".onnx" and not f.name.startswith("model.onnx"):
                shutil.copy(f, out / f.name)
    return out


def main(argv: list[str] | None = None) -> None:
    from .optimum_export import main as export_main

    export_main(argv, export_merged, default="none", doc=__doc__)


if __name__ == "__main__":
    main()
