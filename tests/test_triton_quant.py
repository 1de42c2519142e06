"""Triton FP8 quant kernels (providers/triton_kernels, kernels/quant.py) in the CPU interpreter:
bit-identical to native on every input variant, fp8 encoding against torch's casts, the
multi-program paths (per-tensor atomic absmax, long rows, column-major N-D scales), layouts,
predicates and errors. Small shapes: the interpreter runs every program in Python."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("vllm_ir_provider_triton") is None or importlib.util.find_spec("triton") is None:
    pytest.skip("providers/triton_kernels or triton is not installed", allow_module_level=True)

os.environ["TRITON_INTERPRET"] = "1"  # tests/conftest.py sets it first; this guards direct runs

import vllm_ir

vllm_ir.load_provider("triton")
from vllm_ir_provider_triton.kernels import quant as kernels  # noqa: E402
from vllm_ir_provider_triton.ops import quant as ops  # noqa: E402

FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
OPS = ("static_quant_fp8", "dynamic_quant_fp8", "dynamic_group_quant_fp8")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _assert_same(out, ref, rows: int | None = None) -> None:
    """Bitwise equality (fp8 as bytes), native's strides, only the first ``rows`` rows of q."""
    out = out if isinstance(out, tuple) else (out,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    for o, r in zip(out, ref, strict=True):
        if o.dtype.itemsize == 1 and rows is not None:
            o, r = o[:rows], r[:rows]
        assert o.dtype == r.dtype and o.shape == r.shape and o.stride() == r.stride()
        assert torch.equal(_bytes(o), _bytes(r)), (o, r)


def _variants(name: str) -> list[tuple[str, dict]]:
    op = getattr(vllm_ir.ops, name)
    return [("default", {}), *op.input_variants.items()]


CASES = [(name, variant, options) for name in OPS for variant, options in _variants(name)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("name", "variant", "options"), CASES, ids=[f"{n}-{v}" for n, v, _ in CASES])
def test_bit_identical_to_native_on_every_variant(name, variant, options, dtype):
    op = getattr(vllm_ir.ops, name)
    impl = op.impls["triton"]
    for shape in ((6, 64), (3, 40), (2, 3, 32)):
        args = op.generate_inputs(shape, dtype, **options)
        assert impl.supports_args(*args) is True, (shape, impl.supports_args(*args))
        _assert_same(impl.fn(*args), op.fn(*args), rows=shape[0] if len(shape) == 2 else None)


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_fp8_encoding_matches_torch_cast_bit_for_bit(fp8_dtype):
    """Scale 1: q is the clamped value cast to fp8. Covers every fp8 code's neighbourhood (ties
    to even included), subnormals, values below the smallest subnormal, -0, +-inf and NaN."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).float()
    codes = codes[torch.isfinite(codes)]
    near = torch.cat([codes, codes.nextafter(codes + 1), codes.nextafter(codes - 1)])
    ties = (codes.sort().values[1:] + codes.sort().values[:-1]) / 2
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 2.0**-12, 1e30, -1e30, float("inf"), -float("inf"), 500.0])
    x = torch.cat([near, ties, ties.nextafter(ties + 1), special, torch.randn(2000) * 4])
    x = torch.cat([x, torch.full((1,), float("nan"))])
    scale = torch.ones(1)
    q = vllm_ir.ops.static_quant_fp8.impls["triton"].fn(x, scale, fp8_dtype)
    bound = 448.0 if fp8_dtype == torch.float8_e4m3fn else 224.0
    expected = x.clamp(-bound, bound).to(fp8_dtype)
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))


def test_per_tensor_absmax_spans_programs_and_scale_ub():
    """40 rows of 128: three programs join the absmax by atomic max; the largest value sits in
    the last program's tile."""
    op = vllm_ir.ops.dynamic_quant_fp8
    x = torch.randn(40, 128)
    x[37, 5] = -60.0
    for ub in (None, torch.tensor([30.0])):
        args = (x, False, torch.float8_e4m3fn, ub, None)
        _assert_same(op.impls["triton"].fn(*args), op.fn(*args))
    q, scale = op.impls["triton"].fn(torch.empty(0, 16), False, torch.float8_e4m3fn)
    assert q.shape == (0, 16) and torch.equal(scale, op.fn(torch.empty(0, 16), False, torch.float8_e4m3fn)[1])


def test_long_rows_loop_over_column_blocks():
    op = vllm_ir.ops.dynamic_quant_fp8
    x = torch.randn(3, 1100, dtype=torch.float16)
    x[1, 1090] = 40.0  # the row's absmax is in its second column block
    args = (x, True, torch.float8_e4m3fnuz, None, None)
    _assert_same(op.impls["triton"].fn(*args), op.fn(*args))


def test_nan_rows_and_zero_groups_as_native():
    x = torch.randn(4, 32)
    x[1, 3] = float("nan")
    x[2] = 0.0
    dyn = vllm_ir.ops.dynamic_quant_fp8
    q, s = dyn.impls["triton"].fn(x, True, torch.float8_e4m3fn)
    q_ref, s_ref = dyn.fn(x, True, torch.float8_e4m3fn)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0, equal_nan=True)  # row 1's scale is NaN
    assert q[1].float().isnan().all() and q_ref[1].float().isnan().all()  # NaN's sign is not specified
    keep = torch.tensor([0, 2, 3])
    assert torch.equal(q[keep].view(torch.uint8), q_ref[keep].view(torch.uint8))
    group = vllm_ir.ops.dynamic_group_quant_fp8
    _assert_same(group.impls["triton"].fn(x[[0, 2, 3]], 16, False, True, torch.float8_e4m3fn),
                 group.fn(x[[0, 2, 3]], 16, False, True, torch.float8_e4m3fn))  # fmt: skip


@pytest.mark.parametrize("column_major", [False, True])
def test_group_scales_of_3d_x_and_partial_groups(column_major):
    op = vllm_ir.ops.dynamic_group_quant_fp8
    x = torch.randn(2, 5, 40, dtype=torch.bfloat16)  # 40 = 2 groups of 16 + a partial group of 8
    args = (x, 16, column_major, True, torch.float8_e4m3fn)
    q, scales = op.impls["triton"].fn(*args)
    assert scales.shape == (2, 5, 3) and scales.stride() == ((15, 1, 5) if column_major else (15, 3, 1))
    _assert_same((q, scales), op.fn(*args))


def test_static_scale_layouts():
    op = vllm_ir.ops.static_quant_fp8
    impl = op.impls["triton"]
    x = torch.randn(8, 64)
    for scale in (
        torch.rand(8, 1) + 0.01,  # per token
        torch.rand(1, 64) + 0.01,  # per channel
        torch.rand(4, 2) + 0.01,  # 2 x 32 blocks
        (torch.rand(8, 3) + 0.01)[:, :1],  # per token, a strided view
        torch.tensor(0.05),  # 0-d per tensor
    ):
        _assert_same(impl.fn(x, scale, torch.float8_e4m3fn), op.fn(x, scale, torch.float8_e4m3fn))
    x3 = torch.randn(2, 4, 16)
    for scale in (torch.rand(2, 4, 1) + 0.1, torch.rand(1, 1, 16) + 0.1):
        _assert_same(impl.fn(x3, scale, torch.float8_e4m3fn), op.fn(x3, scale, torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"static_quant_fp8 \(provider triton\): a 3-D scale .* per token or per"):
        impl.fn(x3, torch.rand(2, 1, 1), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"static_quant_fp8 \(provider triton\): scale of shape \[3, 2\] does not"):
        impl.fn(x, torch.rand(3, 2), torch.float8_e4m3fn)
    for ambiguous in (torch.rand(8) + 0.01, torch.rand(64) + 0.01):  # per token or per channel? (native refuses)
        with pytest.raises(ValueError, match=r"\(provider triton\): a 1-D scale of \d+ elements is ambiguous"):
            impl.fn(x, ambiguous, torch.float8_e4m3fn)


def test_row_strided_and_broadcast_rows_read_in_place():
    op = vllm_ir.ops.dynamic_group_quant_fp8
    wide = torch.randn(2, 3, 80)
    x = wide[..., :64]  # rows 80 apart, leading dimensions collapse
    assert ops._rows_stride(x) == 80
    _assert_same(op.impls["triton"].fn(x, 32, True, False, torch.float8_e4m3fn),
                 op.fn(x, 32, True, False, torch.float8_e4m3fn))  # fmt: skip
    row = torch.randn(1, 48).expand(5, 48)  # stride-0 rows
    dyn = vllm_ir.ops.dynamic_quant_fp8
    _assert_same(dyn.impls["triton"].fn(row, True, torch.float8_e4m3fn), dyn.fn(row, True, torch.float8_e4m3fn))


@pytest.mark.parametrize(
    ("name", "args", "reason"),
    [
        ("static_quant_fp8", (torch.randn(4, 8), torch.ones(1), torch.float8_e5m2), "fp8_dtype torch.float8_e5m2"),
        ("static_quant_fp8", (torch.randn(4, 8).double(), torch.ones(1), FP8[0]), "dtype torch.float64 is not"),
        ("static_quant_fp8", (torch.randn(4, 8), torch.ones(1).double(), FP8[0]), "scale dtype torch.float64"),
        ("static_quant_fp8", (torch.randn(8, 4).t(), torch.ones(1), FP8[0]), "not rows with one row stride"),
        ("static_quant_fp8", (torch.randn(2, 5, 8)[:, :4], torch.ones(1), FP8[0]), "not rows with one row stride"),
        ("static_quant_fp8", (torch.randn(2, 4, 8), torch.ones(2, 4, 2), FP8[0]), "3-D scale of 2 column groups"),
        ("static_quant_fp8", (torch.randn(2, 4, 8), torch.ones(1), FP8[0], 8), "num_token_padding with a 3-D x"),
        ("static_quant_fp8", (torch.tensor(1.0), torch.ones(1), FP8[0]), "x is 0-d"),
        ("dynamic_quant_fp8", (torch.randn(4, 0), True, FP8[0]), "rows with no elements"),
        ("dynamic_quant_fp8", (torch.randn(4, 8), True, FP8[0], torch.ones(2)), "scale_ub of shape [2]"),
        ("dynamic_group_quant_fp8", (torch.randn(4, 8), 8192, False, False, FP8[0]), "group_size 8192 > 4096"),
        ("dynamic_group_quant_fp8", (torch.randn(8), 4, True, False, FP8[0]), "column_major scales of a 1-D x"),
    ],
)
def test_predicates_decline_with_reasons(name, args, reason):
    verdict = getattr(vllm_ir.ops, name).impls["triton"].supports_args(*args)
    assert not verdict and reason in verdict.reason


def test_kernel_wrappers_reject_bad_buffers():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"vllm_ir_triton::static_quant_fp8_out: fp8_dtype torch.float8_e5m2"):
        kernels.static_quant_fp8_out(
            torch.empty(4, 16, dtype=torch.uint8), x, torch.ones(1, 1), 4, 16, torch.float8_e5m2
        )
    with pytest.raises(ValueError, match=r"static_quant_fp8_out: q must hold the fp8 bytes as uint8, got torch.float8"):
        kernels.static_quant_fp8_out(torch.empty(4, 16, dtype=FP8[0]), x, torch.ones(1, 1), 4, 16, FP8[0])
    with pytest.raises(ValueError, match=r"vllm_ir_triton::dynamic_quant_fp8_out: scale has 1 elements for 4 rows"):
        kernels.dynamic_quant_fp8_out(torch.empty(4, 16, dtype=torch.uint8), torch.empty(1), x, None, True, FP8[0])
    with pytest.raises(ValueError, match=r"vllm_ir_triton::group_quant_fp8_out: scales .* for x \[4, 16\]"):
        kernels.group_quant_fp8_out(torch.empty(4, 16, dtype=torch.uint8), torch.empty(4, 3), x, 8, False, FP8[0])


def test_dynamic_scales_are_an_ieee_division_on_every_device():
    """absmax / 448 divides (torch's CUDA ``tensor / python_float`` would multiply by the
    reciprocal, one ulp off for about half of all values: found on an H200); native and the
    Triton kernels both divide, for this absmax where the two differ."""
    absmax = torch.tensor([1.6523820161819458])
    divided = absmax / torch.tensor(448.0)
    assert divided != absmax * torch.tensor(1 / 448.0)  # the case that tells them apart
    x = torch.tensor([[1.6523820161819458, -0.5]])
    op = vllm_ir.ops.dynamic_quant_fp8
    for name, run in (("native", op.fn), ("triton", op.impls["triton"].fn)):
        _, scale = run(x, True, torch.float8_e4m3fn)
        assert scale.item() == divided.item(), name
    assert kernels._min_scale(448.0) == 1 / (448 * 512)
