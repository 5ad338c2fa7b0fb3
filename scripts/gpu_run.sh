#!/usr/bin/env bash
# The one script for a GPU machine (CUDA 13 + nvcc, Python 3 with numpy, onnx, pybind11,
# cmake, ninja, torch and accelerate, a CPU-only onnxruntime, no package index):
#
#   1. install the carried onnxruntime-gpu wheel (parts under .ortgpu/, made by
#      ../shared/device/ort-gpu-parts.sh) into /tmp/site, ahead of the CPU onnxruntime;
#   2. LD_LIBRARY_PATH: torch's nvidia/*/lib folders (cuDNN, cuBLAS, ... for onnxruntime-gpu);
#   3. build ho_onnx with CUDA (sm_80, sm_90) against the carried ORT headers (.ortheaders/,
#      the folder holding onnxruntime_c_api.h) and put the module into ho_onnx/;
#   4. pytest -m gpu (tests/test_cuda_engine.py), the host-logic tests and the CPU engine's
#      tests under onnxruntime-gpu (the CUDA-EP ops are registered there: CPU sessions must
#      keep working);
#   5. ho-onnx calibrate (pinned copy and disk rates -> machine file);
#   6. bench/gpu_offload.py with that machine file.
#
# Logs and JSON go to $OUT (default ./gpu_out). usage: scripts/gpu_run.sh [STEP...]
# STEPs: setup build test calibrate bench (default: all). Every step after setup needs
# setup's environment, so it always runs. BENCH_ARGS adds options to the benchmark (e.g.
# "--layers 8 --hidden 2048"); PYTEST_ARGS to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=/tmp/site
steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(build test calibrate bench)
status=0

say() { echo "== gpu_run: $*" | tee -a "$OUT/gpu_run.log" >&2; }
want() { local s; for s in "${steps[@]}"; do [[ $s == "$1" || $s == all ]] && return 0; done; return 1; }

# ---- 1. onnxruntime-gpu ------------------------------------------------------------------------
setup() {
  mkdir -p "$SITE"
  if ! PYTHONPATH=$SITE "$PY" -c 'import onnxruntime as o, sys; sys.exit("CUDAExecutionProvider" not in o.get_available_providers())' 2>/dev/null; then
    [[ -f .ortgpu/wheel.sha256 ]] || { say "no .ortgpu/wheel.sha256: carry the onnxruntime-gpu parts (.ortgpu)"; return 1; }
    local wheel
    wheel=$(awk '{print $2}' .ortgpu/wheel.sha256)
    mkdir -p /tmp/ortgpu
    cat .ortgpu/part-* > "/tmp/ortgpu/$wheel"
    (cd /tmp/ortgpu && sha256sum -c "$ROOT/.ortgpu/wheel.sha256") || { say "wheel checksum mismatch"; return 1; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" \
      "/tmp/ortgpu/$wheel" || { say "pip could not install $wheel"; return 1; }
  fi
  export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
  # The CUDA libraries onnxruntime-gpu loads (cuDNN, cuBLAS, cuFFT, cuRAND, the runtime)
  # come with torch's nvidia-* wheels.
  local nv libs
  nv=$("$PY" -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
  if [[ -n $nv ]]; then
    libs=$(find "$nv" -maxdepth 3 -type d -name lib | sort | paste -sd: -)
    export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  else
    say "torch's nvidia packages not found: relying on the system's CUDA libraries"
  fi
  export PATH=/usr/local/cuda/bin:$PATH
  "$PY" - <<'EOF' 2>&1 | tee -a "$OUT/gpu_run.log"
import onnxruntime as o
print("onnxruntime", o.__version__, o.__file__, o.get_available_providers())
EOF
}

# ---- 3. build ------------------------------------------------------------------------------------
build() {
  local hdr
  hdr=$(dirname "$(find "$ROOT/.ortheaders" -name onnxruntime_c_api.h 2>/dev/null | head -n 1)" 2>/dev/null)
  [[ -n $hdr && -f $hdr/onnxruntime_c_api.h ]] || { say "no onnxruntime_c_api.h under .ortheaders/"; return 1; }
  local pyb
  pyb=$("$PY" -m pybind11 --cmakedir) || { say "pybind11 is not installed"; return 1; }
  cmake -S "$ROOT" -B /tmp/ho_build -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DHO_ONNX_WITH_CUDA=ON -DHO_ONNX_ORT_INCLUDE_DIR="$hdr" -Dpybind11_DIR="$pyb" \
    -DPython_EXECUTABLE="$(command -v "$PY")" >"$OUT/build.log" 2>&1 &&
    cmake --build /tmp/ho_build >>"$OUT/build.log" 2>&1 || { say "build failed (build.log)"; tail -n 30 "$OUT/build.log"; return 1; }
  # the module finds the op library next to it ($ORIGIN), where library_path() looks too
  cp /tmp/ho_build/_ops*.so /tmp/ho_build/libho_onnx_ops.so "$ROOT/ho_onnx/" || return 1
  "$PY" -c 'from ho_onnx import _ops; print("ho_onnx", _ops.build_info(), "devices:", _ops.cuda_device_count())' 2>&1 | tee -a "$OUT/gpu_run.log"
}

# ---- 4. tests ------------------------------------------------------------------------------------
run_tests() {
  # shellcheck disable=SC2086
  "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_cuda_engine.py ${PYTEST_ARGS:-} \
    2>&1 | tee "$OUT/pytest_gpu.log"
  local rc=${PIPESTATUS[0]}
  "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_host_logic.py \
    tests/test_engine_cpu.py tests/test_ops_contract.py tests/test_disk_tier.py \
    2>&1 | tee "$OUT/pytest_cpu_under_ort_gpu.log"
  local rc2=${PIPESTATUS[0]}
  [[ $rc -eq 0 && $rc2 -eq 0 ]]
}

# ---- 5. calibration --------------------------------------------------------------------------------
calibrate() {
  if "$PY" -m ho_onnx.cli calibrate --help >/dev/null 2>&1; then
    "$PY" -m ho_onnx.cli calibrate --out "$OUT/machine.json" --base h100 --size 2GiB --dir /tmp \
      2>&1 | tee "$OUT/calibrate.log"
  else
    "$PY" - "$OUT/machine.json" <<'EOF' 2>&1 | tee "$OUT/calibrate.log"
import json, sys
from ho_onnx import _ops
from ho_onnx.calibrate import measure_file_read
r = _ops.cuda_calibrate(256 << 20)
m = {"base": "h100", "name": "h100+calibrated", "h2d_bw": r["h2d_bw"], "d2h_bw": r["d2h_bw"],
     "disk_bw": measure_file_read(None, threads=2, size=2 << 30, directory="/tmp"),
     "device_name": r["device_name"]}
open(sys.argv[1], "w").write(json.dumps(m, indent=2) + "\n")
print(m)
EOF
  fi
  [[ -s $OUT/machine.json ]]
}

# ---- 6. benchmark ----------------------------------------------------------------------------------
bench() {
  local machine=h100
  [[ -s $OUT/machine.json ]] && machine=$OUT/machine.json
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 "$PY" bench/gpu_offload.py --machine "$machine" --workdir /tmp/ho_bench \
    --json "$OUT/gpu_offload.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  return "${PIPESTATUS[0]}"
}

setup || { say "setup failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee -a "$OUT/gpu_run.log"
if want build; then build || { say "build failed"; exit 1; }; fi
if want test; then run_tests || { say "tests failed"; status=1; }; fi
if want calibrate; then calibrate || { say "calibration failed"; status=1; }; fi
if want bench; then bench || { say "benchmark failed"; status=1; }; fi
say "done (status $status); logs in $OUT"
exit $status
