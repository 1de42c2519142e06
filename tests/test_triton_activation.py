"""Triton activation kernels beyond the conformance kit: threshold rounding per device, NaN and
infinity propagation, the tiling paths (stacked short rows, several column blocks), batch
invariance, the exactness claims and the errors of the kernel entry points.

Runs on CPU in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); small shapes.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("vllm_ir_provider_triton") is None or importlib.util.find_spec("triton") is None:
    pytest.skip("providers/triton_kernels or triton is not installed", allow_module_level=True)

os.environ["TRITON_INTERPRET"] = "1"  # set by tests/conftest.py already; guards direct runs

import vllm_ir

vllm_ir.load_provider("triton")

from vllm_ir_provider_triton.kernels import activation as k  # noqa: E402

GATED = ("silu_and_mul", "mul_and_silu", "gelu_and_mul", "fatrelu_and_mul", "swigluoai_and_mul")
ELEMENTWISE = ("gelu_new", "gelu_fast", "quick_gelu", "relu2")
BF16 = torch.bfloat16
# The interpreter runs the kernels in numpy, which warns about the infinities the tests feed it.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def _impl(name: str):
    return vllm_ir.ops.__getattr__(name).impls["triton"]


def _assert_matches_native(name: str, args: tuple, got: torch.Tensor) -> None:
    op = vllm_ir.ops.__getattr__(name)
    want = op.fn(*args)
    atol, rtol = (0.0, 0.0) if op.impls["triton"].exact else op.tolerance(want.dtype)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, equal_nan=True)


def test_exact_claims_only_where_the_arithmetic_is_exact():
    exact = {name for name in GATED + ELEMENTWISE if _impl(name).exact}
    assert exact == {"fatrelu_and_mul", "relu2"}
    assert all(_impl(name).batch_invariant for name in GATED + ELEMENTWISE)


def test_fatrelu_compares_as_native_does_on_each_device():
    # 0.10009765625 is bfloat16(0.1): above float32(0.1), equal to the threshold rounded to bf16.
    gate = torch.tensor([[0.10009765625, 0.099609375, 0.5, -1.0]], dtype=BF16)
    x = torch.cat([gate, torch.ones_like(gate)], dim=-1)
    got = _impl("fatrelu_and_mul").fn(x, 0.1)
    # PyTorch's CPU F.threshold compares in float32: bf16(0.1) > 0.1 survives.
    assert got.tolist() == [[0.10009765625, 0.0, 0.5, 0.0]]
    assert torch.equal(got, vllm_ir.ops.fatrelu_and_mul.fn(x, 0.1))
    # CUDA and XPU round the threshold to x's dtype first: then it is zeroed.
    out = torch.empty_like(gate)
    k.gated_activation_out(out, x, k.FATRELU_DTYPE_THRESHOLD.value, k.GATE_FIRST.value, 0.1, 0.0)
    assert out.tolist() == [[0.0, 0.0, 0.5, 0.0]]
    assert torch.equal(out, torch.where(gate <= torch.tensor(0.1, dtype=BF16), 0.0, gate))


@pytest.mark.parametrize("name", GATED + ELEMENTWISE)
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_nan_and_infinities_propagate_as_native(name, dtype):
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 30.0, -30.0, 1.5])
    if name in GATED:  # every special as gate against every special as up, plus ordinary values
        gate = specials.repeat_interleave(len(specials))
        up = specials.repeat(len(specials))
        if name == "swigluoai_and_mul":
            x = torch.stack([gate, up], dim=-1).reshape(1, -1)
        elif name == "mul_and_silu":
            x = torch.cat([up, gate]).reshape(1, -1)
        else:
            x = torch.cat([gate, up]).reshape(1, -1)
    else:
        x = specials.reshape(2, -1)
    x = x.to(dtype)
    if name == "gelu_and_mul":
        # PyTorch's CPU F.gelu gives NaN at +inf (its vectorized erf); CUDA's erff and the
        # kernel give 0.5 x (1 + erf(x / sqrt 2)) = inf there (and -inf * 0 = NaN at -inf).
        finite_gate = x[..., : x.shape[-1] // 2].isfinite() | x[..., : x.shape[-1] // 2].isnan()
        x = x[..., torch.cat([finite_gate[0], finite_gate[0]])].reshape(1, -1)
        at_infinities = _impl(name).fn(torch.tensor([[float("inf"), -float("inf"), 1.0, 1.0]], dtype=dtype))
        assert at_infinities[0, 0] == float("inf") and at_infinities[0, 1].isnan()
    _assert_matches_native(name, (x,), _impl(name).fn(x))


@pytest.mark.parametrize("name", ["silu_and_mul", "swigluoai_and_mul", "gelu_and_mul"])
def test_rows_wider_than_one_block(name):
    # d = 1100 > MAX_BLOCK: two column blocks per row; row 1 starts mid-tensor.
    x = 2.0 * torch.randn(2, 2 * 1100, generator=torch.Generator().manual_seed(1))
    _assert_matches_native(name, (x,), _impl(name).fn(x))


@pytest.mark.parametrize("name", ["mul_and_silu", "fatrelu_and_mul", "quick_gelu"])
def test_short_rows_stacked_over_several_programs(name):
    # d = 8 stacks TILE // 16 = 64 rows per program: 70 rows take two programs, the second partial.
    gen = torch.Generator().manual_seed(2)
    width = 16 if name in GATED else 8
    x = (2.0 * torch.randn(70, width + 5, generator=gen))[:, :width]  # row-strided view
    assert not x.is_contiguous()
    _assert_matches_native(name, (x,), _impl(name).fn(x))


@pytest.mark.parametrize("name", ["silu_and_mul", "gelu_new"])
def test_a_row_does_not_depend_on_the_batch(name):
    x = 3.0 * torch.randn(5, 48, generator=torch.Generator().manual_seed(3), dtype=torch.float32).to(BF16)
    batch = _impl(name).fn(x)
    for i in (0, 4):
        assert torch.equal(_impl(name).fn(x[i : i + 1]), batch[i : i + 1])


def test_gelu_and_mul_declines_and_refuses_an_unknown_approximation():
    x = torch.randn(2, 8)
    verdict = vllm_ir.ops.gelu_and_mul.impls["triton"].supports_args(x, "erf")
    assert not verdict and "approximate='erf' is neither 'none' nor 'tanh'" in verdict.reason
    with pytest.raises(ValueError, match=r"gelu_and_mul \(provider triton\): approximate must be"):
        _impl("gelu_and_mul").fn(x, "erf")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: k.gated_activation_out(torch.empty(2, 4), torch.randn(2, 8), 42, 0, 0.0, 0.0), "unknown activation"),
        (lambda: k.gated_activation_out(torch.empty(2, 4), torch.randn(2, 8), 0, 7, 0.0, 0.0), "unknown layout"),
        (lambda: k.gated_activation_out(torch.empty(2, 3), torch.randn(2, 8), 0, 0, 0.0, 0.0), r"out \[2, 3\] for x"),
        (lambda: k.gated_activation_out(torch.empty(4, 1), torch.randn(4, 3), 0, 0, 0.0, 0.0), r"x of shape \[4, 3\]"),
        (lambda: k.gated_activation_out(torch.empty(8, 2), torch.randn(4, 8).t(), 0, 0, 0.0, 0.0), "unit inner stride"),
        (lambda: k.elementwise_activation_out(torch.empty(3, 4), torch.randn(3, 4), 9), "unknown activation"),
        (lambda: k.elementwise_activation_out(torch.empty(4, 3), torch.randn(3, 4).t(), 0), "unit inner stride"),
    ],
)
def test_kernel_entry_points_name_what_is_wrong(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(
    ("name", "x", "reason"),
    [
        ("silu_and_mul", torch.randn(3, 7), "last dimension 7 is odd"),
        ("swigluoai_and_mul", torch.tensor(1.0), "x is 0-d"),
        ("mul_and_silu", torch.randn(3, 8, dtype=torch.float64), "dtype torch.float64 is not one of"),
        ("gelu_new", torch.randn(2, 3, 8)[:, :, :4], "contiguous, or 2-D rows"),
        ("relu2", torch.randn(8, 3).t(), "contiguous, or 2-D rows"),
        ("quick_gelu", torch.randn(4, device="meta"), "x is on meta"),
    ],
)
def test_predicates_say_why(name, x, reason):
    verdict = _impl(name).supports_args(x)
    assert not verdict and reason in verdict.reason
