#!/usr/bin/env bash
# The main job on a default model: set up, build a 12-layer decoder (external data), rewrite
# it with every weight and large activation offloaded, show the schedule, run both models on
# the same random inputs and compare. Everything lands in out/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p out
dims=(--dim batch=1 --dim seq=128)
echo "== building the decoder"
.venv/bin/python -m models.decoder out/decoder.onnx --layers 12 --hidden 256 --heads 8 \
  --vocab 512 --external-data
echo "== optimizing (weights and activations >= 64 KiB offloaded)"
.venv/bin/ho-onnx optimize out/decoder.onnx out/decoder.ho.onnx --offload all \
  --min-bytes 64KiB --min-gap 2 --prefetch-distance 2 "${dims[@]}"
echo "== the schedule"
.venv/bin/ho-onnx inspect out/decoder.ho.onnx | head -n 25
echo "   ... (full table: .venv/bin/ho-onnx inspect out/decoder.ho.onnx)"
echo "== running both models on the same random inputs, identical kernels (ORT graph optimizations off): bit-exact"
.venv/bin/ho-onnx verify out/decoder.onnx out/decoder.ho.onnx "${dims[@]}" --runs 3 --int-high 512 \
  --opt-level disable
echo "== the same with all ORT fusions: fusions that need a resident intermediate do not apply, so rounding differs"
.venv/bin/ho-onnx verify out/decoder.onnx out/decoder.ho.onnx "${dims[@]}" --runs 3 --int-high 512 \
  --atol 1e-5 --rtol 1e-4
