"""The Triton kernels and their ``torch.library.triton_op`` wrappers (imported only when usable)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

# Rounding points as the other kernels take them (bf16 bit for bit in the CPU interpreter too).
from vllm_ir_provider_triton.kernels.activation import _cast, _round


@triton.jit
def _weighted(normed, w_ptr, cols, mask, HAS_WEIGHT: tl.constexpr):
    """vLLM's ``normed.to(weight.dtype) * weight`` in fp32 arithmetic: rounded to the weight's
    dtype, multiplied, rounded again (no-ops for an fp32 weight); the caller casts to x's dtype."""
    if HAS_WEIGHT:
        W_DTYPE: tl.constexpr = w_ptr.dtype.element_ty
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        normed = _round(_round(normed, W_DTYPE) * w, W_DTYPE)
    return normed


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    x_ptr,
    w_ptr,
    out_row_stride,
    x_row_stride,
    n_cols,
    eps,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    y = _weighted(x * rstd, w_ptr, cols, mask, HAS_WEIGHT)
    tl.store(out_ptr + row * out_row_stride + cols, _cast(y, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    x_row_stride,
    r_row_stride,
    n_cols,
    eps,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * r_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    s = x + r
    tl.store(r_ptr + row * r_row_stride + cols, _cast(s, r_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / n_cols + eps)
    y = _weighted(s * rstd, w_ptr, cols, mask, HAS_WEIGHT)
    tl.store(x_ptr + row * x_row_stride + cols, _cast(y, x_ptr.dtype.element_ty), mask=mask)


def _rows(t: Tensor) -> tuple[int, int]:
    """(number of rows, row stride) of a tensor viewed as [rows, hidden]."""
    hidden = t.shape[-1]
    rows = t.numel() // hidden if hidden else 0
    return rows, (t.stride(-2) if t.dim() >= 2 else hidden)


def _block(hidden: int) -> int:
    return max(triton.next_power_of_2(hidden), 16)


@triton_op("vllm_ir_triton::rms_norm_out", mutates_args={"out"})
def rms_norm_out(out: Tensor, x: Tensor, weight: Tensor | None, epsilon: float) -> None:
    rows, x_stride = _rows(x)
    if rows == 0 or x.shape[-1] == 0:
        return
    _, out_stride = _rows(out)
    wrap_triton(_rms_norm_kernel)[(rows,)](
        out, x, weight if weight is not None else x, out_stride, x_stride, x.shape[-1], epsilon,
        HAS_WEIGHT=weight is not None, BLOCK=_block(x.shape[-1]),
    )  # fmt: skip


@triton_op("vllm_ir_triton::fused_add_rms_norm_", mutates_args={"x", "residual"})
def fused_add_rms_norm_(x: Tensor, residual: Tensor, weight: Tensor | None, epsilon: float) -> None:
    rows, x_stride = _rows(x)
    if rows == 0 or x.shape[-1] == 0:
        return
    _, r_stride = _rows(residual)
    wrap_triton(_fused_add_rms_norm_kernel)[(rows,)](
        x, residual, weight if weight is not None else x, x_stride, r_stride, x.shape[-1], epsilon,
        HAS_WEIGHT=weight is not None, BLOCK=_block(x.shape[-1]),
    )  # fmt: skip


__all__ = ["fused_add_rms_norm_", "rms_norm_out", "torch"]
