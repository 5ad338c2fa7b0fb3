#!/usr/bin/env bash
# The one runner for a GPU machine (CUDA 13 + nvcc, Python 3.12 with numpy, onnx, onnx-ir,
# pybind11, cmake, ninja, click, pytest, torch and accelerate, a CPU-only onnxruntime, NO
# package index; one command at most 10 minutes, 64 MiB carried, 8 files back).
# Prepare here with scripts/gpu_prepare.sh; it writes the exact calls to .ortgpu/calls.txt.
#
# usage: scripts/gpu_run.sh STEP...      or      scripts/gpu_run.sh --check   (no GPU needed)
# STEPs, in the order given:
#   receive    move the carried wheel parts (.ortgpu/part-*) to /tmp/ho_gpu/parts (kept while
#              the machine stays warm); one call per part, back to back
#   setup      reassemble the onnxruntime-gpu wheel, check its sha256, install it into
#              /tmp/site ahead of the CPU onnxruntime; LD_LIBRARY_PATH from torch's nvidia/*/lib;
#              then PROVE that CUDAExecutionProvider loads (a one-node session whose
#              get_providers()[0] is CUDA), else name the missing shared libraries and stop.
#              Every step after it needs its environment: put it first in every call.
#   build      cmake + ninja with CUDA (sm_80, sm_90) against the carried headers (.ortheaders/),
#              installed into ho_onnx/ (the op library and the Python module)
#   test       pytest -m gpu (all gpu-marked tests), then the CPU engine's tests under
#              onnxruntime-gpu (the CUDA kernels are registered there; CPU sessions must work)
#   calibrate  pinned H2D/D2H and disk read rates -> $OUT/machine.json
#   bench      bench/gpu_offload.py with that machine file -> $OUT/gpu_offload.json
#   llmbench   bench/llm_generate.py --device cuda (greedy generation, TTFT and tokens/s of a
#              1.08 B-parameter fp16 decoder with a KV cache, built here; ort / ho-onnx /
#              transformers rows) -> $OUT/llm_generate.json, bounded by HO_LLM_S seconds
#              (default 300: `setup llmbench` on a warm, built machine ends within ~5 min);
#              LLM_ARGS replaces its sizes (default: --contexts 32768 --repeats 1 --new-tokens 16:
#              2,048 ran at stop 46, 32,768 at stop 48, ~200 s, before the loop's own cache
#              buffers and arena shrinking)
#   recomputebench  bench/recompute.py --device cuda: an 8-layer decoder's activations stored
#              against recomputed (recompute off/auto/on) at 0.7 of its peak, planned with
#              this GPU's machine, run on the CUDA EP -> $OUT/recompute.json (about a minute)
#   pinprobe   bench/pin_probe.py: how fast host memory is pinned, by method and block size
#              (mmap + cudaHostRegister, with huge pages, cudaHostAlloc) -> $OUT/pin_probe.json;
#              needs only the CUDA runtime, so it fits the first receive call
#   moebench   bench/moe_decode.py --device cuda --hf on the carried graph .moegraph/ (written
#              by gpu_prepare.sh: a 2.0 GiB Qwen3-MoE exported here without its weights, which
#              are regrown on the machine from a seed, models/regrow.py) -> $OUT/moe_decode.json,
#              bounded by HO_MOE_S seconds (default 300); HO_MOE_ROWS: its ONNX rows (';'-separated,
#              default the goal's two and every expert computed on the host: 'CPU experts, 1/4
#              experts' (auto) chose none on the H200 of stop 46; each session takes ~20 s to
#              create there, ORT's own time for this graph); MOE_ARGS adds options
# Logs and JSON go to $OUT (default ./gpu_out), at most 8 files per call. Every step is
# bounded so that the call ends inside 10 minutes with its logs (HO_GPU_CALL_S, default 570).
# BENCH_ARGS adds options to the benchmark, PYTEST_ARGS to the gpu pytest.
#
# --check (any machine): performs every step that can be performed without a GPU (parts,
# checksum, headers, sizes of what each call carries, files each call brings back, command
# lengths, shell syntax, that pytest collects the gpu tests and the benchmark parses its
# options) and exits non-zero if any call would break a limit.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_out}
PY=${PYTHON:-python3}
SITE=/tmp/site
PARTS=/tmp/ho_gpu/parts
CALL_S=${HO_GPU_CALL_S:-570}
LIMIT_CARRY=$((64 << 20))
LIMIT_FILES=8
status=0

say() { echo "== gpu_run: $*" | tee -a "$OUT/gpu_run.log" >&2; }
left() { echo $((CALL_S - SECONDS)); }

# ---- receive ------------------------------------------------------------------------------------
receive() {
  mkdir -p "$PARTS"
  local f moved=0
  for f in .ortgpu/part-*; do
    [[ -f $f ]] || continue
    cp -f "$f" "$PARTS/" && moved=$((moved + 1))
  done
  [[ -f .ortgpu/wheel.sha256 ]] && cp -f .ortgpu/wheel.sha256 "$PARTS/"
  [[ -f .ortgpu/parts.txt ]] && cp -f .ortgpu/parts.txt "$PARTS/"
  local want have
  want=$(wc -l < "$PARTS/parts.txt" 2>/dev/null || echo '?')
  have=$(find "$PARTS" -name 'part-*' | wc -l)
  say "received $moved part(s); $have of $want on this machine"
}

# ---- setup --------------------------------------------------------------------------------------
missing_parts() {
  local p
  [[ -f $PARTS/parts.txt ]] || { echo "parts.txt"; return; }
  while read -r p; do [[ -f $PARTS/$p ]] || echo "$p"; done < "$PARTS/parts.txt"
}

setup() {
  mkdir -p "$SITE"
  if ! PYTHONPATH=$SITE "$PY" -c 'import onnxruntime as o, sys; sys.exit("CUDAExecutionProvider" not in o.get_available_providers())' 2>/dev/null; then
    local miss
    miss=$(missing_parts | paste -sd' ' -)
    if [[ -n $miss ]]; then
      say "wheel parts missing on this machine: $miss (a fresh machine: run the calls of .ortgpu/calls.txt again from the first)"
      return 1
    fi
    local wheel
    wheel=$(awk '{print $2}' "$PARTS/wheel.sha256")
    mkdir -p /tmp/ho_gpu/wheel
    # shellcheck disable=SC2046
    cat $(sed "s|^|$PARTS/|" "$PARTS/parts.txt") > "/tmp/ho_gpu/wheel/$wheel"
    (cd /tmp/ho_gpu/wheel && sha256sum -c "$PARTS/wheel.sha256") || { say "wheel checksum mismatch"; return 1; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" \
      "/tmp/ho_gpu/wheel/$wheel" || { say "pip could not install $wheel"; return 1; }
  fi
  export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
  # cli/ is installed as ho_onnx.cli (pyproject's wheel.packages); from the source tree on
  # PYTHONPATH the same mapping is a link (ignored by git).
  [[ -e $ROOT/ho_onnx/cli ]] || ln -sfn ../cli "$ROOT/ho_onnx/cli"
  local nv libs
  nv=$("$PY" -c 'import nvidia, os; print(os.path.dirname(nvidia.__file__) if getattr(nvidia, "__file__", None) else list(nvidia.__path__)[0])' 2>/dev/null || true)
  if [[ -n $nv ]]; then
    libs=$(find "$nv" -maxdepth 3 -type d -name lib | sort | paste -sd: -)
    export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  else
    say "torch's nvidia packages not found: relying on the system's CUDA libraries"
  fi
  export PATH=/usr/local/cuda/bin:$PATH
  cuda_ep_loads
}

# One Add node on CUDAExecutionProvider: ORT silently falls back to the CPU when the provider
# library cannot load, so check what the session actually uses.
cuda_ep_loads() {
  if "$PY" - <<'EOF' 2>&1 | tee -a "$OUT/gpu_run.log"; then
import sys
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

print("onnxruntime", ort.__version__, ort.__file__, ort.get_available_providers())
x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
g = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "probe", [x], [y])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
m.ir_version = 9
s = ort.InferenceSession(m.SerializeToString(), providers=["CUDAExecutionProvider"])
got = s.get_providers()
out = s.run(None, {"x": np.arange(4, dtype=np.float32)})[0]
ok = got[0] == "CUDAExecutionProvider" and out.tolist() == [0.0, 2.0, 4.0, 6.0]
print("probe session providers:", got, "->", "CUDA EP LOADED" if ok else "NOT ON CUDA")
sys.exit(0 if ok else 1)
EOF
    [[ ${PIPESTATUS[0]} -eq 0 ]] && return 0
  fi
  local capi lib
  capi=$("$PY" -c 'import onnxruntime, os; print(os.path.join(os.path.dirname(onnxruntime.__file__), "capi"))' 2>/dev/null)
  lib=$(ls "$capi"/libonnxruntime_providers_cuda.so 2>/dev/null)
  if [[ -z $lib ]]; then
    say "CUDAExecutionProvider did not load: $capi has no libonnxruntime_providers_cuda.so (the CPU onnxruntime is first on the path?)"
  else
    say "CUDAExecutionProvider did not load; libraries it cannot find: $(ldd "$lib" | awk '/not found/{print $1}' | paste -sd' ' -) (LD_LIBRARY_PATH=$LD_LIBRARY_PATH)"
  fi
  return 1
}

# ---- build --------------------------------------------------------------------------------------
build() {
  local hdr
  hdr=$(dirname "$(find "$ROOT/.ortheaders" -name onnxruntime_c_api.h 2>/dev/null | head -n 1)" 2>/dev/null)
  [[ -n $hdr && -f $hdr/onnxruntime_c_api.h ]] || { say "no onnxruntime_c_api.h under .ortheaders/ (carry it)"; return 1; }
  local pyb
  pyb=$("$PY" -m pybind11 --cmakedir) || { say "pybind11 is not installed"; return 1; }
  timeout "$(left)" cmake -S "$ROOT" -B /tmp/ho_build -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DHO_ONNX_WITH_CUDA=ON -DHO_ONNX_TESTING=ON -DHO_ONNX_ORT_INCLUDE_DIR="$hdr" -Dpybind11_DIR="$pyb" \
    -DPython_EXECUTABLE="$(command -v "$PY")" >"$OUT/build.log" 2>&1 &&
    timeout "$(left)" cmake --build /tmp/ho_build >>"$OUT/build.log" 2>&1 &&
    cmake --install /tmp/ho_build --prefix /tmp/ho_install >>"$OUT/build.log" 2>&1 ||
    { say "build failed (build.log)"; tail -n 30 "$OUT/build.log"; return 1; }
  install_built
}

install_built() {
  local f n=0
  for f in /tmp/ho_install/ho_onnx/*.so*; do
    [[ -e $f ]] || continue
    cp -f "$f" "$ROOT/ho_onnx/" && n=$((n + 1))
  done
  [[ $n -gt 0 ]] || { say "nothing built into /tmp/ho_install/ho_onnx (run the build step)"; return 1; }
  "$PY" -c 'import ho_onnx; from ho_onnx import _ops; print("ho_onnx", ho_onnx.library_path(), _ops.build_info(), "devices:", _ops.cuda_device_count())' 2>&1 | tee -a "$OUT/gpu_run.log"
  return "${PIPESTATUS[0]}"
}

# ---- test ---------------------------------------------------------------------------------------
cpu_engine_tests() {
  local f
  shopt -s globstar nullglob
  for f in tests/**/test_*engine_cpu*.py tests/**/test_*ops_contract*.py tests/**/test_*disk_tier*.py \
           tests/**/test_*cuda_host_logic*.py tests/**/test_*placement*.py \
           tests/**/test_*run_records*.py; do
    echo "$f"
  done
}

run_tests() {
  local budget
  budget=$(( $(left) * 2 / 3 ))
  # shellcheck disable=SC2086
  timeout "$budget" "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests ${PYTEST_ARGS:-} \
    2>&1 | tee "$OUT/pytest_gpu.log"
  local rc=${PIPESTATUS[0]}
  # shellcheck disable=SC2046
  timeout "$(( $(left) - 15 ))" "$PY" -m pytest -q -rs -p no:cacheprovider -m 'not gpu and not slow' \
    $(cpu_engine_tests) 2>&1 | tee "$OUT/pytest_cpu.log"
  local rc2=${PIPESTATUS[0]}
  say "gpu tests exit $rc, cpu engine tests under onnxruntime-gpu exit $rc2"
  [[ $rc -eq 0 && $rc2 -eq 0 ]]
}

# ---- calibrate ----------------------------------------------------------------------------------
calibrate() {
  [[ -e $ROOT/ho_onnx/_ops$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))') ]] || install_built || return 1
  timeout 120 "$PY" -m ho_onnx calibrate --out "$OUT/machine.json" --base h100 --size 2GiB --dir /tmp \
    2>&1 | tee "$OUT/calibrate.log"
  [[ ${PIPESTATUS[0]} -eq 0 && -s $OUT/machine.json ]]
}

# ---- bench --------------------------------------------------------------------------------------
bench() {
  # The planner's predictions need this machine's rates: a call without its own `calibrate`
  # step calibrates first (the h100 preset's 50 GB/s made decode predictions 10 % slow).
  [[ -s $OUT/machine.json ]] || { say "no machine.json in this call: calibrating first"; calibrate || return 1; }
  local machine=$OUT/machine.json
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 timeout "$(( $(left) - 10 ))" "$PY" bench/gpu_offload.py --machine "$machine" \
    --workdir /tmp/ho_bench --json "$OUT/gpu_offload.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  return "${PIPESTATUS[0]}"
}

# ---- llmbench -----------------------------------------------------------------------------------
llmbench() {
  [[ -e $ROOT/ho_onnx/_ops$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))') ]] || install_built || return 1
  local bound=${HO_LLM_S:-300} machine=(--machine "$(machine_arg)")
  [[ $bound -lt $(( $(left) - 10 )) ]] || bound=$(( $(left) - 10 ))
  # Rows are saved to the JSON as each ends: a bound that cuts the run short still brings back
  # every row it measured ("complete": false).
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 timeout "$bound" "$PY" bench/llm_generate.py --device cuda \
    --workdir /tmp/ho_llm --json "$OUT/llm_generate.json" --timeout 120 "${machine[@]}" \
    ${LLM_ARGS:---contexts 32768 --repeats 1 --new-tokens 16} 2>&1 | tee "$OUT/llmbench.log"
  return "${PIPESTATUS[0]}"
}

# The planner's rates: this call's calibration, else the preset of this GPU (h200 / h100).
machine_arg() {
  if [[ -s $OUT/machine.json ]]; then echo "$OUT/machine.json"
  elif nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H200; then echo h200
  else echo h100; fi
}

# ---- moebench -----------------------------------------------------------------------------------
moebench() {
  [[ -e $ROOT/ho_onnx/_ops$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))') ]] || install_built || return 1
  [[ -f .moegraph/model.onnx ]] || { say "no .moegraph/model.onnx: carry .moegraph (scripts/gpu_prepare.sh)"; return 1; }
  local bound=${HO_MOE_S:-300}
  [[ $bound -lt $(( $(left) - 10 )) ]] || bound=$(( $(left) - 10 ))
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 timeout "$bound" "$PY" bench/moe_decode.py --device cuda --graph .moegraph \
    --hf --machine "$(machine_arg)" --workdir /tmp --json "$OUT/moe_decode.json" \
    --rows "${HO_MOE_ROWS:-all streamed, 1/4 experts;routed, 1/4 experts;routed + CPU experts}" \
    ${MOE_ARGS:-} 2>&1 | tee "$OUT/moebench.log"
  return "${PIPESTATUS[0]}"
}

# ---- recomputebench -----------------------------------------------------------------------------
recomputebench() {
  [[ -e $ROOT/ho_onnx/_ops$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))') ]] || install_built || return 1
  local bound=${HO_RECOMPUTE_S:-150}
  [[ $bound -lt $(( $(left) - 10 )) ]] || bound=$(( $(left) - 10 ))
  PYTHONUNBUFFERED=1 timeout "$bound" "$PY" bench/recompute.py --device cuda \
    --machine "$(machine_arg)" --runs 20 --workdir /tmp/ho_recompute --json "$OUT/recompute.json" \
    2>&1 | tee "$OUT/recompute.log"
  return "${PIPESTATUS[0]}"
}

# ---- pinprobe -----------------------------------------------------------------------------------
# How fast the machine pins host memory, by method and block size (no ORT, no build needed).
pinprobe() {
  timeout 100 "$PY" bench/pin_probe.py --mib "${HO_PIN_MIB:-256}" --row-s 8 --json "$OUT/pin_probe.json" \
    2>&1 | tee "$OUT/pin_probe.log"
  return "${PIPESTATUS[0]}"
}

# ---- --check ------------------------------------------------------------------------------------
# Files each step writes under $OUT (a call brings back at most LIMIT_FILES).
step_files() {
  case $1 in
    receive|setup) echo gpu_run.log ;;
    build) echo gpu_run.log build.log ;;
    test) echo gpu_run.log pytest_gpu.log pytest_cpu.log ;;
    calibrate) echo gpu_run.log machine.json calibrate.log ;;
    bench) echo gpu_run.log bench.log gpu_offload.json machine.json calibrate.log ;;
    llmbench) echo gpu_run.log llmbench.log llm_generate.json ;;
    moebench) echo gpu_run.log moebench.log moe_decode.json ;;
    pinprobe) echo gpu_run.log pin_probe.log pin_probe.json ;;
    recomputebench) echo gpu_run.log recompute.log recompute.json ;;
  esac
}

size_of() { [[ $# -gt 0 ]] || { echo 0; return; }; du -sb "$@" 2>/dev/null | awk '{s += $1} END {print s + 0}'; }

check() {
  local bad=0 line cmd carry tree n=0
  fail() { echo "check: FAIL: $*"; bad=1; }
  ok() { echo "check: ok: $*"; }
  for s in scripts/gpu_run.sh scripts/gpu_prepare.sh; do bash -n "$s" || fail "$s has a syntax error"; done
  [[ -f .ortheaders/onnxruntime/onnxruntime_c_api.h ]] && ok "headers in .ortheaders" ||
    fail ".ortheaders/onnxruntime/onnxruntime_c_api.h missing (scripts/gpu_prepare.sh)"
  if [[ -f .ortgpu/parts.txt && -f .ortgpu/wheel.sha256 ]]; then
    local sum want
    # shellcheck disable=SC2046
    sum=$(cat $(sed 's|^|.ortgpu/|' .ortgpu/parts.txt) | sha256sum | awk '{print $1}')
    want=$(awk '{print $1}' .ortgpu/wheel.sha256)
    [[ $sum == "$want" ]] && ok "$(wc -l < .ortgpu/parts.txt) parts reassemble to $(awk '{print $2}' .ortgpu/wheel.sha256)" ||
      fail "the parts do not reassemble to the wheel's sha256"
  else
    fail ".ortgpu/parts.txt or wheel.sha256 missing (scripts/gpu_prepare.sh)"
  fi
  git check-ignore -q .ortgpu/x && git check-ignore -q .ortheaders/x || fail ".ortgpu/ and .ortheaders/ must be ignored (else they travel every call)"
  # What travels in every call: tracked + untracked-not-ignored files.
  tree=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
  ok "working tree that travels: $((tree >> 10)) KiB"
  [[ -f .ortgpu/calls.txt ]] || fail ".ortgpu/calls.txt missing (scripts/gpu_prepare.sh)"
  while IFS=$'\t' read -r cmd carry; do
    [[ -z $cmd || $cmd == \#* ]] && continue
    n=$((n + 1))
    local paths=() total files=() st
    IFS=, read -r -a paths <<< "$carry"
    total=$((tree + $(size_of "${paths[@]}")))
    [[ ${#cmd} -le 2000 ]] || fail "call $n: command longer than 2000 characters"
    [[ ${#paths[@]} -le 8 ]] || fail "call $n: more than 8 carried paths"
    local p
    for p in "${paths[@]}"; do [[ -e $p ]] || fail "call $n: carried path $p does not exist"; done
    if [[ $total -gt $LIMIT_CARRY ]]; then fail "call $n: $((total >> 20)) MiB would travel (limit 64 MiB)"; continue; fi
    for st in ${cmd#bash scripts/gpu_run.sh }; do
      declare -F "$(fn_of "$st")" >/dev/null || fail "call $n: unknown step $st"
      mapfile -t -O "${#files[@]}" files < <(step_files "$st" | tr ' ' '\n')
    done
    local uniq
    uniq=$(printf '%s\n' "${files[@]}" | sort -u | wc -l)
    if [[ $uniq -gt $LIMIT_FILES ]]; then fail "call $n brings back $uniq files (limit $LIMIT_FILES)"; continue; fi
    ok "call $n: $((total >> 20)) MiB carried, $uniq files back: $cmd"
  done < <(cat .ortgpu/calls.txt 2>/dev/null)
  [[ $n -ge 2 ]] || fail "fewer than two calls planned"
  local vpy=$PY
  [[ -x .venv/bin/python ]] && vpy=.venv/bin/python
  if "$vpy" -m pytest -q -p no:cacheprovider --collect-only -m gpu tests > /tmp/ho_gpu_collect.log 2>&1; then
    ok "pytest collects $(grep -Eo '^[0-9]+(/[0-9]+)? tests? (collected|selected)' /tmp/ho_gpu_collect.log | head -1 || tail -1 /tmp/ho_gpu_collect.log) -m gpu"
  else
    fail "pytest cannot collect the gpu tests: $(tail -n 3 /tmp/ho_gpu_collect.log)"
  fi
  [[ -n $(cpu_engine_tests) ]] && ok "cpu engine tests: $(cpu_engine_tests | paste -sd' ' -)" || fail "no cpu engine tests found"
  "$vpy" bench/gpu_offload.py --help > /dev/null 2>&1 && ok "bench/gpu_offload.py parses its options" ||
    fail "bench/gpu_offload.py --help fails"
  "$vpy" bench/llm_generate.py --help > /dev/null 2>&1 && ok "bench/llm_generate.py parses its options" ||
    fail "bench/llm_generate.py --help fails"
  "$vpy" bench/moe_decode.py --help > /dev/null 2>&1 && ok "bench/moe_decode.py parses its options" ||
    fail "bench/moe_decode.py --help fails"
  "$vpy" bench/recompute.py --help > /dev/null 2>&1 && ok "bench/recompute.py parses its options" ||
    fail "bench/recompute.py --help fails"
  if grep -q moebench .ortgpu/calls.txt 2>/dev/null; then
    [[ -f .moegraph/model.onnx ]] && ok "the MoE graph in .moegraph ($(du -sh .moegraph | cut -f1))" ||
      fail ".moegraph/model.onnx missing (scripts/gpu_prepare.sh)"
    git check-ignore -q .moegraph/x || fail ".moegraph/ must be ignored (else it travels every call)"
  fi
  local llm_files
  llm_files=$( { step_files setup; step_files llmbench; } | tr ' ' '\n' | sort -u | wc -l)
  [[ $llm_files -le $LIMIT_FILES ]] && ok "'setup llmbench' brings back $llm_files files" ||
    fail "'setup llmbench' brings back $llm_files files (limit $LIMIT_FILES)"
  "$vpy" -m ho_onnx calibrate --help > /dev/null 2>&1 && ok "python -m ho_onnx calibrate exists" ||
    fail "python -m ho_onnx calibrate --help fails"
  [[ $bad -eq 0 ]] && echo "check: all device calls fit the limits" || echo "check: FAILED"
  return $bad
}

fn_of() { case $1 in test) echo run_tests ;; *) echo "$1" ;; esac; }

if [[ ${1:-} == --check ]]; then
  check
  exit $?
fi
mkdir -p "$OUT"
[[ $# -gt 0 ]] || { echo "usage: scripts/gpu_run.sh STEP... | --check (see the header)" >&2; exit 2; }
for st in "$@"; do
  declare -F "$(fn_of "$st")" >/dev/null || { echo "gpu_run: unknown step $st" >&2; exit 2; }
done
for st in "$@"; do
  if [[ $st == setup ]]; then
    setup || { say "setup failed: nothing after it can run"; exit 1; }
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee -a "$OUT/gpu_run.log"
    continue
  fi
  say "step $st ($(left) s left in this call)"
  "$(fn_of "$st")" || { say "step $st failed"; status=1; [[ $st == build ]] && break; }
done
say "done (status $status) after ${SECONDS} s; logs in $OUT"
exit $status
