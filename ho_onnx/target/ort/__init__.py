"""ONNX Runtime as the target: sessions with the op library, the runtime facts the decisions
respect, verification, profiling, ORT's own graph optimizations and calibration.

Modules: :mod:`.facts`, :mod:`.session` (optimization levels, sessions for comparisons),
:mod:`.runtime` (the op library: ``InferenceSession``, ``library_path``, counters),
:mod:`.verify`, :mod:`.profile`, :mod:`.optimize`, :mod:`.calibrate`, :mod:`.isolate` (ORT on
untrusted models in a child process); serving: :mod:`.triton` (a Triton model repository
entry) and :mod:`.ray_serve` (Ray Serve replicas), docs/serving.md.
"""
