"""Small models for the tests, written in ONNX text with random initializers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.parser
from onnx import numpy_helper

HEADER = '<ir_version: 8, opset_import: ["" : 17]>'


def text_model(body: str, seed: int = 0, **inits: tuple[int, ...] | np.ndarray) -> onnx.ModelProto:
    """Parse ``body`` (a graph in ONNX text) and add initializers: shapes get random floats."""
    model = onnx.parser.parse_model(f"{HEADER}\n{body}")
    rng = np.random.default_rng(seed)
    for name, value in inits.items():
        arr = value if isinstance(value, np.ndarray) else (
            rng.standard_normal(value).astype(np.float32) * 0.5)
        model.graph.initializer.append(numpy_helper.from_array(arr, name))
    onnx.checker.check_model(model)
    return model


# x -> MatMul W1 -> Relu -> MatMul W2 -> Relu -> Add(h4, h1): h1 has a gap (used at 1 and 4).
CHAIN = """
chain (float[N, 16] x) => (float[N, 16] y) {
  h1 = MatMul(x, W1)
  h2 = Relu(h1)
  h3 = MatMul(h2, W2)
  h4 = Relu(h3)
  h5 = Sigmoid(h4)
  y = Add(h5, h1)
}
"""


def chain_model() -> onnx.ModelProto:
    return text_model(CHAIN, W1=(16, 16), W2=(16, 16))


def save(model: onnx.ModelProto, path: Path, external: bool = False) -> Path:
    """Save ``model`` to ``path``; ``external`` puts every initializer in ``<name>.data``."""
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=f"{path.name}.data",
                        size_threshold=0)
    else:
        onnx.save_model(model, str(path))
    return path
