"""``python -m ho_onnx``: the command line (``cli/``, installed as ``ho_onnx.cli``).

An entry point, not part of the library: nothing in ``ho_onnx`` imports it. In a source
checkout used without installing (``PYTHONPATH=<checkout>``, as on the GPU runner) the
command line is the top-level ``cli`` package beside ``ho_onnx/``.
"""

try:
    from ho_onnx.cli import main
except ModuleNotFoundError:  # not installed: cli/ is not mapped into the package
    from cli import main

main(prog_name="ho-onnx")
