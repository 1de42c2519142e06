"""Tensor-parallel all-reduce fused with RMSNorm: the targets of the all-reduce fusion pass.

In a tensor-parallel decoder every row-parallel projection (attention output, MLP down)
ends in an all-reduce of partial sums, and the very next op is the (residual add +) RMSNorm.
These ops name that pair, so that a provider with a one-shot kernel (an all-reduce that
adds and normalizes while the data is in flight, as FlashInfer's all-reduce fusion does on
CUDA) can run it in one launch. Each native function is exactly the composition: a
functional all-reduce (``torch.ops._c10d_functional``, what Dynamo traces and Inductor
schedules) followed by the existing op's native function, so the fusion pass never changes
a value under the native provider.

The process group travels as its name (``group.group_name``), a ``str`` in the schema, as
the functional collectives take it. Ranks must call the op in the same order (it is a
collective); the sum is ``"sum"`` over every rank of the group.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_ir.ir.declarations.layernorm import fused_add_rms_norm, rms_norm
from vllm_ir.ir.op import register_op

_c10d = torch.ops._c10d_functional


def all_reduce_sum(x: Tensor, group_name: str, op_name: str = "all_reduce") -> Tensor:
    """The functional all-reduce (sum) of ``x`` over ``group_name``, waited on: a fresh tensor.

    A back-end failure (a dead peer, a timeout) is a `vllm_ir.ir.collectives.CollectiveError`
    naming ``op_name``, this rank and the group.
    """
    try:
        return _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group_name))
    except Exception as exc:
        from vllm_ir.ir.collectives import is_collective_failure, named_failure

        if "could not resolve the process group" in str(exc).lower():
            raise ValueError(
                f"op {op_name!r} (native): group_name {group_name!r} names no process group of this process; "
                "pass group.group_name of an initialized torch.distributed group"
            ) from exc
        if not is_collective_failure(exc):
            raise
        raise named_failure(exc, group_name, f"all_reduce of {op_name} {list(x.shape)}") from exc


@register_op
def all_reduce_rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, group_name: str) -> tuple[Tensor, Tensor]:
    """``(rms_norm(s, weight, epsilon), s)`` where ``s`` is the all-reduce (sum) of ``x`` over the group.

    The reduced tensor is returned too: in a decoder it becomes the residual.
    """
    reduced = all_reduce_sum(x, group_name, "all_reduce_rms_norm")
    return rms_norm.fn(reduced, weight, epsilon), reduced


@register_op(allow_inplace=True, activations=("x", "x_residual"))
def all_reduce_fused_add_rms_norm(
    x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, group_name: str
) -> tuple[Tensor, Tensor]:
    """``fused_add_rms_norm(all_reduce(x), x_residual, weight, epsilon)``: (normalized, new residual).

    ``maybe_inplace`` lets a kernel write its outputs into ``x`` and ``x_residual``.
    """
    reduced = all_reduce_sum(x, group_name, "all_reduce_fused_add_rms_norm")
    return fused_add_rms_norm.fn(reduced, x_residual, weight, epsilon)


COLLECTIVE_OPS = (all_reduce_rms_norm, all_reduce_fused_add_rms_norm)


# -- test inputs -----------------------------------------------------------------------------


def default_group_name() -> str:
    """The default process group's name; a one-rank gloo group in this process when none exists.

    With one rank the all-reduce is the identity, so the conformance kit and ``vllm-ir bench``
    can check and time these ops in a single process (the collective's cost is then only its
    launch and copy). Tensor-parallel runs initialize their own group first, which is used.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return dist.group.WORLD.group_name  # type: ignore[union-attr]


def _inputs(with_residual: bool):
    def generate(
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        *,
        epsilon: float = 1e-6,
        with_weight: bool = True,
        seed: int = 0,
    ) -> tuple:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
        residual = torch.randn(shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
        weight = None
        if with_weight:
            weight = (1.0 + 0.1 * torch.randn(shape[-1], generator=g, dtype=torch.float32)).to(device, dtype)
        group = default_group_name()
        if with_residual:
            return x, residual, weight, epsilon, group
        return x, weight, epsilon, group

    return generate


all_reduce_rms_norm.input_generator(_inputs(with_residual=False))
all_reduce_fused_add_rms_norm.input_generator(_inputs(with_residual=True))
for _op in COLLECTIVE_OPS:
    _op.set_tolerance(torch.float16, atol=1e-3, rtol=4e-3)  # as rms_norm's: two roundings
    _op.add_input_variant("no_weight", with_weight=False)
