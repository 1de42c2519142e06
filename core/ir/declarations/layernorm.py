"""RMSNorm and fused residual-add + RMSNorm, with vLLM 0.33.0's semantics (``vllm/ir/ops/layernorm.py``).

Both normalize in float32, then apply the weight **in the weight's dtype** and cast to x's
dtype: ``y = x.float() * rsqrt(mean(x.float()**2) + eps)``; with a weight,
``y = y.to(weight.dtype) * weight``; the result is ``y.to(x.dtype)``, always in x's dtype.

So a weight of x's dtype rounds twice (the normalized value, then the product), a float32
weight with a bf16/fp16 x multiplies in float32 and rounds once (the common Hugging Face
checkpoint: bf16 activations, fp32 norm weights), and a bf16 weight with a float32 x rounds
the normalized value and the product to bf16 before widening back to float32. Hugging Face's
``LlamaRMSNorm`` rounds to x's dtype *before* the weight multiply instead (with promotion):
that is ``rms_norm(x, None, eps)`` followed by its own multiply (see `vllm_ir.integrations.transformers`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_ir.ir.impl import Unsupported
from vllm_ir.ir.op import register_op


@register_op
def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    """Weighted root-mean-square normalization over the last dimension, as vLLM 0.33's ``rms_norm``.

    Normalizes in float32, multiplies by ``weight`` in the weight's dtype (``y.to(weight.dtype)
    * weight``), returns x's dtype. ``variance_size`` computes the variance over the first
    ``variance_size`` channels only.
    """
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    x_var = x if variance_size is None else x[..., :variance_size]
    variance = x_var.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + epsilon)
    if weight is not None:
        x = x.to(weight.dtype) * weight
    return x.to(orig_dtype)


@register_op(allow_inplace=True)
def fused_add_rms_norm(
    x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> tuple[Tensor, Tensor]:
    """``(rms_norm(x + x_residual), x + x_residual)`` with the sum kept in float32 for the norm,
    as vLLM 0.33's ``fused_add_rms_norm``.

    The sum is formed in float32; the new residual is that sum rounded to x's dtype, and the
    norm is of the float32 sum (not of the rounded residual), with the weight applied as in
    `rms_norm`. Returns the normalized sum and the new residual, both in x's dtype. With
    ``maybe_inplace`` an implementation may write the outputs into ``x`` and ``x_residual``.
    """
    orig_dtype = x.dtype
    x = x.to(torch.float32) + x_residual.to(torch.float32)
    residual = x.to(orig_dtype)
    x_var = x if variance_size is None else x[..., :variance_size]
    variance = x_var.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + epsilon)
    if weight is not None:
        x = x.to(weight.dtype) * weight
    return x.to(orig_dtype), residual


def variance_size_verdict(variance_size: int | None) -> bool | Unsupported:
    """A kernel predicate's refusal of ``variance_size`` (the variance of the first channels
    only), for kernels that normalize over the whole last dimension."""
    if variance_size is not None:
        return Unsupported("variance_size is not supported (the kernel normalizes over the whole last dimension)")
    return True


def weight_dtype_verdict(x: Tensor, weight: Tensor | None) -> bool | Unsupported:
    """A kernel predicate's refusal of a weight whose dtype is not x's, for kernels that take the
    weight in x's dtype (the op multiplies in the weight's own dtype)."""
    if weight is not None and weight.dtype != x.dtype:
        return Unsupported(
            f"weight dtype {weight.dtype} must match x dtype {x.dtype} (the kernel takes the weight in x's dtype; "
            "vLLM applies another weight dtype in that dtype, which it cannot reproduce)"
        )
    return True


def contiguous_residual_verdict(x: Tensor, x_residual: Tensor) -> bool | Unsupported:
    """A ``fused_add_rms_norm`` kernel predicate's refusal of a residual it cannot read as x's
    rows: one of another dtype, or not contiguous."""
    if x_residual.dtype != x.dtype or not x_residual.is_contiguous():
        return Unsupported("residual must be contiguous with x's dtype")
    return True


def residual_verdict(x: Tensor, x_residual: Tensor | None) -> bool | Unsupported:
    """No residual, or one of x's dtype, device and shape (native broadcasts and promotes): what the
    norm kernels (fused with a quant or not) of vllm_c and Triton decline alike."""
    if x_residual is not None and (
        x_residual.dtype != x.dtype or x_residual.device != x.device or x_residual.shape != x.shape
    ):
        return Unsupported(
            f"x_residual ({x_residual.dtype}, {list(x_residual.shape)}, {x_residual.device}) differs from x "
            f"({x.dtype}, {list(x.shape)}, {x.device}) (native broadcasts and promotes; the kernels do not)"
        )
    return True


def weight_verdict(x: Tensor, weight: Tensor | None) -> bool | Unsupported:
    """No weight, or a ``[hidden]`` one of x's dtype or float32 on x's device (its layout is each
    kernel's own)."""
    if weight is None:
        return True
    if weight.dtype not in (x.dtype, torch.float32):
        return Unsupported(f"weight dtype {weight.dtype} is neither x's ({x.dtype}) nor float32")
    if weight.device != x.device:
        return Unsupported(f"weight is on {weight.device}, x on {x.device}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        return Unsupported(f"weight of shape {list(weight.shape)} for rows of {x.shape[-1]} (native broadcasts)")
    return True


def _weight(
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator,
    weight_dtype: torch.dtype | None,
    with_weight: bool,
) -> Tensor | None:
    if not with_weight:
        return None
    w = 1.0 + 0.1 * torch.randn(hidden, generator=generator, dtype=torch.float32)
    return w.to(device=device, dtype=weight_dtype or dtype)


def _layernorm_inputs(with_residual: bool):
    """An input generator: activations ~ N(0, 1), weight ~ 1 + N(0, 0.01), deterministic per seed."""

    def generate(
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        *,
        weight_dtype: torch.dtype | None = None,
        with_weight: bool = True,
        epsilon: float = 1e-6,
        variance_size: int | None = None,
        seed: int = 0,
    ) -> tuple:
        g = torch.Generator().manual_seed(seed)
        activations = [
            torch.randn(shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
            for _ in range(2 if with_residual else 1)
        ]
        weight = _weight(shape[-1], dtype, device, g, weight_dtype, with_weight)
        return (*activations, weight, epsilon, _clamp(variance_size, shape[-1]))

    return generate


rms_norm.input_generator(_layernorm_inputs(with_residual=False))
fused_add_rms_norm.input_generator(_layernorm_inputs(with_residual=True))


def _clamp(variance_size: int | None, hidden: int) -> int | None:
    return None if variance_size is None else max(1, min(variance_size, hidden))


for _op in (rms_norm, fused_add_rms_norm):
    # Two roundings (before and after the weight multiply) that a kernel may fuse into one:
    # allow ~4 ulp of fp16, as the default bf16 tolerance allows ~4 ulp of bf16.
    _op.set_tolerance(torch.float16, atol=1e-3, rtol=4e-3)
    _op.add_input_variant("no_weight", with_weight=False)
    # Mixed weight dtypes: an fp32 weight (bf16/fp16 x: one fp32 multiply, one rounding; the
    # Hugging Face case, benchmarked) and a bf16 weight (fp32 x: rounded to bf16 twice, then
    # widened; fp16 x: bf16 rounding, then fp16).
    _op.add_input_variant("fp32_weight", benchmark=True, weight_dtype=torch.float32)
    _op.add_input_variant("bf16_weight", weight_dtype=torch.bfloat16)
    _op.add_input_variant("variance_size", variance_size=5)
