"""TEST DOUBLE of AMD AITER's RMSNorm entry points (not AITER): records calls, computes with torch."""

from __future__ import annotations

import torch

IS_TEST_DOUBLE = True
CALLS: list[dict] = []


def _normalize(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + epsilon)).to(x.dtype)
    return y * weight


def rmsnorm2d_fwd(input, weight, epsilon, use_model_sensitive_rmsnorm=0):
    CALLS.append({"fn": "rmsnorm2d_fwd", "input": input, "weight": weight, "epsilon": epsilon})
    assert input.dim() == 2, "AITER takes [rows, hidden]"
    return _normalize(input, weight, epsilon)


def rmsnorm2d_fwd_with_add(out, input, residual_in, residual_out, weight, epsilon, *args):
    CALLS.append(
        {"fn": "rmsnorm2d_fwd_with_add", "out": out, "input": input, "residual_in": residual_in,
         "residual_out": residual_out, "weight": weight, "epsilon": epsilon}
    )  # fmt: skip
    total = input.float() + residual_in.float()
    residual_out.copy_(total)
    out.copy_((total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + epsilon)).to(out.dtype) * weight)
