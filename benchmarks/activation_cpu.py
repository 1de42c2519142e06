"""Activation kernels on this CPU: vllm_c, native eager and Inductor-compiled native side by side.

For every activation op (gated: x is [T, 2 * hidden], output [T, hidden]; elementwise: x and the
output are [T, hidden]; hidden defaults to 4096) at T in {1, 16, 256, 4096}, bf16 and fp32,
microseconds per call (the best of several interleaved rounds' medians, or 10th percentiles
with ``--stat p10`` when other tenants keep preempting one of the two threads) of:

- ``vllm_c``: the ``torch.ops.vllm_ir_c`` kernel writing a preallocated output (the kernel alone);
- ``op()``: ``vllm_ir.ops.<op>(x)`` with vllm_c first: dispatch plus a fresh output, the path
  users call (a fresh large output costs page faults on this VM, for every column that allocates);
- ``native``: the op's own function, eager (allocates its intermediates and output);
- ``compiled``: ``torch.compile(native, dynamic=True)`` (one fused Inductor kernel; allocates);
- ``copy_``: ``dst.copy_(src)`` moving as many bytes as vllm_c reads and writes.

``GB/s`` is vllm_c's achieved bandwidth ((bytes read + written) / time) and ``of copy`` that
bandwidth as a fraction of copy_'s: the median over rounds of the two timed back to back in
each round (copy_'s bandwidth swings 2x between phases of this VM). Targets (the issue):
vllm_c >= 0.8x copy_ at T=4096 for the gated ops; vllm_c at least as fast as native and
compiled at every T. Misses are listed.

    OMP_NUM_THREADS=2 python benchmarks/activation_cpu.py [--hidden 4096] [--tokens 1,16,256,4096]
        [--dtypes bfloat16,float32] [--ops silu_and_mul,...] [--rounds 3] [--stat median|p10] [--no-compile]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("VLLM_IR_FALLBACK", "allow")

import torch

import vllm_ir
from vllm_ir.tools.timing import best_of, interleaved_rounds, machine_summary, median_ratio

COLUMNS = ("vllm_c", "op()", "native", "compiled", "copy_")


@dataclass(frozen=True)
class Case:
    """One benchmarked op: its IR name, scalar arguments, and whether it is gated."""

    label: str
    op: str
    scalars: tuple = ()
    gated: bool = True


CASES = (
    Case("silu_and_mul", "silu_and_mul"),
    Case("mul_and_silu", "mul_and_silu"),
    Case("gelu_and_mul", "gelu_and_mul", ("none",)),
    Case("gelu_and_mul tanh", "gelu_and_mul", ("tanh",)),
    Case("fatrelu_and_mul", "fatrelu_and_mul", (0.5,)),
    Case("swigluoai_and_mul", "swigluoai_and_mul", (1.702, 7.0)),
    Case("gelu_new", "gelu_new", gated=False),
    Case("gelu_fast", "gelu_fast", gated=False),
    Case("quick_gelu", "quick_gelu", gated=False),
    Case("relu2", "relu2", gated=False),
)


def _inner(elements: int) -> int:
    """Calls per sample: enough that one sample lasts at least ~50 us."""
    return max(1, 200_000 // max(1, elements))


def _run_case(case: Case, tokens: int, hidden: int, dtype: torch.dtype, compiled, rounds: int, stat: str):
    op = getattr(vllm_ir.ops, case.op)
    g = torch.Generator().manual_seed(0)
    width = 2 * hidden if case.gated else hidden
    x = (2 * torch.randn(tokens, width, generator=g)).to(dtype)
    out = torch.empty(tokens, hidden, dtype=dtype)
    kernel = getattr(torch.ops.vllm_ir_c, case.op).default
    args = (x, *case.scalars)
    moved = (x.numel() + out.numel()) * x.element_size()  # bytes read + written
    src = torch.randn(moved // 2 // x.element_size()).to(dtype)
    dst = torch.empty_like(src)
    with vllm_ir.priority(**{case.op: ["vllm_c"]}):
        chosen = op.dispatch(*args).provider
    assert chosen == "vllm_c", f"{case.op}: dispatch chose {chosen}, not vllm_c"

    def via_op() -> object:
        with vllm_ir.priority(**{case.op: ["vllm_c"]}):
            return op(*args)

    fns: dict[str, Callable[[], object]] = {  # vllm_c and copy_ next to each other
        "op()": via_op,
        "native": lambda: op.fn(*args),
        "vllm_c": lambda: kernel(out, *args),
        "copy_": lambda: dst.copy_(src),
    }
    if compiled is not None:
        fns["compiled"] = lambda: compiled(*args)
    # copy_ over vllm_c per round: a ratio of two bests can pair a fast copy_ phase with a slow kernel one.
    times = interleaved_rounds(fns, rounds=rounds, inner=_inner(x.numel()), stat=stat)
    return (best_of(times), median_ratio(times, "copy_", "vllm_c")), moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", default="1,16,256,4096")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--ops", default=",".join(c.label for c in CASES), help="labels, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per case; the best is kept")
    parser.add_argument(
        "--stat", choices=["median", "p10"], default="median", help="per round: median, or p10 on a busy machine"
    )
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile'd native")
    args = parser.parse_args()

    import vllm_ir_provider_vllm_c as provider

    if not provider.STATUS.loaded:
        raise SystemExit(f"vllm_c is not available: {provider.STATUS.reason}")
    print(machine_summary())
    print(
        f"vllm_c CPU kernels: {provider.cpu_capability()}; hidden={args.hidden}; us per call, best round's {args.stat}"
    )
    wanted = args.ops.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    misses: list[str] = []
    for case in (c for c in CASES if c.label in wanted):
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            op = getattr(vllm_ir.ops, case.op)
            compiled = None if args.no_compile else torch.compile(op.fn, dynamic=True)
            shape = f"[T, {2 * args.hidden}] -> [T, {args.hidden}]" if case.gated else f"[T, {args.hidden}]"
            print(f"\n{case.label} {dtype_name} {shape}")
            print(f"{'T':>5} " + " ".join(f"{c:>9}" for c in COLUMNS) + f" {'GB/s':>6} {'of copy':>7} {'x native':>8}")
            for t in tokens:
                stat = f"{args.stat}_us"
                (times, of_copy), moved = _run_case(case, t, args.hidden, dtype, compiled, args.rounds, stat)
                cells = " ".join(f"{times[c]:>9.1f}" if c in times else f"{'-':>9}" for c in COLUMNS)
                print(
                    f"{t:>5} {cells} {moved / times['vllm_c'] / 1e3:>6.1f} {of_copy:>7.2f} "
                    f"{times['native'] / times['vllm_c']:>8.1f}"
                )
                where = f"{case.label} {dtype_name} T={t}"
                if t == 4096 and case.gated and of_copy < 0.8:  # the target: gated ops
                    misses.append(f"{where}: {of_copy:.2f}x of copy_ bandwidth (target 0.8)")
                for ref in ("native", "compiled"):
                    if ref in times and times["vllm_c"] > times[ref]:
                        misses.append(f"{where}: vllm_c {times['vllm_c']:.1f} us slower than {ref} {times[ref]:.1f} us")
    print("\ntargets: gated vllm_c >= 0.8x copy_ at T=4096; vllm_c <= native and compiled at every T")
    print("\n".join(f"  MISS {m}" for m in misses) if misses else "  all met")


if __name__ == "__main__":
    main()
