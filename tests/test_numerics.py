"""The reference semantics of the core ops against an independent float64 computation."""

from __future__ import annotations

import pytest
import torch

import vllm_ir


def _rms_norm64(x, weight, eps, variance_size=None):
    x64 = x.double()
    v = x64 if variance_size is None else x64[..., :variance_size]
    y = x64 / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.double()


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variance_size", [None, 5])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches_float64(dtype, variance_size, with_weight):
    op = vllm_ir.ops.rms_norm
    x, w, eps, _ = op.generate_inputs((3, 7, 24), dtype, with_weight=with_weight)
    out = op(x, w, eps, variance_size)
    assert out.dtype == dtype and out.shape == x.shape
    atol, rtol = op.tolerance(dtype)
    # bf16/fp16 round once before the weight multiply and once after: allow two roundings.
    torch.testing.assert_close(out.double(), _rms_norm64(x, w, eps, variance_size), atol=2 * atol, rtol=2 * rtol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_float64(dtype):
    op = vllm_ir.ops.fused_add_rms_norm
    x, res, w, eps, _ = op.generate_inputs((5, 40), dtype)
    out, new_res = op(x, res, w, eps)
    total = x.double() + res.double()
    atol, rtol = op.tolerance(dtype)
    torch.testing.assert_close(new_res.double(), total, atol=atol, rtol=rtol)
    torch.testing.assert_close(out.double(), _rms_norm64(total, w, eps), atol=2 * atol, rtol=2 * rtol)
    assert out.dtype == new_res.dtype == dtype


def test_an_fp32_weight_gives_xs_dtype_as_vllm():
    """vLLM 0.33: the weight multiplies in its own dtype, the result is cast back to x's."""
    op = vllm_ir.ops.rms_norm
    x, w, eps, _ = op.generate_inputs((2, 16), torch.bfloat16, weight_dtype=torch.float32)
    assert op(x, w, eps).dtype == torch.bfloat16


def test_zero_tokens():
    x, w, eps, _ = vllm_ir.ops.rms_norm.generate_inputs((0, 16), torch.float32)
    assert vllm_ir.ops.rms_norm(x, w, eps).shape == (0, 16)


def test_float64_is_computed_in_float32():
    # The reason no float64 kernel can meet the float64 tolerance (1e-10) against native:
    # providers leave float64 to native instead of computing it differently.
    op = vllm_ir.ops.rms_norm
    x, w, eps, _ = op.generate_inputs((3, 64), torch.float64)
    out = op(x, w, eps)
    assert out.dtype == torch.float64
    assert torch.equal(out, op(x.float(), None, eps).double() * w)
    atol, rtol = op.tolerance(torch.float64)
    assert not torch.allclose(out, _rms_norm64(x, w, eps), atol=atol, rtol=rtol)
