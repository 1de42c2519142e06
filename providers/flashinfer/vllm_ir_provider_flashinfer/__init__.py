"""Provider ``flashinfer``: FlashInfer's fused all-reduce + residual add + RMSNorm (CUDA).

Implements the tensor-parallel ops ``all_reduce_rms_norm`` and ``all_reduce_fused_add_rms_norm``
(declared in ``vllm_ir.ir.declarations.collective``) with FlashInfer's unified all-reduce
fusion API (``flashinfer.comm``, checked against flashinfer-python 0.7.4):

- ``create_allreduce_fusion_workspace(backend="trtllm", world_size, rank, max_token_num,
  hidden_dim, dtype, group=...)``: the IPC (Lamport) buffers the one-shot / two-shot kernels
  exchange partial sums through; a collective call, made by every rank on its first call;
- ``allreduce_fusion(input, workspace, pattern=AllReduceFusionPattern.kARResidualRMSNorm,
  residual_out=..., norm_out=..., residual_in=..., rms_gamma=..., rms_eps=...)``.

Loading this module never imports FlashInfer or initializes CUDA: availability comes from
torch's build, a visible GPU and whether ``flashinfer`` can be found; the vendor module is
imported on the first real call (``ops.py``).

No default priority: the kernel cannot be measured on this project's machines, and it only pays
off with two or more GPUs; put ``flashinfer`` first for these ops yourself
(``VLLM_IR_OP_PRIORITY=all_reduce_fused_add_rms_norm=flashinfer``) after measuring.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

import vllm_ir
from vllm_ir import Provider
from vllm_ir.plugins.provider import define_custom_ops
from vllm_ir_provider_flashinfer import ops

__version__ = "0.1.0"
PROVIDER = "flashinfer"
#: The dtypes the TRT-LLM all-reduce fusion kernel is instantiated for.
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Rank counts FlashInfer's TRT-LLM backend serves: the kernel is instantiated for 2/4/8/16, and
#: its one-shot/two-shot heuristic (``_use_oneshot_heuristics``) knows only 2, 4 and 8.
WORLD_SIZES = (2, 4, 8)
#: The kernel loads rows in 16-byte vectors: the hidden size must be a multiple of 16 bytes.
VECTOR_BYTES = 16


def availability() -> bool | vllm_ir.Unsupported:
    """Supported with a CUDA build of torch, a visible GPU and FlashInfer importable."""
    if torch.version.cuda is None:
        build = "a ROCm" if torch.version.hip is not None else "a CPU"
        return vllm_ir.Unsupported(f"torch is {build} build; FlashInfer's all-reduce fusion needs CUDA")
    if not torch.cuda.is_available():
        return vllm_ir.Unsupported("no CUDA GPU is visible")
    if importlib.util.find_spec("flashinfer") is None:
        return vllm_ir.Unsupported("flashinfer-python not installed")
    return True


def group_size(group_name: str) -> int | vllm_ir.Unsupported:
    """The number of ranks of the process group named ``group_name`` (not the token count)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return vllm_ir.Unsupported("torch.distributed is not initialized")
    try:
        return dist.distributed_c10d._resolve_process_group(group_name).size()
    except Exception as exc:
        return vllm_ir.Unsupported(f"process group {group_name!r} is unknown here ({type(exc).__name__})")


def _on_gpu(x: Tensor) -> bool | vllm_ir.Unsupported:
    if x.device.type != "cuda":
        return vllm_ir.Unsupported(f"tensors are on {x.device.type}; FlashInfer's all-reduce fusion runs on CUDA GPUs")
    return True


# The predicates read the hidden size and the group's size: registered cacheable=False.
def rules(x: Tensor, weight: Tensor | None, group_name: str) -> bool | vllm_ir.Unsupported:
    """``all_reduce_rms_norm``'s predicate: the device, then the argument rules and the group's size
    (unit-tested on CPU tensors, the device check stood in for)."""
    if not (on_gpu := _on_gpu(x)):
        return on_gpu
    if x.dtype not in DTYPES:
        return vllm_ir.Unsupported(f"FlashInfer's all-reduce fusion takes float16/bfloat16/float32, not {x.dtype}")
    if x.dim() < 1 or not x.is_contiguous():
        return vllm_ir.Unsupported("x must be contiguous (the kernel addresses rows as token * hidden)")
    multiple = VECTOR_BYTES // x.element_size()
    if x.shape[-1] % multiple:
        return vllm_ir.Unsupported(
            f"hidden size {x.shape[-1]} is not a multiple of {multiple} (FlashInfer loads rows in 16-byte vectors)"
        )
    if weight is not None:
        if weight.dtype != x.dtype:
            return vllm_ir.Unsupported(f"weight dtype {weight.dtype} must match x dtype {x.dtype}")
        if weight.shape != (x.shape[-1],) or not weight.is_contiguous():
            return vllm_ir.Unsupported("weight must be a contiguous 1-D [hidden] tensor")
    size = group_size(group_name)
    if isinstance(size, vllm_ir.Unsupported):
        return size
    if size not in WORLD_SIZES:
        return vllm_ir.Unsupported(f"world size {size}; FlashInfer's TRT-LLM all-reduce fusion serves {WORLD_SIZES}")
    return True


def residual_rules(x: Tensor, x_residual: Tensor) -> bool | vllm_ir.Unsupported:
    """What ``all_reduce_fused_add_rms_norm`` asks before `rules`."""
    if x_residual.shape != x.shape or x_residual.dtype != x.dtype or not x_residual.is_contiguous():
        return vllm_ir.Unsupported("residual must be contiguous with x's shape and dtype")
    return True


SUPPORTED = availability()
if SUPPORTED:  # elsewhere the custom op is defined on its first call (tests, with doubles)
    define_custom_ops(ops)
#: The registration surface: unavailable with `availability`'s reason; the predicates read the
#: group's size, which the decision key leaves out, so nothing is cached.
FLASHINFER = Provider(PROVIDER, available=SUPPORTED, cacheable=False)


@FLASHINFER.impl("all_reduce_rms_norm", supports=rules)
def all_reduce_rms_norm(x, weight, epsilon, group_name):
    return ops.allreduce_fusion(x, None, weight, epsilon, group_name)


@FLASHINFER.impl("all_reduce_fused_add_rms_norm", supports=(residual_rules, rules))
def all_reduce_fused_add_rms_norm(x, x_residual, weight, epsilon, group_name):
    return ops.allreduce_fusion(x, x_residual, weight, epsilon, group_name)


__all__ = ["ops"]
