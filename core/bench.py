"""``vllm-ir bench``: validate and time every available implementation, and say which wins.

For each (op, dtype, shape, provider): correctness against native first (a wrong kernel is
reported, never timed), then timing with the shared helpers of `vllm_ir.timing` (CPU: warm-up
and median of repeated runs; CUDA: CUDA events, graphs where possible), reported as µs, GB/s
and % of this machine's copy bandwidth, measured by the command itself.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

import vllm_ir
from vllm_ir.ir import selection
from vllm_ir.ir.impl import IrOpImpl, reason_of
from vllm_ir.ir.op import IrOp
from vllm_ir.timing import machine_summary, time_kernel

#: A single call slower than this is not timed (e.g. an interpreter back-end).
MAX_CALL_SECONDS = 0.5


@dataclass
class Result:
    op: str
    dtype: str
    tokens: int
    hidden: int
    provider: str
    status: str  # "ok", "declined", "wrong", "error", "too slow"
    detail: str | None = None
    median_us: float | None = None
    gbps: float | None = None
    pct_of_copy: float | None = None
    dispatcher_picks: str | None = None


def copy_bandwidth(device: torch.device, mib: int) -> float:
    """GB/s of ``dst.copy_(src)`` for ``mib`` MiB of fp32 (bytes read + written)."""
    n = mib * 2**20 // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    t = time_kernel(lambda: dst.copy_(src), device, warmup=3, repeats=15)
    return 2 * n * 4 / t.median_us / 1e3


def _clone_args(args: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _bytes_moved(args: Sequence[Any], out: Any) -> int:
    """Activations read plus outputs written (weights are small and cached)."""
    outs = out if isinstance(out, tuple) else (out,)
    read = sum(a.nbytes for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2)
    return read + sum(o.nbytes for o in outs if isinstance(o, torch.Tensor))


def bench_case(op: IrOp, impl: IrOpImpl, args: tuple, repeats: int) -> Result:
    from vllm_ir.testing import Case, compare

    dtype = args[0].dtype
    case = Case(tuple(args[0].shape), dtype)
    base = Result(op.name, str(dtype).removeprefix("torch."), args[0].shape[0], args[0].shape[-1], impl.provider, "ok")
    verdict = selection.ask(impl, args)
    if not verdict:
        base.status, base.detail = "declined", reason_of(verdict, "declined")
        return base
    try:
        t0 = time.perf_counter()
        out = impl.fn(*_clone_args(args))
        first = time.perf_counter() - t0
        compare(op, impl, case, out, op.fn(*args))
    except AssertionError as exc:
        base.status, base.detail = "wrong", str(exc).splitlines()[0]
        return base
    except Exception as exc:
        base.status, base.detail = "error", f"{type(exc).__name__}: {exc}".splitlines()[0]
        return base
    # In-place kernels run on the same buffers over and over: allocation-free, as in serving.
    work = _clone_args(args)
    again = time.perf_counter()
    impl.fn(*work)
    if time.perf_counter() - again > MAX_CALL_SECONDS:
        base.status, base.detail = (
            "too slow",
            f"one call took {time.perf_counter() - again:.1f} s (first {first:.1f} s)",
        )
        return base
    timing = time_kernel(lambda: impl.fn(*work), args[0].device, warmup=3, repeats=repeats)
    base.median_us = timing.median_us
    base.gbps = _bytes_moved(args, out) / timing.median_us / 1e3
    if not impl.inplace:
        base.detail = "includes allocating the output"
    return base


def run(
    op_names: Sequence[str],
    *,
    providers: Sequence[str] | None,
    dtypes: Sequence[torch.dtype],
    tokens: Sequence[int],
    hidden: int,
    device: str,
    repeats: int,
    copy_mib: int,
    progress: bool = True,
) -> dict[str, Any]:
    vllm_ir.load_providers()
    dev = torch.device(device)
    ops = [vllm_ir.ops.__getattr__(n) for n in op_names] if op_names else list(vllm_ir.ops)
    bandwidth = copy_bandwidth(dev, copy_mib)
    plan = []
    for op in ops:
        impls = [i for i in op.impls.values() if i.supported and (not providers or i.provider in providers)]
        for dtype in dtypes:
            for t in tokens:
                for impl in impls:
                    plan.append((op, dtype, t, impl))
    results: list[Result] = []
    inputs: dict[tuple, tuple] = {}
    for k, (op, dtype, t, impl) in enumerate(plan, 1):
        if progress:
            line = f"[{k}/{len(plan)}] {op.name} {str(dtype).removeprefix('torch.')} [{t}, {hidden}] {impl.provider}"
            sys.stderr.write(f"\r{line:<80}" if sys.stderr.isatty() else line + "\n")
            sys.stderr.flush()
        key = (op.name, dtype, t)
        if key not in inputs:
            inputs[key] = op.generate_inputs((t, hidden), dtype, dev)
        args = inputs[key]
        r = bench_case(op, impl, args, repeats)
        r.dispatcher_picks = op.dispatch(*args).provider
        if r.gbps is not None:
            r.pct_of_copy = 100 * r.gbps / bandwidth
        results.append(r)
    if progress and sys.stderr.isatty():
        sys.stderr.write("\r" + " " * 80 + "\r")
    return {
        "machine": machine_summary(),
        "device": str(dev),
        "copy_bandwidth_gbps": bandwidth,
        "hidden": hidden,
        "results": [asdict(r) for r in results],
    }


def winners(report: dict[str, Any]) -> dict[tuple[str, str, int], str]:
    best: dict[tuple[str, str, int], tuple[float, str]] = {}
    for r in report["results"]:
        if r["status"] == "ok" and r["median_us"] is not None:
            key = (r["op"], r["dtype"], r["tokens"])
            if key not in best or r["median_us"] < best[key][0]:
                best[key] = (r["median_us"], r["provider"])
    return {k: v[1] for k, v in best.items()}


def format_report(report: dict[str, Any]) -> str:
    lines = [report["machine"], f"copy_ bandwidth on {report['device']}: {report['copy_bandwidth_gbps']:.1f} GB/s"]
    win = winners(report)
    by_op: dict[str, list[dict[str, Any]]] = {}
    for r in report["results"]:
        by_op.setdefault(r["op"], []).append(r)
    for op, rows in by_op.items():
        providers = list(dict.fromkeys(r["provider"] for r in rows))
        lines.append("")
        lines.append(f"{op} [tokens, {report['hidden']}]: us (GB/s, % of copy)")
        header = (
            f"{'dtype':<9}{'tokens':>7}  " + "".join(f"{p:>24}" for p in providers) + f"{'winner':>12}{'dispatch':>12}"
        )
        lines.append(header)
        cases = list(dict.fromkeys((r["dtype"], r["tokens"]) for r in rows))
        for dtype, t in cases:
            cells = []
            picks = ""
            for p in providers:
                r = next((x for x in rows if x["dtype"] == dtype and x["tokens"] == t and x["provider"] == p), None)
                if r is None:
                    cells.append("")
                    continue
                picks = r["dispatcher_picks"]
                if r["status"] == "ok":
                    cells.append(f"{r['median_us']:.1f} ({r['gbps']:.1f}, {r['pct_of_copy']:.0f}%)")
                else:
                    cells.append(r["status"].upper() if r["status"] == "wrong" else r["status"])
            lines.append(
                f"{dtype:<9}{t:>7}  "
                + "".join(f"{c:>24}" for c in cells)
                + f"{win.get((op, dtype, t), '-'):>12}{picks:>12}"
            )
        notes = {(r["provider"], r["status"], r["detail"]) for r in rows if r["status"] != "ok"}
        for provider, status, detail in sorted(notes, key=str):
            lines.append(f"  {provider}: {status}: {detail}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot: matplotlib is not installed (pip install matplotlib); {path} not written"
    groups: dict[tuple[str, str], dict[str, list[tuple[int, float]]]] = {}
    for r in report["results"]:
        if r["status"] == "ok":
            groups.setdefault((r["op"], r["dtype"]), {}).setdefault(r["provider"], []).append((r["tokens"], r["gbps"]))
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(5 * max(1, len(groups)), 4), squeeze=False)
    for ax, ((op, dtype), lines) in zip(axes[0], sorted(groups.items()), strict=False):
        for provider, points in sorted(lines.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=provider)
        ax.axhline(report["copy_bandwidth_gbps"], color="grey", linestyle="--", label="copy_")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{op} {dtype} hidden {report['hidden']}")
        ax.set_xlabel("tokens")
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return f"plot written to {path}"


def main(args: Any) -> int:
    dtypes = [getattr(torch, d) for d in (args.dtype.split(",") if args.dtype else ["float32", "bfloat16"])]
    if args.quick:
        tokens = args.tokens or [1, 16, 256]
        repeats, copy_mib = 15, 64
    else:
        tokens = args.tokens or [1, 16, 256, 4096]
        repeats, copy_mib = 40, 256
    if args.device is None:
        import vllm_ir

        args.device = vllm_ir.current_platform().device_type
    report = run(
        args.ops,
        providers=args.providers,
        dtypes=dtypes,
        tokens=tokens,
        hidden=args.hidden,
        device=args.device,
        repeats=repeats,
        copy_mib=copy_mib,
    )
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(report, f, indent=2)
    print(format_report(report))
    if args.plot:
        print(plot(report, args.plot))
    wrong = [r for r in report["results"] if r["status"] in ("wrong", "error")]
    if wrong:
        print(f"\n{len(wrong)} implementation(s) failed correctness: exit code 1", file=sys.stderr)
        return 1
    return 0
