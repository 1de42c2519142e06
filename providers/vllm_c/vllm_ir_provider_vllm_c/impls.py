"""The ``vllm_c`` implementations of ``rms_norm`` and ``fused_add_rms_norm``.

Each wraps one ``torch.ops.vllm_ir_c`` op; the predicates say why a call is declined. They
read only dtypes, devices, number of dimensions and the last dimension's stride, never the
batch size or values.

The dispatch cache keys a decision on a layout class (contiguous, unit inner stride, other),
not on full strides, and a size-1 last dimension is accepted whatever its stride, so a cached
verdict can meet a layout the predicate would have declined. The C++ ops therefore accept
every layout (awkward ones run on a contiguous copy); the predicates still decline a
non-unit last-dimension stride so that ``explain`` says what is slow about it.
"""

from __future__ import annotations

import torch
from torch import Tensor

import vllm_ir
from vllm_ir import Unsupported

from ._extension import ExtensionStatus

PROVIDER = "vllm_c"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def register(status: ExtensionStatus) -> None:
    """Register both implementations; unsupported with the load failure's reason if not loaded."""
    supported: bool | Unsupported = True if status.loaded else Unsupported(status.reason or "not loaded")
    if status.loaded:
        rms_norm_kernel = torch.ops.vllm_ir_c.rms_norm.default
        fused_add_rms_norm_kernel = torch.ops.vllm_ir_c.fused_add_rms_norm.default
    else:
        rms_norm_kernel = fused_add_rms_norm_kernel = _not_loaded(status)
    devices = ("cpu", "cuda") if status.cuda_kernels and torch.version.hip is None else ("cpu",)
    # The CPU kernels reduce each row in a fixed order whatever the batch; the CUDA ones do not
    # (their summation order depends on hidden size and pointer alignment).
    batch_invariant = devices == ("cpu",)

    def supports_rms_norm(
        x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
    ) -> bool | Unsupported:
        verdict = _common_verdict(x, weight, variance_size, devices)
        return True if verdict is None else verdict

    def supports_fused_add_rms_norm(
        x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
    ) -> bool | Unsupported:
        verdict = _common_verdict(x, weight, variance_size, devices)
        if verdict is not None:
            return verdict
        if x_residual.dtype != x.dtype:
            return Unsupported(f"x_residual dtype {x_residual.dtype} differs from x dtype {x.dtype}")
        if x_residual.device != x.device:
            return Unsupported(f"x_residual is on {x_residual.device}, x on {x.device}")
        if x_residual.shape != x.shape:
            return Unsupported(
                f"x_residual shape {list(x_residual.shape)} != x shape {list(x.shape)} "
                "(native broadcasts; the kernels update the residual in place)"
            )
        if x_residual.stride(-1) != 1 and x_residual.size(-1) != 1:
            return Unsupported(
                f"x_residual has stride {x_residual.stride(-1)} along the last dimension (the kernels need 1)"
            )
        return True

    @vllm_ir.ops.rms_norm.register_impl(
        PROVIDER, supported=supported, supports_args=supports_rms_norm, batch_invariant=batch_invariant
    )
    def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
        out = torch.empty_like(x)
        rms_norm_kernel(out, x, weight, epsilon)
        return out

    @vllm_ir.ops.fused_add_rms_norm.register_impl(
        PROVIDER,
        supported=supported,
        supports_args=supports_fused_add_rms_norm,
        inplace=True,
        batch_invariant=batch_invariant,
    )
    def fused_add_rms_norm(
        x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
    ) -> tuple[Tensor, Tensor]:
        # In place: x_residual <- x + x_residual, x <- rms_norm(the fp32 sum) * weight.
        fused_add_rms_norm_kernel(x, x_residual, weight, epsilon)
        return x, x_residual


def _common_verdict(
    x: Tensor, weight: Tensor | None, variance_size: int | None, devices: tuple[str, ...]
) -> Unsupported | None:
    if variance_size is not None:
        return Unsupported("variance_size is not supported (the kernels normalize over the whole last dimension)")
    if x.dtype not in DTYPES:
        return Unsupported(f"dtype {x.dtype} is not supported (float32, bfloat16, float16)")
    if x.device.type not in devices:
        return Unsupported(f"device {x.device.type} is not supported (kernels built for: {', '.join(devices)})")
    if x.dim() == 0:
        return Unsupported("x is 0-d (the kernels normalize over a last dimension)")
    if x.stride(-1) != 1 and x.size(-1) != 1:
        return Unsupported(f"x has stride {x.stride(-1)} along the last dimension (the kernels need 1)")
    if weight is not None:
        if weight.dtype != x.dtype:
            return Unsupported(
                f"weight dtype {weight.dtype} differs from x dtype {x.dtype} "
                "(native promotes the result; the kernels compute in x's dtype)"
            )
        if weight.device != x.device:
            return Unsupported(f"weight is on {weight.device}, x on {x.device}")
        if weight.dim() != 1:
            return Unsupported(f"weight is {weight.dim()}-d (the kernels take a 1-d weight)")
        if weight.shape[0] != x.shape[-1]:
            return Unsupported(f"weight has {weight.shape[0]} elements, x rows {x.shape[-1]} (native broadcasts)")
    return None


def _not_loaded(status: ExtensionStatus):
    def kernel(*args: object) -> None:
        raise RuntimeError(f"vllm_c kernels are not available: {status.reason}")

    return kernel
