"""The conformance kit catches deliberately wrong implementations, and passes a correct one."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import vllm_ir
from tests.ops_for_tests import inplace_fused_add_rms_norm
from vllm_ir.testing import (
    Case,
    check_cache_agreement,
    check_numerics,
    check_odd_input,
    check_overloads,
    check_predicate_hygiene,
    conformance_tests,
    key_variations,
    odd_inputs,
)

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


# -- float64 in the grid -----------------------------------------------------------------


def _float64_exact(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    """RMSNorm computed in x's dtype: for float64, more precise than native (which computes in fp32)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
    return y if weight is None else y * weight


def _grid_ids(tests: dict, provider: str) -> list[str]:
    (mark,) = [m for m in tests[f"test_conformance_{provider}_numerics"].pytestmark if m.name == "parametrize"]
    return [p.id for p in mark.args[1]]


def test_grid_covers_float64_where_the_predicate_accepts_it():
    _register("kit_f64", _float64_exact)
    assert any("float64" in i for i in _grid_ids(conformance_tests("kit_f64"), "kit_f64"))

    def no_float64(x, weight, epsilon, variance_size=None):
        return x.dtype != torch.float64 or vllm_ir.Unsupported("no float64")

    _register("kit_no_f64", supports_args=no_float64)
    assert not any("float64" in i for i in _grid_ids(conformance_tests("kit_no_f64"), "kit_no_f64"))


def test_float64_kernel_that_does_not_match_native_is_caught():
    with pytest.raises(AssertionError, match=r"provider 'kit_f64x'.*float64.*x the tolerance"):
        check_numerics(*_register("kit_f64x", _float64_exact), Case((3, 64), torch.float64))


# -- odd inputs that native accepts --------------------------------------------------------


def _aten_like(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    """A fused ATen kernel with no predicate: it rejects a weight native broadcasts."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, epsilon)


def test_kernel_raising_where_native_returns_is_caught():
    op, impl = _register("kit_raises", _aten_like)
    with pytest.raises(AssertionError, match=r"provider 'kit_raises'.*weight of shape \[1\].*raises RuntimeError"):
        check_odd_input(op, impl, torch.float32, "weight of shape [1]")


def test_declining_an_odd_input_passes():
    op, impl = _register("kit_declines", _aten_like, supports_args=_plain_weight)
    outcome = check_odd_input(op, impl, torch.float32, "weight of shape [1]")
    assert outcome.status == "declined" and outcome.reason == "weight is not [hidden]"


def test_result_where_native_raises_is_caught():
    def skips_meta_weight(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
        # What aten's in-place multiply did: a meta weight multiplies nothing.
        return rms_norm.fn(x, None if weight is not None and weight.is_meta else weight, epsilon, variance_size)

    op, impl = _register("kit_meta", skips_meta_weight)
    with pytest.raises(AssertionError, match=r"provider 'kit_meta'.*returns a result, but native raises"):
        check_odd_input(op, impl, torch.float32, "weight on the meta device")


def test_every_odd_input_is_legal_for_native_or_rejected_by_it():
    # The list is what the kit feeds; each entry must be a call native answers or rejects cleanly.
    labels = [label for label, _ in odd_inputs(vllm_ir.ops.fused_add_rms_norm, torch.float32)]
    assert "x_residual of shape [8] against [3, 8] (broadcast)" in labels
    assert "x, x_residual 0-d" in labels and "weight of shape [1, 8]" in labels


# -- the decision cache agrees with the predicates over every key fact ----------------------


def _even_hidden(x, weight, epsilon, variance_size=None):
    return x.shape[-1] % 2 == 0 or vllm_ir.Unsupported(f"odd hidden size {x.shape[-1]}")


def _cache_ignoring_shapes(op) -> Callable[..., object]:
    """A decision cache keyed as before issue 12: dtype, device, rank, contiguity and scalars only."""
    decisions: dict[tuple, object] = {}

    def cached_dispatch(*args):
        key = tuple((a.dtype, a.device, a.dim(), a.is_contiguous()) if isinstance(a, torch.Tensor) else a for a in args)
        if key not in decisions:
            decisions[key] = op.dispatch(*args)
        return decisions[key]

    return cached_dispatch


def test_correct_cache_passes_cache_agreement():
    op, impl = _register("kit_even", supports_args=_even_hidden, cacheable=True)
    check_cache_agreement(op, impl, CASE)
    check_cache_agreement(op, impl, Case((2, 3, 64), torch.bfloat16))
    check_cache_agreement(op, impl, Case((64,), torch.float32))  # one row: its only dimension is hidden


def test_cache_ignoring_the_hidden_size_is_caught(monkeypatch):
    op, impl = _register("kit_even_stale", supports_args=_even_hidden, cacheable=True)
    monkeypatch.setattr(op, "cached_dispatch", _cache_ignoring_shapes(op))
    with pytest.raises(
        AssertionError, match=r"differs from the cached one only in x: dimension 1 64 -> 65 gets 'kit_even_stale'"
    ):
        check_cache_agreement(op, impl, CASE)


def test_cache_missing_what_makes_an_odd_input_odd_is_caught(monkeypatch):
    op, impl = _register("kit_plain_weight", _aten_like, supports_args=_plain_weight)
    monkeypatch.setattr(op, "cached_dispatch", _cache_ignoring_shapes(op))
    with pytest.raises(AssertionError, match=r"decision cache answers 'kit_plain_weight' but the predicates choose"):
        check_odd_input(op, impl, torch.float32, "weight of shape [1]")


def _plain_weight(x, weight, epsilon, variance_size=None):
    return weight is None or weight.shape == x.shape[-1:] or vllm_ir.Unsupported("weight is not [hidden]")


def test_key_variations_change_one_fact_each():
    op = vllm_ir.ops.fused_add_rms_norm
    base = CASE.make_args(op)
    labels = [label for label, _ in key_variations(op, base)]
    assert "x: dimension 1 64 -> 65" in labels and "weight: dimension 0 64 -> 1" in labels
    assert not any(label.startswith(("x: dimension 0", "x_residual: dimension 0")) for label in labels)
    assert {"weight: tensor -> None", "variance_size: None -> 5", "epsilon: 1e-06 -> 2e-06"} <= set(labels)
    assert {"x: rows padded by 16", "x: transposed", "x_residual: dtype float32 -> float64"} <= set(labels)
