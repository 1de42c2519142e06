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
    check_batch_invariance,
    check_cache_agreement,
    check_numerics,
    check_odd_input,
    check_overloads,
    check_predicate_hygiene,
    compare,
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


def test_a_reason_quoting_a_size_passes_hygiene():
    # On symbolic tensors the reason reads "got s49", on real ones "got 7": the verdict is the same.
    def hidden_multiple_of_8(x, weight, epsilon, variance_size=None):
        return x.shape[-1] % 8 == 0 or vllm_ir.Unsupported(f"needs hidden % 8 == 0, got {x.shape[-1]}")

    check_predicate_hygiene(*_register("kit_quoting", supports_args=hidden_multiple_of_8), Case((3, 7), torch.float32))


def test_a_reason_on_real_tensors_only_is_caught():
    from torch._subclasses.fake_tensor import FakeTensor

    def reason_only_on_real(x, weight, epsilon, variance_size=None):
        return vllm_ir.Unsupported("declined") if not isinstance(x, FakeTensor) else False

    with pytest.raises(AssertionError, match="supports_args says False on fake tensors"):
        check_predicate_hygiene(*_register("kit_reasonless", supports_args=reason_only_on_real), CASE)


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


def test_ops_label_and_focused_variants_select_the_generated_tests():
    """``ops`` keeps the named ops' implementations, ``label`` renames the tests, and
    ``focused_variants=False`` keeps the focused checks to the default variant's layouts."""
    _register("kit_sel")
    tests = conformance_tests("kit_sel", ops={"rms_norm"}, label="part", focused_variants=False)
    assert "test_conformance_kit_sel_part_numerics" in tests
    (mark,) = [
        m for m in tests["test_conformance_kit_sel_part_predicate_hygiene"].pytestmark if m.name == "parametrize"
    ]
    focused = [p.id for p in mark.args[1]]
    assert focused and all(i.split("-")[3] in ("default", "3d") for i in focused), focused
    assert any(i.split("-")[3] not in ("default", "3d") for i in _grid_ids(conformance_tests("kit_sel"), "kit_sel"))


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


# -- comparison modes (vllm_ir.Comparison) over the fp8 quant ops -----------------------------

static_quant = vllm_ir.ops.static_quant_fp8
dynamic_quant = vllm_ir.ops.dynamic_quant_fp8
group_quant = vllm_ir.ops.dynamic_group_quant_fp8
QCASE = Case((64, 128), torch.bfloat16)


def _register_quant(op, provider: str, fn, **options):
    op.register_impl(provider, **options)(fn)
    return op, op.impls[provider]


def _flip_low_bits(q: Tensor, every: int) -> Tensor:
    """q with the lowest mantissa bit of every ``every``-th element flipped: one fp8 step off."""
    flat = q.view(torch.uint8).clone().reshape(-1)
    flat[::every] ^= 1
    return flat.reshape(q.shape).view(q.dtype)


def test_dequantized_mode_allows_a_few_one_step_differences():
    def few(x, per_token, fp8_dtype, scale_ub=None, num_token_padding=None):
        q, s = dynamic_quant.fn(x, per_token, fp8_dtype, scale_ub, num_token_padding)
        return _flip_low_bits(q, 1000), s  # 0.1% of the elements, one step each

    outcome = check_numerics(*_register_quant(dynamic_quant, "kit_q_few", few), QCASE)
    assert outcome.status == "ok"


def test_dequantized_mode_catches_too_many_differing_elements():
    def many(x, per_token, fp8_dtype, scale_ub=None, num_token_padding=None):
        q, s = dynamic_quant.fn(x, per_token, fp8_dtype, scale_ub, num_token_padding)
        return _flip_low_bits(q, 100), s  # 1% > 0.2%

    with pytest.raises(AssertionError, match=r"quantized elements \(1\.\d\d%\) differ from native"):
        check_numerics(*_register_quant(dynamic_quant, "kit_q_many", many), QCASE)


def test_dequantized_mode_catches_values_far_from_x():
    def far(x, scale, fp8_dtype, num_token_padding=None):
        # A systematic error: q of 0.8 x (every element is off, by more than the 15% allowed)
        return static_quant.fn(x * 0.8, scale, fp8_dtype, num_token_padding)

    options = dict(max_mismatch=1.0)  # with the mismatch bound lifted, dequantized closeness catches it
    spec = static_quant.comparison
    static_quant.set_comparison(type(spec)(**{**spec.__dict__, **options}))
    try:
        with pytest.raises(AssertionError, match=r"dequantized values \(q \* scale\) are not within"):
            check_numerics(*_register_quant(static_quant, "kit_q_far", far), QCASE)
    finally:
        static_quant.set_comparison(spec)


def test_dequantized_mode_catches_wrong_scales_above_the_floor():
    def wrong_scale(x, group_size, column_major, use_ue8m0, fp8_dtype):
        q, s = group_quant.fn(x, group_size, column_major, use_ue8m0, fp8_dtype)
        return q, s * 1.001

    with pytest.raises(AssertionError, match=r"output 1 \(scales\).*above the floor"):
        check_numerics(*_register_quant(group_quant, "kit_q_scale", wrong_scale), Case((4, 256), torch.float32))


def test_dequantized_mode_ignores_scales_at_or_below_the_floor():
    floor = 1.0 / (448 * 512)

    def eps_floor(x, group_size, column_major, use_ue8m0, fp8_dtype):
        # vLLM's kernels floor at 1e-10 / fp8_max: all-zero groups get another scale, the same q.
        q, s = group_quant.fn(x, group_size, column_major, use_ue8m0, fp8_dtype)
        return q, torch.where(s <= floor, torch.full_like(s, 1e-10 / 448), s)

    op, impl = _register_quant(group_quant, "kit_q_floor", eps_floor)
    args = list(op.generate_inputs((4, 256), torch.float32))
    args[0][:, :128] = 0  # one all-zero group per row
    expected, actual = op.fn(*args), eps_floor(*args)
    assert not torch.equal(expected[1], actual[1])
    compare(op, impl, Case((4, 256), torch.float32), actual, expected, tuple(args))


def test_padding_rows_are_not_compared_but_valid_rows_are():
    def garbage_padding(x, scale, fp8_dtype, num_token_padding=None):
        q = static_quant.fn(x, scale, fp8_dtype, num_token_padding).clone()
        q.view(torch.uint8)[x.shape[0] :] = 0x55
        return q

    def wrong_last_row(x, scale, fp8_dtype, num_token_padding=None):
        q = static_quant.fn(x, scale, fp8_dtype, num_token_padding).clone()
        q.view(torch.uint8)[x.shape[0] - 1] ^= 0x08  # a whole row off by a binade
        return q

    case = Case((3, 64), torch.float32, "padded", {"num_token_padding": 8})
    assert check_numerics(*_register_quant(static_quant, "kit_q_pad", garbage_padding, exact=True), case).status == "ok"
    with pytest.raises(AssertionError, match="elements differ from native's bytes"):
        check_numerics(*_register_quant(static_quant, "kit_q_row", wrong_last_row, exact=True), case)


def test_exact_claim_on_a_quant_op_is_bitwise():
    def one_off(x, per_token, fp8_dtype, scale_ub=None, num_token_padding=None):
        q, s = dynamic_quant.fn(x, per_token, fp8_dtype, scale_ub, num_token_padding)
        return _flip_low_bits(q, q.numel() + 1), s  # one element, one step

    # Allowed by the dequantized mode, not under a claim of exactness.
    assert check_numerics(*_register_quant(dynamic_quant, "kit_q_one", one_off), QCASE).status == "ok"
    with pytest.raises(AssertionError, match="1 of 8192 elements differ from native's bytes"):
        check_numerics(*_register_quant(dynamic_quant, "kit_q_one_exact", one_off, exact=True), QCASE)


def test_strides_of_column_major_scales_are_checked():
    def row_major(x, group_size, column_major, use_ue8m0, fp8_dtype):
        q, s = group_quant.fn(x, group_size, column_major, use_ue8m0, fp8_dtype)
        return q, s.contiguous()  # the right values, the wrong layout

    case = Case((5, 64), torch.float32, "column_major", {"group_size": 16, "column_major": True})
    with pytest.raises(AssertionError, match=r"output 1: strides \(4, 1\), native's are \(1, 5\)"):
        check_numerics(*_register_quant(group_quant, "kit_q_layout", row_major), case)


def test_strided_input_must_give_the_bytes_of_a_contiguous_one():
    def layout_dependent(x, scale, fp8_dtype, num_token_padding=None):
        q = static_quant.fn(x, scale, fp8_dtype, num_token_padding)
        return q if x.is_contiguous() else _flip_low_bits(q, q.numel() + 1)

    case = Case((5, 64), torch.float32, row_padding=16)
    with pytest.raises(AssertionError, match="a strided input gives other values than a contiguous copy"):
        check_numerics(*_register_quant(static_quant, "kit_q_strided", layout_dependent), case)


def test_exact_comparison_mode_holds_every_implementation_to_zero_tolerance():
    spec = rms_norm.comparison
    rms_norm.set_comparison(vllm_ir.Comparison("exact"))
    try:

        def ulp_off(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
            out = rms_norm.fn(x, weight, epsilon, variance_size)
            return torch.nextafter(out, torch.full_like(out, float("inf")))

        with pytest.raises(AssertionError, match=r"atol, rtol = \(0\.0, 0\.0\)"):
            check_numerics(*_register("kit_exact_mode", ulp_off), CASE)
    finally:
        rms_norm.set_comparison(spec)


def test_comparison_declarations_are_checked():
    with pytest.raises(vllm_ir.RegistrationError, match="comparison mode must be one of"):
        vllm_ir.Comparison("close enough")
    with pytest.raises(vllm_ir.RegistrationError, match="needs quantized output indices"):
        vllm_ir.Comparison("dequantized")
    with pytest.raises(vllm_ir.RegistrationError, match=r"set_comparison needs a vllm_ir\.Comparison"):
        rms_norm.set_comparison("exact")


def test_fp8_dtype_argument_is_a_key_variation():
    args = static_quant.generate_inputs((3, 64), torch.bfloat16)
    labels = [label for label, _ in key_variations(static_quant, args)]
    assert "fp8_dtype: float8_e4m3fn -> float8_e4m3fnuz" in labels


@pytest.mark.parametrize("small", [False, True], ids=["full", "small"])
@pytest.mark.parametrize(
    ("wrong_from", "where"),
    [(2, "batch of rows"), (38, "-token batch")],
    ids=["any_batch_above_one", "only_the_larger_batch"],
)
def test_batch_dependent_rows_are_caught(small: bool, wrong_from: int, where: str):
    """A kernel claiming batch_invariant=True whose rows change with the token count is caught,
    also when only the larger batch (the one ``small`` shrinks) computes them differently."""

    def variant(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
        out = rms_norm.fn(x, weight, epsilon, variance_size)
        return out * 1.001 if x.shape[0] >= wrong_from else out

    op, impl = _register(f"kit_batch_variant_{wrong_from}_{int(small)}", variant, batch_invariant=True)
    with pytest.raises(AssertionError, match=f"differs between a 37-token batch and .*{where}"):
        check_batch_invariance(op, impl, torch.float32, "default", small=small)


@pytest.mark.parametrize("small", [False, True], ids=["full", "small"])
def test_batch_invariant_kernel_passes(small: bool):
    op, impl = _register(f"kit_batch_invariant_{int(small)}", batch_invariant=True)
    assert check_batch_invariance(op, impl, torch.float32, "default", small=small) == "checked"
