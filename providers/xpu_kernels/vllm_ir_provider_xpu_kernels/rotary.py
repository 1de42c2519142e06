"""vllm-xpu-kernels' rotary embedding, in place.

``import vllm_xpu_kernels._C`` registers (``csrc/torch_bindings.cpp``, ``csrc/pos_encoding_kernels.cpp``,
checked against the 2026 tree) ``torch.ops._C.rotary_embedding(positions, query, key, head_size,
cos_sin_cache, is_neox)``: vLLM's kernel, rotating ``query`` and ``key`` (or None) where they
are. It reads the rotary width from ``cos_sin_cache.size(1)`` (partial rotary works), token t of
``query`` at ``t * query.stride(0)`` and head h at ``h * head_stride``, where ``head_stride`` is
``query.stride(-2)`` for a ``[T, heads, head_size]`` query, else ``head_size`` -- for the key
too, so the key must have the query's head stride. Products and sums are computed in x's dtype
(the op's rounding points). Positions are read as int64, the cache as x's dtype, contiguous.

The wrapper passes ``positions`` flattened and query/key as ``[T, heads, head_size]`` views
(no copy; sliced and row-strided layouts keep their strides), and is registered in place.
"""

from __future__ import annotations

from torch import Tensor

import vllm_ir
from vllm_ir.ir.declarations.rotary import check_token_counts, inplace_kernel_verdict
from vllm_ir_provider_xpu_kernels import DTYPES, XPU, _on_xpu, _vendor_ops


def _heads(x: Tensor, token_dims: int, head_size: int) -> Tensor | None:
    """``x`` (``token_dims`` leading token dimensions) as a ``[T, heads, head_size]`` view sharing
    its memory with a unit channel stride, or None where no such view exists."""
    if x.dim() <= token_dims or head_size <= 0:
        return None
    try:
        rows = x.view(-1, *x.shape[token_dims:]) if x.numel() else x.reshape(-1, *x.shape[token_dims:])
        view = rows.view(rows.shape[0], -1, head_size)
    except RuntimeError:
        return None
    return view if view.stride(-1) == 1 or head_size == 1 else None


def _views(
    positions: Tensor, query: Tensor, key: Tensor | None, head_size: int
) -> tuple[Tensor, Tensor | None] | vllm_ir.Unsupported:
    """The views the kernel gets, or why there are none."""
    token_dims = max(positions.dim(), 1)
    q, k = (None if t is None else _heads(t, token_dims, head_size) for t in (query, key))
    for name, t, view in (("query", query, q), ("key", key, k)):
        if t is not None and view is None:
            return vllm_ir.Unsupported(
                f"{name} is not a [tokens, heads, head_size] view with a unit channel stride "
                "(the kernel writes in place)"
            )
    if k is not None and k.shape[1] > 1 and k.stride(1) != q.stride(1):
        return vllm_ir.Unsupported(
            f"key's head stride {k.stride(1)} differs from query's {q.stride(1)} (the kernel uses query's for both)"
        )
    return q, k


def contiguous_cache(cos_sin_cache: Tensor) -> bool | vllm_ir.Unsupported:
    if not cos_sin_cache.is_contiguous():
        return vllm_ir.Unsupported("cos_sin_cache must be a contiguous [max_position, rotary_dim] tensor")
    return True


def views_verdict(positions: Tensor, query: Tensor, key: Tensor | None, head_size: int) -> bool | vllm_ir.Unsupported:
    views = _views(positions, query, key, head_size)
    return views if isinstance(views, vllm_ir.Unsupported) else True


#: The kernel's predicate: the device (looked up per call, so tests stand it in), what every
#: in-place rotary kernel asks (`inplace_kernel_verdict`), then a contiguous cache and the views.
SUPPORTS = (lambda query: _on_xpu(query), inplace_kernel_verdict(DTYPES), contiguous_cache, views_verdict)


@XPU.impl("rotary_embedding", supports=SUPPORTS, inplace=True)
def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox_style, rotary_dim=None):
    who = "rotary_embedding (provider xpu_kernels)"
    check_token_counts(who, positions, query, key, head_size)
    views = _views(positions, query, key, head_size)
    if isinstance(views, vllm_ir.Unsupported):
        raise ValueError(f"{who}: {views.reason}")
    q, k = views
    for name, view in (("query", q), ("key", k)):  # the kernel reads one position per row of the view
        if view is not None and view.shape[0] != positions.numel():
            raise ValueError(f"{who}: {name} has {view.shape[0]} token rows, positions {positions.numel()}")
    if q.shape[0]:
        _vendor_ops().rotary_embedding(positions.reshape(-1), q, k, head_size, cos_sin_cache, is_neox_style)
    return query, key
