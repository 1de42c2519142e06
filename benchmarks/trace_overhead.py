"""What tracing costs per call: `vllm_ir.trace` on vs off.

Target (the trace issue): at most 1 us per call with tracing on, on this CPU. Each figure is
`vllm_ir.tools.timing.paired_overhead`: interleaved blocks of the same call with and without the
feature, median of per-pair differences (this VM drifts; separate runs would absorb it).

- "trace on": ``op(x, w, eps)`` inside ``vllm_ir.trace()`` minus outside it. Both calls run
  through ``contextvars.Context.run`` (the traced one in a context where the trace is open),
  so that cost cancels. The kernel is a no-op provider (dispatch and recording only) and native
  on a [1, 4096] input.

    python benchmarks/trace_overhead.py [--samples 2000] [--inner 20]
"""

from __future__ import annotations

import argparse
import contextvars
import warnings

import torch
from torch import Tensor

import vllm_ir
from vllm_ir.tools.timing import machine_summary, paired_overhead

TARGET_US = 1.0


def _noop_provider() -> str:
    out = torch.empty(1, 4096)

    def noop(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
        return out

    vllm_ir.ops.rms_norm.register_impl("trace_bench_noop")(noop)
    return "trace_bench_noop"


def _traced_overhead(op, x, w, plain, traced, samples: int, inner: int):
    return paired_overhead(
        lambda: plain.run(op, x, w, 1e-6), lambda: traced.run(op, x, w, 1e-6), samples=samples, inner=inner
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--inner", type=int, default=20)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    op = vllm_ir.ops.rms_norm
    x, w = torch.randn(1, 4096), torch.ones(4096)
    noop = _noop_provider()
    print(machine_summary())
    print(f"median per-call overhead, us ({args.samples} paired blocks of {args.inner} calls)")
    worst = 0.0
    for provider in (noop, "native"):
        trace = vllm_ir.trace()
        with vllm_ir.priority(rms_norm=[provider]):
            traced = contextvars.copy_context()
            plain = contextvars.copy_context()
        traced.run(trace.__enter__)
        t = _traced_overhead(op, x, w, plain, traced, args.samples, args.inner)
        traced.run(trace.close)
        worst = max(worst, t.median_us)
        spread = f"p10..p90 {t.p10_us:+.3f}..{t.p90_us:+.3f}"
        print(f"  trace on, {provider:<16} [1, 4096] fp32: {t.median_us:+.3f} ({spread}); {trace.calls} calls traced")
    verdict = "meets" if worst <= TARGET_US else "misses"
    print(f"worst trace-on overhead: {worst:.3f} us ({verdict} the {TARGET_US} us target)")


if __name__ == "__main__":
    main()
