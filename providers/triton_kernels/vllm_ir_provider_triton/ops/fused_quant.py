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
from vllm_ir.ir.declarations.fused_quant import (
    halves_verdict,
    per_tensor_scale_verdict,
)
from vllm_ir.ir.declarations.layernorm import residual_verdict, weight_verdict
from vllm_ir.ir.declarations.quant import column_major_verdict, group_size_verdict, scale_ub_verdict
from vllm_ir.plugins.provider import empty_group_scales
from vllm_ir_provider_triton import TRITON
from vllm_ir_provider_triton.ops.quant import ROWS, _rows_stride

#: Mirrors kernels/fused_quant.py (importing it needs Triton, predicates must not).
MAX_TILE = 65536
_STATIC, _PER_TOKEN, _GROUP = 0, 1, 2


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _fits(hidden: int, group_size: int) -> bool | vllm_ir.Unsupported:
    groups = -(-hidden // group_size) if hidden else 1
    if _next_pow2(max(groups, 1)) * max(16, _next_pow2(max(group_size, 1))) > MAX_TILE:
        return vllm_ir.Unsupported(f"a row of {hidden} does not fit one program ({MAX_TILE} elements once padded)")
    return True


def _row_fits(x: Tensor) -> bool | vllm_ir.Unsupported:
    return _fits(x.shape[-1], max(x.shape[-1], 1))


def _groups_fit(x: Tensor, group_size: int) -> bool | vllm_ir.Unsupported:
    """After the declaration's `group_size_verdict` (``_fits`` divides by the group size)."""
    return _fits(x.shape[-1], group_size)


def _residual_rows(x_residual: Tensor | None) -> bool | vllm_ir.Unsupported:
    if x_residual is not None and _rows_stride(x_residual) is None:
        return vllm_ir.Unsupported("x_residual is not rows with one row stride")
    return True


def _weight_contiguous(weight: Tensor | None) -> bool | vllm_ir.Unsupported:
    """After the declaration's `weight_verdict` (a ``[hidden]`` weight): one the kernels read densely."""
    if weight is not None and not weight.is_contiguous():
        return vllm_ir.Unsupported("weight is not contiguous")
    return True


#: The group ops' group size, and the optional residual and weight of the norm ops, in the order
#: they are asked.
GROUPS = (group_size_verdict, _groups_fit)
RESIDUAL = (residual_verdict, _residual_rows)
WEIGHT = (weight_verdict, _weight_contiguous)


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


@TRITON.impl("rms_norm_static_fp8_quant", supports=(*ROWS, _row_fits, *WEIGHT, per_tensor_scale_verdict))
def rms_norm_static_fp8_quant(x, weight, epsilon, scale, fp8_dtype):
    return _norm(x, None, weight, epsilon, fp8_dtype, _STATIC, scale=scale)[0]


@TRITON.impl(
    "fused_add_rms_norm_static_fp8_quant", supports=(*ROWS, _row_fits, *RESIDUAL, *WEIGHT, per_tensor_scale_verdict)
)
def fused_add_rms_norm_static_fp8_quant(x, x_residual, weight, epsilon, scale, fp8_dtype):
    q, _, residual = _norm(x, x_residual, weight, epsilon, fp8_dtype, _STATIC, scale=scale)
    return q, residual


@TRITON.impl("rms_norm_dynamic_per_token_fp8_quant", supports=(*ROWS, _row_fits, *RESIDUAL, *WEIGHT, scale_ub_verdict))
def rms_norm_dynamic_per_token_fp8_quant(x, x_residual, weight, epsilon, fp8_dtype, scale_ub=None):
    return _norm(x, x_residual, weight, epsilon, fp8_dtype, _PER_TOKEN, scale_ub=scale_ub)


@TRITON.impl(
    "rms_norm_group_fp8_quant",
    supports=(*ROWS, *GROUPS, *RESIDUAL, *WEIGHT, column_major_verdict),
)
def rms_norm_group_fp8_quant(x, x_residual, weight, epsilon, group_size, column_major, use_ue8m0, fp8_dtype):
    _check_group_size("rms_norm_group_fp8_quant", group_size)
    group = (group_size, column_major, use_ue8m0)
    return _norm(x, x_residual, weight, epsilon, fp8_dtype, _GROUP, group=group)


@TRITON.impl("silu_and_mul_static_fp8_quant", supports=(halves_verdict, *ROWS, _row_fits, per_tensor_scale_verdict))
def silu_and_mul_static_fp8_quant(x, scale, fp8_dtype):
    q = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8, device=x.device)
    silu_and_mul_fp8_quant_out(q, None, x, scale, _STATIC, 1, False, fp8_dtype)
    return q.view(fp8_dtype)


@TRITON.impl(
    "silu_and_mul_group_fp8_quant",
    supports=(halves_verdict, *ROWS, *GROUPS, column_major_verdict),
)
def silu_and_mul_group_fp8_quant(x, group_size, column_major, use_ue8m0, fp8_dtype):
    _check_group_size("silu_and_mul_group_fp8_quant", group_size)
    shape = (*x.shape[:-1], x.shape[-1] // 2)
    q = torch.empty(shape, dtype=torch.uint8, device=x.device)
    scales = empty_group_scales(shape, group_size, column_major, x.device)
    silu_and_mul_fp8_quant_out(q, scales, x, None, _GROUP, group_size, use_ue8m0, fp8_dtype)
    return q.view(fp8_dtype), scales
