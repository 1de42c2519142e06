"""``vllm_ir_flashinfer::allreduce_fusion``: each fused all-reduce is one opaque node for the compiler.

Both ops run FlashInfer's ``kARResidualRMSNorm`` pattern through it (``residual_out =
allreduce(x) + residual_in``, ``norm_out = rmsnorm(residual_out) * gamma``); ``all_reduce_rms_norm``
has no residual, so it passes None for a zero residual and returns ``residual_out`` as the reduced
sum (FlashInfer has no norm-without-residual pattern). The workspace is created per (group, dtype,
hidden size) on the first call and regrown (doubling its token capacity) when a call needs more:
both are collective, and every rank makes the same calls in the same order, as the ops require.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from vllm_ir.plugins.provider import deferred_custom_op, weight_or_ones

#: Token capacity of a first workspace (grown on demand; sized as vLLM sizes its default).
MIN_TOKENS = 1024


def _comm():
    import flashinfer.comm  # imported on first real call only: never at provider discovery

    return flashinfer.comm


@dataclass
class _Workspace:
    handle: Any
    world_size: int
    max_tokens: int


_WORKSPACES: dict[tuple[str, torch.dtype, int, torch.device], _Workspace] = {}


def workspace(group_name: str, dtype: torch.dtype, hidden: int, tokens: int, device: torch.device) -> _Workspace:
    """The TRT-LLM fusion workspace for this group, dtype and hidden size holding ``tokens`` rows."""
    import torch.distributed as dist

    key = (group_name, dtype, hidden, device)
    found = _WORKSPACES.get(key)
    if found is not None and found.handle.is_buffer_size_sufficient(found.world_size, tokens, hidden, dtype):
        return found
    group = dist.distributed_c10d._resolve_process_group(group_name)
    capacity = max(MIN_TOKENS, 1 << (tokens - 1).bit_length())
    if found is not None:
        found.handle.destroy()
        capacity = max(capacity, 2 * found.max_tokens)
    handle = _comm().create_allreduce_fusion_workspace(
        backend="trtllm",
        world_size=group.size(),
        rank=group.rank(),
        max_token_num=capacity,
        hidden_dim=hidden,
        dtype=dtype,
        group=group,
    )
    _WORKSPACES[key] = _Workspace(handle, group.size(), capacity)
    return _WORKSPACES[key]


@deferred_custom_op("vllm_ir_flashinfer::allreduce_fusion", mutates_args=())
def allreduce_fusion(
    x: Tensor, residual: Tensor | None, weight: Tensor | None, epsilon: float, group_name: str
) -> tuple[Tensor, Tensor]:
    """(norm_out, residual_out) of FlashInfer's AR + residual + RMSNorm, in fresh buffers of x's shape
    (``residual`` None: a zero residual, so ``residual_out`` is the reduced sum)."""
    hidden = x.shape[-1]
    rows = x.view(-1, hidden)  # contiguous (the predicate requires it): a view
    norm_out = torch.empty_like(rows)
    residual_out = torch.empty_like(rows)
    tokens = rows.shape[0]
    if tokens:  # every rank sees the same shape: all skip together
        ws = workspace(group_name, x.dtype, hidden, tokens, x.device)
        comm = _comm()
        comm.allreduce_fusion(
            input=rows,
            workspace=ws.handle,
            pattern=comm.AllReduceFusionPattern.kARResidualRMSNorm,
            launch_with_pdl=False,
            residual_out=residual_out,
            norm_out=norm_out,
            residual_in=torch.zeros_like(rows) if residual is None else residual.reshape(-1, hidden),
            rms_gamma=weight_or_ones(x, weight),  # the kernel always multiplies by gamma
            rms_eps=epsilon,
            # The two-shot path splits tokens across ranks and asserts more tokens than ranks.
            use_oneshot=True if tokens <= ws.world_size else None,
        )
    return norm_out.view(x.shape), residual_out.view(x.shape)


@allreduce_fusion.register_fake
def _(
    x: Tensor, residual: Tensor | None, weight: Tensor | None, epsilon: float, group_name: str
) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x)
