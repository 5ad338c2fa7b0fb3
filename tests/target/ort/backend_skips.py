"""ONNX backend node cases that are not rewritten-and-compared, with the reason.

Cases ONNX Runtime cannot load or run, or whose original output already differs from the
expected output, are found at run time by tests/test_backend_nodes.py and are not listed
here. What is listed here is only what can run but cannot be compared meaningfully.
"""

from __future__ import annotations

# Ops whose outputs are random draws: the expected outputs come from another generator
# (numpy in onnx's reference), so neither the original nor the rewritten model can match
# them, and two sessions need not agree with each other either. Keys are (domain, op_type)
# with "" for the default domain.
NONDETERMINISTIC_OPS: dict[tuple[str, str], str] = {
    ("", "RandomUniform"): "random draws",
    ("", "RandomUniformLike"): "random draws",
    ("", "RandomNormal"): "random draws",
    ("", "RandomNormalLike"): "random draws",
    ("", "Bernoulli"): "random draws",
    ("", "Multinomial"): "random draws",
}

# Individual cases, by folder name, that cannot be compared; the reason says why.
CASE_SKIPS: dict[str, str] = {}

# Cases, by folder name, whose ``weights`` variant (test inputs turned into initializers in
# external data) cannot be compared although the ``inputs`` variant can; the reason says why.
WEIGHTS_CASE_SKIPS: dict[str, str] = {}
