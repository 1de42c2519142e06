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


# -- FP8 quantization (csrc/quantization/fp8/fp8_quant.cpp): e4m3fn, max 448, fmin/fmax clamp ------
_QUANT_SCHEMAS = {
    "static_scaled_fp8_quant": (
        "static_scaled_fp8_quant(Tensor! result, Tensor input, Tensor scale, (int, int)? group_shape=None) -> ()"
    ),
    "dynamic_scaled_fp8_quant": "dynamic_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale) -> ()",
    "dynamic_per_token_scaled_fp8_quant": (
        "dynamic_per_token_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale, Tensor? scale_ub) -> ()"
    ),
    "per_token_group_fp8_quant": (
        "per_token_group_fp8_quant(Tensor input, Tensor! output_q, Tensor! output_s, int group_size, float eps, "
        "float fp8_min, float fp8_max, bool scale_ue8m0) -> ()"
    ),
}
_FP8_MAX = 448.0
_MIN_SCALE = 1.0 / (_FP8_MAX * 512.0)


def _convert(values: torch.Tensor, inverse: torch.Tensor, out: torch.Tensor) -> None:
    """ConvertWithScaleOp<true>: x * inverse, fmax(-max, fmin(x, max)) (NaN becomes +max), cast."""
    assert out.dtype == torch.float8_e4m3fn, "VLLM_DISPATCH_FP8_TYPES: e4m3fn (or e5m2)"
    v = values.float() * inverse
    v = torch.where(v.isnan(), torch.full_like(v, _FP8_MAX), v.clamp(-_FP8_MAX, _FP8_MAX))
    out.copy_(v.to(out.dtype))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, K] read at row * t.stride(-2), as the kernels read it."""
    assert t.stride(-1) == 1, "last dimension must be contiguous"
    k = t.shape[-1]
    rows = t.numel() // k
    return t.as_strided((rows, k), (t.stride(-2), 1))


def _static_scaled_fp8_quant(result, input, scale, group_shape=None):
    CALLS.append({"fn": "static_scaled_fp8_quant", "out": result, "input": input, "scale": scale,
                  "group_shape": group_shape})  # fmt: skip
    x, out = _rows(input), _rows(result)
    m, n = x.shape
    if scale.dim() == 0 or scale.numel() == 1:
        s = scale.reshape(1, 1).expand(m, n)
    elif scale.dim() == 1:
        assert group_shape is not None, "1D scale requires explicit group_shape"
        gm = m if group_shape[0] == -1 else group_shape[0]
        gn = n if group_shape[1] == -1 else group_shape[1]
        assert scale.numel() == (m // gm) * (n // gn), "1D scale length does not match group_shape"
        s = scale.reshape(1, n).expand(m, n) if m // gm == 1 else scale.reshape(m, 1).expand(m, n)
    else:
        assert scale.dim() == 2 and m % scale.shape[0] == 0 and n % scale.shape[1] == 0, "scale must divide x"
        s = scale.repeat_interleave(m // scale.shape[0], 0).repeat_interleave(n // scale.shape[1], 1)
    _convert(x, 1.0 / s, out)


def _dynamic_scaled_fp8_quant(result, input, scale):
    CALLS.append({"fn": "dynamic_scaled_fp8_quant", "out": result, "input": input, "scale": scale})
    x = _rows(input)
    scale.copy_((x.float().abs().amax() / _FP8_MAX).reshape(1))  # no floor
    _convert(x, 1.0 / scale, _rows(result))


def _dynamic_per_token_scaled_fp8_quant(result, input, scale, scale_ub):
    CALLS.append({"fn": "dynamic_per_token_scaled_fp8_quant", "out": result, "input": input, "scale": scale,
                  "scale_ub": scale_ub})  # fmt: skip
    assert input.is_contiguous() and result.is_contiguous(), "TORCH_CHECK(input.is_contiguous())"
    x = input.reshape(-1, input.shape[-1]).float()
    absmax = x.abs().amax(-1, keepdim=True)
    if scale_ub is not None:
        absmax = torch.minimum(absmax, scale_ub.reshape(1, 1))
    s = (absmax / _FP8_MAX).clamp(min=_MIN_SCALE)
    scale.copy_(s.reshape(scale.shape))
    _convert(x, 1.0 / s, result.view(-1, input.shape[-1]))


def _per_token_group_fp8_quant(input, output_q, output_s, group_size, eps, fp8_min, fp8_max, scale_ue8m0):
    CALLS.append({"fn": "per_token_group_fp8_quant", "input": input, "out": output_q, "scale": output_s,
                  "group_size": group_size, "eps": eps, "fp8_min": fp8_min, "fp8_max": fp8_max,
                  "scale_ue8m0": scale_ue8m0})  # fmt: skip
    assert input.is_contiguous() and output_q.is_contiguous(), "TORCH_CHECK(input.is_contiguous())"
    assert input.numel() % group_size == 0 and output_s.dim() == 2
    groups = input.reshape(-1, group_size).float()  # groups over the flat input
    absmax = groups.abs().amax(-1, keepdim=True).clamp(min=eps)
    s = (absmax / _FP8_MAX).clamp(min=_MIN_SCALE)  # the kernel's own max, not fp8_max
    if scale_ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s.abs().clamp(min=1e-10))))
    per_row = output_s.shape[1]  # groups per row (column-major: [M, G] with strides (1, M))
    output_s.copy_(s.reshape(-1, per_row))
    _convert(groups, 1.0 / s, output_q.view(-1, group_size))


for _name, _schema in _QUANT_SCHEMAS.items():
    _lib.define(_schema)
_lib.impl("static_scaled_fp8_quant", _static_scaled_fp8_quant, "CPU")
_lib.impl("dynamic_scaled_fp8_quant", _dynamic_scaled_fp8_quant, "CPU")
_lib.impl("dynamic_per_token_scaled_fp8_quant", _dynamic_per_token_scaled_fp8_quant, "CPU")
_lib.impl("per_token_group_fp8_quant", _per_token_group_fp8_quant, "CPU")


# -- rotary embedding (csrc/pos_encoding_kernels.cpp): vLLM's in-place kernel ----------------------
_lib.define(
    "rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, Tensor cos_sin_cache, "
    "bool is_neox) -> ()"
)


def _rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    CALLS.append({"fn": "rotary_embedding", "positions": positions, "query": query, "key": key,
                  "head_size": head_size, "cache": cos_sin_cache, "is_neox": is_neox})  # fmt: skip
    assert positions.dim() in (1, 2) and positions.dtype == torch.int64
    tokens = positions.numel()
    assert query.shape[0] == positions.shape[0] and (key is None or key.shape[0] == positions.shape[0])
    assert cos_sin_cache.dtype == query.dtype and cos_sin_cache.is_contiguous()
    rot = cos_sin_cache.shape[1]
    half = rot // 2
    seq_dim = positions.dim() - 1
    # The kernel's addressing: token t at t * stride(seq_dim), head h at h * head_stride (query's, for
    # the key too), channel c at c.
    head_stride = query.stride(-2) if query.dim() == positions.dim() + 2 else head_size
    cache = cos_sin_cache[positions.reshape(-1)]
    cos, sin = cache[:, None, :half], cache[:, None, half:]
    for t in (query, key):
        if t is None:
            continue
        heads = t.numel() // tokens // head_size
        view = t.as_strided((tokens, heads, rot), (t.stride(seq_dim), head_stride, 1), t.storage_offset())
        if is_neox:
            x, y = view[..., :half], view[..., half:]
        else:
            x, y = view[..., 0::2], view[..., 1::2]
        x0, y0 = x.clone(), y.clone()
        x.copy_(x0 * cos - y0 * sin)  # in the tensors' dtype, as the kernel's scalar_t arithmetic
        y.copy_(y0 * cos + x0 * sin)


_lib.impl("rotary_embedding", _rotary_embedding, "CPU")
