"""The activation catalogue in Triton: one gated kernel and one elementwise kernel, each
specialized at compile time by a constexpr activation id (no per-op copies of the kernels).

Both run one program per (row, block of output columns), flattened into a 1-D grid: a
contiguous tensor of any rank is rows of its last dimension (the elementwise kernel views it
as a single row), a 2-D tensor with a unit inner stride is rows ``row_stride`` apart (row
slices of a wider buffer, or a stride-0 broadcast). Outputs are fresh and contiguous.

Values are cast to fp32 at load and to the output dtype at store (the Triton CPU interpreter's
bf16 arithmetic yields NaN). Gated ops round where the op's definition rounds -- the
activation to x's dtype before the multiply, and every step of ``swigluoai_and_mul`` -- so
that kernels whose arithmetic is exact (``fatrelu_and_mul``) are bit-identical to native and
the others differ only where exp/erf implementations differ. In the gated tanh GELU,
``x * sigmoid(2y)`` stands for ``0.5 x (1 + tanh(y))`` (the same function): it needs no tanh,
which Triton's core language lacks. ``gelu_new`` and ``gelu_fast`` are vLLM's expressions op
for op, each step rounded to x's dtype, with `_tanh` (an exp-based tanh with a series near 0).
``gelu_and_mul_sparse`` has its own row kernel (one program per row: the gate's mean and std
first, then the activation), as vLLM's Triton kernel.

The kernels are exposed as ``torch.library.triton_op``s in the ``vllm_ir_triton`` namespace
so the vllm-ir lowering pass traces them into compiled graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

# Gated activations (``activation`` of `gated_activation_out`).
SILU = tl.constexpr(0)
GELU = tl.constexpr(1)  # erf form, F.gelu(approximate="none")
GELU_TANH = tl.constexpr(2)
#: threshold compared in float32 (PyTorch's CPU F.threshold)
FATRELU = tl.constexpr(3)
#: threshold rounded to x's dtype first (PyTorch's CUDA and XPU F.threshold)
FATRELU_DTYPE_THRESHOLD = tl.constexpr(4)
SWIGLUOAI = tl.constexpr(5)  # p0 = alpha, p1 = limit; every step rounded to x's dtype

# Where gate and up are in a row of 2d values (``layout`` of `gated_activation_out`).
GATE_FIRST = tl.constexpr(0)  # [gate | up]
GATE_SECOND = tl.constexpr(1)  # [up | gate] (mul_and_silu)
INTERLEAVED = tl.constexpr(2)  # gate at even, up at odd positions (GPT-OSS)

# Elementwise activations (``activation`` of `elementwise_activation_out`).
GELU_NEW = tl.constexpr(0)
GELU_FAST = tl.constexpr(1)
QUICK_GELU = tl.constexpr(2)
RELU2 = tl.constexpr(3)

_GATED_IDS = range(6)
#: Widest gate ``gelu_and_mul_sparse_out`` takes (one program holds a row's gate and up).
MAX_SPARSE_D = 32768
_LAYOUTS = range(3)
_ELEMENTWISE_IDS = range(4)

#: Columns per program at most; narrower rows get the next power of two (>= 16).
MAX_BLOCK = 1024
#: Elements per program: rows narrower than MAX_BLOCK are stacked up to this many.
TILE = 1024


@triton.jit
def _round(v, DTYPE: tl.constexpr):
    """``v`` rounded to ``DTYPE`` (to nearest even) and widened again: a rounding point of the op.

    bfloat16 is rounded with integer ops: the CPU interpreter truncates fp32 -> bf16 casts
    (and mishandles subnormals); on GPUs this is the rounding the cast does. NaNs pass as is.
    """
    if DTYPE == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        r = tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    else:
        r = v.to(DTYPE).to(tl.float32)
    return r


@triton.jit
def _cast(v, DTYPE: tl.constexpr):
    """``v`` converted to ``DTYPE`` for a store, rounded as `_round` rounds (bf16: bit for bit)."""
    if DTYPE == tl.bfloat16:
        r = (_round(v, DTYPE).to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        r = v.to(DTYPE)
    return r


@triton.jit
def _times_sigmoid(v, s):
    """``v * sigmoid(s)`` in fp32; ``v / inf`` gives the signed zero the tanh form gives."""
    return v / (1.0 + tl.exp(-s))


@triton.jit
def _tanh(u):
    """tanh in fp32: an odd series for |u| < 1/4 (no cancellation), else (1 - e) / (1 + e), e = exp(-2|u|)."""
    a = tl.abs(u)
    u2 = u * u
    series = u * (
        1.0 + u2 * (-1.0 / 3 + u2 * (2.0 / 15 + u2 * (-17.0 / 315 + u2 * (62.0 / 2835 + u2 * (-1382.0 / 155925)))))
    )
    e = tl.exp(-2.0 * a)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(a < 0.25, series, tl.where(u < 0.0, -t, t))


@triton.jit
def _half_x_one_plus_tanh(x, u, DTYPE: tl.constexpr):
    """``0.5 * x * (1 + tanh(u))`` after u, each step rounded to ``DTYPE`` as torch's ops round it."""
    return _round(0.5 * x, DTYPE) * _round(1.0 + _round(_tanh(u), DTYPE), DTYPE)


@triton.jit
def _gate_activation(g, p0, ACT: tl.constexpr, DTYPE: tl.constexpr):
    """The activation of the gate (fp32 in, fp32 out) for every gated op but swigluoai."""
    if ACT == SILU:
        a = _times_sigmoid(g, g)
    elif ACT == GELU:
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    elif ACT == GELU_TANH:
        a = _times_sigmoid(g, 2.0 * (0.7978845608028654 * (g + 0.044715 * g * g * g)))
    else:  # FATRELU, FATRELU_DTYPE_THRESHOLD: F.threshold keeps NaN (NaN <= t is false)
        threshold = tl.cast(p0, tl.float32)  # a Python float in the interpreter
        if ACT == FATRELU_DTYPE_THRESHOLD:
            threshold = _round(threshold, DTYPE)
        a = tl.where(g <= threshold, 0.0, g)
    return a


@triton.jit
def _swigluoai(gate, up, alpha, limit, DTYPE: tl.constexpr):
    """GPT-OSS's clamped SwiGLU, rounding to ``DTYPE`` after each step as the op does."""
    alpha = tl.cast(alpha, tl.float32)
    limit = tl.cast(limit, tl.float32)
    g = _round(tl.where(gate > limit, limit, gate), DTYPE)  # comparisons keep NaN, as clamp does
    u = _round(tl.where(up > limit, limit, tl.where(up < -limit, -limit, up)), DTYPE)
    s = _round(_times_sigmoid(1.0, _round(g * alpha, DTYPE)), DTYPE)
    return _round(u + 1.0, DTYPE) * _round(g * s, DTYPE)


@triton.jit
def _tile(n_rows, n_cols, col_blocks, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's [BLOCK_R, BLOCK_C] tile of an [n_rows, n_cols] grid: (rows, cols, mask)."""
    pid = tl.program_id(0).to(tl.int64)
    rows = (pid // col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid % col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return rows[:, None], cols[None, :], mask


@triton.jit
def _gated_kernel(
    out_ptr,
    x_ptr,
    out_row_stride,
    x_row_stride,
    n_rows,
    d,
    col_blocks,
    p0,
    p1,
    ACT: tl.constexpr,
    LAYOUT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, d, col_blocks, BLOCK_R, BLOCK_C)
    x_row = x_ptr + rows * x_row_stride
    if LAYOUT == INTERLEAVED:  # one contiguous load of (gate, up) pairs, split in registers
        pair_ptrs = (x_row + 2 * cols)[:, :, None] + tl.arange(0, 2)[None, None, :]
        pairs = tl.load(pair_ptrs, mask=mask[:, :, None], other=0.0)
        gate, up = tl.split(pairs.to(tl.float32))
    else:
        gate_offset = d if LAYOUT == GATE_SECOND else 0
        gate = tl.load(x_row + gate_offset + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + (d - gate_offset) + cols, mask=mask, other=0.0).to(tl.float32)
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    if ACT == SWIGLUOAI:
        y = _swigluoai(gate, up, p0, p1, DTYPE)
    else:
        y = _round(_gate_activation(gate, p0, ACT, DTYPE), DTYPE) * up
    tl.store(out_ptr + rows * out_row_stride + cols, _cast(y, DTYPE), mask=mask)


@triton.jit
def _elementwise_kernel(
    out_ptr,
    x_ptr,
    out_row_stride,
    x_row_stride,
    n_rows,
    n_cols,
    col_blocks,
    ACT: tl.constexpr,
    CUBE_ROUNDS_SQUARE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, col_blocks, BLOCK_R, BLOCK_C)
    x = tl.load(x_ptr + rows * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    if ACT == GELU_NEW:  # 0.5 * x * (1 + tanh(c * (x + 0.044715 * pow(x, 3.0))))
        if CUBE_ROUNDS_SQUARE:
            cube = _round(_round(x * x, DTYPE) * x, DTYPE)
        else:
            cube = _round(x * x * x, DTYPE)
        u = _round(0.7978845608028654 * _round(x + _round(0.044715 * cube, DTYPE), DTYPE), DTYPE)
        y = _half_x_one_plus_tanh(x, u, DTYPE)
    elif ACT == GELU_FAST:  # 0.5 * x * (1 + tanh(x * 0.7978845608 * (1 + 0.044715 * x * x)))
        e = _round(1.0 + _round(_round(0.044715 * x, DTYPE) * x, DTYPE), DTYPE)
        y = _half_x_one_plus_tanh(x, _round(_round(x * 0.7978845608, DTYPE) * e, DTYPE), DTYPE)
    elif ACT == QUICK_GELU:
        y = _times_sigmoid(x, 1.702 * x)
    else:  # RELU2: NaN < 0 is false, so NaN stays NaN
        r = tl.where(x < 0.0, 0.0, x)
        y = r * r
    tl.store(out_ptr + rows * out_row_stride + cols, _cast(y, DTYPE), mask=mask)


@triton.jit
def _gelu_and_mul_sparse_kernel(
    out_ptr,
    x_ptr,
    x_row_stride,
    d,
    std_multiplier,
    TANH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row: ``gelu(relu(gate - (mean + std * std_multiplier))) * up``, rounded as native rounds.

    The mean and the population std are reduced in fp32 (native: ATen's fp32 sum, and a double
    std), then each is rounded to the dtype, as are ``std * std_multiplier``, the cutoff, the
    difference, and the activation before the multiply.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    x_row = x_ptr + row * x_row_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    mean = tl.sum(gate, axis=0) / d
    centered = tl.where(mask, gate - mean, 0.0)
    std = tl.sqrt(tl.sum(centered * centered, axis=0) / d)
    scaled = _round(_round(std, DTYPE) * tl.cast(std_multiplier, tl.float32), DTYPE)
    cutoff = _round(_round(mean, DTYPE) + scaled, DTYPE)
    s = _round(gate - cutoff, DTYPE)
    s = tl.where(s < 0.0, 0.0, s)  # relu; NaN < 0 is false, so NaN stays
    if TANH:
        a = _times_sigmoid(s, 2.0 * (0.7978845608028654 * (s + 0.044715 * s * s * s)))
    else:
        a = 0.5 * s * (1.0 + tl.math.erf(s * 0.7071067811865476))
    up = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * d + cols, _cast(_round(a, DTYPE) * up, DTYPE), mask=mask)


def _tiles(n_rows: int, n_cols: int) -> tuple[int, int, int, int]:
    """(programs, col_blocks, BLOCK_R, BLOCK_C): tiles of up to `TILE` elements, at most
    `MAX_BLOCK` columns wide; short rows are stacked so a program still gets a full tile.
    The tile shape depends on the row length only, never on the number of rows."""
    block_c = min(MAX_BLOCK, max(16, triton.next_power_of_2(n_cols)))
    block_r = max(1, TILE // block_c)
    col_blocks = triton.cdiv(n_cols, block_c)
    return triton.cdiv(n_rows, block_r) * col_blocks, col_blocks, block_r, block_c


def _row_stride(x: Tensor) -> int:
    """Elements between rows of ``x`` viewed as [rows, x.shape[-1]].

    A contiguous tensor's rows are ``shape[-1]`` apart whatever the strides of its size-1
    dimensions say (PyTorch ignores those); otherwise ``x`` is 2-D with a unit inner stride.
    """
    return x.shape[-1] if x.is_contiguous() else x.stride(0)


def _check(what: str, ok: bool, detail: str) -> None:
    if not ok:
        raise ValueError(f"vllm_ir_triton::{what}: {detail}")


@triton_op("vllm_ir_triton::gated_activation_out", mutates_args={"out"})
def gated_activation_out(out: Tensor, x: Tensor, activation: int, layout: int, p0: float, p1: float) -> None:
    """``out[..., d] = act(gate) * up`` from ``x[..., 2d]`` (see the module's activation and layout ids).

    ``x`` is contiguous or 2-D with a unit inner stride; ``out`` is contiguous.
    """
    _check("gated_activation_out", activation in _GATED_IDS, f"unknown activation id {activation}")
    _check("gated_activation_out", layout in _LAYOUTS, f"unknown layout id {layout}")
    _check("gated_activation_out", x.dim() >= 1 and x.shape[-1] % 2 == 0, f"x of shape {list(x.shape)}")
    d = x.shape[-1] // 2
    _check("gated_activation_out", out.shape == (*x.shape[:-1], d), f"out {list(out.shape)} for x {list(x.shape)}")
    _check("gated_activation_out", out.is_contiguous(), "out must be contiguous")
    _check(
        "gated_activation_out",
        x.is_contiguous() or (x.dim() == 2 and x.stride(-1) == 1),
        "x must be contiguous, or 2-D rows with a unit inner stride",
    )
    rows = out.numel() // d if d else 0
    if rows == 0:
        return
    programs, col_blocks, block_r, block_c = _tiles(rows, d)
    wrap_triton(_gated_kernel)[(programs,)](
        out, x, d, _row_stride(x), rows, d, col_blocks, p0, p1,
        ACT=activation, LAYOUT=layout, BLOCK_R=block_r, BLOCK_C=block_c,
    )  # fmt: skip


@triton_op("vllm_ir_triton::gelu_and_mul_sparse_out", mutates_args={"out"})
def gelu_and_mul_sparse_out(out: Tensor, x: Tensor, std_multiplier: float, tanh: bool) -> None:
    """``out[..., d] = gelu_and_mul_sparse(x[..., 2d])`` (``tanh``: approximate="tanh"), one program per row.

    ``x`` is contiguous or 2-D with a unit inner stride, ``d <= MAX_SPARSE_D``; ``out`` is contiguous.
    """
    what = "gelu_and_mul_sparse_out"
    _check(what, x.dim() >= 1 and x.shape[-1] % 2 == 0, f"x of shape {list(x.shape)}")
    d = x.shape[-1] // 2
    _check(what, d <= MAX_SPARSE_D, f"the gate has {d} columns (at most {MAX_SPARSE_D})")
    _check(what, out.shape == (*x.shape[:-1], d), f"out {list(out.shape)} for x {list(x.shape)}")
    _check(what, out.is_contiguous(), "out must be contiguous")
    _check(
        what,
        x.is_contiguous() or (x.dim() == 2 and x.stride(-1) == 1),
        "x must be contiguous, or 2-D rows with a unit inner stride",
    )
    rows = out.numel() // d if d else 0
    if rows == 0:
        return
    block = max(16, triton.next_power_of_2(d))
    wrap_triton(_gelu_and_mul_sparse_kernel)[(rows,)](
        out, x, _row_stride(x), d, std_multiplier, TANH=tanh, BLOCK=block, num_warps=min(max(block // 256, 1), 8)
    )


@triton_op("vllm_ir_triton::elementwise_activation_out", mutates_args={"out"})
def elementwise_activation_out(out: Tensor, x: Tensor, activation: int) -> None:
    """``out = act(x)`` for ``x`` contiguous (one flat row) or 2-D with a unit inner stride.

    ``pow(x, 3.0)`` in gelu_new rounds x * x to x's dtype before the product with x wherever
    native's does: bf16 on every device, fp16 off the CPU (ATen's CPU fp16 pow rounds the cube once).
    """
    _check("elementwise_activation_out", activation in _ELEMENTWISE_IDS, f"unknown activation id {activation}")
    _check("elementwise_activation_out", out.shape == x.shape, f"out {list(out.shape)} for x {list(x.shape)}")
    _check("elementwise_activation_out", out.is_contiguous(), "out must be contiguous")
    if x.numel() == 0:
        return
    if x.is_contiguous():
        rows, cols, x_stride = 1, x.numel(), 0
    else:
        _check(
            "elementwise_activation_out",
            x.dim() == 2 and x.stride(-1) == 1,
            "x must be contiguous, or 2-D rows with a unit inner stride",
        )
        rows, cols, x_stride = x.shape[0], x.shape[1], x.stride(0)
    programs, col_blocks, block_r, block_c = _tiles(rows, cols)
    cube_rounds_square = x.dtype == torch.bfloat16 or (x.dtype == torch.float16 and x.device.type != "cpu")
    wrap_triton(_elementwise_kernel)[(programs,)](
        out, x, cols, x_stride, rows, cols, col_blocks,
        ACT=activation, CUBE_ROUNDS_SQUARE=cube_rounds_square, BLOCK_R=block_r, BLOCK_C=block_c,
    )  # fmt: skip


__all__ = ["elementwise_activation_out", "gated_activation_out", "gelu_and_mul_sparse_out", "torch"]
