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
import linecache
import logging
import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from vllm_ir.errors import FallbackError, FallbackWarning, PredicateError, ProviderWarning
from vllm_ir.ir import priority as _priority
from vllm_ir.ir.cache_key import freeze, tensor_facts
from vllm_ir.ir.impl import IrOpImpl, Unsupported, reason_of
from vllm_ir.ir.priority import EntryStatus, Mode, PriorityLayer, current_scope
from vllm_ir.log import get_logger

if TYPE_CHECKING:
    from vllm_ir.ir.op import IrOp

_log = get_logger("dispatch")

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
    #: ``maybe_inplace`` runs an in-place kernel: check each call's donated inputs for overlaps.
    guard_donation: bool = False
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
    """Run an implementation's predicate and insist on a bool or an `Unsupported`.

    A predicate that raises or returns anything else is a provider bug: it is recorded
    (`predicate_errors`, explain, ``vllm-ir doctor``), warned about once, and the provider
    is skipped with the error as its reason; ``VLLM_IR_FALLBACK=error`` raises instead.
    """
    if impl.supports_args is None:
        return True
    try:
        verdict = impl.supports_args(*args)
    except Exception as exc:
        return _predicate_failed(impl, f"supports_args raised {type(exc).__name__}: {exc}", exc)
    if verdict is True or verdict is False or isinstance(verdict, Unsupported):
        return verdict
    return _predicate_failed(
        impl,
        f"supports_args returned {type(verdict).__name__} {verdict!r}; it must return True, False or "
        "vllm_ir.Unsupported(reason) and must not depend on tensor values or batch size",
        None,
    )


#: (op, provider) -> what its predicate did wrong (the latest), for explain and doctor.
_predicate_errors: dict[tuple[str, str], str] = {}


def predicate_errors() -> dict[tuple[str, str], str]:
    """Predicates that raised or returned garbage: ``{(op, provider): description}``."""
    return dict(_predicate_errors)


def _predicate_failed(impl: IrOpImpl, problem: str, exc: BaseException | None) -> Unsupported:
    message = f"op {impl.op_name!r}, provider {impl.provider!r}: {problem}"
    if _priority.settings().fallback == "error":
        raise PredicateError(message + " [VLLM_IR_FALLBACK=error]") from exc
    key = (impl.op_name, impl.provider)
    if key not in _predicate_errors:
        _log.warning("%s; the provider is skipped", message, exc_info=exc)
        warnings.warn(
            f"{message}; the provider is skipped for such calls (a bug in the provider; shown once)",
            ProviderWarning,
            stacklevel=_user_stacklevel(),
        )
    _predicate_errors[key] = problem
    return Unsupported(f"predicate error: {problem}")


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
    guard = impl.inplace and bool(op.activation_indices)
    return Decision(impl, skipped, cacheable, functional=functional, maybe_inplace=fn, guard_donation=guard)


def on_donation_conflict(op: IrOp, decision: Decision, conflict: tuple[int, int], args: tuple) -> Any:
    """A ``maybe_inplace`` call whose donated input overlaps itself or another argument runs
    the functional path: an in-place kernel would read what it already overwrote."""
    if _log.isEnabledFor(logging.DEBUG):
        names = list(op.signature.parameters)
        i, j = conflict
        what = "overlaps itself" if i == j else f"shares memory with {names[j]!r}"
        _log.debug(
            "op %s.maybe_inplace: donated argument %r %s; %s runs on copies instead of in place",
            op.name,
            names[i],
            what,
            decision.provider,
        )
    return decision.functional(*args)


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
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug(
            "op %s: chose %s for %s%s%s",
            op.name,
            decision.provider,
            describe_call(op, args),
            "".join(f"; {p} declined: {r}" for p, r in decision.skipped),
            "" if decision.cacheable else " (not cached: a predicate registered with cacheable=False)",
        )
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


def describe_call(op: IrOp, args: Sequence[Any]) -> str:
    """``x=bfloat16[16, 4096] weight=None epsilon=1e-06``: a call's arguments for log lines."""
    parts = []
    for name, value in zip(op.signature.parameters, args, strict=False):
        if isinstance(value, torch.Tensor):
            value = f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}@{value.device}"
        parts.append(f"{name}={value}")
    return " ".join(parts)


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
    _predicate_errors.clear()
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
    #: ``op.cached_dispatch(...)``, as a method: the implementation a call would run, read
    #: through the same cache as the two entry points above.
    which: Callable[..., Any]
    #: ``key(scope, *args)``: the decision-cache key of a call (compiled where possible).
    key: Callable[..., Any]


def build_entry_points(
    op: IrOp, torch_default: Callable[..., Any], torch_maybe_inplace: Callable[..., Any], lookup: Any | None
) -> EntryPoints:
    """Generate ``op(...)``, ``op.maybe_inplace(...)`` and ``op.cached_dispatch(...)`` with the op's parameters.

    ``op(...)`` is returned as a method (first parameter the op itself) so that it can be
    the ``__call__`` of the op's class, which Dynamo inlines like any user method.

    The Python path below is the reference. With a compiled ``lookup`` over the op's decision
    dicts (`vllm_ir.ir.fast_lookup.make_lookup`), the entry points first ask it for a cached
    decision and take the Python path only when it answers None; Python then stores new
    decisions under the compiled key so that both read one cache.

    Calls that are traced (torch.compile, make_fx, torch.fx.symbolic_trace, a dispatch mode)
    reach the torch op, so graphs record one IR node per call. Calls that need autograd
    (grad mode on and a tensor argument requires grad) reach the torch op's default overload,
    whose autograd formula is the native function's.
    """
    from vllm_ir.ir import fast_lookup

    sig = op.signature
    names = list(sig.parameters)
    conflict, donated, tensors = fast_lookup.donation_conflict_checker(op)
    env: dict[str, Any] = {
        "_is_compiling": torch.compiler.is_compiling,
        "_is_dynamo_compiling": torch.compiler.is_dynamo_compiling,
        "_dispatch_stack": torch._C._len_torch_dispatch_stack,
        "_fx_tracing": torch.fx._symbolic_trace.is_fx_symbolic_tracing,
        "_grad_enabled": torch.is_grad_enabled,
        "_scope": current_scope,
        "_cache": op._decisions,
        "_fixed": op._fixed,
        "_bad_arguments": lambda args: check_arguments(op, args),
        "_miss": lambda key, args: on_miss(op, key, args),
        "_kernel_choice": lambda args: decide_cached(op, args).impl,
        "_aliased": lambda d, conflict, args: on_donation_conflict(op, d, conflict, args),
        "_conflict": conflict,
        "_donated": donated,
        "_tensors": tensors,
        "_torch_default": torch_default,
        "_torch_maybe_inplace": torch_maybe_inplace,
        "_facts": tensor_facts,
        "_freeze": freeze,
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
    env["_python_key"] = _define(
        op,
        "python_key",
        "_python_key",
        _guarded("_python_key", f"scope, {call}", f"({', '.join(key_parts)},)", call),
        env,
    )
    env["_needs_grad"] = _define(
        op, "needs_grad", "_needs_grad", _guarded("_needs_grad", call, _needs_grad_expr(op), call), env
    )
    key = f"_python_key(scope, {call})"
    key_function = env["_python_key"]
    if lookup is not None:
        key = f"_compiled_key(scope, {call}) or {key}"
        key_function = _define(op, "key", "_key", f"def _key(scope, {call}):\n    return {key}\n", env)
    signature = ", ".join(params)
    tails = {
        "functional": f"    d.calls += 1\n    return d.functional({call})\n",
        "maybe_inplace": (
            f"    d.calls += 1\n"
            f"    if d.guard_donation:\n"
            f"        c = _conflict(_donated, _tensors, {call})\n"
            f"        if c is not None:\n"
            f"            return _aliased(d, c, ({call},))\n"
            f"    return d.maybe_inplace({call})\n"
        ),
        "which": "    return d.impl\n",
    }
    reroutes = {
        "functional": ("_torch_default", "_torch_default"),
        "maybe_inplace": ("_torch_maybe_inplace", "_torch_default"),
        "which": ("_kernel_choice", "_kernel_choice"),
    }
    entries = []
    for overload, head, runner in (
        ("default", "_op_self, ", "functional"),
        ("maybe_inplace", "", "maybe_inplace"),
        ("cached_dispatch", "_op_self, ", "which"),
    ):
        traced, grad = reroutes[runner]
        if runner == "which":
            traced, grad = f"{traced}(({call},))", f"{grad}(({call},))"
        else:
            traced, grad = f"{traced}({call})", f"{grad}({call})"
        if lookup is None:
            source = _python_path(op.name, head + signature, call, key, traced, grad, tails[runner])
            entries.append(_define(op, overload, op.name, source, env))
            continue
        source = _python_path(op.name, signature, call, key, traced, grad, tails[runner])
        python_path = _define(op, f"{overload}.python", op.name, source, env)
        source = _fast_path(op.name, head + signature, call, traced, tails[runner])
        entries.append(_define(op, overload, op.name, source, dict(env, _python_path=python_path)))
    return EntryPoints(entries[0], entries[1], entries[2], key_function)


def _guarded(fn_name: str, params: str, expr: str, call: str) -> str:
    """A generated helper that names the argument of the wrong type instead of an AttributeError."""
    return (
        f"def {fn_name}({params}):\n"
        f"    try:\n"
        f"        return {expr}\n"
        f"    except (AttributeError, TypeError):\n"
        f"        _bad_arguments(({call},))\n"
        f"        raise\n"
    )


def _python_path(name: str, signature: str, call: str, key: str, traced: str, grad: str, tail: str) -> str:
    return (
        f"def {name}({signature}):\n"
        f"    if _is_compiling() or _dispatch_stack() or _fx_tracing():\n"
        f"        return {traced}\n"
        f"    if _grad_enabled() and _needs_grad({call}):\n"
        f"        return {grad}\n"
        f"    scope = _scope()\n"
        f"    d = _fixed.get(scope)\n"
        f"    if d is None:\n"
        f"        key = {key}\n"
        f"        d = _cache.get(key)\n"
        f"        if d is None:\n"
        f"            d = _miss(key, ({call},))\n" + tail
    )


def _fast_path(name: str, signature: str, call: str, traced: str, tail: str) -> str:
    # Dynamo folds is_dynamo_compiling() to True; the other tracers run a dispatch mode or
    # pass non-tensors, calls needing autograd have a tensor that requires grad: for all of
    # them the compiled lookup answers None and the Python path routes to the torch op.
    return (
        f"def {name}({signature}):\n"
        f"    if _is_dynamo_compiling():\n"
        f"        return {traced}\n"
        f"    d = _lookup({call})\n"
        f"    if d is None:\n"
        f"        return _python_path({call})\n" + tail
    )


def _define(op: IrOp, what: str, fn_name: str, source: str, env: dict[str, Any]) -> Callable[..., Any]:
    """Compile one generated function; ``what`` names it in tracebacks and profiles.

    The source is registered with `linecache`, so tracebacks, ``inspect.getsource`` and
    debuggers show the generated code.
    """
    filename = f"<vllm_ir.ops.{op.name}.{what}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace = dict(env)
    exec(compile(source, filename, "exec"), namespace)
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
    if optional is None:
        return f"_freeze({name})" if name in op.list_params else name
    facts = f"_facts({name}, {name in op.token_params})"
    return f"None if {name} is None else {facts}" if optional else facts


def _needs_grad_expr(op: IrOp) -> str:
    parts = []
    for name, optional in op.tensor_params.items():
        parts.append(f"({name} is not None and {name}.requires_grad)" if optional else f"{name}.requires_grad")
    for name in op.list_params:
        parts.append(f"any(getattr(v, 'requires_grad', False) for v in {name})")
    return " or ".join(parts) or "False"
