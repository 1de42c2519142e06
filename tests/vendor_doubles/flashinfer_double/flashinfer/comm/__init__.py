"""TEST DOUBLE of ``flashinfer.comm``'s all-reduce fusion API (not FlashInfer): records calls,
checks the contract the TRT-LLM kernel relies on, and computes with torch.distributed + torch.

Signatures follow flashinfer-python 0.7.4 (``flashinfer/comm/allreduce.py``); the all-reduce is
a real ``torch.distributed.all_reduce`` over the workspace's group (gloo on CPU here).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

IS_TEST_DOUBLE = True
CALLS: list[dict] = []


class AllReduceFusionPattern:
    kAllReduce = 0
    kARResidualRMSNorm = 1
    kARResidualRMSNormFP8Quant = 2


class Workspace:
    """Stands for ``TRTLLMAllReduceFusionWorkspace``: remembers what it was sized for."""

    def __init__(self, world_size, rank, max_token_num, hidden_dim, dtype, group):
        self.world_size, self.rank, self.group = world_size, rank, group
        self.max_token_num, self.hidden_dim, self.dtype = max_token_num, hidden_dim, dtype
        self.destroyed = False

    def is_buffer_size_sufficient(self, tp_size, num_tokens, hidden_dim, dtype, use_oneshot=None):
        need = num_tokens * hidden_dim * dtype.itemsize
        return tp_size == self.world_size and need <= self.max_token_num * self.hidden_dim * self.dtype.itemsize

    def destroy(self):
        CALLS.append({"fn": "destroy", "workspace": self})
        self.destroyed = True


def create_allreduce_fusion_workspace(
    backend="auto", world_size=None, rank=None, max_token_num=None, hidden_dim=None, dtype=None,
    gpus_per_node=None, comm_backend=None, force_oneshot_support=False, group=None, **kwargs,
):  # fmt: skip
    assert backend in ("trtllm", "mnnvl", "auto"), backend
    assert world_size == group.size() and rank == group.rank(), "world_size/rank must be the group's"
    ws = Workspace(world_size, rank, max_token_num, hidden_dim, dtype, group)
    CALLS.append({"fn": "create_allreduce_fusion_workspace", "backend": backend, "workspace": ws})
    return ws


def allreduce_fusion(
    input, workspace, pattern, launch_with_pdl=False, trigger_completion_at_end=True, output=None,
    residual_out=None, norm_out=None, quant_out=None, scale_out=None, residual_in=None, rms_gamma=None,
    rms_eps=1e-6, scale_factor=None, layout_code=None, use_oneshot=None, fp32_acc=False, **kwargs,
):  # fmt: skip
    CALLS.append(
        {"fn": "allreduce_fusion", "input": input, "workspace": workspace, "pattern": pattern,
         "residual_out": residual_out, "norm_out": norm_out, "residual_in": residual_in,
         "rms_gamma": rms_gamma, "rms_eps": rms_eps, "use_oneshot": use_oneshot}
    )  # fmt: skip
    assert pattern == AllReduceFusionPattern.kARResidualRMSNorm, "only the AR + residual + RMSNorm pattern here"
    assert not workspace.destroyed, "a destroyed workspace"
    tokens, hidden = input.shape
    assert input.dim() == 2 and input.is_contiguous(), "the kernel takes a contiguous [token_num, hidden_dim]"
    assert hidden % (16 // input.element_size()) == 0, "params.hidden_dim % VEC_SIZE != 0"
    assert workspace.is_buffer_size_sufficient(workspace.world_size, tokens, hidden, input.dtype), "workspace too small"
    assert use_oneshot or tokens > workspace.world_size, "sequence length should be larger than tp_size"
    for t in (residual_in, residual_out, norm_out):
        assert t.shape == input.shape and t.dtype == input.dtype and t.is_contiguous()
    assert rms_gamma.shape == (hidden,) and rms_gamma.dtype == input.dtype
    reduced = input.clone()
    dist.all_reduce(reduced, group=workspace.group)
    total = reduced.float() + residual_in.float()
    residual_out.copy_(total)
    total = residual_out.float()
    norm_out.copy_(total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + rms_eps) * rms_gamma.float())
    return norm_out
