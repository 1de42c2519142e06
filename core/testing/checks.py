"""The conformance checks: each takes an op, one implementation and a generated case.

Every check either passes, raises ``AssertionError`` with a message naming the op, the
provider, the case and what was wrong, or reports a reasoned refusal (``declined``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

import vllm_ir
from vllm_ir.ir import results
from vllm_ir.ir.dispatch.cache_key import first_token_count
from vllm_ir.ir.impl import IrOpImpl, Unsupported, reason_of
from vllm_ir.ir.op import IrOp
from vllm_ir.testing.cases import Case
from vllm_ir.testing.odd_inputs import BASE_SHAPE, odd_inputs, tolerance_dtype
from vllm_ir.testing.variations import key_variations


@dataclass(frozen=True)
class Outcome:
    """Result of one numerics case, collected for the kit's summary table."""

    op: str
    provider: str
    case: str
    status: str  # "ok" or "declined"
    reason: str | None = None
    max_abs_error: float = 0.0
    #: worst |error| / (atol + rtol * |expected|); above 1.0 fails.
    worst_ratio: float = 0.0


OUTCOMES: list[Outcome] = []


def _who(op: IrOp, impl: IrOpImpl, case: Case) -> str:
    return f"op {op.name!r}, provider {impl.provider!r}, case {case.id}"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _verdict(impl: IrOpImpl, args: tuple) -> bool | Unsupported:
    """The predicate's verdict; raising or returning anything but a bool/`Unsupported` fails the check.

    Asked directly rather than through dispatch, which turns a broken predicate into a refusal.
    """
    if impl.supports_args is None:
        return True
    who = f"op {impl.op_name!r}, provider {impl.provider!r}"
    try:
        verdict = impl.supports_args(*args)
    except Exception as exc:  # e.g. a data-dependent guard on symbolic sizes
        raise AssertionError(f"{who}: supports_args raised {type(exc).__name__}: {exc}") from exc
    if verdict is True or verdict is False or isinstance(verdict, Unsupported):
        return verdict
    raise AssertionError(
        f"{who}: supports_args returned {type(verdict).__name__} {verdict!r}; it must return True, False "
        "or vllm_ir.Unsupported(reason) and must not depend on tensor values or batch size"
    )


def _run_selected(op: IrOp, impl: IrOpImpl, args: tuple, overload: str = "default") -> Any:
    with vllm_ir.priority(**{op.name: [impl.provider]}):
        chosen = op.dispatch(*args).provider
        assert chosen == impl.provider, (
            f"op {op.name!r}: {impl.provider!r} accepts the call but dispatch chose {chosen!r}"
        )
        return op(*args) if overload == "default" else op.maybe_inplace(*args)


def tolerance(op: IrOp, impl: IrOpImpl, dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol): zero for an implementation that claims ``exact`` or an op compared exactly,
    else the op's for ``dtype``."""
    return (0.0, 0.0) if impl.exact or op.comparison.mode == "exact" else op.tolerance(dtype)


def compare(
    op: IrOp, impl: IrOpImpl, case: Case, actual: Any, expected: Any, args: tuple | None = None
) -> tuple[float, float]:
    """Assert ``actual`` matches native as the op's comparison mode says (`vllm_ir.Comparison`);
    returns (max abs error, worst ratio).

    ``args`` (the call's arguments) are needed for what depends on them: valid rows of padded
    outputs and dequantization; without them every row is compared and the dequantized
    closeness is skipped (bitwise, mismatch and scale checks still apply).
    """
    got, want = _tensors(actual), _tensors(expected)
    assert len(got) == len(want), f"{_who(op, impl, case)}: {len(got)} outputs, native returns {len(want)}"
    spec = op.comparison
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        where = f"{_who(op, impl, case)}, output {i}"
        assert a.shape == e.shape, f"{where}: shape {tuple(a.shape)}, native {tuple(e.shape)}"
        assert a.dtype == e.dtype, f"{where}: dtype {a.dtype}, native {e.dtype}"
        if spec.check_strides and e.numel():  # an empty tensor's strides mean nothing
            _check_strides(a, e, where)
    rows = spec.valid_rows(args) if spec.valid_rows is not None and args is not None else None
    if rows is not None:
        got = [t[:rows] if i in spec.padded else t for i, t in enumerate(got)]
        want = [t[:rows] if i in spec.padded else t for i, t in enumerate(want)]
    if spec.mode == "dequantized" and not impl.exact:
        return _compare_dequantized(op, impl, case, got, want, args)
    return _compare_tolerance(op, impl, case, got, want)


def _check_strides(a: torch.Tensor, e: torch.Tensor, where: str) -> None:
    """Native's memory layout (e.g. column-major scales), over the dimensions longer than one."""
    mine = [s for s, n in zip(a.stride(), a.shape, strict=True) if n > 1]
    native = [s for s, n in zip(e.stride(), e.shape, strict=True) if n > 1]
    assert mine == native, f"{where}: strides {a.stride()}, native's are {e.stride()} (shape {tuple(e.shape)})"


def _identical(a: torch.Tensor, e: torch.Tensor) -> bool:
    """``a`` and ``e`` (same dtype and device) hold the same values: the same bytes for 1-byte
    dtypes, equal values (no NaN: ``torch.equal`` counts NaN unequal) for the others. One pass
    over the data, where working out the error takes a dozen: every comparison takes it first,
    and an identical output is no error (what the full comparison would find too)."""
    if a.shape != e.shape or a.dtype != e.dtype or a.device != e.device or e.device.type == "meta":
        return False
    if e.element_size() == 1:
        return torch.equal(a.view(torch.uint8), e.view(torch.uint8))
    return torch.equal(a, e)


def _compare_tolerance(
    op: IrOp, impl: IrOpImpl, case: Case, got: list[torch.Tensor], want: list[torch.Tensor]
) -> tuple[float, float]:
    worst_abs, worst_ratio = 0.0, 0.0
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        where = f"{_who(op, impl, case)}, output {i}"
        if e.numel() == 0:
            continue
        if e.device.type == "meta":  # no values: shape, dtype and device are the whole answer
            assert a.device.type == "meta", f"{where}: on {a.device}, native returns a meta tensor"
            continue
        # Looked up first: a dtype without a tolerance is an error even when the outputs agree.
        atol, rtol = tolerance(op, impl, case.dtype)
        if _identical(a, e):  # error 0 everywhere (native's NaNs take the full comparison)
            continue
        if atol == rtol == 0.0 and e.element_size() == 1:  # fp8 and int8: bit for bit
            differ = _differ(a, e)
            assert not differ.any().item(), (
                f"{where}: {int(differ.sum().item())} of {e.numel()} elements differ from native's bytes "
                f"(first at index {tuple(differ.nonzero()[0].tolist())}); the comparison is exact"
            )
            continue
        a64, e64 = a.detach().to("cpu", torch.float64), e.detach().to("cpu", torch.float64)
        nan_mismatch = (a64.isnan() != e64.isnan()).any().item()
        assert not nan_mismatch, f"{where}: NaN where native has none (or the reverse)"
        finite = ~e64.isnan()
        # Equal values (infinities included) are no error, also under a zero (exact) tolerance.
        same = a64 == e64
        err = torch.where(same, 0.0, (a64 - e64).abs())[finite]
        allowed = (atol + rtol * e64.abs())[finite]
        if err.numel():
            worst_abs = max(worst_abs, err.max().item())
            ratio = torch.where(same[finite], 0.0, err / allowed).max().item()
            worst_ratio = max(worst_ratio, ratio if math.isfinite(ratio) else math.inf)
    assert worst_ratio <= 1.0, (
        f"{_who(op, impl, case)}: max abs error {worst_abs:.3g} is {worst_ratio:.2f}x the tolerance "
        f"(atol, rtol = {tolerance(op, impl, case.dtype)})"
    )
    return worst_abs, worst_ratio


def _compare_dequantized(
    op: IrOp, impl: IrOpImpl, case: Case, got: list[torch.Tensor], want: list[torch.Tensor], args: tuple | None
) -> tuple[float, float]:
    """The quantized-op mode: mismatch fraction, scales above the floor, dequantized closeness."""
    spec = op.comparison
    who = _who(op, impl, case)
    if all(_identical(a, e) for a, e in zip(got, want, strict=True)):
        # The same bytes (quantized values) and values (scales, no NaN): nothing differs, no scale
        # error, and the dequantized values (a function of the outputs) are native's own.
        return 0.0, 0.0
    for i in spec.quantized:
        a, e = got[i], want[i]
        if e.numel() == 0 or _identical(a, e):
            continue
        differ = _differ(a, e)
        mismatched = int(differ.sum().item())
        # A fraction of a tiny tensor is less than one element: one differing element is allowed there.
        allowed = max(1, math.floor(spec.max_mismatch * e.numel()))
        assert mismatched <= allowed, (
            f"{who}, output {i}: {mismatched} of {e.numel()} quantized elements ({mismatched / e.numel():.2%}) "
            f"differ from native; at most {spec.max_mismatch:.2%} may"
        )
    floor = spec.scale_floor(args) if spec.scale_floor is not None and args is not None else 0.0
    atol, rtol = op.tolerance(torch.float32)
    if spec.scale_rtol is not None and args is not None:
        rtol = max(rtol, spec.scale_rtol(args))
    worst_abs, worst_ratio = 0.0, 0.0
    for i in spec.scales:
        a, e = got[i].to(torch.float64), want[i].to(torch.float64)
        above = e > floor  # at or below the floor providers floor differently (and q is the same)
        err = (a - e).abs()[above]
        if err.numel():
            worst_abs = max(worst_abs, err.max().item())
            ratio = (err / (atol + rtol * e.abs()[above])).max().item()
            worst_ratio = max(worst_ratio, ratio)
            assert ratio <= 1.0, (
                f"{who}, output {i} (scales): max abs error {err.max().item():.3g} is {ratio:.2f}x the float32 "
                f"tolerance where native's scale is above the floor {floor:.3g}"
            )
        nan_mismatch = (a.isnan() != e.isnan()).any().item()
        assert not nan_mismatch, f"{who}, output {i} (scales): NaN where native has none (or the reverse)"
    if args is not None and spec.dequantize is not None:
        x = (spec.reference(args) if spec.reference is not None else args[0]).to(torch.float64)
        mine = spec.dequantize(args, tuple(got)).to(torch.float64)
        native = spec.dequantize(args, tuple(want)).to(torch.float64)
        allowed = spec.atol + spec.rtol * x.abs()
        # Where native cannot represent x (clamped to the fp8 range, scale_ub) no one has to.
        representable = (native - x).abs() <= allowed
        bad = representable & ~((mine - x).abs() <= allowed)
        assert not bad.any().item(), (
            f"{who}: {int(bad.sum().item())} dequantized values (q * scale) are not within "
            f"atol {spec.atol} + rtol {spec.rtol} * |x| of x where native's are; first at index "
            f"{tuple(bad.nonzero()[0].tolist())}: x {x[bad][0].item():.4g}, dequantized {mine[bad][0].item():.4g}"
        )
    return worst_abs, worst_ratio


def _differ(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Elementwise: the values differ (bytes for 1-byte dtypes, so NaN encodings count too)."""
    if a.element_size() == 1 and a.dtype == e.dtype:
        return a.view(torch.uint8) != e.view(torch.uint8)
    a64, e64 = a.to(torch.float64), e.to(torch.float64)
    return (a64 != e64) & ~(a64.isnan() & e64.isnan())


def check_layout_invariance(op: IrOp, impl: IrOpImpl, case: Case, args: tuple, actual: Any) -> None:
    """A strided input gives byte-identical results to a contiguous copy of it (valid rows)."""
    contiguous = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
    if all(c is a for c, a in zip(contiguous, args, strict=True)):
        return
    again = _run_selected(op, impl, contiguous)
    spec = op.comparison
    rows = spec.valid_rows(args) if spec.valid_rows is not None else None
    for i, (a, b) in enumerate(zip(_tensors(actual), _tensors(again), strict=True)):
        if rows is not None and i in spec.padded:
            a, b = a[:rows], b[:rows]
        assert _identical(a, b) or (a.shape == b.shape and not _differ(a, b).any().item()), (
            f"{_who(op, impl, case)}, output {i}: a strided input gives other values than a contiguous copy of it"
        )


def check_numerics(op: IrOp, impl: IrOpImpl, case: Case, device: str = "cpu") -> Outcome:
    """Against native with the op's per-dtype tolerance, or a reasoned refusal."""
    args = case.make_args(op, device)
    verdict = _verdict(impl, args)
    if not verdict:
        outcome = Outcome(op.name, impl.provider, case.id, "declined", reason_of(verdict, "declined (no reason given)"))
    else:
        expected = op.fn(*args)
        actual = _run_selected(op, impl, args)
        # Native's real result gives what its fake run would (dtypes, shapes, devices, which outputs
        # alias inputs) without a second native run under FakeTensorMode (most of a case's time).
        owed = results._FakeResult(expected, list(args))
        results.check_result(op, impl, actual, args, functional=True, expected=owed)
        abs_err, ratio = compare(op, impl, case, actual, expected, args)
        if op.comparison.layout_invariant:
            check_layout_invariance(op, impl, case, args, actual)
        outcome = Outcome(op.name, impl.provider, case.id, "ok", None, abs_err, ratio)
    OUTCOMES.append(outcome)
    return outcome


def check_predicate_hygiene(op: IrOp, impl: IrOpImpl, case: Case, device: str = "cpu") -> None:
    """Plain bool or reasoned refusal on real, fake and symbolic inputs; independent of batch size."""
    if impl.supports_args is None:
        return
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    args = case.make_args(op, device)
    real = _verdict(impl, args)
    for label, mode in (("fake", FakeTensorMode()), ("symbolic", FakeTensorMode(shape_env=ShapeEnv()))):
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        with mode:
            verdict = _verdict(impl, fake_args)
        assert _same(verdict, real), (
            f"{_who(op, impl, case)}: supports_args says {verdict!r} on {label} tensors but {real!r} on real ones"
        )
    for tokens in (1, 7, 64):
        other = Case((tokens, *case.shape[1:]), case.dtype, case.variant, case.options, case.row_padding, case.seed)
        verdict = _verdict(impl, other.make_args(op, device))
        assert _same(verdict, real), (
            f"{_who(op, impl, case)}: supports_args depends on the batch size "
            f"({case.shape[0]} tokens: {real!r}, {tokens} tokens: {verdict!r})"
        )
    _check_cached_across_token_counts(op, impl, case, device)


def _check_cached_across_token_counts(op: IrOp, impl: IrOpImpl, case: Case, device: str) -> None:
    """Calls with a cached decision run what the predicate says for each call."""
    vllm_ir.reset_dispatch_stats()
    with vllm_ir.priority(**{op.name: [impl.provider]}), warnings.catch_warnings():
        warnings.simplefilter("ignore", vllm_ir.FallbackWarning)
        for tokens in (1, 3, 7):
            other = Case((tokens, *case.shape[1:]), case.dtype, case.variant, case.options, case.row_padding)
            args = other.make_args(op, device)
            declined = not _verdict(impl, args)
            before = vllm_ir.dispatch_stats().get(op.name, {}).get(impl.provider, {})
            op(*args)
            after = vllm_ir.dispatch_stats().get(op.name, {}).get(impl.provider, {})
            skipped = sum(after.values()) - sum(before.values())
            assert skipped == int(declined), (
                f"{_who(op, impl, case)}: with {tokens} tokens the predicate says "
                f"{'decline' if declined else 'accept'} but the cached decision "
                f"{'ran it' if not skipped else 'skipped it'}"
            )


def check_cache_agreement(op: IrOp, impl: IrOpImpl, case: Case, device: str = "cpu") -> None:
    """A call answered from the decision cache runs what its predicates choose, over every key fact.

    With priority [provider, native], a base call fills the cache; then for each call that
    differs from it in one fact (`key_variations`: a non-token dimension, the layout, the
    rank, None vs tensor, a dtype, the device, a scalar) ``op.cached_dispatch`` must equal
    the uncached ``op.dispatch``, twice, and the base call must still agree afterwards.
    """
    base = case.make_args(op, device)
    who = _who(op, impl, case)
    with vllm_ir.priority(**{op.name: [impl.provider]}), warnings.catch_warnings():
        warnings.simplefilter("ignore", vllm_ir.FallbackWarning)
        op(*base)  # a real call: the cache now holds the base call's decision
        base_choice = _choice(op.dispatch, base)
        got = _choice(op.cached_dispatch, base)
        assert _agree(got, base_choice), (
            f"{who}: the decision cache answers {got} for the base call, its predicates choose {base_choice}"
        )
        for label, varied in key_variations(op, base):
            expected = _choice(op.dispatch, varied)
            for attempt in ("first", "second"):
                got = _choice(op.cached_dispatch, varied)
                assert _agree(got, expected), (
                    f"{who}: a call that differs from the cached one only in {label} gets {got} from the "
                    f"decision cache ({attempt} call), but its predicates choose {expected}: "
                    "the cache key must cover this fact"
                )
            got = _choice(op.cached_dispatch, base)
            assert _agree(got, base_choice), (
                f"{who}: after a call that differs only in {label}, the base call gets {got} from the "
                f"decision cache, but its predicates choose {base_choice}"
            )


def _choice(dispatch_fn: Any, args: tuple) -> str:
    """The provider ``dispatch_fn`` picks for ``args`` as ``'name'``, or the error it raises."""
    try:
        return repr(dispatch_fn(*args).provider)
    except Exception as exc:
        return f"an error ({type(exc).__name__}: {exc})"


def _agree(a: str, b: str) -> bool:
    return a == b or (a.startswith("an error") and b.startswith("an error"))


def check_odd_input(op: IrOp, impl: IrOpImpl, dtype: torch.dtype, label: str, device: str = "cpu") -> Outcome:
    """On a call that is odd but legal for native (`odd_inputs`), decline or match native; never raise.

    Where native raises, the implementation must decline or raise too: such a call has no result.
    """
    args = dict(odd_inputs(op, dtype, device))[label]
    case = Case(BASE_SHAPE, tolerance_dtype(args), f"odd input: {label}")
    who = f"op {op.name!r}, provider {impl.provider!r}, {_name(dtype)} call with {label}"
    try:
        expected, native_error = op.fn(*args), None
    except Exception as exc:
        expected, native_error = None, exc
    verdict = _verdict(impl, args)
    with vllm_ir.priority(**{op.name: [impl.provider]}), warnings.catch_warnings():
        warnings.simplefilter("ignore", vllm_ir.FallbackWarning)
        # The call the odd one is derived from is cached first: the odd call must not reuse its decision.
        op.cached_dispatch(*op.generate_inputs(BASE_SHAPE, dtype, device))
        cached, uncached = _choice(op.cached_dispatch, args), _choice(op.dispatch, args)
        assert _agree(cached, uncached), (
            f"{who}: after a plain {list(BASE_SHAPE)} call, the decision cache answers {cached} but the "
            f"predicates choose {uncached}: the cache key misses what makes this call odd"
        )
    if not verdict:
        outcome = Outcome(op.name, impl.provider, case.id, "declined", reason_of(verdict, "declined (no reason given)"))
        OUTCOMES.append(outcome)
        return outcome
    with vllm_ir.priority(**{op.name: [impl.provider]}):
        chosen = op.dispatch(*args).provider
        assert chosen == impl.provider, f"{who}: the predicate accepts the call but dispatch chose {chosen!r}"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                actual = op(*args)
        except Exception as exc:
            if native_error is not None:
                outcome = Outcome(op.name, impl.provider, case.id, "ok", "raises, as native does")
                OUTCOMES.append(outcome)
                return outcome
            raise AssertionError(
                f"{who}: raises {type(exc).__name__}: {exc}; native returns a result. "
                "Decline such calls in supports_args with a reason (vllm_ir.Unsupported) so native runs"
            ) from exc
    assert native_error is None, (
        f"{who}: returns a result, but native raises {type(native_error).__name__}: {native_error}. "
        "A call native rejects has no result: decline it in supports_args (or raise)"
    )
    abs_err, ratio = compare(op, impl, case, actual, expected, args)
    outcome = Outcome(op.name, impl.provider, case.id, "ok", None, abs_err, ratio)
    OUTCOMES.append(outcome)
    return outcome


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _same(a: bool | Unsupported, b: bool | Unsupported) -> bool:
    """The same verdict: both accept or both decline. A reason's text may differ (it may quote a
    size, printed as ``s0`` on symbolic tensors and ``7`` on real ones); whether it gives one may not."""
    return bool(a) == bool(b) and isinstance(a, Unsupported) == isinstance(b, Unsupported)


def check_overloads(op: IrOp, impl: IrOpImpl, case: Case, device: str = "cpu") -> None:
    """Default leaves inputs untouched and returns fresh tensors; maybe_inplace matches and aliases."""
    args = case.make_args(op, device)
    if not _verdict(impl, args):
        return
    originals = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = _run_selected(op, impl, args)
    for name, before, after in zip(op.signature.parameters, originals, args, strict=True):
        if isinstance(after, torch.Tensor):
            assert torch.equal(before, after), f"{_who(op, impl, case)}: the default overload modified {name!r}"
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor) and a.numel()}
    for i, t in enumerate(_tensors(out)):
        assert not t.numel() or t.untyped_storage().data_ptr() not in inputs, (
            f"{_who(op, impl, case)}: output {i} of the default overload aliases an input"
        )
    if not op.allow_inplace:
        return
    donated = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    out_inplace = _run_selected(op, impl, donated, "maybe_inplace")
    for i, (a, b) in enumerate(zip(_tensors(out), _tensors(out_inplace), strict=True)):
        assert torch.equal(a, b), f"{_who(op, impl, case)}: output {i} differs between default and maybe_inplace"
    if impl.inplace and all(t.numel() for t in _tensors(out_inplace)):
        activations = {donated[i].data_ptr() for i in op.activation_indices if donated[i] is not None}
        outputs = [t.data_ptr() for t in _tensors(out_inplace)]
        aliased = set(outputs) & activations
        assert len(aliased) == min(len(outputs), len(activations)), (
            f"{_who(op, impl, case)}: an in-place implementation must return the donated buffers; "
            f"{len(aliased)} of {len(outputs)} outputs alias an activation"
        )
        _check_no_new_allocations(op, impl, case, device)


def _bytes_allocated(fn: Any, device: str) -> int:
    """Bytes ``fn`` allocates on ``device``: the profiler's CPU allocations, the CUDA allocator's peak."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return top_level_allocations(prof.events())


def top_level_allocations(events: Any) -> int:
    """Bytes the top-level ops of a CPU profile allocated (a parent already includes its children's).
    A vllm-ir call's own range, ``vllm_ir::op[provider]`` (what a profiler shows of it), is see-through."""

    def top(e: Any) -> bool:
        parent = e.cpu_parent
        return not e.name.startswith("vllm_ir::") and (parent is None or parent.name.startswith("vllm_ir::"))

    return sum(e.cpu_memory_usage for e in events if top(e) and e.cpu_memory_usage > 0)


def _check_no_new_allocations(op: IrOp, impl: IrOpImpl, case: Case, device: str) -> None:
    """maybe_inplace allocates nothing activation-sized (per-row statistics are fine)."""
    if case.row_padding or case.shape[0] == 0:
        return
    fresh = [case.make_args(op, device) for _ in range(2)]
    smallest = min(fresh[1][i].nbytes for i in op.activation_indices if fresh[1][i] is not None)
    with vllm_ir.priority(**{op.name: [impl.provider]}):
        op.maybe_inplace(*fresh[0])  # warm the decision cache
        allocated = _bytes_allocated(lambda: op.maybe_inplace(*fresh[1]), device)
    assert allocated < smallest, (
        f"{_who(op, impl, case)}: maybe_inplace allocated {allocated} bytes; an activation is {smallest}"
    )


def check_opcheck(op: IrOp, impl: IrOpImpl, case: Case, device: str = "cpu") -> None:
    """``torch.library.opcheck`` of the IR op (schema, fake, AOT dispatch) with this implementation selected."""
    args = case.make_args(op, device)
    if not _verdict(impl, args):
        return
    with vllm_ir.priority(**{op.name: [impl.provider]}):
        torch.library.opcheck(op.torch_op.default, args)


def check_compiled(op: IrOp, impl: IrOpImpl, case: Case, device: str = "cpu") -> None:
    """Under ``vllm_ir.compile`` the lowering selects what eager dispatch selects, with the same values."""
    import types

    from vllm_ir import passes

    args = case.make_args(op, device)
    if not _verdict(impl, args):
        return
    tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def call(*tensors: torch.Tensor) -> Any:
        full = list(args)
        for i, t in zip(tensor_at, tensors, strict=True):
            full[i] = t
        return op(*full)

    # A fresh code object: Dynamo caches per code object, and every check compiles anew.
    fresh = types.FunctionType(
        call.__code__.replace(co_name=f"conformance_{op.name}_{impl.provider}_{len(OUTCOMES)}"),
        call.__globals__,
        closure=call.__closure__,
    )
    with vllm_ir.priority(**{op.name: [impl.provider]}):
        eager_choice = op.dispatch(*args).provider
        expected = op(*args)
        compiled = passes.compile(fresh, dynamic=False)
        actual = compiled(*[args[i] for i in tensor_at])
    selected = passes.record_of(compiled).selected_impls.get(op.name, {})
    assert selected, f"{_who(op, impl, case)}: the compiled graph lowered no {op.name} node"
    assert set(selected.values()) == {eager_choice}, (
        f"{_who(op, impl, case)}: eager dispatch picks {eager_choice!r}, lowering picked {selected}"
    )
    compare(op, impl, case, actual, expected, args)


#: The batch the invariance check slices: an odd token count, and a larger batch around it.
INVARIANCE_TOKENS = 37
INVARIANCE_PADDED_TOKENS = 64
INVARIANCE_HIDDEN = 1024
#: For slow back-ends (``small=True``, e.g. the Triton interpreter, whose cost is one Python run
#: per row program: the larger batch is the check's biggest call, so it stays just above 37).
INVARIANCE_HIDDEN_SMALL = 96
INVARIANCE_PADDED_TOKENS_SMALL = 41


def _token_slices(op: IrOp, args: tuple, rows: slice) -> tuple:
    """``args`` with every per-token tensor cut to ``rows`` (fresh copies): the token parameters,
    and tensors whose leading dimension is the token count (a ``[T, 1]`` static scale)."""
    names = list(op.signature.parameters)
    tokens = first_token_count(*(a for n, a in zip(names, args, strict=False) if n in op.token_params))

    def per_token(name: str, a: Any) -> bool:
        if not isinstance(a, torch.Tensor) or not a.dim():
            return False
        if tokens is None or a.shape[0] != tokens:  # e.g. a one-element per-tensor scale
            return False
        return name in op.token_params or a.dim() >= 2

    return tuple(a[rows].clone() if per_token(n, a) else a for n, a in zip(names, args, strict=True))


def _token_outputs(out: Any, tokens: int) -> list[torch.Tensor]:
    """The outputs that have the token dimension (per-tensor statistics have none)."""
    return [t for t in _tensors(out) if t.dim() and t.shape[0] == tokens]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A view that compares every bit (NaN payloads, -0.0) rather than values."""
    return t.contiguous().view(torch.uint8)


def check_batch_invariance(
    op: IrOp, impl: IrOpImpl, dtype: torch.dtype, variant: str, device: str = "cpu", *, small: bool = False
) -> str:
    """A provider that declares ``batch_invariant=True`` computes every row bit for bit the same
    whatever else is in the batch: alone, in sub-batches of several sizes and positions, at odd
    token counts and inside a larger batch. Returns what was checked, or why nothing was.

    Only row-wise ops are checked: where native's own rows depend on the batch (a per-tensor
    scale), the claim can only mean "deterministic", which the other checks cover.
    """
    options = dict(op.input_variants.get(variant, {}))
    hidden = INVARIANCE_HIDDEN_SMALL if small else INVARIANCE_HIDDEN
    padded_tokens = INVARIANCE_PADDED_TOKENS_SMALL if small else INVARIANCE_PADDED_TOKENS
    full = Case((padded_tokens, hidden), dtype, variant, options).make_args(op, device)
    args = _token_slices(op, full, slice(0, INVARIANCE_TOKENS))
    t = INVARIANCE_TOKENS
    try:
        expected = _token_outputs(op.fn(*args), t)
    except Exception:  # e.g. scales shared by groups of tokens: a cut batch is no call
        return "not row-wise (a slice of the batch is not a valid call for native)"
    if not _verdict(impl, args):
        return "declined"
    if not expected:
        return "no per-token output"
    subsets = (slice(0, 1), slice(17, 18), slice(t - 1, t), slice(0, 2), slice(5, 12), slice(t - 4, t))
    atol, rtol = tolerance(op, impl, dtype)
    for rows in subsets:  # native's own rows must not depend on the batch, else nothing to check
        try:
            alone = _token_outputs(op.fn(*_token_slices(op, args, rows)), rows.stop - rows.start)
        except Exception:  # e.g. scales shared by groups of tokens: such a slice is no call
            return "not row-wise (a slice of the batch is not a valid call for native)"
        if len(alone) != len(expected) or not all(
            torch.allclose(a.float(), e[rows].float(), atol=atol, rtol=rtol, equal_nan=True)
            for a, e in zip(alone, expected, strict=True)
        ):
            return "not row-wise (native's rows depend on the batch)"
    with vllm_ir.priority(**{op.name: [impl.provider]}), warnings.catch_warnings():
        warnings.simplefilter("ignore", vllm_ir.FallbackWarning)
        batch = _token_outputs(_run_selected(op, impl, args), t)
        padded = _token_outputs(_run_selected(op, impl, full), padded_tokens)
        #: (rows of the t-token batch, the same rows computed another way, how)
        others = [(slice(0, t), [p[:t] for p in padded], f"the first {t} rows of a {padded_tokens}-token batch")]
        for rows in subsets:
            n = rows.stop - rows.start
            part = _token_outputs(_run_selected(op, impl, _token_slices(op, args, rows)), n)
            others.append((rows, part, f"a {n}-token batch of rows {rows.start}..{rows.stop - 1}"))
    who = f"op {op.name!r}, provider {impl.provider!r} (declares batch_invariant=True), {_name(dtype)} {variant}"
    for rows, outputs, how in others:
        for i, (got, whole) in enumerate(zip(outputs, batch, strict=True)):
            want = whole[rows]
            if got.shape == want.shape and torch.equal(_bits(got), _bits(want)):
                continue  # every bit the same: no row differs (one pass; the rows are found below)
            differ = (_bits(got).reshape(got.shape[0], -1) != _bits(want).reshape(want.shape[0], -1)).any(-1)
            if differ.any():
                row = rows.start + int(differ.nonzero()[0])
                raise AssertionError(
                    f"{who}: row {row} of output {i} differs between a {t}-token batch and {how} "
                    f"(max abs difference {(got.float() - want.float()).abs().max().item():.3g}); "
                    "a batch-invariant kernel computes every row the same way whatever the batch"
                )
    return "checked"
