"""The process-wide table of ops, and the one switch that invalidates every cache.

Anything that can change a dispatch decision (a new implementation, a removed provider, a
priority change, a re-read environment) calls `invalidate`, which bumps `epoch` and clears
the per-op decision caches and resolved priority lists.

`lock` guards every slow path that builds shared state: provider discovery, the merged
default priorities, resolved priority lists and the table itself. It is re-entrant because
discovery re-enters itself (a plugin's import registers implementations, which invalidate;
a hook may ask for a priority). The hot path, a cached decision, never takes it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from vllm_ir.errors import UnknownOpError

if TYPE_CHECKING:
    from vllm_ir.ir.op import IrOp

_ops: dict[str, IrOp] = {}
_invalidation_listeners: list[Callable[[], None]] = []
_providers_loader: Callable[[], None] | None = None
epoch = 0
#: Held while discovery runs and while any lazily built structure is built (see above).
lock = threading.RLock()


def add_op(op: IrOp) -> None:
    with lock:
        _ops[op.name] = op
        invalidate()


def remove_op(name: str) -> IrOp | None:
    """Withdraw an op completely, its ``torch.ops.vllm_ir`` definition included.

    Used when the plugin that declared it fails after ``register_op`` ran, so that the name
    is free again and nothing refers to a half-loaded plugin.
    """
    with lock:
        op = _ops.pop(name, None)
        if op is None:
            return None
        library = getattr(op, "_library", None)
        if library is not None:
            library._destroy()  # also drops the cached torch.ops.vllm_ir.<name> packet
            op._library = None
        invalidate()
        return op


def has_op(name: str) -> bool:
    return name in _ops


def get_op(name: str) -> IrOp:
    """The op called ``name``; an `UnknownOpError` listing the known ops otherwise."""
    try:
        return _ops[name]
    except KeyError:
        raise UnknownOpError(f"unknown op {name!r}; known ops: {', '.join(sorted(_ops)) or '(none)'}") from None


def ops_implemented_by(provider: str) -> list[str]:
    """Names of the ops ``provider`` has an implementation of (for its default-priority hook)."""
    return [name for name in sorted(_ops) if provider in _ops[name].impls]


def all_ops() -> list[IrOp]:
    return [_ops[n] for n in sorted(_ops)]


def on_invalidate(listener: Callable[[], None]) -> None:
    """Call ``listener`` whenever decisions must be recomputed."""
    _invalidation_listeners.append(listener)


def invalidate() -> None:
    """Drop every cached decision and resolved priority list."""
    global epoch
    with lock:
        epoch += 1
        for op in list(_ops.values()):
            op.decision_cache.clear()
        for listener in _invalidation_listeners:
            listener()


def set_providers_loader(loader: Callable[[], None] | None) -> None:
    """Install the function that discovers plugin providers (run lazily, once)."""
    global _providers_loader
    _providers_loader = loader


def ensure_providers_loaded() -> None:
    """Run provider discovery if it has not run yet; cheap after the first call.

    While another thread runs discovery this waits for it to finish, so that no thread
    decides anything from a half-loaded set of providers.
    """
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
