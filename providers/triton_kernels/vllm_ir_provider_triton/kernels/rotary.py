"""The rotary embedding Triton kernel and its ``torch.library.triton_op`` wrapper (imported only when usable)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from vllm_ir.ir.declarations.rotary import check_token_counts


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype``'s precision (to nearest, ties to even), still fp32.

    bfloat16 is rounded on the bits: the interpreter's fp32 -> bf16 cast does not round to
    nearest (it differed from torch by an ulp), and the explicit form is exact on GPUs too.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _rotary_kernel(
    x_ptr,
    pos_ptr,
    cache_ptr,
    token_stride,
    head_stride,
    cache_stride,
    max_position,
    half,
    NEOX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per (token, head): rotate its ``2 * half`` leading channels in place."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    pos = tl.load(pos_ptr + token)
    pos = tl.where(pos < 0, pos + max_position, pos)
    i = tl.arange(0, BLOCK)
    mask = i < half
    cos = tl.load(cache_ptr + pos * cache_stride + i, mask=mask, other=0.0)
    sin = tl.load(cache_ptr + pos * cache_stride + half + i, mask=mask, other=0.0)
    dtype = cos.dtype
    cos = cos.to(tl.float32)
    sin = sin.to(tl.float32)
    base = x_ptr + token * token_stride + head * head_stride
    if NEOX:
        p1 = base + i
        p2 = base + half + i
    else:
        p1 = base + 2 * i
        p2 = base + 2 * i + 1
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    # The op's rounding points: each product in the dtype, then the sum (fp32 arithmetic in
    # between, which the interpreter needs: its bf16 arithmetic yields NaN).
    x1c = _round(x1 * cos, dtype)
    x2s = _round(x2 * sin, dtype)
    x2c = _round(x2 * cos, dtype)
    x1s = _round(x1 * sin, dtype)
    tl.store(p1, _round(x1c - x2s, dtype).to(dtype), mask=mask)
    tl.store(p2, _round(x2c + x1s, dtype).to(dtype), mask=mask)


def _heads_view(x: Tensor, tokens: int, head_size: int) -> tuple[Tensor, bool]:
    """``x`` as [tokens, heads, head_size] sharing its memory, else a contiguous copy (True)."""
    try:
        view = x.view(tokens, -1, head_size)
        if view.stride(-1) == 1 or head_size == 1:
            return view, False
    except RuntimeError:
        pass
    return x.reshape(tokens, -1, head_size).contiguous(), True


@triton_op("vllm_ir_triton::rotary_embedding_", mutates_args={"query", "key"})
def rotary_embedding_(
    positions: Tensor,
    query: Tensor,
    key: Tensor | None,
    head_size: int,
    cos_sin_cache: Tensor,
    is_neox: bool,
    rotary_dim: int,
) -> None:
    check_token_counts("vllm_ir_triton::rotary_embedding_", positions, query, key, head_size)
    tokens = positions.numel()
    if tokens == 0 or rotary_dim == 0:
        return
    pos = positions.reshape(-1).contiguous()
    rows = cos_sin_cache.shape[0]
    if pos.device.type == "cpu" and bool(((pos < -rows) | (pos >= rows)).any()):
        # The interpreter would read outside the cache; native raises an IndexError.
        raise IndexError(f"vllm_ir_triton::rotary_embedding_: a position is outside the cache's {rows} rows")
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = rotary_dim // 2
    for x in (query, key):
        if x is None:
            continue
        view, staged = _heads_view(x, tokens, head_size)
        wrap_triton(_rotary_kernel)[(tokens, view.shape[1])](
            view, pos, cache, view.stride(0), view.stride(1), cache.stride(0), cache.shape[0], half,
            NEOX=is_neox, BLOCK=max(triton.next_power_of_2(half), 16),
        )  # fmt: skip
        if staged:
            x.copy_(view.view(x.shape))


__all__ = ["rotary_embedding_", "torch"]
