"""FP8 quantization kernels (static, dynamic per-token / per-tensor, per-group) and their
``torch.library.triton_op`` wrappers in the ``vllm_ir_triton`` namespace.

Rounding: every kernel computes what the op declarations compute, in fp32 --
``q = encode(clamp(x * (1 / scale)))`` with the reciprocal correctly rounded (``div_rn``) --
and encodes fp8 with integer operations (round to nearest even, e4m3fn or e4m3fnuz,
subnormals included, NaN as torch encodes it) into a ``uint8`` buffer the caller views as
fp8. The Triton interpreter's fp32 -> fp8 cast is wrong (measured here: 36917 of 200k values
differ from torch's, some by a whole binade); the integer form does not depend on any
back-end's cast, so the interpreter and GPUs run the same arithmetic.

Dynamic scales are ``absmax / fp8_max``, an IEEE division (``div_rn``) on every device, as
native computes them (it divides by a 0-d tensor: ``tensor / python_float`` would multiply by
the reciprocal on CUDA); bit-exact against native in the interpreter (tests/test_triton_quant.py)
and on an H200 (benchmarks/gpu_session.sh).

Layouts: ``x`` is read as rows of its last dimension with one row stride (contiguous
tensors, row slices of a wider buffer, stride-0 broadcast rows of a 2-D x); ``q`` and the
scales are written where their strides say (column-major group scales included). No view is
made inside the ``triton_op``s, so compiled graphs see the kernels write their arguments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

#: The fp8 dtypes, with (clamp bound, whether the encoding is e4m3fnuz).
FORMATS: dict[torch.dtype, tuple[float, bool]] = {
    torch.float8_e4m3fn: (448.0, False),
    torch.float8_e4m3fnuz: (224.0, True),
}
#: Elements one program holds at most (tiles of rows x columns).
TILE = 2048
#: Columns per block at most.
MAX_BLOCK = 1024
#: The largest group one program row holds (a group is reduced in registers).
MAX_GROUP = 4096


@triton.jit
def _encode_fp8(v, BOUND: tl.constexpr, FNUZ: tl.constexpr):
    """fp32 ``v`` clamped to +-BOUND and encoded as fp8 bits (uint8): round to nearest even.

    e4m3fn: bias 7, NaN 0x7F (with the sign), -0 is 0x80. e4m3fnuz: bias 8, NaN 0x80, no
    negative zero. Comparisons keep NaN through the clamp, as ``Tensor.clamp`` does.
    """
    v = tl.where(v > BOUND, BOUND, tl.where(v < -BOUND, -BOUND, v))
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    abits = bits & 0x7FFFFFFF
    if FNUZ:
        BIAS: tl.constexpr = 8
    else:
        BIAS: tl.constexpr = 7
    # Normal fp8 values: round fp32's 23-bit mantissa to 3 bits, then rebias the exponent.
    normal = ((abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20) - ((127 - BIAS) << 3)
    # Subnormal fp8 values (|v| < 2^(1-BIAS)): the code is |v| / 2^(-2-BIAS), rounded to even.
    exponent = abits >> 23
    mantissa = tl.where(exponent == 0, abits & 0x7FFFFF, (abits & 0x7FFFFF) | 0x800000)
    shift = tl.minimum(148 - BIAS - tl.maximum(exponent, 1).to(tl.int32), 31).to(tl.uint32)
    truncated = mantissa >> shift
    remainder = mantissa - (truncated << shift)
    half = tl.full(mantissa.shape, 1, tl.uint32) << (shift - 1)
    up = (remainder > half) | ((remainder == half) & ((truncated & 1) == 1))
    subnormal = truncated + up.to(tl.uint32)
    code = tl.where(abits >= ((128 - BIAS) << 23), normal, subnormal)
    if FNUZ:
        code = tl.where(code == 0, code, code | sign)
        code = tl.where(v != v, 0x80, code)
    else:
        code = tl.where(v != v, 0x7F | sign, code | sign)
    return code.to(tl.uint8)


@triton.jit
def _dynamic_scale(absmax, min_scale, BOUND: tl.constexpr):
    """``max(absmax / fp8_max, min_scale)`` as native computes it (an IEEE division; NaN kept)."""
    s = tl.math.div_rn(absmax, BOUND)
    return tl.where(s < min_scale, min_scale, s)


@triton.jit
def _nan_absmax(x, axis: tl.constexpr):
    """``max(|x|)`` along ``axis``, NaN if any element is NaN (as ``Tensor.amax``)."""
    m = tl.max(tl.abs(x), axis=axis)
    has_nan = tl.max((x != x).to(tl.int32), axis=axis) > 0
    return tl.where(has_nan, float("nan"), m)


@triton.jit
def _bounded(absmax, ub_ptr, HAS_UB: tl.constexpr):
    """``torch.minimum(absmax, scale_ub)``: NaN in either gives NaN."""
    if HAS_UB:
        ub = tl.load(ub_ptr)
        absmax = tl.where(absmax > ub, ub, tl.where(ub != ub, ub, absmax))
    return absmax


@triton.jit
def _static_kernel(
    q_ptr,
    x_ptr,
    s_ptr,
    ub_ptr,
    scale_out_ptr,
    x_row_stride,
    q_row_stride,
    n_rows,
    n_cols,
    col_blocks,
    s_row_stride,
    s_col_stride,
    group_r,
    group_c,
    min_scale,
    BOUND: tl.constexpr,
    FNUZ: tl.constexpr,
    FROM_ABSMAX: tl.constexpr,
    HAS_UB: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Quantize a [BLOCK_R, BLOCK_C] tile with a given scale, or (FROM_ABSMAX) with the
    per-tensor scale derived from the absmax at ``s_ptr`` (int32 bits), which program 0 stores."""
    pid = tl.program_id(0).to(tl.int64)
    rows = ((pid // col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]
    cols = ((pid % col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    x = tl.load(x_ptr + rows * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if FROM_ABSMAX:
        absmax = _bounded(tl.load(s_ptr).to(tl.float32, bitcast=True), ub_ptr, HAS_UB)
        scale = _dynamic_scale(absmax, min_scale, BOUND)
        tl.store(scale_out_ptr, scale, mask=pid == 0)
        inverse = tl.math.div_rn(1.0, scale)
    else:
        s = tl.load(s_ptr + (rows // group_r) * s_row_stride + (cols // group_c) * s_col_stride, mask=mask, other=1.0)
        inverse = tl.math.div_rn(1.0, s)
    tl.store(q_ptr + rows * q_row_stride + cols, _encode_fp8(x * inverse, BOUND, FNUZ), mask=mask)


@triton.jit
def _absmax_kernel(
    absmax_ptr, x_ptr, x_row_stride, n_rows, n_cols, col_blocks, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    """The whole tensor's absmax: each tile's max joins ``absmax_ptr`` (int32 bits of a
    non-negative float, whose integer order is the float order, NaN above inf) by atomic max."""
    pid = tl.program_id(0).to(tl.int64)
    rows = ((pid // col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]
    cols = ((pid % col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    x = tl.load(x_ptr + rows * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    row_max = _nan_absmax(x, 1)
    tile_max = tl.max(row_max, axis=0)
    tile_max = tl.where(tl.max((row_max != row_max).to(tl.int32), axis=0) > 0, float("nan"), tile_max)
    tl.atomic_max(absmax_ptr, tile_max.to(tl.int32, bitcast=True))


@triton.jit
def _per_token_kernel(
    q_ptr,
    scale_ptr,
    x_ptr,
    ub_ptr,
    x_row_stride,
    q_row_stride,
    n_rows,
    n_cols,
    min_scale,
    BOUND: tl.constexpr,
    FNUZ: tl.constexpr,
    HAS_UB: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """BLOCK_R rows per program: absmax over each whole row, its scale, then the row's q."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    absmax = tl.zeros((BLOCK_R,), tl.float32)
    for start in range(0, n_cols, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        block_max = _nan_absmax(x, 1)
        absmax = tl.where((block_max > absmax) | (block_max != block_max), block_max, absmax)
    scale = _dynamic_scale(_bounded(absmax, ub_ptr, HAS_UB), min_scale, BOUND)
    tl.store(scale_ptr + rows, scale, mask=row_mask)
    inverse = tl.math.div_rn(1.0, scale)[:, None]
    for start in range(0, n_cols, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q = _encode_fp8(x * inverse, BOUND, FNUZ)
        tl.store(q_ptr + rows[:, None] * q_row_stride + cols[None, :], q, mask=mask)


@triton.jit
def _pow2_ceil(s):
    """The smallest power of two >= s (s >= 0) from the bits; inf and NaN unchanged (UE8M0)."""
    bits = s.to(tl.int32, bitcast=True)
    inexact = ((bits & 0x7FFFFF) != 0).to(tl.int32)
    rounded = (((bits >> 23) + inexact) << 23).to(tl.float32, bitcast=True)
    return tl.where(((bits >> 23) & 0xFF) == 0xFF, s, rounded)


@triton.jit
def _group_kernel(
    q_ptr,
    s_ptr,
    x_ptr,
    x_row_stride,
    q_row_stride,
    n_pairs,
    groups,
    n_cols,
    group_size,
    inner_rows,
    s_batch_stride,
    s_row_stride,
    s_group_stride,
    min_scale,
    BOUND: tl.constexpr,
    FNUZ: tl.constexpr,
    UE8M0: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """BLOCK_P (row, group) pairs per program, one group per tile row.

    Row r of x is (batch r // inner_rows, row r % inner_rows) of the scales, whose strides say
    where each scale goes (row-major or column-major)."""
    pid = tl.program_id(0).to(tl.int64)
    pairs = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    pair_mask = pairs < n_pairs
    row = pairs // groups
    group = pairs % groups
    j = tl.arange(0, BLOCK_G)
    cols = group[:, None] * group_size + j[None, :]
    mask = pair_mask[:, None] & (j < group_size)[None, :] & (cols < n_cols)
    x = tl.load(x_ptr + row[:, None] * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    absmax = _nan_absmax(x, 1)
    s = tl.math.div_rn(absmax, BOUND)
    s = tl.where(s < min_scale, min_scale, s)  # the floor, then UE8M0 (vLLM's order)
    if UE8M0:
        s = _pow2_ceil(s)
    s_offset = (row // inner_rows) * s_batch_stride + (row % inner_rows) * s_row_stride + group * s_group_stride
    tl.store(s_ptr + s_offset, s, mask=pair_mask)
    q = _encode_fp8(x * tl.math.div_rn(1.0, s)[:, None], BOUND, FNUZ)
    tl.store(q_ptr + row[:, None] * q_row_stride + cols, q, mask=mask)


# -- host side ---------------------------------------------------------------------------------


def rows_stride(x: Tensor) -> int | None:
    """Elements between consecutive rows of ``x`` seen as ``[-1, x.shape[-1]]``, or None when
    no single stride walks them (a strided last dimension, leading dimensions that do not
    collapse). A 2-D x may have any row stride, 0 (broadcast rows) included."""
    if x.dim() == 0 or (x.stride(-1) != 1 and x.shape[-1] != 1):
        return None
    if x.dim() == 1:
        return x.shape[-1]
    stride = x.stride(-2)
    expected = stride * x.shape[-2]
    for d in range(x.dim() - 3, -1, -1):
        if x.stride(d) != expected:
            return None
        expected *= x.shape[d]
    return stride


def _format(what: str, q: Tensor, fp8_dtype: torch.dtype) -> tuple[float, bool]:
    """(bound, e4m3fnuz) of ``fp8_dtype``; ``q`` holds its bytes (uint8, so that no view is
    created inside the ops: compiled graphs see the kernels write their arguments)."""
    fmt = FORMATS.get(fp8_dtype)
    _check(what, fmt is not None, f"fp8_dtype {fp8_dtype} is not float8_e4m3fn or float8_e4m3fnuz")
    _check(what, q.dtype == torch.uint8, f"q must hold the fp8 bytes as uint8, got {q.dtype}")
    return fmt


def _check(what: str, ok: bool, detail: str) -> None:
    if not ok:
        raise ValueError(f"vllm_ir_triton::{what}: {detail}")


def _min_scale(bound: float) -> float:
    """The minimum dynamic scale, ``1 / (fp8_max * 512)``."""
    return 1.0 / (bound * 512.0)


def _tiles(n_rows: int, n_cols: int) -> tuple[int, int, int, int]:
    """(programs, col_blocks, BLOCK_R, BLOCK_C); the tile depends on the row length only."""
    block_c = min(MAX_BLOCK, max(16, triton.next_power_of_2(n_cols)))
    block_r = max(1, TILE // block_c)
    col_blocks = triton.cdiv(n_cols, block_c)
    return triton.cdiv(n_rows, block_r) * col_blocks, col_blocks, block_r, block_c


def _x_rows(what: str, x: Tensor) -> tuple[int, int, int]:
    """(rows, cols, row stride) of ``x``; a ValueError when it has no single row stride."""
    stride = rows_stride(x)
    _check(
        what,
        stride is not None,
        f"x of shape {list(x.shape)} and strides {list(x.stride())} is not rows with one row stride",
    )
    cols = x.shape[-1]
    return (x.numel() // cols if cols else 0), cols, stride


def _q_rows(what: str, q: Tensor, x: Tensor) -> int:
    _check(what, q.is_contiguous(), "q must be contiguous")
    same = tuple(q.shape) == tuple(x.shape)
    padded = x.dim() == 2 and q.dim() == 2 and q.shape[1] == x.shape[1] and q.shape[0] >= x.shape[0]
    _check(what, same or padded, f"q of shape {list(q.shape)} for x of shape {list(x.shape)}")
    return max(x.shape[-1], 1) if x.dim() else 1


@triton_op("vllm_ir_triton::static_quant_fp8_out", mutates_args={"q"})
def static_quant_fp8_out(
    q: Tensor, x: Tensor, scale: Tensor, group_r: int, group_c: int, fp8_dtype: torch.dtype
) -> None:
    """``q = fp8(clamp(x / scale))`` where ``scale`` is 2-D and ``scale[i // group_r, j // group_c]``
    covers ``x``'s element (i, j) of its rows (a stride-0 scale for per-tensor or per-channel)."""
    what = "static_quant_fp8_out"
    bound, fnuz = _format(what, q, fp8_dtype)
    rows, cols, x_stride = _x_rows(what, x)
    q_stride = _q_rows(what, q, x)
    _check(
        what,
        scale.dim() == 2 and scale.dtype == torch.float32,
        f"scale must be 2-D float32, got {scale.dtype} {list(scale.shape)}",
    )
    _check(what, group_r >= 1 and group_c >= 1, f"group sizes ({group_r}, {group_c}) must be >= 1")
    if rows == 0 or cols == 0:
        return
    programs, col_blocks, block_r, block_c = _tiles(rows, cols)
    min_scale = _min_scale(bound)
    wrap_triton(_static_kernel)[(programs,)](
        q, x, scale, scale, scale, x_stride, q_stride, rows, cols, col_blocks,
        scale.stride(0), scale.stride(1), group_r, group_c, min_scale,
        BOUND=bound, FNUZ=fnuz, FROM_ABSMAX=False, HAS_UB=False, BLOCK_R=block_r, BLOCK_C=block_c,
    )  # fmt: skip


@triton_op("vllm_ir_triton::dynamic_quant_fp8_out", mutates_args={"q", "scale"})
def dynamic_quant_fp8_out(
    q: Tensor, scale: Tensor, x: Tensor, scale_ub: Tensor | None, per_token: bool, fp8_dtype: torch.dtype
) -> None:
    """Dynamic quantization into ``q`` and ``scale`` (``[rows]`` elements per token, else 1)."""
    what = "dynamic_quant_fp8_out"
    bound, fnuz = _format(what, q, fp8_dtype)
    rows, cols, x_stride = _x_rows(what, x)
    q_stride = _q_rows(what, q, x)
    _check(what, scale.dtype == torch.float32 and scale.is_contiguous(), "scale must be contiguous float32")
    _check(what, scale.numel() == (rows if per_token else 1), f"scale has {scale.numel()} elements for {rows} rows")
    if scale_ub is not None:
        _check(what, scale_ub.numel() == 1 and scale_ub.dtype == torch.float32, "scale_ub must be one float32 element")
    min_scale = _min_scale(bound)
    ub = scale_ub if scale_ub is not None else scale
    if per_token:
        _check(what, cols > 0 or rows == 0, "per-token scales of rows with no elements")
        if rows == 0:
            return
        block_c = min(MAX_BLOCK, max(16, triton.next_power_of_2(cols)))
        block_r = max(1, TILE // block_c)
        wrap_triton(_per_token_kernel)[(triton.cdiv(rows, block_r),)](
            q, scale, x, ub, x_stride, q_stride, rows, cols, min_scale,
            BOUND=bound, FNUZ=fnuz, HAS_UB=scale_ub is not None, BLOCK_R=block_r, BLOCK_C=block_c,
        )  # fmt: skip
        return
    absmax = torch.zeros(1, dtype=torch.int32, device=x.device)
    programs, col_blocks, block_r, block_c = _tiles(rows, cols)
    if rows and cols:
        wrap_triton(_absmax_kernel)[(programs,)](
            absmax, x, x_stride, rows, cols, col_blocks, BLOCK_R=block_r, BLOCK_C=block_c
        )
    # At least one program: it stores the scale even for an empty x (absmax 0).
    wrap_triton(_static_kernel)[(max(programs, 1),)](
        q, x, absmax, ub, scale, x_stride, q_stride, rows, cols, col_blocks,
        0, 0, 1, 1, min_scale,
        BOUND=bound, FNUZ=fnuz, FROM_ABSMAX=True, HAS_UB=scale_ub is not None,
        BLOCK_R=block_r, BLOCK_C=block_c,
    )  # fmt: skip


@triton_op("vllm_ir_triton::group_quant_fp8_out", mutates_args={"q", "scales"})
def group_quant_fp8_out(
    q: Tensor, scales: Tensor, x: Tensor, group_size: int, use_ue8m0: bool, fp8_dtype: torch.dtype
) -> None:
    """Per-group quantization into ``q`` (x's shape) and ``scales`` (``[*x.shape[:-1], groups]``,
    any strides whose leading dimensions collapse: row-major or column-major)."""
    what = "group_quant_fp8_out"
    bound, fnuz = _format(what, q, fp8_dtype)
    rows, cols, x_stride = _x_rows(what, x)
    _check(what, q.is_contiguous() and q.shape == x.shape, f"q of shape {list(q.shape)} must be contiguous, x's shape")
    _check(what, 1 <= group_size <= MAX_GROUP, f"group_size {group_size} is not in [1, {MAX_GROUP}]")
    groups = -(-cols // group_size)
    _check(
        what,
        scales.dtype == torch.float32 and tuple(scales.shape) == (*x.shape[:-1], groups),
        f"scales {scales.dtype} {list(scales.shape)} for x {list(x.shape)} in groups of {group_size}",
    )
    if rows == 0 or cols == 0:
        return
    inner_rows = x.shape[-2] if x.dim() >= 2 else 1
    s_row = scales.stride(-2) if x.dim() >= 2 else 0
    s_batch = scales.stride(-3) if x.dim() >= 3 else 0
    expected = s_batch * (x.shape[-3] if x.dim() >= 3 else 1)
    for d in range(x.dim() - 4, -1, -1):
        _check(what, scales.stride(d) == expected, "the scales' leading dimensions must collapse (one batch stride)")
        expected *= x.shape[d]
    n_pairs = rows * groups
    block_g = max(16, triton.next_power_of_2(group_size))
    block_p = max(1, TILE // block_g)
    min_scale = _min_scale(bound)
    wrap_triton(_group_kernel)[(triton.cdiv(n_pairs, block_p),)](
        q, scales, x, x_stride, cols, n_pairs, groups, cols, group_size, inner_rows,
        s_batch, s_row, scales.stride(-1), min_scale,
        BOUND=bound, FNUZ=fnuz, UE8M0=use_ue8m0, BLOCK_P=block_p, BLOCK_G=block_g,
    )  # fmt: skip


__all__ = ["dynamic_quant_fp8_out", "group_quant_fp8_out", "rows_stride", "static_quant_fp8_out"]
