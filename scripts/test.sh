#!/usr/bin/env bash
# Set up (scripts/setup.sh, with the Hugging Face, LLM-export and Ray Serve extras) and run
# lint + the test suite, then the Ray Serve stage (tests marked `serve`: a local Ray cluster
# with two replicas, ~1 min, bounded at 10; HO_SKIP_SERVE=1 skips it), then the training
# stage (scripts/setup_training.sh builds .venv-training with onnxruntime-training and runs
# tests/training there, ~2-4 min; HO_SKIP_TRAINING=1 skips it), then the native library
# under AddressSanitizer + UBSan (scripts/test_native.sh: op-contract, engine,
# failure-class and fuzz tests; HO_SKIP_NATIVE=1 skips it).
# Extra arguments go to pytest, e.g. scripts/test.sh -k decoder
# The whole run takes ~20 minutes on a 2-core machine (CI's last, before the serve and
# training stages: 854 s; mostly the suite, one dot per test).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "test: set-up, ruff, the test suite, the Ray Serve and training stages, then the native" \
  "library under ASan + UBSan; ~20 minutes on 2 cores (the suite prints one dot per test)" >&2
EXTRAS=${EXTRAS:-cpu,test,hf,genai,serve,exact} bash scripts/setup.sh
.venv/bin/ruff check ho_onnx cli models tests bench
echo "test: the test suite ($(date +%T); most of the time is here)" >&2
.venv/bin/python -m pytest -q -ra -m "not serve" "$@"
if [[ "${HO_SKIP_SERVE:-0}" != 1 ]]; then
  echo "test: the Ray Serve stage ($(date +%T); ~1 min, at most 10)" >&2
  timeout 600 .venv/bin/python -m pytest -q -ra -m serve tests/target/ort/test_ray_serve.py
fi
if [[ "${HO_SKIP_TRAINING:-0}" != 1 ]]; then
  echo "test: the training stage: onnxruntime-training in .venv-training, tests/training" \
    "($(date +%T))" >&2
  bash scripts/setup_training.sh
  .venv-training/bin/python -m pytest -q -ra tests/training
else
  echo "test: training stage skipped (HO_SKIP_TRAINING=1): tests/training ran without the" \
    "training runtime only" >&2
fi
if [[ "${HO_SKIP_NATIVE:-0}" != 1 ]]; then
  echo "test: the native library under ASan + UBSan ($(date +%T))" >&2
  bash scripts/test_native.sh
fi
echo "test: done in $((SECONDS / 60)) min $((SECONDS % 60)) s" >&2
