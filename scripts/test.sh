#!/usr/bin/env bash
# Set up (scripts/setup.sh, with the Hugging Face and LLM-export extras) and run lint + the
# test suite, then the native library under AddressSanitizer + UBSan (scripts/test_native.sh:
# op-contract, engine, failure-class and fuzz tests; HO_SKIP_NATIVE=1 skips it).
# Extra arguments go to pytest, e.g. scripts/test.sh -k decoder
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${EXTRAS:-cpu,test,hf,genai} bash scripts/setup.sh
.venv/bin/ruff check ho_onnx cli models tests bench
.venv/bin/python -m pytest -q -ra "$@"
if [[ "${HO_SKIP_NATIVE:-0}" != 1 ]]; then
  bash scripts/test_native.sh
fi
