"""The conformance kit over providers/triton_kernels, run on CPU by the Triton interpreter.

Small shapes only: the interpreter executes each program in Python (~3 ms per 4096-row).
The compiled path (torch.compile over triton_op) needs a GPU and is checked by
benchmarks/triton_gpu_check.py on a lent GPU machine.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm_ir_provider_triton") is None or importlib.util.find_spec("triton") is None:
    pytest.skip("providers/triton_kernels or triton is not installed", allow_module_level=True)

# tests/conftest.py sets it for the whole session (Triton reads it once); this guards direct runs.
os.environ["TRITON_INTERPRET"] = "1"

import torch

from vllm_ir.ir.declarations.fused_quant import FUSED_QUANT_OPS
from vllm_ir.testing import conformance_tests

COMPILED = "torch.compile over Triton kernels needs a GPU (fake tensors have no data for the interpreter)"
#: The fused norm/SwiGLU + FP8 quant ops have many input variants: bfloat16 only (the dtype
#: whose roundings matter most; the kernels' dtype handling is shared with the ops above), the
#: focused checks on the default variant's layouts (the numerics grid covers every variant).
FUSED = frozenset(op.name for op in FUSED_QUANT_OPS)

globals().update(
    conformance_tests("triton", small=True, examples=10, compiled=COMPILED, ops=lambda name: name not in FUSED)
)
globals().update(
    conformance_tests(
        "triton",
        small=True,
        examples=4,
        dtypes=(torch.bfloat16,),
        compiled=COMPILED,
        ops=FUSED,
        label="fused_quant",
        focused_variants=False,
    )
)
