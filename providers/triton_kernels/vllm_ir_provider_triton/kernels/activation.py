"""Gated activations in Triton: one program per (row, block of output columns).

The gate's activation is computed in fp32 and rounded to the output dtype before the
multiply, which is also computed in fp32 and rounded: the op's (eager PyTorch's) rounding
points, so results are bit-identical to native. Casts only at load/store and at that
rounding point (the Triton CPU interpreter's bf16 arithmetic yields NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

#: Output columns per program.
BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, out_row_stride, x_row_stride, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton_op("vllm_ir_triton::silu_and_mul_out", mutates_args={"out"})
def silu_and_mul_out(out: Tensor, x: Tensor) -> None:
    """``out = silu_and_mul(x)`` for ``x`` viewed as rows (contiguous, or 2-D with unit inner stride)."""
    d = out.shape[-1]
    rows = out.numel() // d if d else 0
    if rows == 0:
        return
    x_stride = x.stride(-2) if x.dim() >= 2 else x.shape[-1]
    out_stride = out.stride(-2) if out.dim() >= 2 else d
    grid = (rows, triton.cdiv(d, BLOCK))
    wrap_triton(_silu_and_mul_kernel)[grid](out, x, out_stride, x_stride, d, BLOCK=BLOCK)


__all__ = ["silu_and_mul_out", "torch"]
