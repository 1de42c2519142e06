"""What a cached dispatch decision is keyed on: every fact a predicate may read.

A ``supports_args`` predicate must not depend on the token (batch) count or on tensor
values; it may read everything else: dtype, device, every other dimension (hidden size,
head count, ...), strides, and whether an optional tensor is ``None``. So a call's key is
its scalar arguments plus, for each tensor, `tensor_facts`: a decision made for one call is
reused only for calls a conforming predicate cannot tell apart from it.

This is the one definition of the key. The compiled lookup (``csrc/fast_lookup.cpp``,
``tensor_facts``) packs the same facts into bytes; tests check both agree with an uncached
decision over every fact.
"""

from __future__ import annotations

from typing import Any

import torch


def tensor_facts(t: torch.Tensor, token: bool, lead: int | None = None) -> tuple[Any, ...]:
    """The facts of ``t`` a predicate may read.

    ``token``: ``t`` is a token parameter, so when it has two or more dimensions its leading
    one is the token count, which is left out (a 1-D activation's one dimension is its hidden
    size). ``lead``: for ops with several token parameters, the token count of the call's first
    such tensor (`first_token_count`); whether ``t`` has the same is a fact, since a ``[1, H]``
    residual broadcast against a ``[T, H]`` activation is not the same call as a ``[T, H]`` one.
    The number of dimensions is implied by the strides (one per dimension).
    """
    if t.layout is not torch.strided:
        return (t.dtype, t.device, t.layout, t.shape)
    if token and t.dim() >= 2:
        if lead is None:
            return (t.dtype, t.device, t.shape[1:], t.stride())
        return (t.dtype, t.device, t.shape[1:], t.stride(), t.shape[0] == lead)
    return (t.dtype, t.device, t.shape, t.stride())


def first_token_count(*tensors: torch.Tensor | None) -> int | None:
    """The leading dimension of the first tensor of two or more dimensions (token parameters in order)."""
    for t in tensors:
        if t is not None and t.layout is torch.strided and t.dim() >= 2:
            return t.shape[0]
    return None


def freeze(value: Any) -> Any:
    """A hashable stand-in for a list argument (its tensors by their facts, all dimensions kept)."""
    if isinstance(value, (list, tuple)):
        return tuple(tensor_facts(v, False) if isinstance(v, torch.Tensor) else v for v in value)
    return value
