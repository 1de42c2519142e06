"""vllm-xpu-kernels' FP8 quantization: ``static_quant_fp8``, ``dynamic_quant_fp8`` and
``dynamic_group_quant_fp8``.

``import vllm_xpu_kernels._C`` registers (``csrc/torch_bindings.cpp`` and
``csrc/quantization/fp8/fp8_quant.cpp``, checked against the 2026 tree), each writing
caller-allocated buffers:

- ``static_scaled_fp8_quant(result, input, scale, group_shape=None)``: one scale, or (releases
  with ``group_shape``) a 1-D scale with an explicit group shape ``(-1, 1)`` per channel /
  ``(1, -1)`` per token, or a 2-D scale whose blocks it infers. Older releases take
  ``(result, input, scale)`` and one scale only. The op has no 1-D scales of several elements
  (ambiguous: native refuses them), so only one-element and 2-D scales are passed on.
- ``dynamic_scaled_fp8_quant(result, input, scale)``: per tensor, ``scale = absmax / 448``
  (no floor, no ``scale_ub``).
- ``dynamic_per_token_scaled_fp8_quant(result, input, scale, scale_ub)``: per token,
  ``max(min(absmax, scale_ub) / 448, 1 / (448 * 512))``, as the op.
- ``per_token_group_fp8_quant(input, output_q, output_s, group_size, eps, fp8_min, fp8_max,
  scale_ue8m0)``: groups taken over the flat input (so the row length must be a multiple of
  the group size), ``output_s`` 2-D, column-major when ``stride(0) < stride(1)``; the floor
  is ``1e-10 / 448`` (the op's is ``1 / (448 * 512)``), UE8M0 rounds ``exp2(ceil(log2(s)))``
  after the floor, as the op does: the two differ only below the op's floor, where the kit
  does not compare scales.

The kernels quantize to ``float8_e4m3fn`` (and e5m2) with the dtype's max, 448: the op's
``float8_e4m3fnuz`` (clamped to 224) is declined. They multiply by ``1 / scale`` and clamp
with ``fmin``/``fmax`` (a NaN input becomes +448, native keeps NaN). The per-tensor scale has
no floor: below ``1 / 512`` absmax it is smaller than native's (the kit compares scales only
above the floor; q dequantizes to x either way), an all-zero x gets scale 0 and q = 448.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import vllm_ir
from vllm_ir.ir.declarations.quant import padded_shape, padding_verdict
from vllm_ir.plugins.provider import empty_group_scales
from vllm_ir_provider_xpu_kernels import DTYPES, XPU, _on_xpu, _vendor_ops

FP8_MAX = 448.0


def _single_row_stride(x: Tensor) -> bool | vllm_ir.Unsupported:
    """``x`` seen as ``[-1, x.shape[-1]]`` must have one row stride: the vendor reads row t at
    ``t * input.stride(-2)``."""
    if (
        x.dim() >= 2
        and x.stride(-1) == 1
        and all(x.stride(d) == x.stride(-2) * math.prod(x.shape[d + 1 : -1]) for d in range(x.dim() - 2))
    ):
        return True
    return vllm_ir.Unsupported("x's rows have no single stride (the kernel reads row t at t * input.stride(-2))")


def common_rules(x: Tensor, fp8_dtype: torch.dtype) -> bool | vllm_ir.Unsupported:
    """What the three ops' predicates check first: the device, then the shared argument rules
    (unit-tested on CPU tensors, the device check stood in for); the padding check follows."""
    if not (on_xpu := _on_xpu(x)):
        return on_xpu
    if fp8_dtype != torch.float8_e4m3fn:
        return vllm_ir.Unsupported(
            f"fp8_dtype {fp8_dtype}: vllm-xpu-kernels quantizes to float8_e4m3fn (the op's e4m3fnuz clamps to 224)"
        )
    if x.dtype not in DTYPES:
        return vllm_ir.Unsupported(f"vllm-xpu-kernels' fp8 quantization takes float32/float16/bfloat16, not {x.dtype}")
    if x.dim() < 2:
        return vllm_ir.Unsupported(f"x is {x.dim()}-D (the kernels read rows at input.stride(-2))")
    if x.shape[-1] == 0:
        return vllm_ir.Unsupported("last dimension is 0 (the kernels divide by the row length)")
    return True


def _has_group_shape() -> bool:
    schema = _vendor_ops().static_scaled_fp8_quant.default._schema
    return any(a.name == "group_shape" for a in schema.arguments)


def static_rules(x: Tensor, scale: Tensor) -> bool | vllm_ir.Unsupported:
    """``static_quant_fp8``'s checks after `common_rules`, the padding and the rows: the scale's,
    then whether the installed vllm-xpu-kernels takes a scale of several elements."""
    if scale.dtype != torch.float32 or scale.device != x.device:
        return vllm_ir.Unsupported(f"scale must be float32 on x's device, got {scale.dtype} on {scale.device}")
    if scale.dim() > 2:
        return vllm_ir.Unsupported(f"scale is {scale.dim()}-D (the kernel takes 0-D, 1-D or 2-D scales)")
    if scale.dim() == 1 and scale.numel() != 1:
        return vllm_ir.Unsupported(f"a 1-D scale of {scale.numel()} elements (ambiguous: native refuses it)")
    if scale.dim() == 2 and x.dim() != 2:
        return vllm_ir.Unsupported(f"a 2-D scale with a {x.dim()}-D x (blocks of a 2-D x only)")
    if scale.numel() != 1 and not _has_group_shape():  # imports the vendor: asked last, on XPU only
        return vllm_ir.Unsupported(
            "this vllm-xpu-kernels' static_scaled_fp8_quant has no group_shape (one scale only): upgrade it"
        )
    return True


def dynamic_rules(x: Tensor, per_token: bool, scale_ub: Tensor | None) -> bool | vllm_ir.Unsupported:
    """``dynamic_quant_fp8``'s checks after `common_rules` and the padding: the per-token /
    per-tensor kernel's."""
    if per_token and not x.is_contiguous():
        return vllm_ir.Unsupported("x must be contiguous (dynamic_per_token_scaled_fp8_quant checks it)")
    if not per_token and not (rows := _single_row_stride(x)):
        return rows
    if scale_ub is not None:
        if not per_token:
            return vllm_ir.Unsupported("scale_ub with per-tensor scales (dynamic_scaled_fp8_quant takes none)")
        if scale_ub.dtype != torch.float32 or scale_ub.numel() != 1 or scale_ub.device != x.device:
            return vllm_ir.Unsupported("scale_ub must be one float32 element on x's device")
    return True


def group_rules(x: Tensor, group_size: int, column_major: bool) -> bool | vllm_ir.Unsupported:
    """``dynamic_group_quant_fp8``'s checks after `common_rules`: the group kernel's."""
    if group_size < 1 or x.shape[-1] % group_size:
        return vllm_ir.Unsupported(
            f"last dimension {x.shape[-1]} is not a multiple of group_size {group_size} "
            "(the kernel takes groups over the flat input)"
        )
    if not x.is_contiguous():
        return vllm_ir.Unsupported("x must be contiguous (per_token_group_fp8_quant checks it)")
    if column_major and x.dim() != 2:
        return vllm_ir.Unsupported(f"column_major scales of a {x.dim()}-D x (the kernel takes 2-D scales)")
    return True


def _q(x: Tensor, fp8_dtype: torch.dtype, num_token_padding: int | None) -> tuple[Tensor, Tensor]:
    """(q, the view of its first ``x.shape[0]`` rows the vendor writes): pad rows stay unwritten."""
    q = torch.empty(padded_shape(x, num_token_padding), dtype=fp8_dtype, device=x.device)
    return q, (q[: x.shape[0]] if q.shape != x.shape else q)


@XPU.impl("static_quant_fp8", supports=(common_rules, padding_verdict, _single_row_stride, static_rules))
def static_quant_fp8(x, scale, fp8_dtype, num_token_padding=None):
    q, rows = _q(x, fp8_dtype, num_token_padding)
    if rows.numel() == 0:  # the launch math divides by the row length
        return q
    _vendor_ops().static_scaled_fp8_quant(rows, x, scale)  # one scale, or a 2-D scale whose blocks it infers
    return q


@XPU.impl("dynamic_quant_fp8", supports=(common_rules, padding_verdict, dynamic_rules))
def dynamic_quant_fp8(x, per_token, fp8_dtype, scale_ub=None, num_token_padding=None):
    q, rows = _q(x, fp8_dtype, num_token_padding)
    if per_token:
        scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
        if rows.numel():
            _vendor_ops().dynamic_per_token_scaled_fp8_quant(rows, x, scale, scale_ub)
        return q, scale
    if rows.numel() == 0:  # no launch: the op's scale of an empty x is the floor
        return q, torch.full((1,), 1.0 / (FP8_MAX * 512.0), dtype=torch.float32, device=x.device)
    scale = torch.empty((1,), dtype=torch.float32, device=x.device)
    _vendor_ops().dynamic_scaled_fp8_quant(rows, x, scale)
    return q, scale


@XPU.impl("dynamic_group_quant_fp8", supports=(common_rules, group_rules))
def dynamic_group_quant_fp8(x, group_size, column_major, use_ue8m0, fp8_dtype):
    q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scales = empty_group_scales(x.shape, group_size, column_major, x.device)  # in the op's layout
    if x.numel():
        flat = scales.view(-1, scales.shape[-1])  # the kernel takes 2-D scales
        _vendor_ops().per_token_group_fp8_quant(x, q, flat, group_size, 1e-10, -FP8_MAX, FP8_MAX, use_ue8m0)
    return q, scales
