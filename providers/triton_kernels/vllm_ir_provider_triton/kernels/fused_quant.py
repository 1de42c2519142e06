"""RMSNorm / SwiGLU fused with FP8 quantization: one Triton kernel for the four norm ops
(static, fused add + static, dynamic per-token, per-group; residual optional) and one for
the two SwiGLU ops (static, per-group), with ``torch.library.triton_op`` wrappers in the
``vllm_ir_triton`` namespace.

One program per row. The row is loaded once as a ``[BLOCK_NG, BLOCK_G]`` tile of groups
(``group_size`` columns per tile row; the static and per-token forms are one group of the
whole row), so that the norm's sum of squares, a per-token absmax and each group's absmax
are all reductions of the same registers: the normalized (or activated) value never leaves
the program. Arithmetic is fp32, rounded to the model dtype where the ops' native functions
round (`_round` of the activation kernels: bit-exact bf16 rounding in the interpreter too),
and fp8 is encoded with the quant kernels' integer encoding (`_encode_fp8`), scales derived
by their helpers (`_dynamic_scale`, `_pow2_ceil`, `_bounded`), so a fused kernel rounds
and encodes exactly like the norm / activation kernel followed by the quant kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from vllm_ir_provider_triton.kernels.activation import _cast, _round, _times_sigmoid
from vllm_ir_provider_triton.kernels.quant import (
    FORMATS,
    _bounded,
    _dynamic_scale,
    _encode_fp8,
    _min_scale,
    _nan_absmax,
    _pow2_ceil,
    rows_stride,
)

# How q is scaled (``QUANT`` of the kernels).
STATIC = tl.constexpr(0)
PER_TOKEN = tl.constexpr(1)
GROUP = tl.constexpr(2)
#: Elements of one program's tile at most (a whole row, padded to powers of two).
MAX_TILE = 65536


@triton.jit
def _quantize_store(
    y, q_ptrs, mask, s_ptr, ub_ptr, row, groups, s_row_offset, s_group_stride, min_scale,
    QUANT: tl.constexpr, BOUND: tl.constexpr, FNUZ: tl.constexpr, HAS_UB: tl.constexpr, UE8M0: tl.constexpr,
    BLOCK_NG: tl.constexpr,
):  # fmt: skip
    """Scale and encode one row's tile ``y`` ([groups, columns], fp32; padding masked out)
    into ``q_ptrs``: by the static scale at ``s_ptr``, by the row's dynamic scale (stored at
    ``s_ptr + row``), or by each group's scale (stored at ``s_row_offset + g * s_group_stride``)."""
    if QUANT == STATIC:
        inverse = tl.math.div_rn(1.0, tl.load(s_ptr))
        q = _encode_fp8(y * inverse, BOUND, FNUZ)
    elif QUANT == PER_TOKEN:
        group_max = _nan_absmax(tl.where(mask, y, 0.0), 1)
        absmax = tl.max(group_max, axis=0)
        absmax = tl.where(tl.max((group_max != group_max).to(tl.int32), axis=0) > 0, float("nan"), absmax)
        scale = _dynamic_scale(_bounded(absmax, ub_ptr, HAS_UB), min_scale, BOUND)
        tl.store(s_ptr + row, scale)
        q = _encode_fp8(y * tl.math.div_rn(1.0, scale), BOUND, FNUZ)
    else:
        absmax = _nan_absmax(tl.where(mask, y, 0.0), 1)
        s = tl.math.div_rn(absmax, BOUND)
        s = tl.where(s < min_scale, min_scale, s)  # the floor, then UE8M0 (vLLM's order)
        if UE8M0:
            s = _pow2_ceil(s)
        g = tl.arange(0, BLOCK_NG)
        tl.store(s_ptr + s_row_offset + g * s_group_stride, s, mask=g < groups)
        q = _encode_fp8(y * tl.math.div_rn(1.0, s)[:, None], BOUND, FNUZ)
    tl.store(q_ptrs, q, mask=mask)


@triton.jit
def _rms_norm_quant_kernel(
    q_ptr, s_ptr, ub_ptr, x_ptr, r_ptr, r_out_ptr, w_ptr,
    x_row_stride, r_row_stride, r_out_row_stride, n_cols, eps,
    group_size, groups, inner_rows, s_batch_stride, s_row_stride, s_group_stride, min_scale,
    QUANT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    BOUND: tl.constexpr, FNUZ: tl.constexpr, HAS_UB: tl.constexpr, UE8M0: tl.constexpr,
    BLOCK_NG: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """One row: s = x (+ residual, fp32; the residual stored rounded), y = rms_norm(s) with the
    weight applied as vLLM 0.33 does (rounded to the weight's dtype, multiplied, rounded to it
    again: no roundings for an fp32 weight), rounded to x's dtype, then quantized."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_NG)[:, None]
    j = tl.arange(0, BLOCK_G)[None, :]
    cols = g * group_size + j
    mask = (g < groups) & (j < group_size) & (cols < n_cols)
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    s = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        s += tl.load(r_ptr + row * r_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(r_out_ptr + row * r_out_row_stride + cols, _cast(s, DTYPE), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(s * s, axis=1), axis=0) / n_cols + eps)
    y = s * rstd
    if HAS_WEIGHT:
        W_DTYPE: tl.constexpr = w_ptr.dtype.element_ty
        y = _round(_round(y, W_DTYPE) * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32), W_DTYPE)
    y = _round(y, DTYPE)
    s_row_offset = (row // inner_rows) * s_batch_stride + (row % inner_rows) * s_row_stride
    _quantize_store(
        y, q_ptr + row * n_cols + cols, mask, s_ptr, ub_ptr, row, groups, s_row_offset, s_group_stride,
        min_scale, QUANT=QUANT, BOUND=BOUND, FNUZ=FNUZ, HAS_UB=HAS_UB, UE8M0=UE8M0,
        BLOCK_NG=BLOCK_NG,
    )  # fmt: skip


@triton.jit
def _silu_and_mul_quant_kernel(
    q_ptr, s_ptr, x_ptr, x_row_stride, d,
    group_size, groups, inner_rows, s_batch_stride, s_row_stride, s_group_stride, min_scale,
    QUANT: tl.constexpr, BOUND: tl.constexpr, FNUZ: tl.constexpr, UE8M0: tl.constexpr,
    BLOCK_NG: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """One row of ``[gate | up]``: y = silu(gate) rounded to x's dtype, times up, rounded, quantized."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_NG)[:, None]
    j = tl.arange(0, BLOCK_G)[None, :]
    cols = g * group_size + j
    mask = (g < groups) & (j < group_size) & (cols < d)
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    x_row = x_ptr + row * x_row_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    y = _round(_round(_times_sigmoid(gate, gate), DTYPE) * up, DTYPE)
    s_row_offset = (row // inner_rows) * s_batch_stride + (row % inner_rows) * s_row_stride
    _quantize_store(
        y, q_ptr + row * d + cols, mask, s_ptr, s_ptr, row, groups, s_row_offset, s_group_stride,
        min_scale, QUANT=QUANT, BOUND=BOUND, FNUZ=FNUZ, HAS_UB=False, UE8M0=UE8M0,
        BLOCK_NG=BLOCK_NG,
    )  # fmt: skip


# -- host side ---------------------------------------------------------------------------------


def _check(what: str, ok: bool, detail: str) -> None:
    if not ok:
        raise ValueError(f"vllm_ir_triton::{what}: {detail}")


def tile(n_cols: int, group_size: int) -> tuple[int, int]:
    """(BLOCK_NG, BLOCK_G): the row as groups of ``group_size`` columns, in powers of two."""
    groups = -(-n_cols // group_size) if n_cols else 1
    return triton.next_power_of_2(max(groups, 1)), max(16, triton.next_power_of_2(max(group_size, 1)))


def _rows(what: str, name: str, t: Tensor) -> tuple[int, int]:
    """(rows, row stride) of ``t`` seen as ``[-1, t.shape[-1]]``."""
    stride = rows_stride(t)
    _check(what, stride is not None, f"{name} of shape {list(t.shape)} and strides {list(t.stride())} is not rows")
    cols = t.shape[-1]
    return (t.numel() // cols if cols else 0), stride


def _format(what: str, q: Tensor, fp8_dtype: torch.dtype) -> tuple[float, bool]:
    fmt = FORMATS.get(fp8_dtype)
    _check(what, fmt is not None, f"fp8_dtype {fp8_dtype} is not float8_e4m3fn or float8_e4m3fnuz")
    _check(what, q.dtype == torch.uint8 and q.is_contiguous(), f"q must be contiguous uint8 (fp8 bytes), got {q.dtype}")
    return fmt


def _scale_layout(what: str, scales: Tensor, shape: tuple[int, ...], group_size: int) -> tuple[int, int, int, int, int]:
    """(groups, inner rows, batch stride, row stride, group stride) of group ``scales`` of
    ``[*shape[:-1], groups]``, whose leading dimensions must collapse to one batch stride."""
    groups = -(-shape[-1] // group_size)
    _check(
        what,
        scales.dtype == torch.float32 and tuple(scales.shape) == (*shape[:-1], groups),
        f"scales {scales.dtype} {list(scales.shape)} for q of shape {list(shape)} in groups of {group_size}",
    )
    dims = len(shape)
    inner_rows = shape[-2] if dims >= 2 else 1
    s_row = scales.stride(-2) if dims >= 2 else 0
    s_batch = scales.stride(-3) if dims >= 3 else 0
    expected = s_batch * (shape[-3] if dims >= 3 else 1)
    for d in range(dims - 4, -1, -1):
        _check(what, scales.stride(d) == expected, "the scales' leading dimensions must collapse (one batch stride)")
        expected *= shape[d]
    return groups, inner_rows, s_batch, s_row, scales.stride(-1)


@triton_op("vllm_ir_triton::rms_norm_fp8_quant_out", mutates_args={"q", "scales", "residual_out"})
def rms_norm_fp8_quant_out(
    q: Tensor,
    scales: Tensor | None,
    residual_out: Tensor | None,
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    epsilon: float,
    static_scale: Tensor | None,
    scale_ub: Tensor | None,
    quant: int,
    group_size: int,
    use_ue8m0: bool,
    fp8_dtype: torch.dtype,
) -> None:
    """q (x's shape, fp8 bytes) of ``rms_norm(x [+ residual])`` and ``residual_out`` (with a
    residual). ``quant``: STATIC (by the per-tensor ``static_scale``; ``scales`` is None),
    PER_TOKEN (one scale per row written into ``scales``, bounded by ``scale_ub``) or GROUP
    (``scales`` of ``[*x.shape[:-1], groups]`` written, row- or column-major)."""
    what = "rms_norm_fp8_quant_out"
    bound, fnuz = _format(what, q, fp8_dtype)
    _check(what, tuple(q.shape) == tuple(x.shape), f"q of shape {list(q.shape)} for x of shape {list(x.shape)}")
    rows, x_stride = _rows(what, "x", x)
    cols = x.shape[-1]
    r_stride = ro_stride = 0
    if residual is not None:
        _check(what, residual_out is not None, "a residual needs residual_out")
        _, r_stride = _rows(what, "residual", residual)
        _, ro_stride = _rows(what, "residual_out", residual_out)
    _check(what, weight is None or weight.is_contiguous(), "weight must be contiguous")
    if quant == STATIC.value:
        _check(what, static_scale is not None and static_scale.numel() == 1, "a static scale has one element")
        scales = static_scale
    else:
        _check(what, scales is not None, "dynamic quant writes scales")
    if quant == GROUP.value:
        _check(what, group_size >= 1, f"group_size {group_size} < 1")
        groups, inner, s_batch, s_row, s_group = _scale_layout(what, scales, tuple(x.shape), group_size)
    else:
        group_size, groups, inner, s_batch, s_row, s_group = max(cols, 1), 1, 1, 0, 0, 0
        expected = 1 if quant == STATIC.value else rows
        _check(what, scales.numel() == expected, f"scales has {scales.numel()} elements, expected {expected}")
    block_ng, block_g = tile(cols, group_size)
    _check(what, block_ng * block_g <= MAX_TILE, f"a row of {cols} in groups of {group_size} exceeds one program")
    if rows == 0 or cols == 0:
        return
    min_scale = _min_scale(bound)
    wrap_triton(_rms_norm_quant_kernel)[(rows,)](
        q, scales, scale_ub if scale_ub is not None else scales, x,
        residual if residual is not None else x, residual_out if residual_out is not None else x,
        weight if weight is not None else x,
        x_stride, r_stride, ro_stride, cols, epsilon,
        group_size, groups, inner, s_batch, s_row, s_group, min_scale,
        QUANT=quant, HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
        BOUND=bound, FNUZ=fnuz, HAS_UB=scale_ub is not None, UE8M0=use_ue8m0,
        BLOCK_NG=block_ng, BLOCK_G=block_g,
    )  # fmt: skip


@triton_op("vllm_ir_triton::silu_and_mul_fp8_quant_out", mutates_args={"q", "scales"})
def silu_and_mul_fp8_quant_out(
    q: Tensor,
    scales: Tensor | None,
    x: Tensor,
    static_scale: Tensor | None,
    quant: int,
    group_size: int,
    use_ue8m0: bool,
    fp8_dtype: torch.dtype,
) -> None:
    """q (``[..., d]`` fp8 bytes) of ``silu_and_mul(x)``: STATIC (by the per-tensor
    ``static_scale``; ``scales`` is None) or GROUP (``scales`` of ``[..., groups]`` written)."""
    what = "silu_and_mul_fp8_quant_out"
    bound, fnuz = _format(what, q, fp8_dtype)
    _check(what, x.dim() >= 1 and x.shape[-1] % 2 == 0, f"x of shape {list(x.shape)}: the last dimension must be even")
    d = x.shape[-1] // 2
    shape = (*x.shape[:-1], d)
    _check(what, tuple(q.shape) == shape, f"q of shape {list(q.shape)} for x of shape {list(x.shape)}")
    rows, x_stride = _rows(what, "x", x)
    if quant == GROUP.value:
        _check(what, scales is not None and group_size >= 1, f"group quant writes scales (group_size {group_size})")
        groups, inner, s_batch, s_row, s_group = _scale_layout(what, scales, shape, group_size)
    else:
        _check(what, quant == STATIC.value, f"quant {quant} is neither STATIC nor GROUP")
        _check(what, static_scale is not None and static_scale.numel() == 1, "a static scale has one element")
        scales = static_scale
        group_size, groups, inner, s_batch, s_row, s_group = max(d, 1), 1, 1, 0, 0, 0
    block_ng, block_g = tile(d, group_size)
    _check(what, block_ng * block_g <= MAX_TILE, f"a row of {d} in groups of {group_size} exceeds one program")
    if rows == 0 or d == 0:
        return
    min_scale = _min_scale(bound)
    wrap_triton(_silu_and_mul_quant_kernel)[(rows,)](
        q, scales, x, x_stride, d, group_size, groups, inner, s_batch, s_row, s_group, min_scale,
        QUANT=quant, BOUND=bound, FNUZ=fnuz, UE8M0=use_ue8m0,
        BLOCK_NG=block_ng, BLOCK_G=block_g,
    )  # fmt: skip


__all__ = ["GROUP", "PER_TOKEN", "STATIC", "rms_norm_fp8_quant_out", "silu_and_mul_fp8_quant_out", "tile"]
