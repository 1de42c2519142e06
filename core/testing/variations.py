"""Calls that differ from a base call in exactly one fact the dispatch cache must key on.

A cached decision may be reused only for calls whose predicate-visible facts are those of
the call it was made on (DESIGN.md, contract 4): dtype, device, every dimension except the
token dimension of token tensors, strides, ``None`` vs tensor, scalar arguments. Each
variation here changes one of them, so a cache that ignores it answers with the base call's
decision where the predicates would choose differently.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Iterator
from typing import Any

import torch

from vllm_ir.ir.op import IrOp
from vllm_ir.testing.cases import row_strided

#: Every tensor argument is tried in each of these dtypes.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: A dtype argument (e.g. an fp8 output dtype) is tried as each of these.
DTYPE_ARGUMENTS = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float32)
#: Row padding of the "row-padded" layout (another one when the base call is padded already).
ROW_PADDING = 16


def token_params(op: IrOp) -> tuple[str, ...]:
    """Tensor parameters whose leading dimension, where they have two or more, is the token count."""
    return tuple(getattr(op, "token_params", op.activations))


def fresh(t: torch.Tensor, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous tensor like ``t`` (deterministic values), optionally of another shape or dtype."""
    shape = tuple(t.shape) if shape is None else shape
    dtype = t.dtype if dtype is None else dtype
    if t.device.type == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    g = torch.Generator().manual_seed(1)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(device=t.device, dtype=dtype)


def transposed(t: torch.Tensor) -> torch.Tensor:
    """The same values, laid out with the last two dimensions swapped in memory."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values with a stride of 2 along the last dimension."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    view = wide[..., ::2]
    view.copy_(t)
    return view


def broadcast_rows(t: torch.Tensor) -> torch.Tensor:
    """The first slice along dimension 0 repeated by a stride-0 view (an expanded tensor)."""
    return t[:1].expand(t.shape)


def layouts(t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``t`` in every layout class other than its own: contiguous, row-padded, transposed/strided, stride 0."""
    candidates: list[tuple[str, torch.Tensor]] = [("contiguous", t.contiguous())]
    if t.dim() >= 2:
        padded = t.stride(-1) == 1 and not t.is_contiguous()
        pad = 3 if padded else ROW_PADDING
        candidates.append((f"rows padded by {pad}", row_strided(t.contiguous(), pad)))
        candidates.append(("transposed", transposed(t)))
    if t.dim() >= 1:
        candidates.append(("last-dimension stride 2", strided(t)))
    if t.dim() >= 1 and t.shape[0] > 1:
        candidates.append(("stride 0 along dimension 0", broadcast_rows(t)))
    seen = {t.stride()}
    for label, value in candidates:
        if value.stride() not in seen:
            seen.add(value.stride())
            yield label, value


def _like_layout(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """``new`` with ``base``'s row padding, where ``base`` has padded rows (one fact changes, not two)."""
    if base.dim() >= 2 and base.stride(-1) == 1 and not base.is_contiguous():
        pad = base.stride(-2) - base.shape[-1]
        if pad > 0:
            return row_strided(new, pad)
    return new


def _optional(param: inspect.Parameter) -> bool:
    if param.default is None:
        return True
    origin = typing.get_origin(param.annotation)
    return origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(param.annotation)


def _donors(op: IrOp, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> list[tuple[Any, ...]]:
    """Arguments from the op's input variants: where a value comes from when the base call has None."""
    donors = []
    for options in [{}, *op.input_variants.values()]:
        try:
            donors.append(op.generate_inputs(shape, dtype, device, **options))
        except Exception:  # a variant that does not apply to this shape
            continue
    return donors


def _scalar_values(param: inspect.Parameter, value: Any, donated: list[Any]) -> Iterator[tuple[str, Any]]:
    if value is None:
        for other in donated:
            if other is not None:
                yield f"None -> {other!r}", other
                return
        return
    if isinstance(value, torch.dtype):
        for other in DTYPE_ARGUMENTS:
            if other != value:
                yield f"{_name(value)} -> {_name(other)}", other
        return
    if isinstance(value, bool):
        yield f"{value} -> {not value}", not value
    elif isinstance(value, int):
        yield f"{value} -> {value + 1}", value + 1
    elif isinstance(value, float):
        changed = value * 2 if value else 1e-3
        yield f"{value!r} -> {changed!r}", changed
    if _optional(param):
        yield f"{value!r} -> None", None


def key_variations(op: IrOp, base: tuple[Any, ...]) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """``(label, args)`` for each call that differs from ``base`` in exactly one cache-key fact.

    ``base`` is a full positional argument tuple (as `Case.make_args` returns).
    """
    params = list(op.signature.parameters.values())
    tokens = set(token_params(op))
    first = next((a for a in base if isinstance(a, torch.Tensor)), None)
    shape = tuple(first.shape) if first is not None else (3, 8)
    dtype = first.dtype if first is not None else torch.float32
    donors = _donors(op, shape, dtype, first.device if first is not None else torch.device("cpu"))

    def replaced(i: int, value: Any) -> tuple[Any, ...]:
        return (*base[:i], value, *base[i + 1 :])

    for i, (param, value) in enumerate(zip(params, base, strict=True)):
        name = param.name
        if name in op.tensor_params:
            if value is None:
                donated = next((d[i] for d in donors if isinstance(d[i], torch.Tensor)), None)
                if donated is not None:
                    yield f"{name}: None -> tensor {list(donated.shape)}", replaced(i, donated)
                continue
            yield from ((f"{name}: {label}", replaced(i, v)) for label, v in _tensor_variations(value, name in tokens))
            if op.tensor_params[name]:
                yield f"{name}: tensor -> None", replaced(i, None)
        elif name not in op.list_params:
            donated = [d[i] for d in donors]
            for label, changed in _scalar_values(param, value, donated):
                yield f"{name}: {label}", replaced(i, changed)


def _tensor_variations(t: torch.Tensor, token: bool) -> Iterator[tuple[str, torch.Tensor]]:
    for d in range(t.dim()):
        if d == 0 and token and t.dim() >= 2:
            continue  # the token count: not a key fact (a 1-D activation is one row: its dimension is hidden)
        size = t.shape[d]
        for n in dict.fromkeys((size + 1, 1)):
            if n != size:
                shape = (*t.shape[:d], n, *t.shape[d + 1 :])
                yield f"dimension {d} {size} -> {n}", _like_layout(fresh(t, shape), t)
    yield from layouts(t)
    yield f"{t.dim()}-d -> {t.dim() + 1}-d", t.unsqueeze(0)
    if t.dim() >= 2:
        yield f"{t.dim()}-d -> {t.dim() - 1}-d", t.flatten(0, 1)
    for dtype in FLOAT_DTYPES:
        if dtype != t.dtype:
            yield f"dtype {_name(t.dtype)} -> {_name(dtype)}", t.to(dtype)
    if t.device.type != "meta":
        yield f"device {t.device} -> meta", t.to("meta")
    if t.device.type not in ("meta", "cpu"):
        yield f"device {t.device} -> cpu", t.cpu()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
