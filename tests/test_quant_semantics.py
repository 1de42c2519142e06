"""FP8 quant semantics that vLLM 0.33 fixes and every provider must follow: UE8M0 group scales
are powers of two (the floor applied before the rounding), and a static scale's layout is
explicit (a 1-D scale of several elements is refused as ambiguous, not guessed from its length)."""

from __future__ import annotations

import math
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # tests/conftest.py sets it first; this guards direct runs

import vllm_ir

for _name in ("triton", "vllm_c", "aten", "inductor"):  # plugin autoload is off in the test suite
    vllm_ir.load_provider(_name)
E4M3, E4M3FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
GROUP_OPS = ("dynamic_group_quant_fp8", "rms_norm_group_fp8_quant", "silu_and_mul_group_fp8_quant")
STATIC_OPS = ("static_quant_fp8", "rms_norm_static_fp8_quant", "silu_and_mul_static_fp8_quant")


def _providers(op_name: str) -> list[str]:
    op = getattr(vllm_ir.ops, op_name)
    return sorted(p for p, impl in op.impls.items() if impl.is_supported)


def _near_zero(op_name: str, rows: int = 2, hidden: int = 128) -> torch.Tensor:
    """Rows of which the first half is zero and the second tiny (absmax 1e-3): the input of the
    op (the gated ops' input is twice as wide; their gate half is what is quantized)."""
    x = torch.zeros(rows, hidden)
    x[:, hidden // 2 :] = torch.linspace(-1e-3, 1e-3, hidden // 2)
    if op_name == "silu_and_mul_group_fp8_quant":
        return torch.cat([x, torch.ones_like(x)], dim=-1)  # silu(x) * 1: tiny where x is
    return x


def _group_args(op_name: str, x: torch.Tensor, fp8: torch.dtype) -> tuple:
    if op_name == "rms_norm_group_fp8_quant":
        # rms_norm of a tiny row is not tiny: give it a tiny weight so the groups stay near zero.
        return (x, None, torch.full((x.shape[-1],), 1e-6), 1e-6, 64, False, True, fp8)
    return (x, 64, False, True, fp8)


def test_native_ue8m0_floor_is_a_power_of_two_as_in_vllm():
    """vLLM 0.33: ``dynamic_group_quant_fp8(x, 64, False, True, e4m3fn)`` of this x gives
    ``[7.62939453125e-06, 7.62939453125e-06]`` (2^-17); rounding before the floor gave 4.36e-6."""
    x = torch.zeros(1, 128)
    x[0, 64:] = torch.linspace(-1e-3, 1e-3, 64)
    _, scales = vllm_ir.ops.dynamic_group_quant_fp8.fn(x, 64, False, True, E4M3)
    assert scales.tolist() == [[7.62939453125e-06, 7.62939453125e-06]]
    _, scales = vllm_ir.ops.dynamic_group_quant_fp8.fn(x, 64, False, True, E4M3FNUZ)
    assert scales.tolist() == [[2.0**-16, 2.0**-16]]
    _, plain = vllm_ir.ops.dynamic_group_quant_fp8.fn(x, 64, False, False, E4M3)
    assert plain.tolist() == [[pytest.approx(1 / (448 * 512))] * 2]  # without UE8M0: the floor itself


@pytest.mark.parametrize("fp8", [E4M3, E4M3FNUZ], ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize(
    ("op_name", "provider"), [(o, p) for o in GROUP_OPS for p in _providers(o)], ids=lambda v: str(v)
)
def test_every_ue8m0_scale_is_a_power_of_two_on_every_provider(op_name, provider, fp8):
    op = getattr(vllm_ir.ops, op_name)
    args = _group_args(op_name, _near_zero(op_name), fp8)
    impl = op.impls[provider]
    if impl.supports_args is not None and not impl.supports_args(*args):
        pytest.skip(f"{provider} declines: {impl.supports_args(*args)!r}")
    scales = impl.fn(*args)[1]
    floor = 2.0 ** math.ceil(math.log2(1 / ((448.0 if fp8 == E4M3 else 224.0) * 512)))
    mantissa, _ = torch.frexp(scales)
    assert (mantissa == 0.5).all(), f"{op_name} on {provider}: scales {scales.tolist()} are not powers of two"
    assert (scales >= floor).all(), f"{op_name} on {provider}: scales {scales.tolist()} below {floor}"
    native = op.fn(*args)[1]
    assert torch.equal(scales, native)


# -- static scales -------------------------------------------------------------------------


def _static_args(op_name: str, x: torch.Tensor, scale: torch.Tensor) -> tuple:
    if op_name == "rms_norm_static_fp8_quant":
        return (x, None, 1e-6, scale, E4M3)
    if op_name == "silu_and_mul_static_fp8_quant":
        return (torch.cat([x, x], dim=-1), scale, E4M3)
    return (x, scale, E4M3)


@pytest.mark.filterwarnings("ignore::vllm_ir.FallbackWarning")
@pytest.mark.parametrize(
    ("op_name", "provider"), [(o, p) for o in STATIC_OPS for p in _providers(o)], ids=lambda v: str(v)
)
def test_a_1d_scale_of_several_elements_is_refused_as_ambiguous_on_every_provider(op_name, provider):
    op = getattr(vllm_ir.ops, op_name)
    x = torch.rand(4, 4, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    args = _static_args(op_name, x, torch.tensor([0.0025, 0.005, 0.01, 0.02]))
    with vllm_ir.priority(**{op_name: [provider]}), pytest.raises((ValueError, RuntimeError)) as info:
        op(*args)
    assert "ambiguous" in str(info.value) and "[T, 1] per token" in str(info.value)


def test_a_per_token_scale_of_a_square_input_goes_per_row_as_vllms_quantfp8():
    """vLLM's ``QuantFP8(static=True, GroupShape.PER_TOKEN)`` reads a length-T scale as [T, 1]."""
    x = torch.rand(4, 4, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    scale = torch.tensor([0.0025, 0.005, 0.01, 0.02])
    q = vllm_ir.ops.static_quant_fp8.fn(x, scale.reshape(4, 1), E4M3)
    expected = (x.float() * scale.reshape(4, 1).reciprocal()).clamp(-448, 448).to(E4M3)
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))
    per_channel = vllm_ir.ops.static_quant_fp8.fn(x, scale.reshape(1, 4), E4M3)
    assert not torch.equal(per_channel.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("provider", _providers("static_quant_fp8"))
def test_2d_per_token_and_per_channel_scales_match_native_on_every_provider(provider):
    op = vllm_ir.ops.static_quant_fp8
    x = torch.rand(4, 4, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    scale = torch.tensor([0.0025, 0.005, 0.01, 0.02])
    for s in (scale.reshape(4, 1), scale.reshape(1, 4)):
        with vllm_ir.priority(static_quant_fp8=[provider]):
            assert op.dispatch(x, s, E4M3).provider == provider
            assert torch.equal(op(x, s, E4M3).view(torch.uint8), op.fn(x, s, E4M3).view(torch.uint8))


def test_a_1d_scale_of_a_1d_input_is_per_element():
    x = torch.tensor([1.0, 2.0, 3.0])
    q = vllm_ir.ops.static_quant_fp8.fn(x, torch.tensor([1.0, 2.0, 4.0]), E4M3)
    assert q.float().tolist() == [1.0, 1.0, 0.75]
