#!/usr/bin/env bash
# The main job on a default model: set up, build a 12-layer decoder (40 MiB peak, weights in
# external data), plan it under a 16 MiB budget, rewrite it, show the schedule, run both
# models on the same random inputs and compare. Everything lands in out/.
#   BUDGET=8MiB bash scripts/demo.sh   (any size; below the smallest feasible one it says so)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p out
budget=${BUDGET:-16MiB}
dims=(--dim batch=1 --dim seq=128)
echo "== building the decoder"
.venv/bin/python -m models.decoder out/decoder.onnx --layers 12 --hidden 256 --heads 8 \
  --vocab 512 --external-data
echo "== the plan under a $budget budget (cost model: analytic, CPU preset)"
.venv/bin/ho-onnx plan out/decoder.onnx --budget "$budget" "${dims[@]}" | head -n 20
echo "== optimizing"
.venv/bin/ho-onnx optimize out/decoder.onnx out/decoder.ho.onnx --budget "$budget" "${dims[@]}"
echo "== the schedule written into the model"
.venv/bin/ho-onnx inspect out/decoder.ho.onnx | head -n 12
echo "   ... (full table: .venv/bin/ho-onnx inspect out/decoder.ho.onnx)"
echo "== both models on the same random inputs, identical kernels (ORT graph optimizations off): bit-exact"
.venv/bin/ho-onnx verify out/decoder.onnx out/decoder.ho.onnx "${dims[@]}" --runs 3 --int-high 512 \
  --opt-level disable
echo "== the same with all ORT fusions (some need a resident constant, so rounding may differ)"
.venv/bin/ho-onnx verify out/decoder.onnx out/decoder.ho.onnx "${dims[@]}" --runs 3 --int-high 512 \
  --atol 1e-5 --rtol 1e-4
