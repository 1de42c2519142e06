"""rms_norm and fused_add_rms_norm mean what vLLM 0.33.0's ops mean, bit for bit, on every CPU provider.

vLLM's expression (``vllm/ir/ops/layernorm.py``, written out below as vLLM's code): normalize in
fp32, ``x.to(weight.dtype) * weight`` when there is a weight, ``.to(orig_dtype)``: the result is
always in x's dtype, and a weight of another dtype multiplies in the weight's dtype. The native
functions must equal it for every x dtype x weight dtype x variance_size x hidden size. The
providers sum squares in their own order, which moves the mean by an fp32 ulp on random data;
on inputs whose sum of squares is exact in any order (small integers), every provider must
give vLLM's bits, so a wrong rounding point (rounding before the weight, or promoting) shows as
a difference. vLLM's own functions are compared in tests/test_vllm_bridge.py (its venv).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor

import vllm_ir
from vllm_ir.testing import provider_impls

RMS = vllm_ir.ops.rms_norm
FUSED = vllm_ir.ops.fused_add_rms_norm
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: None: no weight; "same": x's dtype; else that dtype.
WEIGHTS = (None, "same", torch.float32, torch.bfloat16, torch.float16)
HIDDEN = (1, 7, 64, 67, 1000)


# vLLM 0.33.0's native functions (vllm/ir/ops/layernorm.py), verbatim but for the decorator.
def vllm_rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    x_var = x if variance_size is None else x[..., :variance_size]
    variance = x_var.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + epsilon)
    if weight is not None:
        x = x.to(weight.dtype) * weight
    return x.to(orig_dtype)


def vllm_fused_add_rms_norm(
    x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> tuple[Tensor, Tensor]:
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    x = x + x_residual.to(torch.float32)
    x_residual = x.to(orig_dtype)

    x_var = x if variance_size is None else x[..., :variance_size]
    variance = x_var.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + epsilon)
    if weight is not None:
        x = x.to(weight.dtype) * weight
    return x.to(orig_dtype), x_residual


def _bits(t: Tensor) -> Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bits(actual, expected) -> None:
    actual = actual if isinstance(actual, tuple) else (actual,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape, (a.dtype, e.dtype, a.shape, e.shape)
        different = (_bits(a) != _bits(e)) & ~(a.isnan() & e.isnan())
        assert not different.any(), f"{int(different.sum())} of {a.numel()} elements differ, first at " + str(
            different.nonzero()[0].tolist()
        )


def _weight(hidden: int, dtype: torch.dtype, which, g: torch.Generator) -> Tensor | None:
    if which is None:
        return None
    w = 1.0 + 0.1 * torch.randn(hidden, generator=g)
    return w.to(dtype if which == "same" else which)


def _random(shape, dtype, g) -> Tensor:
    return (3 * torch.randn(shape, generator=g)).to(dtype)


def _exact_sum(shape, dtype, g) -> Tensor:
    """Integers in [-8, 8]: squares and their sums are exact in fp32 in any order."""
    return torch.randint(-8, 9, shape, generator=g).to(dtype)


# ---------------------------------------------------------------------------------------
# the declarations


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("which", WEIGHTS, ids=str)
def test_native_is_vllms_expression_bit_for_bit(dtype, which):
    g = torch.Generator().manual_seed(0)
    for hidden in HIDDEN:
        x, r = _random((5, hidden), dtype, g), _random((5, hidden), dtype, g)
        w = _weight(hidden, dtype, which, g)
        for variance_size in (None, max(1, hidden // 2)):
            assert_same_bits(RMS.fn(x, w, 1e-6, variance_size), vllm_rms_norm(x, w, 1e-6, variance_size))
            assert_same_bits(
                FUSED.fn(x, r, w, 1e-6, variance_size), vllm_fused_add_rms_norm(x, r, w, 1e-6, variance_size)
            )


def test_a_bf16_input_with_an_fp32_weight_gives_bf16_from_one_fp32_multiply():
    x = torch.randn(16, 4096, dtype=torch.bfloat16)
    w = 1.0 + 0.1 * torch.randn(4096)
    y = vllm_ir.ops.rms_norm(x, w, 1e-6)
    assert y.dtype == torch.bfloat16
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(y, (normed * w).bfloat16())
    # Rounding to bf16 before the multiply (vllm-ir before vLLM 0.33's semantics) differs.
    assert not torch.equal(y, (normed.bfloat16().float() * w).bfloat16())


def test_fused_normalizes_the_fp32_sum_where_the_rounded_sum_overflows():
    x = torch.full((1, 64), 60000.0, dtype=torch.float16)
    y, residual = FUSED.fn(x, x.clone(), torch.ones(64, dtype=torch.float16), 1e-6)
    assert torch.equal(y, torch.ones(1, 64, dtype=torch.float16))
    assert residual.isinf().all()


# ---------------------------------------------------------------------------------------
# the CPU providers


def _providers() -> list[str]:
    """The CPU providers installed and usable here (triton through its interpreter)."""
    found = []
    for provider in ("aten", "vllm_c", "triton"):
        try:
            provider_impls(provider)
        except vllm_ir.PluginError:
            continue
        impl = RMS.impls.get(provider)
        if impl is not None and impl.supported:
            found.append(provider)
    return found


PROVIDERS = _providers()
#: Providers whose kernels sum squares in native's order: bit for bit on any input.
SAME_ORDER = {"aten"}


def _run(op, provider: str, args: tuple, inplace: bool = False):
    with vllm_ir.priority(**{op.name: [provider]}), warnings.catch_warnings():
        warnings.simplefilter("error", vllm_ir.FallbackWarning)
        assert op.dispatch(*args).provider == provider, op.explain(*args)
        if inplace:
            return op.maybe_inplace(*(a.clone() if isinstance(a, Tensor) else a for a in args))
        return op(*args)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("which", [None, "same", torch.float32], ids=str)
def test_providers_give_vllms_bits(provider, dtype, which):
    """Both ops, both overloads, odd hidden sizes; random inputs where the provider reduces in
    native's order, sums exact in any order otherwise."""
    make = _random if provider in SAME_ORDER else _exact_sum
    g = torch.Generator().manual_seed(1)
    for hidden in HIDDEN:
        x, r = make((9, hidden), dtype, g), make((9, hidden), dtype, g)
        w = _weight(hidden, dtype, which, g)
        assert_same_bits(_run(RMS, provider, (x, w, 1e-6)), vllm_rms_norm(x, w, 1e-6))
        if provider == "aten" and dtype != torch.float32:
            continue  # declined (test_aten_declines_a_16_bit_fused_add_rms_norm_with_the_reason)
        expected = vllm_fused_add_rms_norm(x, r, w, 1e-6)
        assert_same_bits(_run(FUSED, provider, (x, r, w, 1e-6)), expected)
        assert_same_bits(_run(FUSED, provider, (x, r, w, 1e-6), inplace=True), expected)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_providers_are_within_tolerance_on_random_inputs_with_an_fp32_weight(provider):
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.bfloat16, torch.float16):
        x, r = _random((33, 4096), dtype, g), _random((33, 4096), dtype, g)
        w = _weight(4096, dtype, torch.float32, g)
        atol, rtol = RMS.tolerance(dtype)
        torch.testing.assert_close(_run(RMS, provider, (x, w, 1e-6)), vllm_rms_norm(x, w, 1e-6), atol=atol, rtol=rtol)
        if provider == "aten":
            continue  # 16-bit fused: declined
        got_fused = _run(FUSED, provider, (x, r, w, 1e-6))
        for got, want in zip(got_fused, vllm_fused_add_rms_norm(x, r, w, 1e-6), strict=True):
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.skipif("aten" not in PROVIDERS, reason="providers/native is not installed")
@pytest.mark.parametrize("which", WEIGHTS, ids=str)
def test_aten_gives_vllms_bits_for_every_weight_dtype(which):
    g = torch.Generator().manual_seed(3)
    for dtype in DTYPES:
        x, r = _random((4, 3, 67), dtype, g), _random((4, 3, 67), dtype, g)
        w = _weight(67, dtype, which, g)
        assert_same_bits(_run(RMS, "aten", (x, w, 1e-6)), vllm_rms_norm(x, w, 1e-6))
        if dtype == torch.float32:
            expected = vllm_fused_add_rms_norm(x, r, w, 1e-6)
            assert_same_bits(_run(FUSED, "aten", (x, r, w, 1e-6), inplace=True), expected)


@pytest.mark.skipif("aten" not in PROVIDERS, reason="providers/native is not installed")
def test_aten_declines_a_16_bit_fused_add_rms_norm_with_the_reason():
    """The op normalizes the fp32 sum (fp16 60000 + 60000 gives 1.0, not a rounded sum's NaN):
    ATen ops can hold it only in fp32 temporaries, which an in-place kernel may not allocate.
    Native runs it instead, with the fp32 sum."""
    x = torch.full((1, 64), 60000.0, dtype=torch.float16)
    args = (x, x.clone(), torch.ones(64, dtype=torch.float16), 1e-6)
    with vllm_ir.priority(fused_add_rms_norm=["aten"]):
        verdict = FUSED.explain(*args).verdicts[0]
        assert verdict.provider == "aten" and "float32 sum" in str(verdict.reason), verdict
        y, residual = FUSED.maybe_inplace(*(a.clone() if isinstance(a, Tensor) else a for a in args))
    assert torch.equal(y, torch.ones(1, 64, dtype=torch.float16)) and residual.isinf().all()


@pytest.mark.skipif("vllm_c" not in PROVIDERS, reason="vllm_c kernels not usable")
@pytest.mark.parametrize("which", [torch.bfloat16, torch.float16], ids=str)
def test_vllm_c_declines_a_weight_of_a_third_dtype_with_the_reason(which):
    x = torch.randn(3, 16)
    w = torch.ones(16, dtype=which)
    with vllm_ir.priority(rms_norm=["vllm_c"]):
        verdict = next(v for v in RMS.explain(x, w, 1e-6).verdicts if v.provider == "vllm_c")
    assert verdict.status == "declined" and f"weight dtype {which} is neither x's" in verdict.reason, verdict
