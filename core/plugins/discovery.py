"""Provider discovery: entry points, pluggy hooks, and a record of every provider's fate.

Each entry point of the ``vllm_ir.providers`` group is handled on its own: its declared
``vllm-ir`` requirement is checked before anything is imported, its import registers its
implementations (and maybe ops), and its module joins a pluggy `PluginManager`. Whatever goes
wrong (import, ``sys.exit``, refused registration, incompatible core, a raising hook, a hook
result that breaks its contract, see `vllm_ir.plugins.hookspecs`) is recorded in a `ProviderRecord`,
everything the provider registered is withdrawn, and everything else keeps working;
``VLLM_IR_STRICT_PLUGINS=1`` raises instead. Hooks are called one implementation at a time
(pluggy's own loop would let one failure abort all) and only when priorities are built.

Discovery and everything built from hooks run under `registry.lock`: a thread that arrives
while another one loads waits for it (the loading thread itself re-enters freely), so every
first call sees the fully loaded providers. Each step is logged at DEBUG on the
``vllm_ir.plugins.discovery`` logger (``VLLM_IR_LOG_LEVEL=DEBUG``).
"""

from __future__ import annotations

import enum
import functools
import logging
import operator
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from vllm_ir.errors import VllmIrError
from vllm_ir.ir import priority as _priority
from vllm_ir.ir import registry
from vllm_ir.ir.impl import NATIVE
from vllm_ir.plugins import hookspecs
from vllm_ir.plugins.hookspecs import HookResultError
from vllm_ir.settings import env
from vllm_ir.settings.env import ConfigError, Finding
from vllm_ir.settings.log import get_logger

ENTRY_POINT_GROUP = "vllm_ir.providers"
ENV_ALLOW = env.ENV_ALLOW
ENV_DENY = env.ENV_DENY
ENV_NO_AUTOLOAD = env.ENV_NO_AUTOLOAD
ENV_STRICT = env.ENV_STRICT
ENV_PLATFORM = env.ENV_PLATFORM
#: ``VLLM_IR_PLATFORM=builtin``: ignore every claim and detect the platform from torch.
BUILTIN = "builtin"
CORE_DISTRIBUTION = "vllm-ir"

log = get_logger("plugins")


class PluginError(VllmIrError, RuntimeError):
    """A provider plugin failed and ``VLLM_IR_STRICT_PLUGINS=1`` asks for an exception."""


class ProviderStatus(str, enum.Enum):
    LOADED = "loaded"
    UNSUPPORTED = "unsupported here"
    FAILED = "failed"
    INCOMPATIBLE = "incompatible"
    BLOCKED = "blocked"
    NOT_LOADED = "not loaded"


@dataclass
class ProviderRecord:
    """What discovery knows about one entry point, shown by ``vllm-ir providers list``."""

    name: str
    value: str
    distribution: str | None
    version: str | None
    status: ProviderStatus = ProviderStatus.NOT_LOADED
    reason: str | None = None
    #: provider name -> ops it implements (what the plugin's import registered).
    implementations: dict[str, list[str]] = field(default_factory=dict)
    #: Ops the plugin declared itself (``vllm_ir.register_op`` at import); withdrawn with it.
    ops: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "entry_point": self.value,
            "status": self.status.value,
            "reason": self.reason,
            "implementations": self.implementations,
        }


@dataclass
class _State:
    scanned: bool = False
    #: Discovery has started; the loading thread re-entering it returns at once.
    autoloaded: bool = False
    #: Discovery has finished: the lock-free check every later call makes.
    ready: bool = False
    entry_points: dict[str, metadata.EntryPoint] = field(default_factory=dict)
    records: dict[str, ProviderRecord] = field(default_factory=dict)
    manager: Any = None
    platform: Any = None
    #: The plugin whose `vllm_ir_platform` claim `platform` is (None: detected from torch).
    claimant: str | None = None
    #: Every plugin that claimed the platform at the last choice, and the platform it claimed.
    claims: dict[str, Any] = field(default_factory=dict)
    defaults: dict[str, dict[str, list[tuple[str, str]]]] = field(default_factory=dict)
    #: Bumped whenever the set of live plugins changes (a failure withdraws one).
    generation: int = 0
    #: provider name -> the plugin (record name) whose withdrawal took that provider's implementations.
    withdrawn: dict[str, str] = field(default_factory=dict)


_state = _State()


# ---------------------------------------------------------------------------------------
# Public API


def load_providers() -> list[ProviderRecord]:
    """Discover and load every provider once per process (honouring the plugin env vars).

    Thread-safe: a thread arriving while another one loads waits until loading is complete.
    """
    ensure_loaded()
    return list(_state.records.values())


def ensure_loaded() -> None:
    """Run discovery unless it has run: one attribute read once it has (the lazy-loading hook)."""
    if _state.ready:
        return
    with registry.lock:
        if not _state.autoloaded:  # else finished meanwhile, or re-entered by the loading thread
            _autoload()


def load_provider(name: str) -> ProviderRecord:
    """Load one provider explicitly (e.g. with ``VLLM_IR_DISABLE_PLUGIN_AUTOLOAD=1``)."""
    with registry.lock:
        _scan()
        if name not in _state.records:
            known = ", ".join(sorted(_state.records)) or "(none installed)"
            raise PluginError(f"no provider entry point named {name!r} in group {ENTRY_POINT_GROUP!r}; known: {known}")
        record = _state.records[name]
        if record.status in (ProviderStatus.NOT_LOADED, ProviderStatus.BLOCKED):
            _load(name, explicit=True)
        return record


def provider_records() -> list[ProviderRecord]:
    """Every discovered provider with its final status (runs discovery if it has not run).

    The hooks run here too (the platform, and the default and adjusted priorities of every
    mode), so a plugin whose hook raises or returns something invalid is already shown as
    failed: ``providers list``, ``doctor`` and an op call report one and the same status.
    """
    ensure_loaded()
    with registry.lock:
        current_platform()
        for mode in _priority.MODES:
            merged_defaults(mode)
        return [_state.records[n] for n in sorted(_state.records)]


def current_platform() -> Any:
    """The platform of this process: one claimed by a plugin, else detected from torch."""
    ensure_loaded()
    platform = _state.platform
    if platform is not None:
        return platform
    with registry.lock:
        if _state.platform is None:
            platform = _choose_platform()
            _state.platform = platform  # after _choose_platform: a failing claim resets it
            log.debug("platform: %s", platform.describe() if _state.claimant else f"{platform.name} (detected)")
        return _state.platform


def merged_defaults(mode: str) -> dict[str, list[tuple[str, str]]]:
    """Default priorities for ``mode``: platform first, then providers in hook order, then adjusted."""
    cached = _state.defaults.get(mode)
    if cached is not None:
        return cached
    ensure_loaded()
    with registry.lock:
        cached = _state.defaults.get(mode)
        if cached is not None:
            return cached
        for _attempt in range(len(_state.records) + 1):
            generation = _state.generation
            merged = _merge_defaults(mode)
            if generation == _state.generation:  # no plugin failed (and was withdrawn) meanwhile
                break
        _state.defaults[mode] = merged
        if log.isEnabledFor(logging.DEBUG):
            log.debug("default priorities (%s): %s", mode, _describe_defaults(merged) or "none")
        return merged


def plugin_manager() -> Any:
    """The pluggy manager holding every loaded provider module (created on first use)."""
    if _state.manager is None:
        import pluggy

        with registry.lock:
            if _state.manager is None:
                manager = pluggy.PluginManager(hookspecs.PROJECT)
                manager.add_hookspecs(hookspecs)
                _state.manager = manager
    return _state.manager


def reset_for_tests() -> None:
    """Forget discovery (withdrawing what providers registered) so a test can rescan."""
    with registry.lock:
        for record in _state.records.values():
            _withdraw(record)
        _state.__init__()  # type: ignore[misc]
        for owner in (_OWNER_SETTINGS, _OWNER_PLATFORM, _OWNER_VARIABLES):
            env.clear(owner)
        from vllm_ir.settings import config

        config.reset()
        install()  # a test may have replaced the defaults source
        _invalidate_defaults()


# ---------------------------------------------------------------------------------------
# Discovery and loading


def _autoload() -> None:
    _state.autoloaded = True
    try:
        _scan()
        if _env_flag(ENV_NO_AUTOLOAD):
            for record in _state.records.values():
                if record.status is ProviderStatus.NOT_LOADED:
                    record.reason = f"{ENV_NO_AUTOLOAD}=1; load it with vllm_ir.load_provider({record.name!r})"
            log.debug("%s=1: no provider is loaded automatically", ENV_NO_AUTOLOAD)
        else:
            for name in sorted(_state.records):  # a fixed order: duplicate names resolve the same way
                if _state.records[name].status is ProviderStatus.NOT_LOADED:
                    _load(name)
    except KeyboardInterrupt:
        _state.autoloaded = False  # the next call resumes with the providers not loaded yet
        raise
    finally:
        _invalidate_defaults()  # nothing decided from a half-loaded registry outlives loading
        _state.ready = _state.autoloaded


def _scan() -> None:
    if _state.scanned:
        return
    _state.scanned = True
    allow, deny, allow_source, deny_sources = _allow_and_deny()
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        meta = dist.metadata if dist else None  # parsed once: ``dist.version`` would parse it again
        name, version = (meta["Name"], meta["Version"]) if meta is not None else (None, None)
        record = ProviderRecord(ep.name, ep.value, name, version)
        log.debug("found entry point %s = %s (%s %s)", ep.name, ep.value, record.distribution, record.version)
        if ep.name in _state.records:
            first = _state.records[ep.name]
            if first.distribution == record.distribution:
                continue  # the same distribution seen twice on sys.path
            record.name = f"{ep.name}@{record.distribution}"
            record.status = ProviderStatus.FAILED
            record.reason = f"entry point name {ep.name!r} is already used by {first.distribution}"
            _state.records[record.name] = record
            log.debug("provider %r failed: %s", record.name, record.reason)
            continue
        _state.entry_points[ep.name] = ep
        _state.records[ep.name] = record
        if allow is not None and ep.name not in allow:
            listed = ",".join(sorted(allow))
            reason = f"not in {allow_source}" + (f"={listed}" if allow_source == ENV_ALLOW else f" ({listed})")
            record.status, record.reason = ProviderStatus.BLOCKED, reason
        elif ep.name in deny:
            record.status, record.reason = ProviderStatus.BLOCKED, f"listed in {deny_sources[ep.name]}"
        if record.status is ProviderStatus.BLOCKED:
            log.debug("provider %r blocked: %s", ep.name, record.reason)
    if _env_flag(ENV_NO_AUTOLOAD):
        return  # the lists only steer automatic loading
    installed = [n for n in _state.records if "@" not in n]
    findings = []
    if allow is not None:
        findings += env.unknown_names(
            allow_source, sorted(allow), installed, what="installed providers", consequence="it allows nothing"
        )
    for source in dict.fromkeys(deny_sources.values()):
        names = sorted(n for n, s in deny_sources.items() if s == source)
        findings += env.unknown_names(
            source, names, installed, what="installed providers", consequence="there is nothing to disable"
        )
    _settings_findings(findings)


def _load(name: str, explicit: bool = False) -> None:
    record = _state.records[name]
    if record.status is ProviderStatus.BLOCKED and not explicit:
        return
    ep = _state.entry_points[name]
    ok, problem = _guard(name, "reading its distribution metadata", _core_requirement_problem, ep)
    if not ok:
        return
    if problem is not None:
        _fail(name, ProviderStatus.INCOMPATIBLE, problem)
        return
    log.debug("loading provider %r: importing %s", name, ep.value)
    ops_before = {op.name for op in registry.all_ops()}
    impls_before = _registered_impls()
    try:
        module = ep.load()
    except PluginError:
        raise  # strict mode, from a discovery the import itself started
    except KeyboardInterrupt as exc:
        # Ctrl-C belongs to the user: stop, but leave no half-registered plugin behind, and say
        # which plugin was being imported (a plugin raising it by itself is otherwise anonymous).
        _note_registrations(record, ops_before, impls_before)
        _record_failure(name, ProviderStatus.FAILED, f"import of {ep.value} was interrupted (KeyboardInterrupt)")
        note = interrupted_note(record)
        log.warning("%s", note)
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        else:  # Python 3.10: the same attribute, read by interrupted_plugin
            exc.__notes__ = [*getattr(exc, "__notes__", ()), note]
        raise
    except BaseException as exc:  # SystemExit too: a plugin must not end the host process
        _note_registrations(record, ops_before, impls_before)
        _fail(name, ProviderStatus.FAILED, f"import of {ep.value} failed: {_describe_exception(exc)}", exc)
        return
    _note_registrations(record, ops_before, impls_before)
    try:
        plugin_manager().register(module, name=name)
    except Exception as exc:
        _fail(name, ProviderStatus.FAILED, f"invalid hook implementations: {exc}", exc)
        return
    origin = f"{record.distribution} {record.version}" if record.distribution else name
    unsupported: list[str] = []
    for provider, ops in record.implementations.items():
        for op_name in ops:
            impl = registry.get_op(op_name).impls[provider]
            impl.origin = origin
            if not impl.supported:
                unsupported.append(impl.unsupported_reason or "unsupported")
    total = sum(len(ops) for ops in record.implementations.values())
    if total and len(unsupported) == total:
        record.status, record.reason = ProviderStatus.UNSUPPORTED, "; ".join(dict.fromkeys(unsupported))
    else:
        record.status, record.reason = ProviderStatus.LOADED, None
    if log.isEnabledFor(logging.DEBUG):
        hooks = sorted(h.name for h in plugin_manager().get_hookcallers(module) or ())
        log.debug(
            "loaded provider %r (%s): %s; implementations: %s; ops declared: %s; hooks: %s",
            name,
            origin,
            record.status.value + (f" ({record.reason})" if record.reason else ""),
            _describe_impls(record.implementations) or "none",
            ", ".join(record.ops) or "none",
            ", ".join(hooks) or "none",
        )
    _invalidate_defaults()


def _core_requirement_problem(ep: metadata.EntryPoint) -> str | None:
    """Check the provider's ``Requires-Dist: vllm-ir ...`` against the installed core."""
    dist = getattr(ep, "dist", None)
    for line in (dist.requires or []) if dist else []:
        specifier = _core_specifier(line)
        if specifier is None:
            continue
        installed = _core_version()
        if installed is not None and not specifier.contains(installed, prereleases=True):
            return f"requires {CORE_DISTRIBUTION}{specifier} but {installed} is installed"
    return None


@functools.cache
def _core_version() -> str | None:
    """The installed core distribution's version (its metadata, as pip sees it); None if absent.
    Read once: each lookup walks every distribution on sys.path, once per provider otherwise."""
    try:
        return metadata.version(CORE_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


#: A ``Requires-Dist`` line: the distribution name, then the rest.
_REQUIREMENT_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)(.*)", re.DOTALL)


def _core_specifier(line: str) -> Any:
    """The version specifier of a ``Requires-Dist`` line on vllm-ir that applies (None: another
    distribution, an unmet marker, or unreadable). A plain ``vllm-ir>=0.1,<0.2`` is read with
    ``packaging.specifiers`` alone: ``packaging.requirements`` (its tokenizer's regexes) costs
    ~15 ms of start-up, paid only for a line on vllm-ir with a marker, extras or a URL."""
    match = _REQUIREMENT_NAME.fullmatch(line)
    if match is None or re.sub(r"[-_.]+", "-", match[1]).lower() != CORE_DISTRIBUTION:
        return None  # another distribution (what packaging would name it; an unreadable line is skipped too)
    rest = match[2].strip()
    if not any(c in rest for c in ";[@"):
        text = rest[1:-1] if rest.startswith("(") and rest.endswith(")") else rest
        plain = _PlainSpecifier.parse(text)
        if plain is not None:
            return plain
        from packaging.specifiers import InvalidSpecifier, SpecifierSet

        try:
            return SpecifierSet(text)
        except InvalidSpecifier:
            pass  # let packaging's full grammar decide
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        req = Requirement(line)
    except InvalidRequirement:
        return None
    if req.marker and not req.marker.evaluate({"extra": ""}):
        return None
    return req.specifier


#: One clause of a plain specifier: a comparison with a release version (``>=0.1``).
_PLAIN_CLAUSE = re.compile(r"\s*(>=|<=|==|!=|<|>)\s*(\d+(?:\.\d+)*)\s*")
_PLAIN_VERSION = re.compile(r"\d+(?:\.\d+)*")
#: Each plain clause's comparison, of the installed release against the clause's.
_COMPARE = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    ">": operator.gt,
}


@dataclass(frozen=True)
class _PlainSpecifier:
    """``>=0.1,<0.2``-style specifiers read without importing ``packaging.specifiers`` (its
    regexes cost ~18 ms of start-up), for what every provider declares. For a plain release
    version (``0.1.0``) such clauses compare as packaging compares them (zero-padded release
    tuples); anything else -- wildcards, ``~=``, pre/post/dev or local versions -- goes to
    packaging (a test holds the two to the same answers)."""

    clauses: tuple[tuple[str, str], ...]

    @classmethod
    def parse(cls, text: str) -> _PlainSpecifier | None:
        clauses = []
        for part in text.split(",") if text.strip() else []:
            match = _PLAIN_CLAUSE.fullmatch(part)
            if match is None:
                return None
            clauses.append((match[1], match[2]))
        return cls(tuple(clauses))

    def contains(self, version: str, prereleases: bool = True) -> bool:
        if _PLAIN_VERSION.fullmatch(version) is None:
            from packaging.specifiers import SpecifierSet

            return SpecifierSet(str(self)).contains(version, prereleases=prereleases)
        have = _release(version)
        return all(_COMPARE[op](have, _release(v)) for op, v in self.clauses)

    def __str__(self) -> str:
        return ",".join(sorted(op + v for op, v in self.clauses))


def _release(version: str) -> tuple[int, ...]:
    """``0.1`` -> ``(0, 1, 0, ...)``: zero-padded, so ``0.1 == 0.1.0`` as packaging has it."""
    parts = [int(p) for p in version.split(".")]
    return tuple(parts + [0] * (16 - len(parts)))


def _fail(name: str, status: ProviderStatus, reason: str, exc: BaseException | None = None) -> None:
    record = _record_failure(name, status, reason)
    if _env_flag(ENV_STRICT):
        raise PluginError(f"provider {name!r} ({record.distribution} {record.version}): {reason}") from exc
    warnings.warn(
        f"vllm-ir provider {name!r} disabled: {reason}",
        RuntimeWarning,
        stacklevel=env.user_stacklevel(skip_importlib=False),
    )


def _record_failure(name: str, status: ProviderStatus, reason: str) -> ProviderRecord:
    record = _state.records[name]
    _withdraw(record)
    record.status, record.reason = status, reason
    log.debug("provider %r %s: %s", name, status.value, reason)
    return record


def _withdraw(record: ProviderRecord) -> None:
    """Undo what a provider did: its implementations, the ops it declared, and its hooks."""
    for provider, ops in record.implementations.items():
        _state.withdrawn[provider] = record.name
        for op_name in ops:
            if op_name not in record.ops and registry.has_op(op_name):
                registry.get_op(op_name).remove_impl(provider)
    for op_name in record.ops:
        registry.remove_op(op_name)
        for other in _state.records.values():  # implementations of it went with the op
            for provider, ops in list(other.implementations.items()):
                if op_name in ops:
                    ops.remove(op_name)
                    if not ops:
                        del other.implementations[provider]
    record.implementations = {}
    record.ops = []
    manager = _state.manager
    if manager is not None and manager.has_plugin(record.name):
        manager.unregister(name=record.name)
    _invalidate_defaults()


def _registered_impls() -> set[tuple[str, str]]:
    return {(op.name, p) for op in registry.all_ops() for p in op.impls}


def _note_registrations(record: ProviderRecord, ops_before: set[str], impls_before: set[tuple[str, str]]) -> None:
    """Record what an import registered: new ops, and new implementations (an op's native aside)."""
    record.ops = sorted({op.name for op in registry.all_ops()} - ops_before)
    out: dict[str, list[str]] = {}
    for op_name, provider in sorted(_registered_impls() - impls_before):
        if provider != NATIVE:  # a new op's own function: withdrawn with the op
            out.setdefault(provider, []).append(op_name)
    record.implementations = out


# ---------------------------------------------------------------------------------------
# Hooks and defaults


def _hook_impls(hook_name: str) -> list[Any]:
    """A hook's implementations in pluggy's call order (last registered and tryfirst first)."""
    if _state.manager is None:
        return []
    return list(reversed(getattr(_state.manager.hook, hook_name).get_hookimpls()))


#: How every note `interrupted_note` adds to a ``KeyboardInterrupt`` begins.
INTERRUPTED_NOTE = "interrupted while importing plugin "


def provider_facts() -> dict[str, dict[str, str]]:
    """Each loaded plugin's ``vllm_ir_provider_facts`` (plugin name -> {fact: line}), for the CLI.

    Display only: a hook that raises or returns something else shows that as its one fact
    (the plugin stays loaded).
    """
    facts: dict[str, dict[str, str]] = {}
    for impl in _hook_impls("vllm_ir_provider_facts"):
        try:
            result = impl.function()
            if result is None:
                continue
            facts[impl.plugin_name] = {str(k): str(v) for k, v in dict(result).items()}
        except Exception as exc:
            facts[impl.plugin_name] = {"error": f"vllm_ir_provider_facts raised {_describe_exception(exc)}"}
    return facts


def provider_variables() -> dict[str, tuple[str, str]]:
    """Every environment variable a loaded plugin declares (`vllm_ir_environment_variables`):
    name -> (plugin, one line), for ``vllm-ir doctor``. Display only: a hook that raises or
    returns something else is left out and listed as a ``doctor`` problem (the plugin stays
    loaded); the first plugin to declare a name keeps it."""
    ensure_loaded()
    declared: dict[str, tuple[str, str]] = {}
    findings: list[Finding] = []
    for impl in _hook_impls("vllm_ir_environment_variables"):
        try:
            names = hookspecs.check_environment_variables(impl.function())
        except Exception as exc:
            reason = (
                str(exc)
                if isinstance(exc, HookResultError)
                else f"vllm_ir_environment_variables raised {_describe_exception(exc)}"
            )
            findings.append(
                Finding(
                    f"plugin {impl.plugin_name}",
                    f"plugin {impl.plugin_name!r}: {reason}; its variables are not listed",
                    "fix the plugin's hook (see vllm_ir.plugins.hookspecs)",
                )
            )
            continue
        for name, description in names.items():
            declared.setdefault(name, (impl.plugin_name, description))
    env.report(_OWNER_VARIABLES, findings, replace=True, warn=False)
    return declared


def interrupted_note(record: ProviderRecord) -> str:
    """``interrupted while importing plugin 'x' (distribution acme-x 1.0)``: added to the
    ``KeyboardInterrupt`` that stopped a plugin's import, which then propagates."""
    origin = f" (distribution {record.distribution} {record.version})" if record.distribution else ""
    return f"{INTERRUPTED_NOTE}{record.name!r}{origin}"


def interrupted_plugin(exc: BaseException) -> str | None:
    """The note `interrupted_note` added to ``exc`` (None: not interrupted in a plugin's import)."""
    return next((n for n in getattr(exc, "__notes__", ()) if n.startswith(INTERRUPTED_NOTE)), None)


def _guard(plugin: str, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[bool, Any]:
    """Run a plugin's code, or a check of what it returned; a failure fails that plugin only.

    ``KeyboardInterrupt`` propagates (it is the user's); ``SystemExit`` and every other
    exception become the plugin's recorded reason.
    """
    try:
        return True, fn(*args, **kwargs)
    except (KeyboardInterrupt, PluginError):
        raise
    except HookResultError as exc:
        _fail(plugin, ProviderStatus.FAILED, str(exc), exc)
    except BaseException as exc:
        _fail(plugin, ProviderStatus.FAILED, f"{what} raised {_describe_exception(exc)}", exc)
    return False, None


def _call_one(impl: Any, hook_name: str, args: Mapping[str, Any]) -> tuple[bool, Any]:
    """Call one hook implementation; a raising plugin is recorded as failed and withdrawn."""
    plugin = impl.plugin_name
    if plugin not in _state.records:  # registered on the manager by hand, not discovered
        return True, impl.function(*[args[a] for a in impl.argnames])
    if _state.manager is None or not _state.manager.has_plugin(plugin):
        return False, None  # failed (and withdrawn) earlier in this round of hook calls
    return _guard(plugin, f"hook {hook_name}", impl.function, *[args[a] for a in impl.argnames])


def _call_hook(hook_name: str, **args: Any) -> list[tuple[str, Any]]:
    """Call each implementation of a hook in pluggy's order, isolating failures per plugin."""
    results = []
    for impl in _hook_impls(hook_name):
        ok, value = _call_one(impl, hook_name, args)
        if ok:
            results.append((impl.plugin_name, value))
    return results


def _checked(plugin: str, check: Callable[..., Any], result: Any, **context: Any) -> tuple[bool, Any]:
    """Validate one hook result (`vllm_ir.plugins.hookspecs`); an invalid one fails ``plugin``."""
    if plugin not in _state.records:
        return True, check(result, **context)
    return _guard(plugin, f"checking the result of {check.__name__}", check, result, **context)


def _choose_platform() -> Any:
    """The claimed platform: the only claim, or the one ``VLLM_IR_PLATFORM`` (or the config file) picks.

    Several claims and no choice: built-in detection is used, a warning and a ``doctor``
    problem say how to choose, and every claimant stays loaded (its kernels included).
    """
    from vllm_ir.plugins import platforms

    _state.claimant = None
    claims: dict[str, Any] = {}
    for plugin, result in _call_hook("vllm_ir_platform"):
        ok, claimed = _checked(plugin, hookspecs.check_platform, result)
        if ok and claimed is not None:
            claims[plugin] = claimed
    _state.claims = claims
    names = sorted(claims)
    choice, source = _platform_choice()
    findings: list[Finding] = []
    chosen: str | None = None
    if choice is not None:
        accepted = ", ".join([BUILTIN, *names])
        if choice == BUILTIN:
            env.report(_OWNER_PLATFORM, [], replace=True)
            return platforms.detect()
        matches = [n for n in names if choice in (n, claims[n].name)]
        if matches:
            chosen = matches[0]
        else:
            findings.append(
                Finding(
                    source,
                    f"{source}={choice!r}: no plugin claims the platform under that name "
                    f"(accepted: {accepted}){env.did_you_mean(choice, [BUILTIN, *names])}; it is ignored",
                    f"set {ENV_PLATFORM} to one of: {accepted}",
                )
            )
    if chosen is None and len(names) == 1:
        chosen = names[0]
    elif chosen is None and len(names) > 1:
        detected = platforms.detect()
        listing = " and ".join(repr(n) for n in names)
        findings.append(
            Finding(
                ENV_PLATFORM,
                f"plugins {listing} all claim the platform; the built-in {detected.name!r} is used and their "
                f"kernels stay loaded",
                f'choose one with {ENV_PLATFORM}=<{"|".join([*names, BUILTIN])}> (or platform = "..." in '
                f"the {env.ENV_CONFIG} file)",
            )
        )
    env.report(_OWNER_PLATFORM, findings, replace=True)
    if chosen is None:
        return platforms.detect()
    _state.claimant = chosen
    return _as_claimed(claims[chosen], chosen)


def _platform_choice() -> tuple[str | None, str]:
    """``VLLM_IR_PLATFORM``, else the config file's ``platform`` (value, where it came from)."""
    from vllm_ir.settings import config

    value = env.raw(ENV_PLATFORM)
    if value is not None:
        return value.strip(), ENV_PLATFORM
    site = config.current()
    if site.platform is not None:
        return site.platform, site.where("platform")
    return None, ENV_PLATFORM


def platform_claims() -> dict[str, str]:
    """Plugin -> the platform name it claimed, at the last platform choice (``doctor``)."""
    current_platform()
    return {plugin: platform.name for plugin, platform in _state.claims.items()}


def _merge_defaults(mode: str) -> dict[str, list[tuple[str, str]]]:
    platform = current_platform()
    merged: dict[str, list[tuple[str, str]]] = {}
    if _state.claimant is None:  # built in: part of vllm-ir itself
        base: Any = hookspecs.check_default_priority(platform.default_priority(mode))
    else:
        _ok, base = _guard(
            _state.claimant,
            f"platform {platform.name!r} default_priority({mode!r})",
            lambda: hookspecs.check_default_priority(
                platform.default_priority(mode), what=f"platform {platform.name!r} default_priority({mode!r})"
            ),
        )
    _merge(merged, base or {}, f"platform {platform.name}")
    for plugin, result in _call_hook("vllm_ir_default_priority", platform=platform, mode=mode):
        ok, contribution = _checked(plugin, hookspecs.check_default_priority, result)
        if ok:
            _merge(merged, contribution, f"provider {plugin}")
    adjusters = _hook_impls("vllm_ir_adjust_priority")
    for op in registry.all_ops():
        entries = merged.get(op.name, [])
        for impl in adjusters:
            before = [p for p, _ in entries]
            args = {"op_name": op.name, "priority": list(before), "platform": platform, "mode": mode}
            ok, result = _call_one(impl, "vllm_ir_adjust_priority", args)
            if ok:
                ok, adjusted = _checked(
                    impl.plugin_name, hookspecs.check_adjusted_priority, result, op_name=op.name, before=before
                )
                if ok and adjusted is not None:
                    entries = _adjusted(entries, adjusted, impl.plugin_name)
        if entries:
            merged[op.name] = entries
    return merged


def _merge(merged: dict[str, list[tuple[str, str]]], contribution: Mapping[str, Sequence[str]], source: str) -> None:
    for op_name, providers in contribution.items():
        entries = merged.setdefault(op_name, [])
        seen = {p for p, _ in entries}
        entries.extend((p, source) for p in providers if p not in seen)


def _adjusted(entries: list[tuple[str, str]], new: Sequence[str], plugin: str) -> list[tuple[str, str]]:
    """Apply one adjust hook's (checked) list, keeping each entry's origin and noting the adjustment."""
    sources = dict(entries)
    if list(new) == [p for p, _ in entries]:
        return entries
    return [(p, f"{sources[p]}, moved by {plugin}" if p in sources else f"added by {plugin}") for p in new]


def _as_claimed(platform: Any, plugin: str) -> Any:
    import dataclasses

    from vllm_ir.plugins.platforms import Platform

    if isinstance(platform, Platform) and platform.claimed_by is None:
        return dataclasses.replace(platform, claimed_by=plugin)
    return platform


def _invalidate_defaults() -> None:
    from vllm_ir.ir import tuning

    with registry.lock:
        tuning.reload()  # the shipped tables and provider versions follow the loaded plugins
        _state.defaults.clear()
        _state.platform = None
        _state.claimant = None
        _state.generation += 1
        registry.invalidate()


def _describe_exception(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"SystemExit: the plugin called sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {exc}"


def _describe_impls(implementations: Mapping[str, Sequence[str]]) -> str:
    return "; ".join(f"{p}: {', '.join(ops)}" for p, ops in implementations.items())


def _describe_defaults(merged: Mapping[str, Sequence[tuple[str, str]]]) -> str:
    return "; ".join(
        f"{op}: " + ", ".join(f"{p} [{source}]" for p, source in entries) for op, entries in sorted(merged.items())
    )


_OWNER_SETTINGS = "plugins"
_OWNER_PLATFORM = "platform"
_OWNER_VARIABLES = "plugin variables"


def _env_flag(name: str) -> bool:
    """A boolean variable; a malformed value is ignored (off) with a warning and a doctor problem."""
    return env.read_bool(name, False, owner=_OWNER_SETTINGS)


def _env_names(name: str) -> tuple[str, ...] | None:
    """A name list (None when unset); a malformed one is ignored with a warning and a doctor problem."""
    value = env.raw(name)
    if value is None:
        return None
    try:
        return env.parse_names(name, value)
    except ConfigError as exc:
        f = exc.finding
        _settings_findings([Finding(f.setting, f"{f.message}; {name} is ignored", f.fix)])
        return None


def _allow_and_deny() -> tuple[set[str] | None, set[str], str, dict[str, str]]:
    """The allow-list (None: all), the deny-list, and where each came from (env or config file)."""
    from vllm_ir.settings import config

    site = config.current()
    allow_names = _env_names(ENV_ALLOW)
    allow_source = ENV_ALLOW
    if allow_names is None and site.providers is not None:
        allow_names, allow_source = site.providers, site.where("providers")
    deny_sources = {n: site.where("disable_providers") for n in site.disable_providers}
    deny_sources.update({n: ENV_DENY for n in _env_names(ENV_DENY) or ()})
    return (None if allow_names is None else set(allow_names)), set(deny_sources), allow_source, deny_sources


def _settings_findings(findings: Sequence[Finding]) -> None:
    """Report what the plugin settings got wrong; ``VLLM_IR_STRICT_PLUGINS=1`` raises on a real problem."""
    if not findings:
        return
    problems = [f for f in findings if not f.here_only]
    if problems and env.read_bool(ENV_STRICT, False, owner=_OWNER_SETTINGS):
        raise PluginError(f"{problems[0].message} [{ENV_STRICT}=1]")
    env.report(_OWNER_SETTINGS, findings)


def tuning_facts() -> Any:
    """What the tuning layer needs from discovery: the platform, each provider's distribution
    version and the tables providers ship (`vllm_ir_tuning_tables`, read here once per load)."""
    from vllm_ir.ir import tuning

    platform = current_platform()
    versions: dict[str, str] = {}
    for record in _state.records.values():
        if record.status is ProviderStatus.LOADED and record.version:
            for provider in record.implementations:
                versions.setdefault(provider, record.version)
    shipped: list[tuple[str, str]] = []
    for plugin, result in _call_hook("vllm_ir_tuning_tables", platform=platform):
        ok, paths = _checked(plugin, hookspecs.check_tuning_tables, result)
        if ok:
            record = _state.records.get(plugin)
            origin = f"provider {plugin}" + (
                f" ({record.distribution} {record.version})" if record is not None and record.distribution else ""
            )
            shipped += [(origin, p) for p in paths]
    return tuning.Facts(platform.name, versions, tuple(shipped))


def install() -> None:
    """Connect discovery to the core, once (`vllm_ir.ir.registry.connect_discovery`): lazy loading,
    the defaults layer, the known provider names, why one is absent, and the tuning facts."""
    registry.connect_discovery(
        registry.Discovery(
            ensure_loaded=ensure_loaded,
            defaults=merged_defaults,
            known_names=known_names,
            absence_reason=absence_reason,
            tuning_facts=tuning_facts,
        )
    )


def known_names() -> list[str]:
    """Every provider entry point discovery found, and every provider a withdrawn plugin named."""
    return [*_state.records, *_state.withdrawn]


def absence_reason(provider: str) -> str | None:
    """Why ``provider`` has no implementation here, from its plugin's record (what ``providers list``
    shows): ``plugin 'x' (dist 1.0) failed: <reason>``. None when no plugin of that name failed,
    was refused, blocked or left unloaded (the provider is simply not installed, or its loaded
    plugin does not implement this op)."""
    name = provider if provider in _state.records else _state.withdrawn.get(provider)
    record = _state.records.get(name) if name is not None else None
    if record is None or record.status in (ProviderStatus.LOADED, ProviderStatus.UNSUPPORTED):
        return None
    origin = f" ({record.distribution} {record.version})" if record.distribution else ""
    return f"plugin {record.name!r}{origin} {record.status.value}: {record.reason or 'no reason recorded'}"
