"""Gated activations: ``[..., 2d] -> [..., d]``, the MLP's nonlinearity times its up projection.

The first half of the last dimension is the gate, the second half the "up" value (vLLM's
layout for merged gate/up projections). Rounding follows eager PyTorch, as vLLM's CUDA
kernels do: the activation is computed in float32 and rounded to x's dtype, then multiplied
in x's dtype — so a kernel that keeps float32 through the multiply differs by ~1 ulp, which
the default tolerances allow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_ir.ir.op import register_op


@register_op
def silu_and_mul(x: Tensor) -> Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` where ``d = x.shape[-1] // 2`` (SwiGLU)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _gated_inputs(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, seed: int = 0) -> tuple[Tensor]:
    """``x`` of shape ``[*shape[:-1], 2 * shape[-1]]`` (``shape`` names the output), ~ N(0, 2)."""
    g = torch.Generator().manual_seed(seed)
    x = 2.0 * torch.randn((*shape[:-1], 2 * shape[-1]), generator=g, dtype=torch.float32)
    return (x.to(device=device, dtype=dtype),)


silu_and_mul.input_generator(_gated_inputs)
