"""What a kernel owes its caller, checked where it is cheap.

A provider's kernel must return what the op's native function returns for the same call:
as many tensors, each with native's dtype, shape and device; and the default overload owes
fresh tensors (no output may share memory with an input unless native's does). A kernel that
breaks this -- returns ``None`` (an unfinished ``...`` body), a tuple of the wrong length, a
float32 result for a bf16 call, its input back -- would hand the caller a wrong answer or fail
far from the cause. `check_result` names the op, the provider and the mismatch instead.

Eager dispatch checks the first call of each decision (`checked_once`), never the calls
answered from the cache after it; lowering checks every traced kernel on fake values; the
conformance kit checks every case it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from vllm_ir.errors import KernelResultError

if TYPE_CHECKING:
    from vllm_ir.ir.impl import IrOpImpl
    from vllm_ir.ir.op import IrOp


def _flat(value: Any) -> list[Any] | None:
    """The outputs of a result as a list (``None`` for a lone non-tensor result)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return list(value)
    return None


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)} on {value.device}"
    return type(value).__name__ if value is not None else "None"


#: Calls this small (elements over all tensor arguments) get native's result from a real run.
REAL_RUN_ELEMENTS = 1 << 22


def expected_result(op: IrOp, args: Sequence[Any]) -> Any | None:
    """Native's result for ``args`` (its metadata is what counts), or None where native cannot run
    on them: then only the result's structure is checked.

    A small call runs native itself: a fake tensor mode (or a meta kernel written in Python)
    imports torch._dynamo, seconds that the first eager call of every process would pay. A large
    call runs native on fake tensors, so that no activation-sized memory is allocated twice."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    small = sum(t.numel() for t in tensors) <= REAL_RUN_ELEMENTS
    if small and all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout is torch.strided for t in tensors):
        try:
            with torch.no_grad():
                return _FakeResult(op.fn(*args), list(args))
        except Exception:
            return None
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            out = op.fn(*fakes)
    except Exception:
        return None
    return _FakeResult(out, fakes)


class _FakeResult:
    """Native's outputs (real or fake: only their metadata is read), and which of them are (views of) its inputs."""

    def __init__(self, out: Any, fake_args: list[Any]):
        self.outputs = _flat(out)
        storages = {a.untyped_storage()._cdata for a in fake_args if isinstance(a, torch.Tensor)}
        self.aliased = [
            isinstance(o, torch.Tensor) and o.untyped_storage()._cdata in storages for o in (self.outputs or [])
        ]


def check_result(
    op: IrOp, impl: IrOpImpl, result: Any, args: Sequence[Any], *, functional: bool, expected: Any | None = None
) -> bool:
    """Raise `KernelResultError` if ``result`` is not the kind of result ``op`` owes for ``args``.

    Returns whether the check was conclusive: False when native's result could not be computed
    on fake tensors or an output is empty (an alias of an empty tensor cannot be seen).

    :param functional: the default overload ran (outputs must not alias inputs native's don't);
        False for ``maybe_inplace``, whose kernel may return its donated activations.
    :param expected: `expected_result` for ``args``, when the caller has it already.
    """
    who = f"op {op.name!r}, provider {impl.provider!r}"
    want = expected if expected is not None else expected_result(op, args)
    outputs = _flat(result)
    known = want is not None and want.outputs is not None
    # A tuple may hold None where native's does (e.g. no residual); nothing else but tensors.
    allowed = [o is None for o in want.outputs] if known and outputs is not None else None
    if outputs is None or not all(
        isinstance(o, torch.Tensor) or (o is None and (allowed is None or (i < len(allowed) and allowed[i])))
        for i, o in enumerate(outputs)
    ):
        got = _describe(result) if outputs is None else ", ".join(_describe(o) for o in outputs)
        native = ", ".join(_describe(o) for o in want.outputs) if known else None
        expected = f"native returns {native}" if native else "expected a tensor or a tuple of tensors"
        raise KernelResultError(f"{who}: the kernel returned {got}; {expected}")
    if not known:
        if functional:
            _check_fresh(who, list(op.signature.parameters), outputs, [False] * len(outputs), args)
        return False
    if len(outputs) != len(want.outputs):
        raise KernelResultError(
            f"{who}: the kernel returned {len(outputs)} output(s), native returns {len(want.outputs)}"
        )
    for i, (got, exp) in enumerate(zip(outputs, want.outputs, strict=True)):
        what = f"output {i}" if len(outputs) > 1 else "the output"
        if (got is None) != (exp is None):
            raise KernelResultError(f"{who}: {what} is {_describe(got)}, native's is {_describe(exp)}")
        if got is None:
            continue
        if got.dtype != exp.dtype or _shapes_differ(got, exp) or got.device.type != exp.device.type:
            raise KernelResultError(f"{who}: {what} is {_describe(got)}, native's is {_describe(exp)}")
    if functional:
        _check_fresh(who, list(op.signature.parameters), outputs, want.aliased, args)
    return all(o.numel() for o in outputs if o is not None)


def _shapes_differ(got: torch.Tensor, exp: torch.Tensor) -> bool:
    """Provably different shapes (symbolic sizes are compared without adding guards)."""
    if got.dim() != exp.dim():
        return True
    sizes = (*got.shape, *exp.shape)
    if all(type(n) is int for n in sizes):  # no import of the symbolic-shapes machinery for eager calls
        return tuple(got.shape) != tuple(exp.shape)
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return any(statically_known_true(a != b) for a, b in zip(got.shape, exp.shape, strict=True))


def check_traced(op: IrOp, impl: IrOpImpl, traced: Any, expected: Any) -> None:
    """Under compile: the fake result of a traced kernel against the IR node's (``node.meta["val"]``)."""
    want = _FakeResult(expected, [])
    check_result(op, impl, traced, (), functional=False, expected=want)


def _check_fresh(
    who: str, names: list[str], outputs: list[torch.Tensor | None], native_aliases: list[bool], args: Sequence[Any]
) -> None:
    """The default overload owes fresh outputs: none may share memory with an argument (where native's doesn't)."""
    inputs = {
        a.untyped_storage().data_ptr(): i
        for i, a in enumerate(args)
        if isinstance(a, torch.Tensor) and a.numel() and a.device.type != "meta"
    }
    for i, (out, native_alias) in enumerate(zip(outputs, native_aliases, strict=True)):
        if native_alias or out is None or not out.numel() or out.device.type == "meta":
            continue
        if out.untyped_storage().data_ptr() in inputs:
            what = f"output {i}" if len(outputs) > 1 else "the output"
            raise KernelResultError(
                f"{who}: {what} shares memory with argument {names[inputs[out.untyped_storage().data_ptr()]]!r} "
                "where op(...) owes a fresh tensor (register the kernel with inplace=True if it writes its inputs)"
            )


def checked_once(
    op: IrOp, impl: IrOpImpl, runner: Callable[..., Any], *, functional: bool, settle: Callable[[], None]
) -> Callable[..., Any]:
    """``runner`` behind a check of its results until one check is conclusive; ``settle()`` then
    swaps the plain runner in. A decision covers every call its cache key matches (for a provider
    without a predicate, every call in a priority scope), so this is a first-call check, not a
    per-call one; the conformance kit checks every case.

    A result that fails the check raises `KernelResultError` and does not settle, so every
    later call of that decision raises the same way rather than returning garbage.
    """

    def first_call(*args: Any) -> Any:
        result = runner(*args)
        try:
            conclusive = check_result(op, impl, result, args, functional=functional)
        except KernelResultError:
            raise
        except Exception:  # tensors without storage (vmap's batched tensors, ...): no verdict here
            conclusive = False
        if conclusive:
            settle()
        return result

    return first_call
