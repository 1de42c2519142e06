"""An out-of-tree platform for vllm-ir, in one module.

Importing this module (vllm-ir does it through the ``vllm_ir.providers`` entry point)
registers the ``oot_example`` kernels; the ``@vllm_ir.hookimpl`` functions below claim the
platform, contribute default priorities and apply a site policy. The "device" is simulated:
the platform claims the process when ``VLLM_IR_OOT_PLATFORM=1`` (a real vendor would ask its
runtime, e.g. ``torch.my_device.is_available()``), and its kernels run on CPU tensors.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

import vllm_ir

PROVIDER = "oot_example"
ENV_DEVICE_PRESENT = "VLLM_IR_OOT_PLATFORM"

PLATFORM = vllm_ir.Platform(
    name="oot_example",
    device_type="cpu",
    defaults={
        "eager": {"rms_norm": [PROVIDER], "fused_add_rms_norm": [PROVIDER]},
        "compile": {"rms_norm": [PROVIDER], "fused_add_rms_norm": [PROVIDER]},
    },
)


def device_present() -> bool:
    return os.environ.get(ENV_DEVICE_PRESENT) == "1"


def _supports(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None):
    if variance_size is not None:
        return vllm_ir.Unsupported("oot_example kernels normalize over the full hidden size only")
    if weight is not None and weight.dtype != x.dtype:
        return vllm_ir.Unsupported(f"weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    return True


def _supports_fused(
    x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
):
    return _supports(x, weight, epsilon, variance_size)


_SUPPORTED = (
    True if device_present() else vllm_ir.Unsupported(f"oot_example device not present ({ENV_DEVICE_PRESENT}!=1)")
)


@vllm_ir.ops.rms_norm.register_impl(PROVIDER, supported=_SUPPORTED, supports_args=_supports)
def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    """RMSNorm as one fp32 pass: the variance via a single fused ``linalg.vector_norm`` reduction."""
    x32 = x.float()
    rms = torch.linalg.vector_norm(x32, dim=-1, keepdim=True) * x.shape[-1] ** -0.5
    out = (x32 / torch.sqrt(rms * rms + epsilon)).to(x.dtype)
    return out if weight is None else out * weight


@vllm_ir.ops.fused_add_rms_norm.register_impl(
    PROVIDER, supported=_SUPPORTED, supports_args=_supports_fused, inplace=True
)
def fused_add_rms_norm(
    x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> tuple[Tensor, Tensor]:
    """In place: ``x_residual <- x + x_residual`` and ``x <- rms_norm(sum)``; returns (x, x_residual)."""
    total = x.float() + x_residual.float()
    x_residual.copy_(total)
    variance = total.pow(2).mean(dim=-1, keepdim=True)
    x.copy_(total * torch.rsqrt(variance + epsilon))
    if weight is not None:
        x.mul_(weight)
    return x, x_residual


@vllm_ir.hookimpl
def vllm_ir_platform():
    """Claim the process when our device is present."""
    return PLATFORM if device_present() else None


@vllm_ir.hookimpl
def vllm_ir_environment_variables():
    """The variables this plugin reads, so ``vllm-ir doctor`` lists them instead of calling them unknown."""
    return {ENV_DEVICE_PRESENT: "1: the simulated oot_example device is plugged in (the platform claims the process)"}


@vllm_ir.hookimpl
def vllm_ir_default_priority(platform, mode):
    """The platform's own defaults come from PLATFORM.defaults; as a provider we add nothing elsewhere."""
    return None


@vllm_ir.hookimpl
def vllm_ir_adjust_priority(op_name, priority, platform, mode):
    """Site policy on our platform: Triton kernels are not validated here, so never use them by default."""
    if platform.name != PLATFORM.name or "triton" not in priority:
        return None
    return [p for p in priority if p != "triton"]
