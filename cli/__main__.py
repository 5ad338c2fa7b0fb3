"""``python -m ho_onnx.cli``, the same as ``ho-onnx``."""

from ho_onnx.cli import main

main(prog_name="ho-onnx")
