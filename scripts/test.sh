#!/usr/bin/env bash
# Set up (scripts/setup.sh, with the Hugging Face extra) and run lint + the test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k decoder
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${EXTRAS:-cpu,test,hf} bash scripts/setup.sh
.venv/bin/ruff check ho_onnx cli models tests bench
exec .venv/bin/python -m pytest -q -ra "$@"
