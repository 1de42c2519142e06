"""TEST DOUBLE: registers vllm-xpu-kernels' ``torch.ops._C`` RMSNorm and activation functions, with
the vendor's schemas (``Tensor!`` marks included), as recording CPU kernels that check the layout
contract of the SYCL kernels and compute with torch."""

from __future__ import annotations

import torch

CALLS: list[dict] = []
_lib = torch.library.Library("_C", "FRAGMENT")
_lib.define("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float epsilon) -> ()")
_lib.define("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float epsilon) -> ()")


def _normalized(x32: torch.Tensor, dtype: torch.dtype, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + epsilon)).to(dtype) * weight


def _rms_norm(out, input, weight, epsilon):
    CALLS.append({"fn": "rms_norm", "out": out, "input": input, "weight": weight, "epsilon": epsilon})
    out.copy_(_normalized(input.float(), input.dtype, weight, epsilon))


def _fused_add_rms_norm(input, residual, weight, epsilon):
    CALLS.append(
        {"fn": "fused_add_rms_norm", "input": input, "residual": residual, "weight": weight, "epsilon": epsilon}
    )
    total = input.float() + residual.float()
    residual.copy_(total)
    input.copy_(_normalized(total, input.dtype, weight, epsilon))


_lib.impl("rms_norm", _rms_norm, "CPU")
_lib.impl("fused_add_rms_norm", _fused_add_rms_norm, "CPU")


# -- activations: vendor schemas as in csrc/torch_bindings.cpp (fatrelu's input is marked written) --
_ACTIVATION_SCHEMAS = {
    "silu_and_mul": "silu_and_mul(Tensor! result, Tensor input) -> ()",
    "mul_and_silu": "mul_and_silu(Tensor! out, Tensor input) -> ()",
    "gelu_and_mul": "gelu_and_mul(Tensor! out, Tensor input) -> ()",
    "gelu_tanh_and_mul": "gelu_tanh_and_mul(Tensor! out, Tensor input) -> ()",
    "fatrelu_and_mul": "fatrelu_and_mul(Tensor! out, Tensor! input, float threshold) -> ()",
    "swigluoai_and_mul": "swigluoai_and_mul(Tensor! out, Tensor input, float alpha=1.702, float limit=7.0) -> ()",
    "gelu_new": "gelu_new(Tensor! out, Tensor input) -> ()",
    "gelu_fast": "gelu_fast(Tensor! out, Tensor input) -> ()",
    "gelu_quick": "gelu_quick(Tensor! out, Tensor input) -> ()",
    "relu2": "relu2(Tensor! out, Tensor input) -> ()",
}
F = torch.nn.functional


def _round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).float()


def _gated(fn: str, out: torch.Tensor, input: torch.Tensor, interleaved: bool = False):
    assert input.is_contiguous() and out.is_contiguous(), f"{fn}: the kernels address row t at t * 2d"
    assert input.data_ptr() % 16 == 0, f"{fn}: the vectorized kernels load aligned vectors"
    assert out.dtype == input.dtype and out.shape == (*input.shape[:-1], input.shape[-1] // 2), fn
    if interleaved:
        return input[..., ::2].float(), input[..., 1::2].float()
    d = input.shape[-1] // 2
    return input[..., :d].float(), input[..., d:].float()


def _act_and_mul(fn, act, act_first=True):
    def kernel(out, input):
        CALLS.append({"fn": fn, "out": out, "input": input})
        x, y = _gated(fn, out, input)
        gate, up = (x, y) if act_first else (y, x)
        out.copy_((_round(act(gate), out.dtype) * up).to(out.dtype))  # activation rounded first, as vLLM

    return kernel


def _fatrelu_and_mul(out, input, threshold):
    CALLS.append({"fn": "fatrelu_and_mul", "out": out, "input": input, "threshold": threshold})
    gate, up = _gated("fatrelu_and_mul", out, input)
    threshold32 = torch.tensor(threshold, dtype=torch.float32)  # the kernel takes a float
    out.copy_((torch.where(gate > threshold32, gate, 0.0) * up).to(out.dtype))  # NaN > t is false: 0


def _swigluoai_and_mul(out, input, alpha=1.702, limit=7.0):
    CALLS.append({"fn": "swigluoai_and_mul", "out": out, "input": input, "alpha": alpha, "limit": limit})
    gate, up = _gated("swigluoai_and_mul", out, input, interleaved=True)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    out.copy_(((up + 1.0) * gate * torch.sigmoid(alpha * gate)).to(out.dtype))  # float32 throughout


def _elementwise(fn, act):
    def kernel(out, input):
        CALLS.append({"fn": fn, "out": out, "input": input})
        assert input.is_contiguous() and out.is_contiguous(), f"{fn}: the kernel addresses row t at t * d"
        assert out.dtype == input.dtype and out.shape == input.shape, fn
        out.copy_(act(input.float()).to(out.dtype))

    return kernel


_ACTIVATION_KERNELS = {
    "silu_and_mul": _act_and_mul("silu_and_mul", F.silu),
    "mul_and_silu": _act_and_mul("mul_and_silu", F.silu, act_first=False),
    "gelu_and_mul": _act_and_mul("gelu_and_mul", F.gelu),
    "gelu_tanh_and_mul": _act_and_mul("gelu_tanh_and_mul", lambda g: F.gelu(g, approximate="tanh")),
    "fatrelu_and_mul": _fatrelu_and_mul,
    "swigluoai_and_mul": _swigluoai_and_mul,
    "gelu_new": _elementwise("gelu_new", lambda x: F.gelu(x, approximate="tanh")),
    "gelu_fast": _elementwise(
        "gelu_fast", lambda x: 0.5 * x * (1.0 + torch.tanh(0.7978845608 * x * (1.0 + 0.044715 * x * x)))
    ),
    "gelu_quick": _elementwise("gelu_quick", lambda x: x * torch.sigmoid(1.702 * x)),
    "relu2": _elementwise("relu2", lambda x: torch.square(F.relu(x))),
}
for _name, _schema in _ACTIVATION_SCHEMAS.items():
    _lib.define(_schema)
    _lib.impl(_name, _ACTIVATION_KERNELS[_name], "CPU")
