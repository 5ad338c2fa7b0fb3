"""Runtimes the rewritten models target (today: ONNX Runtime, :mod:`ho_onnx.target.ort`)."""
