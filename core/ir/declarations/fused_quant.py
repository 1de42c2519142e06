"""RMSNorm / SwiGLU fused with FP8 quantization: the targets of the norm+quant fusions.

Each op's native function is exactly the composition of the existing ops' native functions
(shared/OPS.md 4.7): the norm (or activation) result is rounded to the model dtype (the
norm's weight applied as vLLM 0.33's `rms_norm` applies it: ``y.to(weight.dtype) * weight``,
then x's dtype, so an fp32 weight with bf16 x is one fp32 multiply and one rounding to bf16),
then quantized as `static_quant_fp8` / `dynamic_quant_fp8` / `dynamic_group_quant_fp8` would
(groups of 128 or 64 for DeepSeek-V3 / Qwen style block FP8, UE8M0 and column-major scales
included), so a fusion that rewrites
``quant(norm(x))`` into one of these ops never changes a value under the native provider.
A kernel keeps the intermediate in registers instead of writing it and reading it back.

Residual variants update the residual in the model dtype (``x + residual`` rounded once, as
`fused_add_rms_norm` returns it); ``maybe_inplace`` lets a kernel write it into
``x_residual``. The quantized output is compared by dequantized value (fp8 rounding of a
value a kernel computes in a different order may move one fp8 step; a dynamic scale may move
by one ulp of the model dtype, the absmax being of a value rounded to it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_ir.ir.comparison import Comparison
from vllm_ir.ir.declarations.activation import silu_and_mul
from vllm_ir.ir.declarations.layernorm import _weight, fused_add_rms_norm, rms_norm
from vllm_ir.ir.declarations.quant import (
    _activation,
    _dequantize_dynamic,
    _dequantize_group,
    _dequantize_static,
    _floor,
    _group_floor,
    broadcast_scale,
    dynamic_group_quant_fp8,
    dynamic_quant_fp8,
    float32_verdict,
    fp8_max,
    static_quant_fp8,
)
from vllm_ir.ir.impl import Unsupported
from vllm_ir.ir.op import register_op


def _norm(x: Tensor, x_residual: Tensor | None, weight: Tensor | None, epsilon: float) -> tuple[Tensor, Tensor | None]:
    """``(y, residual)``: `rms_norm` of x (residual None), or `fused_add_rms_norm` of x and ``x_residual``."""
    if x_residual is None:
        return rms_norm.fn(x, weight, epsilon), None
    return fused_add_rms_norm.fn(x, x_residual, weight, epsilon)


@register_op
def rms_norm_static_fp8_quant(
    x: Tensor, weight: Tensor | None, epsilon: float, scale: Tensor, fp8_dtype: torch.dtype
) -> Tensor:
    """``static_quant_fp8(rms_norm(x, weight, epsilon), scale, fp8_dtype)``."""
    return static_quant_fp8.fn(rms_norm.fn(x, weight, epsilon), scale, fp8_dtype)


@register_op(allow_inplace=True, activations=("x", "x_residual"))
def fused_add_rms_norm_static_fp8_quant(
    x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, scale: Tensor, fp8_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``(static_quant_fp8(y), residual)`` where ``y, residual = fused_add_rms_norm(x, x_residual, ...)``.

    The new residual is in x's dtype; ``maybe_inplace`` may write it into ``x_residual``.
    """
    y, residual = fused_add_rms_norm.fn(x, x_residual, weight, epsilon)
    return static_quant_fp8.fn(y, scale, fp8_dtype), residual


@register_op(allow_inplace=True, activations=("x", "x_residual"))
def rms_norm_dynamic_per_token_fp8_quant(
    x: Tensor,
    x_residual: Tensor | None,
    weight: Tensor | None,
    epsilon: float,
    fp8_dtype: torch.dtype,
    scale_ub: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(q, scale, residual)``: `rms_norm` (or `fused_add_rms_norm` when ``x_residual`` is
    given) then per-token `dynamic_quant_fp8` with ``scale_ub``; ``residual`` is None without
    ``x_residual``, else the new residual (``maybe_inplace`` may write it into ``x_residual``)."""
    y, residual = _norm(x, x_residual, weight, epsilon)
    q, scale = dynamic_quant_fp8.fn(y, True, fp8_dtype, scale_ub)
    return q, scale, residual


@register_op
def silu_and_mul_static_fp8_quant(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """``static_quant_fp8(silu_and_mul(x), scale, fp8_dtype)``."""
    return static_quant_fp8.fn(silu_and_mul.fn(x), scale, fp8_dtype)


@register_op(allow_inplace=True, activations=("x", "x_residual"))
def rms_norm_group_fp8_quant(
    x: Tensor,
    x_residual: Tensor | None,
    weight: Tensor | None,
    epsilon: float,
    group_size: int,
    column_major: bool,
    use_ue8m0: bool,
    fp8_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(q, scales, residual)``: `rms_norm` (or `fused_add_rms_norm` when ``x_residual`` is
    given) then `dynamic_group_quant_fp8` (groups of ``group_size`` along the row: 128 for
    DeepSeek-V3 / Qwen FP8 blocks, 64; UE8M0 and column-major scales as that op has them);
    ``residual`` is None without ``x_residual``, else the new residual (``maybe_inplace`` may
    write it into ``x_residual``)."""
    y, residual = _norm(x, x_residual, weight, epsilon)
    q, scales = dynamic_group_quant_fp8.fn(y, group_size, column_major, use_ue8m0, fp8_dtype)
    return q, scales, residual


@register_op
def silu_and_mul_group_fp8_quant(
    x: Tensor, group_size: int, column_major: bool, use_ue8m0: bool, fp8_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``dynamic_group_quant_fp8(silu_and_mul(x), group_size, column_major, use_ue8m0, fp8_dtype)``:
    the down projection's input of a block-quantized FP8 MLP."""
    return dynamic_group_quant_fp8.fn(silu_and_mul.fn(x), group_size, column_major, use_ue8m0, fp8_dtype)


FUSED_QUANT_OPS = (
    rms_norm_static_fp8_quant,
    fused_add_rms_norm_static_fp8_quant,
    rms_norm_dynamic_per_token_fp8_quant,
    silu_and_mul_static_fp8_quant,
    rms_norm_group_fp8_quant,
    silu_and_mul_group_fp8_quant,
)


# -- what the fused kernels decline alike (vllm_c's and Triton's predicates) ----------------


def halves_verdict(x: Tensor) -> bool | Unsupported:
    """The SwiGLU ops' x: an even last dimension."""
    if x.dim() >= 1 and x.shape[-1] % 2:
        return Unsupported(f"the last dimension ({x.shape[-1]}) is odd (native's halves do not match)")
    return True


def per_tensor_scale_verdict(x: Tensor, scale: Tensor) -> bool | Unsupported:
    """The static ops' scale: one element (the fused kernels take no other), float32 on x's device."""
    verdict = float32_verdict(x, "scale", scale)
    if verdict and scale.numel() != 1:
        return Unsupported(
            f"scale of shape {list(scale.shape)}: the fused kernels take a per-tensor scale (one element)"
        )
    return verdict


# -- test inputs and comparison --------------------------------------------------------------


def _static_scale(y: Tensor, fp8_dtype: torch.dtype, device: torch.device) -> Tensor:
    """A per-tensor scale 1.25x the absmax of the value to quantize (no clamping)."""
    m = y.to(torch.float32).abs().amax() if y.numel() else torch.ones(())
    return (m.clamp(min=1e-3) * 1.25 / fp8_max(fp8_dtype, "fused quant")).reshape(1).to(device)


def _norm_static_inputs(with_residual: bool):
    def generate(
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        *,
        epsilon: float = 1e-6,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        seed: int = 0,
        **options: object,
    ) -> tuple:
        g = torch.Generator().manual_seed(seed)
        x = _activation(shape, dtype, device, g)
        residual = _activation(shape, dtype, device, g) if with_residual else None
        weight = _weight(shape[-1], dtype, device, g, options.get("weight_dtype"), options.get("with_weight", True))
        if residual is None:
            y = rms_norm.fn(x, weight, epsilon)
            return x, weight, epsilon, _static_scale(y, fp8_dtype, device), fp8_dtype
        y, _ = fused_add_rms_norm.fn(x, residual, weight, epsilon)
        return x, residual, weight, epsilon, _static_scale(y, fp8_dtype, device), fp8_dtype

    return generate


def _norm_dynamic_inputs(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    *,
    epsilon: float = 1e-6,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    with_residual: bool = True,
    scale_ub: float | None = None,
    seed: int = 0,
    **options: object,
) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = _activation(shape, dtype, device, g)
    residual = _activation(shape, dtype, device, g) if with_residual else None
    weight = _weight(shape[-1], dtype, device, g, options.get("weight_dtype"), options.get("with_weight", True))
    ub = None if scale_ub is None else torch.tensor([scale_ub], dtype=torch.float32, device=device)
    return x, residual, weight, epsilon, fp8_dtype, ub


def _silu_static_inputs(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    seed: int = 0,
) -> tuple:
    """``x`` of shape ``[*shape[:-1], 2 * shape[-1]]`` (``shape`` names the output), ~ N(0, 2)."""
    g = torch.Generator().manual_seed(seed)
    x = (2.0 * torch.randn((*shape[:-1], 2 * shape[-1]), generator=g, dtype=torch.float32)).to(device, dtype)
    return x, _static_scale(silu_and_mul.fn(x), fp8_dtype, device), fp8_dtype


def _norm_group_inputs(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    *,
    epsilon: float = 1e-6,
    group_size: int = 128,
    column_major: bool = False,
    use_ue8m0: bool = False,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    with_residual: bool = True,
    seed: int = 0,
    **options: object,
) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = _activation(shape, dtype, device, g)
    residual = _activation(shape, dtype, device, g) if with_residual else None
    weight = _weight(shape[-1], dtype, device, g, options.get("weight_dtype"), options.get("with_weight", True))
    column_major = column_major and len(shape) >= 2  # a 1-D x has no column-major scales
    return x, residual, weight, epsilon, group_size, column_major, use_ue8m0, fp8_dtype


def _silu_group_inputs(
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
    """``x`` of shape ``[*shape[:-1], 2 * shape[-1]]`` (``shape`` names the output), ~ N(0, 2)."""
    g = torch.Generator().manual_seed(seed)
    x = (2.0 * torch.randn((*shape[:-1], 2 * shape[-1]), generator=g, dtype=torch.float32)).to(device, dtype)
    column_major = column_major and len(shape) >= 2
    return x, group_size, column_major, use_ue8m0, fp8_dtype


rms_norm_static_fp8_quant.input_generator(_norm_static_inputs(with_residual=False))
fused_add_rms_norm_static_fp8_quant.input_generator(_norm_static_inputs(with_residual=True))
rms_norm_dynamic_per_token_fp8_quant.input_generator(_norm_dynamic_inputs)
silu_and_mul_static_fp8_quant.input_generator(_silu_static_inputs)
rms_norm_group_fp8_quant.input_generator(_norm_group_inputs)
silu_and_mul_group_fp8_quant.input_generator(_silu_group_inputs)

for _op in (rms_norm_static_fp8_quant, fused_add_rms_norm_static_fp8_quant, rms_norm_dynamic_per_token_fp8_quant):
    _op.add_input_variant("fp32_weight", weight_dtype=torch.float32)
    _op.add_input_variant("no_weight_eps_1e_5", with_weight=False, epsilon=1e-5)
# Options combined where they are independent (each variant costs every provider's kit cases).
for _op in (rms_norm_static_fp8_quant, fused_add_rms_norm_static_fp8_quant):
    _op.add_input_variant("e4m3fnuz", fp8_dtype=torch.float8_e4m3fnuz)
rms_norm_dynamic_per_token_fp8_quant.add_input_variant(
    "e4m3fnuz_scale_ub", fp8_dtype=torch.float8_e4m3fnuz, scale_ub=0.5
)
rms_norm_dynamic_per_token_fp8_quant.add_input_variant("no_residual", with_residual=False)
rms_norm_dynamic_per_token_fp8_quant.add_input_variant("no_residual_scale_ub", with_residual=False, scale_ub=0.5)
silu_and_mul_static_fp8_quant.add_input_variant("e4m3fnuz", fp8_dtype=torch.float8_e4m3fnuz)
# Groups of 16 where a variant needs several groups in the kit's 64-wide rows.
for _name, _options in {
    "group_64": {"group_size": 64},
    "no_residual_ue8m0": {"group_size": 16, "with_residual": False, "use_ue8m0": True},
    "fp32_weight_column_major": {"group_size": 16, "weight_dtype": torch.float32, "column_major": True},
    "no_weight_no_residual": {"group_size": 16, "with_weight": False, "with_residual": False},
    "e4m3fnuz": {"group_size": 16, "fp8_dtype": torch.float8_e4m3fnuz},
}.items():
    rms_norm_group_fp8_quant.add_input_variant(_name, **_options)
for _name, _options in {
    "column_major_ue8m0": {"group_size": 16, "column_major": True, "use_ue8m0": True},
    "e4m3fnuz": {"group_size": 16, "fp8_dtype": torch.float8_e4m3fnuz},
}.items():
    silu_and_mul_group_fp8_quant.add_input_variant(_name, **_options)


def _intermediate_ulp(args: tuple) -> float:
    """The relative step of x's dtype: a dynamic scale is the absmax of the normalized (or
    activated) x rounded to that dtype, and a kernel summing squares in another order than
    native's mean (or computing exp differently) may move that absmax by one ulp."""
    return torch.finfo(args[0].dtype).eps


def _dequantize_norm_static(args: tuple, outputs: tuple) -> Tensor:
    x, scale = args[0], args[-2]
    return _dequantize_static((x, scale), outputs)


def _dequantize_norm_dynamic(args: tuple, outputs: tuple) -> Tensor:
    return _dequantize_dynamic(args, outputs[:2])


def _normed(args: tuple) -> Tensor:
    """The unquantized value of a norm op: what its q * scale approximates."""
    if len(args) == 5:  # rms_norm_static_fp8_quant
        x, weight, epsilon = args[:3]
        return rms_norm.fn(x, weight, epsilon)
    return _norm(*args[:4])[0]  # (x, x_residual, weight, epsilon, ...): the other norm ops


for _op in (rms_norm_static_fp8_quant, fused_add_rms_norm_static_fp8_quant):
    _op.set_comparison(Comparison.dequantized(quantized=(0,), dequantize=_dequantize_norm_static, reference=_normed))
silu_and_mul_static_fp8_quant.set_comparison(
    Comparison.dequantized(
        quantized=(0,),
        dequantize=lambda args, outputs: outputs[0].to(torch.float32) * broadcast_scale(args[1], outputs[0]),
        reference=lambda args: silu_and_mul.fn(args[0]),
    )
)
rms_norm_dynamic_per_token_fp8_quant.set_comparison(
    Comparison.dequantized(
        quantized=(0,),
        scales=(1,),
        dequantize=_dequantize_norm_dynamic,
        scale_floor=_floor,
        scale_rtol=_intermediate_ulp,
        reference=_normed,
    )
)

rms_norm_group_fp8_quant.set_comparison(
    Comparison.dequantized(
        quantized=(0,),
        scales=(1,),
        dequantize=lambda args, outputs: _dequantize_group((args[0], args[4]), outputs[:2]),
        scale_floor=_group_floor,
        scale_rtol=_intermediate_ulp,
        reference=_normed,
    )
)
silu_and_mul_group_fp8_quant.set_comparison(
    Comparison.dequantized(
        quantized=(0,),
        scales=(1,),
        dequantize=lambda args, outputs: _dequantize_group((outputs[0], args[1]), outputs),
        scale_floor=_group_floor,
        scale_rtol=_intermediate_ulp,
        reference=lambda args: silu_and_mul.fn(args[0]),
    )
)
