"""Provider ``oink``: KernelAgent-Oink's CuTeDSL RMSNorm kernels on NVIDIA Blackwell (SM100+) GPUs.

Oink (``kernelagent-oink``, from meta-pytorch/KernelAgent) registers two external custom ops
when ``kernelagent_oink.blackwell.oink_custom_ops`` is imported:

- ``torch.ops.oink.rmsnorm(x, weight, eps) -> Tensor``: ``x`` a 2-D ``[rows, hidden]`` view
  with a unit inner stride (a padded row stride is kept), ``weight`` 1-D;
- ``torch.ops.oink.fused_add_rms_norm(x, residual, weight, eps) -> None``: in place,
  ``residual <- x + residual`` and ``x <- RMSNorm(residual) * weight``.

Both are opaque custom ops with fakes, so a compiled graph keeps each call as one node.
Loading this module imports neither Oink nor CUDA: availability at load comes from torch's
build, a visible GPU and whether the packages can be found; the compute capability is asked
per device by the predicate (initializing CUDA at discovery would break forked workers), and
the vendor module is imported on the first real call.

No default priority: the kernels are tuned for SM100 and have not been measured by this
project; put ``oink`` first yourself (``VLLM_IR_OP_PRIORITY=rms_norm=oink``, or the config
file) on a Blackwell machine after ``vllm-ir bench`` shows it wins there.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor

import vllm_ir
from vllm_ir import Provider
from vllm_ir.ir.declarations.layernorm import variance_size_verdict, weight_dtype_verdict
from vllm_ir.plugins.provider import weight_or_ones

__version__ = "0.1.0"
PROVIDER = "oink"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Oink's kernels target Blackwell: compute capability 10.0 and newer.
MIN_SM = 100
#: Oink loads rows in 256-bit vectors: a row stride must be a multiple of 32 bytes.
VECTOR_BYTES = 32


def availability() -> bool | vllm_ir.Unsupported:
    """Supported with a CUDA build of torch, a visible GPU, and Oink and CuTeDSL importable."""
    if torch.version.cuda is None:
        build = "a ROCm" if torch.version.hip is not None else "a CPU"
        return vllm_ir.Unsupported(f"torch is {build} build; Oink needs CUDA on an SM100+ (Blackwell) GPU")
    if not torch.cuda.is_available():
        return vllm_ir.Unsupported("no CUDA GPU is visible")
    if importlib.util.find_spec("kernelagent_oink") is None:
        return vllm_ir.Unsupported("kernelagent-oink not installed")
    if importlib.util.find_spec("cutlass") is None:
        return vllm_ir.Unsupported("nvidia-cutlass-dsl (CuTeDSL) not installed; Oink's kernels need it")
    return True


@functools.cache
def compute_capability(index: int) -> int:
    """``10 * major + minor`` of CUDA device ``index`` (asked once per device)."""
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def _on_blackwell(x: Tensor) -> bool | vllm_ir.Unsupported:
    if x.device.type != "cuda":
        return vllm_ir.Unsupported(f"tensors are on {x.device.type}; Oink runs on CUDA GPUs")
    sm = compute_capability(x.device.index or 0)
    if sm < MIN_SM:
        return vllm_ir.Unsupported(f"{x.device} is SM{sm}; Oink's kernels need SM{MIN_SM}+ (Blackwell)")
    return True


def row_stride(x: Tensor) -> int | None:
    """The row stride of ``x`` viewed as ``[rows, hidden]`` without a copy, or None if it cannot be."""
    if x.dim() < 2:
        return None
    for d in range(x.dim() - 2):  # every leading dimension must step over whole rows of the next
        if x.size(d + 1) != 1 and x.stride(d) != x.stride(d + 1) * x.size(d + 1):
            return None
    return x.stride(-2)


def rules(x: Tensor, weight: Tensor | None, variance_size: int | None) -> bool | vllm_ir.Unsupported:
    """The argument rules, independent of the device (unit-tested on CPU tensors)."""
    if not (verdict := variance_size_verdict(variance_size)):
        return verdict
    if x.dtype not in DTYPES:
        return vllm_ir.Unsupported(f"Oink RMSNorm takes float16/bfloat16/float32, not {x.dtype}")
    if not (verdict := weight_dtype_verdict(x, weight)):
        return verdict
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != x.shape[-1] or not weight.is_contiguous()):
        return vllm_ir.Unsupported("weight must be a contiguous 1-D [hidden] tensor")
    if x.dim() < 2:
        return vllm_ir.Unsupported(f"Oink takes [rows, hidden]; a {x.dim()}-D input has no rows")
    stride = row_stride(x)
    if stride is None:
        return vllm_ir.Unsupported("input cannot be viewed as [rows, hidden] without a copy (e.g. a per-head view)")
    if x.stride(-1) != 1:
        return vllm_ir.Unsupported("the hidden dimension must be contiguous (stride 1)")
    multiple = VECTOR_BYTES // x.element_size()
    if stride % multiple:
        return vllm_ir.Unsupported(
            f"row stride {stride} is not a multiple of {multiple} elements (Oink loads rows in 256-bit vectors)"
        )
    return True


def residual_rules(x: Tensor, x_residual: Tensor) -> bool | vllm_ir.Unsupported:
    """What ``fused_add_rms_norm`` asks before the device and `rules`."""
    # In place on both: contiguous buffers of one shape and dtype (a clone for the functional
    # overload is then contiguous too, and just as aligned).
    if x_residual.shape != x.shape or x_residual.dtype != x.dtype:
        return vllm_ir.Unsupported("residual must have x's shape and dtype")
    if not x.is_contiguous() or not x_residual.is_contiguous():
        return vllm_ir.Unsupported("x and residual must be contiguous (Oink adds and normalizes in place)")
    return True


@functools.cache
def _vendor_ops():
    """``torch.ops.oink`` after importing the module that registers it (first real call only)."""
    if torch.cuda.is_available() and "CUTE_DSL_ARCH" not in os.environ:
        major, minor = torch.cuda.get_device_capability()
        os.environ["CUTE_DSL_ARCH"] = f"sm_{major}{minor}{'a' if major >= 9 else ''}"  # as Oink's own plugin does
    import kernelagent_oink.blackwell.oink_custom_ops  # noqa: F401  (registers torch.ops.oink.*)

    return torch.ops.oink


SUPPORTED = availability()
#: The registration surface: unavailable with `availability`'s reason.
OINK = Provider(PROVIDER, available=SUPPORTED)


@OINK.impl("rms_norm", supports=(_on_blackwell, rules))
def rms_norm(x, weight, epsilon, variance_size=None):
    if x.numel() == 0:
        return torch.empty_like(x)
    rows = x.view(-1, x.shape[-1])  # a view: the predicate admits only inputs that flatten without a copy
    return _vendor_ops().rmsnorm(rows, weight_or_ones(x, weight), epsilon).view(x.shape)


@OINK.impl("fused_add_rms_norm", supports=(residual_rules, _on_blackwell, rules), inplace=True)
def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None):
    if x.numel():
        hidden = x.shape[-1]
        _vendor_ops().fused_add_rms_norm(
            x.view(-1, hidden), x_residual.view(-1, hidden), weight_or_ones(x, weight), epsilon
        )
    return x, x_residual
