"""Signature checks done once at registration, never per call.

The torch schema inferred from a function's annotations is the single description of an
op's calling convention: the op, the torch library definition and every implementation are
compared through it, so "same signature" means what the dispatcher and the compiler see.
"""

from __future__ import annotations

import inspect
import re
import types
import weakref
from collections.abc import Callable
from typing import Any, get_args, get_origin

import torch

from vllm_ir.errors import RegistrationError

#: Op and provider names: lowercase identifiers, as priority lists, env vars, torch.library
#: and vLLM's own IR accept them.
NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
_REFUSED_KINDS = {
    inspect.Parameter.KEYWORD_ONLY: "keyword-only",
    inspect.Parameter.VAR_POSITIONAL: "*args",
    inspect.Parameter.VAR_KEYWORD: "**kwargs",
    inspect.Parameter.POSITIONAL_ONLY: "positional-only",
}


#: `signature_of`'s results: function -> (the state they were computed from, signature).
_signatures: weakref.WeakKeyDictionary[Callable[..., Any], tuple[tuple[object, ...], inspect.Signature]] = (
    weakref.WeakKeyDictionary()
)


def signature_of(fn: Callable[..., Any]) -> inspect.Signature:
    """``inspect.signature(fn, eval_str=True)``, computed once per function while it is unchanged.

    Registering one implementation reads its kernel's and predicate's signatures three or four
    times (the kernel forms, the parameter check, the schema), each evaluating every string
    annotation again. A plain function's signature follows from its code, defaults,
    annotations and a ``__signature__`` or ``__wrapped__`` set on it: the result is reused while
    each of those is the very object it was computed from (the names its annotations evaluate to
    in its module are taken to stay bound as they were). Other callables are inspected each time.
    """
    if type(fn) is not types.FunctionType:
        return inspect.signature(fn, eval_str=True)
    extra = fn.__dict__
    annotations = fn.__annotations__
    state = (
        fn.__code__,
        fn.__defaults__,
        fn.__kwdefaults__,
        annotations,
        *annotations.values(),
        extra.get("__signature__"),
        extra.get("__wrapped__"),
    )
    known = _signatures.get(fn)
    if known is not None and len(known[0]) == len(state) and all(a is b for a, b in zip(known[0], state, strict=True)):
        return known[1]
    sig = inspect.signature(fn, eval_str=True)
    _signatures[fn] = (state, sig)
    return sig


def check_op_name(name: str) -> None:
    if not isinstance(name, str) or not NAME.match(name):
        raise RegistrationError(
            f"invalid op name {name!r}: op names must be lowercase Python identifiers "
            "(letters a-z, digits, underscores; not starting with a digit)",
            op=str(name),
        )


def check_parameters(fn: Callable[..., Any], *, op: str, provider: str | None, what: str) -> inspect.Signature:
    """Refuse parameter kinds a torch schema cannot express positionally."""
    try:
        sig = signature_of(fn)
    except NameError as exc:
        raise RegistrationError(
            f"{_who(op, provider)}: cannot resolve the annotations of {what}: {exc}", op=op, provider=provider
        ) from exc
    for p in sig.parameters.values():
        if p.kind in _REFUSED_KINDS:
            raise RegistrationError(
                f"{_who(op, provider)}: {what} has {_REFUSED_KINDS[p.kind]} parameter {p.name!r}; "
                "IR ops take plain positional-or-keyword parameters only",
                op=op,
                provider=provider,
            )
    return sig


def infer_schema(fn: Callable[..., Any], *, op: str, provider: str | None, what: str) -> str:
    """The torch schema string of ``fn`` (without the op name), with a vllm-ir error on failure.

    Beyond what ``torch.library.infer_schema`` accepts, a returned tuple may hold optional
    tensors (``tuple[Tensor, Tensor | None]`` -> ``(Tensor, Tensor?)``): the dispatcher,
    fake tensors, autograd, AOTAutograd and Inductor all handle ``Tensor?`` returns, which
    lets an op with an optional tensor input return None for it (``rotary_embedding``'s key).
    """
    try:
        optional = _optional_tensor_returns(fn)
        if not optional:
            return torch.library.infer_schema(fn, mutates_args=())
        schema = torch.library.infer_schema(_with_return(fn, optional), mutates_args=())
        return _mark_optional_returns(schema, optional)
    except (ValueError, TypeError) as exc:
        raise RegistrationError(
            f"{_who(op, provider)}: cannot infer a torch schema from {what}: {exc}. "
            "Annotate every parameter and the return value with torch-compatible types "
            "(Tensor, Tensor | None, float, int, bool, list[int], tuple[Tensor, Tensor], ...)",
            op=op,
            provider=provider,
        ) from exc


def _optional_tensor_returns(fn: Callable[..., Any]) -> tuple[int, ...]:
    """Positions of ``Tensor | None`` elements in ``fn``'s returned tuple (empty: nothing to adapt)."""
    ret = signature_of(fn).return_annotation
    if get_origin(ret) is not tuple:
        return ()
    return tuple(i for i, a in enumerate(get_args(ret)) if _is_optional_tensor(a))


def _is_optional_tensor(annotation: object) -> bool:
    args = get_args(annotation)
    return len(args) == 2 and torch.Tensor in args and type(None) in args


def _with_return(fn: Callable[..., Any], optional: tuple[int, ...]) -> Callable[..., Any]:
    """A stand-in with ``fn``'s parameters whose returned tuple has ``Tensor`` at ``optional``."""
    sig = signature_of(fn)
    elements = [torch.Tensor if i in optional else a for i, a in enumerate(get_args(sig.return_annotation))]

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("never called")

    stand_in.__signature__ = sig.replace(return_annotation=tuple[tuple(elements)])  # type: ignore[attr-defined]
    return stand_in


def _mark_optional_returns(schema: str, optional: tuple[int, ...]) -> str:
    """``(...) -> (Tensor, Tensor)`` with the returns at ``optional`` made ``Tensor?``."""
    params, sep, returns = schema.rpartition(" -> ")
    if not (sep and returns.startswith("(") and returns.endswith(")")):
        raise ValueError(f"unexpected schema {schema!r}")
    types = returns[1:-1].split(", ")
    for i in optional:
        if types[i] != "Tensor":
            raise ValueError(f"return {i} of {schema!r} is {types[i]}, expected Tensor")
        types[i] = "Tensor?"
    return f"{params} -> ({', '.join(types)})"


def tensor_parameters(sig: inspect.Signature) -> dict[str, bool]:
    """Map each Tensor-typed parameter name to whether it may be None."""
    out: dict[str, bool] = {}
    for p in sig.parameters.values():
        ann = p.annotation
        if ann is torch.Tensor:
            out[p.name] = False
        elif torch.Tensor in get_args(ann) and type(None) in get_args(ann):
            out[p.name] = True
    return out


def is_tensor_list(annotation: object) -> bool:
    return get_origin(annotation) in (list, tuple) and torch.Tensor in get_args(annotation)


def check_same_schema(op_schema: str, impl_schema: str, *, op: str, provider: str) -> None:
    if op_schema == impl_schema:
        return
    raise RegistrationError(
        f"{_who(op, provider)}: implementation signature does not match the op.\n"
        f"  op expects:          {op_schema}\n"
        f"  implementation has:  {impl_schema}\n"
        "Parameter names, types, defaults and the return type must be identical.",
        op=op,
        provider=provider,
    )


def check_predicate_signature(pred: Callable[..., Any], op_sig: inspect.Signature, *, op: str, provider: str) -> None:
    """``supports_args`` must take the op's parameters: same names, same defaults."""
    if not callable(pred):
        raise RegistrationError(
            f"{_who(op, provider)}: supports_args must be callable, got {type(pred).__name__}",
            op=op,
            provider=provider,
        )
    sig = check_parameters(pred, op=op, provider=provider, what="supports_args")
    check_same_parameters(sig, op_sig, op=op, provider=provider, what="supports_args")


def is_unannotated(sig: inspect.Signature) -> bool:
    """No parameter and no return annotation: the function takes the op's own signature."""
    return sig.return_annotation is inspect.Signature.empty and all(
        p.annotation is inspect.Parameter.empty for p in sig.parameters.values()
    )


def check_same_parameters(
    sig: inspect.Signature, op_sig: inspect.Signature, *, op: str, provider: str, what: str
) -> None:
    """``sig`` takes the op's parameters: same names, same defaults, in order."""
    want = [(p.name, p.default) for p in op_sig.parameters.values()]
    have = [(p.name, p.default) for p in sig.parameters.values()]
    if want != have:
        raise RegistrationError(
            f"{_who(op, provider)}: {what} must take the op's parameters with the same "
            f"names and defaults.\n  op expects:    {_fmt(want)}\n  {what + ':':<14} {_fmt(have)}",
            op=op,
            provider=provider,
        )


def _fmt(params: list[tuple[str, object]]) -> str:
    parts = [n if d is inspect.Parameter.empty else f"{n}={d!r}" for n, d in params]
    return "(" + ", ".join(parts) + ")"


def _who(op: str, provider: str | None) -> str:
    return f"op {op!r}" if provider is None else f"op {op!r}, provider {provider!r}"
