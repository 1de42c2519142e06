"""rotary_embedding on this CPU: vllm_c in place, native eager and Inductor-compiled native.

Query and key are [T, 32 * 128] (32 heads of 128, as many key heads), neox style, with
rotary_dim 128 (full) and 64 (partial), T in {1, 16, 256, 4096}, fp32 and bf16. Per case,
median microseconds per call of:

- ``native``: the op's own function, eager (allocates its two outputs).
- ``compiled``: ``torch.compile(native, dynamic=True)`` (Inductor's C++ backend; allocates).
- ``vllm_c``: ``torch.ops.vllm_ir_c.rotary_embedding`` in place on the same q and k call
  after call (the in-place kernel ``maybe_inplace`` runs).
- ``mi()``: ``vllm_ir.ops.rotary_embedding.maybe_inplace`` with vllm_c first: the same kernel
  through vllm-ir's dispatch.
- ``copy_``: ``dst.copy_(src)`` of q+k's bytes (read + written), the bandwidth ceiling.
  ``GB/s`` and ``of copy`` are vllm_c's, counting q and k read and written once in full
  (with rotary_dim 64 the kernel touches only half of each head: ``of copy`` then says how
  the half-work kernel compares with moving everything).

The machine is shared and noisy: variants are timed in interleaved rounds, the best round's
median is kept; ``of copy`` is the median over rounds of copy_ and vllm_c timed back to back
in each round (copy_'s bandwidth swings 2x between phases of this VM). Set OMP_NUM_THREADS
(or --threads) to compare runs.

    python benchmarks/rotary_cpu.py [--tokens 1,16,256,4096] [--rot 128,64] [--rounds 3] [--threads N]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

os.environ.setdefault("VLLM_IR_FALLBACK", "allow")

import torch

import vllm_ir
from vllm_ir.ir.declarations.rotary import build_cos_sin_cache
from vllm_ir.tools.timing import best_of, interleaved_rounds, machine_summary, median_ratio

HEADS, HEAD_SIZE, MAX_POSITION = 32, 128, 8192
COLUMNS = ("native", "compiled", "vllm_c", "mi()", "copy_")


def _inner(tokens: int) -> int:
    """Calls per sample: enough that one sample lasts at least ~50 us."""
    return max(1, 200_000 // (tokens * HEADS * HEAD_SIZE))


def _case(
    tokens: int, rot: int, dtype: torch.dtype, compiled, rounds: int
) -> tuple[tuple[dict[str, float], float], int]:
    op = vllm_ir.ops.rotary_embedding
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=g)
    q = torch.randn(tokens, HEADS * HEAD_SIZE, generator=g).to(dtype)
    k = torch.randn(tokens, HEADS * HEAD_SIZE, generator=g).to(dtype)
    cache = build_cos_sin_cache(MAX_POSITION, rot, dtype)
    qi, ki = q.clone(), k.clone()
    qd, kd = q.clone(), k.clone()
    src = torch.cat([q, k])
    dst = torch.empty_like(src)
    kernel = torch.ops.vllm_ir_c.rotary_embedding.default
    args = (positions, qd, kd, HEAD_SIZE, cache, True, rot)
    assert op.dispatch(*args).provider == "vllm_c", op.explain(*args)  # main() put vllm_c first

    fns: dict[str, Callable[[], object]] = {
        "native": lambda: op.fn(positions, q, k, HEAD_SIZE, cache, True, rot),
        "mi()": lambda: op.maybe_inplace(*args),
        "vllm_c": lambda: kernel(positions, qi, ki, HEAD_SIZE, cache, True, rot),  # next to copy_
        "copy_": lambda: dst.copy_(src),
    }
    if compiled is not None:
        fns["compiled"] = lambda: compiled(positions, q, k, HEAD_SIZE, cache, True, rot)
    # copy_ over vllm_c per round: copy_'s bandwidth swings 2x between phases of this VM.
    times = interleaved_rounds(fns, rounds=rounds, inner=_inner(tokens))
    return (best_of(times), median_ratio(times, "copy_", "vllm_c")), 2 * src.numel() * src.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,256,4096")
    parser.add_argument("--rot", default="128,64")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    import vllm_ir_provider_vllm_c as provider

    if not provider.STATUS.loaded:
        raise SystemExit(f"vllm_c is not available: {provider.STATUS.reason}")
    vllm_ir.set_priority(rotary_embedding=["vllm_c"])
    print(machine_summary())
    print(f"vllm_c CPU kernels: {provider.cpu_capability()}; threads {torch.get_num_threads()}; us per call")
    print(f"q and k [T, {HEADS}x{HEAD_SIZE}], neox; best round's median of {args.rounds}")
    tokens = [int(t) for t in args.tokens.split(",")]
    misses = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        compiled = None
        if not args.no_compile:
            compiled = torch.compile(vllm_ir.ops.rotary_embedding.fn, dynamic=True)
        for rot in (int(r) for r in args.rot.split(",")):
            print(f"\n{dtype_name} rotary_dim {rot}")
            header = f"{'T':>5} " + " ".join(f"{c:>9}" for c in COLUMNS)
            print(header + f" {'GB/s':>6} {'of copy':>7} {'x native':>8} {'x compiled':>10}")
            for t in tokens:
                (times, of_copy), nbytes = _case(t, rot, dtype, compiled, args.rounds)
                cells = " ".join(f"{times.get(c, float('nan')):>9.1f}" for c in COLUMNS)
                gbs = nbytes / times["vllm_c"] / 1e3
                x_native = times["native"] / times["vllm_c"]
                x_comp = times.get("compiled", float("nan")) / times["vllm_c"]
                print(f"{t:>5} {cells} {gbs:>6.1f} {of_copy:>7.2f} {x_native:>8.1f} {x_comp:>10.1f}")
                if x_native < 1 or (compiled is not None and x_comp < 1):
                    misses.append(f"{dtype_name} rot {rot} T={t}: slower than native or compiled")
                if t == 4096 and of_copy < 0.8:
                    misses.append(f"{dtype_name} rot {rot} T=4096: {of_copy:.2f}x copy_ bandwidth (target 0.8)")
    print("\ntargets: " + ("all met" if not misses else "; ".join(misses)))


if __name__ == "__main__":
    main()
