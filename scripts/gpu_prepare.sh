#!/usr/bin/env bash
# Prepare, on a machine WITHOUT a GPU, everything the GPU machine needs (it has no package
# index, runs one command at most 10 minutes, carries at most 64 MiB per command and brings
# back at most 8 files), then check it with `scripts/gpu_run.sh --check`.
#
#   1. the ORT headers the build fetched -> .ortheaders/   (ignored; ~0.6 MB)
#   2. the onnxruntime-gpu wheel for Python 3.12, cut into parts of PART_MB MiB (default: the
#      64 MiB a call carries, less the working tree that travels with it, less 1 MiB)
#      -> .ortgpu/part-N, .ortgpu/wheel.sha256 (../shared/device/ort-gpu-parts.sh)
#   3. the MoE benchmark's graph without its weights -> .moegraph/ (ignored; ~3 MB; the GPU
#      machine has no Optimum to export it and regrows the weights from a seed)
#   4. .ortgpu/calls.txt: the exact device calls, in order (command + carry), also printed:
#      the parts, build + gpu tests, the LLM (32k) and MoE benchmarks, then the weight-streaming
#      benchmark with a fresh calibration (the last call: when device time is left).
#
# usage: scripts/gpu_prepare.sh [ORT_GPU_VERSION]      (default: the newest onnxruntime-gpu
# that the package's `gpu` extra allows, 1.31.1 today). Re-running reuses what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
version=${1:-${ORT_GPU_VERSION:-1.31.1}}
# What travels in every call besides the carried paths: tracked + untracked-not-ignored files.
tree_mib=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null \
  | awk '{s += $1} END {print int(s / 1048576) + 1}')
export PART_MB=${PART_MB:-$((64 - tree_mib - 1))}

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")" && touch "$exclude"  # (a checkout may have no .git/info)
for ign in /.ortgpu/ /.ortheaders/ /.moegraph/; do
  grep -qx "$ign" .gitignore "$exclude" 2>/dev/null || echo "$ign" >> "$exclude"
done

# ---- 1. headers -----------------------------------------------------------------------------------
hdr=${HO_ONNX_ORT_INCLUDE_DIR:-}
if [[ -z $hdr ]]; then
  hdr=$(dirname "$(find build .cache -name onnxruntime_c_api.h -path '*onnxruntime*' 2>/dev/null | head -n 1)" 2>/dev/null || true)
fi
if [[ -z $hdr || ! -f $hdr/onnxruntime_c_api.h ]]; then
  echo "gpu_prepare: no onnxruntime_c_api.h found under build/: run scripts/setup.sh first" >&2
  exit 2
fi
rm -rf .ortheaders && mkdir -p .ortheaders/onnxruntime
cp "$hdr"/*.h .ortheaders/onnxruntime/
echo "gpu_prepare: headers from $hdr -> .ortheaders/onnxruntime ($(du -sh .ortheaders | cut -f1))"

# ---- 2. the wheel in parts --------------------------------------------------------------------------
shared=$ROOT/../shared/device/ort-gpu-parts.sh
if [[ ! -f .ortgpu/wheel.sha256 ]] || ! grep -q "onnxruntime_gpu-$version-" .ortgpu/wheel.sha256 \
   || [[ $(find .ortgpu -name 'part-*' -size +"${PART_MB}M" | wc -l) -ne 0 ]] \
   || [[ ! -f .ortgpu/part-0 ]]; then
  [[ -f $shared ]] || { echo "gpu_prepare: $shared is missing" >&2; exit 2; }
  bash "$shared" "$version"
fi
# The whole wheel is not carried; only its parts.
ls .ortgpu/part-* > /dev/null
(cd .ortgpu && ls part-* | sort -V) > .ortgpu/parts.txt

# ---- 3. the MoE graph ------------------------------------------------------------------------------
if [[ ! -f .moegraph/model.onnx ]]; then
  py=python3; [[ -x .venv/bin/python ]] && py=.venv/bin/python
  rm -rf .moegraph
  "$py" bench/moe_decode.py --device cuda --machine "${MOE_MACHINE:-h100}" --strip-to .moegraph > /dev/null
fi
echo "gpu_prepare: the MoE graph in .moegraph ($(du -sh .moegraph | cut -f1))"

# ---- 4. the calls -----------------------------------------------------------------------------------
parts=()
mapfile -t parts < .ortgpu/parts.txt
n=${#parts[@]}
{
  echo "# device calls, in order, back to back (the machine is given back 30 s after a call)"
  echo "# format: COMMAND <TAB> CARRY (comma-separated)"
  for ((i = 0; i < n - 1; i++)); do
    # The first call also probes how fast the machine pins host memory (CUDA runtime only).
    printf 'bash scripts/gpu_run.sh receive%s\t.ortgpu/%s,.ortgpu/parts.txt,.ortgpu/wheel.sha256\n' \
      "$([[ $i -eq 0 ]] && echo ' pinprobe')" "${parts[i]}"
  done
  printf 'bash scripts/gpu_run.sh receive setup build test\t.ortgpu/%s,.ortgpu/parts.txt,.ortgpu/wheel.sha256,.ortheaders\n' "${parts[n-1]}"
  printf 'bash scripts/gpu_run.sh setup llmbench\t\n'
  printf 'bash scripts/gpu_run.sh setup moebench\t.moegraph\n'
  printf 'bash scripts/gpu_run.sh setup calibrate bench\t\n'
} > .ortgpu/calls.txt
echo "gpu_prepare: $n parts of at most $PART_MB MiB; device calls (.ortgpu/calls.txt):"
grep -v '^#' .ortgpu/calls.txt | awk -F'\t' '{printf "  %d. run(command=\"%s\", carry=[%s])\n", NR, $1, $2}'
exec bash scripts/gpu_run.sh --check
