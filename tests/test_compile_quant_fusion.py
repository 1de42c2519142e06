"""Norm + FP8 quant fusion over IR nodes under real torch.compile runs (core/passes/quant_fusion.py).

The fused ops' kernels come from providers/vllm_c: fusion happens only where the compile-mode
priority runs a non-native fused op, so these tests set ``vllm_c`` first and check the record
(applied and rejected candidates), the kernel lowering picked and the values against the
unfused model.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import vllm_ir
from tests.compile_models import compile_with_passes, load_installed_provider, passes_always_run

if importlib.util.find_spec("vllm_ir_provider_vllm_c") is None:
    pytest.skip("providers/vllm_c is not installed (scripts/setup.sh installs it)", allow_module_level=True)

ops = vllm_ir.ops
FP8 = torch.float8_e4m3fn
FUSED = (
    "rms_norm_static_fp8_quant",
    "fused_add_rms_norm_static_fp8_quant",
    "rms_norm_dynamic_per_token_fp8_quant",
    "silu_and_mul_static_fp8_quant",
    "rms_norm_group_fp8_quant",
    "silu_and_mul_group_fp8_quant",
)
UNFUSED = (
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "static_quant_fp8",
    "dynamic_quant_fp8",
    "dynamic_group_quant_fp8",
)
VLLM_C_FIRST = {name: ["vllm_c"] for name in FUSED + UNFUSED}
#: As above, but silu_and_mul_static_fp8_quant left at the default compile priority (native only).
NO_SILU_QUANT = {name: p for name, p in VLLM_C_FIRST.items() if name != "silu_and_mul_static_fp8_quant"}


@pytest.fixture(scope="module", autouse=True)
def _vllm_c_and_fresh_compiles():
    """vllm_c loaded before `clean_state` snapshots the registry (so it stays for every test),
    and Inductor's graph caches off so that every compile runs the passes."""
    reason = load_installed_provider("vllm_c")
    if reason is not None:
        pytest.skip(reason)
    with passes_always_run():
        yield


#: Fusions in `_model`.
PAIRS = 8


def _model(eps: float):
    """Every fusable pattern once: norm+static, add+norm+static, norm+dynamic (with ub),
    add+norm+dynamic, silu_and_mul+static, norm+group, add+norm+group (column-major UE8M0
    scales) and silu_and_mul+group."""

    def model(x, r, w, scale, ub, g):
        q1 = ops.static_quant_fp8(ops.rms_norm(x, w, eps), scale, FP8)
        y, r2 = ops.fused_add_rms_norm(x, r, w, eps)
        q2 = ops.static_quant_fp8(y, scale, FP8)
        q3, s3 = ops.dynamic_quant_fp8(ops.rms_norm(r2, w, eps), True, FP8, ub)
        y4, r4 = ops.fused_add_rms_norm(x, r2, w, eps)
        q4, s4 = ops.dynamic_quant_fp8(y4, True, FP8)
        q5 = ops.static_quant_fp8(ops.silu_and_mul(g), scale, FP8)
        q6, s6 = ops.dynamic_group_quant_fp8(ops.rms_norm(r4, w, eps), 16, False, False, FP8)
        y7, r7 = ops.fused_add_rms_norm(x, r4, w, eps)
        q7, s7 = ops.dynamic_group_quant_fp8(y7, 16, True, True, FP8)
        q8, s8 = ops.dynamic_group_quant_fp8(ops.silu_and_mul(g), 32, False, False, FP8)
        return q1, q2, r2, q3, s3, q4, s4, r4, q5, q6, s6, q7, s7, r7, q8, s8

    return model


def _inputs(dtype: torch.dtype, weight_dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 64, generator=g).to(dtype)
    r = torch.randn(5, 64, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(weight_dtype)
    scale = torch.tensor([0.02])
    ub = torch.tensor([3.0])
    gate_up = (2 * torch.randn(5, 128, generator=g)).to(dtype)
    return x, r, w, scale, ub, gate_up


def _assert_same_dequantized(out, expected, dtype=torch.float32):
    """q by dequantized value (one fp8 step apart at most on rare elements), the rest with
    ``dtype``'s tolerance (a dynamic scale moves with one ulp of y in the model dtype)."""
    tol = {} if dtype == torch.float32 else {"atol": 1e-5, "rtol": 1.6e-2}
    for i, (a, b) in enumerate(zip(out, expected, strict=True)):
        if a.dtype == FP8:
            fa, fb = a.float(), b.float()
            step = fb.abs().clamp(min=2**-6) / 8  # one e4m3 step at b's binade, at least
            assert ((fa - fb).abs() <= step + 1e-6).all(), f"output {i}"
            # Near a rounding boundary a one-ulp difference of y (Inductor's reduction order vs
            # the kernel's) moves q one step: a few percent of these small tensors at most.
            assert (fa != fb).float().mean() < 0.05, f"output {i}: too many fp8 elements differ"
        else:
            tols = tol if a.dtype == torch.float32 else {}
            torch.testing.assert_close(a, b, **tols, msg=lambda m, i=i: f"output {i}: {m}")


@pytest.mark.filterwarnings("ignore::vllm_ir.FallbackWarning")  # unfused vllm_c norms decline fp32 weights
@pytest.mark.parametrize(
    ("eps", "dtype", "weight_dtype"),
    [
        (1e-5, torch.bfloat16, torch.bfloat16),
        (1e-6, torch.float32, torch.float32),
        (3e-4, torch.bfloat16, torch.float32),  # any epsilon; Gemma-style fp32 weight with bf16 x
    ],
)
def test_norm_quant_pairs_fuse_under_vllm_c_priority(eps, dtype, weight_dtype):
    model = _model(eps)
    args = _inputs(dtype, weight_dtype)
    with vllm_ir.priority(**VLLM_C_FIRST):
        unfused, _ = compile_with_passes(model, fusions=[])
        expected = unfused(*args)
        compiled, record = compile_with_passes(model)
        out = compiled(*args)
    _assert_same_dequantized(out, expected, dtype)
    _assert_same_dequantized(out, model(*args), dtype)  # eager, unfused, native-equivalent kernels
    assert out[12].stride() == expected[12].stride() == (1, 5)  # column-major group scales stay so
    report = record.graphs[0]
    fused = [f for f in report.fusions if f.startswith("quant:")]
    assert len(fused) == PAIRS and not report.fusions_rejected, (report.fusions, report.fusions_rejected)
    assert set(report.selected_impls) == set(FUSED)
    assert all(p == "vllm_c" for op in FUSED for p in report.selected_impls[op].values())


def test_a_fused_op_only_native_would_run_stays_unfused():
    """Without vllm_c first for silu_and_mul_static_fp8_quant, its pair stays unfused (and the
    unfused ops keep their vllm_c kernels); the record says why."""
    model = _model(1e-6)
    args = _inputs(torch.bfloat16, torch.bfloat16)
    with vllm_ir.priority(**NO_SILU_QUANT):
        compiled, record = compile_with_passes(model)
        _assert_same_dequantized(compiled(*args), model(*args), torch.bfloat16)
    report = record.graphs[0]
    assert len([f for f in report.fusions if f.startswith("quant:")]) == PAIRS - 1
    (rejected,) = report.fusions_rejected
    assert "silu_and_mul" in rejected and "only the native silu_and_mul_static_fp8_quant" in rejected
    assert report.selected_impls["silu_and_mul"] and report.selected_impls["static_quant_fp8"]


def test_default_compile_priority_leaves_pairs_unfused_with_reasons():
    """Under the default compile priority (native first: vllm_c is eager-only) nothing fuses."""
    model = _model(1e-6)
    args = _inputs(torch.float32, torch.float32)
    compiled, record = compile_with_passes(model)
    _assert_same_dequantized(compiled(*args), model(*args))
    report = record.graphs[0]
    assert not [f for f in report.fusions if f.startswith("quant:")]
    assert len(report.fusions_rejected) == PAIRS
    assert all("only the native" in r for r in report.fusions_rejected)


@pytest.mark.filterwarnings("ignore::vllm_ir.FallbackWarning")  # vllm_c's rms_norm declines variance_size
def test_other_uses_of_the_intermediate_and_unsupported_calls_are_rejected_with_reasons():
    def model(x, w, scale, per_channel):
        y = ops.rms_norm(x, w, 1e-6)
        q1 = ops.static_quant_fp8(y, scale, FP8)  # y is also returned: not fused
        q2 = ops.static_quant_fp8(ops.rms_norm(x * 2, w, 1e-6), per_channel, FP8)  # no kernel: per-channel
        q3, s3 = ops.dynamic_quant_fp8(ops.rms_norm(x * 3, w, 1e-6), False, FP8)  # per-tensor dynamic
        q4 = ops.static_quant_fp8(ops.rms_norm(x * 4, w, 1e-6, 16), scale, FP8)  # variance_size
        return y, q1, q2, q3, s3, q4

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 32, generator=g), 1 + 0.1 * torch.randn(32, generator=g)
    scale, per_channel = torch.tensor([0.05]), torch.full((1, 32), 0.05)
    with vllm_ir.priority(**VLLM_C_FIRST):
        compiled, record = compile_with_passes(model)
        out = compiled(x, w, scale, per_channel)
    _assert_same_dequantized(out, model(x, w, scale, per_channel))
    report = record.graphs[0]
    assert not [f for f in report.fusions if f.startswith("quant:")]
    reasons = "\n".join(report.fusions_rejected)
    assert len(report.fusions_rejected) == 4, reasons
    assert "has other uses" in reasons
    assert "per-tensor scale (one element)" in reasons  # the vllm_c predicate's reason, via the priority
    assert "per-tensor dynamic quant" in reasons
    assert "variance_size=16" in reasons
    assert report.selected_impls["rms_norm"] and report.selected_impls["static_quant_fp8"]


def test_record_of_a_compiled_function_lists_fusions_and_rejections():
    def model(x, w, scale, g):
        return ops.static_quant_fp8(ops.rms_norm(x, w, 1e-6), scale, FP8), ops.static_quant_fp8(
            ops.silu_and_mul(g), scale, FP8
        )

    torch._dynamo.reset()
    x, w, scale, g = torch.randn(3, 32), torch.ones(32), torch.tensor([0.05]), torch.randn(3, 64)
    with vllm_ir.priority(**NO_SILU_QUANT):
        compiled = vllm_ir.passes.compile(model)
        compiled(x, w, scale, g)
    record = vllm_ir.passes.record_of(compiled)
    (report,) = record.graphs
    assert len(report.fusions) == 1 and "rms_norm_static_fp8_quant" in report.fusions[0]
    assert len(report.fusions_rejected) == 1 and "silu_and_mul" in report.fusions_rejected[0]


def test_a_donating_fused_add_rms_norm_fuses_and_returns_the_right_residual():
    """``fused_add_rms_norm.maybe_inplace`` + quant fuses (the fused node inherits the donation),
    and q and the returned residual match the unfused eager run."""

    def model(x, r, w, scale):
        y, r2 = ops.fused_add_rms_norm.maybe_inplace(x, r, w, 1e-6)
        return ops.static_quant_fp8(y, scale, FP8), r2

    g = torch.Generator().manual_seed(2)
    x, r = torch.randn(4, 64, generator=g).bfloat16(), torch.randn(4, 64, generator=g).bfloat16()
    w, scale = torch.ones(64, dtype=torch.bfloat16), torch.tensor([0.02])
    expected = model(x.clone(), r.clone(), w, scale)
    with vllm_ir.priority(**VLLM_C_FIRST):
        compiled, record = compile_with_passes(model)
        out = compiled(x.clone(), r.clone(), w, scale)
    _assert_same_dequantized(out, expected, torch.bfloat16)
    report = record.graphs[0]
    assert report.selected_impls["fused_add_rms_norm_static_fp8_quant"]
    assert "fused_add_rms_norm_static_fp8_quant" in report.fusions[0]
