"""RMSNorm / SwiGLU fused with FP8 quant: ``rms_norm_static_fp8_quant``,
``fused_add_rms_norm_static_fp8_quant``, ``rms_norm_dynamic_per_token_fp8_quant``,
``rms_norm_group_fp8_quant``, ``silu_and_mul_static_fp8_quant`` and
``silu_and_mul_group_fp8_quant`` (csrc/cpu/fused_quant.cpp, numerics in csrc/fused_quant.h;
the two group ops also csrc/cuda/fused_quant.cu, the others CPU only).

One pass over each row's memory: norm, weight, scale and fp8 encoding in registers, from the
same building blocks as the norm and quant kernels (csrc/cpu/norm_vec.h, fp8_vec.h), so the
results round where native rounds (the sum of squares is summed in another order, see below).
``fused_add_rms_norm_static_fp8_quant`` and the dynamic and group norm ops with a residual
also register an in-place form (``maybe_inplace``) that writes the new residual into ``x_residual``.

The predicates read dtypes, devices, ranks, the hidden size, the last dimension's stride and
the static scale's element count (the scale is no token parameter: its whole shape keys the
decision cache), never the token count or values. They decline what native handles and the
kernels do not: other dtypes, a weight of a third dtype, per-token / per-channel / group
static scales, devices without kernels, fp8 dtypes other than e4m3fn/e4m3fnuz, group sizes
below 1. The group kernels quantize each group exactly as ``dynamic_group_quant_fp8``'s
kernel does (same scale, UE8M0 and floor arithmetic; scales written row- or column-major as
native lays them out).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_ir import Unsupported
from vllm_ir.ir.declarations.fused_quant import FUSED_QUANT_OPS
from vllm_ir.plugins.provider import empty_group_scales

from ._extension import STATUS, VLLM_C, devices, torch_op

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
#: The eager default on a CPU no shipped table was measured on (tuning/*.json decides where one
#: was): `vllm-ir bench --quick` on a 2-vCPU AVX-512 AMD EPYC measured vllm_c 4-12x faster than
#: native for all six (issue 33: rms_norm_static_fp8_quant bf16 T=16 12.9 against 87.9 us).
EAGER_FIRST = {"cpu": tuple(op.name for op in FUSED_QUANT_OPS)}


_static = torch_op(STATUS, "rms_norm_static_fp8_quant")
_add_static = torch_op(STATUS, "fused_add_rms_norm_static_fp8_quant")
_dynamic = torch_op(STATUS, "rms_norm_dynamic_per_token_fp8_quant")
_silu = torch_op(STATUS, "silu_and_mul_static_fp8_quant")
_group_kernel = torch_op(STATUS, "rms_norm_group_fp8_quant")
_silu_group = torch_op(STATUS, "silu_and_mul_group_fp8_quant")
GROUP_DEVICES = devices(STATUS)  # CPU, and CUDA where the CUDA sources were built
# Each row is computed from its own values in a fixed order whatever the batch. Not exact: the
# sum of squares is vectorized (another summation order than native's mean), which can move the
# inverse RMS by an ulp; bf16/fp16 rounding and fp8 encoding usually hide it, but a float32
# row's dynamic scale shows it.
OPTIONS = {"batch_invariant": True}


def supports_add_static(x, x_residual, weight, scale, fp8_dtype) -> bool | Unsupported:
    return _first(_common(x, x_residual, weight, fp8_dtype), _static_scale(x, scale))


def supports_static(x, weight, scale, fp8_dtype) -> bool | Unsupported:
    return supports_add_static(x, None, weight, scale, fp8_dtype)


def supports_dynamic(x, x_residual, weight, fp8_dtype, scale_ub) -> bool | Unsupported:
    verdict = _common(x, x_residual, weight, fp8_dtype)
    if verdict is None and scale_ub is not None:
        if scale_ub.dtype != torch.float32 or scale_ub.device != x.device or scale_ub.numel() != 1:
            verdict = Unsupported(
                f"scale_ub must be one float32 element on x's device, got {scale_ub.dtype} "
                f"{list(scale_ub.shape)} on {scale_ub.device}"
            )
        elif scale_ub.dim() > 1:
            verdict = Unsupported(f"scale_ub is {scale_ub.dim()}-D (native broadcasts the scale's shape to it)")
    return True if verdict is None else verdict


def supports_silu(x, scale, fp8_dtype) -> bool | Unsupported:
    verdict = _common(x, None, None, fp8_dtype)
    if verdict is None and x.shape[-1] % 2:
        verdict = Unsupported(f"the last dimension ({x.shape[-1]}) is odd (native's halves do not match)")
    return _first(verdict, _static_scale(x, scale))


def supports_group(x, x_residual, weight, group_size, column_major, fp8_dtype) -> bool | Unsupported:
    return _first(_common(x, x_residual, weight, fp8_dtype, GROUP_DEVICES), _group(x, group_size, column_major))


def supports_silu_group(x, group_size, column_major, fp8_dtype) -> bool | Unsupported:
    verdict = _common(x, None, None, fp8_dtype, GROUP_DEVICES)
    if verdict is None and x.shape[-1] % 2:
        verdict = Unsupported(f"the last dimension ({x.shape[-1]}) is odd (native's halves do not match)")
    return _first(verdict, _group(x, group_size, column_major))


@VLLM_C.impl("silu_and_mul_static_fp8_quant", supports=supports_silu, **OPTIONS)
def silu_and_mul_static_fp8_quant(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=fp8_dtype, device=x.device)
    _silu(out, x, scale)
    return out


@VLLM_C.impl("rms_norm_static_fp8_quant", supports=supports_static, **OPTIONS)
def rms_norm_static_fp8_quant(
    x: Tensor, weight: Tensor | None, epsilon: float, scale: Tensor, fp8_dtype: torch.dtype
) -> Tensor:
    out = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    _static(out, x, weight, scale, epsilon)
    return out


@VLLM_C.impl("fused_add_rms_norm_static_fp8_quant", supports=supports_add_static, **OPTIONS)
def fused_add_rms_norm_static_fp8_quant(x, x_residual, weight, epsilon, scale, fp8_dtype, inplace=False):
    # In place, the new residual goes into x_residual; q always has its own (fp8) buffer.
    out = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    residual = x_residual if inplace else torch.empty_like(x)
    _add_static(out, residual, x, x_residual, weight, scale, epsilon)
    return out, residual


@VLLM_C.impl("rms_norm_dynamic_per_token_fp8_quant", supports=supports_dynamic, **OPTIONS)
def rms_norm_dynamic_per_token_fp8_quant(x, x_residual, weight, epsilon, fp8_dtype, scale_ub=None, inplace=False):
    out = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scales = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    residual = None if x_residual is None else (x_residual if inplace else torch.empty_like(x))
    _dynamic(out, scales, residual, x, x_residual, weight, scale_ub, epsilon)
    return out, scales, residual


@VLLM_C.impl("rms_norm_group_fp8_quant", supports=supports_group, **OPTIONS)
def rms_norm_group_fp8_quant(
    x, x_residual, weight, epsilon, group_size, column_major, use_ue8m0, fp8_dtype, inplace=False
):
    out = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scales = empty_group_scales(x.shape, group_size, column_major, x.device)
    residual = None if x_residual is None else (x_residual if inplace else torch.empty_like(x))
    _group_kernel(out, scales, residual, x, x_residual, weight, group_size, use_ue8m0, epsilon)
    return out, scales, residual


@VLLM_C.impl("silu_and_mul_group_fp8_quant", supports=supports_silu_group, **OPTIONS)
def silu_and_mul_group_fp8_quant(
    x: Tensor, group_size: int, column_major: bool, use_ue8m0: bool, fp8_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    shape = (*x.shape[:-1], x.shape[-1] // 2)
    out = torch.empty(shape, dtype=fp8_dtype, device=x.device)
    scales = empty_group_scales(shape, group_size, column_major, x.device)
    _silu_group(out, scales, x, group_size, use_ue8m0)
    return out, scales


def _first(*verdicts: Unsupported | None) -> bool | Unsupported:
    for verdict in verdicts:
        if verdict is not None:
            return verdict
    return True


def _common(
    x: Tensor,
    x_residual: Tensor | None,
    weight: Tensor | None,
    fp8_dtype: torch.dtype,
    device_types: tuple[str, ...] = ("cpu",),
) -> Unsupported | None:
    if fp8_dtype not in FP8_DTYPES:
        return Unsupported(f"fp8_dtype {fp8_dtype} is not supported (float8_e4m3fn, float8_e4m3fnuz)")
    if x.dtype not in DTYPES:
        return Unsupported(f"dtype {x.dtype} is not supported (float32, bfloat16, float16)")
    if x.device.type not in device_types:
        return Unsupported(
            f"device {x.device.type} is not supported (this fused kernel is built for: {', '.join(device_types)})"
        )
    if x.dim() == 0:
        return Unsupported("x is 0-d (the kernels normalize over a last dimension)")
    if x.stride(-1) != 1 and x.size(-1) != 1:
        return Unsupported(f"x has stride {x.stride(-1)} along the last dimension (the kernels need 1)")
    if x_residual is not None:
        if x_residual.dtype != x.dtype or x_residual.device != x.device or x_residual.shape != x.shape:
            return Unsupported(
                f"x_residual ({x_residual.dtype}, {list(x_residual.shape)}, {x_residual.device}) differs from x "
                f"({x.dtype}, {list(x.shape)}, {x.device}) (native broadcasts and promotes; the kernels do not)"
            )
        if x_residual.stride(-1) != 1 and x_residual.size(-1) != 1:
            return Unsupported(f"x_residual has stride {x_residual.stride(-1)} along the last dimension (need 1)")
    if weight is not None:
        if weight.dtype not in (x.dtype, torch.float32):
            return Unsupported(f"weight dtype {weight.dtype} is neither x's ({x.dtype}) nor float32")
        if weight.device != x.device:
            return Unsupported(f"weight is on {weight.device}, x on {x.device}")
        if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
            return Unsupported(f"weight of shape {list(weight.shape)} for rows of {x.shape[-1]} (native broadcasts)")
    return None


def _static_scale(x: Tensor, scale: Tensor) -> Unsupported | None:
    if scale.dtype != torch.float32 or scale.device != x.device:
        return Unsupported(f"scale must be float32 on x's device, got {scale.dtype} on {scale.device}")
    if scale.numel() != 1:
        return Unsupported(
            f"scale of shape {list(scale.shape)}: the fused kernels take a per-tensor scale (one element)"
        )
    return None


def _group(x: Tensor, group_size: int, column_major: bool) -> Unsupported | None:
    if group_size < 1:
        return Unsupported(f"group_size {group_size} < 1 (native raises)")
    if column_major and x.dim() < 2:
        return Unsupported("column_major scales of a 1-D x (native raises)")
    return None
