#!/usr/bin/env bash
# Set up a development environment from a fresh clone: .venv with the pinned CPU torch,
# the core and every in-repo provider installed editable. Idempotent and quick when done.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0  # the CPU build on local disk; any other version downloads a multi-GB CUDA build

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }

pip install --upgrade pip
pip install "torch==${TORCH_VERSION}"
# Build tools live in the venv: every package here is built with --no-build-isolation so
# that C++ extensions compile against the pinned torch instead of a freshly downloaded one.
pip install "setuptools>=77" wheel
pip install --no-build-isolation -e ".[dev]"
# Every in-repo provider and example platform, editable. A provider whose build fails must not
# stop the set-up: it then reports the reason in `vllm-ir providers list`.
for dir in providers/*/ examples/*/; do
  if [ -f "$dir/pyproject.toml" ]; then
    pip install --no-build-isolation -e "$dir" || echo "warning: could not install $dir" >&2
  fi
done
