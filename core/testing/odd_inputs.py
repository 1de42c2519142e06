"""Calls that are unusual but legal for native: an implementation must not raise on them.

The native function broadcasts like any PyTorch code, so it accepts a weight of shape [1]
or [1, H], a 0-d or 1-D activation, a residual of shape [H] while x is [T, H], expanded
(stride-0) or strided tensors and mixed dtypes. A kernel written for the common case raises
on such a call, or worse reads past a buffer: it must decline it in ``supports_args`` so
native runs. Calls native itself rejects (a tensor on another device) have no result: an
implementation must raise or decline, never return something.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_ir.ir.op import IrOp
from vllm_ir.testing.variations import FLOAT_DTYPES, broadcast_rows, strided, transposed

#: Shape of the calls the odd inputs are derived from: [tokens, hidden].
BASE_SHAPE = (3, 8)


def odd_inputs(op: IrOp, dtype: torch.dtype, device: str | torch.device = "cpu") -> list[tuple[str, tuple[Any, ...]]]:
    """``(label, args)`` for each odd call derived from a generated [3, 8] call in ``dtype``."""
    base = op.generate_inputs(BASE_SHAPE, dtype, device)
    names = list(op.signature.parameters)
    tensors = [i for i, a in enumerate(base) if isinstance(a, torch.Tensor)]
    acts = [i for i in op.activation_indices if isinstance(base[i], torch.Tensor)]
    out: list[tuple[str, tuple[Any, ...]]] = []

    def add(label: str, changes: dict[int, Any]) -> None:
        out.append((label, tuple(changes.get(i, a) for i, a in enumerate(base))))

    def other_dtypes(t: torch.Tensor) -> list[torch.dtype]:
        return [d for d in FLOAT_DTYPES if d != t.dtype]

    for i in tensors:
        if i in acts:
            continue
        t, name = base[i], names[i]
        add(f"{name} of shape [1]", {i: t.reshape(-1)[:1].clone()})
        add(f"{name} of shape {[1, *t.shape]}", {i: t.unsqueeze(0)})
        add(f"{name} 0-d", {i: t.reshape(-1)[0].clone()})
        if t.dim() >= 1 and t.shape[0] > 1:
            add(f"{name} expanded from one element (stride 0)", {i: t.reshape(-1)[:1].expand(t.shape)})
        if t.dim() >= 1:
            add(f"{name} with stride 2", {i: strided(t)})
        for d in other_dtypes(t):
            add(f"{name} in {_name(d)}", {i: t.to(d)})
        add(f"{name} on the meta device", {i: t.to("meta")})

    if acts:
        act_names = ", ".join(names[i] for i in acts)
        add(f"{act_names} 0-d", {i: base[i].reshape(-1)[0].clone() for i in acts})
        add(f"{act_names} 1-D", {i: base[i][0].clone() for i in acts})
    for i in acts:
        t, name = base[i], names[i]
        if len(acts) > 1:
            add(f"{name} of shape {list(t.shape[1:])} against {list(t.shape)} (broadcast)", {i: t[0].clone()})
            add(f"{name} of shape {[1, *t.shape[1:]]} against {list(t.shape)} (broadcast)", {i: t[:1].clone()})
            add(f"{name} 0-d, the others {list(t.shape)}", {i: t.reshape(-1)[0].clone()})
            for d in other_dtypes(t):
                add(f"{name} in {_name(d)}, the others in {_name(t.dtype)}", {i: t.to(d)})
        add(f"{name} rows expanded from one row (stride 0)", {i: broadcast_rows(t)})
        add(f"{name} transposed in memory", {i: transposed(t)})
        add(f"{name} on the meta device", {i: t.to("meta")})
    return out


def tolerance_dtype(args: tuple[Any, ...]) -> torch.dtype:
    """The least precise floating dtype among the tensor arguments: the one whose tolerance applies."""
    dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype.is_floating_point]
    return max(dtypes, key=lambda d: torch.finfo(d).eps, default=torch.float32)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
