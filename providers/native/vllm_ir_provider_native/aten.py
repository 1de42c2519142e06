"""Provider ``aten``: PyTorch's own fused kernels, and in-place ops where PyTorch has none.

- ``rms_norm`` calls ``torch.nn.functional.rms_norm`` (one fused ATen kernel), which on CPU
  computes vLLM 0.33's expression bit for bit without a weight and with a float32 weight (it
  normalizes in fp32, multiplies by the fp32 weight and rounds once; ATen's fused kernel wants
  the weight in x's dtype, so a 16-bit x is widened to fp32 first). For a weight of x's
  16-bit dtype the op rounds the normalized value before the multiply, so that case is the
  kernel without weight followed by the multiply in x's dtype; a weight of a third dtype (bf16
  with float32 or float16 x) is the fp32 norm rounded to the weight's dtype, times the weight,
  cast to x's dtype (vLLM's ``x.to(weight.dtype) * weight``). ``variance_size`` is declined
  (not expressible).
- ``gelu_new`` and ``gelu_fast`` are GELU's tanh approximation (the same formula; gelu_fast's
  constant is sqrt(2/pi) to ten digits): ``torch.nn.functional.gelu(x, approximate="tanh")``
  for float32 x. 16-bit x is declined: the ops are vLLM's expressions rounded to x's dtype
  after every step, where F.gelu rounds once (outside bf16's tolerance for ~50 inputs).
- ``fused_add_rms_norm`` is in place, for float32 x: the sum is written into ``x_residual``
  and its squares into ``x`` (no activation-sized allocation), then the op's own steps in its
  order, so native's bits (a strided x or residual goes through the op's own temporaries: the
  mean sums in the order of their layout). 16-bit x is declined: the op normalizes the float32
  sum (not the residual rounded to x's dtype, which overflows fp16 where the fp32 sum does
  not), and ATen ops can hold it only in float32 temporaries, which an in-place kernel may not
  allocate. ``variance_size`` is declined.

Both decline what native computes differently or broadcasts (and ATen's kernels reject):
float64 (native computes in fp32, so a float64 kernel differs by ~1 fp32 ulp, far beyond the
float64 tolerance; native is the right kernel for a reference dtype), a 0-d x, a weight that is
not [hidden] or not on x's device (on the meta device the in-place multiply silently did
nothing), and a residual of another shape or device than x (native broadcasts it).
"""

from __future__ import annotations

import torch
from torch import Tensor

import vllm_ir
from vllm_ir import Provider
from vllm_ir.ir.declarations.layernorm import variance_size_verdict

PROVIDER = "aten"
#: The registration surface (PyTorch is always there: always available).
ATEN = Provider(PROVIDER)
#: float64 is left to native, which computes it in float32 (see the module docstring).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _weight(x: Tensor, weight: Tensor | None) -> bool | vllm_ir.Unsupported:
    if weight is None:
        return True
    if weight.dtype not in DTYPES:
        return vllm_ir.Unsupported(f"weight dtype {weight.dtype} is not float32, bfloat16 or float16")
    if weight.device != x.device:
        return vllm_ir.Unsupported(f"weight is on {weight.device}, x on {x.device}")
    if weight.shape != x.shape[-1:]:
        return vllm_ir.Unsupported(
            f"weight shape {list(weight.shape)} is not [{x.shape[-1]}] (native broadcasts it; ATen does not)"
        )
    return True


def _dtype(x: Tensor) -> bool | vllm_ir.Unsupported:
    if x.dtype not in DTYPES:
        return vllm_ir.Unsupported(
            f"dtype {x.dtype} is not float32, bfloat16 or float16"
            + (" (native computes float64 in float32; ATen would not match it)" if x.dtype == torch.float64 else "")
        )
    return True


def _not_0d(x: Tensor) -> bool | vllm_ir.Unsupported:
    if x.dim() == 0:
        return vllm_ir.Unsupported("x is 0-d (ATen normalizes over a last dimension)")
    return True


def _normed(x: Tensor, weight: Tensor | None, epsilon: float) -> Tensor:
    """vLLM's rms_norm of ``x`` (any float dtype), in x's dtype, or for a weight of x's 16-bit
    dtype the normalized value before that weight's multiply (see the module docstring)."""
    shape = (x.shape[-1],)
    if weight is None or weight.dtype == x.dtype == torch.float32:
        return torch.nn.functional.rms_norm(x, shape, weight, epsilon)
    if weight.dtype == torch.float32:
        # ATen's fused kernel takes a weight of x's dtype only (other pairs run its composite
        # form, with a warning): the fp32 kernel on the widened x, then x's dtype.
        return torch.nn.functional.rms_norm(x.to(torch.float32), shape, weight, epsilon).to(x.dtype)
    if weight.dtype == x.dtype:
        return torch.nn.functional.rms_norm(x, shape, None, epsilon)
    y = torch.nn.functional.rms_norm(x.to(torch.float32), shape, None, epsilon)
    return y.to(weight.dtype).mul_(weight).to(x.dtype)


def _weighted_by_x_dtype(x: Tensor, weight: Tensor | None) -> bool:
    """Whether `_normed` left the weight's multiply (in x's dtype) to the caller."""
    return weight is not None and weight.dtype == x.dtype and x.dtype != torch.float32


@ATEN.impl("rms_norm", supports=(variance_size_verdict, _dtype, _not_0d, _weight))
def rms_norm(x, weight, epsilon, variance_size=None):
    y = _normed(x, weight, epsilon)
    return y.mul_(weight) if _weighted_by_x_dtype(x, weight) else y


def _residual(x: Tensor, x_residual: Tensor) -> bool | vllm_ir.Unsupported:
    """``fused_add_rms_norm``'s own rules, asked between the variance_size and the x checks."""
    if x.dtype != torch.float32 and x.dtype in DTYPES:
        return vllm_ir.Unsupported(
            f"{x.dtype} x: the op normalizes the float32 sum, which ATen ops hold only in float32 "
            "temporaries twice x's size (not in place; native computes the same)"
        )
    if x_residual.dtype != x.dtype:
        return vllm_ir.Unsupported(f"residual dtype {x_residual.dtype} != x dtype {x.dtype}")
    if x_residual.device != x.device:
        return vllm_ir.Unsupported(f"residual is on {x_residual.device}, x on {x.device}")
    if x_residual.shape != x.shape:
        return vllm_ir.Unsupported(
            f"residual shape {list(x_residual.shape)} != x shape {list(x.shape)} (native broadcasts; in place cannot)"
        )
    return True


@ATEN.impl("fused_add_rms_norm", supports=(variance_size_verdict, _residual, _dtype, _not_0d, _weight), inplace=True)
def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None):
    if x.is_contiguous() and x_residual.is_contiguous():
        total = x_residual.add_(x)  # float32 (see _residual): the sum is the new residual
        squares = torch.mul(total, total, out=x)  # x's values are in the sum: x holds the squares
    else:  # strided: the op's own temporaries, whose layout fixes the order its mean sums in
        summed = x + x_residual
        total = x_residual.copy_(summed)
        squares = summed.pow(2)
    # The op's own steps, in its order (native's bits): mean of squares, + eps, rsqrt, multiply.
    # No rsqrt_(): Inductor has no lowering for it (under CI=1 its ATen fallback is an error).
    rstd = squares.mean(dim=-1, keepdim=True).add_(epsilon).rsqrt()
    torch.mul(total, rstd, out=x)
    if weight is not None and weight.dtype == torch.float32:
        x.mul_(weight)
    elif weight is not None:
        x.copy_(x.to(weight.dtype).mul_(weight))  # half x's size: vLLM's multiply in the weight's dtype
    return x, x_residual


def _not_16_bit(x: Tensor) -> bool | vllm_ir.Unsupported:
    if x.dtype in (torch.bfloat16, torch.float16):
        return vllm_ir.Unsupported(
            f"dtype {x.dtype}: the op rounds every step to x's dtype (vLLM's), F.gelu rounds once"
        )
    return True


def _gelu_tanh(x: Tensor) -> Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


for _op in ("gelu_new", "gelu_fast"):
    ATEN.register(_op, _gelu_tanh, supports=(_not_16_bit, _dtype), batch_invariant=True)
