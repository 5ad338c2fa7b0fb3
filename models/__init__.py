"""Test and benchmark models for ho-onnx.

- :mod:`models.decoder`: GPT-style decoder written directly in ONNX (numpy weights, no torch).
- :mod:`models.hf_export`: GPT-2 / Llama from transformers with random weights, exported offline
  (needs the ``hf`` extra; torch is imported only when :func:`export_hf` runs).

(Import the submodules themselves: importing them here would make ``python -m models.decoder``
warn that the module was imported twice.)
"""
