"""Keys of compiled results: what Inductor's FX graph cache and Dynamo's guards must know.

Lowering depends on state outside the graph: the effective compile-mode priority of every
op (scoped ``priority()`` lists included), the code of every implementation and predicate
dispatch may pick, and what that code reads from its environment (library versions, build
ids, environment variables: its *compile facts*). Two caches keep compiled code, and each
gets a key here:

* Inductor's FX graph cache (on disk, across processes) keys a graph by each custom pass's
  ``uuid()``: `priority_fingerprint` (priorities and code) plus `facts_fingerprint` (facts,
  re-read at every compile) go into the lowering pass's uuid, so a change recompiles and
  anything else hits the cache (a ``None`` uuid would disable caching altogether).
* Dynamo's code cache (in process) reuses a compiled frame while its guards hold. A graph
  with IR ops gets one more guard (`install_priority_guard`): the compile-mode priority in
  effect for the calling thread or task must have the fingerprint it was lowered under. A
  call after ``set_priority(...)``, inside ``with priority(...)``, or after leaving the scope
  it was compiled in therefore recompiles (or reuses the entry compiled for that priority)
  instead of running a kernel the current priority would not pick.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from vllm_ir.errors import ProviderWarning, VllmIrError
from vllm_ir.ir import priority as _priority
from vllm_ir.ir import registry, tuning
from vllm_ir.settings.log import get_logger

log = get_logger("passes")

_MAX_DEPTH = 4
_SIMPLE = (str, int, float, bool, type(None), bytes, torch.dtype)


def combine(*parts: object) -> str:
    """A stable hex digest of ``parts`` (strings, numbers, nested tuples)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()


@functools.cache
def package_fingerprint() -> str:
    """Hash of the pipeline's own code and of the op model it dispatches with."""
    root = Path(__file__).resolve().parent.parent  # the vllm_ir package
    h = hashlib.sha256()
    for sub in ("passes", "ir"):
        for path in sorted((root / sub).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def code_fingerprint(fn: Any) -> str:
    """Hash of what ``fn`` runs: its code objects, constants, closure, and same-module helpers.

    Code objects are used rather than ``inspect.getsource`` so functions built at run time
    (``exec``, lambdas in loops, closures) are covered too; helper functions of the same
    module that ``fn`` calls by name are followed a few levels deep.
    """
    h = hashlib.sha256()
    _feed(h, fn, 0, set())
    return h.hexdigest()


def _feed(h: Any, obj: Any, depth: int, seen: set[int]) -> None:
    if isinstance(obj, _SIMPLE):
        h.update(repr(obj).encode())
        return
    if id(obj) in seen or depth > _MAX_DEPTH:
        h.update(b"<seen>")
        return
    seen.add(id(obj))
    if isinstance(obj, (list, tuple, frozenset, set)):
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
        h.update(type(obj).__name__.encode())
        for item in items:
            _feed(h, item, depth, seen)
        return
    if isinstance(obj, functools.partial):
        h.update(b"partial")
        _feed(h, obj.func, depth + 1, seen)
        _feed(h, obj.args, depth + 1, seen)
        _feed(h, tuple(sorted(obj.keywords.items())), depth + 1, seen)
        return
    if isinstance(obj, torch._ops.OpOverload):
        h.update(f"op:{obj.name()}:{obj._schema}".encode())
        return
    if isinstance(obj, torch._ops.OpOverloadPacket):
        h.update(f"op:{obj._qualified_op_name}".encode())
        return
    if isinstance(obj, types.MethodType):
        _feed(h, obj.__func__, depth, seen)
        return
    if isinstance(obj, types.FunctionType):
        h.update(f"fn:{obj.__module__}.{obj.__qualname__}".encode())
        _feed_code(h, obj.__code__)
        _feed(h, obj.__defaults__, depth + 1, seen)
        for cell in obj.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # empty cell
                continue
            _feed_value(h, contents, depth + 1, seen)
        for name in _global_names(obj.__code__):
            helper = obj.__globals__.get(name)
            if isinstance(helper, types.FunctionType) and helper.__module__ == obj.__module__:
                _feed(h, helper, depth + 1, seen)
        return
    if isinstance(obj, type):
        h.update(f"type:{obj.__module__}.{obj.__qualname__}".encode())
        for name, member in sorted(vars(obj).items()):
            if isinstance(member, (types.FunctionType, staticmethod, classmethod)):
                h.update(name.encode())
                _feed(h, getattr(member, "__func__", member), depth + 1, seen)
        return
    if callable(obj):
        # Builtins and callable objects: their type's code and their identity by name.
        name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
        h.update(f"callable:{getattr(obj, '__module__', type(obj).__module__)}.{name}".encode())
        if not isinstance(obj, types.BuiltinFunctionType):
            _feed(h, type(obj), depth + 1, seen)
        return
    h.update(f"obj:{type(obj).__module__}.{type(obj).__qualname__}".encode())


def _feed_value(h: Any, value: Any, depth: int, seen: set[int]) -> None:
    """Closure contents: code and plain values count; tensors and other state by type only."""
    if isinstance(value, torch.Tensor):
        h.update(f"tensor:{value.dtype}:{tuple(value.shape)}".encode())
        return
    _feed(h, value, depth, seen)


def _feed_code(h: Any, code: types.CodeType) -> None:
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    h.update(repr(code.co_varnames).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _feed_code(h, const)
        else:
            h.update(repr(const).encode())


def _global_names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _global_names(const)
    return names


def _impl_fingerprint(impl: Any) -> tuple:
    return (
        impl.provider,
        bool(impl.inplace),
        bool(impl.cacheable),
        code_fingerprint(impl.fn),
        code_fingerprint(impl.supports_args) if impl.supports_args is not None else None,
    )


_priority_cache: dict[tuple[int, str, object], str] = {}


def priority_fingerprint(mode: _priority.Mode = "compile", scope: object = None) -> str:
    """Hash of every op's effective priority in ``mode`` and ``scope``, with candidate code.

    Cached per (registry epoch, scope): any registration or priority change bumps the epoch.
    The tuning tables' entries for ``mode`` are covered too (each entry's priority, with the
    code of its candidates): a table change invalidates compiled code as a priority change does.
    """
    key = (registry.epoch, mode, scope)
    hit = _priority_cache.get(key)
    if hit is not None:
        return hit
    tuned_by_op: dict[str, list[Any]] = {}
    for entry in tuning.applied_entries(mode):
        tuned_by_op.setdefault(entry.op, []).append(entry)
    parts = []
    for op in registry.all_ops():
        for tuned in (None, *tuned_by_op.get(op.name, ())):
            resolved = _priority.resolve(op, mode, scope, tuned)
            parts.append(
                (
                    op.name,
                    None if tuned is None else (tuned.dtype, tuned.low, tuned.high, tuned.providers),
                    str(op.schema),
                    op.activations,
                    tuple(_impl_fingerprint(impl) for impl, _entry in resolved.candidates),
                )
            )
    digest = combine(mode, parts)
    if len(_priority_cache) > 64:
        _priority_cache.clear()
    _priority_cache[key] = digest
    return digest


# -- Dynamo guard -------------------------------------------------------------------------------

#: Shown by ``TORCH_LOGS=recompiles`` when the guard fails.
GUARD_DESCRIPTION = (
    "vllm-ir: the compile-mode priority is the one this graph was lowered for (any layer: "
    "set_priority, a priority() scope, the environment, defaults; or the registered implementations)"
)


def compile_state() -> str:
    """The fingerprint of the compile-mode priority in effect here (this thread's or task's scope).

    What a compiled graph's guard compares: one dict lookup while nothing was invalidated.
    """
    return priority_fingerprint("compile", _priority.scope_var.get())


def _state_check(expected: str) -> Callable[[Any], bool]:
    get_scope = _priority.scope_var.get
    cached = _priority_cache

    def check(_frame_locals: Any) -> bool:
        hit = cached.get((registry.epoch, "compile", get_scope()))
        if hit is None:
            hit = compile_state()
        return hit == expected

    return check


def _create_guard(expected: str, builder: Any, guard: Any) -> None:
    builder.guard_manager.root.add_lambda_guard(_state_check(expected), [GUARD_DESCRIPTION], guard.user_stack)


def install_priority_guard(gm: torch.fx.GraphModule | torch.fx.Graph) -> bool:
    """Make the Dynamo frame being compiled guard on the compile-mode priority, if ``gm`` has IR ops.

    Called on Dynamo's graph by every vllm-ir pipeline (Inductor's pre-grad pass, the
    back-end of `vllm_ir.compile`), while Dynamo still collects the frame's guards. Returns
    whether a guard was added (False outside Dynamo, e.g. under ``make_fx``, or without IR ops).
    """
    from torch._dynamo.source import GlobalStateSource
    from torch._guards import Guard, TracingContext

    from vllm_ir.passes.nodes import ir_nodes

    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    if next(ir_nodes(graph), None) is None:
        return False
    context = TracingContext.try_get()
    guards = getattr(getattr(context, "guards_context", None), "dynamo_guards", None)
    if guards is None:
        return False
    expected = compile_state()
    guards.add(Guard(GlobalStateSource(), functools.partial(_create_guard, expected)))
    log.debug("guarding the compiled frame on the compile-mode priority %s", expected[:16])
    return True


# -- compile facts -----------------------------------------------------------------------------

_UNSET = object()
#: Top-level packages whose state is covered otherwise (torch: `process_facts`; vllm_ir: its code).
_COVERED = frozenset({"torch", "vllm_ir", "builtins", "__main__"})
_library_facts: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()
_warned: set[tuple[str, str, str]] = set()


@functools.cache
def process_facts() -> tuple[tuple[str, object], ...]:
    """Facts every compiled graph depends on: torch's version and build, Triton's version."""
    facts: dict[str, object] = {
        "torch": torch.__version__,
        "torch.git": getattr(torch.version, "git_version", None),
        "torch.cuda": torch.version.cuda,
        "torch.hip": torch.version.hip,
    }
    facts["triton"] = _distribution_version("triton")
    return tuple(facts.items())


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


@functools.cache
def _packages_distributions() -> Mapping[str, list[str]]:
    return importlib.metadata.packages_distributions()


@functools.cache
def library_version(top_level: str) -> str | None:
    """The installed version of the distribution providing import package ``top_level``."""
    version = _distribution_version(top_level)
    if version is not None:
        return version
    module = sys.modules.get(top_level)
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    dists = _packages_distributions().get(top_level) or ()
    found = [f"{d} {v}" for d in sorted(set(dists)) if (v := _distribution_version(d)) is not None]
    return ", ".join(found) or None


def _referenced_modules(fn: Any, depth: int, out: dict[str, types.ModuleType | None], seen: set[int]) -> None:
    """Modules ``fn``'s code refers to by global name (and those of its same-module helpers)."""
    fn = getattr(fn, "__func__", fn)
    if isinstance(fn, functools.partial):
        _referenced_modules(fn.func, depth, out, seen)
        return
    if not isinstance(fn, types.FunctionType) or id(fn) in seen or depth > _MAX_DEPTH:
        module = getattr(fn, "__module__", None)
        if isinstance(module, str):
            out.setdefault(module, sys.modules.get(module))
        return
    seen.add(id(fn))
    if isinstance(fn.__module__, str):  # None for code exec'd without a __name__
        out.setdefault(fn.__module__, sys.modules.get(fn.__module__))
    for name in _global_names(fn.__code__):
        value = fn.__globals__.get(name, _UNSET)
        if isinstance(value, types.ModuleType):
            out.setdefault(value.__name__, value)
        elif isinstance(value, types.FunctionType) and value.__module__ == fn.__module__:
            _referenced_modules(value, depth + 1, out, seen)
        elif isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
            module = getattr(value, "__module__", None)
            if isinstance(module, str):
                out.setdefault(module, sys.modules.get(module))


def _extension_stamp(module: types.ModuleType | None) -> tuple[int, int] | None:
    """(size, mtime) of a compiled extension module's file: catches a rebuild in place."""
    path = getattr(module, "__file__", None)
    if not isinstance(path, str) or not path.endswith((".so", ".pyd", ".dylib")):
        return None
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns)


def library_facts(impl: Any) -> tuple:
    """The versions of the libraries an implementation's code (and predicate) refers to.

    Computed once per implementation and process: the code that runs is the one imported,
    whatever is installed later. Standard-library modules, torch and vllm-ir are left out
    (torch is in `process_facts`; vllm-ir's own code is hashed).
    """
    hit = _library_facts.get(impl)
    if hit is not None:
        return hit
    modules: dict[str, types.ModuleType | None] = {}
    seen: set[int] = set()
    for fn in (impl.fn, impl.inplace_fn, impl.supports_args):
        if fn is not None:
            _referenced_modules(fn, 0, modules, seen)
    libraries: dict[str, object] = {}
    stamps: dict[str, object] = {}
    for name, module in sorted(modules.items()):
        top = name.partition(".")[0]
        if top in _COVERED or top in sys.stdlib_module_names or top.startswith("_"):
            continue
        if top not in libraries:
            libraries[top] = library_version(top)
        stamp = _extension_stamp(module)
        if stamp is not None:
            stamps[name] = stamp
    facts = (tuple(libraries.items()), tuple(stamps.items()))
    _library_facts[impl] = facts
    return facts


class FactsError(VllmIrError, ValueError):
    """A provider's ``compile_facts`` raised or returned something other than a mapping of names to values."""


def declared_facts(impl: Any) -> tuple[tuple[str, str], ...]:
    """The facts ``impl`` declares (``compile_facts=``), read now; `FactsError` if they are malformed."""
    facts = impl.compile_facts
    if facts is None:
        return ()
    if callable(facts):
        try:
            facts = facts()
        except Exception as exc:
            raise FactsError(f"compile_facts() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(facts, Mapping):
        raise FactsError(f"compile_facts must be a mapping (or return one), got {type(facts).__name__}")
    out = []
    for key, value in facts.items():
        if not isinstance(key, str):
            raise FactsError(f"compile_facts keys must be strings, got {key!r}")
        out.append((key, _fact_value(value)))
    return tuple(sorted(out))


def _fact_value(value: Any) -> str:
    if isinstance(value, _SIMPLE) or value is None:
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_fact_value(v) for v in value) + ")"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_fact_value(v)}" for k, v in sorted(value.items(), key=repr)) + "}"
    raise FactsError(f"compile_facts values must be plain values (str, numbers, None, tuples), got {value!r}")


def compile_facts(mode: _priority.Mode = "compile", scope: object = _UNSET) -> dict[str, Any]:
    """Every fact the compile cache key covers: ``{"process": {...}, op: {provider: {...}}}``.

    For the candidates of ``mode``'s priority in ``scope`` (default: the current scope). A
    provider whose declared facts are malformed shows ``{"error": reason}``.
    """
    scope = _priority.current_scope() if scope is _UNSET else scope
    out: dict[str, Any] = {"process": dict(process_facts())}
    for op in registry.all_ops():
        per_provider = {}
        for impl, _entry in _priority.resolve(op, mode, scope).candidates:
            libraries, stamps = library_facts(impl)
            entry: dict[str, Any] = {"libraries": dict(libraries)}
            if stamps:
                entry["extension files"] = dict(stamps)
            if impl.origin:
                entry["distribution"] = impl.origin
            try:
                entry["declared"] = dict(declared_facts(impl))
            except FactsError as exc:
                entry["error"] = str(exc)
            per_provider[impl.provider] = entry
        out[op.name] = per_provider
    return out


def facts_fingerprint(mode: _priority.Mode = "compile", scope: object = None) -> str | None:
    """Hash of the compile facts of every candidate in ``mode`` and ``scope`` (read afresh).

    None when a provider's declared facts cannot be read: the caller then turns the compile
    cache off for this compile (a uuid of None) rather than risk a stale entry, and a
    `vllm_ir.ProviderWarning` says which provider (once per reason).
    """
    parts: list[object] = [process_facts()]
    for op in registry.all_ops():
        for impl, _entry in _priority.resolve(op, mode, scope).candidates:
            try:
                declared = declared_facts(impl)
            except FactsError as exc:
                _warn_facts(op.name, impl.provider, str(exc))
                return None
            libraries = library_facts(impl)
            if declared or libraries != ((), ()) or impl.origin:
                parts.append((op.name, impl.provider, impl.origin, libraries, declared))
    digest = combine("facts", mode, parts)
    global _logged_facts
    if digest != _logged_facts and log.isEnabledFor(logging.DEBUG):  # Inductor asks several times per compile
        _logged_facts = digest
        log.debug("compile facts %s: %s", digest[:16], parts)
    return digest


_logged_facts: str | None = None


def _warn_facts(op_name: str, provider: str, reason: str) -> None:
    key = (op_name, provider, reason)
    log.debug("compile cache off: op %s, provider %s: %s", op_name, provider, reason)
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(
        f"vllm-ir: op {op_name!r}, provider {provider!r}: {reason}; Inductor's compile cache is off "
        "for compiles that may pick it",
        ProviderWarning,
        stacklevel=3,
    )
