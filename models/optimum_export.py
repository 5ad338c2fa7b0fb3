"""Optimum ``text-generation-with-past`` export of a local random-weight Llama (optionally
``--optimize O2``, which brings ORT contrib ops), and greedy generation through
``optimum.onnxruntime.ORTModelForCausalLM``.

Needs the ``hf`` and ``genai`` extras (optimum-onnx); nothing is downloaded: the model folder
comes from :func:`models.genai_export.build_hf_llama`.

    python -m models.optimum_export out/llama-optimum --optimize O2
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["export_optimum", "main", "optimum_greedy"]


def export_optimum(hf_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                   optimize: str | None = "O2") -> Path:
    """Export ``hf_dir`` with Optimum for ``text-generation-with-past`` on the CPU; returns
    ``out_dir`` (``config.json``, ``model.onnx``, tokenizer files). ``optimize``: ORT
    transformer optimizations (``O1``..``O3``; ``None``: the plain export)."""
    from optimum.exporters.onnx import main_export

    out = Path(out_dir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kw: dict[str, Any] = {"optimize": optimize} if optimize else {}
    main_export(str(hf_dir), output=str(out), task="text-generation-with-past", device="cpu",
                do_validation=False, **kw)
    if not (out / "model.onnx").is_file():
        raise RuntimeError(f"optimum export wrote no model.onnx in {str(out)!r}")
    return out


def optimum_greedy(folder: str | os.PathLike[str], prompt: Sequence[int],
                   max_new_tokens: int = 16, session_options: Any = None,
                   file_name: str | None = None) -> list[int]:
    """Greedy generation with ``ORTModelForCausalLM`` from token ids: the whole sequence."""
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM

    kw: dict[str, Any] = {"session_options": session_options} if session_options else {}
    if file_name is not None:
        kw["file_name"] = file_name
    model = ORTModelForCausalLM.from_pretrained(str(folder), local_files_only=True, **kw)
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens)
    return [int(t) for t in out[0]]


def main(argv: list[str] | None = None, export: Callable[..., Path] = export_optimum,
         default: str = "O2", doc: str = __doc__) -> None:
    """Build the random-weight Llama beside OUT_DIR and ``export`` it into OUT_DIR."""
    from .genai_export import DEFAULT_CONFIG, build_hf_llama

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--optimize", default=default, help="O1..O4, or 'none'")
    a = ap.parse_args(argv)
    out = Path(a.out_dir)
    hf = build_hf_llama(out.with_name(out.name + ".hf"), **DEFAULT_CONFIG)
    export(hf, out, optimize=None if a.optimize == "none" else a.optimize)
    print(out)


if __name__ == "__main__":
    main()
