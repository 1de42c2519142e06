"""What the dispatch-trust features cost on the eager hot path, side by side (no-op kernels).

Each row is the overhead of a dispatched call over calling the same no-op kernel directly,
median of interleaved blocks, median over fresh processes (us per call), [16, 4096] fp32:
- ``op(...)`` with grad mode on (tensors that do not require grad: the default), under
  ``torch.no_grad()`` and under ``torch.inference_mode()``: the autograd check must cost
  nothing measurable;
- ``op.maybe_inplace(...)`` with an in-place kernel, with the overlap check of the donated
  inputs, and the same decision with the check switched off (what it cost before);
- ``torch.ops.vllm_ir.rms_norm.default`` with grad mode on and under inference mode: the
  autograd kernel the IR op now has runs only when grad mode is on.

    python benchmarks/dispatch_variants.py [--processes 3] [--samples 1000] [--inner 20]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys

os.environ.setdefault("VLLM_IR_FALLBACK", "allow")
os.environ.setdefault("VLLM_IR_DISABLE_PLUGIN_AUTOLOAD", "1")

import torch
from torch import Tensor

import vllm_ir
from vllm_ir.ir.dispatch import fast_lookup
from vllm_ir.tools.timing import machine_summary, paired_overhead

ROWS = (
    "op(...), grad mode on",
    "op(...), torch.no_grad()",
    "op(...), torch.inference_mode()",
    "maybe_inplace, in-place kernel, overlap check",
    "maybe_inplace, in-place kernel, no check",
    "torch.ops path, grad mode on",
    "torch.ops path, torch.inference_mode()",
)


def _noop(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    return x


def _noop_inplace(
    x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> tuple[Tensor, Tensor]:
    return x, x_residual


def measure_in_this_process(samples: int, inner: int) -> list[float]:
    rms, fused = vllm_ir.ops.rms_norm, vllm_ir.ops.fused_add_rms_norm
    rms.register_impl("bench_noop")(_noop)
    fused.register_impl("bench_noop_inplace", inplace=True)(_noop_inplace)
    vllm_ir.set_priority(rms_norm=["bench_noop"], fused_add_rms_norm=["bench_noop_inplace"])
    x, r, w = torch.randn(16, 4096), torch.randn(16, 4096), torch.randn(4096)
    torch_op = torch.ops.vllm_ir.rms_norm.default

    def overhead(entry, kernel, args, mode=contextlib.nullcontext):
        with mode():
            return paired_overhead(lambda: kernel(*args), lambda: entry(*args), samples=samples, inner=inner).median_us

    out = [
        overhead(rms, _noop, (x, w, 1e-6)),
        overhead(rms, _noop, (x, w, 1e-6), torch.no_grad),
        overhead(rms, _noop, (x, w, 1e-6), torch.inference_mode),
        overhead(fused.maybe_inplace, _noop_inplace, (x, r, w, 1e-6)),
    ]
    fused.maybe_inplace(x, r, w, 1e-6)
    decision = next(iter(fused.decision_cache.fixed.values()))
    assert decision.guard_donation
    decision.guard_donation = False  # the same decision without the check, for comparison only
    out.append(overhead(fused.maybe_inplace, _noop_inplace, (x, r, w, 1e-6)))
    out.append(overhead(torch_op, _noop, (x, w, 1e-6)))
    out.append(overhead(torch_op, _noop, (x, w, 1e-6), torch.inference_mode))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--inner", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.worker:
        json.dump(measure_in_this_process(args.samples, args.inner), sys.stdout)
        return
    worker = [sys.executable, __file__, "--worker", *sys.argv[1:]]
    runs = [json.loads(subprocess.run(worker, check=True, capture_output=True, text=True).stdout)
            for _ in range(max(1, args.processes))]  # fmt: skip
    print(machine_summary())
    print(f"eager dispatch lookup: {fast_lookup.describe()}")
    print(f"[16, 4096] fp32, no-op kernels; median over {len(runs)} processes (min..max), us over a direct call")
    for i, row in enumerate(ROWS):
        values = [run[i] for run in runs]
        print(f"  {row:<48} {statistics.median(values):6.3f} ({min(values):.2f}..{max(values):.2f})")


if __name__ == "__main__":
    main()
