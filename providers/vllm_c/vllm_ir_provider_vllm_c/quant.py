"""The FP8 quantization family: ``static_quant_fp8``, ``dynamic_quant_fp8`` and
``dynamic_group_quant_fp8`` (csrc/cpu/quant.cpp, csrc/cuda/quant.cu, shared numerics in
csrc/quant.h).

The kernels compute what the op declarations compute, rounding for rounding (fp32 reciprocal
of the scale, clamp, round-to-nearest-even encoding as c10's casts), so the implementations
claim ``exact``: the conformance kit holds them to bitwise equality with native on every row
native specifies (padding rows are left unwritten, as vLLM's kernels leave them).

The predicates read dtypes, devices, ranks, non-token sizes and the last dimension's stride,
never the token count or values; they decline with a reason what native handles and the
kernels do not (other dtypes, scale layouts of more dimensions, a 0-d x, a strided last
dimension, fp8 dtypes other than e4m3fn/e4m3fnuz, for which native raises).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_ir import Unsupported
from vllm_ir.ir.declarations.quant import (
    column_major_verdict,
    fp8_verdict,
    group_size_verdict,
    padded_shape,
    padding_verdict,
    scale_ub_verdict,
    scale_verdict,
)
from vllm_ir.plugins.provider import empty_group_scales

from ._extension import DEVICES, STATUS, VLLM_C, rows_on, torch_op

#: Platforms where ``vllm_c`` goes first for these ops in eager mode: CPU, where it beats native
#: and Inductor-compiled native at every measured token count (benchmarks/quant_cpu.py); CUDA,
#: where it beat native eager at every T on an H200 (`vllm-ir bench --device cuda`, bf16
#: [T, 4096], T 1/256/4096: 10.7-63 us against 12-244 us; Triton was faster still for the
#: dynamic ops at T=4096, 45-48 us, and ties below).
EAGER_FIRST = {
    platform: ("static_quant_fp8", "dynamic_quant_fp8", "dynamic_group_quant_fp8") for platform in ("cpu", "cuda")
}


_static = torch_op(STATUS, "static_quant_fp8")
_dynamic = torch_op(STATUS, "dynamic_quant_fp8")
_group = torch_op(STATUS, "dynamic_group_quant_fp8")
# Every value is computed from its own row (or the whole tensor's absmax, a max: no order).
OPTIONS = {"batch_invariant": True, "exact": True}


#: What every op checks first: the fp8 dtype, then x (of the activation dtypes, on a device with
#: kernels, rows of a unit-stride last dimension).
ROWS = (fp8_verdict, rows_on(DEVICES))


def scale_rank_verdict(x: Tensor, scale: Tensor) -> bool | Unsupported:
    """After the declaration's `scale_verdict`: the scale ranks the kernels take."""
    if scale.dim() > 2:
        return Unsupported(f"scale is {scale.dim()}-D (the kernels take one element, 1-D or 2-D scales)")
    if scale.dim() == 2 and x.dim() != 2:
        return Unsupported(f"a 2-D scale with a {x.dim()}-D x (the kernels group a 2-D x only)")
    return True


@VLLM_C.impl("static_quant_fp8", supports=(*ROWS, padding_verdict, scale_verdict, scale_rank_verdict), **OPTIONS)
def static_quant_fp8(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, num_token_padding: int | None = None) -> Tensor:
    out = torch.empty(padded_shape(x, num_token_padding), dtype=fp8_dtype, device=x.device)
    _static(out, x, scale)
    return out


@VLLM_C.impl("dynamic_quant_fp8", supports=(*ROWS, padding_verdict, scale_ub_verdict), **OPTIONS)
def dynamic_quant_fp8(
    x: Tensor,
    per_token: bool,
    fp8_dtype: torch.dtype,
    scale_ub: Tensor | None = None,
    num_token_padding: int | None = None,
) -> tuple[Tensor, Tensor]:
    out = torch.empty(padded_shape(x, num_token_padding), dtype=fp8_dtype, device=x.device)
    scale_shape = (*x.shape[:-1], 1) if per_token else (1,)
    scale = torch.empty(scale_shape, dtype=torch.float32, device=x.device)
    _dynamic(out, scale, x, scale_ub, per_token)
    return out, scale


@VLLM_C.impl("dynamic_group_quant_fp8", supports=(*ROWS, group_size_verdict, column_major_verdict), **OPTIONS)
def dynamic_group_quant_fp8(
    x: Tensor, group_size: int, column_major: bool, use_ue8m0: bool, fp8_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    out = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scales = empty_group_scales(x.shape, group_size, column_major, x.device)
    _group(out, scales, x, group_size, use_ue8m0)
    return out, scales
