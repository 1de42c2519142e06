"""The layernorm family: ``rms_norm`` and ``fused_add_rms_norm`` (csrc/cpu/layernorm.cpp,
csrc/cuda/layernorm.cu).

Each implementation wraps one ``torch.ops.vllm_ir_c`` op; ``fused_add_rms_norm`` registers both
kernel forms under ``vllm_c``: ``op(...)`` runs the out-of-place kernel (fresh outputs, no
clones), ``op.maybe_inplace(...)`` the in-place one on the donated activations.

The weight is applied as the op (and vLLM 0.33) applies it: a weight of x's dtype multiplies
the normalized value rounded to x's dtype; a float32 weight with a bf16/fp16 x (the Hugging
Face checkpoint case) multiplies the fp32 value and rounds once. A weight of a third dtype
(bf16 with float32 or float16 x, float16 with bf16 or float32 x) is declined: native runs it.

The predicates say why a call is declined. They read only dtypes, devices, shapes other than
the batch, and the last dimension's stride, never the batch size or values (the dispatch cache
keys on all of those facts, so a cached verdict always matches the call). The C++ ops still
accept every layout (awkward ones run on a contiguous copy), so a direct ``torch.ops.vllm_ir_c``
call is correct too; the predicates decline a non-unit last-dimension stride so that
``explain`` says what would be slow about it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_ir.ir.declarations.layernorm import residual_verdict, variance_size_verdict, weight_verdict

from ._extension import DEVICES, STATUS, VLLM_C, residual_stride_verdict, rows_on, torch_op

#: Platforms where ``vllm_c`` goes first for these ops in eager mode: CPU (benchmarks/kernels.py:
#: it wins at every shape there) and CUDA (the seed's defaults). Not ROCm: vllm_c builds no HIP
#: kernels (`_extension.devices`), so there it could only decline every GPU call.
EAGER_FIRST = {platform: ("rms_norm", "fused_add_rms_norm") for platform in ("cpu", "cuda")}
# The CPU kernels reduce each row in a fixed order whatever the batch; the CUDA ones do not
# (their summation order depends on hidden size and pointer alignment).
OPTIONS = {"batch_invariant": DEVICES == ("cpu",)}
_rms_norm = torch_op(STATUS, "rms_norm")
_fused = torch_op(STATUS, "fused_add_rms_norm")
_fused_out = torch_op(STATUS, "fused_add_rms_norm_out")


#: What both norms check (rms_norm's predicate); x's optional weight and fused_add_rms_norm's
#: residual are checked as the fused norm + quant kernels check them.
NORM = (variance_size_verdict, rows_on(DEVICES), weight_verdict)


@VLLM_C.impl("rms_norm", supports=NORM, **OPTIONS)
def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    out = torch.empty_like(x)
    _rms_norm(out, x, weight, epsilon)
    return out


@VLLM_C.impl("fused_add_rms_norm", supports=(*NORM, residual_verdict, residual_stride_verdict), **OPTIONS)
def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None, inplace=False):
    if inplace:  # x_residual <- x + x_residual, x <- rms_norm(the fp32 sum) * weight
        _fused(x, x_residual, weight, epsilon)
        return x, x_residual
    # One pass over x and x_residual into two fresh tensors.
    out = torch.empty_like(x)
    residual = torch.empty_like(x)
    _fused_out(out, residual, x, x_residual, weight, epsilon)
    return out, residual
