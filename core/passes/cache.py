"""Cache keys of the passes: what Inductor's FX graph cache must know about lowering.

Inductor keys a compiled graph by, among others, each custom pass's ``uuid()``. The lowering
output depends on state outside the graph: the effective compile-mode priority of every op
(scoped ``priority()`` lists included) and the code of every implementation and predicate
dispatch may pick. The fingerprint below covers exactly that, so a change recompiles and
anything else hits the cache (a ``None`` uuid would disable caching altogether).
"""

from __future__ import annotations

import functools
import hashlib
import types
from pathlib import Path
from typing import Any

import torch

from vllm_ir.ir import priority as _priority
from vllm_ir.ir import registry

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
    """
    key = (registry.epoch, mode, scope)
    hit = _priority_cache.get(key)
    if hit is not None:
        return hit
    parts = []
    for op in registry.all_ops():
        resolved = _priority.resolve(op, mode, scope)
        parts.append(
            (
                op.name,
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
