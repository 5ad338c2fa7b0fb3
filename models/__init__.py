"""Test and benchmark models for ho-onnx.

- :mod:`models.decoder`: GPT-style decoder written directly in ONNX (numpy weights, no torch).
- :mod:`models.hf_export`: GPT-2 / Llama from transformers with random weights, exported offline
  (needs the ``hf`` extra; torch is imported only when :func:`export_hf` runs).
"""

from models.decoder import build_decoder, decoder_config_bytes
from models.hf_export import export_hf

__all__ = ["build_decoder", "decoder_config_bytes", "export_hf"]
