"""``vllm_ir_aiter::*`` custom ops: each AITER call is one opaque node for the compiler.

Targets AITER's long-standing public entry points (present since 2024 and used by vLLM's
ROCm path; checked against ROCm/aiter ``aiter/ops/rmsnorm.py`` as of 2026):

- ``aiter.rmsnorm2d_fwd(input, weight, epsilon, use_model_sensitive_rmsnorm=0) -> Tensor``
- ``aiter.rmsnorm2d_fwd_with_add(out, input, residual_in, residual_out, weight, epsilon, ...)``
  (writes ``out`` and ``residual_out``).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def _aiter():
    import aiter  # imported on first real call only: never at provider discovery

    return aiter


@functools.cache
def _ones(hidden: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """AITER always multiplies by a weight: a cached ones vector stands for ``weight=None``."""
    return torch.ones(hidden, dtype=dtype, device=device)


def _weight(x: Tensor, weight: Tensor | None) -> Tensor:
    return weight if weight is not None else _ones(x.shape[-1], x.dtype, x.device)


@torch.library.custom_op("vllm_ir_aiter::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float) -> Tensor:
    rows = x.reshape(-1, x.shape[-1])  # a view: the predicate only admits inputs that flatten without a copy
    return _aiter().rmsnorm2d_fwd(rows, _weight(x, weight), epsilon).view(x.shape)


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor | None, epsilon: float) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("vllm_ir_aiter::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor | None, epsilon: float) -> tuple[Tensor, Tensor]:
    rows = x.reshape(-1, x.shape[-1])
    residual_rows = residual.reshape(-1, x.shape[-1])
    out = torch.empty_like(rows, memory_format=torch.contiguous_format)
    residual_out = torch.empty_like(residual_rows)
    _aiter().rmsnorm2d_fwd_with_add(out, rows, residual_rows, residual_out, _weight(x, weight), epsilon)
    return out.view(x.shape), residual_out.view(x.shape)


@fused_add_rms_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor | None, epsilon: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(residual)
