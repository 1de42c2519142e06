"""FP8 quantization kernels on this CPU: vllm_c against copy_ bandwidth and compiled native.

For [T, hidden] bf16 -> float8_e4m3fn (default hidden 4096, T in {1, 16, 256, 4096}), median
microseconds per call of:

- ``static``: ``torch.ops.vllm_ir_c.static_quant_fp8`` with a per-tensor scale, into a
  preallocated q (the kernel alone);
- ``dyn/tok``: ``torch.ops.vllm_ir_c.dynamic_quant_fp8`` per-token, preallocated q and scales;
- ``group``: ``torch.ops.vllm_ir_c.dynamic_group_quant_fp8``, group 128, row-major scales;
- ``copy_``: ``dst.copy_(src)`` of a uint8 buffer moving the bytes static quant moves (reads
  2 bytes and writes 1 per element: 1.5 bytes per element copied), the bandwidth ceiling;
- ``ind:static``, ``ind:dyn``, ``ind:group``: the op's native function compiled by Inductor
  (``torch.compile(dynamic=False)``, one compile per shape), which allocates its outputs;
- ``op()``: ``vllm_ir.ops.static_quant_fp8(...)`` through dispatch with ``vllm_c`` first
  (fresh output: the dispatch path users call).

Ratios printed: ``static/copy`` and ``dyn/copy`` are copy_'s time over the kernel's (bandwidth
as a fraction of copy's, bytes read + written), ``ind/static`` and ``ind/dyn`` compiled native's
time over vllm_c's (>1: vllm_c faster), ``group/static`` group quant's time over static's.

This machine class is noisy (2 shared cores, other tenants): variants are timed in interleaved
rounds and the best round's median is kept; ``static/copy``, ``dyn/copy`` and ``group/static``
are medians over rounds of the two timed back to back in each round (copy_'s bandwidth swings
2x between phases of this VM). Set ``OMP_NUM_THREADS`` the same for every run
that is compared (torch's thread count follows it).

    OMP_NUM_THREADS=2 python benchmarks/quant_cpu.py [--hidden 4096] [--tokens 1,16,256,4096]
        [--rounds 3] [--no-compile]
"""

from __future__ import annotations

import argparse
import os

import torch

import vllm_ir
from vllm_ir.tools.timing import best_of, interleaved_rounds, machine_summary, median_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", default="1,16,256,4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()

    import vllm_ir_provider_vllm_c

    if not vllm_ir_provider_vllm_c.STATUS.loaded:
        raise SystemExit(f"vllm_c is not available: {vllm_ir_provider_vllm_c.STATUS.reason}")
    print(machine_summary())
    print(
        f"torch threads {torch.get_num_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), "
        f"vllm_c CPU variant {vllm_ir_provider_vllm_c.cpu_capability()}"
    )
    c = torch.ops.vllm_ir_c
    fp8 = torch.float8_e4m3fn
    ops = vllm_ir.ops
    header = (
        f"{'T':>5} {'static':>8} {'dyn/tok':>8} {'group':>8} {'copy_':>8} {'ind:st':>8} {'ind:dyn':>8} "
        f"{'ind:grp':>8} {'op()':>8} | {'st/copy':>7} {'dyn/copy':>8} {'ind/st':>6} {'ind/dyn':>7} "
        f"{'ind/grp':>7} {'grp/st':>6}"
    )
    print(f"bf16 [T, {args.hidden}] -> float8_e4m3fn, median us per call (best of {args.rounds} rounds)")
    print(header)
    for t in (int(s) for s in args.tokens.split(",")):
        _row(t, args, c, fp8, ops)


def _row(t: int, args: argparse.Namespace, c: object, fp8: torch.dtype, ops: object) -> None:
    """Time every variant at T tokens and print one row."""
    x = torch.randn(t, args.hidden, dtype=torch.bfloat16)
    scale = (x.float().abs().amax() / 448).reshape(1)
    q = torch.empty(t, args.hidden, dtype=fp8)
    token_scale = torch.empty(t, 1)
    group_scale = torch.empty(t, args.hidden // 128)
    src = torch.empty(t * args.hidden * 3 // 2, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    calls = {  # copy next to static and dyn, group next to static: their ratios are per round
        "dyn": lambda: c.dynamic_quant_fp8(q, token_scale, x, None, True),
        "copy": lambda: dst.copy_(src),
        "static": lambda: c.static_quant_fp8(q, x, scale),
        "group": lambda: c.dynamic_group_quant_fp8(q, group_scale, x, 128, False),
    }
    if not args.no_compile:
        st = torch.compile(ops.static_quant_fp8.fn, dynamic=False)
        dy = torch.compile(ops.dynamic_quant_fp8.fn, dynamic=False)
        gr = torch.compile(ops.dynamic_group_quant_fp8.fn, dynamic=False)
        calls["ind_static"] = lambda: st(x, scale, fp8)
        calls["ind_dyn"] = lambda: dy(x, True, fp8)
        calls["ind_group"] = lambda: gr(x, 128, False, False, fp8)
        for fn in (calls["ind_static"], calls["ind_dyn"], calls["ind_group"]):
            fn()  # compile outside the timing
    with vllm_ir.priority(static_quant_fp8=["vllm_c"]):
        calls["op"] = lambda: ops.static_quant_fp8(x, scale, fp8)
        repeats = max(25, min(200, 2_000_000 // max(t * args.hidden, 1)))
        times = interleaved_rounds(calls, rounds=args.rounds, repeats=repeats)
    best = best_of(times)
    nan = float("nan")
    row = [best[k] for k in ("static", "dyn", "group", "copy")]
    row += [best.get(k, nan) for k in ("ind_static", "ind_dyn", "ind_group")] + [best["op"]]
    ratios = [  # per round, then the median: a VM phase hits both of a pair
        median_ratio(times, "copy", "static"),
        median_ratio(times, "copy", "dyn"),
        best.get("ind_static", nan) / best["static"],
        best.get("ind_dyn", nan) / best["dyn"],
        best.get("ind_group", nan) / best["group"],
        median_ratio(times, "group", "static"),
    ]
    print(
        f"{t:>5} " + " ".join(f"{v:8.1f}" for v in row) + " | "
        f"{ratios[0]:7.2f} {ratios[1]:8.2f} {ratios[2]:6.2f} {ratios[3]:7.2f} {ratios[4]:7.2f} {ratios[5]:6.2f}"
    )


if __name__ == "__main__":
    main()
