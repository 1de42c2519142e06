"""Which providers an op tries, in what order, and which layer asked for each.

Layers, lowest first: defaults (platform and provider hooks, per mode, or an op's
`IrOp.set_default` list from code, which replaces the hooks' for that op) < measured tuning
tables (`vllm_ir.ir.tuning`: per op, mode, dtype and token range, so they apply to calls) < the site config
file (``VLLM_IR_CONFIG``, per mode, `vllm_ir.settings.config`) < the ``VLLM_IR_OP_PRIORITY``
environment variable < `set_priority` (process-wide) < the scoped `priority` context (per
thread/task, nests). Each layer's list is placed in front of the layers below it; the first
occurrence of a provider wins; ``native`` always closes the list.

Everything here that is built lazily (settings, resolved lists, interned scopes) is built
under `registry.lock` after provider discovery has finished, so a thread's first call never
sees a half-loaded set of providers; cache hits take no lock.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from vllm_ir.errors import PriorityError, UnknownOpError
from vllm_ir.ir import registry
from vllm_ir.ir.impl import NATIVE, IrOpImpl, reason_of
from vllm_ir.settings import dispatch as dispatch_settings
from vllm_ir.settings import env
from vllm_ir.settings.env import ConfigError, Finding

if TYPE_CHECKING:
    from vllm_ir.ir.op import IrOp
    from vllm_ir.ir.tuning import TuningEntry

Mode = Literal["eager", "compile"]
MODES: tuple[Mode, ...] = ("eager", "compile")
FALLBACK_POLICIES = env.FALLBACK_POLICIES
ENV_PRIORITY = env.ENV_PRIORITY
ENV_FALLBACK = env.ENV_FALLBACK
ENV_BATCH_INVARIANT = env.ENV_BATCH_INVARIANT


class PriorityLayer(enum.IntEnum):
    """Where a priority entry came from; higher layers are tried first."""

    DEFAULT = 0
    #: A measured tuning table's entry for the call's dtype and token range; source
    #: ``"tuning <path>, T ∈ [low, high)"`` (`vllm_ir.ir.tuning`).
    TUNING = 1
    #: The site config file (``VLLM_IR_CONFIG``); source ``"config <path>"``.
    CONFIG = 2
    ENV = 3
    GLOBAL = 4
    SCOPED = 5


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
    #: Reference mode (`reference`): every op runs native.
    REFERENCE = "reference mode"


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


@dataclass(frozen=True)
class Settings:
    """What the environment and the config file say; read lazily once, again on `reload_env`."""

    op_priority: Mapping[str, tuple[str, ...]]
    fallback: str
    batch_invariant: bool
    #: mode -> op -> providers from the config file (``VLLM_IR_CONFIG``), checked like the environment's.
    config_priority: Mapping[str, Mapping[str, tuple[str, ...]]] = dataclasses.field(default_factory=dict)
    #: The config layer's source string, ``"config /path/file.toml"``.
    config_source: str = "config"
    #: What was ignored (malformed, unknown) or names something this machine lacks.
    findings: tuple[Finding, ...] = ()
    #: ``VLLM_IR_REFERENCE=1``: every op runs native (`reference`).
    reference: bool = False


class _Scope:
    """An interned stack of scoped priority lists and switches; hashed by identity for cheap cache keys.

    The switches change what a decision runs, so decisions are cached per scope like the lists:
    ``traced`` (inside `vllm_ir.trace`: kernels run behind a recorder), ``labelled`` (a profiler
    is active: kernels run inside a named profiler range) and ``reference`` (`vllm_ir.reference`:
    every op runs native). A scope with none of them and no lists is ``None``.
    """

    __slots__ = ("__weakref__", "labelled", "lists", "reference", "traced")

    def __init__(
        self,
        lists: tuple[tuple[str, tuple[str, ...]], ...],
        traced: bool = False,
        labelled: bool = False,
        reference: bool = False,
    ):
        self.lists = lists  # innermost first
        self.traced = traced
        self.labelled = labelled
        self.reference = reference

    def lists_for(self, op_name: str) -> Iterator[tuple[str, ...]]:
        for name, providers in self.lists:
            if name == op_name:
                yield providers

    @property
    def switches(self) -> tuple[bool, bool, bool]:
        return (self.traced, self.labelled, self.reference)

    @property
    def observed(self) -> bool:
        """Calls run behind a recorder or a profiler range (`vllm_ir.ir.dispatch.observe`)."""
        return self.traced or self.labelled


def interned_scope(
    lists: tuple[tuple[str, tuple[str, ...]], ...], switches: tuple[bool, bool, bool] = (False, False, False)
) -> _Scope | None:
    """The one scope object for these lists and switches (None for the plain, empty scope)."""
    if not lists and not any(switches):
        return None
    key = (lists, switches)
    scope = _interned_scopes.get(key)
    if scope is None:
        with registry.lock:  # one _Scope per stack: decision caches are keyed by its identity
            scope = _interned_scopes.setdefault(key, _Scope(lists, *switches))
    return scope


def with_switches(
    scope: _Scope | None, *, traced: bool | None = None, labelled: bool | None = None, reference: bool | None = None
) -> _Scope | None:
    """``scope`` with some switches changed (None: kept)."""
    old = scope.switches if scope is not None else (False, False, False)
    new = tuple(o if n is None else n for o, n in zip(old, (traced, labelled, reference), strict=True))
    return interned_scope(scope.lists if scope is not None else (), new)  # type: ignore[arg-type]


#: Scopes as a running profiler sees them (`labelled_scope`).
_labelled: dict[_Scope | None, _Scope | None] = {}


def labelled_scope(scope: _Scope | None) -> _Scope | None:
    """The variant of ``scope`` whose decisions run inside named profiler ranges."""
    hit = _labelled.get(scope)
    if hit is None:
        hit = _labelled.setdefault(scope, with_switches(scope, labelled=True))
    return hit


_interned_scopes: dict[tuple, _Scope] = {}


def _initial_scope() -> _Scope | None:
    """``VLLM_IR_TRACE=1`` (or the config's ``trace = true``): every context starts traced."""
    return interned_scope((), (True, False, False)) if dispatch_settings.process_traced() else None


_initial = _initial_scope()
#: ``VLLM_IR_TRACE=1``: `vllm_ir.tools.tracing` keeps one trace for the whole process.
process_traced = _initial is not None
#: The innermost ``priority()`` scope; read by the eager hot path (also from C, see fast_lookup).
scope_var: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("vllm_ir_priority_scope", default=_initial)
_global: dict[str, tuple[str, ...]] = {}
#: (op, mode) -> providers set from code by `set_default`: replace the hooks' defaults of that op.
_code_defaults: dict[tuple[str, Mode], tuple[str, ...]] = {}
_settings: Settings | None = None
_resolved: dict[tuple[str, Mode, _Scope | None, TuningEntry | None], ResolvedPriority] = {}
registry.on_invalidate(_resolved.clear)

current_scope = scope_var.get


def settings() -> Settings:
    """The settings in force. Never raises: a malformed value is ignored with a `ConfigWarning`."""
    global _settings
    current = _settings
    if current is not None:
        return current
    registry.ensure_providers_loaded()  # the environment names plugin providers
    with registry.lock:
        if _settings is None:
            read = _read_env(os.environ)
            env.report(_OWNER, list(read.findings), replace=True)
            _settings = read
        return _settings


def reload_env() -> Settings:
    """Re-read ``VLLM_IR_OP_PRIORITY``, ``VLLM_IR_FALLBACK``, ``VLLM_BATCH_INVARIANT`` and the config file.

    Raises `vllm_ir.ConfigError` (a `PriorityError`) naming every malformed or unknown value;
    the settings in force are then those without the bad values, as an implicit read gives.
    """
    global _settings
    from vllm_ir.ir import tuning
    from vllm_ir.settings import config

    with registry.lock:
        _settings = None
        registry.invalidate()
        config.reload()
        tuning.reload()
        registry.ensure_providers_loaded()
        read = _read_env(os.environ)
        env.report(_OWNER, list(read.findings), replace=True, warn=False)
        _settings = read
    problems = [f for f in (*config.current().findings, *read.findings) if not f.here_only]
    if problems:
        raise ConfigError(Finding(problems[0].setting, "\n".join(f.message for f in problems), problems[0].fix))
    return read


_OWNER = "priority"


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


def set_default(op_name: str, providers: Sequence[str] | None, *, mode: Mode | None = None) -> None:
    """The platform-default list of ``op_name`` from code (`IrOp.set_default`): it replaces the
    hooks' defaults of that op in ``mode`` (both when None); None or empty restores them."""
    if mode is not None and mode not in MODES:
        raise PriorityError(f"set_default: mode must be one of {MODES}, got {mode!r}")
    validated = _validate(op_name, providers, "set_default")
    with registry.lock:
        for m in MODES if mode is None else (mode,):
            if validated:
                _code_defaults[(op_name, m)] = validated
            else:
                _code_defaults.pop((op_name, m), None)
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
    if outer is None:
        scope = interned_scope(new)
    else:
        scope = interned_scope(new + outer.lists, outer.switches)
    token = scope_var.set(scope)
    try:
        yield
    finally:
        scope_var.reset(token)


@contextlib.contextmanager
def switched(*, traced: bool | None = None, reference: bool | None = None) -> Iterator[None]:
    """Run the block in the current scope with some switches changed (see `_Scope`)."""
    token = scope_var.set(with_switches(scope_var.get(), traced=traced, reference=reference))
    try:
        yield
    finally:
        scope_var.reset(token)


def reference_reason(scope: _Scope | None = None) -> str | None:
    """Why every op runs native here (``VLLM_IR_REFERENCE=1``, the config's ``reference = true``
    or `vllm_ir.reference`), or None."""
    if scope is not None and scope.reference:
        return "pinned to native by vllm_ir.reference()"
    if settings().reference:
        if env.raw(env.ENV_REFERENCE) is not None:
            return f"pinned to native by {env.ENV_REFERENCE}=1"
        from vllm_ir.settings import config

        return f"pinned to native by {config.current().where('reference')}"
    return None


@contextlib.contextmanager
def reference() -> Iterator[None]:
    """Run every op native, eager and in graphs compiled inside the block: the first thing to try
    when a model's output looks wrong (if it is then right, a kernel is to blame)::

        with vllm_ir.reference():
            expected = model(x)

    A graph compiled before the block keeps the kernels it was lowered to; set
    ``VLLM_IR_REFERENCE=1`` to pin a whole process, compiles included.
    """
    with switched(reference=True):
        yield


def resolve(
    op: IrOp, mode: Mode = "eager", scope: _Scope | None = None, tuned: TuningEntry | None = None
) -> ResolvedPriority:
    """Merge every layer for ``op`` and classify each entry (cached until invalidated).

    ``tuned``: the tuning-table entry for the call being decided (`vllm_ir.ir.tuning.context`);
    without one (no call, or no table for it) the tuning layer contributes nothing.
    """
    registry.ensure_providers_loaded()  # waits while another thread runs discovery
    key = (op.name, mode, scope, tuned)
    hit = _resolved.get(key)
    if hit is not None:
        return hit
    with registry.lock:
        epoch = registry.epoch
        resolved = _resolve(op, mode, scope, tuned)
        if registry.epoch == epoch:  # nothing changed while it was built (a failing hook may withdraw a plugin)
            _resolved[key] = resolved
        return resolved


def _resolve(op: IrOp, mode: Mode, scope: _Scope | None, tuned: TuningEntry | None = None) -> ResolvedPriority:
    st = settings()
    raw: list[PriorityEntry] = []
    if scope is not None:
        for providers in scope.lists_for(op.name):
            raw += [PriorityEntry(p, PriorityLayer.SCOPED, "priority() context") for p in providers]
    raw += [PriorityEntry(p, PriorityLayer.GLOBAL, "set_priority") for p in _global.get(op.name, ())]
    raw += [PriorityEntry(p, PriorityLayer.ENV, ENV_PRIORITY) for p in st.op_priority.get(op.name, ())]
    config_list = st.config_priority.get(mode, {}).get(op.name, ())
    raw += [PriorityEntry(p, PriorityLayer.CONFIG, st.config_source) for p in config_list]
    if tuned is not None:
        source = f"tuning {tuned.path}, {tuned.range_text()}"
        raw += [PriorityEntry(p, PriorityLayer.TUNING, source) for p in tuned.providers]
    code_defaults = _code_defaults.get((op.name, mode))
    if code_defaults is not None:
        raw += [PriorityEntry(p, PriorityLayer.DEFAULT, "set_default") for p in code_defaults]
    else:
        defaults = registry.discovery().defaults(mode).get(op.name, ())
        raw += [PriorityEntry(p, PriorityLayer.DEFAULT, src) for p, src in defaults]
    raw.append(PriorityEntry(NATIVE, PriorityLayer.DEFAULT, "always last"))

    pinned = reference_reason(scope)
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
                    entry,
                    EntryStatus.NOT_INSTALLED,
                    registry.discovery().absence_reason(entry.provider)
                    or f"no {entry.provider!r} implementation of {op.name} is registered",
                )
            )
        elif not impl.supported:
            entries.append(ResolvedEntry(entry, EntryStatus.UNSUPPORTED, impl.unsupported_reason))
        elif mode == "compile" and not impl.lowerable:
            reason = reason_of(impl.lowerable, "cannot be traced into compiled graphs here")
            entries.append(ResolvedEntry(entry, EntryStatus.UNSUPPORTED, f"under compile: {reason}"))
        elif pinned is not None and impl.provider != NATIVE:
            entries.append(ResolvedEntry(entry, EntryStatus.REFERENCE, pinned))
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


def check_names(op_name: str, providers: Sequence[str], source: str) -> tuple[tuple[str, ...], list[Finding]]:
    """Check a priority list from the environment or the config file against what is installed.

    An unknown op, or a provider name that is a near miss of a known one (a typo,
    `env.looks_like_typo`), raises `ConfigError` listing the known ones. Any other provider not
    here (not installed, unsupported on this machine, or a third-party provider of other
    machines) stays in the list, where `resolve` marks it, and yields a note.
    """
    try:
        op = registry.get_op(op_name)
    except UnknownOpError as exc:
        hint = env.did_you_mean(op_name, [o.name for o in registry.all_ops()])
        raise dispatch_settings.priority_error(
            source, f"{exc}{hint}", f"use one of the known op names in {source}"
        ) from None
    notes: list[Finding] = []
    known = {p for o in registry.all_ops() for p in o.impls} | set(registry.discovery().known_names())
    for p in providers:
        impl = op.impls.get(p)
        if impl is not None:
            if not impl.supported:
                notes.append(
                    Finding(
                        source,
                        f"{source}: provider {p!r} for op {op_name!r} is unsupported here "
                        f"({impl.unsupported_reason}); calls use the next provider",
                        f"nothing to do if this setting is shared with machines where {p} runs",
                        here_only=True,
                    )
                )
        elif p in known or not env.looks_like_typo(p, known):  # this machine's, or another's
            notes.append(
                Finding(
                    source,
                    f"{source}: provider {p!r} has no implementation of {op_name!r} installed here "
                    f"(known providers of {op_name}: {', '.join(sorted(op.impls))}); calls use the next provider",
                    f"nothing to do if this setting is shared with machines that have {p}; else install it",
                    here_only=True,
                )
            )
        else:
            raise dispatch_settings.priority_error(
                source,
                f"unknown provider {p!r} for op {op_name!r}; known providers of {op_name}: "
                f"{', '.join(sorted(op.impls))}{env.did_you_mean(p, sorted(known))}",
                f"correct the provider name in {source}",
            )
    return tuple(providers), notes


def _read_env(environ: Mapping[str, str]) -> Settings:
    """The dispatch settings (`vllm_ir.settings.dispatch`) with every priority list's op and
    provider names checked: an entry naming an unknown op or a misspelt provider is left out."""
    read = dispatch_settings.read(environ)
    findings = list(read.findings)
    op_priority: dict[str, tuple[str, ...]] = {}
    for op_name, entry in read.env_priority.items():
        try:
            op_priority[op_name], notes = check_names(op_name, entry.providers, entry.source)
        except ConfigError as exc:
            notes = [env.ignored(exc.finding, f"the entry {entry.text!r} is ignored")]
        findings += notes
    config_priority: dict[str, dict[str, tuple[str, ...]]] = {}
    for mode, lists in read.config_priority.items():
        config_priority[mode] = {}
        for op_name, entry in lists.items():
            try:
                config_priority[mode][op_name], notes = check_names(op_name, entry.providers, entry.source)
            except ConfigError as exc:
                notes = [env.ignored(exc.finding, "the key is ignored")]
            findings += [n for n in notes if n not in findings]
    return Settings(
        op_priority=op_priority,
        fallback=read.fallback,
        batch_invariant=read.batch_invariant,
        config_priority=config_priority,
        config_source=read.config_source,
        findings=tuple(findings),
        reference=read.reference,
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
    unsupported = [p for p in out if not op.impls[p].supported]
    if unsupported:  # said once and listed by doctor, as the same list in VLLM_IR_OP_PRIORITY is
        env.report(source, check_names(op_name, unsupported, source)[1])
    return out
