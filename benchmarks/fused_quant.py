"""Fused RMSNorm + FP8 quant on this CPU: one vllm_c kernel against vllm_c norm then vllm_c quant.

For [T, hidden] bf16 (default hidden 4096, T in {1, 16, 256, 4096}), bf16 weight,
float8_e4m3fn q, median microseconds per call of the kernels alone (preallocated outputs):

- ``norm+st``: ``torch.ops.vllm_ir_c.rms_norm`` into y, then ``static_quant_fp8`` of y
  (per-tensor scale) -- the unfused pair;
- ``fused st``: ``rms_norm_static_fp8_quant`` (one pass per row, y never stored);
- ``add+st`` / ``f.add st``: the same with a residual (``fused_add_rms_norm_out`` then
  ``static_quant_fp8``, against ``fused_add_rms_norm_static_fp8_quant``);
- ``norm+dyn`` / ``f.dyn``: ``rms_norm`` then per-token ``dynamic_quant_fp8``, against
  ``rms_norm_dynamic_per_token_fp8_quant`` without residual;
- ``norm+grp`` / ``f.grp``: ``rms_norm`` then ``dynamic_group_quant_fp8`` (groups of 128),
  against ``rms_norm_group_fp8_quant`` without residual;
- ``silu+grp`` / ``f.s.grp``: ``silu_and_mul`` of a [T, 2 * hidden] input then group quant,
  against ``silu_and_mul_group_fp8_quant``.

Ratios: unfused time over fused (>1: the fused kernel is faster), the median over interleaved
rounds of the two timed back to back (this VM's memory phases skew a ratio of two rounds'
bests); the times printed are each variant's best round's median.
Use the same ``OMP_NUM_THREADS`` for every run that is compared.

    OMP_NUM_THREADS=2 python benchmarks/fused_quant.py [--hidden 4096] [--tokens 1,16,256,4096] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os

import torch

from vllm_ir.tools.timing import best_of, interleaved_rounds, machine_summary, median_ratio

EPS = 1e-6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", default="1,16,256,4096")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import vllm_ir_provider_vllm_c

    if not vllm_ir_provider_vllm_c.STATUS.loaded:
        raise SystemExit(f"vllm_c is not available: {vllm_ir_provider_vllm_c.STATUS.reason}")
    print(machine_summary())
    print(
        f"torch threads {torch.get_num_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), "
        f"vllm_c CPU variant {vllm_ir_provider_vllm_c.cpu_capability()}"
    )
    print(f"bf16 [T, {args.hidden}] -> float8_e4m3fn, median us per call (best of {args.rounds} interleaved rounds)")
    names = (
        "norm+st",
        "fused st",
        "add+st",
        "f.add st",
        "norm+dyn",
        "f.dyn",
        "norm+grp",
        "f.grp",
        "silu+grp",
        "f.s.grp",
    )
    ratios = ("st x", "add x", "dyn x", "grp x", "s.g x")
    print(f"{'T':>5} " + " ".join(f"{n:>9}" for n in names) + " | " + " ".join(f"{r:>5}" for r in ratios))
    for t in (int(s) for s in args.tokens.split(",")):
        _row(t, args)


def _row(t: int, args: argparse.Namespace) -> None:
    c = torch.ops.vllm_ir_c
    g = torch.Generator().manual_seed(t)
    h = args.hidden
    x = torch.randn(t, h, generator=g).bfloat16()
    r = torch.randn(t, h, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16()
    scale = torch.tensor([0.02])
    y = torch.empty_like(x)
    r_out = torch.empty_like(x)
    q = torch.empty(t, h, dtype=torch.float8_e4m3fn)
    scales = torch.empty(t, 1)
    gate_up = torch.randn(t, 2 * h, generator=g).bfloat16()
    group_scales = torch.empty(t, h // 128)
    calls = {
        "norm+st": lambda: (c.rms_norm(y, x, w, EPS), c.static_quant_fp8(q, y, scale)),
        "fused st": lambda: c.rms_norm_static_fp8_quant(q, x, w, scale, EPS),
        "add+st": lambda: (c.fused_add_rms_norm_out(y, r_out, x, r, w, EPS), c.static_quant_fp8(q, y, scale)),
        "f.add st": lambda: c.fused_add_rms_norm_static_fp8_quant(q, r_out, x, r, w, scale, EPS),
        "norm+dyn": lambda: (c.rms_norm(y, x, w, EPS), c.dynamic_quant_fp8(q, scales, y, None, True)),
        "f.dyn": lambda: c.rms_norm_dynamic_per_token_fp8_quant(q, scales, None, x, None, w, None, EPS),
        "norm+grp": lambda: (c.rms_norm(y, x, w, EPS), c.dynamic_group_quant_fp8(q, group_scales, y, 128, False)),
        "f.grp": lambda: c.rms_norm_group_fp8_quant(q, group_scales, None, x, None, w, 128, False, EPS),
        "silu+grp": lambda: (c.silu_and_mul(y, gate_up), c.dynamic_group_quant_fp8(q, group_scales, y, 128, False)),
        "f.s.grp": lambda: c.silu_and_mul_group_fp8_quant(q, group_scales, gate_up, 128, False),
    }
    repeats = max(5, min(200, 2_000_000 // max(t * h, 1)))
    times = interleaved_rounds(calls, rounds=args.rounds, repeats=repeats)
    best = best_of(times)
    names = list(calls)
    ratios = [median_ratio(times, unfused, fused) for unfused, fused in zip(names[::2], names[1::2], strict=True)]
    print(f"{t:>5} " + " ".join(f"{best[n]:9.1f}" for n in calls) + " | " + " ".join(f"{v:5.2f}" for v in ratios))


if __name__ == "__main__":
    main()
