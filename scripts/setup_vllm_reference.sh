#!/usr/bin/env bash
# The vLLM IR reference environment for benchmarks/dispatch_overhead.py (which finds it at
# build/vllm-reference by default) and benchmarks/vllm_reference.py: a separate venv holding
# the same torch CPU build as .venv and vLLM 0.33.0, whose `vllm.ir` is measured beside vllm_ir.
#
#   scripts/setup_vllm_reference.sh [DIR]      # DIR defaults to build/vllm-reference (git-ignored)
#
# vllm 0.33.0 is installed with --no-deps: its requirements pin torch==2.14.0 and CUDA-only
# packages (flashinfer, cutlass-dsl, ...), which would replace the torch build with a multi-GB
# CUDA one. `import vllm.ir` needs none of them: it runs vllm/__init__ -> env_override,
# envs, logger, logging_utils, utils.torch_version and vllm/ir itself, which import only torch,
# packaging (utils.torch_version) and regex (ir.op); numpy only silences torch's "Failed to
# initialize NumPy" warning, as in .venv. No compiled vLLM module (vllm._C) is loaded, and
# benchmarks/vllm_reference.py checks that. .venv is not touched. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DIR=${1:-build/vllm-reference}
TORCH_VERSION=2.13.0  # the CPU build on local disk, as in scripts/setup.sh; any other version downloads a CUDA build
VLLM_VERSION=0.33.0

if [ ! -x "$DIR/bin/python" ]; then
  "$PY" -m venv "$DIR"
fi
pip() { "$DIR/bin/python" -m pip --disable-pip-version-check -q "$@"; }

pip install "torch==${TORCH_VERSION}" packaging regex numpy
# Last, so that no later install reports vllm's deliberately missing requirements as conflicts.
pip install --no-deps "vllm==${VLLM_VERSION}"
"$DIR/bin/python" -c "
import sys, torch, vllm, vllm.ir
assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__
assert vllm.__version__ == '${VLLM_VERSION}', vllm.__version__
assert 'vllm._C' not in sys.modules
print(f'vLLM IR reference ready: {sys.executable} (vllm {vllm.__version__}, torch {torch.__version__})')
"
