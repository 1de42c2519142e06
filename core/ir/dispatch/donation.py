"""Whether a ``maybe_inplace`` call may let an in-place kernel overwrite its donated inputs.

An in-place kernel reads and writes its activations element by element; if a donated
activation overlaps itself (an expanded, stride-0 view) or any other tensor argument of the
call (``x is x_residual``, overlapping rows, a weight that views the activation), the kernel
reads values it has already overwritten and the result is silently wrong. Such a call runs
the functional path instead (fresh outputs, inputs untouched), which ``maybe_inplace``
permits: it *may* reuse its inputs, it never has to.

`donation_conflict` is the reference; the compiled lookup has the same check in C
(``donation_conflict`` in ``core/ir/dispatch/fast_lookup.cpp``), and tests hold both to the same answers.
Anything the check cannot prove disjoint counts as a conflict.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def may_self_overlap(t: torch.Tensor) -> bool:
    """True when two elements of ``t`` may share memory (stride 0, or interleaving strides)."""
    if t.is_contiguous():
        return False
    dims = sorted((stride, size) for stride, size in zip(t.stride(), t.shape, strict=True) if size > 1)
    reach = 0
    for stride, size in dims:
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def may_share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of two non-empty tensors intersect in one storage (or cannot be told)."""
    try:
        if a.untyped_storage()._cdata != b.untyped_storage()._cdata:  # the StorageImpl itself
            return False
    except (RuntimeError, NotImplementedError):  # no storage (functorch wrappers): cannot tell
        return True
    a0, a1 = _byte_range(a)
    b0, b1 = _byte_range(b)
    return a0 < b1 and b0 < a1


def disjoint_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two views of one storage provably share no element, by their row structure.

    The case the byte-range check cannot tell: column slices of one wider tensor (``q`` and
    ``k`` split from one ``qkv`` projection). When both have the same element size and the
    same stride ``S`` along dimension 0, and every other dimension spans less than ``S``, the
    elements of each lie at ``offset + t * S + [0, span)``; the two are disjoint when those
    windows do not meet modulo ``S``. Anything else is not proven disjoint.
    """
    if a.dim() < 1 or b.dim() < 1 or a.element_size() != b.element_size():
        return False
    row = a.stride(0)
    if row <= 0 or b.stride(0) != row:
        return False
    spans = []
    for t in (a, b):
        span = 1 + sum(stride * (size - 1) for stride, size in zip(t.stride()[1:], t.shape[1:], strict=True))
        if any(stride < 0 for stride in t.stride()) or span > row:
            return False
        spans.append(span)
    ra, rb = a.storage_offset() % row, b.storage_offset() % row
    return (rb - ra) % row >= spans[0] and (ra - rb) % row >= spans[1]


def precise_donation_conflict(
    donated: Sequence[int], tensors: Sequence[int], args: Sequence[Any]
) -> tuple[int, int] | None:
    """`donation_conflict`, with overlapping byte ranges refined by `disjoint_rows`.

    Run only where the quick check reported a conflict, so the common call pays nothing for it.
    """
    return _first_conflict(donated, tensors, args, lambda a, b: may_share_memory(a, b) and not disjoint_rows(a, b))


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    last = sum(stride * (size - 1) for stride, size in zip(t.stride(), t.shape, strict=True))
    start = t.storage_offset() * t.element_size()
    return start, start + (last + 1) * t.element_size()


def donation_conflict(donated: Sequence[int], tensors: Sequence[int], args: Sequence[Any]) -> tuple[int, int] | None:
    """``(i, j)`` when donated argument ``i`` overlaps itself (``j == i``) or tensor argument ``j``."""
    return _first_conflict(donated, tensors, args, may_share_memory)


def _first_conflict(
    donated: Sequence[int],
    tensors: Sequence[int],
    args: Sequence[Any],
    overlap: Callable[[torch.Tensor, torch.Tensor], bool],
) -> tuple[int, int] | None:
    def tensor_at(i: int) -> torch.Tensor | None:
        value = args[i]
        return value if i in tensors and isinstance(value, torch.Tensor) and value.numel() else None

    for i in donated:
        a = tensor_at(i)
        if a is None:
            continue
        if may_self_overlap(a):
            return i, i
        for j in range(len(args)):
            b = None if j == i else tensor_at(j)
            if b is not None and overlap(a, b):
                return i, j
    return None
