"""Rotary position embedding in Triton: one program per (token, head), in place.

The implementation is registered in place (``inplace=True``): ``op.maybe_inplace(...)``
rotates the donated query and key where they are (strided views included) and returns
them; ``op(...)`` runs it on clones. Arithmetic is fp32 with each product and each sum
rounded to the dtype, the op's rounding points.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import vllm_ir
from vllm_ir_provider_triton import TRITON, interpreting

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Channel pairs one program rotates at most (its registers on GPUs).
MAX_ROTARY_DIM = 4096


def rotary_embedding_supports(
    positions: Tensor, query: Tensor, key: Tensor | None, head_size: int, cos_sin_cache: Tensor, rotary_dim: int | None
) -> bool | vllm_ir.Unsupported:
    if query.dtype not in _DTYPES:
        return vllm_ir.Unsupported(f"dtype {query.dtype} is not one of float32, float16, bfloat16")
    if positions.dtype != torch.int64:
        return vllm_ir.Unsupported(f"positions are {positions.dtype} (the kernel reads int64)")
    if head_size <= 0:
        return vllm_ir.Unsupported(f"head_size {head_size} is not positive")
    rot = cos_sin_cache.shape[-1] if rotary_dim is None and cos_sin_cache.dim() else rotary_dim
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[-1] != rot:
        return vllm_ir.Unsupported(
            f"cos_sin_cache of shape {list(cos_sin_cache.shape)} is not [max_position, rotary_dim={rot}]"
        )
    if rot % 2 or rot > head_size:
        return vllm_ir.Unsupported(f"rotary_dim {rot} is odd or exceeds head_size {head_size}")
    if rot > MAX_ROTARY_DIM:
        return vllm_ir.Unsupported(f"rotary_dim {rot} > {MAX_ROTARY_DIM} (one head per program)")
    if cos_sin_cache.dtype != query.dtype:
        return vllm_ir.Unsupported(f"cos_sin_cache is {cos_sin_cache.dtype}, query {query.dtype}")
    for name, t in (("positions", positions), ("cos_sin_cache", cos_sin_cache), ("key", key)):
        if t is not None and t.device != query.device:
            return vllm_ir.Unsupported(f"{name} is on {t.device}, query on {query.device}")
    for name, t in (("query", query), ("key", key)):
        if t is None:
            continue
        if t.dtype != query.dtype:
            return vllm_ir.Unsupported(f"key is {t.dtype}, query {query.dtype}")
        if t.dim() < 2:
            return vllm_ir.Unsupported(f"{name} is {t.dim()}-d (the kernel takes [tokens, ...])")
        if math.prod(t.shape[1:]) % head_size:
            return vllm_ir.Unsupported(f"{name}'s per-token size is not a multiple of head_size {head_size}")
        if t.stride(-1) != 1 and t.shape[-1] != 1:
            return vllm_ir.Unsupported(f"{name} has stride {t.stride(-1)} along the last dimension (needs 1)")
    if query.device.type == "cpu" and not interpreting():
        return vllm_ir.Unsupported("CPU tensors need TRITON_INTERPRET=1")
    return True


if TRITON.available:
    from vllm_ir_provider_triton.kernels.rotary import rotary_embedding_


@TRITON.impl("rotary_embedding", supports=rotary_embedding_supports, inplace=True)
def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox_style, rotary_dim=None):
    rot = cos_sin_cache.shape[-1] if rotary_dim is None else rotary_dim
    rotary_embedding_(positions, query, key, head_size, cos_sin_cache, is_neox_style, rot)
    return query, key
