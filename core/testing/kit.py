"""Turn the conformance checks into pytest tests for one provider.

In a provider's own test suite::

    from vllm_ir.testing import conformance_tests
    globals().update(conformance_tests("vllm_c"))

or from the command line for any installed provider::

    pytest --vllm-ir-conformance --vllm-ir-provider vllm_c [--vllm-ir-device cuda]
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import pytest
import torch

import vllm_ir
from vllm_ir.ir.impl import IrOpImpl, reason_of
from vllm_ir.ir.op import IrOp
from vllm_ir.testing import checks
from vllm_ir.testing.cases import DTYPES, Case, grid, property_strategy
from vllm_ir.testing.odd_inputs import odd_inputs


def provider_impls(provider: str) -> list[IrOpImpl]:
    """Load ``provider`` (an entry point of the same name, if not loaded yet) and list its implementations."""
    records = {r.name: r for r in vllm_ir.provider_records()}
    if provider in records and records[provider].status in (
        vllm_ir.ProviderStatus.NOT_LOADED,
        vllm_ir.ProviderStatus.BLOCKED,
    ):
        vllm_ir.load_provider(provider)
    impls = [op.impls[provider] for op in vllm_ir.ops if provider in op.impls]
    if not impls:
        record = records.get(provider)
        detail = f" ({record.status.value}: {record.reason})" if record else ""
        raise vllm_ir.PluginError(f"provider {provider!r} registers no implementation{detail}")
    return impls


def _resolve(op_name: str, provider: str) -> tuple[IrOp, IrOpImpl]:
    op = vllm_ir.ops.__getattr__(op_name)
    impl = op.impls.get(provider)
    if impl is None:
        pytest.fail(f"provider {provider!r} has no implementation of {op_name!r} any more")
    if not impl.supported:
        pytest.skip(f"{provider} is unsupported here: {impl.unsupported_reason}")
    return op, impl


def device_unavailable(device: str) -> str | None:
    """Why the kit cannot run on ``device`` here (its tests then skip with this reason), or None."""
    try:
        kind = torch.device(device).type
    except RuntimeError as exc:
        return f"device {device!r}: {exc}"
    if kind == "cpu":
        return None
    module = getattr(torch, kind, None)
    if module is None or not hasattr(module, "is_available") or not module.is_available():
        return f"device {device!r} is not available to this torch ({torch.__version__})"
    return None


def claims(op: IrOp, impl: IrOpImpl, dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether ``impl`` accepts a plain [3, 64] call in ``dtype`` (then the kit must test that dtype).

    A predicate that raises counts as claiming it, so that the tests report the error.
    """
    if not impl.supported or device_unavailable(device):
        return False
    args = Case((3, 64), dtype).make_args(op, device)
    try:
        return impl.supports_args is None or bool(impl.supports_args(*args))
    except Exception:
        return True


def _dtypes_of(op: IrOp, impl: IrOpImpl, dtypes: tuple[torch.dtype, ...], device: str) -> tuple[torch.dtype, ...]:
    """``dtypes``, plus float64 where the implementation claims it."""
    if torch.float64 not in dtypes and claims(op, impl, torch.float64, device):
        return (*dtypes, torch.float64)
    return dtypes


def conformance_tests(
    provider: str,
    *,
    small: bool = False,
    examples: int = 20,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    compiled: bool | str = True,
    device: str = "cpu",
    ops: Collection[str] | Callable[[str], bool] | None = None,
    label: str = "",
    focused_variants: bool = True,
    seed: int | None = 0,
    batch_invariance: bool | str = True,
) -> dict[str, Callable[..., Any]]:
    """pytest test functions that check every implementation of ``provider`` against its op.

    :param small: small shapes only (for slow back-ends such as the Triton interpreter).
    :param examples: number of hypothesis examples per op.
    :param dtypes: activation dtypes to cover (each one costs a compile for compiling providers);
        float64 is added for implementations whose predicate accepts float64 calls.
    :param compiled: check eager vs ``vllm_ir.compile``; a string skips that check with the string as reason.
    :param device: where the inputs live (``"cuda"`` for a GPU provider); every test skips, with
        the reason, where this torch has no such device.
    :param ops: only these ops' implementations (names, or a predicate on the name), e.g. to give
        a slow back-end's costly ops fewer dtypes in a second call.
    :param label: inserted into the test names (``test_conformance_<provider>_<label>_...``), so
        that two calls for one provider define distinct tests.
    :param focused_variants: run the focused checks (predicate hygiene, cache agreement,
        overloads) on every input variant too; False keeps them to the default variant's
        layouts (the numerics grid still covers every variant), for slow back-ends.
    :param batch_invariance: check the rows of ``batch_invariant=True`` implementations alone and
        in other batches; a string skips that check with the string as reason.
    :param seed: seed of the property-based cases, so that a failing run reproduces; None draws
        afresh every run (hypothesis's own randomness).
    """
    impls = provider_impls(provider)
    if ops is not None:
        wanted = ops if callable(ops) else (lambda name, names=frozenset(ops): name in names)
        impls = [i for i in impls if wanted(i.op_name)]
    ops = [vllm_ir.ops.__getattr__(i.op_name) for i in impls]
    op_dtypes = {i.op_name: _dtypes_of(op, i, dtypes, device) for op, i in zip(ops, impls, strict=True)}
    grid_params = [
        pytest.param(op.name, case, id=f"{op.name}-{case.id}")
        for op in ops
        for case in grid(op, small=small, dtypes=op_dtypes[op.name])
    ]
    focused = [
        pytest.param(op.name, case, id=f"{op.name}-{case.id}")
        for op in ops
        for case in grid(op, small=True, dtypes=op_dtypes[op.name])
        if case.shape in ((3, 7), (3, 64), (2, 3, 64), (5, 64))
        and (focused_variants or case.variant in ("default", "3d"))
    ]
    # One row without a token dimension too: its only dimension is the hidden size, a key fact.
    cache_params = focused + [
        pytest.param(op.name, case, id=f"{op.name}-{case.id}")
        for op in ops
        for case in (Case((64,), dtype) for dtype in op_dtypes[op.name])
    ]
    odd_params = [
        pytest.param(op.name, dtype, label, id=f"{op.name}-{str(dtype).removeprefix('torch.')}-{label}")
        for op in ops
        for dtype in op_dtypes[op.name]
        for label, _args in odd_inputs(op, dtype)  # labels only: the same on every device
    ]
    op_params = [pytest.param(op.name, id=op.name) for op in ops]
    invariance_params = [
        pytest.param(op.name, dtype, variant, id=f"{op.name}-{str(dtype).removeprefix('torch.')}-{variant}")
        for op, impl in zip(ops, impls, strict=True)
        if impl.batch_invariant
        for dtype in op_dtypes[op.name][: 1 if small else None]  # slow back-ends: the first dtype
        for variant in ("default", *op.input_variants)
    ]

    def resolve(op_name: str) -> tuple[IrOp, IrOpImpl]:
        unavailable = device_unavailable(device)
        if unavailable:
            pytest.skip(unavailable)
        return _resolve(op_name, provider)

    @pytest.mark.parametrize(("op_name", "case"), grid_params)
    def test_numerics(op_name: str, case: Case) -> None:
        checks.check_numerics(*resolve(op_name), case, device)

    @pytest.mark.parametrize("op_name", op_params)
    def test_numerics_property(op_name: str) -> None:
        import hypothesis
        from hypothesis import HealthCheck, given, settings

        op, impl = resolve(op_name)

        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(property_strategy(op, small=small, dtypes=op_dtypes[op_name]))
        def run(case: Case) -> None:
            checks.check_numerics(op, impl, case, device)

        (run if seed is None else hypothesis.seed(seed)(run))()

    @pytest.mark.parametrize(("op_name", "case"), focused)
    def test_predicate_hygiene(op_name: str, case: Case) -> None:
        checks.check_predicate_hygiene(*resolve(op_name), case, device)

    @pytest.mark.parametrize(("op_name", "case"), cache_params)
    def test_cache_agreement(op_name: str, case: Case) -> None:
        checks.check_cache_agreement(*resolve(op_name), case, device)

    @pytest.mark.parametrize(("op_name", "dtype", "label"), odd_params)
    def test_odd_inputs(op_name: str, dtype: torch.dtype, label: str) -> None:
        checks.check_odd_input(*resolve(op_name), dtype, label, device)

    @pytest.mark.parametrize(("op_name", "case"), focused)
    def test_overload_semantics(op_name: str, case: Case) -> None:
        checks.check_overloads(*resolve(op_name), case, device)

    @pytest.mark.parametrize("op_name", op_params)
    def test_opcheck(op_name: str) -> None:
        op, impl = resolve(op_name)
        checks.check_opcheck(op, impl, Case((3, 64), torch.float32), device)

    @pytest.mark.parametrize(("op_name", "dtype", "variant"), invariance_params)
    def test_batch_invariance(op_name: str, dtype: torch.dtype, variant: str) -> None:
        if batch_invariance is not True:
            pytest.skip(str(batch_invariance) or "batch-invariance check disabled")
        outcome = checks.check_batch_invariance(*resolve(op_name), dtype, variant, device, small=small)
        if outcome != "checked":
            pytest.skip(f"batch invariance not checked: {outcome}")

    @pytest.mark.parametrize("op_name", op_params)
    def test_eager_vs_compiled(op_name: str) -> None:
        if compiled is not True:
            pytest.skip(str(compiled) or "compiled check disabled")
        op, impl = resolve(op_name)
        if not impl.lowerable:
            why = reason_of(impl.lowerable, "its implementation says so")
            pytest.skip(f"{provider} cannot be lowered into compiled graphs here: {why}")
        checks.check_compiled(op, impl, Case((3, 64), torch.float32), device)

    names = {
        "eager_vs_compiled": test_eager_vs_compiled,
        "numerics": test_numerics,
        "numerics_property": test_numerics_property,
        "predicate_hygiene": test_predicate_hygiene,
        "cache_agreement": test_cache_agreement,
        "odd_inputs": test_odd_inputs,
        "overload_semantics": test_overload_semantics,
        "opcheck": test_opcheck,
        "batch_invariance": test_batch_invariance,
    }
    prefix = f"test_conformance_{provider}_{label}_" if label else f"test_conformance_{provider}_"
    return {f"{prefix}{k}": _renamed(f, f"{prefix}{k}") for k, f in names.items()}


def _renamed(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    fn.__name__ = fn.__qualname__ = name
    return fn
