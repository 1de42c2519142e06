"""vllm_c's rms_norm / fused_add_rms_norm CPU kernels against ``copy_``, per weight dtype.

The Hugging Face case is a bf16 (or fp16) activation with an fp32 norm weight: vLLM 0.33's
semantics multiply the fp32 normalized row by the fp32 weight and round once to x's dtype, and
vllm_c runs that without a fallback. This times the kernels with preallocated outputs (rms_norm
into ``out``; fused_add_rms_norm in place) beside ``dst.copy_(src)`` of the same bytes (rms_norm:
x read and written; fused: x and residual read and written; the weight is not counted), the two
timed back to back in every round (`vllm_ir.tools.timing.interleaved_rounds`), and prints the median
over rounds of copy_'s time over the kernel's: the fraction of ``copy_`` bandwidth (target 0.8).

    OMP_NUM_THREADS=2 python benchmarks/norm_weight_dtypes.py [--tokens 256,4096] [--rounds 7]
"""

from __future__ import annotations

import argparse

import torch

import vllm_ir
from vllm_ir.tools.timing import interleaved_rounds, median_ratio

EPS = 1e-6
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cases(tokens: int, hidden: int, dtype: torch.dtype, weight_dtype: torch.dtype) -> dict[str, dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    r = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(weight_dtype)
    out = torch.empty_like(x)
    dst = torch.empty_like(x)
    both = torch.cat([x, r])
    both_dst = torch.empty_like(both)
    rms_norm = torch.ops.vllm_ir_c.rms_norm.default
    fused = torch.ops.vllm_ir_c.fused_add_rms_norm.default
    xi, ri = x.clone(), r.clone()
    return {
        "rms_norm": {"kernel": lambda: rms_norm(out, x, w, EPS), "copy_": lambda: dst.copy_(x)},
        # In place, every call: the values drift (x <- norm(x + r), r <- x + r) but the work does not.
        "fused_add_rms_norm": {"kernel": lambda: fused(xi, ri, w, EPS), "copy_": lambda: both_dst.copy_(both)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="256,4096")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    vllm_ir.load_providers()
    assert vllm_ir.ops.rms_norm.impls["vllm_c"].is_supported, "vllm_c's kernels are not built"
    print(f"{torch.get_num_threads()} threads, hidden {args.hidden}, {args.rounds} paired rounds")
    print(f"{'op':<20} {'x':<9} {'weight':<9} {'T':>5} {'kernel us':>10} {'copy_ us':>9} {'of copy_':>8}")
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        weights = (dtype,) if dtype == torch.float32 else (dtype, torch.float32)
        for weight_dtype in weights:
            for tokens in (int(t) for t in args.tokens.split(",")):
                for op, fns in cases(tokens, args.hidden, dtype, weight_dtype).items():
                    inner = max(1, 2**20 // (tokens * args.hidden))
                    times = interleaved_rounds(fns, rounds=args.rounds, inner=inner, repeats=15)
                    kernel = sorted(t["kernel"] for t in times)[len(times) // 2]
                    copy = sorted(t["copy_"] for t in times)[len(times) // 2]
                    ratio = median_ratio(times, "copy_", "kernel")
                    print(
                        f"{op:<20} {dtype_name:<9} {str(weight_dtype)[6:]:<9} {tokens:>5} {kernel:>10.1f} "
                        f"{copy:>9.1f} {ratio:>8.2f}"
                    )


if __name__ == "__main__":
    main()
