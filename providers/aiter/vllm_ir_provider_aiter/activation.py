"""AITER's activations: ``silu_and_mul``, ``gelu_and_mul`` (both approximations), ``gelu_fast``.

What AITER has and what it lacks (``aiter/ops/activation.py``, 2026 tree):

- ``silu_and_mul``, ``gelu_and_mul``, ``gelu_tanh_and_mul`` take ``[..., 2d]`` with the gate
  first, rows at ``token * 2d`` (no row stride), in fp32/fp16/bf16. They keep fp32 through the
  multiply (vLLM rounds the activation first): ~1 ulp from native, inside the tolerances.
- ``gelu_fast`` runs on fp16/bf16 only, with a saturating rational tanh (|error| <= 1e-3).
- No ``mul_and_silu``, ``fatrelu_and_mul``, ``gelu_new``, ``quick_gelu`` or ``relu2``; its
  ``swiglu_and_mul`` is GPT-OSS's function on *halves* with alpha and limit fixed, where
  ``swigluoai_and_mul`` takes interleaved gate/up pairs: none of these is registered.

Predicates follow the kernels' addressing: contiguous rows, halves that start on a 16-byte
boundary, no 0-d input. Every call goes through one custom op, ``vllm_ir_aiter::activation``.
Empty inputs never reach AITER (its launch math divides by the row length and launches zero
blocks): the custom op returns the empty result itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

import vllm_ir
from vllm_ir.ir.declarations.activation import approximate_verdict, check_approximate
from vllm_ir_provider_aiter import AITER, _on_gpu, ops

GATED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_GELU_FUNCTIONS = {"none": "gelu_and_mul", "tanh": "gelu_tanh_and_mul"}


def gated_rules(x: Tensor) -> bool | vllm_ir.Unsupported:
    """The gated kernels' predicate: the device, then the argument rules (unit-tested on CPU
    tensors, the device check stood in for)."""
    if not (on_gpu := _on_gpu(x)):
        return on_gpu
    if x.dtype not in GATED_DTYPES:
        return vllm_ir.Unsupported(f"AITER's gated activations take float32/float16/bfloat16, not {x.dtype}")
    if x.dim() == 0:
        return vllm_ir.Unsupported("x is 0-d (gated ops split the last dimension)")
    if x.shape[-1] == 0 or x.shape[-1] % 16:
        return vllm_ir.Unsupported(
            f"last dimension {x.shape[-1]} is not a positive multiple of 16: AITER reads each half "
            "with 16-byte vector loads, so the up half must start 16-byte aligned"
        )
    if not x.is_contiguous():
        return vllm_ir.Unsupported("x must be contiguous: AITER addresses row t at t * 2d, without a row stride")
    return True


def gelu_fast_rules(x: Tensor) -> bool | vllm_ir.Unsupported:
    """``aiter.gelu_fast``'s predicate: the device, the argument rules, then whether the installed
    AITER has it (unit-tested on CPU tensors, the device check stood in for)."""
    if not (on_gpu := _on_gpu(x)):
        return on_gpu
    if x.dtype != torch.bfloat16:
        return vllm_ir.Unsupported(
            f"AITER's gelu_fast is used for bfloat16 only, not {x.dtype}: it has no float32 kernel, and "
            "its tanh saturates at |y| >= 3.8 (error up to 1e-3), beyond float16's tolerance near x = -3.2"
        )
    if x.dim() == 0:
        return vllm_ir.Unsupported("x is 0-d (AITER's gelu_fast sizes its vectors from the last dimension)")
    if x.shape[-1] % 8:
        return vllm_ir.Unsupported(
            f"last dimension {x.shape[-1]} is not a multiple of 8: AITER's gelu_fast reads and writes "
            "whole vectors of up to 8 elements without bounds checks"
        )
    if not x.is_contiguous():
        return vllm_ir.Unsupported("x must be contiguous: AITER's gelu_fast walks it as one flat array")
    if not ops.has_function("gelu_fast"):  # imports AITER: asked last, on a ROCm GPU only
        return vllm_ir.Unsupported("this AITER has no gelu_fast (a later addition): upgrade AITER")
    return True


@AITER.impl("silu_and_mul", supports=gated_rules)
def silu_and_mul(x):
    return ops.activation(x, "silu_and_mul")


@AITER.impl("gelu_and_mul", supports=(approximate_verdict, gated_rules))
def gelu_and_mul(x, approximate="none"):
    check_approximate(approximate, "gelu_and_mul (provider aiter)")
    return ops.activation(x, _GELU_FUNCTIONS[approximate])


@AITER.impl("gelu_fast", supports=gelu_fast_rules)
def gelu_fast(x):
    return ops.activation(x, "gelu_fast")
