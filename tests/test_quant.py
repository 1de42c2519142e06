"""FP8 quant ops: declared semantics, the vllm_c kernels' encoding and layouts, and dispatch
keyed on the fp8 dtype argument. The conformance kit (tests/test_conformance_vllm_c.py) covers
the grid; this file covers what the grid does not state directly."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor

import vllm_ir
from vllm_ir.ir.dispatch import fast_lookup

# Imported at collection, before conftest's per-test registry snapshot: every test sees vllm_c.
try:
    import vllm_ir_provider_vllm_c as provider
except ImportError:
    provider = None
needs_vllm_c = pytest.mark.skipif(
    provider is None or not provider.STATUS.loaded,
    reason=f"vllm_c kernels not usable: {provider.STATUS.reason if provider else 'not installed'}",
)
FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
BOUND = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 224.0}


def _vllm_c():
    return torch.ops.vllm_ir_c


@needs_vllm_c
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_kernel_encoding_matches_torch_cast_over_the_float_range(fp8_dtype):
    """Every ~4099th float32 bit pattern (all exponents, NaN, inf, subnormals, -0)."""
    c = _vllm_c()
    bits = torch.arange(0, 2**32, 4099, dtype=torch.int64).to(torch.int32)
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, float("nan"), float("inf"), -float("inf")])
    x = torch.cat([bits.view(torch.float32), special]).reshape(1, -1)
    out = torch.empty(x.shape, dtype=fp8_dtype)
    c.static_quant_fp8(out, x, torch.ones(1))
    expected = x.clamp(-BOUND[fp8_dtype], BOUND[fp8_dtype]).to(fp8_dtype)
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))


def _every_bf16(shuffled: bool, hidden: int) -> Tensor:
    """All 65536 bf16 bit patterns (NaN, inf, subnormals, -0), padded to rows of `hidden`."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    if shuffled:
        x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))]
    rows = -(-x.numel() // hidden)
    return torch.cat([x, torch.ones(rows * hidden - x.numel(), dtype=torch.bfloat16)]).reshape(rows, hidden)


# Scales around the table path's limits (inv in [2^-60, 2^60]), ordinary ones, and ones it declines.
TABLE_SCALES = [1.0, 1 / 448, 0.01234, 3.0, 123.4, 2.0**-60, 2.0**60, 2.0**-61, 2.0**61, 1e-30, 1e30, -0.5]


@needs_vllm_c
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("shuffled", [False, True], ids=["sorted", "shuffled"])
def test_bf16_table_path_matches_torch_for_every_bf16_value(fp8_dtype, shuffled):
    """bf16 rows of >= 512 go through a lookup table on AVX512 CPUs (bytes with VBMI, 16-bit
    words for the last 32 of a 1056-wide row): the fast path is differential-tested against
    torch's own cast over every bf16 value and scales at and beyond the table's limits, static
    per-tensor and per-token scales, dynamic per-token and per-tensor quant, and group quant
    (a table per group of 64 or 128, with NaN and inf in some groups)."""
    c = _vllm_c()
    bound = BOUND[fp8_dtype]
    for hidden in (1056, 4096):
        x = _every_bf16(shuffled, hidden)
        for s in TABLE_SCALES:
            scale = torch.tensor([s])
            out = torch.empty(x.shape, dtype=fp8_dtype)
            c.static_quant_fp8(out, x, scale)
            expected = (x.float() * (1.0 / scale)).clamp(-bound, bound).to(fp8_dtype)
            assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8)), (hidden, s)
        per_token = torch.logspace(-6, 6, x.shape[0]).unsqueeze(1)
        out = torch.empty(x.shape, dtype=fp8_dtype)
        c.static_quant_fp8(out, x, per_token)
        expected = (x.float() * (1.0 / per_token)).clamp(-bound, bound).to(fp8_dtype)
        assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
        # Dynamic scales: rows without NaN/inf, spread over many magnitudes.
        finite = x.float().isfinite().all(dim=1)
        y = (x[finite].float() * torch.logspace(-20, 20, int(finite.sum())).unsqueeze(1)).bfloat16()
        for per_token_scales in (True, False):
            with vllm_ir.priority(dynamic_quant_fp8=["vllm_c"]):
                q, scales = vllm_ir.ops.dynamic_quant_fp8(y, per_token_scales, fp8_dtype)
            expected_q, expected_s = vllm_ir.ops.dynamic_quant_fp8.fn(y, per_token_scales, fp8_dtype)
            assert torch.equal(scales, expected_s)
            assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))
        for group_size in (64, 128):  # a table per group
            for ue8m0 in (False, True):
                args = (x, group_size, False, ue8m0, fp8_dtype)
                with vllm_ir.priority(dynamic_group_quant_fp8=["vllm_c"]):
                    q, scales = vllm_ir.ops.dynamic_group_quant_fp8(*args)
                expected_q, expected_s = vllm_ir.ops.dynamic_group_quant_fp8.fn(*args)
                torch.testing.assert_close(scales, expected_s, rtol=0, atol=0, equal_nan=True)
                nan = q.float().isnan() & expected_q.float().isnan()  # NaN groups: any NaN code
                assert ((q.view(torch.uint8) == expected_q.view(torch.uint8)) | nan).all(), (group_size, ue8m0)


@needs_vllm_c
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_table_caches_give_the_same_bytes_when_scales_collide_and_repeat(fp8_dtype):
    """The table path keeps each thread's tables by the scale reciprocal's mantissa (1024 slots)
    and by binade offset (128 slots): thousands of distinct per-token scales over many binades
    collide in both, a repeated pass reuses them, and groups whose absmaxes differ row to row
    reuse them across rows; every byte must still be torch's."""
    c = _vllm_c()
    bound = BOUND[fp8_dtype]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=g).bfloat16()
    scales = torch.exp2(torch.empty(4096, 1).uniform_(-50, 50, generator=g)) * torch.rand(4096, 1, generator=g).add(1)
    expected = (x.float() * (1.0 / scales)).clamp(-bound, bound).to(fp8_dtype)
    for _ in range(2):
        out = torch.empty(x.shape, dtype=fp8_dtype)
        c.static_quant_fp8(out, x, scales)
        assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    magnitudes = torch.exp2(torch.randint(-30, 30, (64, 32), generator=g).float()).repeat_interleave(128, dim=1)
    y = (torch.randn(64, 4096, generator=g) * magnitudes).bfloat16()
    for use_ue8m0 in (False, True):
        args = (y, 128, False, use_ue8m0, fp8_dtype)
        with vllm_ir.priority(dynamic_group_quant_fp8=["vllm_c"]):
            q, s = vllm_ir.ops.dynamic_group_quant_fp8(*args)
        expected_q, expected_s = vllm_ir.ops.dynamic_group_quant_fp8.fn(*args)
        assert torch.equal(s, expected_s)
        assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8)), use_ue8m0


def test_fnuz_clamps_to_224_and_e4m3fn_to_448():
    x = torch.tensor([[1000.0, -1000.0, 230.0]])
    q = vllm_ir.ops.static_quant_fp8(x, torch.ones(1), torch.float8_e4m3fnuz)
    assert q.float().tolist() == [[224.0, -224.0, 224.0]]
    q = vllm_ir.ops.static_quant_fp8(x, torch.ones(1), torch.float8_e4m3fn)
    assert q.float().tolist() == [[448.0, -448.0, 224.0]]


def test_dynamic_scales_have_the_floor_and_the_upper_bound():
    x = torch.zeros(2, 8)
    x[1] = 100.0
    q, s = vllm_ir.ops.dynamic_quant_fp8(x, True, torch.float8_e4m3fn)
    assert s[0].item() == pytest.approx(1 / (448 * 512)) and s[1].item() == pytest.approx(100 / 448)
    q, s = vllm_ir.ops.dynamic_quant_fp8(x, True, torch.float8_e4m3fn, torch.tensor([10.0]))
    assert s[1].item() == pytest.approx(10 / 448) and q[1].float().max().item() == 448.0
    q, s = vllm_ir.ops.dynamic_quant_fp8(x, False, torch.float8_e4m3fn)
    assert s.shape == (1,) and s.item() == pytest.approx(100 / 448)


def test_ue8m0_scales_are_powers_of_two_at_least_the_plain_scale():
    x = torch.randn(4, 256)
    _, plain = vllm_ir.ops.dynamic_group_quant_fp8(x, 64, False, False, torch.float8_e4m3fn)
    _, pow2 = vllm_ir.ops.dynamic_group_quant_fp8(x, 64, False, True, torch.float8_e4m3fn)
    mantissa, _ = torch.frexp(pow2)
    assert (mantissa == 0.5).all() and (pow2 >= plain).all() and (pow2 < 2 * plain).all()


def test_static_quant_is_scale_invariant():
    x = torch.randn(16, 128)
    s = torch.tensor([0.01])
    a = vllm_ir.ops.static_quant_fp8(x, s, torch.float8_e4m3fn)
    b = vllm_ir.ops.static_quant_fp8(2 * x, 2 * s, torch.float8_e4m3fn)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_an_unsupported_fp8_dtype_is_an_error_naming_the_op():
    with pytest.raises(ValueError, match=r"static_quant_fp8: fp8_dtype must be one of .*float8_e5m2"):
        vllm_ir.ops.static_quant_fp8(torch.ones(2, 4), torch.ones(1), torch.float8_e5m2)


@needs_vllm_c
@pytest.mark.parametrize("column_major", [False, True])
def test_group_scales_layout_and_padding_rows(column_major):
    _vllm_c()
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    with vllm_ir.priority(dynamic_group_quant_fp8=["vllm_c"]):
        assert vllm_ir.ops.dynamic_group_quant_fp8.dispatch(x, 128, column_major, False, FP8[0]).provider == "vllm_c"
        q, s = vllm_ir.ops.dynamic_group_quant_fp8(x, 128, column_major, False, FP8[0])
    assert s.shape == (5, 2) and s.stride() == ((1, 5) if column_major else (2, 1))
    expected_q, expected_s = vllm_ir.ops.dynamic_group_quant_fp8.fn(x, 128, column_major, False, FP8[0])
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8)) and torch.equal(s, expected_s)


@needs_vllm_c
def test_padded_q_has_the_padding_rows_and_exact_valid_rows():
    _vllm_c()
    x = torch.randn(3, 64)
    with vllm_ir.priority(dynamic_quant_fp8=["vllm_c"]):
        q, s = vllm_ir.ops.dynamic_quant_fp8(x, True, FP8[0], None, 8)
    expected, _ = vllm_ir.ops.dynamic_quant_fp8.fn(x, True, FP8[0], None, 8)
    assert q.shape == (8, 64) and s.shape == (3, 1)
    assert torch.equal(q[:3].view(torch.uint8), expected[:3].view(torch.uint8))


@needs_vllm_c
def test_kernel_errors_name_the_op_and_what_is_wrong():
    c = _vllm_c()
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="vllm_ir_c::static_quant_fp8: out must be float8_e4m3fn or"):
        c.static_quant_fp8(torch.empty(4, 64), x, torch.ones(1))
    with pytest.raises(RuntimeError, match=r"vllm_ir_c::static_quant_fp8: scale of shape \[3, 1\] does not divide"):
        c.static_quant_fp8(torch.empty(4, 64, dtype=FP8[0]), x, torch.ones(3, 1))
    with pytest.raises(RuntimeError, match="vllm_ir_c::dynamic_group_quant_fp8: scales has shape"):
        c.dynamic_group_quant_fp8(torch.empty(4, 64, dtype=FP8[0]), torch.empty(4, 3), x, 16, False)


@needs_vllm_c
def test_predicates_say_why_they_decline():
    _vllm_c()
    op = vllm_ir.ops.static_quant_fp8
    x = torch.randn(4, 64)
    with vllm_ir.priority(static_quant_fp8=["vllm_c"]):
        (verdict, *_) = op.explain(x, torch.ones(1), torch.float8_e5m2).verdicts
        assert "fp8_dtype torch.float8_e5m2 is not float8_e4m3fn" in verdict.reason
        (verdict, *_) = op.explain(x, torch.ones(1, dtype=torch.float64), FP8[0]).verdicts
        assert "scale dtype torch.float64" in verdict.reason


def _only_e4m3fn(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, num_token_padding: int | None = None):
    return fp8_dtype == torch.float8_e4m3fn or vllm_ir.Unsupported("e4m3fn only")


@pytest.mark.parametrize("first", FP8)
def test_e4m3fn_and_e4m3fnuz_calls_never_share_a_cached_decision(first):
    """The decision cache (the compiled lookup where it is built, else the Python key) keys on
    the dtype argument: after either dtype's decision is cached, the other gets its own."""
    op = vllm_ir.ops.static_quant_fp8
    calls = []

    def kernel(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, num_token_padding: int | None = None) -> Tensor:
        calls.append(fp8_dtype)
        return op.fn(x, scale, fp8_dtype, num_token_padding)

    op.register_impl("only_e4m3fn", supports_args=_only_e4m3fn)(kernel)
    second = FP8[1] if first == FP8[0] else FP8[0]
    x, s = torch.randn(3, 64), torch.ones(1)
    with vllm_ir.priority(static_quant_fp8=["only_e4m3fn"]), warnings.catch_warnings():
        warnings.simplefilter("ignore", vllm_ir.FallbackWarning)
        for dtype in (first, second, first, second):
            calls.clear()
            op(x, s, dtype)
            assert calls == ([dtype] if dtype == torch.float8_e4m3fn else [])
            expected = "only_e4m3fn" if dtype == torch.float8_e4m3fn else "native"
            assert op.cached_dispatch(x, s, dtype).provider == expected
    assert fast_lookup.available() or fast_lookup.unavailable_reason


@needs_vllm_c
@pytest.mark.slow
def test_a_tensor_beyond_32_bit_byte_offsets():
    """vLLM's int32-overflow regression shape: 1,024,000 x 1,152 bf16 (2.36 GB in, 1.18 GB out)."""
    _vllm_c()
    rows, hidden = 1_024_000, 1_152
    x = torch.empty(rows, hidden, dtype=torch.bfloat16).uniform_(-4, 4)
    x[-1, -1] = 100.0  # the last element decides the last row's scale
    with vllm_ir.priority(dynamic_quant_fp8=["vllm_c"]):
        q, s = vllm_ir.ops.dynamic_quant_fp8(x, True, FP8[0])
    for lo in (0, rows // 2, rows - 4096):
        eq, es = vllm_ir.ops.dynamic_quant_fp8.fn(x[lo : lo + 4096], True, FP8[0])
        assert torch.equal(q[lo : lo + 4096].view(torch.uint8), eq.view(torch.uint8))
        assert torch.equal(s[lo : lo + 4096], es)
    assert s[-1].item() == pytest.approx(100 / 448)


@needs_vllm_c
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("hidden", [200, 1056, 4096])
def test_fused_quant_kernels_equal_the_unfused_vllm_c_chain(fp8_dtype, hidden):
    """The fused kernels encode y as the quant kernels do (bf16 rows and groups of >= 64 through
    the lookup tables, checked above over every bf16 value): byte-identical to vllm_c's norm or
    silu_and_mul followed by vllm_c's quant, over rows of magnitudes 1e-3..1e3."""
    _vllm_c()
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(33, hidden, generator=g) * torch.logspace(-3, 3, 33).unsqueeze(1)).bfloat16()
    residual = torch.randn(33, hidden, generator=g).bfloat16()
    w = (torch.rand(hidden, generator=g) + 0.5).bfloat16()
    scale = torch.tensor([0.0123])
    ops = vllm_ir.ops
    names = (
        "rms_norm fused_add_rms_norm silu_and_mul static_quant_fp8 dynamic_quant_fp8 rms_norm_static_fp8_quant "
        "fused_add_rms_norm_static_fp8_quant rms_norm_dynamic_per_token_fp8_quant silu_and_mul_static_fp8_quant"
    )
    with vllm_ir.priority(**{name: ["vllm_c"] for name in names.split()}):

        def same(a: Tensor, b: Tensor) -> bool:
            return torch.equal(
                a.view(torch.uint8) if a.dtype == fp8_dtype else a, b.view(torch.uint8) if b.dtype == fp8_dtype else b
            )

        y = ops.rms_norm(x, w, 1e-6)
        assert same(
            ops.rms_norm_static_fp8_quant(x, w, 1e-6, scale, fp8_dtype), ops.static_quant_fp8(y, scale, fp8_dtype)
        )
        q, s, _ = ops.rms_norm_dynamic_per_token_fp8_quant(x, None, w, 1e-6, fp8_dtype)
        expected_q, expected_s = ops.dynamic_quant_fp8(y, True, fp8_dtype)
        assert same(q, expected_q) and torch.equal(s, expected_s)
        y_added, new_residual = ops.fused_add_rms_norm(x, residual, w, 1e-6)
        q, r = ops.fused_add_rms_norm_static_fp8_quant(x, residual, w, 1e-6, scale, fp8_dtype)
        assert same(q, ops.static_quant_fp8(y_added, scale, fp8_dtype)) and torch.equal(r, new_residual)
        q, s, r = ops.rms_norm_dynamic_per_token_fp8_quant(x, residual, w, 1e-6, fp8_dtype)
        expected_q, expected_s = ops.dynamic_quant_fp8(y_added, True, fp8_dtype)
        assert same(q, expected_q) and torch.equal(s, expected_s) and torch.equal(r, new_residual)
        gate_up = torch.cat([x, residual], dim=1)
        assert same(
            ops.silu_and_mul_static_fp8_quant(gate_up, scale, fp8_dtype),
            ops.static_quant_fp8(ops.silu_and_mul(gate_up), scale, fp8_dtype),
        )
        # Group ops: bf16 groups of >= 64 staged in bf16 and encoded by the cached tables.
        with vllm_ir.priority(
            rms_norm_group_fp8_quant=["vllm_c"],
            silu_and_mul_group_fp8_quant=["vllm_c"],
            dynamic_group_quant_fp8=["vllm_c"],
        ):
            for group_size, column_major, ue8m0 in ((128, False, False), (64, True, True), (32, False, False)):
                quant = (group_size, column_major, ue8m0, fp8_dtype)
                for res, y_ref in ((None, y), (residual, y_added)):
                    q, s, r = ops.rms_norm_group_fp8_quant(x, res, w, 1e-6, *quant)
                    expected_q, expected_s = ops.dynamic_group_quant_fp8(y_ref, *quant)
                    assert same(q, expected_q) and torch.equal(s, expected_s), (group_size, res is None)
                    assert res is None or torch.equal(r, new_residual)
                q, s = ops.silu_and_mul_group_fp8_quant(gate_up, *quant)
                expected_q, expected_s = ops.dynamic_group_quant_fp8(ops.silu_and_mul(gate_up), *quant)
                assert same(q, expected_q) and torch.equal(s, expected_s), group_size
