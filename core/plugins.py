"""Provider discovery: entry points, pluggy hooks, and a record of every provider's fate.

Each entry point of the ``vllm_ir.providers`` group is handled on its own: its declared
``vllm-ir`` requirement is checked before anything is imported, its import registers its
implementations, and its module joins a pluggy `PluginManager`. Whatever goes wrong (import,
refused registration, incompatible core, a raising hook) is recorded in a `ProviderRecord`,
the provider's partial registrations are withdrawn, and everything else keeps working;
``VLLM_IR_STRICT_PLUGINS=1`` raises instead. Hooks are called one implementation at a time
(pluggy's own loop would let one failure abort all) and only when priorities are built.
"""

from __future__ import annotations

import enum
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import Any

from vllm_ir.errors import VllmIrError
from vllm_ir.ir import priority as _priority
from vllm_ir.ir import registry

ENTRY_POINT_GROUP = "vllm_ir.providers"
ENV_ALLOW = "VLLM_IR_PROVIDERS"
ENV_DENY = "VLLM_IR_DISABLE_PROVIDERS"
ENV_NO_AUTOLOAD = "VLLM_IR_DISABLE_PLUGIN_AUTOLOAD"
ENV_STRICT = "VLLM_IR_STRICT_PLUGINS"
CORE_DISTRIBUTION = "vllm-ir"


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
    module: ModuleType | None = field(default=None, repr=False)

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
    autoloaded: bool = False
    loading: bool = False
    entry_points: dict[str, metadata.EntryPoint] = field(default_factory=dict)
    records: dict[str, ProviderRecord] = field(default_factory=dict)
    manager: Any = None
    platform: Any = None
    defaults: dict[str, dict[str, list[tuple[str, str]]]] = field(default_factory=dict)
    #: Bumped whenever the set of live plugins changes (a failure withdraws one).
    generation: int = 0


_state = _State()


# ---------------------------------------------------------------------------------------
# Public API


def load_providers() -> list[ProviderRecord]:
    """Discover and load every provider once per process (honouring the plugin env vars)."""
    if _state.autoloaded or _state.loading:
        return list(_state.records.values())
    _state.loading = True
    _state.autoloaded = True
    try:
        _scan()
        if _env_flag(ENV_NO_AUTOLOAD):
            for record in _state.records.values():
                if record.status is ProviderStatus.NOT_LOADED:
                    record.reason = f"{ENV_NO_AUTOLOAD}=1; load it with vllm_ir.load_provider({record.name!r})"
        else:
            for name in sorted(_state.records):  # a fixed order: duplicate names resolve the same way
                if _state.records[name].status is ProviderStatus.NOT_LOADED:
                    _load(name)
    finally:
        _state.loading = False
    return list(_state.records.values())


def load_provider(name: str) -> ProviderRecord:
    """Load one provider explicitly (e.g. with ``VLLM_IR_DISABLE_PLUGIN_AUTOLOAD=1``)."""
    _scan()
    if name not in _state.records:
        known = ", ".join(sorted(_state.records)) or "(none installed)"
        raise PluginError(f"no provider entry point named {name!r} in group {ENTRY_POINT_GROUP!r}; known: {known}")
    record = _state.records[name]
    if record.status in (ProviderStatus.NOT_LOADED, ProviderStatus.BLOCKED):
        _load(name, explicit=True)
    return record


def provider_records() -> list[ProviderRecord]:
    """Every discovered provider with its status (runs discovery if it has not run)."""
    load_providers()
    return [_state.records[n] for n in sorted(_state.records)]


def current_platform() -> Any:
    """The platform of this process: one claimed by a plugin, else detected from torch."""
    from vllm_ir import platforms

    load_providers()
    if _state.platform is None:
        claims = [(name, p) for name, p in _call_hook("vllm_ir_platform") if p is not None]
        if len(claims) > 1:
            names = " and ".join(sorted(f"{n!r}" for n, _ in claims))
            for name, _ in claims:
                _fail(name, ProviderStatus.FAILED, f"both {names} claim the platform; neither is used")
            _state.platform = platforms.detect()
        elif claims:
            name, claimed = claims[0]
            _state.platform = _as_claimed(claimed, name)
        else:
            _state.platform = platforms.detect()
    return _state.platform


def merged_defaults(mode: str) -> dict[str, list[tuple[str, str]]]:
    """Default priorities for ``mode``: platform first, then providers in hook order, then adjusted."""
    cached = _state.defaults.get(mode)
    if cached is not None:
        return cached
    for _attempt in range(len(_state.records) + 1):
        generation = _state.generation
        merged = _merge_defaults(mode)
        if generation == _state.generation:  # no plugin failed (and was withdrawn) meanwhile
            break
    _state.defaults[mode] = merged
    return merged


def _merge_defaults(mode: str) -> dict[str, list[tuple[str, str]]]:
    platform = current_platform()
    merged: dict[str, list[tuple[str, str]]] = {}
    _merge(merged, platform.default_priority(mode), f"platform {platform.name}")
    for plugin, contribution in _call_hook("vllm_ir_default_priority", platform=platform, mode=mode):
        if contribution:
            _merge(merged, contribution, f"provider {plugin}", plugin)
    adjusters = _hook_impls("vllm_ir_adjust_priority")
    for op in registry.all_ops():
        entries = merged.get(op.name, [])
        for impl in adjusters:
            args = {"op_name": op.name, "priority": [p for p, _ in entries], "platform": platform, "mode": mode}
            ok, adjusted = _call_one(impl, "vllm_ir_adjust_priority", args)
            if ok and adjusted is not None:
                entries = _adjusted(entries, adjusted, impl.plugin_name)
        if entries:
            merged[op.name] = entries
    return merged


def plugin_manager() -> Any:
    """The pluggy manager holding every loaded provider module (created on first use)."""
    if _state.manager is None:
        import pluggy

        from vllm_ir import hookspecs

        manager = pluggy.PluginManager(hookspecs.PROJECT)
        manager.add_hookspecs(hookspecs)
        _state.manager = manager
    return _state.manager


def reset_for_tests() -> None:
    """Forget discovery (withdrawing what providers registered) so a test can rescan."""
    for record in _state.records.values():
        _withdraw(record)
    _state.__init__()  # type: ignore[misc]
    _invalidate_defaults()


# ---------------------------------------------------------------------------------------
# Discovery and loading


def _scan() -> None:
    if _state.scanned:
        return
    _state.scanned = True
    allow = _env_list(ENV_ALLOW)
    deny = _env_list(ENV_DENY)
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        record = ProviderRecord(
            ep.name, ep.value, dist.metadata["Name"] if dist else None, dist.version if dist else None
        )
        if ep.name in _state.records:
            first = _state.records[ep.name]
            if first.distribution == record.distribution:
                continue  # the same distribution seen twice on sys.path
            record.name = f"{ep.name}@{record.distribution}"
            record.status = ProviderStatus.FAILED
            record.reason = f"entry point name {ep.name!r} is already used by {first.distribution}"
            _state.records[record.name] = record
            continue
        _state.entry_points[ep.name] = ep
        _state.records[ep.name] = record
        if allow is not None and ep.name not in allow:
            record.status, record.reason = ProviderStatus.BLOCKED, f"not in {ENV_ALLOW}={','.join(sorted(allow))}"
        elif ep.name in deny:
            record.status, record.reason = ProviderStatus.BLOCKED, f"listed in {ENV_DENY}"


def _load(name: str, explicit: bool = False) -> None:
    record = _state.records[name]
    if record.status is ProviderStatus.BLOCKED and not explicit:
        return
    ep = _state.entry_points[name]
    problem = _core_requirement_problem(ep)
    if problem is not None:
        _fail(name, ProviderStatus.INCOMPATIBLE, problem)
        return
    before = _registered_impls()
    try:
        module = ep.load()
    except Exception as exc:
        record.implementations = _new_impls(before)
        _fail(name, ProviderStatus.FAILED, f"import of {ep.value} failed: {type(exc).__name__}: {exc}", exc)
        return
    record.implementations = _new_impls(before)
    record.module = module if isinstance(module, ModuleType) else None
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
    _invalidate_defaults()


def _core_requirement_problem(ep: metadata.EntryPoint) -> str | None:
    """Check the provider's ``Requires-Dist: vllm-ir ...`` against the installed core."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    import vllm_ir

    dist = getattr(ep, "dist", None)
    for line in (dist.requires or []) if dist else []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(req.name) != CORE_DISTRIBUTION or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        if not req.specifier.contains(vllm_ir.__version__, prereleases=True):
            return f"requires {CORE_DISTRIBUTION}{req.specifier} but {vllm_ir.__version__} is installed"
    return None


def _fail(name: str, status: ProviderStatus, reason: str, exc: BaseException | None = None) -> None:
    record = _state.records[name]
    _withdraw(record)
    record.status, record.reason = status, reason
    if _env_flag(ENV_STRICT):
        raise PluginError(f"provider {name!r} ({record.distribution} {record.version}): {reason}") from exc
    warnings.warn(f"vllm-ir provider {name!r} disabled: {reason}", RuntimeWarning, stacklevel=3)


def _withdraw(record: ProviderRecord) -> None:
    """Undo what a provider did: its implementations and its hooks."""
    for provider, ops in record.implementations.items():
        for op_name in ops:
            if registry.has_op(op_name):
                registry.get_op(op_name).remove_impl(provider)
    record.implementations = {}
    manager = _state.manager
    if manager is not None and manager.has_plugin(record.name):
        manager.unregister(name=record.name)
    record.module = None
    _invalidate_defaults()


def _registered_impls() -> set[tuple[str, str]]:
    return {(op.name, p) for op in registry.all_ops() for p in op.impls}


def _new_impls(before: set[tuple[str, str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for op_name, provider in sorted(_registered_impls() - before):
        out.setdefault(provider, []).append(op_name)
    return out


# ---------------------------------------------------------------------------------------
# Hooks and defaults


def _hook_impls(hook_name: str) -> list[Any]:
    """A hook's implementations in pluggy's call order (last registered and tryfirst first)."""
    if _state.manager is None:
        return []
    return list(reversed(getattr(_state.manager.hook, hook_name).get_hookimpls()))


def _call_one(impl: Any, hook_name: str, args: Mapping[str, Any]) -> tuple[bool, Any]:
    """Call one hook implementation; a raising plugin is recorded as failed and withdrawn."""
    try:
        return True, impl.function(*[args[a] for a in impl.argnames])
    except Exception as exc:
        if impl.plugin_name not in _state.records:
            raise
        _fail(impl.plugin_name, ProviderStatus.FAILED, f"hook {hook_name} raised {type(exc).__name__}: {exc}", exc)
        return False, None


def _call_hook(hook_name: str, **args: Any) -> list[tuple[str, Any]]:
    """Call each implementation of a hook in pluggy's order, isolating failures per plugin."""
    results = []
    for impl in _hook_impls(hook_name):
        ok, value = _call_one(impl, hook_name, args)
        if ok:
            results.append((impl.plugin_name, value))
    return results


def _merge(merged: dict[str, list[tuple[str, str]]], contribution: Any, source: str, plugin: str | None = None) -> None:
    if not isinstance(contribution, Mapping):
        if plugin is not None:
            _fail(
                plugin,
                ProviderStatus.FAILED,
                f"vllm_ir_default_priority returned {type(contribution).__name__}, expected a dict",
            )
        return
    for op_name, providers in contribution.items():
        if isinstance(providers, str) or not isinstance(providers, Iterable):
            if plugin is not None:
                _fail(plugin, ProviderStatus.FAILED, f"vllm_ir_default_priority: {op_name!r} must map to a list")
            return
        entries = merged.setdefault(op_name, [])
        seen = {p for p, _ in entries}
        entries.extend((p, source) for p in providers if p not in seen)


def _adjusted(entries: list[tuple[str, str]], new: Sequence[str], plugin: str) -> list[tuple[str, str]]:
    """Apply one adjust hook's list, keeping each entry's origin and noting the adjustment."""
    if isinstance(new, str) or not all(isinstance(p, str) for p in new):
        _fail(plugin, ProviderStatus.FAILED, "vllm_ir_adjust_priority must return a list of provider names or None")
        return entries
    sources = dict(entries)
    if list(new) == [p for p, _ in entries]:
        return entries
    return [
        (p, f"{sources[p]}, moved by {plugin}" if p in sources else f"added by {plugin}") for p in dict.fromkeys(new)
    ]


def _as_claimed(platform: Any, plugin: str) -> Any:
    import dataclasses

    from vllm_ir.platforms import Platform

    if isinstance(platform, Platform) and platform.claimed_by is None:
        return dataclasses.replace(platform, claimed_by=plugin)
    return platform


def _invalidate_defaults() -> None:
    _state.defaults.clear()
    _state.platform = None
    _state.generation += 1
    registry.invalidate()


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def _env_list(name: str) -> set[str] | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None if name == ENV_ALLOW else set()
    return {item.strip() for item in raw.split(",") if item.strip()}


def install() -> None:
    """Wire discovery into the core: lazy loading and the defaults layer."""
    registry.set_providers_loader(load_providers)
    _priority.set_defaults_source(merged_defaults)
