"""Provider ``aten``: PyTorch's own fused kernels, and in-place ops where PyTorch has none.

- ``rms_norm`` calls ``torch.nn.functional.rms_norm`` (one fused ATen kernel). It applies the
  weight in fp32 and rounds once, where the op rounds before the weight multiply: results
  differ by at most one ulp of the input dtype, inside the op's tolerance. It declines where
  the contract differs: ``variance_size`` (not expressible) and a weight dtype other than x's
  (native promotes the result to the weight's dtype; ATen returns x's dtype).
- ``gelu_new`` and ``gelu_fast`` are GELU's tanh approximation (the same formula; gelu_fast's
  constant is sqrt(2/pi) to ten digits): ``torch.nn.functional.gelu(x, approximate="tanh")``,
  one kernel computing in fp32 and rounding once, as the op does.
- ``fused_add_rms_norm`` is in place from in-place torch ops: the only temporaries are the
  per-row statistics ([..., 1] fp32), so ``maybe_inplace`` allocates nothing activation-sized.

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

PROVIDER = "aten"
#: float64 is left to native, which computes it in float32 (see the module docstring).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _weight(x: Tensor, weight: Tensor | None) -> bool | vllm_ir.Unsupported:
    if weight is None:
        return True
    if weight.dtype != x.dtype:
        return vllm_ir.Unsupported(
            f"weight dtype {weight.dtype} != x dtype {x.dtype}: native promotes the result, ATen does not"
        )
    if weight.device != x.device:
        return vllm_ir.Unsupported(f"weight is on {weight.device}, x on {x.device}")
    if weight.shape != x.shape[-1:]:
        return vllm_ir.Unsupported(
            f"weight shape {list(weight.shape)} is not [{x.shape[-1]}] (native broadcasts it; ATen does not)"
        )
    return True


def _x(x: Tensor) -> bool | vllm_ir.Unsupported:
    if x.dtype not in DTYPES:
        return vllm_ir.Unsupported(
            f"dtype {x.dtype} is not float32, bfloat16 or float16"
            + (" (native computes float64 in float32; ATen would not match it)" if x.dtype == torch.float64 else "")
        )
    if x.dim() == 0:
        return vllm_ir.Unsupported("x is 0-d (ATen normalizes over a last dimension)")
    return True


def _rms_norm_supports(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None):
    if variance_size is not None:
        return vllm_ir.Unsupported("variance_size is not supported by torch.nn.functional.rms_norm")
    return _x(x) and _weight(x, weight)


@vllm_ir.ops.rms_norm.register_impl(PROVIDER, supports_args=_rms_norm_supports)
def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, epsilon)


def _fused_supports(
    x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
):
    if x_residual.dtype != x.dtype:
        return vllm_ir.Unsupported(f"residual dtype {x_residual.dtype} != x dtype {x.dtype}")
    if x_residual.device != x.device:
        return vllm_ir.Unsupported(f"residual is on {x_residual.device}, x on {x.device}")
    if x_residual.shape != x.shape:
        return vllm_ir.Unsupported(
            f"residual shape {list(x_residual.shape)} != x shape {list(x.shape)} (native broadcasts; in place cannot)"
        )
    return _x(x) and _weight(x, weight)


@vllm_ir.ops.fused_add_rms_norm.register_impl(PROVIDER, supports_args=_fused_supports, inplace=True)
def fused_add_rms_norm(
    x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> tuple[Tensor, Tensor]:
    x_residual.add_(x)  # the sum, rounded to x's dtype once: the new residual
    x_var = x_residual if variance_size is None else x_residual[..., :variance_size]
    # sqrt(sum of squares) in fp32 without an fp32 copy of the activations; then mean, + eps, rsqrt.
    scale = torch.linalg.vector_norm(x_var, dim=-1, keepdim=True, dtype=torch.float32)
    # No square_()/rsqrt_(): Inductor has no lowering for pow_/rsqrt_ (under CI=1 its ATen
    # fallback for them is an error); mul_/div_/add_ it lowers.
    scale = scale.mul_(scale).div_(x_var.shape[-1]).add_(epsilon).rsqrt()
    torch.mul(x_residual, scale, out=x)
    if weight is not None:
        x.mul_(weight)
    return x, x_residual


def _gelu_tanh_supports(x: Tensor) -> bool | vllm_ir.Unsupported:
    if x.dtype not in DTYPES:
        return vllm_ir.Unsupported(
            f"dtype {x.dtype} is not float32, bfloat16 or float16"
            + (" (native computes float64 in float32; ATen would not match it)" if x.dtype == torch.float64 else "")
        )
    return True


def _gelu_tanh(x: Tensor) -> Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


for _op in (vllm_ir.ops.gelu_new, vllm_ir.ops.gelu_fast):
    _op.register_impl(PROVIDER, supports_args=_gelu_tanh_supports, batch_invariant=True)(_gelu_tanh)
