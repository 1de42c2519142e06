"""Small helpers to build implementations with the core ops' exact signatures."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

import vllm_ir


def rms_norm_impl(provider: str, body: Callable[..., Tensor] | None = None, **options) -> Callable[..., Tensor]:
    """Register an rms_norm implementation that records its calls and computes like native."""
    calls: list[str] = []

    def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
        calls.append(provider)
        fn = body or vllm_ir.ops.rms_norm.fn
        return fn(x, weight, epsilon, variance_size)

    rms_norm.calls = calls  # type: ignore[attr-defined]
    vllm_ir.ops.rms_norm.register_impl(provider, **options)(rms_norm)
    return rms_norm


def inplace_fused_add_rms_norm(
    x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> tuple[Tensor, Tensor]:
    """A correct in-place implementation built from in-place torch ops (fp32 inputs)."""
    x_residual.add_(x)
    variance = x_residual.pow(2).mean(dim=-1, keepdim=True)
    torch.mul(x_residual, torch.rsqrt(variance + epsilon), out=x)
    if weight is not None:
        x.mul_(weight)
    return x, x_residual


def x_w(tokens: int = 4, hidden: int = 16, dtype: torch.dtype = torch.float32):
    return vllm_ir.ops.rms_norm.generate_inputs((tokens, hidden), dtype)[:3]


@contextlib.contextmanager
def discovery_answering(**answers: Callable[..., object]) -> Iterator[None]:
    """Connect a discovery that answers ``answers`` (fields of `vllm_ir.ir.registry.Discovery`,
    e.g. ``defaults=lambda mode: {...}``) and the rest as the connected one; reconnect that on exit."""
    from vllm_ir.ir import registry

    previous = registry.discovery()
    registry.connect_discovery(dataclasses.replace(previous, **answers))
    try:
        yield
    finally:
        registry.connect_discovery(previous)
