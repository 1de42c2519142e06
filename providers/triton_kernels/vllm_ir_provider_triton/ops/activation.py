"""The activation catalogue in Triton; the kernels are in ``kernels/activation.py``.

Every implementation is registered ``batch_invariant``: each output element is computed from
its own inputs alone, whatever the number of rows. ``exact=True`` (bit-identical to native,
held to zero tolerance by the conformance kit) only where the arithmetic is exact on every
back-end: ``fatrelu_and_mul`` (a comparison and one multiply) and ``relu2`` (one multiply).
The others go through exp or erf, whose implementations differ in the last bit between
PyTorch, Triton's GPU libraries and the interpreter's numpy: they meet the op's tolerances.

Predicates read dtypes, devices, the number of dimensions, the last dimension and the layout
class (contiguous, 2-D unit inner stride, other) and scalar arguments, never the batch size.
"""

from __future__ import annotations

import torch
from torch import Tensor

import vllm_ir
from vllm_ir.ir.declarations.activation import approximate_verdict, check_approximate
from vllm_ir_provider_triton import TRITON, dtype_and_device_verdict

#: Widest gate of gelu_and_mul_sparse's row kernel (kernels.activation.MAX_SPARSE_D; not imported
#: from there, which needs Triton).
MAX_SPARSE_D = 32768


def elementwise_supports(x: Tensor) -> bool | vllm_ir.Unsupported:
    """Any shape, contiguous (one flat row) or 2-D rows with a unit inner stride."""
    verdict = dtype_and_device_verdict(x)
    if verdict and not x.is_contiguous() and not (x.dim() == 2 and x.stride(-1) == 1):
        return vllm_ir.Unsupported("x must be contiguous, or 2-D rows with a unit inner stride")
    return verdict


def gated_supports(x: Tensor) -> bool | vllm_ir.Unsupported:
    """A row layout the gated kernel indexes: even last dimension, contiguous or unit-inner-stride 2-D rows."""
    if x.dim() == 0:
        return vllm_ir.Unsupported("x is 0-d (gated ops split the last dimension)")
    if x.shape[-1] % 2:
        return vllm_ir.Unsupported(f"last dimension {x.shape[-1]} is odd (gate and up halves differ in size)")
    return elementwise_supports(x)


def sparse_gate_supports(x: Tensor) -> bool | vllm_ir.Unsupported:
    """A gate of at most MAX_SPARSE_D columns (one program holds a row)."""
    if x.shape[-1] // 2 > MAX_SPARSE_D:
        return vllm_ir.Unsupported(
            f"the gate has {x.shape[-1] // 2} columns (the row kernel holds at most {MAX_SPARSE_D})"
        )
    return True


def _gated_out(x: Tensor) -> Tensor:
    return torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)


if TRITON.available:
    from vllm_ir_provider_triton.kernels import activation as k
    from vllm_ir_provider_triton.kernels.activation import (
        elementwise_activation_out,
        gated_activation_out,
        gelu_and_mul_sparse_out,
    )

    assert k.MAX_SPARSE_D == MAX_SPARSE_D


def _gated(x: Tensor, activation: int, layout: int, p0: float = 0.0, p1: float = 0.0) -> Tensor:
    out = _gated_out(x)
    gated_activation_out(out, x, activation, layout, p0, p1)
    return out


@TRITON.impl("silu_and_mul", supports=gated_supports)
def silu_and_mul(x):
    return _gated(x, k.SILU.value, k.GATE_FIRST.value)


@TRITON.impl("mul_and_silu", supports=gated_supports)
def mul_and_silu(x):
    return _gated(x, k.SILU.value, k.GATE_SECOND.value)


@TRITON.impl("gelu_and_mul", supports=(approximate_verdict, gated_supports))
def gelu_and_mul(x, approximate="none"):
    check_approximate(approximate, "gelu_and_mul (provider triton)")
    return _gated(x, (k.GELU if approximate == "none" else k.GELU_TANH).value, k.GATE_FIRST.value)


# F.threshold compares x with the threshold as float32 on CPU, and with the threshold rounded to
# x's dtype on CUDA and XPU (they differ for e.g. 0.1 in bfloat16): the kernel compares as native
# does on x's device, so it is exact on both.
@TRITON.impl("fatrelu_and_mul", supports=gated_supports, exact=True)
def fatrelu_and_mul(x, threshold=0.0):
    activation = k.FATRELU if x.device.type == "cpu" else k.FATRELU_DTYPE_THRESHOLD
    return _gated(x, activation.value, k.GATE_FIRST.value, float(threshold))


@TRITON.impl("swigluoai_and_mul", supports=gated_supports)
def swigluoai_and_mul(x, alpha=1.702, limit=7.0):
    return _gated(x, k.SWIGLUOAI.value, k.INTERLEAVED.value, float(alpha), float(limit))


# vLLM's own Triton gelu_and_mul_sparse is a triton_op too: Inductor sees into it under compile.
@TRITON.impl("gelu_and_mul_sparse", supports=(approximate_verdict, gated_supports, sparse_gate_supports))
def gelu_and_mul_sparse(x, std_multiplier, approximate="none"):
    check_approximate(approximate, "gelu_and_mul_sparse (provider triton)")
    out = _gated_out(x)
    gelu_and_mul_sparse_out(out, x, float(std_multiplier), approximate == "tanh")
    return out


def _elementwise(name: str, activation: str, exact: bool = False) -> None:
    """One elementwise op: x -> a fresh tensor of x's shape through `elementwise_activation_out`."""

    def impl(x):
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        elementwise_activation_out(out, x, getattr(k, activation).value)
        return out

    impl.__name__ = impl.__qualname__ = name
    TRITON.register(name, impl, supports=elementwise_supports, exact=exact)


for _name, _activation in (("gelu_new", "GELU_NEW"), ("gelu_fast", "GELU_FAST"), ("quick_gelu", "QUICK_GELU")):
    _elementwise(_name, _activation)
_elementwise("relu2", "RELU2", exact=True)
