"""TEST DOUBLE of AMD AITER's RMSNorm and activation entry points (not AITER): records calls,
checks the layout contract the real kernels rely on, computes with torch on CPU."""

from __future__ import annotations

import torch

IS_TEST_DOUBLE = True
CALLS: list[dict] = []


def _normalize(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + epsilon)).to(x.dtype)
    return y * weight


def rmsnorm2d_fwd(input, weight, epsilon, use_model_sensitive_rmsnorm=0):
    CALLS.append({"fn": "rmsnorm2d_fwd", "input": input, "weight": weight, "epsilon": epsilon})
    assert input.dim() == 2, "AITER takes [rows, hidden]"
    return _normalize(input, weight, epsilon)


def rmsnorm2d_fwd_with_add(out, input, residual_in, residual_out, weight, epsilon, *args):
    CALLS.append(
        {"fn": "rmsnorm2d_fwd_with_add", "out": out, "input": input, "residual_in": residual_in,
         "residual_out": residual_out, "weight": weight, "epsilon": epsilon}
    )  # fmt: skip
    total = input.float() + residual_in.float()
    residual_out.copy_(total)
    out.copy_((total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + epsilon)).to(out.dtype) * weight)


# -- activations (aiter/ops/activation.py): out-parameter calls, gate first, contiguous rows ----


def _check_gated(fn: str, out: torch.Tensor, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract AITER's act_and_mul kernel relies on; returns (gate, up) in float32."""
    assert input.is_contiguous(), f"{fn}: AITER addresses row t at t * 2d (contiguous input)"
    assert input.data_ptr() % 16 == 0, f"{fn}: AITER loads 16-byte vectors from the input"
    assert out.is_contiguous() and out.dtype == input.dtype, f"{fn}: out must be contiguous, of input's dtype"
    d = input.shape[-1] // 2
    assert out.shape == (*input.shape[:-1], d), f"{fn}: out {tuple(out.shape)} for input {tuple(input.shape)}"
    assert input.numel() > 0, f"{fn}: AITER's launch divides by the row length and launches one block per row"
    return input[..., :d].float(), input[..., d:].float()


def _gated(fn: str, act, out: torch.Tensor, input: torch.Tensor) -> None:
    CALLS.append({"fn": fn, "out": out, "input": input})
    gate, up = _check_gated(fn, out, input)
    out.copy_((act(gate) * up).to(out.dtype))  # AITER keeps fp32 through the multiply


def silu_and_mul(out, input, limit=0.0):
    assert limit == 0.0, "the wrapper never asks for AITER's limit clamp"
    _gated("silu_and_mul", torch.nn.functional.silu, out, input)


def gelu_and_mul(out, input):
    _gated("gelu_and_mul", torch.nn.functional.gelu, out, input)


def gelu_tanh_and_mul(out, input):
    _gated("gelu_tanh_and_mul", lambda g: torch.nn.functional.gelu(g, approximate="tanh"), out, input)


def gelu_fast(out, input):
    CALLS.append({"fn": "gelu_fast", "out": out, "input": input})
    assert input.dtype in (torch.float16, torch.bfloat16), "AITER's gelu_fast dispatches fp16/bf16 only"
    assert input.is_contiguous() and out.is_contiguous() and out.shape == input.shape and out.dtype == input.dtype
    assert input.numel() % 8 == 0, "AITER's gelu_fast reads whole vectors: numel must be a multiple of 8"
    assert input.data_ptr() % 16 == 0, "gelu_fast: AITER loads 16-byte vectors from the input"
    f = input.float()
    out.copy_((0.5 * f * (1.0 + torch.tanh(0.7978845608 * f * (1.0 + 0.044715 * f * f)))).to(out.dtype))


# -- FP8 quantization (aiter/ops/quant.py): static per-tensor, out of aiter.dtypes.fp8 -------------


class dtypes:  # AITER's module of dtype constants, a namespace here
    """AITER's dtype constants; ``fp8`` is the GPU's (this stand-in plays a gfx950: e4m3fn)."""

    fp8 = torch.float8_e4m3fn


def static_per_tensor_quant(out, input, scale):
    CALLS.append({"fn": "static_per_tensor_quant", "out": out, "input": input, "scale": scale})
    assert input.dtype in (torch.float16, torch.bfloat16), "AITER_DISPATCH_FLOATING16_TYPES: fp16/bf16 input only"
    assert out.dtype == dtypes.fp8, f"static_per_tensor_quant not support output type: {out.dtype}"
    assert input.is_contiguous() and out.is_contiguous(), "AITER addresses row t at t * K (contiguous)"
    assert out.shape == input.shape, f"out {tuple(out.shape)} for input {tuple(input.shape)}"
    assert input.data_ptr() % 16 == 0 and input.shape[-1] % 8 == 0, "AITER loads 16-byte vectors per row"
    assert scale.dtype == torch.float32 and scale.numel() == 1, "one float32 scale"
    assert input.numel() > 0, "AITER launches one block per row"
    bound = torch.finfo(out.dtype).max  # AITER clamps to the dtype's max (240 for e4m3fnuz)
    out.copy_((input.float() * (1.0 / scale.float())).clamp(-bound, bound).to(out.dtype))
