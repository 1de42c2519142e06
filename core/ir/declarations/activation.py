"""Activations: gated ``[..., 2d] -> [..., d]`` (the MLP's nonlinearity times its up projection)
and elementwise (shape preserved).

Gated ops: the first half of the last dimension is the gate, the second half the "up" value
(vLLM's layout for merged gate/up projections), except ``swigluoai_and_mul`` whose halves are
interleaved as GPT-OSS stores them. Rounding follows eager PyTorch, as vLLM's CUDA kernels do:
the activation is computed in float32 and rounded to x's dtype, then multiplied in x's dtype,
so a kernel that rounds at the same points is bit-exact (it may register ``exact=True``) and
one that keeps float32 through the multiply differs by ~1 ulp, which the default tolerances
allow. ``gelu_and_mul_sparse`` (vLLM 0.33's third IR op, Gemma 3n's MLP) rounds at every
op boundary of its expression in the same way.

Elementwise ops: ``gelu_new`` and ``gelu_fast`` are vLLM's ``NewGELU`` / ``FastGELU``
``forward_native`` expressions op for op, so a 16-bit x is rounded to its dtype after every
step (vLLM's CUDA kernels round the same way). That is not the most accurate value (``1 + t``
cancels in bf16 for x in about [-4, -1.8]) but it is vLLM's function under vLLM's name.
``quick_gelu`` and ``relu2`` compute in float32 and round once (a few bf16 ulp from vLLM's
step-rounded ``QuickGELU``, inside the default tolerances).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_ir.ir.impl import Unsupported
from vllm_ir.ir.op import IrOp, register_op


def _halves(x: Tensor) -> tuple[Tensor, Tensor]:
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


def approximate_verdict(approximate: str) -> bool | Unsupported:
    """A kernel predicate's refusal of what `check_approximate` raises for: a gelu form other
    than "none" or "tanh" (native raises, so the call must reach native to raise)."""
    if approximate not in ("none", "tanh"):
        return Unsupported(f"approximate={approximate!r} is neither 'none' nor 'tanh' (native raises)")
    return True


def check_approximate(approximate: str, who: str) -> None:
    """A ValueError naming ``who`` (the op, or the op and a provider) unless ``approximate`` is
    one of gelu's forms, "none" or "tanh": the GELU ops and their kernels refuse the others."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"{who}: approximate must be 'none' or 'tanh', not {approximate!r}")


@register_op
def silu_and_mul(x: Tensor) -> Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` where ``d = x.shape[-1] // 2`` (SwiGLU)."""
    gate, up = _halves(x)
    return F.silu(gate) * up


@register_op
def mul_and_silu(x: Tensor) -> Tensor:
    """``x[..., :d] * silu(x[..., d:])``: the gate in the second half."""
    up, gate = _halves(x)
    return up * F.silu(gate)


@register_op
def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    """``gelu(x[..., :d], approximate) * x[..., d:]`` (GeGLU); ``approximate`` is "none" or "tanh"."""
    check_approximate(approximate, "gelu_and_mul")
    gate, up = _halves(x)
    return F.gelu(gate, approximate=approximate) * up


@register_op
def fatrelu_and_mul(x: Tensor, threshold: float = 0.0) -> Tensor:
    """``threshold(x[..., :d]) * x[..., d:]``: gate values ``<= threshold`` become 0 (FATReLU)."""
    gate, up = _halves(x)
    return F.threshold(gate, threshold, 0.0) * up


@register_op
def swigluoai_and_mul(x: Tensor, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """GPT-OSS's clamped SwiGLU on interleaved halves: gate ``x[..., ::2]``, up ``x[..., 1::2]``.

    ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
    ``gate * sigmoid(alpha * gate) * (up + 1)``, each step in x's dtype as vLLM's
    ``SwigluOAIAndMul.forward_native`` computes it.
    """
    gate, up = x[..., ::2], x[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


@register_op
def gelu_and_mul_sparse(x: Tensor, std_multiplier: float, approximate: str = "none") -> Tensor:
    """Gaussian sparsification of the gate, then GeGLU: vLLM 0.33's ``gelu_and_mul_sparse``.

    ``gate = x[..., :d]``; ``cutoff = mean(gate) + std(gate) * std_multiplier`` over the last
    dimension (population std, ``unbiased=False``); ``gelu(relu(gate - cutoff), approximate) *
    x[..., d:]``. Statistics are those of this tensor's rows, so under tensor parallelism they
    stay local to each shard, as in vLLM. Rounding is eager PyTorch's at every op boundary, in
    x's dtype: the mean is the float32 sum (ATen's order) divided by d, the std is computed in
    double; both, ``std * std_multiplier`` (a float32 scalar), the cutoff, the difference and
    the activation are each rounded to x's dtype. ``std_multiplier`` is the standard normal
    quantile of the target sparsity (Gemma 3n: 0.95 -> 1.6448536269514722).
    """
    check_approximate(approximate, "gelu_and_mul_sparse")
    d = x.shape[-1] // 2
    gate = x[..., :d]
    mean = torch.mean(gate, dim=-1, keepdim=True)
    std = torch.std(gate, dim=-1, keepdim=True, unbiased=False)
    sparse_gate = F.relu(gate - (mean + std * std_multiplier))
    return F.gelu(sparse_gate, approximate=approximate) * x[..., d:]


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@register_op
def gelu_new(x: Tensor) -> Tensor:
    """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (GPT-2's GELU), vLLM's ``NewGELU``.

    Op for op as vLLM 0.33's ``forward_native``: in x's dtype, each step rounded (a 16-bit
    ``x^3`` is ``pow(x, 3.0)``: bf16 rounds ``x * x`` and then the product with x, fp16 rounds
    the float32 cube once; scalars are float32).
    """
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))


@register_op
def gelu_fast(x: Tensor) -> Tensor:
    """``0.5 x (1 + tanh(0.7978845608 x (1 + 0.044715 x^2)))``, vLLM's ``FastGELU``.

    Op for op as vLLM 0.33's ``forward_native``: in x's dtype, each step rounded.
    """
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


@register_op
def quick_gelu(x: Tensor) -> Tensor:
    """``x * sigmoid(1.702 x)`` (CLIP's GELU approximation), in float32, rounded once."""
    xf = x.float()
    return (xf * torch.sigmoid(1.702 * xf)).to(x.dtype)


@register_op
def relu2(x: Tensor) -> Tensor:
    """``relu(x)^2`` (squared ReLU, Primer / Nemotron); NaN stays NaN."""
    xf = x.float()
    return torch.square(F.relu(xf)).to(x.dtype)


GATED_OPS: tuple[IrOp, ...] = (silu_and_mul, mul_and_silu, gelu_and_mul, fatrelu_and_mul, swigluoai_and_mul)
ELEMENTWISE_OPS: tuple[IrOp, ...] = (gelu_new, gelu_fast, quick_gelu, relu2)
#: Gated ops whose gate is normalized by its row's statistics (not in GATED_OPS: a compiled
#: rendering keeps float32 through the mean, std and cutoff, several x-dtype ulps from native).
ROW_STATISTIC_GATED_OPS: tuple[IrOp, ...] = (gelu_and_mul_sparse,)
#: vLLM's default ``std_multiplier``: the 0.95 quantile of the standard normal (Gemma 3n's sparsity).
GEMMA3N_STD_MULTIPLIER = 1.6448536269514722


def _gated_inputs(**defaults: object):
    """An input generator: ``x`` of shape ``[*shape[:-1], 2 * shape[-1]]`` (``shape`` names the
    output), ~ N(0, 2), followed by every scalar parameter of the op (``defaults``: name ->
    default), as a variant sets it or else its default: the kit takes full argument tuples."""

    def generate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, seed: int = 0, **options):
        g = torch.Generator().manual_seed(seed)
        x = 2.0 * torch.randn((*shape[:-1], 2 * shape[-1]), generator=g, dtype=torch.float32)
        unknown = set(options) - set(defaults)
        if unknown:
            raise TypeError(f"unknown input options {sorted(unknown)}")
        return (x.to(device=device, dtype=dtype), *(options.get(name, default) for name, default in defaults.items()))

    return generate


def _elementwise_inputs(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, seed: int = 0):
    """``x`` of ``shape``, ~ N(0, 3): both tails of the activations, and exact zeros are rare."""
    g = torch.Generator().manual_seed(seed)
    return ((3.0 * torch.randn(shape, generator=g, dtype=torch.float32)).to(device=device, dtype=dtype),)


silu_and_mul.input_generator(_gated_inputs())
mul_and_silu.input_generator(_gated_inputs())
gelu_and_mul.input_generator(_gated_inputs(approximate="none"))
gelu_and_mul.add_input_variant("tanh", approximate="tanh")
fatrelu_and_mul.input_generator(_gated_inputs(threshold=0.0))
fatrelu_and_mul.add_input_variant("threshold_0_5", threshold=0.5)
swigluoai_and_mul.input_generator(_gated_inputs(alpha=1.702, limit=7.0))
swigluoai_and_mul.add_input_variant("alpha_1_limit_3", alpha=1.0, limit=3.0)
# vLLM's kernel test tolerances for swigluoai_and_mul (several roundings in x's dtype).
swigluoai_and_mul.set_tolerance(torch.float16, atol=1e-3, rtol=2e-3)
swigluoai_and_mul.set_tolerance(torch.bfloat16, atol=1e-3, rtol=2e-2)
# vLLM's generator: approximate="tanh" (its Triton kernel's only form), Gemma 3n's multiplier.
gelu_and_mul_sparse.input_generator(_gated_inputs(std_multiplier=GEMMA3N_STD_MULTIPLIER, approximate="tanh"))
gelu_and_mul_sparse.add_input_variant("erf", approximate="none")
gelu_and_mul_sparse.add_input_variant("sparsity_0_75", std_multiplier=0.6744897501960817)
for _op in ELEMENTWISE_OPS:
    _op.input_generator(_elementwise_inputs)
