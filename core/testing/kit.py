"""Turn the conformance checks into pytest tests for one provider.

In a provider's own test suite::

    from vllm_ir.testing import conformance_tests
    globals().update(conformance_tests("vllm_c"))

or from the command line for any installed provider::

    pytest --vllm-ir-conformance --vllm-ir-provider vllm_c
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import vllm_ir
from vllm_ir.ir.impl import IrOpImpl
from vllm_ir.ir.op import IrOp
from vllm_ir.testing import checks
from vllm_ir.testing.cases import DTYPES, Case, grid, property_strategy


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


def conformance_tests(
    provider: str,
    *,
    small: bool = False,
    examples: int = 20,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    compiled: bool | str = True,
) -> dict[str, Callable[..., Any]]:
    """pytest test functions that check every implementation of ``provider`` against its op.

    :param small: small shapes only (for slow back-ends such as the Triton interpreter).
    :param examples: number of hypothesis examples per op.
    :param dtypes: activation dtypes to cover (each one costs a compile for compiling providers).
    :param compiled: check eager vs ``vllm_ir.compile``; a string skips that check with the string as reason.
    """
    impls = provider_impls(provider)
    ops = [vllm_ir.ops.__getattr__(i.op_name) for i in impls]
    grid_params = [
        pytest.param(op.name, case, id=f"{op.name}-{case.id}")
        for op in ops
        for case in grid(op, small=small, dtypes=dtypes)
    ]
    focused = [
        pytest.param(op.name, case, id=f"{op.name}-{case.id}")
        for op in ops
        for case in grid(op, small=True, dtypes=dtypes)
        if case.shape in ((3, 7), (3, 64), (2, 3, 64), (5, 64))
    ]
    op_params = [pytest.param(op.name, id=op.name) for op in ops]

    @pytest.mark.parametrize(("op_name", "case"), grid_params)
    def test_numerics(op_name: str, case: Case) -> None:
        checks.check_numerics(*_resolve(op_name, provider), case)

    @pytest.mark.parametrize("op_name", op_params)
    def test_numerics_property(op_name: str) -> None:
        from hypothesis import HealthCheck, given, settings

        op, impl = _resolve(op_name, provider)

        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(property_strategy(op, small=small, dtypes=dtypes))
        def run(case: Case) -> None:
            checks.check_numerics(op, impl, case)

        run()

    @pytest.mark.parametrize(("op_name", "case"), focused)
    def test_predicate_hygiene(op_name: str, case: Case) -> None:
        checks.check_predicate_hygiene(*_resolve(op_name, provider), case)

    @pytest.mark.parametrize(("op_name", "case"), focused)
    def test_overload_semantics(op_name: str, case: Case) -> None:
        checks.check_overloads(*_resolve(op_name, provider), case)

    @pytest.mark.parametrize("op_name", op_params)
    def test_opcheck(op_name: str) -> None:
        op, impl = _resolve(op_name, provider)
        checks.check_opcheck(op, impl, Case((3, 64), torch.float32))

    @pytest.mark.parametrize("op_name", op_params)
    def test_eager_vs_compiled(op_name: str) -> None:
        if compiled is not True:
            pytest.skip(str(compiled) or "compiled check disabled")
        op, impl = _resolve(op_name, provider)
        checks.check_compiled(op, impl, Case((3, 64), torch.float32))

    names = {
        "eager_vs_compiled": test_eager_vs_compiled,
        "numerics": test_numerics,
        "numerics_property": test_numerics_property,
        "predicate_hygiene": test_predicate_hygiene,
        "overload_semantics": test_overload_semantics,
        "opcheck": test_opcheck,
    }
    return {
        f"test_conformance_{provider}_{k}": _renamed(f, f"test_conformance_{provider}_{k}") for k, f in names.items()
    }


def _renamed(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    fn.__name__ = fn.__qualname__ = name
    return fn
