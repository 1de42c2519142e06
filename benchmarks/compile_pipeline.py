"""The compile pipeline on a Llama-style decoder: step time and compile time, side by side.

Four ways to run the same model (weights shared), all on CPU with Inductor's C++ backend:

- ``eager``  : the IR model in eager mode (vllm-ir dispatch per call);
- ``opaque`` : ``torch.compile`` of the IR model without the passes (IR ops stay opaque calls);
- ``passes`` : ``torch.compile`` with ``vllm_ir.inductor_options()`` (functionalize, fuse, lower, clean),
  lowering to whatever the compile-mode priority picks on this machine (platform/plugin defaults);
- ``passes:native``: the same with ``native`` first for both ops (Inductor then fuses the norms);
- ``plain``  : ``torch.compile`` of the same model written in plain torch ops.

The model donates its input (``maybe_inplace``), so every call of every variant gets a fresh
copy of the input (the copy is part of every timing; it is < 0.1% of a step here).

Targets (issue 4): ``passes`` within 5% of ``plain``; clearly faster than ``opaque``; the
passes take < 10% of the compile time. Times are medians of interleaved rounds (the
variants alternate, so drift from other tenants hits all of them alike). Every variant is
compiled for static shapes, once per token count, with Inductor's FX-graph and AOTAutograd
caches off (compile times are real compiles).

Compile time (issue 14, target: ``passes:native`` within 1.1x ``plain``) is measured with
the same kernel-cache state for both: each variant is compiled once first (untimed), which
leaves every C++ kernel either builds in Inductor's kernel cache, then ``--compile-rounds``
rounds compile both from a fresh Dynamo state, alternating which goes first. Both then pay
Dynamo, AOTAutograd, Inductor's passes and code generation, and neither pays a C++ build
(lowered to native, the two produce the same kernels). The step-time section's first-call
compile seconds are printed too, but there an earlier variant may have built the kernels a
later one reuses: they are not comparable across variants.

    .venv/bin/python benchmarks/compile_pipeline.py [--layers 4] [--hidden 1024] [--tokens 1 16 256]
        [--dtypes fp32 bf16] [--rounds 15] [--compile-rounds 5] [--compile-only] [--threads N] [--no-linear]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vllm_ir
from tests.compile_models import make_decoder
from vllm_ir import passes
from vllm_ir.tools.timing import machine_summary, time_call

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NATIVE = {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}


def _compile(fn: Callable, x: torch.Tensor, **kwargs) -> tuple[Callable, float]:
    """Compile ``fn`` for ``x``'s shape; returns the compiled callable and the first call's seconds."""
    compiled = torch.compile(fn, dynamic=False, **kwargs)
    start = time.perf_counter()
    compiled(x.clone())
    return compiled, time.perf_counter() - start


def compile_times(ir_model: Callable, plain_model: Callable, x: torch.Tensor, rounds: int) -> dict:
    """Compile seconds of ``passes:native`` and ``plain`` with the same (warm) kernel cache.

    One untimed compile of each fills the kernel cache; then ``rounds`` rounds compile both
    from a fresh Dynamo state, the order alternating per round. Returns each variant's
    median, all samples, and the passes' own seconds per compile.
    """
    pass_seconds: list[float] = []

    def passes_native() -> float:
        options = passes.inductor_options()
        with vllm_ir.priority(**NATIVE):
            _compiled, seconds = _compile(ir_model, x, options=options)
        pass_seconds.append(passes.record_of(options).pass_seconds)
        return seconds

    def plain() -> float:
        return _compile(plain_model, x)[1]

    variants = {"passes:native": passes_native, "plain": plain}
    for fn in variants.values():  # warm-up: every kernel either variant needs is built once
        torch._dynamo.reset()
        fn()
    del pass_seconds[:]
    samples: dict[str, list[float]] = {n: [] for n in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            torch._dynamo.reset()
            samples[name].append(variants[name]())
    torch._dynamo.reset()
    return {
        "median": {n: statistics.median(v) for n, v in samples.items()},
        "samples": samples,
        "pass_s": statistics.median(pass_seconds),
    }


def _interleaved(fns: dict[str, Callable[[], object]], rounds: int, repeats: int) -> dict[str, float]:
    """Median over ``rounds`` of each variant's median of ``repeats`` calls; order alternates per round."""
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for fn in fns.values():
        time_call(fn, warmup=3, repeats=1)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            samples[name].append(time_call(fns[name], warmup=0, repeats=repeats).median_us)
    return {n: statistics.median(s) for n, s in samples.items()}


def run_case(dtype_name: str, tokens: int, args: argparse.Namespace) -> dict:
    dtype = DTYPES[dtype_name]
    ir_model, plain_model = make_decoder(
        hidden=args.hidden,
        intermediate=args.hidden if args.no_linear else args.intermediate,
        layers=args.layers,
        dtype=dtype,
        linear=not args.no_linear,
    )
    x = torch.randn(tokens, args.hidden).to(dtype)
    compile_s = compile_times(ir_model, plain_model, x, args.compile_rounds)
    result = {"dtype": dtype_name, "tokens": tokens, "compile": compile_s}
    if args.compile_only:
        return result
    torch._dynamo.reset()
    opaque, opaque_s = _compile(ir_model, x)
    options = passes.inductor_options()
    with_passes, passes_s = _compile(ir_model, x, options=options)
    native_options = passes.inductor_options()
    with vllm_ir.priority(**NATIVE):
        with_native, native_s = _compile(ir_model, x, options=native_options)
    plain, plain_s = _compile(plain_model, x)
    record = passes.record_of(options)
    native_record = passes.record_of(native_options)
    fns = {
        "eager": lambda: ir_model(x.clone()),
        "opaque": lambda: opaque(x.clone()),
        "passes": lambda: with_passes(x.clone()),
        "passes:native": lambda: with_native(x.clone()),
        "plain": lambda: plain(x.clone()),
    }
    ref = plain_model(x.clone()).float()
    atol, rtol = vllm_ir.ops.fused_add_rms_norm.tolerance(dtype)
    for name, fn in fns.items():
        out = fn().float()
        # Stacked layers accumulate rounding: allow ten times one op's tolerance.
        torch.testing.assert_close(out, ref, atol=atol * 10, rtol=rtol * 10, msg=lambda m, n=name: f"{n}: {m}")
    medians = _interleaved(fns, args.rounds, args.repeats)
    providers = sorted({p for nodes in record.selected_impls.values() for p in nodes.values()})
    return {
        **result,
        "us": medians,
        "compile_s": {"opaque": opaque_s, "passes": passes_s, "passes:native": native_s, "plain": plain_s},
        "pass_s": {"passes": record.pass_seconds, "passes:native": native_record.pass_seconds},
        "pass_breakdown": {k: record.seconds[k] + native_record.seconds[k] for k in record.seconds},
        "providers": providers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds per case")
    parser.add_argument("--repeats", type=int, default=5, help="calls per variant per round")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--compile-rounds", type=int, default=5, help="alternating compile-time rounds per case (warm kernel cache)"
    )
    parser.add_argument("--compile-only", action="store_true", help="measure compile time only (no step times)")
    parser.add_argument(
        "--no-linear",
        action="store_true",
        help="replace the projections by per-channel scales (intermediate = hidden): the IR ops dominate",
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False

    print(machine_summary())
    shape = "no linear layers (per-channel scales)" if args.no_linear else f"intermediate {args.intermediate}"
    print(
        f"decoder: {args.layers} layers, hidden {args.hidden}, {shape}; "
        f"{args.rounds} interleaved rounds x {args.repeats} calls; medians in microseconds"
    )
    results = []
    with torch.no_grad():
        for dtype_name in args.dtypes:
            for tokens in args.tokens:
                r = run_case(dtype_name, tokens, args)
                results.append(r)
                c = r["compile"]
                m = c["median"]
                print(
                    f"compile {dtype_name:<5} T={tokens:<5} passes:native {m['passes:native']:.3f} s, "
                    f"plain {m['plain']:.3f} s, ratio {m['passes:native'] / m['plain']:.3f} "
                    f"(passes {c['pass_s']:.3f} s = {c['pass_s'] / m['passes:native']:.1%}; samples "
                    + "; ".join(f"{n} " + " ".join(f"{v:.2f}" for v in vs) for n, vs in c["samples"].items())
                    + ")",
                    flush=True,
                )
    print()
    print(
        f"compile time, warm kernel cache, {args.compile_rounds} alternating rounds, median seconds "
        "(target passes:native / plain <= 1.1):"
    )
    print(f"{'dtype':<5} {'tokens':>6} | {'passes:native':>13} {'plain':>7} {'ratio':>6} | {'passes':>7} {'share':>6}")
    for r in results:
        c = r["compile"]
        m = c["median"]
        print(
            f"{r['dtype']:<5} {r['tokens']:>6} | {m['passes:native']:>13.3f} {m['plain']:>7.3f} "
            f"{m['passes:native'] / m['plain']:>6.3f} | {c['pass_s']:>7.3f} {c['pass_s'] / m['passes:native']:>6.1%}"
        )
    worst = max(r["compile"]["median"]["passes:native"] / r["compile"]["median"]["plain"] for r in results)
    print(f"worst compile ratio passes:native / plain: {worst:.3f} (target <= 1.1)")
    if args.compile_only:
        return

    print()
    header = (
        f"{'dtype':<5} {'tokens':>6} | {'eager':>9} {'opaque':>9} {'passes':>9} {'p:native':>9} {'plain':>9} | "
        f"{'passes/plain':>12} {'p:nat/plain':>11} {'passes/opaque':>13} {'passes/eager':>12} | "
        f"{'first-call s: passes  p:native  plain':>37} | {'pass share':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        us, cs = r["us"], r["compile_s"]
        share = max(r["pass_s"][k] / cs[k] for k in r["pass_s"])
        print(
            f"{r['dtype']:<5} {r['tokens']:>6} | {us['eager']:>9.1f} {us['opaque']:>9.1f} {us['passes']:>9.1f} "
            f"{us['passes:native']:>9.1f} {us['plain']:>9.1f} | {us['passes'] / us['plain']:>12.3f} "
            f"{us['passes:native'] / us['plain']:>11.3f} {us['passes'] / us['opaque']:>13.3f} "
            f"{us['passes'] / us['eager']:>12.3f} | {'':>14}{cs['passes']:>7.2f} {cs['passes:native']:>9.2f} "
            f"{cs['plain']:>6.2f} | {share:>10.1%}",
            flush=True,
        )
    best = {k: max(r["us"][k] / r["us"]["plain"] for r in results) for k in ("passes", "passes:native")}
    share = max(r["pass_s"][k] / r["compile_s"][k] for r in results for k in r["pass_s"])
    total_share = sum(sum(r["pass_s"].values()) for r in results) / sum(
        r["compile_s"][k] for r in results for k in r["pass_s"]
    )
    providers = sorted({p for r in results for p in r["providers"]})
    print(f"'passes' lowered to providers: {', '.join(providers)} (compile-mode defaults of this machine)")
    print(
        f"worst passes/plain: {best['passes']:.3f}, worst passes:native/plain: {best['passes:native']:.3f} "
        f"(target <= 1.05)"
    )
    print(
        f"time in the passes: {total_share:.1%} of all compile time with them (target < 10%); "
        f"largest share in a single compile: {share:.1%}"
    )
    breakdown = {k: sum(r["pass_breakdown"].get(k, 0.0) for r in results) for k in results[0]["pass_breakdown"]}
    print("pass seconds over all compiles: " + ", ".join(f"{k} {v:.3f}" for k, v in breakdown.items()))


if __name__ == "__main__":
    main()
