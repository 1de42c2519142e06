"""The process-wide table of ops, and the one switch that invalidates every cache.

Anything that can change a dispatch decision (a new implementation, a removed provider, a
priority change, a re-read environment) calls `invalidate`, which bumps `epoch` and clears
the per-op decision caches and resolved priority lists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from vllm_ir.errors import UnknownOpError

if TYPE_CHECKING:
    from vllm_ir.ir.op import IrOp

_ops: dict[str, IrOp] = {}
_invalidation_listeners: list[Callable[[], None]] = []
_providers_loader: Callable[[], None] | None = None
epoch = 0


def add_op(op: IrOp) -> None:
    _ops[op.name] = op
    invalidate()


def has_op(name: str) -> bool:
    return name in _ops


def get_op(name: str) -> IrOp:
    """The op called ``name``; an `UnknownOpError` listing the known ops otherwise."""
    try:
        return _ops[name]
    except KeyError:
        raise UnknownOpError(f"unknown op {name!r}; known ops: {', '.join(sorted(_ops)) or '(none)'}") from None


def all_ops() -> list[IrOp]:
    return [_ops[n] for n in sorted(_ops)]


def on_invalidate(listener: Callable[[], None]) -> None:
    """Call ``listener`` whenever decisions must be recomputed."""
    _invalidation_listeners.append(listener)


def invalidate() -> None:
    """Drop every cached decision and resolved priority list."""
    global epoch
    epoch += 1
    for op in _ops.values():
        op._clear_decisions()
    for listener in _invalidation_listeners:
        listener()


def set_providers_loader(loader: Callable[[], None] | None) -> None:
    """Install the function that discovers plugin providers (run lazily, once)."""
    global _providers_loader
    _providers_loader = loader


def ensure_providers_loaded() -> None:
    """Run provider discovery if it has not run yet; cheap after the first call."""
    if _providers_loader is not None:
        _providers_loader()


class OpNamespace:
    """``vllm_ir.ops``: every registered op as an attribute (``vllm_ir.ops.rms_norm``)."""

    def __getattr__(self, name: str) -> IrOp:
        if name.startswith("__"):
            raise AttributeError(name)
        return get_op(name)

    def __dir__(self) -> list[str]:
        return sorted(_ops)

    def __iter__(self) -> Iterator[IrOp]:
        return iter(all_ops())

    def __contains__(self, name: object) -> bool:
        return name in _ops

    def __repr__(self) -> str:
        return f"<vllm_ir.ops: {', '.join(sorted(_ops))}>"


ops = OpNamespace()
