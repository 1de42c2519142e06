"""FP8 quantization in Triton: ``static_quant_fp8``, ``dynamic_quant_fp8`` (per token and per
tensor) and ``dynamic_group_quant_fp8``; the kernels are in ``kernels/quant.py``.

The kernels round as the declarations do (fp32 ``x * (1 / scale)``, clamp, fp8 encoding to
nearest even done with integer operations) and are bit-identical to native in the CPU
interpreter (tests/test_triton_quant.py). They are not registered ``exact``: that claim is
unmeasured on GPUs (no GPU here), and the ops' comparison mode (dequantized values plus a
mismatch bound) is the contract. Every implementation is ``batch_invariant``: a value depends
on its own row (or group), or on the whole tensor's absmax, a max (no order of reduction).

Predicates read dtypes, devices, ranks, non-token sizes and strides, never the token count:

- x: float32/float16/bfloat16, rows of its last dimension with one row stride (contiguous,
  row slices of a wider buffer, or a 2-D x with any row stride);
- static scales: float32, per-tensor, per-token, per-channel or 2-D blocks of a 2-D x; an
  N-D scale of an N-D x (N > 2) only per token (``[..., 1]``) or per channel (``[1, .., K]``);
- ``num_token_padding`` only with a 2-D x (native raises otherwise); pad rows are left unwritten;
- group sizes up to 4096 (a group is reduced in one program's registers).
"""

from __future__ import annotations

import torch
from torch import Tensor

import vllm_ir
from vllm_ir.ir.declarations.quant import (
    column_major_verdict,
    fp8_verdict,
    group_size_verdict,
    padded_shape,
    padding_verdict,
    scale_ub_verdict,
    scale_verdict,
)
from vllm_ir.plugins.provider import empty_group_scales
from vllm_ir_provider_triton import TRITON, dtype_and_device_verdict

#: Mirrors kernels/quant.py (importing it needs Triton, predicates must not).
MAX_GROUP = 4096


def _rows_stride(x: Tensor) -> int | None:
    """See ``kernels.quant.rows_stride`` (duplicated: predicates must work without Triton)."""
    if x.dim() == 0 or (x.stride(-1) != 1 and x.shape[-1] != 1):
        return None
    if x.dim() == 1:
        return x.shape[-1]
    expected = x.stride(-2) * x.shape[-2]
    for d in range(x.dim() - 3, -1, -1):
        if x.stride(d) != expected:
            return None
        expected *= x.shape[d]
    return x.stride(-2)


def rows_verdict(x: Tensor) -> bool | vllm_ir.Unsupported:
    """Whether the quant kernels (the fused ones too) can quantize ``x`` row by row, after `fp8_verdict`."""
    verdict = dtype_and_device_verdict(x)
    if not verdict:
        return verdict
    if x.dim() == 0:
        return vllm_ir.Unsupported("x is 0-d (the kernels work along a last dimension)")
    if _rows_stride(x) is None:
        return vllm_ir.Unsupported(
            "x is not rows with one row stride (a strided last dimension, or leading dimensions that do not collapse)"
        )
    return True


#: What every op checks first (the fused ones too): the fp8 dtype, then x.
ROWS = (fp8_verdict, rows_verdict)


def scale_groups_verdict(x: Tensor, scale: Tensor) -> bool | vllm_ir.Unsupported:
    """After the declaration's `scale_verdict`: the scale ranks and groupings the kernel takes."""
    if scale.dim() == 2 and x.dim() == 1:
        return vllm_ir.Unsupported("a 2-D scale with a 1-D x")
    if scale.dim() > 2:
        if scale.dim() != x.dim():
            return vllm_ir.Unsupported(f"a {scale.dim()}-D scale with a {x.dim()}-D x (native raises)")
        if scale.shape[-1] not in (1, x.shape[-1]):
            return vllm_ir.Unsupported(
                f"a {scale.dim()}-D scale of {scale.shape[-1]} column groups (the kernel groups columns of a "
                "2-D x only; N-D scales must be per token [..., 1] or per channel [1, .., K])"
            )
    return True


def per_token_verdict(x: Tensor, per_token: bool) -> bool | vllm_ir.Unsupported:
    if per_token and x.shape[-1] == 0:
        return vllm_ir.Unsupported("per-token scales of rows with no elements (native raises)")
    return True


def max_group_verdict(group_size: int) -> bool | vllm_ir.Unsupported:
    """After the declaration's `group_size_verdict`: a group fits one program's registers."""
    if group_size > MAX_GROUP:
        return vllm_ir.Unsupported(f"group_size {group_size} > {MAX_GROUP} (a group is reduced in one program)")
    return True


def scale_plan(x: Tensor, scale: Tensor) -> tuple[Tensor, int, int]:
    """``scale`` as a 2-D float32 tensor over x's rows with its group sizes (rows, columns),
    following the declaration's `broadcast_scale`; a ValueError naming the op otherwise."""
    what = "static_quant_fp8 (provider triton)"
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    if scale.numel() == 1:
        return scale.reshape(1, 1), max(rows, 1), max(cols, 1)
    if scale.dim() == 1:
        if x.dim() > 1:
            raise ValueError(
                f"{what}: a 1-D scale of {scale.shape[0]} elements is ambiguous (per token or per channel?); "
                "pass it as [T, 1] per token or [1, K] per channel"
            )
        if scale.shape[0] == cols:  # one scale per element of a 1-D x
            return scale.reshape(1, cols), 1, 1
        raise ValueError(f"{what}: a 1-D scale of a 1-D x must have 1 or {cols} elements, got {scale.shape[0]}")
    if scale.dim() != x.dim():
        raise ValueError(f"{what}: scale of shape {list(scale.shape)} does not group x of shape {list(x.shape)}")
    if x.dim() == 2:
        (s_rows, s_cols), groups = scale.shape, []
        for size, n, d in ((rows, s_rows, 0), (cols, s_cols, 1)):
            if size == n:  # one scale per row / column (an empty x included)
                groups.append(1)
                continue
            if n == 0 or size % n:
                raise ValueError(
                    f"{what}: scale of shape {list(scale.shape)} does not divide x of shape {list(x.shape)} "
                    f"along dimension {d}"
                )
            groups.append(size // n)
        return scale, groups[0], groups[1]
    leading, x_leading = tuple(scale.shape[:-1]), tuple(x.shape[:-1])
    if scale.shape[-1] not in (1, cols) or leading not in (x_leading, (1,) * len(leading)):
        raise ValueError(
            f"{what}: a {scale.dim()}-D scale of shape {list(scale.shape)} must be per token or per channel "
            f"of x of shape {list(x.shape)} (blocks over leading dimensions are not implemented)"
        )
    s_rows = rows if leading == x_leading else 1
    flat = scale.reshape(s_rows, scale.shape[-1])
    return flat, (1 if s_rows == rows else max(rows, 1)), (1 if scale.shape[-1] == cols else max(cols, 1))


if TRITON.available:
    from vllm_ir_provider_triton.kernels.quant import dynamic_quant_fp8_out, group_quant_fp8_out, static_quant_fp8_out

# The kernels write q's bytes (uint8, at least ``num_token_padding`` rows, those past x's left
# unwritten); the result is their fp8 view.


@TRITON.impl("static_quant_fp8", supports=(*ROWS, padding_verdict, scale_verdict, scale_groups_verdict))
def static_quant_fp8(x, scale, fp8_dtype, num_token_padding=None):
    q = torch.empty(padded_shape(x, num_token_padding), dtype=torch.uint8, device=x.device)
    scale2d, group_r, group_c = scale_plan(x, scale)
    static_quant_fp8_out(q, x, scale2d, group_r, group_c, fp8_dtype)
    return q.view(fp8_dtype)


@TRITON.impl("dynamic_quant_fp8", supports=(*ROWS, padding_verdict, per_token_verdict, scale_ub_verdict))
def dynamic_quant_fp8(x, per_token, fp8_dtype, scale_ub=None, num_token_padding=None):
    q = torch.empty(padded_shape(x, num_token_padding), dtype=torch.uint8, device=x.device)
    shape = (*x.shape[:-1], 1) if per_token else (1,)
    scale = torch.empty(shape, dtype=torch.float32, device=x.device)
    dynamic_quant_fp8_out(q, scale, x, scale_ub, per_token, fp8_dtype)
    return q.view(fp8_dtype), scale


@TRITON.impl("dynamic_group_quant_fp8", supports=(*ROWS, group_size_verdict, max_group_verdict, column_major_verdict))
def dynamic_group_quant_fp8(x, group_size, column_major, use_ue8m0, fp8_dtype):
    if not 1 <= group_size <= MAX_GROUP:
        raise ValueError(
            f"dynamic_group_quant_fp8 (provider triton): group_size must be in [1, {MAX_GROUP}], got {group_size}"
        )
    q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = empty_group_scales(x.shape, group_size, column_major, x.device)
    group_quant_fp8_out(q, scales, x, group_size, use_ue8m0, fp8_dtype)
    return q.view(fp8_dtype), scales
