#!/usr/bin/env bash
# Set up ho-onnx from a fresh clone: a virtual environment in .venv with the package built
# (C++ custom-op library included) and installed in editable mode.
#   EXTRAS=cpu,test,hf (default: cpu,test)   PYTHON=python3
#   ORT_VERSION=1.x.y: that onnxruntime(-gpu) release instead of the newest the pin allows
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${EXTRAS:-cpu,test}
py=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  echo "setup: creating .venv with $($py --version)" >&2
  "$py" -m venv .venv
fi
# Build requirements first, so the editable build reuses its cache in build/ (no isolation).
.venv/bin/python -m pip install -q --disable-pip-version-check "scikit-build-core>=0.10" "pybind11>=2.12" ninja
echo "setup: building and installing ho-onnx[$extras] (first build fetches ORT headers, ~1-2 min)" >&2
.venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[$extras]"
if [[ -n ${ORT_VERSION:-} ]]; then
  ort_pkg=onnxruntime
  [[ ,$extras, == *,gpu,* ]] && ort_pkg=onnxruntime-gpu
  echo "setup: $ort_pkg==$ORT_VERSION" >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check "$ort_pkg==$ORT_VERSION"
fi
.venv/bin/python -c "import onnxruntime; print('setup: onnxruntime', onnxruntime.__version__)" >&2
.venv/bin/python -c "import ho_onnx; print('setup: ho_onnx', ho_onnx.__version__, ho_onnx.build_info())" >&2
