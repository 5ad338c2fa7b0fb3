#!/usr/bin/env bash
# The native library as trusted native libraries are tested (issue 9): an AddressSanitizer +
# UndefinedBehaviorSanitizer build of the custom-op library (CPU only) in build/sanitize,
# run under the op-contract, engine, disk-tier, failure-class and fuzz tests. UBSan halts on
# the first error; ASan aborts on the first error (leak detection is off: Python itself
# "leaks" at exit). Needs .venv (scripts/setup.sh).
#   HO_FUZZ_SECONDS=60 (default 45)   extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
build=build/sanitize
ort_inc=${HO_ONNX_ORT_INCLUDE_DIR:-}
if [[ -z "$ort_inc" ]]; then  # reuse the headers the regular build fetched, if any
  for d in build/*/ort-headers/include/onnxruntime; do
    [[ -f "$d/onnxruntime_c_api.h" ]] && ort_inc=$(realpath "$d") && break
  done
fi
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DHO_ONNX_SANITIZE=ON -DHO_ONNX_WITH_CUDA=OFF -DHO_ONNX_TESTING=ON \
  -DPython_EXECUTABLE="$py" \
  -Dpybind11_DIR="$("$py" -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
  ${ort_inc:+-DHO_ONNX_ORT_INCLUDE_DIR="$ort_inc"} > "$build.log" 2>&1 \
  || { cat "$build.log"; exit 1; }
cmake --build "$build" >> "$build.log" 2>&1 || { tail -50 "$build.log"; exit 1; }
lib=$(ls "$build"/_ops.*.so)
asan=$(gcc -print-file-name=libasan.so)
echo "test_native: $lib (ASan + UBSan), LD_PRELOAD=$asan" >&2
export HO_ONNX_TEST_OPS="$PWD/$lib"
export LD_PRELOAD="$asan $(gcc -print-file-name=libstdc++.so)"  # libstdc++ too: ASan must find the real __cxa_throw
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1:detect_stack_use_after_return=0
export UBSAN_OPTIONS=halt_on_error=1:abort_on_error=1:print_stacktrace=1
export HO_FUZZ_SECONDS=${HO_FUZZ_SECONDS:-45}
exec "$py" -m pytest -q -p no:cacheprovider \
  tests/target/ort/test_ops_contract.py tests/target/ort/test_engine_cpu.py tests/target/ort/test_disk_tier.py \
  tests/target/ort/test_run_records.py tests/test_native_safety.py tests/test_native_fuzz.py \
  tests/graph/test_fingerprint.py tests/target/ort/test_fork.py \
  tests/target/ort/test_gather_rows.py tests/target/ort/test_kv.py tests/target/ort/test_kv_buffers.py \
  tests/target/ort/test_decode_cache.py \
  tests/target/ort/test_cpu_experts.py::test_experts_computed_on_the_host_are_exact_and_move_nothing \
  tests/target/ort/test_cpu_experts.py::test_a_hostile_host_matmul_fails_session_creation \
  tests/target/ort/test_cpu_experts.py::test_a_host_matmul_given_the_wrong_input_fails_the_run "$@"
