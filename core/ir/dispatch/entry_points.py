"""The eager hot path: per-op generated functions that look a decision up and run its kernel.

Each op gets plain functions with its own parameters (no ``*args`` packing): a call costs a
tracing check, a cache lookup (`vllm_ir.ir.dispatch.decision_cache`, keyed as `vllm_ir.ir.dispatch.cache_key`
says) and the kernel call; predicates run only on a miss (`vllm_ir.ir.dispatch.selection`). Where the
``vllm_ir.ir.dispatch._fast_lookup`` extension is built, one C call does the key and the lookup (and
remembers the last hit); the Python path here remains the reference and handles everything
it declines. While tracing or compiling, the same function calls the ``torch.ops.vllm_ir``
op instead, so graphs hold exactly one IR node per call.
"""

from __future__ import annotations

import inspect
import linecache
import logging
from collections.abc import Callable
from types import CodeType
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from vllm_ir.ir.dispatch import code_cache, fast_lookup
from vllm_ir.ir.dispatch.cache_key import bucket, first_token_count, freeze, tensor_facts
from vllm_ir.ir.dispatch.donation import precise_donation_conflict
from vllm_ir.ir.dispatch.observe import profiler_flag
from vllm_ir.ir.priority import current_scope, labelled_scope
from vllm_ir.settings.log import get_logger

if TYPE_CHECKING:
    from vllm_ir.ir.dispatch.decision_cache import DecisionCache
    from vllm_ir.ir.dispatch.selection import Decision
    from vllm_ir.ir.op import IrOp

_log = get_logger("dispatch")


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
    op: IrOp,
    cache: DecisionCache,
    torch_default: Callable[..., Any],
    torch_maybe_inplace: Callable[..., Any],
    lookup: Any | None,
) -> EntryPoints:
    """Generate ``op(...)``, ``op.maybe_inplace(...)`` and ``op.cached_dispatch(...)`` with the op's parameters.

    ``op(...)`` is returned as a method (first parameter the op itself) so that it can be
    the ``__call__`` of the op's class, which Dynamo inlines like any user method.

    The Python path below is the reference. With a compiled ``lookup`` over the op's decision
    dicts (``cache.lookup``, or None for the pure-Python path), the entry points first ask it for a cached
    decision and take the Python path only when it answers None; Python then stores new
    decisions under the compiled key so that both read one cache.

    Calls that are traced (torch.compile, make_fx, torch.fx.symbolic_trace, a dispatch mode)
    reach the torch op, so graphs record one IR node per call. Calls that need autograd
    (grad mode on and a tensor argument requires grad) reach the torch op's default overload,
    whose autograd formula is the native function's.
    """
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
        "_profiler": profiler_flag,
        "_labelled_scope": labelled_scope,
        "_cache": cache.decisions,
        "_fixed": cache.fixed,
        "_bad_arguments": lambda args: check_arguments(op, args),
        "_miss": cache.on_miss,
        "_kernel_choice": lambda args: cache.for_kernel(args).impl,
        "_aliased": lambda d, conflict, args: on_donation_conflict(op, d, conflict, args),
        "_conflict": conflict,
        "_donated": donated,
        "_tensors": tensors,
        "_torch_default": torch_default,
        "_with_autograd": lambda *args: with_autograd(op, torch_default, args),
        "_torch_maybe_inplace": torch_maybe_inplace,
        "_facts": tensor_facts,
        "_first_token_count": first_token_count,
        "_bucket": bucket,
        "_buckets": cache.bucket_cell,
        "_freeze": freeze,
        "_lookup": lookup.lookup if lookup is not None else None,
        "_compiled_key": lookup.key if lookup is not None else None,
    }
    signature = parameter_list(sig, env)
    call = ", ".join(names)
    relate = len(op.token_params) >= 2
    key_parts = ["_vi_scope"] + [_key_expr(op, name, relate) for name in names]
    prelude = f"_vi_lead = _first_token_count({', '.join(op.token_params)})" if relate else ""
    # A tuning table that chooses this op by token range puts the range bucket last (None: no bucket).
    counted = f"_first_token_count({', '.join(op.token_params)})" if op.token_params else "None"
    with_bucket = f"_vi_k if _buckets[0] is None else _vi_k + (_bucket(_buckets[0], {counted}),)"
    # Every source is generated first and compiled as one batch (`code_cache`: read back from
    # the per-user cache after the first process); then defined in order, each function's
    # globals holding those defined before it.
    generated = _Generated(op)
    generated.add(
        "python_key",
        "_python_key",
        _guarded(
            "_python_key",
            f"_vi_scope, {call}",
            with_bucket,
            call,
            "\n        ".join(filter(None, (prelude, f"_vi_k = ({', '.join(key_parts)},)"))),
        ),
    )
    generated.add("needs_grad", "_needs_grad", _guarded("_needs_grad", call, _needs_grad_expr(op), call))
    key = f"_python_key(_vi_scope, {call})"
    if lookup is not None:
        key = f"_compiled_key(_vi_scope, {call}) or {key}"
        generated.add("key", "_key", f"def _key(_vi_scope, {call}):\n    return {key}\n")
    tails = {
        "functional": f"    _vi_d.calls += 1\n    return _vi_d.functional({call})\n",
        "maybe_inplace": (
            f"    _vi_d.calls += 1\n"
            f"    if _vi_d.guard_donation:\n"
            f"        _vi_c = _conflict(_donated, _tensors, {call})\n"
            f"        if _vi_c is not None:\n"
            f"            return _aliased(_vi_d, _vi_c, ({call},))\n"
            f"    return _vi_d.maybe_inplace({call})\n"
        ),
        "which": "    return _vi_d.impl\n",
    }
    reroutes = {
        "functional": ("_torch_default", "_with_autograd"),
        "maybe_inplace": ("_torch_maybe_inplace", "_with_autograd"),
        "which": ("_kernel_choice", "_kernel_choice"),
    }
    overloads = (
        ("default", "_op_self, ", "functional"),
        ("maybe_inplace", "", "maybe_inplace"),
        ("cached_dispatch", "_op_self, ", "which"),
    )
    for overload, head, runner in overloads:
        traced, grad = reroutes[runner]
        if runner == "which":
            traced, grad = f"{traced}(({call},))", f"{grad}(({call},))"
        else:
            traced, grad = f"{traced}({call})", f"{grad}({call})"
        if lookup is None:
            generated.add(
                overload, op.name, _python_path(op.name, head + signature, call, key, traced, grad, tails[runner])
            )
            continue
        generated.add(
            f"{overload}.python", op.name, _python_path(op.name, signature, call, key, traced, grad, tails[runner])
        )
        generated.add(overload, op.name, _fast_path(op.name, head + signature, call, traced, tails[runner]))
    generated.compile()
    env["_python_key"] = generated.define("python_key", env)
    env["_needs_grad"] = generated.define("needs_grad", env)
    key_function = env["_python_key"] if lookup is None else generated.define("key", env)
    entries = []
    for overload, _head, _runner in overloads:
        if lookup is None:
            entries.append(generated.define(overload, env))
        else:
            python_path = generated.define(f"{overload}.python", env)
            entries.append(generated.define(overload, dict(env, _python_path=python_path)))
    return EntryPoints(entries[0], entries[1], entries[2], key_function)


def parameter_list(sig: inspect.Signature, env: dict[str, Any]) -> str:
    """``"x, weight, epsilon, variance_size=_default_3"``: the parameters of generated code with
    the op's defaults, which it puts into ``env`` (the generated functions' globals)."""
    params = []
    for i, p in enumerate(sig.parameters.values()):
        if p.default is inspect.Parameter.empty:
            params.append(p.name)
        else:
            env[f"_default_{i}"] = p.default
            params.append(f"{p.name}=_default_{i}")
    return ", ".join(params)


def build_unrunnable(op: IrOp, provider: str) -> Callable[..., Any]:
    """A stand-in kernel with the op's parameters for `IrOp.register_unsupported`: unsupported
    implementations are never dispatched, so calling it is a bug."""
    env: dict[str, Any] = {}
    source = (
        f"def {op.name}({parameter_list(op.signature, env)}):\n"
        f"    raise AssertionError('op {op.name}: provider {provider} is unsupported here and never dispatched')\n"
    )
    return _define(op, f"unsupported.{provider}", op.name, source, env)


def _guarded(fn_name: str, params: str, expr: str, call: str, prelude: str = "") -> str:
    """A generated helper that names the argument of the wrong type instead of an AttributeError."""
    return (
        f"def {fn_name}({params}):\n"
        f"    try:\n" + (f"        {prelude}\n" if prelude else "") + f"        return {expr}\n"
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
        f"    _vi_scope = _scope()\n"
        f"    if _profiler._is_profiler_enabled:\n"
        f"        _vi_scope = _labelled_scope(_vi_scope)\n"
        f"    _vi_d = _fixed.get(_vi_scope)\n"
        f"    if _vi_d is None:\n"
        f"        _vi_key = {key}\n"
        f"        _vi_d = _cache.get(_vi_key)\n"
        f"        if _vi_d is None:\n"
        f"            _vi_d = _miss(_vi_key, ({call},))\n" + tail
    )


def _fast_path(name: str, signature: str, call: str, traced: str, tail: str) -> str:
    # Dynamo folds is_dynamo_compiling() to True; the other tracers run a dispatch mode or
    # pass non-tensors, calls needing autograd have a tensor that requires grad: for all of
    # them the compiled lookup answers None and the Python path routes to the torch op.
    return (
        f"def {name}({signature}):\n"
        f"    if _is_dynamo_compiling():\n"
        f"        return {traced}\n"
        f"    _vi_d = _lookup({call})\n"
        f"    if _vi_d is None:\n"
        f"        return _python_path({call})\n" + tail
    )


class _Generated:
    """The generated functions of one op, compiled as one batch and then defined one by one."""

    def __init__(self, op: IrOp):
        self.op = op
        #: ``what`` -> (function name, file name, source), in the order added.
        self.units: dict[str, tuple[str, str, str]] = {}
        self.codes: dict[str, CodeType] = {}

    def add(self, what: str, fn_name: str, source: str) -> None:
        self.units[what] = (fn_name, f"<vllm_ir.ops.{self.op.name}.{what}>", source)

    def compile(self) -> None:
        batch = [(filename, source) for _fn_name, filename, source in self.units.values()]
        self.codes = dict(zip(self.units, code_cache.compile_all(batch), strict=True))

    def define(self, what: str, env: dict[str, Any]) -> Callable[..., Any]:
        fn_name, _filename, source = self.units[what]
        return _define(self.op, what, fn_name, source, env, self.codes[what])


def _define(
    op: IrOp, what: str, fn_name: str, source: str, env: dict[str, Any], code: CodeType | None = None
) -> Callable[..., Any]:
    """Define one generated function (compiled from ``source`` unless its ``code`` is given);
    ``what`` names it in tracebacks and profiles.

    The source is registered with `linecache`, so tracebacks, ``inspect.getsource`` and
    debuggers show the generated code.
    """
    filename = f"<vllm_ir.ops.{op.name}.{what}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace = dict(env)
    exec(code if code is not None else code_cache.compile_fresh(filename, source), namespace)
    fn = namespace[fn_name]
    fn.__qualname__ = op.name if what == "default" else f"{op.name}.{what}"
    fn.__doc__ = op.fn.__doc__
    return fn


def with_autograd(op: IrOp, torch_default: Callable[..., Any], args: tuple) -> Any:
    """A call that needs gradients: the torch op, whose autograd formula is native's vector-
    Jacobian product around whichever kernel runs forward. Under torch.func transforms (which
    cannot run a custom op's autograd formula) the native function itself, which they differentiate."""
    if torch._C._are_functorch_transforms_active():
        return op.fn(*args)
    return torch_default(*args)


def check_arguments(op: IrOp, args: tuple) -> None:
    """Name the argument that is not a tensor where the op expects one."""
    for (name, optional), i in zip(op.tensor_params.items(), op.tensor_param_indices, strict=True):
        value = args[i]
        if value is None and optional:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"op {op.name!r}: argument {name!r} must be a Tensor, got {type(value).__name__}")


def _key_expr(op: IrOp, name: str, relate_tokens: bool) -> str:
    optional = op.tensor_params.get(name)
    if optional is None:
        return f"_freeze({name})" if name in op.list_params else name
    token = name in op.token_params
    facts = f"_facts({name}, True, _vi_lead)" if token and relate_tokens else f"_facts({name}, {token})"
    return f"None if {name} is None else {facts}" if optional else facts


def _needs_grad_expr(op: IrOp) -> str:
    parts = []
    for name, optional in op.tensor_params.items():
        parts.append(f"({name} is not None and {name}.requires_grad)" if optional else f"{name}.requires_grad")
    for name in op.list_params:
        parts.append(f"any(getattr(v, 'requires_grad', False) for v in {name})")
    return " or ".join(parts) or "False"


def on_donation_conflict(op: IrOp, decision: Decision, conflict: tuple[int, int], args: tuple) -> Any:
    """A ``maybe_inplace`` call whose donated input overlaps itself or another argument runs
    the functional path: an in-place kernel would read what it already overwrote.

    The quick check compares byte ranges; here the conflict is refined first (column slices
    of one tensor, such as q and k split from qkv, share a range but no element) and a call
    whose tensors are provably disjoint runs in place after all.
    """
    refined = precise_donation_conflict(op.activation_indices, op.tensor_param_indices, args)
    if refined is None:
        return decision.maybe_inplace(*args)
    conflict = refined
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
