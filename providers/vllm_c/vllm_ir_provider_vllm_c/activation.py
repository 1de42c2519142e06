"""The gated-activation family: ``silu_and_mul`` (csrc/cpu/activation.cpp; no CUDA kernel yet).

The predicate says why a call is declined; it reads dtypes, devices, the last dimension and
its stride, never the batch size or values.
"""

from __future__ import annotations

import torch
from torch import Tensor

import vllm_ir
from vllm_ir import Unsupported

from ._extension import PROVIDER, ExtensionStatus, compile_facts, supported, torch_op

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: CPU only (no CUDA kernel yet). Measured against native (2 threads, d = 8192, median µs):
#: fp32 1.35-10x faster at T 1-2048; bf16 0.95-1.7x (even at T 16-256, ahead at 1 and 2048).
EAGER_FIRST = {"cpu": ("silu_and_mul",)}


def register(status: ExtensionStatus) -> None:
    """Register the implementation; unsupported with the load failure's reason if not loaded."""
    if status.loaded:

        @torch.library.register_fake("vllm_ir_c::silu_and_mul")
        def _silu_and_mul_fake(out, input):
            return None

    kernel = torch_op(status, "silu_and_mul")

    def supports(x: Tensor) -> bool | Unsupported:
        if x.dtype not in DTYPES:
            return Unsupported(f"dtype {x.dtype} is not supported (float32, bfloat16, float16)")
        if x.device.type != "cpu":
            return Unsupported(f"device {x.device.type} is not supported (CPU kernel only)")
        if x.dim() == 0:
            return Unsupported("x is 0-d")
        if x.shape[-1] % 2:
            return Unsupported(f"last dimension {x.shape[-1]} is odd (gate and up halves differ in size)")
        if x.stride(-1) != 1 and x.size(-1) != 1:
            return Unsupported(f"x has stride {x.stride(-1)} along the last dimension (the kernel needs 1)")
        return True

    # The kernel computes each element independently: results never depend on the batch.
    @vllm_ir.ops.silu_and_mul.register_impl(
        PROVIDER,
        supported=supported(status),
        supports_args=supports,
        batch_invariant=True,
        compile_facts=compile_facts(status),
    )
    def silu_and_mul(x):
        out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
        kernel(out, x)
        return out
