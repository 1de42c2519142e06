"""Choosing an implementation for a call: the priority walk, predicate verdicts, ``explain``.

This is the reference every fast path answers like: `decide` walks the effective priority
and returns the first implementation whose predicate accepts the call. The eager hot path
caches its answers (`vllm_ir.ir.dispatch.decision_cache`), lowering asks it on fake values.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm_ir.errors import PredicateError, ProviderWarning
from vllm_ir.ir import priority as _priority
from vllm_ir.ir import results, tuning
from vllm_ir.ir.dispatch import observe
from vllm_ir.ir.impl import NATIVE, IrOpImpl, Unsupported, reason_of
from vllm_ir.ir.priority import EntryStatus, Mode, PriorityLayer, current_scope
from vllm_ir.settings import env
from vllm_ir.settings.log import get_logger

if TYPE_CHECKING:
    from vllm_ir.ir.op import IrOp

_log = get_logger("dispatch")


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
    #: What the tuning layer said for this call: the measurement behind its entry and the
    #: range the call's token count falls in, or why no entry applies (None: no table names the op).
    tuning: str | None = None

    def __str__(self) -> str:
        rows = [(v.provider, v.status, v.source, v.reason or "") for v in self.verdicts]
        widths = [max(len(r[i]) for r in [*rows, ("provider", "verdict", "from", "")]) for i in range(3)]
        lines = [f"{self.op} ({self.mode}): chose {self.chosen}"]
        lines.append(f"  {'provider':<{widths[0]}}  {'verdict':<{widths[1]}}  {'from':<{widths[2]}}  reason")
        for r in rows:
            lines.append(f"  {r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip())
        if self.tuning:
            lines.append(f"  tuning: {self.tuning}")
        return "\n".join(lines)


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


def forget_predicate_errors() -> None:
    _predicate_errors.clear()


def _predicate_failed(impl: IrOpImpl, problem: str, exc: BaseException | None) -> Unsupported:
    message = f"op {impl.op_name!r}, provider {impl.provider!r}: {problem}"
    key = (impl.op_name, impl.provider)
    first = key not in _predicate_errors
    _predicate_errors[key] = problem
    if _priority.settings().fallback == "error":
        raise PredicateError(message + " [VLLM_IR_FALLBACK=error]") from exc
    if first:
        _log.warning("%s; the provider is skipped", message, exc_info=exc)
        warnings.warn(
            f"{message}; the provider is skipped for such calls (a bug in the provider; shown once)",
            ProviderWarning,
            stacklevel=env.user_stacklevel(),
        )
    return Unsupported(f"predicate error: {problem}")


def decide(op: IrOp, args: Sequence[Any], mode: Mode = "eager", scope: Any = None) -> Decision:
    """Walk the effective priority for ``args`` and return the first implementation that accepts."""
    skipped: list[tuple[str, str]] = []
    cacheable = True
    tuned = tuning.context(op, args, mode)
    for impl, _entry in _priority.resolve(op, mode, scope, tuned and tuned.entry).candidates:
        if impl.supports_args is not None:
            cacheable = cacheable and impl.cacheable
        verdict = ask(impl, args)
        if verdict:
            decision = make_decision(op, impl, tuple(skipped), cacheable)
            if mode == "eager" and scope is not None and scope.observed:
                decision = observe.observed(op, decision, traced=scope.traced, labelled=scope.labelled)
            return decision
        skipped.append((impl.provider, reason_of(verdict, "declined by supports_args")))
    raise AssertionError(f"op {op.name!r}: the native implementation must close every priority list")


def explain(op: IrOp, args: Sequence[Any], mode: Mode = "eager") -> Explanation:
    """Every provider of the effective priority with its verdict for ``args``."""
    tuned = tuning.context(op, args, mode)
    if tuned is None:
        tuned = tuning.choice(op, args, mode) if tuning.layer().ignored.get(op.name) else None
    resolved = _priority.resolve(op, mode, current_scope(), tuned and tuned.entry)
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
    note = None
    if tuned is not None:
        note = tuned.describe()
        if tuned.entry is not None and not any(
            v.layer is PriorityLayer.TUNING and v.provider == chosen for v in verdicts
        ):
            note += "; a higher layer or a declining predicate decided instead"
        elif tuned.entry is not None:
            note = "chosen by " + note
    return Explanation(op.name, mode, chosen, tuple(verdicts), note)


def make_decision(op: IrOp, impl: IrOpImpl, skipped: tuple[tuple[str, str], ...], cacheable: bool) -> Decision:
    """The runners of both overloads: a functional kernel as is, an in-place one behind clones
    for ``op(...)``; ``maybe_inplace`` runs the in-place kernel where there is one."""
    fn = impl.fn
    functional = fn
    if impl.inplace and op.activation_indices:
        functional = on_copies(fn, op.activation_indices)
    in_place = impl.inplace_fn or fn
    guard = impl.has_inplace_kernel and bool(op.activation_indices)
    decision = Decision(impl, skipped, cacheable, functional=functional, maybe_inplace=in_place, guard_donation=guard)
    if impl.provider != NATIVE:  # a kernel's first result is checked for the kind native returns
        decision.functional = results.checked_once(
            op, impl, functional, functional=True, settle=lambda: setattr(decision, "functional", functional)
        )
        decision.maybe_inplace = results.checked_once(
            op, impl, in_place, functional=False, settle=lambda: setattr(decision, "maybe_inplace", in_place)
        )
    return decision


def on_copies(fn: Callable[..., Any], indices: tuple[int, ...]) -> Callable[..., Any]:
    """``fn`` (an in-place kernel) run on fresh copies of the tensors at ``indices``: the default
    overload stays functional. Eager dispatch and lowering share it; traced, the copies are
    ``aten.clone`` nodes in front of the kernel, which clone cleanup may remove."""

    def with_copies(*args: Any) -> Any:
        args_list = list(args)
        for i in indices:
            if isinstance(args_list[i], torch.Tensor):
                args_list[i] = args_list[i].clone()
        return fn(*args_list)

    return with_copies


def describe_call(op: IrOp, args: Sequence[Any]) -> str:
    """``x=bfloat16[16, 4096] weight=None epsilon=1e-06``: a call's arguments for log lines."""
    parts = []
    for name, value in zip(op.signature.parameters, args, strict=False):
        if isinstance(value, torch.Tensor):
            value = f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}@{value.device}"
        parts.append(f"{name}={value}")
    return " ".join(parts)
