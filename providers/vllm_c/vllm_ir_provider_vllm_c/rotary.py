"""Rotary position embedding: ``rotary_embedding`` (csrc/cpu/rotary.cpp, csrc/cuda/rotary.cu).

One in-place kernel (``inplace=True``), vLLM's common form: ``op.maybe_inplace(...)`` rotates
the donated query and key where they are (strided views such as slices of one qkv tensor
included) and returns them; ``op(...)`` runs it on clones.

The predicate says why a call is declined. It reads dtypes, devices, the number of
dimensions, the per-token size, the last dimension's stride and the scalar arguments, never
the batch size or values.
"""

from __future__ import annotations

from torch import Tensor

from vllm_ir import Unsupported
from vllm_ir.ir.declarations.rotary import check_token_counts, inplace_kernel_verdict

from ._extension import DEVICES, DTYPES, PROVIDER, STATUS, VLLM_C, torch_op

#: vllm_c goes first in eager mode on CPU: benchmarks/rotary_cpu.py (32 heads x 128, rotary_dim
#: 128 and 64, T 1-4096, bf16 and fp32; 2 threads on a loaded 2-core VM) measured it 2.5-178x
#: faster than native eager and 1.4-78x faster than Inductor-compiled native at every shape.
#: CUDA (an H200, `vllm-ir bench --device cuda`, bf16 [T, 4096], T 1/256/4096): 3-7x faster
#: than native eager at every T (T=4096: 94 us, 41 us partial, against 323 and 276 us).
EAGER_FIRST = {platform: ("rotary_embedding",) for platform in ("cpu", "cuda")}


_kernel = torch_op(STATUS, "rotary_embedding")


def built_for(query: Tensor) -> bool | Unsupported:
    if query.device.type not in DEVICES:
        return Unsupported(f"device {query.device.type} is not supported (kernels built for: {', '.join(DEVICES)})")
    return True


# Each (token, head) is rotated on its own: results never depend on the batch.
@VLLM_C.impl(
    "rotary_embedding", supports=(built_for, inplace_kernel_verdict(DTYPES)), inplace=True, batch_invariant=True
)
def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox_style, rotary_dim=None):
    rot = cos_sin_cache.shape[-1] if rotary_dim is None else rotary_dim
    # The C++ side checks the token counts as well, but on an H200 with torch 2.11 that failing
    # check crashed the process instead of raising.
    check_token_counts(f"rotary_embedding (provider {PROVIDER!r})", positions, query, key, head_size)
    _kernel(positions, query, key, head_size, cos_sin_cache, is_neox_style, rot)
    return query, key
