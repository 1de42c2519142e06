"""Rotary position embedding in Triton: one program per (token, head), in place.

The implementation is registered in place (``inplace=True``): ``op.maybe_inplace(...)``
rotates the donated query and key where they are (strided views included) and returns
them; ``op(...)`` runs it on clones. Arithmetic is fp32 with each product and each sum
rounded to the dtype, the op's rounding points.
"""

from __future__ import annotations

from torch import Tensor

import vllm_ir
from vllm_ir.ir.declarations.rotary import inplace_kernel_verdict
from vllm_ir_provider_triton import DTYPES, TRITON, on_cpu_verdict

#: Channel pairs one program rotates at most (its registers on GPUs).
MAX_ROTARY_DIM = 4096


def max_rotary_dim(cos_sin_cache: Tensor, rotary_dim: int | None) -> bool | vllm_ir.Unsupported:
    if (cos_sin_cache.shape[-1] if rotary_dim is None else rotary_dim) > MAX_ROTARY_DIM:
        return vllm_ir.Unsupported(f"rotary_dim > {MAX_ROTARY_DIM} (one head per program)")
    return True


if TRITON.available:
    from vllm_ir_provider_triton.kernels.rotary import rotary_embedding_


@TRITON.impl(
    "rotary_embedding",
    supports=(inplace_kernel_verdict(DTYPES), max_rotary_dim, lambda query: on_cpu_verdict(query)),
    inplace=True,
)
def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox_style, rotary_dim=None):
    rot = cos_sin_cache.shape[-1] if rotary_dim is None else rotary_dim
    rotary_embedding_(positions, query, key, head_size, cos_sin_cache, is_neox_style, rot)
    return query, key
