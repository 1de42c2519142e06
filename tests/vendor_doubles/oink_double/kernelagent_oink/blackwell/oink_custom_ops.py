"""TEST DOUBLE: ``torch.ops.oink.rmsnorm`` / ``fused_add_rms_norm`` as recording CPU kernels (not Oink).

Same names, schemas and layout contract as Oink's ops (2-D ``[M, N]`` views with a unit
inner stride, a padded row stride kept in the output, a 1-D weight; the fused op mutates x
and residual and returns nothing); computed with plain torch on CPU. It says nothing about
Oink's numerics or speed.
"""

from __future__ import annotations

import torch

from kernelagent_oink import CALLS


def _check_rows(name: str, x: torch.Tensor) -> None:
    assert x.dim() == 2, f"oink::{name} expects a 2D [M, N] tensor view"
    assert x.stride(1) == 1, f"oink::{name} expects a unit inner stride"


def _normalized(x32: torch.Tensor, dtype: torch.dtype, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype) * weight


@torch.library.custom_op("oink::rmsnorm", mutates_args=())
def oink_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    CALLS.append({"fn": "rmsnorm", "x": x, "weight": weight, "eps": eps})
    _check_rows("rmsnorm", x)
    assert weight.dim() == 1, "weight must be 1D [N]"
    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)  # keeps the row stride
    out.copy_(_normalized(x.float(), x.dtype, weight, eps))
    return out


@oink_rmsnorm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)


@torch.library.custom_op("oink::fused_add_rms_norm", mutates_args=("x", "residual"))
def oink_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    CALLS.append({"fn": "fused_add_rms_norm", "x": x, "residual": residual, "weight": weight, "eps": eps})
    _check_rows("fused_add_rms_norm", x)
    assert x.shape == residual.shape and x.dtype == residual.dtype, "x and residual must match"
    assert weight.dim() == 1, "weight must be 1D [N]"
    total = x.float() + residual.float()
    residual.copy_(total)
    x.copy_(_normalized(total, x.dtype, weight, eps))


@oink_fused_add_rms_norm.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    return None
