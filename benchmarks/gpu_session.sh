#!/usr/bin/env bash
# Everything a lent GPU machine should run, in one go: install the repo into that machine's
# own torch (no pinned CPU torch there), build vllm_c's CUDA kernels for this GPU only, then
# the correctness checks and figures that README quotes. Each step has its own time limit
# and writes its output under $OUT, so a step that fails or overruns does not cost the rest.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh > /tmp/gpu/session.log 2>&1   # repo root, GPU machine
#   STEPS="kit_vllm_c bench" BENCH_OPS="static_quant_fp8" ...   # a rerun of some steps only
set -uo pipefail
OUT=${OUT:-/tmp/vllm_ir_gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} VLLM_IR_C_STRICT_BUILD=1
# This GPU's architecture only, and one CPU variant besides DEFAULT: the build is the
# slowest step and the CPU kernels are not what this session measures.
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$($PY -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')}
export TORCH_CUDA_ARCH_LIST VLLM_IR_C_CPU_CAPABILITIES=${VLLM_IR_C_CPU_CAPABILITIES:-none}
# The whole session ends by TOTAL_S (a lease is short); each step gets its own limit or what is left.
END=$(($(date +%s) + ${TOTAL_S:-540}))

step() { echo "=== $1 ($(date +%T))"; }
# At most 8 files come back from a lent machine: every step's text goes to $OUT/session.log
# (run the script with its output there), the kit and bench write JSON beside it.
run() {  # run LIMIT_S NAME COMMAND...
  local limit=$1 name=$2 left=$((END - $(date +%s)))
  shift 2
  ((left < limit)) && limit=$left
  ((limit < 10)) && { echo "=== $name: skipped, the session's time is up"; return; }
  [[ -n "${STEPS:-}" && " $STEPS build_vllm_c " != *" $name "* ]] && return
  step "$name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1
  echo "=== $name: exit $?"
}

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'

step "install"
for dir in . providers/native providers/triton_kernels; do
  $PY -m pip install -q --no-deps --no-build-isolation -e "$dir" 2>&1 | tail -20
done
run 300 build_vllm_c $PY -m pip install --no-deps --no-build-isolation -e providers/vllm_c
$PY -m vllm_ir providers list

run 90 vllm_c_cuda_check $PY benchmarks/vllm_c_cuda_check.py --no-build
run 90 triton_gpu_check $PY benchmarks/triton_gpu_check.py
# The kit from outside the repo (its pytest settings would collect the repo's own tests too),
# on 8 pytest-xdist workers: faster, and a kernel that crashes its process fails one test.
for provider in vllm_c triton; do
  (cd "$(mktemp -d)" && run "${KIT_LIMIT_S:-150}" "kit_$provider" $PY -m pytest -q -p no:cacheprovider \
    -n "${KIT_WORKERS:-8}" -p no:benchmark --tb=short -rfE --vllm-ir-conformance --vllm-ir-provider "$provider" \
    --vllm-ir-device cuda --vllm-ir-examples 5 --vllm-ir-report "$OUT/kit_$provider.json")
done
run "${BENCH_LIMIT_S:-120}" bench $PY -m vllm_ir bench --device cuda --providers native,vllm_c,triton,aten \
  --dtype bfloat16 --tokens 1,256,4096 --rounds 3 --json "$OUT/bench.json" \
  ${BENCH_OPS:-rms_norm fused_add_rms_norm silu_and_mul gelu_and_mul rotary_embedding \
  static_quant_fp8 dynamic_quant_fp8 dynamic_group_quant_fp8}
step "done"
