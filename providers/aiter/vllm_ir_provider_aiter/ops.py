"""``vllm_ir_aiter::*`` custom ops: each AITER call is one opaque node for the compiler.

Targets AITER's long-standing public entry points (present since 2024 and used by vLLM's
ROCm path; checked against ROCm/aiter ``aiter/ops/rmsnorm.py`` as of 2026):

- ``aiter.rmsnorm2d_fwd(input, weight, epsilon, use_model_sensitive_rmsnorm=0) -> Tensor``
- ``aiter.rmsnorm2d_fwd_with_add(out, input, residual_in, residual_out, weight, epsilon, ...)``
  (writes ``out`` and ``residual_out``).

and AITER's activations (``aiter/ops/activation.py``, re-exported by ``aiter``; checked
against the 2026 tree), each writing a caller-allocated ``out``:

- ``aiter.silu_and_mul(out, input)`` / ``gelu_and_mul`` / ``gelu_tanh_and_mul``: ``input``
  is ``[..., 2d]`` with the gate first, ``out`` ``[..., d]`` (newer releases add an optional
  ``limit`` clamp to ``silu_and_mul``; it is left at its default 0, no clamp);
- ``aiter.gelu_fast(out, input)`` (elementwise; recent releases only);

and AITER's FP8 quantization (``aiter/ops/quant.py`` and ``csrc/kernels/quant_kernels.cu``):

- ``aiter.static_per_tensor_quant(out, input, scale)``: one float32 scale, ``out`` of
  ``aiter.dtypes.fp8``.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from vllm_ir.plugins.provider import aligned, deferred_custom_op, weight_or_ones


def _aiter():
    import aiter  # imported on first real call only: never at provider discovery

    return aiter


@functools.cache
def has_function(name: str) -> bool:
    """Whether the installed AITER exports ``name`` (imports AITER: called on the GPU path only)."""
    return callable(getattr(_aiter(), name, None))


@deferred_custom_op("vllm_ir_aiter::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float) -> Tensor:
    rows = x.reshape(-1, x.shape[-1])  # a view: the predicate only admits inputs that flatten without a copy
    return _aiter().rmsnorm2d_fwd(rows, weight_or_ones(x, weight), epsilon).view(x.shape)


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor | None, epsilon: float) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@deferred_custom_op("vllm_ir_aiter::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor | None, epsilon: float) -> tuple[Tensor, Tensor]:
    rows = x.reshape(-1, x.shape[-1])
    residual_rows = residual.reshape(-1, x.shape[-1])
    out = torch.empty_like(rows, memory_format=torch.contiguous_format)
    residual_out = torch.empty_like(residual_rows)
    _aiter().rmsnorm2d_fwd_with_add(out, rows, residual_rows, residual_out, weight_or_ones(x, weight), epsilon)
    return out.view(x.shape), residual_out.view(x.shape)


@fused_add_rms_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor | None, epsilon: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(residual)


#: The vendor's activation entry points, by the name `activation` takes: whether each is gated
#: (``[..., 2d]`` with the gate first -> ``[..., d]``) or elementwise.
FUNCTIONS = {"silu_and_mul": True, "gelu_and_mul": True, "gelu_tanh_and_mul": True, "gelu_fast": False}


def _new_out(x: Tensor, function: str) -> Tensor:
    """A fresh contiguous ``out`` of x's dtype: ``[..., d]`` for a gated function, x's shape else."""
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2) if FUNCTIONS[function] else x.shape)


@deferred_custom_op("vllm_ir_aiter::activation", mutates_args=())
def activation(x: Tensor, function: str) -> Tensor:
    """``aiter.<function>(out, x)`` into a fresh ``out``."""
    if function not in FUNCTIONS:
        raise ValueError(f"vllm_ir_aiter::activation: function must be one of {list(FUNCTIONS)}, not {function!r}")
    out = _new_out(x, function)
    if out.numel():  # AITER's kernels read 16-byte vectors from the data pointer
        getattr(_aiter(), function)(out, aligned(x))
    return out


activation.register_fake(_new_out)


@functools.cache
def fp8_dtype() -> torch.dtype:
    """AITER's fp8 dtype on this GPU (``aiter.dtypes.fp8``: e4m3fnuz on gfx942, e4m3fn on gfx950);
    its quant kernels write no other (imports AITER: called on the GPU path only)."""
    return _aiter().dtypes.fp8


@deferred_custom_op("vllm_ir_aiter::static_quant_fp8", mutates_args=())
def static_quant_fp8(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, shape: list[int]) -> Tensor:
    """``aiter.static_per_tensor_quant(out, x, scale)`` into the first x's rows of a fresh ``out`` of
    ``shape`` (x's, or padded rows: `padded_shape`); pad rows stay unwritten."""
    if list(shape[1:]) != list(x.shape[1:]) or (x.dim() and shape[0] < x.shape[0]):  # AITER would write past it
        raise ValueError(f"vllm_ir_aiter::static_quant_fp8: q of shape {list(shape)} cannot hold x {list(x.shape)}")
    out = x.new_empty(shape, dtype=fp8_dtype)
    if x.numel():
        written = out[: x.shape[0]] if out.shape != x.shape else out
        _aiter().static_per_tensor_quant(written, aligned(x), scale.reshape(1))
    return out


@static_quant_fp8.register_fake
def _(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, shape: list[int]) -> Tensor:
    return x.new_empty(shape, dtype=fp8_dtype)
