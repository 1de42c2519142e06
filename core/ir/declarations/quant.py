"""FP8 quantization: static (given scales), dynamic (per-tensor / per-token) and per-group.

Conventions (vLLM's, see shared/OPS.md 4.3-4.6): scales are float32 and dequantize as
``x ~ q.float() * scale``; conversion is clamp to the fp8 range, then a round-to-nearest-even
cast. ``float8_e4m3fn`` clamps to +-448, ``float8_e4m3fnuz`` to +-224 as vLLM does on ROCm
(torch's finfo says 240, which vLLM found to lose accuracy). Dynamic scales never go below
``1 / (fp8_max * 512)``.

Choices where vLLM's kernels and its native code differ (kernels may match native exactly; the
conformance kit compares others by dequantized values, `vllm_ir.Comparison.dequantized`):

- every op multiplies by the scale's reciprocal (vLLM's static and per-token native and its
  static kernels do; its native group quant and dynamic CUDA kernels divide, which differs by
  one fp8 step on 0.052% of bf16 codes, 0.006% of fp16 and none of fp32: [512, 4096] N(0, 1),
  groups of 128; the vllm_c table path is built on the reciprocal, so it is kept, and the
  conformance kit's dequantized comparison allows 0.2%);
- the group op's UE8M0 scale is the exact power-of-two ceiling of ``absmax / fp8_max`` (from
  the float's bits; vLLM's ``exp2(ceil(log2(s)))`` equals it except where ``log2`` rounds);
- the group op's floor is native vLLM's ``1 / (fp8_max * 512)``, applied before the UE8M0
  rounding as vLLM's native does, so a UE8M0 scale is always a power of two (2^-17 for
  e4m3fn, 2^-16 for e4m3fnuz at the floor; vLLM's kernels floor with ``1e-10 / fp8_max``: only
  groups whose absmax is below the floor get other scales, and their q is the same);
- ``num_token_padding`` pads q's rows with zeros (2-D x only); kernels may leave those rows
  unwritten, so they are unspecified (the kit compares the first ``x.shape[0]`` rows).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vllm_ir.ir.comparison import Comparison
from vllm_ir.ir.impl import Unsupported
from vllm_ir.ir.op import register_op

#: The fp8 dtypes these ops produce, with the range they clamp to.
FP8_RANGES: dict[torch.dtype, float] = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e4m3fnuz: 224.0,
}


def fp8_max(fp8_dtype: torch.dtype, op: str) -> float:
    """The clamp bound for ``fp8_dtype``; a ValueError naming ``op`` for any other dtype."""
    bound = FP8_RANGES.get(fp8_dtype)
    if bound is None:
        known = ", ".join(str(d) for d in FP8_RANGES)
        raise ValueError(f"{op}: fp8_dtype must be one of {known}, got {fp8_dtype}")
    return bound


def min_scale(fp8_dtype: torch.dtype, op: str) -> float:
    """The smallest dynamic scale, ``1 / (fp8_max * 512)`` (vLLM's FP8_MIN_SCALING_FACTOR)."""
    return 1.0 / (fp8_max(fp8_dtype, op) * 512.0)


def broadcast_scale(scale: Tensor, x: Tensor, op: str = "static_quant_fp8") -> Tensor:
    """``scale`` (float32) expanded to broadcast against ``x``, following vLLM's group_broadcast.

    One element (any rank): per-tensor. Otherwise the scale has x's rank and each of its sizes
    divides x's: every scale covers a block of x (``[T, 1]`` per-token, ``[1, K]``
    per-channel, ``[T, K/128]``, ``[T/128, K/128]``, ...). A 1-D scale of several elements for
    an x of two or more dimensions is refused: vLLM reads one through the ``group_shape`` of
    its ``QuantFP8`` (``PER_TOKEN`` makes it ``[T, 1]``, ``PER_CHANNEL`` ``[1, K]``), which this
    op does not take, and guessing from the length gives a per-token scale of a square x to
    the columns.
    """
    scale = scale.to(torch.float32)
    if scale.numel() == 1:
        return scale.reshape(())
    if x.dim() == 0:
        raise ValueError(f"{op}: x is 0-d but the scale has {scale.numel()} elements")
    if scale.dim() == 1 and x.dim() > 1:
        raise ValueError(
            f"{op}: a 1-D scale of {scale.shape[0]} elements is ambiguous (per token or per channel?); "
            f"pass it as [T, 1] per token (vLLM's QuantFP8(static, PER_TOKEN): scale.reshape(-1, 1)) or as "
            "[1, K] per channel (scale.reshape(1, -1))"
        )
    if scale.dim() != x.dim():
        raise ValueError(f"{op}: scale of shape {list(scale.shape)} does not group x of shape {list(x.shape)}")
    for d in range(x.dim()):
        size, groups = x.shape[d], scale.shape[d]
        if size == groups:
            continue
        if groups == 0 or size % groups:
            raise ValueError(
                f"{op}: scale of shape {list(scale.shape)} does not divide x of shape {list(x.shape)} "
                f"along dimension {d}"
            )
        scale = scale.repeat_interleave(size // groups, dim=d)
    return scale


def _over_bound(absmax: Tensor, bound: float) -> Tensor:
    """``absmax / bound`` as an IEEE division on every device.

    ``tensor / python_float`` is not: on CUDA torch multiplies by the float reciprocal of the
    scalar (one ulp off in some scales), on CPU it divides; dividing by a 0-d tensor on
    absmax's device divides everywhere, as the kernels do.
    """
    return absmax / absmax.new_full((), bound)


def _quantize(xf: Tensor, inverse_scale: Tensor, fp8_dtype: torch.dtype, bound: float) -> Tensor:
    return (xf * inverse_scale).clamp(-bound, bound).to(fp8_dtype)


def padding_verdict(x: Tensor, num_token_padding: int | None) -> bool | Unsupported:
    """What a kernel's predicate says where `_pad_tokens` raises: padding of a non-2-D x."""
    if num_token_padding is not None and x.dim() != 2:
        return Unsupported(f"num_token_padding with a {x.dim()}-D x (padding applies to 2-D x; native raises)")
    return True


def fp8_verdict(fp8_dtype: torch.dtype) -> bool | Unsupported:
    """A kernel's predicate of the fp8 dtype (the fused ops' too): one of `FP8_RANGES`, as native takes."""
    if fp8_dtype not in FP8_RANGES:
        return Unsupported(f"fp8_dtype {fp8_dtype} is not float8_e4m3fn or float8_e4m3fnuz (native raises)")
    return True


def float32_verdict(x: Tensor, name: str, t: Tensor) -> bool | Unsupported:
    """Whether ``t`` (the parameter ``name``, a scale or a bound) is float32 on x's device, as the
    kernels read scales; not a predicate itself (it takes the name)."""
    if t.dtype != torch.float32:
        return Unsupported(f"{name} dtype {t.dtype} is not float32")
    if t.device != x.device:
        return Unsupported(f"{name} is on {t.device}, x on {x.device}")
    return True


def scale_verdict(x: Tensor, scale: Tensor) -> bool | Unsupported:
    """A static scale float32 on x's device, and not one `broadcast_scale` refuses as ambiguous
    (the ranks and groupings a kernel takes beyond that are its own)."""
    verdict = float32_verdict(x, "scale", scale)
    if verdict and scale.dim() == 1 and scale.numel() != 1 and x.dim() > 1:
        return Unsupported(f"a 1-D scale of {scale.numel()} elements (ambiguous: native refuses it)")
    return verdict


def scale_ub_verdict(x: Tensor, scale_ub: Tensor | None) -> bool | Unsupported:
    """No bound, or one float32 element (0-d or 1-D) on x's device (the fused ops' too)."""
    if scale_ub is None:
        return True
    verdict = float32_verdict(x, "scale_ub", scale_ub)
    if verdict and (scale_ub.dim() > 1 or scale_ub.numel() != 1):
        return Unsupported(
            f"scale_ub of shape {list(scale_ub.shape)} (the kernels take one element, 0-d or 1-D; "
            "native broadcasts the scale's shape to it)"
        )
    return verdict


def group_size_verdict(group_size: int) -> bool | Unsupported:
    """A group size native takes (the fused group ops' too); a kernel's upper limit is its own."""
    return group_size >= 1 or Unsupported(f"group_size {group_size} < 1 (native raises)")


def column_major_verdict(x: Tensor, column_major: bool) -> bool | Unsupported:
    """Row-major scales, or column-major ones of an x of 2 or more dimensions (the fused ops' too)."""
    if column_major and x.dim() < 2:
        return Unsupported("column_major scales of a 1-D x (native raises)")
    return True


def padded_shape(x: Tensor, num_token_padding: int | None) -> tuple[int, ...]:
    """q's shape for a kernel: x's, or at least ``num_token_padding`` rows of a 2-D x (a kernel may
    leave the rows past x's unwritten; `_pad_tokens` zeroes them)."""
    if num_token_padding is None:
        return tuple(x.shape)
    return (max(x.shape[0], num_token_padding), x.shape[1])


def _pad_tokens(q: Tensor, num_token_padding: int | None, op: str) -> Tensor:
    if num_token_padding is None:
        return q
    if q.dim() != 2:
        raise ValueError(f"{op}: num_token_padding needs a 2-D x, got {q.dim()}-D")
    extra = num_token_padding - q.shape[0]
    return torch.nn.functional.pad(q.view(torch.uint8), (0, 0, 0, extra)).view(q.dtype) if extra > 0 else q


@register_op(token_params=("x", "scale"))
def static_quant_fp8(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, num_token_padding: int | None = None) -> Tensor:
    """``clamp(x * (1 / scale), -fp8_max, fp8_max)`` cast to ``fp8_dtype``, in float32.

    ``scale`` is per-tensor (one element), per-token ``[T, 1]``, per-channel ``[1, K]`` or a
    2-D group scale, always of x's rank beyond one element (see `broadcast_scale`: a 1-D scale
    of several elements is refused as ambiguous). With ``num_token_padding`` q has at least
    that many rows, the extra ones zero. vLLM: ``QuantFP8(static=True, group_shape)
    .forward_native`` (its per-tensor, per-token and per-channel group shapes), bit for bit.
    """
    bound = fp8_max(fp8_dtype, "static_quant_fp8")
    inverse = broadcast_scale(scale, x).reciprocal()
    q = _quantize(x.to(torch.float32), inverse, fp8_dtype, bound)
    return _pad_tokens(q, num_token_padding, "static_quant_fp8")


@register_op
def dynamic_quant_fp8(
    x: Tensor,
    per_token: bool,
    fp8_dtype: torch.dtype,
    scale_ub: Tensor | None = None,
    num_token_padding: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``(q, scale)`` with ``scale = max(min(absmax, scale_ub) / fp8_max, 1 / (fp8_max * 512))``.

    vLLM: ``QuantFP8(static=False, PER_TOKEN or PER_TENSOR).forward_native``, bit for bit (NaN
    aside: vLLM's per-tensor absmax is ``max()``, whose NaN has the sign bit set). vLLM takes
    ``scale_ub`` per token only; here it bounds the per-tensor absmax too.

    The absmax is per row (``scale`` of shape ``[*x.shape[:-1], 1]``) or over the whole tensor
    (shape ``[1]``; an empty x has absmax 0); ``scale_ub`` bounds it in both modes. q is
    `static_quant_fp8` of x with that scale.
    """
    op = "dynamic_quant_fp8"
    bound = fp8_max(fp8_dtype, op)
    xf = x.to(torch.float32)
    if per_token:
        absmax = xf.abs().amax(dim=-1, keepdim=True)
    else:
        absmax = xf.abs().amax().reshape(1) if x.numel() else xf.new_zeros(1)
    if scale_ub is not None:
        absmax = torch.minimum(absmax, scale_ub.to(torch.float32))
    scale = _over_bound(absmax, bound).clamp(min=min_scale(fp8_dtype, op))
    q = _quantize(xf, scale.reciprocal(), fp8_dtype, bound)
    return _pad_tokens(q, num_token_padding, op), scale


def pow2_ceil(s: Tensor) -> Tensor:
    """The smallest power of two >= ``s`` (float32, s >= 0), from the bits: UE8M0 scales.

    vLLM computes ``exp2(ceil(log2(s)))``; that equals this except where ``log2`` rounds an
    argument just above a power of two down to an integer. Zero stays zero, NaN and inf stay.
    """
    bits = s.view(torch.int32)
    inexact = (bits & 0x7FFFFF) != 0
    rounded = (((bits >> 23) + inexact.to(torch.int32)) << 23).view(torch.float32)
    return torch.where(torch.isfinite(s), rounded, s)


@register_op
def dynamic_group_quant_fp8(
    x: Tensor, group_size: int, column_major: bool, use_ue8m0: bool, fp8_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``(q, scales)``: one scale per ``group_size`` consecutive elements of each row.

    ``scales[..., g] = max(absmax(group g) / fp8_max, 1 / (fp8_max * 512))``, then rounded up
    to a power of two if ``use_ue8m0`` (so every UE8M0 scale is one: 2^-17 at e4m3fn's floor,
    as vLLM's ``QuantFP8`` native computes it); shape ``[*x.shape[:-1], ceil(K / group_size)]`` (a last
    partial group is quantized as if zero-padded). ``column_major``: the scales' last two
    dimensions are transposed in memory (strides ``(1, M)`` for 2-D x), as DeepGEMM reads them.

    vLLM: ``QuantFP8(static=False, GroupShape(1, group_size), use_ue8m0=...)
    ._quantize_group_native``, scales bit for bit; q too except that vLLM divides by the scale
    where this multiplies by its reciprocal (see the module docstring).
    """
    op = "dynamic_group_quant_fp8"
    bound = fp8_max(fp8_dtype, op)
    if group_size < 1:
        raise ValueError(f"{op}: group_size must be >= 1, got {group_size}")
    if x.dim() == 0:
        raise ValueError(f"{op}: x is 0-d")
    if column_major and x.dim() < 2:
        raise ValueError(f"{op}: column_major scales need x of 2 or more dimensions, got {x.dim()}-D")
    hidden = x.shape[-1]
    groups = math.ceil(hidden / group_size)
    xf = x.to(torch.float32)
    pad = groups * group_size - hidden
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    grouped = xf.unflatten(-1, (groups, group_size))
    # vLLM's order: the floor first, then the UE8M0 rounding (every UE8M0 scale a power of two).
    scale = _over_bound(grouped.abs().amax(dim=-1), bound).clamp(min=min_scale(fp8_dtype, op))
    if use_ue8m0:
        scale = pow2_ceil(scale)
    q = _quantize(grouped, scale.reciprocal().unsqueeze(-1), fp8_dtype, bound).flatten(-2)
    if pad:
        q = q[..., :hidden].contiguous()
    if column_major:
        scale = scale.transpose(-2, -1).contiguous().transpose(-2, -1)
    return q, scale


# -- test inputs and comparison --------------------------------------------------------------


def _activation(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, g: torch.Generator) -> Tensor:
    """N(0, 1) activations with a few outliers (x8), as real activations have."""
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    outliers = torch.rand(shape, generator=g) < 0.01
    return torch.where(outliers, x * 8, x).to(device=device, dtype=dtype)


@static_quant_fp8.input_generator
def _static_inputs(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    *,
    granularity: str = "tensor",
    group: tuple[int, int] = (1, 16),
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    num_token_padding: int | None = None,
    seed: int = 0,
) -> tuple:
    """x plus a scale 1.25x the absmax over each block (no clamping), for each granularity:
    ``tensor`` ([1]), ``token`` ([T, 1]), ``channel`` ([1, K]), ``group`` (2-D blocks of
    ``group`` = (rows, columns), clipped to x's size)."""
    g = torch.Generator().manual_seed(seed)
    x = _activation(shape, dtype, device, g)
    a = x.to(torch.float32).abs()
    bound = fp8_max(fp8_dtype, "static_quant_fp8")
    rows = a.reshape(-1, shape[-1]) if len(shape) else a.reshape(1, 1)

    def block_max(r: int, c: int) -> Tensor:
        t, k = rows.shape
        if t == 0:
            return rows.new_zeros(0, math.ceil(k / c))
        padded = torch.nn.functional.pad(rows, (0, -k % c, 0, -t % r))
        return padded.unflatten(1, (-1, c)).unflatten(0, (-1, r)).amax(dim=(1, 3))

    if granularity == "group" and len(shape) != 2:
        granularity = "tensor" if len(shape) < 2 else "token"  # 2-D blocks need a 2-D x
    if granularity == "tensor":
        m = a.max().reshape(1) if a.numel() else a.new_ones(1)
    elif granularity == "token":
        m = rows.amax(dim=-1, keepdim=True) if rows.shape[-1] else rows.new_ones(rows.shape[0], 1)
        m = m.reshape(*shape[:-1], 1)
    elif granularity == "channel":
        m = rows.amax(dim=0) if rows.shape[0] else rows.new_ones(rows.shape[1])
        m = m.reshape(*[1] * (len(shape) - 1), -1)
    elif granularity == "group":
        t, k = rows.shape
        r, c = max(1, min(group[0], t)), max(1, min(group[1], k))
        # Blocks must divide x: fall back to whole rows / columns where they do not.
        r = r if t % r == 0 else 1
        c = c if k % c == 0 else k
        m = block_max(r, c) if k else rows.new_ones(t, 1)
    else:
        raise ValueError(f"unknown granularity {granularity!r}")
    scale = (m.clamp(min=1e-3) * 1.25 / bound).to(device)
    return x, scale, fp8_dtype, _padding(shape, num_token_padding)


@dynamic_quant_fp8.input_generator
def _dynamic_inputs(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    *,
    per_token: bool = True,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    scale_ub: float | None = None,
    num_token_padding: int | None = None,
    seed: int = 0,
) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = _activation(shape, dtype, device, g)
    ub = None if scale_ub is None else torch.tensor([scale_ub], dtype=torch.float32, device=device)
    return x, per_token, fp8_dtype, ub, _padding(shape, num_token_padding)


def _padding(shape: tuple[int, ...], num_token_padding: int | None) -> int | None:
    """Padding applies to 2-D x only (other shapes get none rather than an error)."""
    return num_token_padding if len(shape) == 2 else None


@dynamic_group_quant_fp8.input_generator
def _group_inputs(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    *,
    group_size: int = 128,
    column_major: bool = False,
    use_ue8m0: bool = False,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    seed: int = 0,
) -> tuple:
    g = torch.Generator().manual_seed(seed)
    column_major = column_major and len(shape) >= 2  # a 1-D x has no column-major scales
    return _activation(shape, dtype, device, g), group_size, column_major, use_ue8m0, fp8_dtype


for _name, _options in {
    "per_token": {"granularity": "token"},
    "per_channel": {"granularity": "channel"},
    "group_1x16": {"granularity": "group", "group": (1, 16)},
    "group_2x32": {"granularity": "group", "group": (2, 32)},
    "e4m3fnuz": {"fp8_dtype": torch.float8_e4m3fnuz},
    "padded": {"num_token_padding": 8},
}.items():
    static_quant_fp8.add_input_variant(_name, **_options)

for _name, _options in {
    "per_tensor": {"per_token": False},
    "scale_ub": {"scale_ub": 2.0},
    "per_tensor_scale_ub": {"per_token": False, "scale_ub": 2.0},
    "e4m3fnuz": {"fp8_dtype": torch.float8_e4m3fnuz},
    "padded": {"num_token_padding": 8},
}.items():
    dynamic_quant_fp8.add_input_variant(_name, **_options)

for _name, _options in {
    "group_64": {"group_size": 64},
    "group_32": {"group_size": 32},
    "group_16": {"group_size": 16},
    "column_major": {"group_size": 16, "column_major": True},
    "ue8m0": {"group_size": 16, "use_ue8m0": True},
    "e4m3fnuz": {"group_size": 16, "fp8_dtype": torch.float8_e4m3fnuz},
}.items():
    dynamic_group_quant_fp8.add_input_variant(_name, **_options)


def _valid_rows(args: tuple) -> int | None:
    """q's rows beyond x's are padding (unspecified in kernels)."""
    x = args[0]
    return x.shape[0] if x.dim() == 2 else None


def _dequantize_static(args: tuple, outputs: tuple) -> Tensor:
    x, scale = args[0], args[1]
    return outputs[0].to(torch.float32) * broadcast_scale(scale, x)


def _dequantize_dynamic(args: tuple, outputs: tuple) -> Tensor:
    q, scale = outputs
    return q.to(torch.float32) * scale


def _dequantize_group(args: tuple, outputs: tuple) -> Tensor:
    x, group_size = args[0], args[1]
    q, scale = outputs
    return q.to(torch.float32) * scale.repeat_interleave(group_size, dim=-1)[..., : x.shape[-1]]


def _floor(args: tuple) -> float:
    fp8_dtype = next(a for a in args if isinstance(a, torch.dtype))
    return min_scale(fp8_dtype, "fp8 quant")


def _group_floor(args: tuple) -> float:
    """The group ops' floor (``use_ue8m0`` and ``fp8_dtype`` are their last two arguments): with
    UE8M0 the floor's power of two, below which providers floor differently (vLLM's kernels
    with ``1e-10 / fp8_max``) and q is the same."""
    floor = min_scale(args[-1], "fp8 group quant")
    return 2.0 ** math.ceil(math.log2(floor)) if args[-2] else floor


static_quant_fp8.set_comparison(
    Comparison.dequantized(quantized=(0,), dequantize=_dequantize_static, valid_rows=_valid_rows)
)
dynamic_quant_fp8.set_comparison(
    Comparison.dequantized(
        quantized=(0,), scales=(1,), dequantize=_dequantize_dynamic, scale_floor=_floor, valid_rows=_valid_rows
    )
)
dynamic_group_quant_fp8.set_comparison(
    Comparison.dequantized(quantized=(0,), scales=(1,), dequantize=_dequantize_group, scale_floor=_group_floor)
)
