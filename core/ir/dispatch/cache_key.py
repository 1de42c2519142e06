"""What a cached dispatch decision is keyed on: every fact a predicate may read.

A ``supports_args`` predicate must not depend on the token (batch) count or on tensor
values; it may read everything else: dtype, device, every other dimension (hidden size,
head count, ...), strides, and whether an optional tensor is ``None``. So a call's key is
its scalar arguments plus, for each tensor, `tensor_facts`: a decision made for one call is
reused only for calls a conforming predicate cannot tell apart from it. For an op a tuning
table chooses by token range (`vllm_ir.ir.tuning`), the key ends with the range bucket of
`token_count`, never the count itself.

This is the one definition of the key. The compiled lookup (``core/ir/dispatch/fast_lookup.cpp``,
``tensor_facts``) packs the same facts into bytes; tests check both agree with an uncached
decision over every fact.
"""

from __future__ import annotations

from typing import Any

import torch


def tensor_facts(t: torch.Tensor, token: bool, lead: int | None = None) -> tuple[Any, ...]:
    """The facts of ``t`` a predicate may read.

    ``token``: ``t`` is a token parameter, so when `has_token_dim` its leading dimension is
    the token count, which is left out. ``lead``: for ops with several token parameters, the
    token count of the call's first such tensor (`first_token_count`); whether ``t`` has the
    same is a fact, since a ``[1, H]`` residual broadcast against a ``[T, H]`` activation is not
    the same call as a ``[T, H]`` one.
    The number of dimensions is implied by the strides (one per dimension).
    """
    if t.layout is not torch.strided:
        return (t.dtype, t.device, t.layout, t.shape)
    if token and has_token_dim(t):
        if lead is None:
            return (t.dtype, t.device, t.shape[1:], t.stride())
        return (t.dtype, t.device, t.shape[1:], t.stride(), t.shape[0] == lead)
    return (t.dtype, t.device, t.shape, t.stride())


def has_token_dim(t: torch.Tensor) -> bool:
    """Whether a token tensor's leading dimension is the token count: with two or more
    dimensions, or 1-D of an integer dtype (positions, slot mappings: one index per token).
    A 1-D floating tensor's one dimension is its hidden size (a single token's activation)."""
    return t.dim() >= 2 or (t.dim() == 1 and not t.is_floating_point() and not t.is_complex())


def first_token_count(*tensors: torch.Tensor | None) -> int | None:
    """The token count of a call: the leading dimension of the first token tensor (token
    parameters in order) that `has_token_dim`; None when none has one."""
    for t in tensors:
        if t is not None and t.layout is torch.strided and has_token_dim(t):
            return t.shape[0]
    return None


token_count = first_token_count


def bucket(bucket_map: bytes, tokens: int | None) -> int:
    """The range bucket of a token count (None: one token), as the compiled lookup computes it."""
    return bucket_map[min(1 if tokens is None else tokens, 1 << 62).bit_length()]


def freeze(value: Any) -> Any:
    """A hashable stand-in for a list argument (its tensors by their facts, all dimensions kept)."""
    if isinstance(value, (list, tuple)):
        return tuple(tensor_facts(v, False) if isinstance(v, torch.Tensor) else v for v in value)
    return value
