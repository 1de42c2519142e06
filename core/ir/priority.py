"""Which providers an op tries, in what order, and which layer asked for each.

Layers, lowest first: defaults (platform and provider hooks, per mode) < the
``VLLM_IR_OP_PRIORITY`` environment variable < `set_priority` (process-wide) < the scoped
`priority` context (per thread/task, nests). Each layer's list is placed in front of the
layers below it; the first occurrence of a provider wins; ``native`` always closes the list.

Everything here that is built lazily (settings, resolved lists, interned scopes) is built
under `registry.lock` after provider discovery has finished, so a thread's first call never
sees a half-loaded set of providers; cache hits take no lock.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from vllm_ir.errors import PriorityError, UnknownOpError
from vllm_ir.ir import registry
from vllm_ir.ir.impl import NATIVE, IrOpImpl

if TYPE_CHECKING:
    from vllm_ir.ir.op import IrOp

Mode = Literal["eager", "compile"]
MODES: tuple[Mode, ...] = ("eager", "compile")
FALLBACK_POLICIES = ("allow", "warn", "error")
ENV_PRIORITY = "VLLM_IR_OP_PRIORITY"
ENV_FALLBACK = "VLLM_IR_FALLBACK"
ENV_BATCH_INVARIANT = "VLLM_BATCH_INVARIANT"


class PriorityLayer(enum.IntEnum):
    """Where a priority entry came from; higher layers are tried first."""

    DEFAULT = 0
    ENV = 1
    GLOBAL = 2
    SCOPED = 3


@dataclass(frozen=True)
class PriorityEntry:
    """One provider in an op's effective priority, and who put it there."""

    provider: str
    layer: PriorityLayer
    #: Finer origin: ``"VLLM_IR_OP_PRIORITY"``, ``"set_priority"``, ``"platform cpu"``, ...
    source: str

    def __str__(self) -> str:
        return f"{self.provider} ({self.source})"


class EntryStatus(str, enum.Enum):
    CANDIDATE = "candidate"
    UNSUPPORTED = "unsupported"
    NOT_INSTALLED = "not installed"
    NOT_BATCH_INVARIANT = "not batch-invariant"
    UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class ResolvedEntry:
    entry: PriorityEntry
    status: EntryStatus
    reason: str | None = None


@dataclass(frozen=True)
class ResolvedPriority:
    """An op's merged priority for one mode and scope: everything, and what dispatch walks."""

    entries: tuple[ResolvedEntry, ...]
    candidates: tuple[tuple[IrOpImpl, PriorityEntry], ...]


#: Returns, for a mode, op name -> [(provider, source)] contributed by platforms and plugins.
DefaultsSource = Callable[[Mode], Mapping[str, Sequence[tuple[str, str]]]]


@dataclass(frozen=True)
class Settings:
    """What the environment says; read lazily once, again on `reload_env`."""

    op_priority: Mapping[str, tuple[str, ...]]
    fallback: str
    batch_invariant: bool


class _Scope:
    """An interned stack of scoped priority lists; hashed by identity for cheap cache keys."""

    __slots__ = ("__weakref__", "lists")

    def __init__(self, lists: tuple[tuple[str, tuple[str, ...]], ...]):
        self.lists = lists  # innermost first

    def lists_for(self, op_name: str) -> Iterator[tuple[str, ...]]:
        for name, providers in self.lists:
            if name == op_name:
                yield providers


#: The innermost ``priority()`` scope; read by the eager hot path (also from C, see fast_lookup).
scope_var: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("vllm_ir_priority_scope", default=None)
_interned_scopes: dict[tuple, _Scope] = {}
_global: dict[str, tuple[str, ...]] = {}
_defaults_source: DefaultsSource | None = None
_settings: Settings | None = None
_resolved: dict[tuple[str, Mode, _Scope | None], ResolvedPriority] = {}
registry.on_invalidate(_resolved.clear)

current_scope = scope_var.get


def settings() -> Settings:
    global _settings
    current = _settings
    if current is not None:
        return current
    registry.ensure_providers_loaded()  # the environment names plugin providers
    with registry.lock:
        if _settings is None:
            _settings = _read_env(os.environ)
        return _settings


def reload_env() -> Settings:
    """Re-read ``VLLM_IR_OP_PRIORITY``, ``VLLM_IR_FALLBACK`` and ``VLLM_BATCH_INVARIANT``."""
    global _settings
    with registry.lock:
        _settings = None
        registry.invalidate()
        return settings()


def set_defaults_source(source: DefaultsSource | None) -> None:
    """Install where default priorities come from (the plugin layer's merged hooks)."""
    global _defaults_source
    with registry.lock:
        _defaults_source = source
        registry.invalidate()


def set_priority(**op_priorities: Sequence[str] | None) -> None:
    """Set process-wide priorities, e.g. ``set_priority(rms_norm=["vllm_c", "native"])``.

    The list goes in front of the environment and the defaults. ``None`` (or an empty
    list) clears the op's process-wide list. Unknown ops or providers raise `PriorityError`.
    """
    validated = {op: _validate(op, providers, "set_priority") for op, providers in op_priorities.items()}
    with registry.lock:
        for op, providers in validated.items():
            if providers:
                _global[op] = providers
            else:
                _global.pop(op, None)
        registry.invalidate()


def clear_priority() -> None:
    """Forget every `set_priority` list."""
    with registry.lock:
        _global.clear()
        registry.invalidate()


@contextlib.contextmanager
def priority(**op_priorities: Sequence[str]) -> Iterator[None]:
    """Scoped priorities for this thread or task; nests, and is undone on exit or exception::

    with vllm_ir.priority(rms_norm=["triton", "vllm_c"]):
        model(x)
    """
    new = tuple((op, _validate(op, providers, "priority()")) for op, providers in op_priorities.items())
    outer = scope_var.get()
    lists = new + (outer.lists if outer is not None else ())
    scope = _interned_scopes.get(lists)
    if scope is None:
        with registry.lock:  # one _Scope per stack: decision caches are keyed by its identity
            scope = _interned_scopes.setdefault(lists, _Scope(lists))
    token = scope_var.set(scope)
    try:
        yield
    finally:
        scope_var.reset(token)


def resolve(op: IrOp, mode: Mode = "eager", scope: _Scope | None = None) -> ResolvedPriority:
    """Merge every layer for ``op`` and classify each entry (cached until invalidated)."""
    registry.ensure_providers_loaded()  # waits while another thread runs discovery
    key = (op.name, mode, scope)
    hit = _resolved.get(key)
    if hit is not None:
        return hit
    with registry.lock:
        epoch = registry.epoch
        resolved = _resolve(op, mode, scope)
        if registry.epoch == epoch:  # nothing changed while it was built (a failing hook may withdraw a plugin)
            _resolved[key] = resolved
        return resolved


def _resolve(op: IrOp, mode: Mode, scope: _Scope | None) -> ResolvedPriority:
    st = settings()
    raw: list[PriorityEntry] = []
    if scope is not None:
        for providers in scope.lists_for(op.name):
            raw += [PriorityEntry(p, PriorityLayer.SCOPED, "priority() context") for p in providers]
    raw += [PriorityEntry(p, PriorityLayer.GLOBAL, "set_priority") for p in _global.get(op.name, ())]
    raw += [PriorityEntry(p, PriorityLayer.ENV, ENV_PRIORITY) for p in st.op_priority.get(op.name, ())]
    if _defaults_source is not None:
        defaults = _defaults_source(mode).get(op.name, ())
        raw += [PriorityEntry(p, PriorityLayer.DEFAULT, src) for p, src in defaults]
    raw.append(PriorityEntry(NATIVE, PriorityLayer.DEFAULT, "always last"))

    seen: set[str] = set()
    entries: list[ResolvedEntry] = []
    candidates: list[tuple[IrOpImpl, PriorityEntry]] = []
    closed = False
    for entry in raw:
        if entry.provider in seen:
            continue
        seen.add(entry.provider)
        impl = op.impls.get(entry.provider)
        if impl is None:
            entries.append(
                ResolvedEntry(
                    entry, EntryStatus.NOT_INSTALLED, f"no {entry.provider!r} implementation of {op.name} is registered"
                )
            )
        elif not impl.supported:
            entries.append(ResolvedEntry(entry, EntryStatus.UNSUPPORTED, impl.unsupported_reason))
        elif st.batch_invariant and not impl.batch_invariant and impl.provider != NATIVE:
            entries.append(
                ResolvedEntry(
                    entry,
                    EntryStatus.NOT_BATCH_INVARIANT,
                    f"{ENV_BATCH_INVARIANT}=1 and this implementation is not batch-invariant",
                )
            )
        elif closed:
            entries.append(
                ResolvedEntry(
                    entry, EntryStatus.UNREACHABLE, f"after {candidates[-1][1].provider!r}, which accepts every call"
                )
            )
        else:
            entries.append(ResolvedEntry(entry, EntryStatus.CANDIDATE))
            candidates.append((impl, entry))
            closed = impl.supports_args is None
    return ResolvedPriority(tuple(entries), tuple(candidates))


def parse_priority_spec(spec: str, *, source: str = ENV_PRIORITY) -> dict[str, tuple[str, ...]]:
    """Parse ``"rms_norm=vllm_c,native;fused_add_rms_norm=triton"``; names are validated."""
    out: dict[str, tuple[str, ...]] = {}
    for raw in spec.split(";"):
        item = raw.strip()
        if not item:
            continue
        op, sep, rest = item.partition("=")
        op = op.strip()
        providers = [p.strip() for p in rest.split(",")]
        if not sep or not op:
            raise PriorityError(f"{source}: {item!r} is not of the form op=provider[,provider...] (in {spec!r})")
        if not rest.strip() or any(not p for p in providers):
            raise PriorityError(
                f"{source}: op {op!r} has an empty provider name in {item!r}; expected op=provider[,provider...]"
            )
        if op in out:
            raise PriorityError(f"{source}: op {op!r} is given twice")
        out[op] = _validate(op, providers, source)
    return out


def _read_env(env: Mapping[str, str]) -> Settings:
    fallback = env.get(ENV_FALLBACK, "warn").strip().lower() or "warn"
    if fallback not in FALLBACK_POLICIES:
        raise PriorityError(f"{ENV_FALLBACK}={env[ENV_FALLBACK]!r}: expected one of {', '.join(FALLBACK_POLICIES)}")
    bi = env.get(ENV_BATCH_INVARIANT, "0").strip().lower()
    if bi not in ("", "0", "1", "true", "false"):
        raise PriorityError(f"{ENV_BATCH_INVARIANT}={env[ENV_BATCH_INVARIANT]!r}: expected 0 or 1")
    return Settings(
        op_priority=parse_priority_spec(env.get(ENV_PRIORITY, "")),
        fallback=fallback,
        batch_invariant=bi in ("1", "true"),
    )


def _validate(op_name: str, providers: Sequence[str] | None, source: str) -> tuple[str, ...]:
    registry.ensure_providers_loaded()
    try:
        op = registry.get_op(op_name)
    except UnknownOpError as exc:
        raise UnknownOpError(f"{source}: {exc}") from None
    if providers is None:
        return ()
    if isinstance(providers, str):
        raise PriorityError(
            f"{source}: priority of op {op_name!r} must be a list of provider names, got the string {providers!r}"
        )
    out = tuple(providers)
    for p in out:
        if p not in op.impls:
            raise PriorityError(
                f"{source}: unknown provider {p!r} for op {op_name!r}; "
                f"known providers of {op_name}: {', '.join(sorted(op.impls))}"
            )
    return out
