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

from vllm_ir.testing import conformance_tests

globals().update(
    conformance_tests(
        "triton",
        small=True,
        examples=10,
        compiled="torch.compile over Triton kernels needs a GPU (fake tensors have no data for the interpreter)",
    )
)
