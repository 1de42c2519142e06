"""The conformance kit catches deliberately wrong implementations, and passes a correct one."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import vllm_ir
from tests.ops_for_tests import inplace_fused_add_rms_norm
from vllm_ir.testing import Case, check_numerics, check_overloads, check_predicate_hygiene

rms_norm = vllm_ir.ops.rms_norm
CASE = Case((3, 64), torch.float32)


def _register(provider: str, fn=None, **options):
    def default(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
        return rms_norm.fn(x, weight, epsilon, variance_size)

    rms_norm.register_impl(provider, **options)(fn or default)
    return rms_norm, rms_norm.impls[provider]


def test_beyond_tolerance_is_caught_with_worst_error():
    atol, rtol = rms_norm.tolerance(torch.float32)

    def off(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
        out = rms_norm.fn(x, weight, epsilon, variance_size)
        return out + (atol + rtol * out.abs()) * 1.5  # 1.5x the allowed error everywhere

    with pytest.raises(AssertionError, match=r"provider 'kit_off'.*is 1\.\d\dx the tolerance"):
        check_numerics(*_register("kit_off", off), CASE)


def test_within_tolerance_reports_worst_error():
    outcome = check_numerics(*_register("kit_ok"), CASE)
    assert outcome.status == "ok" and outcome.worst_ratio == 0.0


def test_mutating_inputs_in_default_overload_is_caught():
    def sneaky(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
        out = rms_norm.fn(x, weight, epsilon, variance_size)
        x.zero_()  # an in-place kernel that forgot to say inplace=True
        return out

    with pytest.raises(AssertionError, match="the default overload modified 'x'"):
        check_overloads(*_register("kit_sneaky", sneaky), CASE)


def test_inplace_impl_writing_a_fresh_buffer_is_caught():
    op = vllm_ir.ops.fused_add_rms_norm

    def wasteful(
        x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
    ) -> tuple[Tensor, Tensor]:
        # Claims to work in place but writes the normalized output into a fresh buffer.
        return inplace_fused_add_rms_norm(x.clone(), x_residual, weight, epsilon)

    op.register_impl("kit_wasteful", inplace=True)(wasteful)
    with pytest.raises(AssertionError, match="must return the donated buffers; 1 of 2 outputs alias"):
        check_overloads(op, op.impls["kit_wasteful"], CASE)


def test_predicate_reading_batch_size_is_caught():
    def by_batch(x, weight, epsilon, variance_size=None):
        return x.shape[0] < 32  # depends on the batch: a SymBool under symbolic shapes

    with pytest.raises(AssertionError, match="supports_args"):
        check_predicate_hygiene(*_register("kit_batchy", supports_args=by_batch), CASE)


def test_predicate_reading_batch_size_concretely_is_caught():
    def by_batch(x, weight, epsilon, variance_size=None):
        return bool(int(x.shape[0]) % 2) or vllm_ir.Unsupported("even batch")

    with pytest.raises(AssertionError, match="supports_args"):
        check_predicate_hygiene(*_register("kit_parity", supports_args=by_batch), CASE)


def test_correct_predicate_passes_hygiene():
    def fp32_only(x, weight, epsilon, variance_size=None):
        return x.dtype == torch.float32 or vllm_ir.Unsupported("fp32 only")

    check_predicate_hygiene(*_register("kit_clean", supports_args=fp32_only), CASE)
    check_predicate_hygiene(rms_norm, rms_norm.impls["kit_clean"], Case((3, 64), torch.bfloat16))
