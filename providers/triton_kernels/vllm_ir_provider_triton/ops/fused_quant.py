"""RMSNorm / SwiGLU fused with FP8 quant in Triton: ``rms_norm_static_fp8_quant``,
``fused_add_rms_norm_static_fp8_quant``, ``rms_norm_dynamic_per_token_fp8_quant``,
``rms_norm_group_fp8_quant``, ``silu_and_mul_static_fp8_quant`` and
``silu_and_mul_group_fp8_quant``; the kernels are in ``kernels/fused_quant.py``.

One program per row: the norm (or SwiGLU), the scale and the fp8 encoding in registers, the
intermediate never stored. The kernels round where native rounds and encode as the Triton
quant kernels do; they are not registered ``exact`` (the sum of squares is reduced in another
order than native's mean, and exp differs in the last bit between back-ends): the ops'
dequantized comparison is the contract. Every implementation is ``batch_invariant`` (a row
depends on its own values only) and functional (the new residual goes to a fresh tensor).

Predicates read dtypes, devices, ranks, the hidden size, strides, the static scale's element
count and the group size, never the token count: rows with one row stride (contiguous, row
slices, 2-D with any row stride), a weight of x's dtype or float32, a residual like x, a
per-tensor static scale, a row that fits one program (``MAX_TILE`` elements once padded).
"""

from __future__ import annotations

import torch
from torch import Tensor

import vllm_ir
from vllm_ir.plugins.provider import empty_group_scales
from vllm_ir_provider_triton import TRITON
from vllm_ir_provider_triton.ops.quant import _rows_stride, x_rows_verdict

#: Mirrors kernels/fused_quant.py (importing it needs Triton, predicates must not).
MAX_TILE = 65536
_STATIC, _PER_TOKEN, _GROUP = 0, 1, 2


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _fits(hidden: int, group_size: int) -> bool:
    groups = -(-hidden // group_size) if hidden else 1
    return _next_pow2(max(groups, 1)) * max(16, _next_pow2(max(group_size, 1))) <= MAX_TILE


def _common(
    x: Tensor, x_residual: Tensor | None, weight: Tensor | None, fp8_dtype: torch.dtype, group_size: int | None = None
) -> vllm_ir.Unsupported | None:
    verdict = x_rows_verdict(x, fp8_dtype)
    if verdict is not None:
        return verdict
    if group_size is not None and group_size < 1:
        return vllm_ir.Unsupported(f"group_size {group_size} < 1 (native raises)")
    if not _fits(x.shape[-1], group_size or max(x.shape[-1], 1)):
        return vllm_ir.Unsupported(f"a row of {x.shape[-1]} does not fit one program ({MAX_TILE} elements once padded)")
    if x_residual is not None:
        if x_residual.dtype != x.dtype or x_residual.device != x.device or x_residual.shape != x.shape:
            return vllm_ir.Unsupported(
                f"x_residual ({x_residual.dtype}, {list(x_residual.shape)}, {x_residual.device}) differs from x "
                f"({x.dtype}, {list(x.shape)}, {x.device}) (native broadcasts and promotes; the kernels do not)"
            )
        if _rows_stride(x_residual) is None:
            return vllm_ir.Unsupported("x_residual is not rows with one row stride")
    if weight is not None:
        if weight.dtype not in (x.dtype, torch.float32):
            return vllm_ir.Unsupported(f"weight dtype {weight.dtype} is neither x's ({x.dtype}) nor float32")
        if weight.device != x.device:
            return vllm_ir.Unsupported(f"weight is on {weight.device}, x on {x.device}")
        if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or not weight.is_contiguous():
            return vllm_ir.Unsupported(
                f"weight of shape {list(weight.shape)} for rows of {x.shape[-1]} (need a contiguous [hidden])"
            )
    return None


def _static_scale(x: Tensor, scale: Tensor) -> vllm_ir.Unsupported | None:
    if scale.dtype != torch.float32 or scale.device != x.device:
        return vllm_ir.Unsupported(f"scale must be float32 on x's device, got {scale.dtype} on {scale.device}")
    if scale.numel() != 1:
        return vllm_ir.Unsupported(f"scale of shape {list(scale.shape)}: the fused kernels take a per-tensor scale")
    return None


def _first(*verdicts: vllm_ir.Unsupported | None) -> bool | vllm_ir.Unsupported:
    for verdict in verdicts:
        if verdict is not None:
            return verdict
    return True


def _gated(x: Tensor) -> vllm_ir.Unsupported | None:
    if x.dim() >= 1 and x.shape[-1] % 2:
        return vllm_ir.Unsupported(f"the last dimension ({x.shape[-1]}) is odd (native's halves do not match)")
    return None


def add_static_supports(x, x_residual, weight, scale, fp8_dtype) -> bool | vllm_ir.Unsupported:
    return _first(_common(x, x_residual, weight, fp8_dtype), _static_scale(x, scale))


def static_supports(x, weight, scale, fp8_dtype) -> bool | vllm_ir.Unsupported:
    return add_static_supports(x, None, weight, scale, fp8_dtype)


def dynamic_supports(x, x_residual, weight, fp8_dtype, scale_ub) -> bool | vllm_ir.Unsupported:
    verdict = _common(x, x_residual, weight, fp8_dtype)
    if verdict is None and scale_ub is not None:
        if scale_ub.dtype != torch.float32 or scale_ub.device != x.device or scale_ub.numel() != 1:
            verdict = vllm_ir.Unsupported(
                f"scale_ub must be one float32 element on x's device, got {scale_ub.dtype} "
                f"{list(scale_ub.shape)} on {scale_ub.device}"
            )
        elif scale_ub.dim() > 1:
            verdict = vllm_ir.Unsupported(f"scale_ub is {scale_ub.dim()}-D (native broadcasts the scale's shape to it)")
    return _first(verdict)


def group_supports(x, x_residual, weight, group_size, column_major, fp8_dtype) -> bool | vllm_ir.Unsupported:
    verdict = _common(x, x_residual, weight, fp8_dtype, group_size)
    if verdict is None and column_major and x.dim() < 2:
        verdict = vllm_ir.Unsupported("column_major scales of a 1-D x (native raises)")
    return _first(verdict)


def silu_static_supports(x, scale, fp8_dtype) -> bool | vllm_ir.Unsupported:
    return _first(_gated(x), _common(x, None, None, fp8_dtype), _static_scale(x, scale))


def silu_group_supports(x, group_size, column_major, fp8_dtype) -> bool | vllm_ir.Unsupported:
    verdict = _gated(x)
    if verdict is None:
        verdict = _common(x, None, None, fp8_dtype, group_size)
    if verdict is None and column_major and x.dim() < 2:
        verdict = vllm_ir.Unsupported("column_major scales of a 1-D x (native raises)")
    return _first(verdict)


if TRITON.available:
    from vllm_ir_provider_triton.kernels.fused_quant import rms_norm_fp8_quant_out, silu_and_mul_fp8_quant_out


def _norm(
    x: Tensor,
    x_residual: Tensor | None,
    weight: Tensor | None,
    epsilon: float,
    fp8_dtype: torch.dtype,
    quant: int,
    *,
    scale: Tensor | None = None,
    scale_ub: Tensor | None = None,
    group: tuple[int, bool, bool] = (1, False, False),
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    residual = None if x_residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    group_size, column_major, use_ue8m0 = group
    scales = None
    if quant == _PER_TOKEN:
        scales = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    elif quant == _GROUP:
        scales = empty_group_scales(tuple(x.shape), group_size, column_major, x.device)
    rms_norm_fp8_quant_out(
        q, scales, residual, x, x_residual, weight, float(epsilon), scale, scale_ub, quant, group_size,
        use_ue8m0, fp8_dtype,
    )  # fmt: skip
    return q.view(fp8_dtype), scales, residual


def _check_group_size(op: str, group_size: int) -> None:
    if group_size < 1:
        raise ValueError(f"{op} (provider triton): group_size must be >= 1, got {group_size}")


@TRITON.impl("rms_norm_static_fp8_quant", supports=static_supports)
def rms_norm_static_fp8_quant(x, weight, epsilon, scale, fp8_dtype):
    return _norm(x, None, weight, epsilon, fp8_dtype, _STATIC, scale=scale)[0]


@TRITON.impl("fused_add_rms_norm_static_fp8_quant", supports=add_static_supports)
def fused_add_rms_norm_static_fp8_quant(x, x_residual, weight, epsilon, scale, fp8_dtype):
    q, _, residual = _norm(x, x_residual, weight, epsilon, fp8_dtype, _STATIC, scale=scale)
    return q, residual


@TRITON.impl("rms_norm_dynamic_per_token_fp8_quant", supports=dynamic_supports)
def rms_norm_dynamic_per_token_fp8_quant(x, x_residual, weight, epsilon, fp8_dtype, scale_ub=None):
    return _norm(x, x_residual, weight, epsilon, fp8_dtype, _PER_TOKEN, scale_ub=scale_ub)


@TRITON.impl("rms_norm_group_fp8_quant", supports=group_supports)
def rms_norm_group_fp8_quant(x, x_residual, weight, epsilon, group_size, column_major, use_ue8m0, fp8_dtype):
    _check_group_size("rms_norm_group_fp8_quant", group_size)
    group = (group_size, column_major, use_ue8m0)
    return _norm(x, x_residual, weight, epsilon, fp8_dtype, _GROUP, group=group)


@TRITON.impl("silu_and_mul_static_fp8_quant", supports=silu_static_supports)
def silu_and_mul_static_fp8_quant(x, scale, fp8_dtype):
    q = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8, device=x.device)
    silu_and_mul_fp8_quant_out(q, None, x, scale, _STATIC, 1, False, fp8_dtype)
    return q.view(fp8_dtype)


@TRITON.impl("silu_and_mul_group_fp8_quant", supports=silu_group_supports)
def silu_and_mul_group_fp8_quant(x, group_size, column_major, use_ue8m0, fp8_dtype):
    _check_group_size("silu_and_mul_group_fp8_quant", group_size)
    shape = (*x.shape[:-1], x.shape[-1] // 2)
    q = torch.empty(shape, dtype=torch.uint8, device=x.device)
    scales = empty_group_scales(shape, group_size, column_major, x.device)
    silu_and_mul_fp8_quant_out(q, scales, x, None, _GROUP, group_size, use_ue8m0, fp8_dtype)
    return q.view(fp8_dtype), scales
