"""A tour of eager dispatch: declare nothing, register one extra kernel, steer it, explain it.

python examples/eager_dispatch.py
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

import vllm_ir


def register_demo_provider() -> None:
    """An in-place fused add + RMSNorm built from in-place torch ops; declines non-fp32 inputs."""

    def fp32_only(x, x_residual, weight, epsilon, variance_size=None):
        if x.dtype != torch.float32:
            return vllm_ir.Unsupported(f"demo kernel computes in {x.dtype}: fp32 inputs only")
        if variance_size is not None:
            return vllm_ir.Unsupported("variance_size is not supported")
        return True

    @vllm_ir.ops.fused_add_rms_norm.register_impl("demo_inplace", supports_args=fp32_only, inplace=True)
    def fused_add_rms_norm(
        x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
    ) -> tuple[Tensor, Tensor]:
        x_residual.add_(x)
        torch.mul(x_residual, torch.rsqrt(x_residual.pow(2).mean(-1, keepdim=True) + epsilon), out=x)
        if weight is not None:
            x.mul_(weight)
        return x, x_residual


def main() -> None:
    register_demo_provider()
    op = vllm_ir.ops.fused_add_rms_norm
    print("ops:", ", ".join(o.name for o in vllm_ir.ops))
    print("default priority:", [str(e) for e in op.get_priority()])

    vllm_ir.set_priority(fused_add_rms_norm=["demo_inplace"])
    print("after set_priority:", [str(e) for e in op.get_priority()])

    x, residual, weight, eps, _ = op.generate_inputs((16, 4096), torch.float32)
    print()
    print(op.explain(x, residual, weight, eps))
    print()
    print(op.explain(x.bfloat16(), residual.bfloat16(), weight.bfloat16(), eps))

    # Functional call: inputs untouched even though the chosen kernel works in place.
    x0 = x.clone()
    out, _ = op(x, residual, weight, eps)
    assert torch.equal(x, x0)
    reference = op.fn(x, residual, weight, eps)
    torch.testing.assert_close(out, reference[0], atol=1e-5, rtol=1e-5)

    # maybe_inplace: the kernel reuses the donated buffers.
    out, _ = op.maybe_inplace(x, residual, weight, eps)
    print(f"\nmaybe_inplace reused x's buffer: {out.data_ptr() == x.data_ptr()}")

    with vllm_ir.priority(fused_add_rms_norm=["native"]):
        print("inside priority(native):", op.dispatch(x, residual, weight, eps).provider)
    print("outside again:", op.dispatch(x, residual, weight, eps).provider)

    # A bf16 call falls back to native with one warning that says why; it is counted.
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            op(x.bfloat16(), residual.bfloat16(), weight.bfloat16(), eps)
    print("warnings:", [str(w.message) for w in caught])
    print("dispatch_stats:", vllm_ir.dispatch_stats())

    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        op.maybe_inplace(x, residual, weight, eps)
    print(f"\n{n} eager maybe_inplace calls on [16, 4096] fp32: {(time.perf_counter() - t0) / n * 1e6:.1f} us/call")


if __name__ == "__main__":
    main()
