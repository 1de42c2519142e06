"""TEST DOUBLE: registers ``torch.ops._C.rms_norm`` / ``fused_add_rms_norm`` with recording CPU kernels."""

from __future__ import annotations

import torch

CALLS: list[dict] = []
_lib = torch.library.Library("_C", "FRAGMENT")
_lib.define("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float epsilon) -> ()")
_lib.define("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float epsilon) -> ()")


def _normalized(x32: torch.Tensor, dtype: torch.dtype, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + epsilon)).to(dtype) * weight


def _rms_norm(out, input, weight, epsilon):
    CALLS.append({"fn": "rms_norm", "out": out, "input": input, "weight": weight, "epsilon": epsilon})
    out.copy_(_normalized(input.float(), input.dtype, weight, epsilon))


def _fused_add_rms_norm(input, residual, weight, epsilon):
    CALLS.append(
        {"fn": "fused_add_rms_norm", "input": input, "residual": residual, "weight": weight, "epsilon": epsilon}
    )
    total = input.float() + residual.float()
    residual.copy_(total)
    input.copy_(_normalized(total, input.dtype, weight, epsilon))


_lib.impl("rms_norm", _rms_norm, "CPU")
_lib.impl("fused_add_rms_norm", _fused_add_rms_norm, "CPU")
