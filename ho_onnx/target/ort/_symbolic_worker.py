"""The worker that runs ORT's symbolic shape inference (``python -m`` this module, started
by :mod:`ho_onnx.target.ort.contrib` through :class:`ho_onnx.graph.bounded.Worker`).

The tool computes the values of small tensors in Python and numpy (a ``ConstantOfShape``
of int64 materializes its whole output: ~270 bytes of model, gigabytes of memory), so it
runs as ONNX's inference does: each request in a child forked from this warm worker, under
an address-space limit (:func:`ho_onnx.graph._shape_worker.serve`). The worker imports
onnxruntime's tool and sympy once (~1.5 s); a request then costs the inference in a child
forked, and warmed up with a tiny inference, before it came (~8 ms for a genai block).
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import onnx

from ...graph._shape_worker import serve


def infer(skeleton: bytes) -> bytes:
    """The serialized model ORT's symbolic shape inference makes of a serialized weight-free
    one (raises when it gives up: the worker's "failed" status).

    The tool writes ``sym_shape_infer_temp.onnx`` into the working directory when its
    inference is incomplete (measured: onnxruntime 1.32, a contrib model at opset 7): it runs
    in a temporary directory of its own (the forked child's: this changes no other
    process's directory), removed after."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="ho_onnx_sym_") as tmp:
        os.chdir(tmp)
        try:
            out = SymbolicShapeInference.infer_shapes(
                onnx.ModelProto.FromString(skeleton), int_max=2**31 - 1, auto_merge=True,
                guess_output_rank=True, verbose=0)
        finally:
            os.chdir(cwd)
    if out is None:
        raise ValueError("the tool gave no model (an opset it does not support)")
    return out.SerializeToString()


# ModelProto{graph{node{Relu x -> y}, input x: float[2], output y}, opset 17}: one inference
# in the worker itself imports the tool's lazily imported parts before any fork; one in each
# child before its request takes the child's first copy-on-write faults.
_TINY = onnx.helper.make_model(onnx.helper.make_graph(
    [onnx.helper.make_node("Relu", ["x"], ["y"])], "warm",
    [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
    [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])]),
    opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def main() -> None:
    with contextlib.suppress(Exception):  # (no onnxruntime tool: every request "failed")
        infer(_TINY)
    serve(infer, lambda: infer(_TINY))


if __name__ == "__main__":
    main()
