#!/usr/bin/env bash
# Run the C-host tests (tests/test_c_host.py: an optimized decoder bit-exact against the
# original, the exported symbols, runtime-version handling) against other onnxruntime
# releases, through each wheel's libonnxruntime (releases before 1.19 ship none: they are
# reported and skipped). Needs the .venv of scripts/setup.sh and pip access to the wheels.
#   usage: scripts/ort_matrix.sh 1.19.2 1.24.4 1.32.0 ...
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -gt 0 ]] || { echo "usage: scripts/ort_matrix.sh VERSION..." >&2; exit 2; }
cache=build/ort-matrix
passed=() failed=() skipped=()
for v in "$@"; do
  d=$cache/$v
  if ! compgen -G "$d/onnxruntime/capi/libonnxruntime.so.*" >/dev/null; then
    mkdir -p "$d"
    .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps \
      --only-binary=:all: "onnxruntime==$v" -d "$d"
    .venv/bin/python - "$d" <<'EOF'
import sys, zipfile, glob
d = sys.argv[1]
with zipfile.ZipFile(glob.glob(f"{d}/onnxruntime-*.whl")[0]) as z:
    for n in z.namelist():
        if n.startswith("onnxruntime/capi/libonnxruntime.so"):
            z.extract(n, d)
EOF
  fi
  lib=$(compgen -G "$d/onnxruntime/capi/libonnxruntime.so.*" | head -n1 || true)
  if [[ -z $lib ]]; then
    echo "ort_matrix: onnxruntime $v: the wheel ships no libonnxruntime, skipped" >&2
    skipped+=("$v")
    continue
  fi
  echo "ort_matrix: onnxruntime $v ($lib)" >&2
  if HO_ONNX_TEST_LIBORT=$PWD/$lib .venv/bin/python -m pytest -q -p no:cacheprovider \
       tests/test_c_host.py; then
    passed+=("$v")
  else
    failed+=("$v")
  fi
done
echo "ort_matrix: passed: ${passed[*]:-none}; failed: ${failed[*]:-none}; skipped: ${skipped[*]:-none}"
[[ ${#failed[@]} -eq 0 ]]
