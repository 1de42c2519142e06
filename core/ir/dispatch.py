"""Choosing an implementation for a call: the eager hot path, its cache, and ``explain``.

The hot path is generated per op as a plain function with the op's own parameters, so a
call costs a tracing check, a key of per-tensor facts (dtype, device, number of
dimensions, layout class: contiguous / unit inner stride / other) plus the scalar
arguments, one dict lookup and the kernel call. A predicate that looks at anything else
registers with ``cacheable=False``. Where the ``vllm_ir._fast_lookup`` extension is built,
one C call does the key and the lookup (and remembers the last hit); the Python path here
remains the reference and handles everything it declines.
Predicates run only on a cache miss. While tracing or compiling, the same function calls the
``torch.ops.vllm_ir`` op instead, so graphs hold exactly one IR node per call.
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from vllm_ir.errors import FallbackError, FallbackWarning, PredicateError
from vllm_ir.ir import priority as _priority
from vllm_ir.ir.impl import IrOpImpl, Unsupported, reason_of
from vllm_ir.ir.priority import EntryStatus, Mode, PriorityLayer, current_scope

if TYPE_CHECKING:
    from vllm_ir.ir.op import IrOp

#: A runaway key space (e.g. a new epsilon every call) resets the cache instead of growing it.
MAX_CACHED_DECISIONS = 4096


@dataclass(eq=False, slots=True)
class Decision:
    """The implementation chosen for one call signature, ready to run both overloads."""

    impl: IrOpImpl
    #: Higher-priority providers whose predicate declined: (provider, reason).
    skipped: tuple[tuple[str, str], ...]
    cacheable: bool
    functional: Callable[..., Any] = field(repr=False)
    maybe_inplace: Callable[..., Any] = field(repr=False)
    calls: int = 0

    @property
    def provider(self) -> str:
        return self.impl.provider


@dataclass(frozen=True)
class Verdict:
    """What happened to one provider of the effective priority for one call."""

    provider: str
    #: chosen / declined / unsupported / not installed / not batch-invariant / unreachable / not tried
    status: str
    reason: str | None
    layer: PriorityLayer
    source: str


@dataclass(frozen=True)
class Explanation:
    """The full decision for a call: every provider considered, and the one chosen."""

    op: str
    mode: Mode
    chosen: str
    verdicts: tuple[Verdict, ...]

    def __str__(self) -> str:
        rows = [(v.provider, v.status, v.source, v.reason or "") for v in self.verdicts]
        widths = [max(len(r[i]) for r in [*rows, ("provider", "verdict", "from", "")]) for i in range(3)]
        lines = [f"{self.op} ({self.mode}): chose {self.chosen}"]
        lines.append(f"  {'provider':<{widths[0]}}  {'verdict':<{widths[1]}}  {'from':<{widths[2]}}  reason")
        for r in rows:
            lines.append(f"  {r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip())
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Deciding (cache misses, lowering, explain)


def ask(impl: IrOpImpl, args: Sequence[Any]) -> bool | Unsupported:
    """Run an implementation's predicate and insist on a bool or an `Unsupported`."""
    if impl.supports_args is None:
        return True
    verdict = impl.supports_args(*args)
    if verdict is True or verdict is False or isinstance(verdict, Unsupported):
        return verdict
    raise PredicateError(
        f"op {impl.op_name!r}, provider {impl.provider!r}: supports_args returned "
        f"{type(verdict).__name__} {verdict!r}; it must return True, False or "
        "vllm_ir.Unsupported(reason) and must not depend on tensor values or batch size"
    )


def decide(op: IrOp, args: Sequence[Any], mode: Mode = "eager", scope: Any = None) -> Decision:
    """Walk the effective priority for ``args`` and return the first implementation that accepts."""
    skipped: list[tuple[str, str]] = []
    cacheable = True
    for impl, _entry in _priority.resolve(op, mode, scope).candidates:
        if impl.supports_args is not None:
            cacheable = cacheable and impl.cacheable
        verdict = ask(impl, args)
        if verdict:
            return _make_decision(op, impl, tuple(skipped), cacheable)
        skipped.append((impl.provider, reason_of(verdict, "declined by supports_args")))
    raise AssertionError(f"op {op.name!r}: the native implementation must close every priority list")


def decide_cached(op: IrOp, args: tuple) -> Decision:
    """The decision for a call that reached the torch op's kernel (a graph that kept the IR
    node, a direct ``torch.ops.vllm_ir`` call): cached like the eager path, but in its own
    dict and without the fallback policy, exactly as an uncached `decide` would answer."""
    scope = current_scope()
    assert op._key is not None, "register_op sets the key function before the op can be called"
    key = op._key(scope, *args)
    decision = op._kernel_decisions.get(key)
    if decision is None:
        decision = decide(op, args, "eager", scope)
        if decision.cacheable:
            if len(op._kernel_decisions) >= MAX_CACHED_DECISIONS:
                op._kernel_decisions.clear()
            op._kernel_decisions[key] = decision
    return decision


def explain(op: IrOp, args: Sequence[Any], mode: Mode = "eager") -> Explanation:
    """Every provider of the effective priority with its verdict for ``args``."""
    resolved = _priority.resolve(op, mode, current_scope())
    verdicts: list[Verdict] = []
    chosen: str | None = None
    for r in resolved.entries:
        e = r.entry
        if r.status is not EntryStatus.CANDIDATE:
            verdicts.append(Verdict(e.provider, r.status.value, r.reason, e.layer, e.source))
            continue
        if chosen is not None:
            verdicts.append(Verdict(e.provider, "not tried", f"{chosen!r} was chosen first", e.layer, e.source))
            continue
        verdict = ask(op.impls[e.provider], args)
        if verdict:
            chosen = e.provider
            verdicts.append(Verdict(e.provider, "chosen", None, e.layer, e.source))
        else:
            verdicts.append(
                Verdict(e.provider, "declined", reason_of(verdict, "declined by supports_args"), e.layer, e.source)
            )
    assert chosen is not None
    return Explanation(op.name, mode, chosen, tuple(verdicts))


def _make_decision(op: IrOp, impl: IrOpImpl, skipped: tuple[tuple[str, str], ...], cacheable: bool) -> Decision:
    fn = impl.fn
    functional = fn
    if impl.inplace and op.activation_indices:
        functional = _cloning(fn, op.activation_indices)
    return Decision(impl, skipped, cacheable, functional=functional, maybe_inplace=fn)


def _cloning(fn: Callable[..., Any], indices: tuple[int, ...]) -> Callable[..., Any]:
    """Run an in-place kernel on copies of the activations, keeping the default overload functional."""

    def functional(*args: Any) -> Any:
        args_list = list(args)
        for i in indices:
            if args_list[i] is not None:
                args_list[i] = args_list[i].clone()
        return fn(*args_list)

    return functional


# ---------------------------------------------------------------------------------------
# Fallback policy and statistics

_warned: set[tuple[str, str, str]] = set()
_retired_skips: Counter[tuple[str, str, str]] = Counter()


def on_miss(op: IrOp, key: tuple, args: tuple) -> Decision:
    """Cache miss of the eager hot path: decide, apply the fallback policy, maybe cache."""
    decision = decide(op, args, "eager", key[0])
    if decision.skipped:
        _apply_fallback_policy(op, decision)
    if not decision.skipped and decision.impl.supports_args is None:
        # Nothing was skipped, so the first candidate ran, and it accepts every call:
        # no per-call key is needed in this scope.
        op._fixed[key[0]] = decision
    elif decision.cacheable:
        cache = op._decisions
        if len(cache) >= MAX_CACHED_DECISIONS:
            op._clear_decisions()
        cache[key] = decision
    else:
        for provider, reason in decision.skipped:
            _retired_skips[(op.name, provider, reason)] += 1
        decision.calls = -1  # the hot path adds one; this decision is never looked up again
    return decision


def _apply_fallback_policy(op: IrOp, decision: Decision) -> None:
    policy = _priority.settings().fallback
    if policy == "allow":
        return
    provider, reason = decision.skipped[0]
    message = f"op {op.name!r}: provider {provider!r} declined the call ({reason}); {decision.provider!r} runs instead"
    if policy == "error":
        raise FallbackError(message + " [VLLM_IR_FALLBACK=error]")
    for provider, reason in decision.skipped:
        if (op.name, provider, reason) not in _warned:
            _warned.add((op.name, provider, reason))
            warnings.warn(
                f"op {op.name!r}: provider {provider!r} declined the call ({reason}); "
                f"{decision.provider!r} runs instead (shown once; VLLM_IR_FALLBACK=allow silences it)",
                FallbackWarning,
                stacklevel=_user_stacklevel(),
            )


#: Frames of vllm_ir itself: its modules and its generated entry points.
_OWN_CODE = (str(Path(__file__).resolve().parents[1]) + os.sep, "<vllm_ir.")


def _user_stacklevel() -> int:
    """``stacklevel`` for a warning raised in here that points at the caller's line."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_OWN_CODE):
        frame, level = frame.f_back, level + 1
    return level


def retire(decisions: dict[tuple, Decision], op_name: str) -> None:
    """Fold the call counts of decisions about to be dropped into the statistics."""
    for d in decisions.values():
        for provider, reason in d.skipped:
            _retired_skips[(op_name, provider, reason)] += d.calls


def dispatch_stats() -> dict[str, dict[str, dict[str, int]]]:
    """How often each provider was skipped in favour of a lower one: ``{op: {provider: {reason: calls}}}``."""
    from vllm_ir.ir import registry

    counts = Counter(_retired_skips)
    for op in registry.all_ops():
        for d in op._decisions.values():
            for provider, reason in d.skipped:
                counts[(op.name, provider, reason)] += d.calls
    out: dict[str, dict[str, dict[str, int]]] = {}
    for (op_name, provider, reason), n in sorted(counts.items()):
        if n:
            out.setdefault(op_name, {}).setdefault(provider, {})[reason] = n
    return out


def reset_dispatch_stats() -> None:
    from vllm_ir.ir import registry

    _retired_skips.clear()
    _warned.clear()
    for op in registry.all_ops():
        for d in op._decisions.values():
            d.calls = 0


# ---------------------------------------------------------------------------------------
# The generated hot path


class EntryPoints(NamedTuple):
    """The generated functions of one op."""

    #: ``op(...)``, as a method: its first parameter is the op itself.
    call: Callable[..., Any]
    #: ``op.maybe_inplace(...)``.
    maybe_inplace: Callable[..., Any]
    #: ``key(scope, *args)``: the decision-cache key of a call (compiled where possible).
    key: Callable[..., Any]


def build_entry_points(
    op: IrOp, torch_default: Callable[..., Any], torch_maybe_inplace: Callable[..., Any], lookup: Any | None
) -> EntryPoints:
    """Generate ``op(...)`` and ``op.maybe_inplace(...)`` with the op's exact parameters.

    ``op(...)`` is returned as a method (first parameter the op itself) so that it can be
    the ``__call__`` of the op's class, which Dynamo inlines like any user method.

    The Python path below is the reference. With a compiled ``lookup`` over the op's decision
    dicts (`vllm_ir.ir.fast_lookup.make_lookup`), the entry points first ask it for a cached
    decision and take the Python path only when it answers None; Python then stores new
    decisions under the compiled key so that both read one cache.
    """
    sig = op.signature
    names = list(sig.parameters)
    env: dict[str, Any] = {
        "_is_compiling": torch.compiler.is_compiling,
        "_is_dynamo_compiling": torch.compiler.is_dynamo_compiling,
        "_dispatch_stack": torch._C._len_torch_dispatch_stack,
        "_scope": current_scope,
        "_cache": op._decisions,
        "_fixed": op._fixed,
        "_bad_arguments": lambda args: check_arguments(op, args),
        "_miss": lambda key, args: on_miss(op, key, args),
        "_torch_default": torch_default,
        "_torch_maybe_inplace": torch_maybe_inplace,
        "_freeze": _freeze,
        "_lookup": lookup.lookup if lookup is not None else None,
        "_compiled_key": lookup.key if lookup is not None else None,
    }
    params = []
    for i, p in enumerate(sig.parameters.values()):
        if p.default is inspect.Parameter.empty:
            params.append(p.name)
        else:
            env[f"_default_{i}"] = p.default
            params.append(f"{p.name}=_default_{i}")
    call = ", ".join(names)
    key_parts = ["scope"] + [_key_expr(op, name) for name in names]
    key_fn = (
        f"def _python_key(scope, {call}):\n"
        f"    try:\n"
        f"        return ({', '.join(key_parts)},)\n"
        f"    except (AttributeError, TypeError):\n"
        f"        _bad_arguments(({call},))\n"
        f"        raise\n"
    )
    key = f"_python_key(scope, {call})"
    key_function = env["_python_key"] = _define(op, "python_key", "_python_key", key_fn, env)
    if lookup is not None:
        key = f"_compiled_key(scope, {call}) or {key}"
        key_source = f"def _key(scope, {call}):\n    return {key}\n"
        key_function = _define(op, "key", "_key", key_source, env)
    signature = ", ".join(params)
    entries = []
    for overload, head, torch_fn, runner in (
        ("default", "_op_self, ", "_torch_default", "functional"),
        ("maybe_inplace", "", "_torch_maybe_inplace", "maybe_inplace"),
    ):
        if lookup is None:
            source = _python_path(op.name, head + signature, call, key, torch_fn, runner)
            entries.append(_define(op, overload, op.name, source, env))
            continue
        source = _python_path(op.name, signature, call, key, torch_fn, runner)
        python_path = _define(op, f"{overload}.python", op.name, source, env)
        source = _fast_path(op.name, head + signature, call, torch_fn, runner)
        entries.append(_define(op, overload, op.name, source, dict(env, _python_path=python_path)))
    return EntryPoints(entries[0], entries[1], key_function)


def _python_path(name: str, signature: str, call: str, key: str, torch_fn: str, runner: str) -> str:
    return (
        f"def {name}({signature}):\n"
        f"    if _is_compiling() or _dispatch_stack():\n"
        f"        return {torch_fn}({call})\n"
        f"    scope = _scope()\n"
        f"    d = _fixed.get(scope)\n"
        f"    if d is None:\n"
        f"        key = {key}\n"
        f"        d = _cache.get(key)\n"
        f"        if d is None:\n"
        f"            d = _miss(key, ({call},))\n"
        f"    d.calls += 1\n"
        f"    return d.{runner}({call})\n"
    )


def _fast_path(name: str, signature: str, call: str, torch_fn: str, runner: str) -> str:
    # Dynamo folds is_dynamo_compiling() to True; the other tracers run a dispatch mode, for
    # which the compiled lookup answers None and the Python path routes to the torch op.
    return (
        f"def {name}({signature}):\n"
        f"    if _is_dynamo_compiling():\n"
        f"        return {torch_fn}({call})\n"
        f"    d = _lookup({call})\n"
        f"    if d is None:\n"
        f"        return _python_path({call})\n"
        f"    d.calls += 1\n"
        f"    return d.{runner}({call})\n"
    )


def _define(op: IrOp, what: str, fn_name: str, source: str, env: dict[str, Any]) -> Callable[..., Any]:
    """Compile one generated function; ``what`` names it in tracebacks and profiles."""
    namespace = dict(env)
    exec(compile(source, f"<vllm_ir.ops.{op.name}.{what}>", "exec"), namespace)
    fn = namespace[fn_name]
    fn.__qualname__ = op.name if what == "default" else f"{op.name}.{what}"
    fn.__doc__ = op.fn.__doc__
    return fn


def check_arguments(op: IrOp, args: tuple) -> None:
    """Name the argument that is not a tensor where the op expects one."""
    for (name, optional), i in zip(op.tensor_params.items(), op.tensor_param_indices, strict=True):
        value = args[i]
        if value is None and optional:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"op {op.name!r}: argument {name!r} must be a Tensor, got {type(value).__name__}")


def _key_expr(op: IrOp, name: str) -> str:
    optional = op.tensor_params.get(name)
    # Layout class: True (contiguous), 2 (rows with a unit inner stride), False (anything else).
    layout = f"(True if {name}.is_contiguous() else {name}.stride(-1) == 1 and 2)"
    facts = f"{name}.dtype, {name}.device, {name}.dim(), {layout}"
    if optional is None:
        return f"_freeze({name})" if name in op.list_params else name
    if optional:
        return f"None if {name} is None else ({facts})"
    return facts


def _freeze(value: Any) -> Any:
    """A hashable stand-in for a list argument (tensors by their dispatch facts)."""
    if isinstance(value, (list, tuple)):
        return tuple(
            (v.dtype, v.device, v.dim(), True if v.is_contiguous() else v.stride(-1) == 1 and 2)
            if isinstance(v, torch.Tensor)
            else v
            for v in value
        )
    return value
