"""Rotary position embedding (RoPE) of attention queries and keys.

Design of the signature: the op returns ``tuple[Tensor, Tensor | None]`` (torch schema
``(Tensor, Tensor?)``), so ``q, k = op(...)`` works with or without a key, and with
``key=None`` the second output is None. ``torch.library.infer_schema`` refuses optional
returns, but the dispatcher, fake tensors, autograd, AOTAutograd and Inductor handle them;
`vllm_ir.ir.signature.infer_schema` writes the schema itself. An in-place kernel returns
exactly its donated inputs ``(query, key)``; with ``key=None`` only ``query`` is donated.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from vllm_ir.ir.impl import Unsupported
from vllm_ir.ir.op import register_op


@register_op(allow_inplace=True, activations=("query", "key"), token_params=("positions", "query", "key"))
def rotary_embedding(
    positions: Tensor,
    query: Tensor,
    key: Tensor | None,
    head_size: int,
    cos_sin_cache: Tensor,
    is_neox_style: bool,
    rotary_dim: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Rotate the first ``rotary_dim`` channels of every head of ``query`` (and ``key``) by position.

    ``positions`` (integer, any shape) flattens to ``[T]``; ``query``/``key`` are
    ``[T, heads * head_size]`` or ``[..., heads, head_size]``, each viewed as
    ``[T, -1, head_size]`` and returned in its own shape. ``cos_sin_cache`` is
    ``[max_position, rotary_dim]`` = ``cat(cos, sin)`` per position; ``rotary_dim`` (default:
    the cache's width) must be even, at most ``head_size`` and equal the cache's width. The
    channels past ``rotary_dim`` pass through unchanged.

    Neox style rotates the halves ``x1 = x[:r/2], x2 = x[r/2:]``; GPT-J style the interleaved
    pairs ``x1 = x[0::2], x2 = x[1::2]``: ``o1 = x1*cos - x2*sin``, ``o2 = x2*cos + x1*sin``.

    Rounding points (vLLM's native and CUDA kernel): cos and sin are cast to x's dtype, each
    product is rounded to x's dtype, then the sum/difference is rounded again. Kernels compute
    in fp32 with the same roundings, so they agree with this function to the last bit up to
    fp32 contraction (the default tolerances of OPS.md 4.8 apply).

    vLLM: ``RotaryEmbedding.forward_native`` (``rotary_embedding/base.py``: the cache cast to
    query's dtype, then ``forward_static`` and ``ApplyRotaryEmb.forward_static``), bit for bit
    on CPU for fp32, bf16 and fp16, neox and GPT-J style, partial rotary_dim and strided inputs
    (tests/test_vllm_reference.py).
    """
    rot = cos_sin_cache.shape[-1] if rotary_dim is None else rotary_dim
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[-1] != rot or rot % 2 or rot > head_size:
        raise ValueError(
            f"rotary_embedding: cos_sin_cache of shape {list(cos_sin_cache.shape)} does not hold rotary_dim={rot} "
            f"(it must be [max_position, rotary_dim], rotary_dim even and at most head_size={head_size})"
        )
    positions = positions.flatten()
    cos_sin = cos_sin_cache[positions]
    half = rot // 2
    cos, sin = cos_sin[:, :half].unsqueeze(-2), cos_sin[:, half:].unsqueeze(-2)
    tokens = positions.shape[0]

    def rotate(x: Tensor) -> Tensor:
        if x.numel() == 0:
            return x.clone()
        heads = x.reshape(tokens, -1, head_size)
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        x_rot, x_pass = heads[..., :rot], heads[..., rot:]
        if is_neox_style:
            x1, x2 = x_rot[..., :half], x_rot[..., half:]
            rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        else:
            x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
            rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
        return torch.cat((rotated, x_pass), dim=-1).reshape(x.shape)

    return rotate(query), None if key is None else rotate(key)


def inplace_kernel_verdict(dtypes: tuple[torch.dtype, ...]) -> Callable[..., bool | Unsupported]:
    """The predicate of a kernel that rotates [T, heads, head_size] views in place, reading int64
    positions and the cache in query's dtype (one of ``dtypes``): what it declines, for a
    provider's ``supports`` tuple before its own limits (devices, sizes). It reads dtypes,
    devices, dimensions, the per-token size, the last stride and the scalars, never the batch
    size or values."""

    def verdict(
        positions: Tensor,
        query: Tensor,
        key: Tensor | None,
        head_size: int,
        cos_sin_cache: Tensor,
        rotary_dim: int | None,
    ) -> bool | Unsupported:
        if query.dtype not in dtypes:
            return Unsupported(f"dtype {query.dtype} is not supported ({', '.join(str(d)[6:] for d in dtypes)})")
        if positions.dtype != torch.int64:
            return Unsupported(f"positions are {positions.dtype} (the kernel reads int64)")
        if head_size <= 0:
            return Unsupported(f"head_size {head_size} is not positive")
        rot = cos_sin_cache.shape[-1] if rotary_dim is None and cos_sin_cache.dim() else rotary_dim
        if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[-1] != rot:
            return Unsupported(
                f"cos_sin_cache of shape {list(cos_sin_cache.shape)} is not [max_position, rotary_dim={rot}]"
            )
        if rot % 2 or rot > head_size:
            return Unsupported(f"rotary_dim {rot} is odd or exceeds head_size {head_size}")
        if cos_sin_cache.dtype != query.dtype:
            return Unsupported(
                f"cos_sin_cache is {cos_sin_cache.dtype}, query {query.dtype} (the kernel reads it in x's dtype)"
            )
        for name, t in (("positions", positions), ("cos_sin_cache", cos_sin_cache), ("key", key)):
            if t is not None and t.device != query.device:
                return Unsupported(f"{name} is on {t.device}, query on {query.device}")
        for name, t in (("query", query), ("key", key)):
            if t is None:
                continue
            if t.dtype != query.dtype:
                return Unsupported(f"key is {t.dtype}, query {query.dtype}")
            if t.dim() < 2:
                return Unsupported(
                    f"{name} is {t.dim()}-d (the kernel takes [tokens, ...] with heads after the tokens)"
                )
            if math.prod(t.shape[1:]) % head_size:
                return Unsupported(f"{name}'s per-token size {math.prod(t.shape[1:])} is not a multiple of head_size")
            if t.stride(-1) != 1 and t.shape[-1] != 1:
                return Unsupported(f"{name} has stride {t.stride(-1)} along the last dimension (the kernel needs 1)")
        return True

    return verdict


def check_token_counts(who: str, positions: Tensor, query: Tensor, key: Tensor | None, head_size: int) -> None:
    """Raise where query's or key's token count is not positions' (native raises too): a kernel
    binding's check, not a predicate's, since the decision cache is keyed without token counts
    and a relation between two of them cannot be part of a verdict. ``who`` names the kernel."""
    per_token = positions.numel() * head_size
    if per_token == 0:
        return  # no tokens: nothing is rotated
    for name, t in (("query", query), ("key", key)):
        if t is not None and t.numel() % per_token:
            raise ValueError(
                f"{who}: {name} of shape {list(t.shape)} is not "
                f"[{positions.numel()} tokens (positions has {positions.numel()}), heads, {head_size}]"
            )


def build_cos_sin_cache(
    max_position: int, rotary_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu", base: float = 10000.0
) -> Tensor:
    """vLLM's cache: ``cat(cos, sin)`` of ``t * inv_freq``, computed in fp32, stored in ``dtype``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / max(rotary_dim, 1)))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device=device, dtype=dtype)


def head_layout(hidden: int) -> tuple[int, int]:
    """(heads, head_size) for a row of ``hidden`` channels: 128- or 64-wide heads where they
    divide it (4096 -> 32 x 128, 64 -> 1 x 64), else one head of the whole row (odd sizes)."""
    for size in (128, 64):
        if hidden % size == 0 and hidden >= size:
            return hidden // size, size
    return 1, max(hidden, 1)


#: Positions the generated cache holds; generated positions are drawn below it.
MAX_POSITION = 96


def _generate(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    *,
    is_neox_style: bool = True,
    partial: bool = False,
    with_key: bool = True,
    layout: str = "flat",
    kv_heads: int | None = None,
    pass_rotary_dim: bool = True,
    seed: int = 0,
) -> tuple:
    """Inputs for a kit shape ``(*leading, hidden)``: ``leading`` are the token dims (positions
    has that shape), ``hidden`` maps to heads x head_size (`head_layout`).

    ``layout``: "flat" ``[..., heads*head_size]``; "heads" ``[..., heads, head_size]``;
    "sliced" heads padded by 64 channels (``[..., heads, head_size]`` views with a head stride
    of head_size + 64, as vLLM's kernel test); "qkv" query and key are column slices of one
    ``[T, q + k + v]`` projection output (as models split it). ``partial`` rotates half of
    each head (rounded down to even); ``kv_heads`` gives the key fewer heads (GQA).
    """
    g = torch.Generator().manual_seed(seed)
    *leading, hidden = shape
    heads, head_size = head_layout(hidden)
    rotary_dim = head_size - head_size % 2
    if partial:
        rotary_dim = (head_size // 2) - (head_size // 2) % 2
    kheads = heads if kv_heads is None else min(kv_heads, heads)

    def values(*dims: int) -> Tensor:
        return torch.randn(dims, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)

    def activation(nh: int) -> Tensor:
        if layout == "flat":
            return values(*leading, nh * head_size)
        if layout == "heads":
            return values(*leading, nh, head_size)
        if layout == "sliced":
            return values(*leading, nh, head_size + 64)[..., :head_size]
        raise ValueError(f"unknown layout {layout!r}")

    if layout == "qkv":
        q_size, k_size = heads * head_size, kheads * head_size
        qkv = values(*leading, q_size + 2 * k_size)
        query, key = qkv[..., :q_size], qkv[..., q_size : q_size + k_size]
    else:
        query, key = activation(heads), activation(kheads)
    positions = torch.randint(0, MAX_POSITION, tuple(leading), generator=g, dtype=torch.int64).to(device)
    cache = build_cos_sin_cache(MAX_POSITION, rotary_dim, dtype, device)
    return (
        positions,
        query,
        key if with_key else None,
        head_size,
        cache,
        is_neox_style,
        rotary_dim if pass_rotary_dim else None,
    )


rotary_embedding.input_generator(_generate)
rotary_embedding.add_input_variant("gptj", is_neox_style=False)
rotary_embedding.add_input_variant("partial", partial=True, benchmark=True)
rotary_embedding.add_input_variant("gptj_partial", is_neox_style=False, partial=True)
rotary_embedding.add_input_variant("no_key", with_key=False)
rotary_embedding.add_input_variant("heads_3d", layout="heads")
rotary_embedding.add_input_variant("sliced", layout="sliced")
rotary_embedding.add_input_variant("qkv_slices", layout="qkv")
rotary_embedding.add_input_variant("gqa", kv_heads=1)
rotary_embedding.add_input_variant("rotary_dim_default", pass_rotary_dim=False)
