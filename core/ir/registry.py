"""The process-wide table of ops, and the one switch that invalidates every cache.

Anything that can change a dispatch decision (a new implementation, a removed provider, a
priority change, a re-read environment) calls `invalidate`, which bumps `epoch` and clears
the per-op decision caches and resolved priority lists.

`lock` guards every slow path that builds shared state: provider discovery, the merged
default priorities, resolved priority lists and the table itself. It is re-entrant because
discovery re-enters itself (a plugin's import registers implementations, which invalidate;
a hook may ask for a priority). The hot path, a cached decision, never takes it.

**Discovery.** The IR core never imports the plugin layer. What discovery knows -- how to run
it, the hooks' default priorities, the provider names it found, why one is absent, the facts
the tuning layer needs -- reaches the core through one object, `Discovery`, which the plugin
layer hands over once with `connect_discovery`. Discovery stays lazy (it runs on the first
call that needs it, so it reads the environment as it is then, not at ``import vllm_ir``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_ir.errors import UnknownOpError

if TYPE_CHECKING:
    from vllm_ir.ir.op import IrOp

_ops: dict[str, IrOp] = {}
_invalidation_listeners: list[Callable[[], None]] = []
_connection_listeners: list[Callable[[], None]] = []
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


def _nothing() -> None:
    return None


def _no_defaults(mode: str) -> Mapping[str, Sequence[tuple[str, str]]]:
    return {}


def _no_reason(provider: str) -> str | None:
    return None


@dataclass(frozen=True)
class Discovery:
    """What provider discovery answers the IR core (see the module doc); each field is asked
    lazily, under `lock`. The defaults describe a process without plugins."""

    #: Run discovery unless it has run; waits while another thread runs it.
    ensure_loaded: Callable[[], None] = _nothing
    #: mode -> {op: [(provider, where that default comes from)]}: the providers' default priorities.
    defaults: Callable[[str], Mapping[str, Sequence[tuple[str, str]]]] = _no_defaults
    #: Provider names discovery found besides the registered implementations (entry points,
    #: withdrawn plugins): a priority list naming one is not a typo.
    known_names: Callable[[], Iterable[str]] = tuple
    #: Why ``provider`` has no implementation here (its plugin failed, was refused, blocked or
    #: left unloaded), as ``providers list`` shows it; None when discovery knows no reason.
    absence_reason: Callable[[str], str | None] = _no_reason
    #: The platform, provider versions and shipped tables (`vllm_ir.ir.tuning.Facts`); None: CPU, none.
    tuning_facts: Callable[[], Any] | None = None


_discovery = Discovery()


def connect_discovery(discovery: Discovery) -> None:
    """Hand the core what discovery answers: the plugin layer calls this once, at import (a test
    may connect a variant, ``dataclasses.replace(registry.discovery(), defaults=...)``, and
    reconnect the previous one after). Every decision and table read from the old one is dropped."""
    global _discovery
    with lock:
        _discovery = discovery
        for listener in _connection_listeners:
            listener()
        invalidate()


def discovery() -> Discovery:
    """The connected `Discovery` (a process without plugins until the plugin layer connects one)."""
    return _discovery


def on_connect(listener: Callable[[], None]) -> None:
    """Call ``listener`` when another `Discovery` is connected (the tuning layer re-reads its tables)."""
    _connection_listeners.append(listener)


def ensure_providers_loaded() -> None:
    """Run provider discovery if it has not run yet; cheap after the first call.

    While another thread runs discovery this waits for it to finish, so that no thread
    decides anything from a half-loaded set of providers.
    """
    _discovery.ensure_loaded()


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
