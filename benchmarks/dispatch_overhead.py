"""Eager dispatch overhead of ``vllm_ir.ops.rms_norm`` over calling the chosen kernel directly.

Target (issue 2): at most 0.5 us extra per call, for [1, 4096] and [16, 4096] fp32 on CPU,
both with priority [native] and with [a provider whose predicate declines, native].

Two figures per case, both medians of interleaved side-by-side blocks:
- "with kernel": op(x, w, eps) vs the native kernel called directly (the contract as stated;
  the kernel evicts the dispatcher's data from cache, so this includes those misses);
- "dispatch only": the same priority with a no-op kernel, isolating the framework's own cost.

    python benchmarks/dispatch_overhead.py [--samples 2000] [--threads 1]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("VLLM_IR_FALLBACK", "allow")

import torch
from torch import Tensor

import vllm_ir
from vllm_ir.timing import machine_summary, paired_overhead

TARGET_US = 0.5


def _register_bench_providers() -> None:
    def declines(x, weight, epsilon, variance_size=None):
        return vllm_ir.Unsupported("benchmark provider declines every call")

    def never(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
        raise AssertionError("never selected")

    def noop(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
        return x

    vllm_ir.ops.rms_norm.register_impl("bench_declines", supports_args=declines)(never)
    vllm_ir.ops.rms_norm.register_impl("bench_noop")(noop)


def _measure(op, kernel, x: Tensor, w: Tensor, samples: int):
    def direct():
        return kernel(x, w, 1e-6)

    def dispatched():
        return op(x, w, 1e-6)

    return paired_overhead(direct, dispatched, samples=samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2000, help="interleaved blocks of 20 calls each")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps kernel noise low)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _register_bench_providers()
    op = vllm_ir.ops.rms_norm
    print(machine_summary())
    print(f"{'shape':<11} {'priority':<22} {'with kernel us':>15} {'p10..p90':>15} {'dispatch only us':>17}")
    worst = {"with kernel": 0.0, "dispatch only": 0.0}
    for tokens in (1, 16):
        x, w = torch.randn(tokens, 4096), torch.randn(4096)
        for head in ([], ["bench_declines"]):
            vllm_ir.set_priority(rms_norm=[*head, "native"])
            assert op.dispatch(x, w, 1e-6).provider == "native"
            real = _measure(op, op.impls["native"].fn, x, w, args.samples)
            vllm_ir.set_priority(rms_norm=[*head, "bench_noop"])
            bare = _measure(op, op.impls["bench_noop"].fn, x, w, args.samples)
            worst["with kernel"] = max(worst["with kernel"], real.median_us)
            worst["dispatch only"] = max(worst["dispatch only"], bare.median_us)
            print(
                f"[{tokens}, 4096] {','.join([*head, 'native']):<22} {real.median_us:>15.3f} "
                f"{real.p10_us:>7.2f}..{real.p90_us:<7.2f} {bare.median_us:>17.3f}"
            )
    vllm_ir.clear_priority()
    for what, value in worst.items():
        verdict = "meets" if value <= TARGET_US else "misses"
        print(f"worst median overhead, {what}: {value:.3f} us ({verdict} the {TARGET_US} us target)")


if __name__ == "__main__":
    main()
