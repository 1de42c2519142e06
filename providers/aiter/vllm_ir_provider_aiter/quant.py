"""AITER's FP8 quantization: ``static_quant_fp8`` with a per-tensor scale.

What AITER has and what it lacks (``aiter/ops/quant.py``, ``csrc/kernels/quant_kernels.cu``,
checked against the 2026 tree):

- ``static_per_tensor_quant(out, input, scale)``: ``q = fp8(x * rcp(scale))`` with the GPU's
  approximate reciprocal (``__builtin_amdgcn_rcpf``: within an ulp, so rare elements land one
  fp8 step from native's; the kit compares dequantized values), rows at ``row * K`` (no row
  stride), fp16/bf16 input, ``out`` of ``aiter.dtypes.fp8`` only -- e4m3fnuz on gfx942, whose
  AITER range is the dtype's +-240 where the op clamps to +-224 (declined), e4m3fn on gfx950.
- Its dynamic kernels are not registered: ``dynamic_per_tensor_quant`` and
  ``dynamic_per_token_scaled_quant`` apply no minimum scale (an all-zero row gets scale 0
  and ``q = 0 * rcp(0)``, NaN, where the op gives the floor and q = 0), and the per-token
  kernel ignores its ``scale_ub`` argument.
- Its group quant (``dynamic_per_group_scaled_quant``, recent releases) takes group sizes
  32/64/128 with fp32 scales but no UE8M0 rounding and a 1e-10 absmax floor; not wrapped yet.
- Rotary embedding is not wrapped: AITER's ``rope_cached_positions_2c_fwd_inplace`` takes
  separate ``[max_position, 1, 1, rotary_dim / 2]`` cos and sin caches, which the op's
  ``cat(cos, sin)`` cache would have to be split into (a copy of the whole cache per call, or
  a cache keyed on tensor identity), and it rejects partial rotary.
"""

from __future__ import annotations

import torch
from torch import Tensor

import vllm_ir
from vllm_ir.ir.declarations.quant import padded_shape, padding_verdict
from vllm_ir_provider_aiter import AITER, _on_gpu, ops

DTYPES = (torch.float16, torch.bfloat16)


def static_rules(x: Tensor, fp8_dtype: torch.dtype) -> bool | vllm_ir.Unsupported:
    """The device, then x's and the fp8 dtype's rules (unit-tested on CPU tensors, the device
    check stood in for); the scale's, the padding's and the GPU's fp8 dtype follow."""
    if not (on_gpu := _on_gpu(x)):
        return on_gpu
    if fp8_dtype != torch.float8_e4m3fn:
        return vllm_ir.Unsupported(
            f"fp8_dtype {fp8_dtype}: AITER clamps e4m3fnuz to its dtype max 240, the op to 224 (only e4m3fn is used)"
        )
    if x.dtype not in DTYPES:
        return vllm_ir.Unsupported(f"AITER's static quant takes float16/bfloat16, not {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % 8:
        return vllm_ir.Unsupported(
            "last dimension must be a multiple of 8: AITER loads 16-byte vectors from row t at t * K"
        )
    if not x.is_contiguous():
        return vllm_ir.Unsupported("x must be contiguous: AITER addresses row t at t * K, without a row stride")
    return True


def scale_rules(x: Tensor, scale: Tensor) -> bool | vllm_ir.Unsupported:
    if scale.dtype != torch.float32 or scale.device != x.device:
        return vllm_ir.Unsupported(f"scale must be float32 on x's device, got {scale.dtype} on {scale.device}")
    if scale.numel() != 1:
        return vllm_ir.Unsupported(
            f"a scale of shape {list(scale.shape)}: AITER's static quant takes one per-tensor scale"
        )
    return True


def gpu_fp8_rules(fp8_dtype: torch.dtype) -> bool | vllm_ir.Unsupported:
    """The fp8 dtype AITER writes on this GPU (imports AITER: asked last, on a ROCm GPU only)."""
    if ops.fp8_dtype() != fp8_dtype:
        return vllm_ir.Unsupported(f"AITER on this GPU quantizes to {ops.fp8_dtype()}, not {fp8_dtype}")
    return True


@AITER.impl("static_quant_fp8", supports=(static_rules, scale_rules, padding_verdict, gpu_fp8_rules))
def static_quant_fp8(x, scale, fp8_dtype, num_token_padding=None):
    if scale.numel() != 1:
        raise ValueError(
            f"static_quant_fp8 (provider aiter): AITER takes one per-tensor scale, got shape {list(scale.shape)}"
        )
    if num_token_padding is not None and x.dim() != 2:
        raise ValueError(f"static_quant_fp8 (provider aiter): num_token_padding needs a 2-D x, got {x.dim()}-D")
    return ops.static_quant_fp8(x, scale, fp8_dtype, padded_shape(x, num_token_padding))
