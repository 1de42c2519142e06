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


def tensor_facts(t: torch.Tensor, token: bool) -> tuple[Any, ...]:
    """The facts of ``t`` a predicate may read; ``token``: its leading dimension is the token count.

    The number of dimensions is implied by the strides (one per dimension).
    """
    if t.layout is not torch.strided:
        return (t.dtype, t.device, t.layout, t.shape)
    return (t.dtype, t.device, t.shape[1:] if token and t.dim() else t.shape, t.stride())


def freeze(value: Any) -> Any:
    """A hashable stand-in for a list argument (its tensors by their facts, all dimensions kept)."""
    if isinstance(value, (list, tuple)):
        return tuple(tensor_facts(v, False) if isinstance(v, torch.Tensor) else v for v in value)
    return value
