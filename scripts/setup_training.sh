#!/usr/bin/env bash
# Set up the training environment: .venv-training with onnxruntime-training-cpu (ORT's
# on-device training API, `onnxruntime.training`) and ho-onnx installed in editable mode
# against it. onnxruntime-training installs the same `onnxruntime` module as the `cpu` extra,
# so it gets its own venv; the op library (C API 18) is the one scikit-build-core builds into
# build/ (shared with .venv: the library links no ORT, only its headers).
#   PYTHON=python3 (3.8-3.12: onnxruntime-training-cpu 1.19.2 has wheels for those only)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${HO_TRAINING_VENV:-.venv-training}
py=${PYTHON:-python3}
if [[ ! -x $venv/bin/python ]]; then
  ver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  case $ver in
    3.8|3.9|3.10|3.11|3.12) ;;
    *) echo "setup_training: onnxruntime-training-cpu 1.19.2 has no wheel for Python $ver" \
         "(3.8-3.12); set PYTHON" >&2; exit 2 ;;
  esac
  echo "setup_training: creating $venv with Python $ver" >&2
  "$py" -m venv "$venv"
  echo "*" > "$venv/.gitignore"  # the venv stays out of git (Python < 3.13 writes none)
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check "scikit-build-core>=0.10" "pybind11>=2.12" ninja
echo "setup_training: installing ho-onnx[training] (reuses the library build in build/)" >&2
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[training]"
"$venv/bin/python" - <<'PY' >&2
import onnxruntime as ort
import onnxruntime.training.api  # noqa: F401  (the training build, not plain onnxruntime)
import ho_onnx
from ho_onnx.target.ort.runtime import library_path
so = ort.SessionOptions()
so.register_custom_ops_library(library_path())
print("setup_training: onnxruntime-training", ort.__version__, "; ho_onnx", ho_onnx.__version__,
      "library registers")
PY
