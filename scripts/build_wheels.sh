#!/usr/bin/env bash
# Build a wheel of every distribution in this repository into dist/ (or $1).
# Uses the current environment's torch (--no-build-isolation): the vllm_c wheel then holds
# an extension compiled for exactly that torch, and no other torch is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-dist}
mkdir -p "$OUT"
for dir in . providers/*/ examples/*/; do
  if [ -f "$dir/pyproject.toml" ]; then
    echo "building $dir" >&2
    # A scratch copy keeps build/ and *.egg-info out of the source tree and out of the wheel.
    scratch=$(mktemp -d)
    if [ "$dir" = "." ]; then
      tar --exclude=./.venv --exclude=./.git --exclude=./dist --exclude=./providers --exclude=./examples \
          --exclude='*.egg-info' --exclude=__pycache__ --exclude=./build --exclude='*.so' -cf - . \
        | tar -xf - -C "$scratch"
    else
      tar -C "$dir" --exclude=build --exclude='*.egg-info' --exclude=__pycache__ --exclude='*.so' -cf - . \
        | tar -xf - -C "$scratch"
    fi
    # Released wheels must hold the core's compiled lookup: a failed build is an error here.
    VLLM_IR_BUILD_EXTENSION=1 MAX_JOBS=${MAX_JOBS:-2} "$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$OUT" "$scratch"
    rm -rf "$scratch"
  fi
done
ls -1 "$OUT"/*.whl
