"""Kernels that report what ran: decisions of traced and profiled scopes run behind a recorder.

Nothing here is on the ordinary hot path. `vllm_ir.trace` and a running profiler switch the
call's priority scope (`vllm_ir.ir.priority.with_switches`), so their calls miss the usual
cached decisions and get decisions of their own, cached per scope and call signature: the plain
scope's decision for the call behind a wrapper made here where it exists (its kernels already
settled, `DecisionCache.on_miss`), else a new decision wrapped alike. With tracing off and no
profiler the hot path is unchanged.

A traced runner times the kernel (``perf_counter_ns``; CUDA events on a GPU, read when the
trace is summarised) and hands the call's facts to the active trace (`active`); a labelled
runner puts the kernel inside one ``record_function`` range, ``vllm_ir::rms_norm[vllm_c]``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any, Protocol

import torch

from vllm_ir.ir.cache_key import first_token_count

if TYPE_CHECKING:
    from vllm_ir.ir.op import IrOp
    from vllm_ir.ir.selection import Decision

#: The module whose ``_is_profiler_enabled`` flag torch's profilers set on start and clear on stop:
#: one attribute read, which the Python hot path can afford. (The C lookup asks this thread's
#: profiler state instead; a flag of the whole process only ever makes Python label more calls.)
profiler_flag = torch.autograd.profiler
_STRIDED = torch.strided


class Sink(Protocol):
    """What a traced runner reports to (`vllm_ir.trace.Trace`)."""

    def record(self, site: CallSite, args: tuple, start_ns: int, duration: Any) -> None: ...


#: The trace calls of this thread or task report to; None: the process trace, if any (`set_process_sink`).
active: contextvars.ContextVar[Sink | None] = contextvars.ContextVar("vllm_ir_trace", default=None)
_process_sink: list[Sink | None] = [None]


def set_process_sink(sink: Sink | None) -> None:
    """The trace of the whole process (``VLLM_IR_TRACE=1``), for calls outside any `vllm_ir.trace` block."""
    _process_sink[0] = sink


@dataclass(frozen=True, eq=False)  # hashed by identity: it keys the trace's rows on every call
class CallSite:
    """What a recorder knows before the call: the op, the decision and the runner's kernel form."""

    op: IrOp
    provider: str
    #: ``functional``, ``in-place``, or ``in-place on copies`` (an in-place kernel behind clones).
    form: str
    #: Providers that declined the call first: (provider, reason).
    skipped: tuple[tuple[str, str], ...]
    label: str
    #: Positions of the op's token parameters (their leading dimension is the token count).
    token_indices: tuple[int, ...]
    #: Positions of the op's tensor parameters, and of the first (whose dtype and device the trace reports).
    tensor_indices: tuple[int, ...]
    first_tensor: int | None
    #: Where the first token parameter's shape is in a call's shapes (None: the op has no token parameter).
    lead_slot: int | None
    #: ``shapes(args)``: each tensor parameter's shape, or None (`shape_reader`).
    shapes: Callable[[tuple], tuple[torch.Size | None, ...]]

    def token_count(self, args: tuple, shapes: tuple[torch.Size | None, ...]) -> int | None:
        """`first_token_count` of the call; ``shapes`` holds each tensor parameter's shape (or None).

        The common case is read off the shapes the trace takes anyway: a strided first token
        tensor of two or more dimensions leads with the token count. Anything else asks
        `first_token_count` itself (tests check the two agree)."""
        lead = self.lead_slot
        if lead is None:
            return None
        shape = shapes[lead]
        if shape is not None and len(shape) >= 2 and args[self.token_indices[0]].layout is _STRIDED:
            return shape[0]
        return first_token_count(*(args[i] for i in self.token_indices))


def shape_reader(indices: tuple[int, ...]) -> Callable[[tuple], tuple[torch.Size | None, ...]]:
    """``shapes(args)``: the shape (or None) of ``args[i]`` for each ``i`` in ``indices``.

    Unrolled for the common arities: a comprehension's own frame costs as much as reading two
    shapes, and this runs on every traced call."""
    if len(indices) == 1:
        (i,) = indices
        return lambda args: (None if (a := args[i]) is None else a.shape,)
    if len(indices) == 2:
        i, j = indices

        def two(args: tuple) -> tuple[torch.Size | None, ...]:
            a, b = args[i], args[j]
            return (None if a is None else a.shape, None if b is None else b.shape)

        return two
    if len(indices) == 3:
        i, j, k = indices

        def three(args: tuple) -> tuple[torch.Size | None, ...]:
            a, b, c = args[i], args[j], args[k]
            return (None if a is None else a.shape, None if b is None else b.shape, None if c is None else c.shape)

        return three
    return lambda args: tuple([None if (a := args[i]) is None else a.shape for i in indices])


def call_site(op: IrOp, provider: str, form: str, skipped: tuple[tuple[str, str], ...] = ()) -> CallSite:
    """The call site of ``op``'s calls that ``provider`` runs in ``form``."""
    names = list(op.signature.parameters)
    tokens = tuple(names.index(p) for p in op.token_params)
    tensors = op.tensor_param_indices
    required = [i for i, (name, optional) in zip(tensors, op.tensor_params.items(), strict=True) if not optional]
    return CallSite(
        op,
        provider,
        form,
        skipped,
        f"vllm_ir::{op.name}[{provider}]",
        tokens,
        tensors,
        required[0] if required else None,
        tensors.index(tokens[0]) if tokens else None,
        shape_reader(tensors),
    )


def observed(op: IrOp, decision: Decision, *, traced: bool, labelled: bool) -> Decision:
    """A decision that runs ``decision``'s kernels behind recorders (traced) or profiler ranges."""
    from vllm_ir.ir.selection import Decision

    impl = decision.impl
    in_place = "in-place" if impl.has_inplace_kernel else "functional"
    functional = "in-place on copies" if impl.inplace and op.activation_indices else "functional"
    runners = []
    for attr, form in (("functional", functional), ("maybe_inplace", in_place)):
        site = call_site(op, impl.provider, form, decision.skipped)
        runners.append(_traced(decision, attr, site) if traced else _labelled(decision, attr, site.label))
    return Decision(
        impl,
        decision.skipped,
        decision.cacheable,
        functional=runners[0],
        maybe_inplace=runners[1],
        guard_donation=decision.guard_donation,
    )


def _labelled(decision: Decision, attr: str, label: str) -> Callable[..., Any]:
    # The runner is read per call: the first call's result check replaces it (`results.checked_once`).
    def run(*args: Any) -> Any:
        with torch.profiler.record_function(label):
            return getattr(decision, attr)(*args)

    return run


def _traced(decision: Decision, attr: str, site: CallSite) -> Callable[..., Any]:
    first = site.first_tensor

    def run(*args: Any) -> Any:
        sink = active.get() or _process_sink[0]
        if sink is None:  # the block ended in another task that shares this scope
            return getattr(decision, attr)(*args)
        cuda = first is not None and args[first].is_cuda
        if cuda or profiler_flag._is_profiler_enabled:
            start, out, duration = _timed(decision, attr, args, cuda, site.label)
        else:  # the common case, inline: this wrapper's own cost is what tracing costs
            start = perf_counter_ns()
            out = getattr(decision, attr)(*args)
            duration = perf_counter_ns() - start
        sink.record(site, args, start, duration)
        return out

    return run


def _timed(decision: Decision, attr: str, args: tuple, cuda: bool, label: str) -> tuple[int, Any, Any]:
    """A call on a GPU (timed by events, read when the trace is summarised: no synchronisation
    per call) or under a profiler (inside the call's named range)."""
    labelled = profiler_flag._is_profiler_enabled
    with torch.profiler.record_function(label) if labelled else contextlib.nullcontext():
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start = perf_counter_ns()
            begin.record()
            out = getattr(decision, attr)(*args)
            end.record()
            return start, out, (begin, end)
        start = perf_counter_ns()
        out = getattr(decision, attr)(*args)
        return start, out, perf_counter_ns() - start
