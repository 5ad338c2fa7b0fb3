"""``python -m ho_onnx``: the command line (``cli/``, installed as ``ho_onnx.cli``).

An entry point, not part of the library: nothing in ``ho_onnx`` imports it.
"""

from ho_onnx.cli import main

main(prog_name="ho-onnx")
