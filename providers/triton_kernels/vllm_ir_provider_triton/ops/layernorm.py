"""RMSNorm and fused add + RMSNorm in Triton.

One program per row; the whole row is loaded once (BLOCK = next power of two >= hidden),
reduced in fp32, and written once: x read + out written (+ residual read and written).
Arithmetic is fp32 throughout and values are cast at load/store, which also keeps the
Triton CPU interpreter exact (its bf16 arithmetic yields NaN). Rounding follows the op (vLLM
0.33's): the normalized fp32 value is rounded to the *weight's* dtype, multiplied, rounded to
it again, then cast to x's dtype, for any pair of float32/bfloat16/float16 dtypes.

The kernels are exposed as ``torch.library.triton_op``s in the ``vllm_ir_triton`` namespace
so the vllm-ir lowering pass traces them into compiled graphs.
"""

from __future__ import annotations

import torch
from torch import Tensor

import vllm_ir
from vllm_ir.ir.declarations.layernorm import residual_verdict, variance_size_verdict
from vllm_ir_provider_triton import DTYPES, TRITON, on_cpu_verdict

#: Rows longer than this would not fit one program's registers on GPUs: declined.
MAX_HIDDEN = 65536


def rms_norm_supports(x: Tensor, weight: Tensor | None) -> bool | vllm_ir.Unsupported:
    """What both norms check after `variance_size_verdict` (rms_norm's predicate)."""
    if x.dtype not in DTYPES:
        return vllm_ir.Unsupported(f"dtype {x.dtype} is not one of float32, float16, bfloat16")
    if x.dim() == 0:
        return vllm_ir.Unsupported("x is 0-d (the kernels work along a last dimension)")
    if x.shape[-1] > MAX_HIDDEN:
        return vllm_ir.Unsupported(f"hidden size {x.shape[-1]} > {MAX_HIDDEN} (one row per program)")
    if weight is not None and weight.dtype not in DTYPES:
        return vllm_ir.Unsupported(f"weight dtype {weight.dtype} is not one of float32, float16, bfloat16")
    if weight is not None and weight.device != x.device:
        return vllm_ir.Unsupported(f"weight is on {weight.device}, x on {x.device}")
    if weight is not None and weight.shape != x.shape[-1:]:
        return vllm_ir.Unsupported(f"weight shape {list(weight.shape)} is not [{x.shape[-1]}] (native broadcasts it)")
    if weight is not None and not weight.is_contiguous():
        return vllm_ir.Unsupported("weight is not contiguous")
    if not x.is_contiguous() and not (x.dim() == 2 and x.stride(-1) == 1):
        return vllm_ir.Unsupported("input must be contiguous, or 2-D rows with a unit inner stride")
    return on_cpu_verdict(x)


def residual_rows(x_residual: Tensor) -> bool | vllm_ir.Unsupported:
    """fused_add_rms_norm's residual after the declaration's `residual_verdict` (like x): in rows."""
    if not x_residual.is_contiguous() and not (x_residual.dim() == 2 and x_residual.stride(-1) == 1):
        return vllm_ir.Unsupported("residual must be contiguous, or 2-D rows with a unit inner stride")
    return True


#: What both norms check (rms_norm's predicate).
NORM = (variance_size_verdict, rms_norm_supports)


if TRITON.available:
    from vllm_ir_provider_triton.kernels.layernorm import fused_add_rms_norm_, rms_norm_out


# The norms make no batch-invariance claim: the provider's default is turned off for them.
@TRITON.impl("rms_norm", supports=NORM, batch_invariant=False)
def rms_norm(x, weight, epsilon, variance_size=None):
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    rms_norm_out(out, x, weight, epsilon)
    return out


@TRITON.impl(
    "fused_add_rms_norm", supports=(residual_verdict, residual_rows, *NORM), inplace=True, batch_invariant=False
)
def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None):
    fused_add_rms_norm_(x, x_residual, weight, epsilon)
    return x, x_residual
