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

from vllm_ir.ir.declarations.fused_quant import (
    FUSED_QUANT_OPS,
    halves_verdict,
    per_tensor_scale_verdict,
)
from vllm_ir.ir.declarations.layernorm import residual_verdict, weight_verdict
from vllm_ir.ir.declarations.quant import column_major_verdict, fp8_verdict, group_size_verdict, scale_ub_verdict
from vllm_ir.plugins.provider import empty_group_scales

from ._extension import DEVICES, STATUS, VLLM_C, residual_stride_verdict, rows_on, torch_op

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
# Each row is computed from its own values in a fixed order whatever the batch. Not exact: the
# sum of squares is vectorized (another summation order than native's mean), which can move the
# inverse RMS by an ulp; bf16/fp16 rounding and fp8 encoding usually hide it, but a float32
# row's dynamic scale shows it.
OPTIONS = {"batch_invariant": True}


#: The four ops on one tensor of rows and a per-tensor scale have CPU kernels only; the group
#: ops CUDA ones too, where the CUDA sources were built.
X_ON_CPU, X_ON_GROUP_DEVICES = rows_on(("cpu",)), rows_on(DEVICES)


#: The checks of an optional residual, in the order every norm op asks them.
RESIDUAL = (residual_verdict, residual_stride_verdict)


def _fused(op: str, *checks):
    """Register a kernel binding of ``op``, supported where the fp8 dtype and then each check hold."""
    return VLLM_C.impl(op, supports=(fp8_verdict, *checks), **OPTIONS)


@_fused("silu_and_mul_static_fp8_quant", X_ON_CPU, halves_verdict, per_tensor_scale_verdict)
def silu_and_mul_static_fp8_quant(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=fp8_dtype, device=x.device)
    _silu(out, x, scale)
    return out


@_fused("rms_norm_static_fp8_quant", X_ON_CPU, weight_verdict, per_tensor_scale_verdict)
def rms_norm_static_fp8_quant(
    x: Tensor, weight: Tensor | None, epsilon: float, scale: Tensor, fp8_dtype: torch.dtype
) -> Tensor:
    out = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    _static(out, x, weight, scale, epsilon)
    return out


@_fused("fused_add_rms_norm_static_fp8_quant", X_ON_CPU, *RESIDUAL, weight_verdict, per_tensor_scale_verdict)
def fused_add_rms_norm_static_fp8_quant(x, x_residual, weight, epsilon, scale, fp8_dtype, inplace=False):
    # In place, the new residual goes into x_residual; q always has its own (fp8) buffer.
    out = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    residual = x_residual if inplace else torch.empty_like(x)
    _add_static(out, residual, x, x_residual, weight, scale, epsilon)
    return out, residual


@_fused("rms_norm_dynamic_per_token_fp8_quant", X_ON_CPU, *RESIDUAL, weight_verdict, scale_ub_verdict)
def rms_norm_dynamic_per_token_fp8_quant(x, x_residual, weight, epsilon, fp8_dtype, scale_ub=None, inplace=False):
    out = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scales = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    residual = None if x_residual is None else (x_residual if inplace else torch.empty_like(x))
    _dynamic(out, scales, residual, x, x_residual, weight, scale_ub, epsilon)
    return out, scales, residual


@_fused(
    "rms_norm_group_fp8_quant", X_ON_GROUP_DEVICES, *RESIDUAL, weight_verdict, group_size_verdict, column_major_verdict
)
def rms_norm_group_fp8_quant(
    x, x_residual, weight, epsilon, group_size, column_major, use_ue8m0, fp8_dtype, inplace=False
):
    out = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scales = empty_group_scales(x.shape, group_size, column_major, x.device)
    residual = None if x_residual is None else (x_residual if inplace else torch.empty_like(x))
    _group_kernel(out, scales, residual, x, x_residual, weight, group_size, use_ue8m0, epsilon)
    return out, scales, residual


@_fused("silu_and_mul_group_fp8_quant", X_ON_GROUP_DEVICES, halves_verdict, group_size_verdict, column_major_verdict)
def silu_and_mul_group_fp8_quant(
    x: Tensor, group_size: int, column_major: bool, use_ue8m0: bool, fp8_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    shape = (*x.shape[:-1], x.shape[-1] // 2)
    out = torch.empty(shape, dtype=fp8_dtype, device=x.device)
    scales = empty_group_scales(shape, group_size, column_major, x.device)
    _silu_group(out, scales, x, group_size, use_ue8m0)
    return out, scales
