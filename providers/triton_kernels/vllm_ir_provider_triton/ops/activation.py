"""Gated activations (``silu_and_mul``) in Triton; the kernels are in ``kernels/activation.py``."""

from __future__ import annotations

import torch
from torch import Tensor

import vllm_ir
from vllm_ir_provider_triton import SUPPORTED, interpreting

PROVIDER = "triton"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def gated_supports(x: Tensor) -> bool | vllm_ir.Unsupported:
    """A row layout the kernel indexes: even last dimension, contiguous or unit-inner-stride 2-D rows."""
    if x.dtype not in _DTYPES:
        return vllm_ir.Unsupported(f"dtype {x.dtype} is not one of float32, float16, bfloat16")
    if x.dim() == 0:
        return vllm_ir.Unsupported("x is 0-d")
    if x.shape[-1] % 2:
        return vllm_ir.Unsupported(f"last dimension {x.shape[-1]} is odd (gate and up halves differ in size)")
    if not x.is_contiguous() and not (x.dim() == 2 and x.stride(-1) == 1):
        return vllm_ir.Unsupported("x must be contiguous, or 2-D rows with a unit inner stride")
    if x.device.type == "cpu" and not interpreting():
        return vllm_ir.Unsupported("CPU tensors need TRITON_INTERPRET=1")
    if x.device.type not in ("cpu", "cuda", "xpu"):
        return vllm_ir.Unsupported(f"x is on {x.device.type}; Triton runs on GPUs (or CPU when interpreting)")
    return True


if SUPPORTED:
    from vllm_ir_provider_triton.kernels.activation import silu_and_mul_out

    @vllm_ir.ops.silu_and_mul.register_impl(PROVIDER, supports_args=gated_supports)
    def silu_and_mul(x):
        out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
        silu_and_mul_out(out, x)
        return out

else:
    vllm_ir.ops.silu_and_mul.register_unsupported(PROVIDER, SUPPORTED)
