"""Provider ``xpu_kernels``: Intel's vllm-xpu-kernels RMSNorm, activations, FP8 quantization and
rotary embedding (SYCL) on XPU devices.

Every op registers through `XPU` (a `vllm_ir.Provider`): the norms here, the activations in
``activation.py``, the FP8 quant ops in ``quant.py``, ``rotary_embedding`` in ``rotary.py``
(every public module of the package is imported).

``import vllm_xpu_kernels._C`` registers ``torch.ops._C.rms_norm(out, input, weight, eps)``
and ``torch.ops._C.fused_add_rms_norm(input, residual, weight, eps)`` (in place); they are
already opaque custom ops, so the lowering pass keeps each call as one node. The vendor
module is imported on first use only, never during provider discovery.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import Tensor

import vllm_ir
from vllm_ir import Provider
from vllm_ir.ir.declarations.layernorm import contiguous_residual_verdict, variance_size_verdict, weight_dtype_verdict
from vllm_ir.plugins.provider import import_families, weight_or_ones

__version__ = "0.1.0"
PROVIDER = "xpu_kernels"
#: What the activation, quant and rotary kernels take.
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def availability() -> bool | vllm_ir.Unsupported:
    xpu = getattr(torch, "xpu", None)
    if xpu is None or not xpu.is_available():
        return vllm_ir.Unsupported("no XPU device (torch.xpu is not available)")
    if importlib.util.find_spec("vllm_xpu_kernels") is None:
        return vllm_ir.Unsupported("vllm-xpu-kernels not installed")
    return True


@functools.cache
def _vendor_ops():
    import vllm_xpu_kernels._C  # noqa: F401  (registers torch.ops._C.*)

    return torch.ops._C


def _on_xpu(x: Tensor) -> bool | vllm_ir.Unsupported:
    if x.device.type != "xpu":
        return vllm_ir.Unsupported(f"tensors are on {x.device.type}; vllm-xpu-kernels runs on XPU")
    return True


def rules(x: Tensor, weight: Tensor | None, variance_size: int | None) -> bool | vllm_ir.Unsupported:
    """``rms_norm``'s predicate: the device, then the argument rules (unit-tested on CPU tensors,
    the device check stood in for)."""
    if not (verdict := _on_xpu(x) and variance_size_verdict(variance_size) and weight_dtype_verdict(x, weight)):
        return verdict
    if not x.is_contiguous():
        return vllm_ir.Unsupported("input must be contiguous (the kernel would copy it)")
    return True


SUPPORTED = availability()
#: The registration surface of every family: unavailable with `availability`'s reason.
XPU = Provider(PROVIDER, available=SUPPORTED)


@XPU.impl("rms_norm", supports=rules)
def rms_norm(x, weight, epsilon, variance_size=None):
    out = torch.empty_like(x)
    _vendor_ops().rms_norm(out, x, weight_or_ones(x, weight), epsilon)
    return out


@XPU.impl("fused_add_rms_norm", supports=(contiguous_residual_verdict, rules), inplace=True)
def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None):
    _vendor_ops().fused_add_rms_norm(x, x_residual, weight_or_ones(x, weight), epsilon)
    return x, x_residual


@vllm_ir.hookimpl
def vllm_ir_default_priority(platform, mode):
    """On XPU in eager mode, ``xpu_kernels`` first for every op it implements."""
    if platform.name == "xpu" and mode == "eager":
        return {op: [PROVIDER] for op in vllm_ir.ops_implemented_by(PROVIDER)}
    return None


#: The op family modules (every public module of this package), each registered through `XPU`.
FAMILIES = import_families(__name__, __path__)

__all__ = ["activation", "quant", "rotary"]
