"""Provider ``aiter``: AMD AITER's RMSNorm, activation and FP8 quant kernels behind ``vllm_ir_aiter``
custom ops (ROCm only). Every op registers through `AITER` (a `vllm_ir.Provider`): the norms here, the
activations in ``activation.py``, quantization in ``quant.py`` (every public module but ``ops.py``,
the custom ops, is imported).

Loading this module never imports AITER: availability is decided from torch's build, the
visible GPU and whether the ``aiter`` package can be found, and the vendor module is
imported on the first real call.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

import vllm_ir
from vllm_ir import Provider
from vllm_ir.ir.declarations.layernorm import contiguous_residual_verdict, variance_size_verdict, weight_dtype_verdict
from vllm_ir.plugins.provider import define_custom_ops, import_families
from vllm_ir_provider_aiter import ops

__version__ = "0.1.0"
PROVIDER = "aiter"
DTYPES = (torch.float16, torch.bfloat16)


def availability() -> bool | vllm_ir.Unsupported:
    """Supported only on a ROCm build of torch with a GPU and AITER importable."""
    if torch.version.hip is None:
        build = f"a CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU"
        return vllm_ir.Unsupported(f"torch is {build} build, AITER needs ROCm")
    if not torch.cuda.is_available():
        return vllm_ir.Unsupported("no ROCm GPU is visible")
    if importlib.util.find_spec("aiter") is None:
        return vllm_ir.Unsupported("aiter not installed")
    return True


def _flattens_without_copy(x: Tensor) -> bool:
    """AITER takes [rows, hidden] with a row stride: contiguous tensors, or 2-D unit-inner-stride rows."""
    return x.is_contiguous() or (x.dim() == 2 and x.stride(-1) == 1)


def _on_gpu(x: Tensor) -> bool | vllm_ir.Unsupported:
    if x.device.type != "cuda":
        return vllm_ir.Unsupported(f"tensors are on {x.device.type}; AITER runs on ROCm GPUs")
    return True


def rules(x: Tensor, weight: Tensor | None, variance_size: int | None) -> bool | vllm_ir.Unsupported:
    """``rms_norm``'s predicate: the device, then the argument rules (unit-tested on CPU tensors,
    the device check stood in for)."""
    if not (verdict := _on_gpu(x) and variance_size_verdict(variance_size)):
        return verdict
    if x.dtype not in DTYPES:
        return vllm_ir.Unsupported(f"AITER RMSNorm takes float16/bfloat16, not {x.dtype}")
    if not (verdict := weight_dtype_verdict(x, weight)):
        return verdict
    if not _flattens_without_copy(x):
        return vllm_ir.Unsupported("input cannot be flattened to 2-D without a copy (e.g. a per-head view)")
    return True


SUPPORTED = availability()
if SUPPORTED:  # elsewhere each custom op is defined on its first call (tests, with doubles)
    define_custom_ops(ops)
#: The registration surface of every family: unavailable with `availability`'s reason.
AITER = Provider(PROVIDER, available=SUPPORTED)


@AITER.impl("rms_norm", supports=rules)
def rms_norm(x, weight, epsilon, variance_size=None):
    return ops.rms_norm(x, weight, epsilon)


@AITER.impl("fused_add_rms_norm", supports=(contiguous_residual_verdict, rules))
def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None):
    return ops.fused_add_rms_norm(x, x_residual, weight, epsilon)


@vllm_ir.hookimpl(tryfirst=True)
def vllm_ir_default_priority(platform, mode):
    """On ROCm in eager mode, ``aiter`` first for every op it implements (tryfirst: ahead of
    other GPU providers such as vllm_c, as the seed's ROCm defaults order them)."""
    if platform.name == "rocm" and mode == "eager":
        return {op: [PROVIDER] for op in vllm_ir.ops_implemented_by(PROVIDER)}
    return None


#: The op family modules (every public module of this package), each registered through `AITER`.
FAMILIES = import_families(__name__, __path__, skip=lambda name: name == "ops")

__all__ = ["activation", "ops", "quant"]
