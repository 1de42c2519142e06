"""What swigluoai_and_mul's glu table is worth: vllm_c with and without it, side by side in one process.

The 16-bit AVX512 kernel looks glu(gate) up in a table per (alpha, limit), keeping at most
16 tables per process (``table16::keyed_table_of``); a 17th pair computes glu as before (the
clamp, three roundings, the sigmoid looked up or computed). So one process can time both: it
fills the 16 tables (alpha 1.702 and 15 others), then times alpha 1.702 (looked up) and 1.703
(computed; the same work otherwise) in interleaved rounds, bf16 [T, 8192] -> [T, 4096].
Prints each path's best-round median and the per-round ratio computed / looked up.

    python benchmarks/swigluoai_table.py [--tokens 256] [--threads 1] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("VLLM_IR_FALLBACK", "allow")

import torch

from vllm_ir.tools.timing import best_of, interleaved_rounds, machine_summary, median_ratio

TABLE_CAP = 16  # table16::kMaxKeyedTables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    import vllm_ir_provider_vllm_c as provider

    if not provider.STATUS.loaded:
        raise SystemExit(f"vllm_c is not available: {provider.STATUS.reason}")
    if provider.cpu_capability() not in ("AVX512", "AVX512_BF16"):
        raise SystemExit(f"vllm_c runs its {provider.cpu_capability()} kernels here: no tables to compare")
    torch.set_num_threads(args.threads)
    kernel = torch.ops.vllm_ir_c.swigluoai_and_mul.default
    x = (2 * torch.randn(args.tokens, 8192, generator=torch.Generator().manual_seed(0))).bfloat16()
    out = torch.empty(args.tokens, 4096, dtype=torch.bfloat16)
    kernel(out, x, 1.702, 7.0)
    for k in range(TABLE_CAP - 1):  # the other tables: 1.703 finds none left to build
        kernel(out[:1], x[:1], 2.0 + k, 7.0)
    times = interleaved_rounds(
        {"looked up": lambda: kernel(out, x, 1.702, 7.0), "computed": lambda: kernel(out, x, 1.703, 7.0)},
        rounds=args.rounds,
        repeats=15,
    )
    best = best_of(times)
    print(machine_summary())
    print(
        f"swigluoai_and_mul bf16 [{args.tokens}, 8192], {args.threads} thread(s): glu looked up "
        f"{best['looked up']:.0f} us, computed {best['computed']:.0f} us (best rounds); "
        f"computed / looked up {median_ratio(times, 'computed', 'looked up'):.2f} (median over rounds)"
    )


if __name__ == "__main__":
    main()
