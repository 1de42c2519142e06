"""vllm-xpu-kernels' activations: the whole catalogue, each op through one vendor function.

``import vllm_xpu_kernels._C`` registers (``csrc/torch_bindings.cpp``, checked against the 2026
tree) ``torch.ops._C.<name>(out, input[, params])`` writing a caller-allocated ``out``:
``silu_and_mul``, ``mul_and_silu``, ``gelu_and_mul``, ``gelu_tanh_and_mul``,
``fatrelu_and_mul(out, input, threshold)``, ``swigluoai_and_mul(out, input, alpha, limit)``
(interleaved gate/up, as the op), ``gelu_new``, ``gelu_fast``, ``gelu_quick`` and ``relu2``
(``relu2_no_mul`` in older releases). Older releases lack some of them: a predicate declines
an op whose function the installed package does not register, with that reason.

Every call goes through ``torch.ops.vllm_ir_xpu_kernels.activation``, a functional custom op:
the vendor schemas mark ``input`` as written for ``fatrelu_and_mul`` and the old
``relu2_no_mul`` (the kernels only read it), which a compiled graph must not see as a
mutation of the activation. Inside it, empty inputs skip the launch and a view whose first
element is not 16-byte aligned is copied (the gated kernels load aligned vectors).

Kernels address row ``t`` at ``t * row length``: inputs must be contiguous. They compute in
float32 and round to x's dtype (the gated ones round the activation first, as vLLM does);
``fatrelu_and_mul`` returns 0 where the gate is NaN (native keeps NaN).
"""

from __future__ import annotations

import math
import struct

import torch
from torch import Tensor

import vllm_ir
from vllm_ir.ir.declarations.activation import approximate_verdict, check_approximate
from vllm_ir.plugins.provider import aligned, deferred_custom_op
from vllm_ir_provider_xpu_kernels import DTYPES, SUPPORTED, XPU, _on_xpu, _vendor_ops

#: Vendor function -> whether it is gated ([..., 2d] -> [..., d]).
FUNCTIONS: dict[str, bool] = {
    "silu_and_mul": True,
    "mul_and_silu": True,
    "gelu_and_mul": True,
    "gelu_tanh_and_mul": True,
    "fatrelu_and_mul": True,
    "swigluoai_and_mul": True,
    "gelu_new": False,
    "gelu_fast": False,
    "gelu_quick": False,
    "relu2": False,
}
#: ``gelu_and_mul``'s vendor function per ``approximate``.
_GELU_FUNCTIONS = {"none": "gelu_and_mul", "tanh": "gelu_tanh_and_mul"}
#: Names a function had in older releases.
_OLD_NAMES = {"relu2": "relu2_no_mul"}


def vendor_name(function: str) -> str | None:
    """The name under which the installed vllm-xpu-kernels registers ``function``, if it does."""
    ops = _vendor_ops()
    for name in (function, _OLD_NAMES.get(function)):
        if name is not None and hasattr(ops, name):
            return name
    return None


@deferred_custom_op("vllm_ir_xpu_kernels::activation", mutates_args=())
def activation(x: Tensor, function: str, params: list[float]) -> Tensor:
    """``torch.ops._C.<function>(out, x, *params)`` into a fresh ``out``."""
    if function not in FUNCTIONS:
        raise ValueError(f"vllm_ir_xpu_kernels::activation: unknown function {function!r} (one of {sorted(FUNCTIONS)})")
    out = _new_out(x, function)
    if out.numel() == 0:  # the launch math divides by the row length; nothing to compute anyway
        return out
    name = vendor_name(function)
    if name is None:
        raise RuntimeError(f"vllm_ir_xpu_kernels::activation: the installed vllm-xpu-kernels has no {function}")
    getattr(_vendor_ops(), name)(out, aligned(x), *params)  # the gated kernels load 16-byte vectors
    return out


@activation.register_fake
def _(x: Tensor, function: str, params: list[float]) -> Tensor:
    return _new_out(x, function)


if SUPPORTED:  # elsewhere defined on its first call (tests, with doubles)
    activation.define()


def _new_out(x: Tensor, function: str) -> Tensor:
    shape = (*x.shape[:-1], x.shape[-1] // 2) if FUNCTIONS[function] else x.shape
    return x.new_empty(shape)


def as_dtype(value: float, dtype: torch.dtype) -> float:
    """``value`` as a tensor of ``dtype`` would hold it (via float32, to nearest even).

    Plain Python, so it also runs while a compiled graph is traced. PyTorch's XPU (and CUDA)
    ``F.threshold`` rounds the threshold so; the vendor kernel compares in float32, so
    ``fatrelu_and_mul`` hands it the rounded threshold and agrees with native on every gate.
    """
    try:
        (f32,) = struct.unpack("<f", struct.pack("<f", value))
    except OverflowError:
        f32 = math.copysign(math.inf, value)
    if dtype == torch.float32 or not math.isfinite(f32):
        return f32
    if dtype == torch.float16:
        try:
            (half,) = struct.unpack("<e", struct.pack("<e", f32))
        except OverflowError:
            half = math.copysign(math.inf, f32)
        return half
    if dtype == torch.bfloat16:
        (bits,) = struct.unpack("<I", struct.pack("<f", f32))
        bits = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16) & 0xFFFFFFFF
        (rounded,) = struct.unpack("<f", struct.pack("<I", bits))
        return rounded
    raise ValueError(f"as_dtype: {dtype} is not float32, float16 or bfloat16")


def rules(x: Tensor, gated: bool) -> bool | vllm_ir.Unsupported:
    """The kernels' argument rules, independent of the device (unit-tested on CPU tensors)."""
    if x.dtype not in DTYPES:
        return vllm_ir.Unsupported(f"vllm-xpu-kernels' activations take float32/float16/bfloat16, not {x.dtype}")
    if x.dim() == 0:
        return vllm_ir.Unsupported("x is 0-d (the kernels take rows of the last dimension)")
    if x.shape[-1] == 0:
        return vllm_ir.Unsupported("last dimension is 0 (the kernels divide by the row length)")
    if gated and x.shape[-1] % 2:
        return vllm_ir.Unsupported(f"last dimension {x.shape[-1]} is odd (gate and up halves differ in size)")
    if not x.is_contiguous():
        return vllm_ir.Unsupported("x must be contiguous: the kernels address row t at t * row length")
    return True


def _installed(function: str) -> bool | vllm_ir.Unsupported:
    if vendor_name(function) is None:
        return vllm_ir.Unsupported(f"the installed vllm-xpu-kernels has no {function}: upgrade it")
    return True


def _supports(x: Tensor, function: str) -> bool | vllm_ir.Unsupported:
    return _on_xpu(x) and rules(x, FUNCTIONS[function]) and _installed(function)


def _call(x: Tensor, function: str, *params: float) -> Tensor:
    return activation(x, function, [float(p) for p in params])


@XPU.impl(
    "gelu_and_mul",
    supports=(
        approximate_verdict,
        lambda x: _on_xpu(x) and rules(x, gated=True),
        lambda approximate: _installed(_GELU_FUNCTIONS[approximate]),
    ),
)
def gelu_and_mul(x, approximate="none"):
    check_approximate(approximate, "gelu_and_mul (provider xpu_kernels)")
    return _call(x, _GELU_FUNCTIONS[approximate])


@XPU.impl("fatrelu_and_mul", supports=lambda x: _supports(x, "fatrelu_and_mul"))
def fatrelu_and_mul(x, threshold=0.0):
    return _call(x, "fatrelu_and_mul", as_dtype(threshold, x.dtype))


@XPU.impl("swigluoai_and_mul", supports=lambda x: _supports(x, "swigluoai_and_mul"))
def swigluoai_and_mul(x, alpha=1.702, limit=7.0):
    return _call(x, "swigluoai_and_mul", alpha, limit)


def _register(op: str, function: str) -> None:
    """An op of x alone: ``function`` into a fresh out, declined where this release lacks it."""

    def impl(x):
        return _call(x, function)

    impl.__name__ = impl.__qualname__ = op
    XPU.register(op, impl, supports=lambda x: _supports(x, function))


for _op, _function in (
    ("silu_and_mul", "silu_and_mul"),
    ("mul_and_silu", "mul_and_silu"),
    ("gelu_new", "gelu_new"),
    ("gelu_fast", "gelu_fast"),
    ("quick_gelu", "gelu_quick"),
    ("relu2", "relu2"),
):
    _register(_op, _function)
