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

With the compiled extension a traced runner is one C call (`fast_lookup.TracedRunner`): it
reads the facts, times the kernel and updates the trace's compiled recorder (``Trace._recorder``)
without running Python code, which is what keeps tracing within its budget of 1 us per call.
The Python runner below stays the reference, and the path of every call the C one hands over:
a sink that is not a `vllm_ir.trace.Trace`, tensor subclasses, CUDA tensors, a profiler.
"""

from __future__ import annotations

import contextlib
import contextvars
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any, Protocol

import torch

from vllm_ir.ir.dispatch import fast_lookup
from vllm_ir.ir.dispatch.cache_key import first_token_count

if TYPE_CHECKING:
    from vllm_ir.ir.dispatch.selection import Decision
    from vllm_ir.ir.op import IrOp

#: The module whose ``_is_profiler_enabled`` flag torch's profilers set on start and clear on stop:
#: one attribute read, which the Python hot path can afford. (The C lookup asks this thread's
#: profiler state instead; a flag of the whole process only ever makes Python label more calls.)
profiler_flag = torch.autograd.profiler


class Sink(Protocol):
    """What a traced runner reports to (`vllm_ir.trace.Trace`)."""

    def record(self, site: CallSite, facts: CallFacts, start_ns: int, duration: Any) -> None: ...


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


#: What a trace records of a call, read before the kernel runs: ``(dtype, is_cuda, shapes, tokens)``.
CallFacts = tuple[Any, bool, bytes, int | None]


def python_call_facts(
    args: tuple, tensor_indices: tuple[int, ...], token_indices: tuple[int, ...], first: int | None
) -> CallFacts:
    """What a trace records of a call: the reference that the compiled ``call_facts`` must agree
    with (it answers None where Python must read them: subclasses, other layouts, bad indices).

    ``dtype`` and ``is_cuda`` are the first required tensor's (None, False without one).
    ``shapes`` is the bytes of int64 values, per tensor parameter: -1 for None, else its number
    of dimensions, then its sizes (`decode_shapes`); bytes are one allocation that the garbage
    collector never tracks. ``tokens`` is `first_token_count` of the token parameters."""
    values: list[int] = []
    for i in tensor_indices:
        a = args[i]
        if a is None:
            values.append(-1)
        else:
            values.append(a.dim())
            values.extend(a.shape)
    lead = None if first is None else args[first]
    return (
        None if lead is None else lead.dtype,
        False if lead is None else lead.is_cuda,
        array("q", values).tobytes(),
        first_token_count(*(args[i] for i in token_indices)),
    )


def decode_shapes(shapes: bytes) -> list[list[int] | None]:
    """The shapes `python_call_facts` encoded, one list (or None) per tensor parameter."""
    values = array("q")
    values.frombytes(shapes)
    out: list[list[int] | None] = []
    i = 0
    while i < len(values):
        dim = values[i]
        out.append(None if dim < 0 else values[i + 1 : i + 1 + dim].tolist())
        i += 1 + max(dim, 0)
    return out


#: ``call_facts(args, tensor_indices, token_indices, first)``: `python_call_facts` in one C call,
#: or None (Python reads them); None itself without the compiled extension.
compiled_call_facts: Callable[..., CallFacts | None] | None = fast_lookup.call_facts


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
    )


def observed(op: IrOp, decision: Decision, *, traced: bool, labelled: bool) -> Decision:
    """A decision that runs ``decision``'s kernels behind recorders (traced) or profiler ranges."""
    from vllm_ir.ir.dispatch.selection import Decision

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


#: Build traced runners in C where the extension has them (tests turn it off to compare).
compiled_runners = fast_lookup.TracedRunner is not None


def _traced(decision: Decision, attr: str, site: CallSite) -> Callable[..., Any]:
    run = _python_traced(decision, attr, site)
    if not compiled_runners or fast_lookup.TracedRunner is None or len(site.tensor_indices) > 64:
        return run
    return fast_lookup.TracedRunner(
        decision,
        attr,
        site,
        site.tensor_indices,
        site.token_indices,
        site.first_tensor,
        active,
        _process_sink,
        vars(profiler_flag),
        run,
    )


def _python_traced(decision: Decision, attr: str, site: CallSite) -> Callable[..., Any]:
    """The reference traced runner (and the compiled one's fallback): `Sink.record` per call."""
    tensors, tokens, first = site.tensor_indices, site.token_indices, site.first_tensor
    compiled = compiled_call_facts

    def run(*args: Any) -> Any:
        sink = active.get() or _process_sink[0]
        if sink is None:  # the block ended in another task that shares this scope
            return getattr(decision, attr)(*args)
        # Read before the kernel runs (an in-place kernel keeps shapes; the device picks the timer).
        facts = (compiled and compiled(args, tensors, tokens, first)) or python_call_facts(args, tensors, tokens, first)
        if facts[1] or profiler_flag._is_profiler_enabled:
            start, out, duration = _timed(decision, attr, args, facts[1], site.label)
        else:  # the common case, inline: this wrapper's own cost is what tracing costs
            start = perf_counter_ns()
            out = getattr(decision, attr)(*args)
            duration = perf_counter_ns() - start
        sink.record(site, facts, start, duration)
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
