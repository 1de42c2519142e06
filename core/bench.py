"""``vllm-ir bench``: validate and time every available implementation, and say which wins.

For each (op, dtype, shape, provider): correctness against native first (a wrong kernel is
reported, never timed), then timing with the shared helpers of `vllm_ir.timing` (CPU: warm-up
and median of repeated runs; CUDA: CUDA events, graphs where possible), reported as µs, GB/s
and % of this machine's copy bandwidth, measured by the command itself.

Every figure is measured in rounds (the implementations of one case take turns, so a burst of
load hits all of them alike): the figure is the median over rounds and its spread the
interquartile range (IQR). A figure whose spread exceeds `NOISE_LIMIT` of its median is
re-measured (up to `EXTRA_ROUND_SETS` more sets of rounds) and flagged if it stays that wide;
a winner whose runner-up lies within the spread is marked as one the machine was too noisy to
call. The copy bandwidth is measured with the same rounds.

A round whose timing thread was on the CPU for less than `DESCHEDULED_BELOW` of its wall time
(`time.thread_time` against the wall clock) was descheduled: its figure is a multiple of the
scheduler's tick, however steady. Such rounds are dropped from the figure (and counted); when
fewer than half of a figure's rounds are clean after re-measuring, all are kept and the figure
is flagged. ``vllm-ir tune`` learns only from figures with no flag.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

import vllm_ir
from vllm_ir.ir import selection
from vllm_ir.ir.impl import IrOpImpl, reason_of
from vllm_ir.ir.op import IrOp
from vllm_ir.timing import DESCHEDULED_BELOW, interleaved_rounds, machine_summary

#: A single call slower than this is not timed (e.g. an interpreter back-end).
MAX_CALL_SECONDS = 0.5
#: IQR / median above this: the figure is re-measured, then flagged if it stays above.
NOISE_LIMIT = 0.10
#: How many extra sets of rounds a too-wide figure gets.
EXTRA_ROUND_SETS = 2


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
    #: Interquartile range of the per-round medians, and the quartiles themselves.
    iqr_us: float | None = None
    q1_us: float | None = None
    q3_us: float | None = None
    #: IQR as a percentage of the median.
    spread_pct: float | None = None
    rounds: int = 0
    #: The spread stayed above NOISE_LIMIT after re-measuring.
    noisy: bool = False
    #: The op's input variant measured ("default" or one of ``op.benchmark_variants``).
    variant: str = "default"
    #: Rounds dropped because the timing thread was descheduled (off the CPU) for much of them.
    descheduled_rounds: int = 0
    #: Fewer than half of the rounds were clean: the figure includes descheduled rounds.
    descheduled: bool = False


def case_label(op: str, variant: str) -> str:
    """What tables call a measured case: the op, with its input variant unless default."""
    return op if variant == "default" else f"{op}[{variant}]"


def _label(r: dict[str, Any]) -> str:
    return case_label(r["op"], r.get("variant", "default"))


@dataclass(frozen=True)
class Spread:
    """Median and quartiles of per-round figures."""

    median: float
    q1: float
    q3: float
    rounds: int
    #: Rounds left out because the thread was descheduled for much of them.
    descheduled: int = 0
    #: Too few clean rounds: the quartiles include descheduled ones.
    unclean: bool = False

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @property
    def relative(self) -> float:
        return self.iqr / self.median if self.median > 0 else math.inf


def spread_of(values: Sequence[float]) -> Spread:
    """Median and quartiles (inclusive method: quartiles of the values themselves)."""
    if len(values) == 1:
        return Spread(values[0], values[0], values[0], 1)
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return Spread(median, q1, q3, len(values))


def measure_rounds(
    fns: dict[str, Callable[[], object]], device: torch.device, *, repeats: int, rounds: int
) -> dict[str, Spread]:
    """Time every callable in ``rounds`` interleaved rounds; re-measure those whose spread is too
    wide or whose rounds were mostly descheduled; descheduled rounds are left out of the figure."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    dropped: dict[str, list[float]] = {name: [] for name in fns}

    def run(names: list[str], n: int) -> None:
        shares: list[dict[str, float]] = []
        times = interleaved_rounds(
            {name: fns[name] for name in names}, rounds=n, repeats=repeats, device=device, on_cpu=shares
        )
        for this_round, share in zip(times, shares, strict=True):
            for name, us in this_round.items():
                (samples if share[name] >= DESCHEDULED_BELOW else dropped)[name].append(us)

    def spread(name: str) -> Spread:
        clean, bad = samples[name], dropped[name]
        if len(clean) * 2 >= len(clean) + len(bad) and clean:
            return dataclasses.replace(spread_of(clean), descheduled=len(bad))
        return dataclasses.replace(spread_of(clean + bad), descheduled=len(bad), unclean=True)

    run(list(fns), rounds)
    for _ in range(EXTRA_ROUND_SETS):
        wide = [n for n in fns if spread(n).relative > NOISE_LIMIT or spread(n).unclean]
        if not wide:
            break
        run(wide, rounds)
    return {name: spread(name) for name in fns}


def copy_bandwidth(device: torch.device, mib: int, *, repeats: int = 15, rounds: int = 1) -> Spread:
    """GB/s of ``dst.copy_(src)`` for ``mib`` MiB of fp32 (bytes read + written), over rounds.

    The quartiles are of GB/s (q1 the slower rounds).
    """
    n = mib * 2**20 // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    us = measure_rounds({"copy_": lambda: dst.copy_(src)}, device, repeats=repeats, rounds=rounds)["copy_"]
    to_gbps = 2 * n * 4 / 1e3
    return Spread(to_gbps / us.median, to_gbps / us.q3, to_gbps / us.q1, us.rounds)


def _clone_args(args: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _bytes_moved(args: Sequence[Any], out: Any) -> int:
    """Activations read plus outputs written (weights are small and cached)."""
    outs = out if isinstance(out, tuple) else (out,)
    read = sum(a.nbytes for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2)
    return read + sum(o.nbytes for o in outs if isinstance(o, torch.Tensor))


def validate_case(
    op: IrOp, impl: IrOpImpl, args: tuple, shape: tuple[int, int], dtype: torch.dtype
) -> tuple[Result, Callable[[], object] | None, int]:
    """Correctness against native; returns the result so far, the timed call (if it may be timed)
    and the bytes it moves. ``shape`` and ``dtype`` are what ``args`` were generated for (the
    first argument need not be the activation: rotary embedding's is the positions)."""
    from vllm_ir.testing import Case, compare

    case = Case(shape, dtype)
    base = Result(op.name, str(dtype).removeprefix("torch."), shape[0], shape[-1], impl.provider, "ok")
    verdict = selection.ask(impl, args)
    if not verdict:
        base.status, base.detail = "declined", reason_of(verdict, "declined")
        return base, None, 0
    try:
        t0 = time.perf_counter()
        out = impl.fn(*_clone_args(args))
        first = time.perf_counter() - t0
        compare(op, impl, case, out, op.fn(*args), args)  # args: scale floors and rtols, dequantizing
    except AssertionError as exc:
        base.status, base.detail = "wrong", str(exc).splitlines()[0]
        return base, None, 0
    except Exception as exc:
        base.status, base.detail = "error", f"{type(exc).__name__}: {exc}".splitlines()[0]
        return base, None, 0
    # In-place kernels run on the same buffers over and over: allocation-free, as in serving.
    work = _clone_args(args)
    again = time.perf_counter()
    impl.fn(*work)
    if time.perf_counter() - again > MAX_CALL_SECONDS:
        base.status, base.detail = (
            "too slow",
            f"one call took {time.perf_counter() - again:.1f} s (first {first:.1f} s)",
        )
        return base, None, 0
    if not impl.inplace:
        base.detail = "includes allocating the output"
    return base, (lambda: impl.fn(*work)), _bytes_moved(args, out)


def _fill(result: Result, spread: Spread, moved: int) -> None:
    result.median_us = spread.median
    result.q1_us, result.q3_us, result.iqr_us = spread.q1, spread.q3, spread.iqr
    result.spread_pct = 100 * spread.relative
    result.rounds = spread.rounds + (0 if spread.unclean else spread.descheduled)
    result.descheduled_rounds = spread.descheduled
    result.descheduled = spread.unclean
    result.noisy = spread.relative > NOISE_LIMIT or spread.unclean
    result.gbps = moved / spread.median / 1e3


def plan_of(
    op_names: Sequence[str], providers: Sequence[str] | None
) -> tuple[list[IrOp], dict[str, list[IrOpImpl]], list[str]]:
    """The ops, their implementations to measure, and why requested providers are not measured."""
    ops = [vllm_ir.ops.__getattr__(n) for n in op_names] if op_names else list(vllm_ir.ops)
    impls: dict[str, list[IrOpImpl]] = {}
    skipped: list[str] = []
    for op in ops:
        impls[op.name] = [i for i in op.impls.values() if i.supported and (not providers or i.provider in providers)]
    for name in providers or ():
        found = [op.impls[name] for op in ops if name in op.impls]
        if not found:
            skipped.append(f"{name} implements none of {', '.join(op.name for op in ops)} here")
        elif not any(i.supported for i in found):
            skipped.append(f"{name} is unsupported here ({found[0].unsupported_reason})")
    return ops, impls, skipped


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
    rounds: int = 5,
    progress: bool = True,
    variants: bool = True,
) -> dict[str, Any]:
    """Validate and time every case; ``variants=False`` measures the ops' default inputs only."""
    vllm_ir.load_providers()
    dev = torch.device(device)
    ops, impls, skipped = plan_of(op_names, providers)
    bandwidth = copy_bandwidth(dev, copy_mib, repeats=repeats, rounds=rounds)
    extra = (lambda op: op.benchmark_variants) if variants else (lambda op: [])
    total = sum(len(impls[op.name]) * (1 + len(extra(op))) for op in ops) * len(dtypes) * len(tokens)
    results: list[Result] = []
    k = 0
    for op, variant in [(o, v) for o in ops for v in ("default", *extra(o))]:
        for dtype in dtypes:
            for t in tokens:
                args = op.generate_inputs((t, hidden), dtype, dev, **op.input_variants.get(variant, {}))
                picks = op.dispatch(*args).provider if impls[op.name] else None
                timed: dict[str, tuple[Result, Callable[[], object], int]] = {}
                for impl in impls[op.name]:
                    k += 1
                    if progress:
                        dtype_name = str(dtype).removeprefix("torch.")
                        line = (
                            f"[{k}/{total}] {case_label(op.name, variant)} {dtype_name} [{t}, {hidden}] {impl.provider}"
                        )
                        sys.stderr.write(f"\r{line:<80}" if sys.stderr.isatty() else line + "\n")
                        sys.stderr.flush()
                    r, call, moved = validate_case(op, impl, args, (t, hidden), dtype)
                    r.dispatcher_picks, r.variant = picks, variant
                    results.append(r)
                    if call is not None:
                        timed[impl.provider] = (r, call, moved)
                if timed:
                    spreads = measure_rounds(
                        {p: call for p, (_, call, _) in timed.items()}, dev, repeats=repeats, rounds=rounds
                    )
                    for p, (r, _, moved) in timed.items():
                        _fill(r, spreads[p], moved)
                        r.pct_of_copy = 100 * r.gbps / bandwidth.median
    if progress and sys.stderr.isatty():
        sys.stderr.write("\r" + " " * 80 + "\r")
    report = {
        "machine": machine_summary(),
        "device": str(dev),
        "copy_bandwidth_gbps": bandwidth.median,
        "copy_bandwidth_q1_gbps": bandwidth.q1,
        "copy_bandwidth_q3_gbps": bandwidth.q3,
        "copy_bandwidth_spread_pct": 100 * (bandwidth.q3 - bandwidth.q1) / bandwidth.median,
        "copy_bandwidth_noisy": (bandwidth.q3 - bandwidth.q1) / bandwidth.median > NOISE_LIMIT,
        "rounds": rounds,
        "repeats_per_round": repeats,
        "noise_limit_pct": 100 * NOISE_LIMIT,
        "hidden": hidden,
        "not_measured": skipped,
        "results": [asdict(r) for r in results],
    }
    report["winners"] = winner_table(report)
    report["suggested_priority"] = suggested_priority(report)
    return report


def winner_table(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (op, dtype, tokens): the fastest, the runner-up, and whether the spread makes the call uncertain."""
    cases: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in report["results"]:
        if r["status"] == "ok" and r["median_us"] is not None:
            cases.setdefault((_label(r), r["dtype"], r["tokens"]), []).append(r)
    out = []
    for (op, dtype, tokens), rows in cases.items():
        rows = sorted(rows, key=lambda r: r["median_us"])
        best, runner = rows[0], (rows[1] if len(rows) > 1 else None)
        uncertain = bool(runner is not None and runner["q1_us"] <= best["q3_us"])
        out.append(
            {
                "op": op,
                "dtype": dtype,
                "tokens": tokens,
                "winner": best["provider"],
                "runner_up": runner["provider"] if runner else None,
                "uncertain": uncertain,
            }
        )
    return out


def winners(report: dict[str, Any]) -> dict[tuple[str, str, int], str]:
    return {(w["op"], w["dtype"], w["tokens"]): w["winner"] for w in report.get("winners") or winner_table(report)}


def suggested_priority(report: dict[str, Any]) -> dict[str, Any]:
    """A priority per op that puts the measured winners first.

    Providers are ranked by the geometric mean, over the cases each was timed in, of its time
    relative to that case's fastest; the list stops at ``native`` (which accepts every call,
    so nothing after it is reachable) and always ends with it.
    """
    ratios: dict[str, dict[str, list[float]]] = {}
    best: dict[tuple[str, str, int], float] = {}
    ok = [r for r in report["results"] if r["status"] == "ok" and r["median_us"]]
    for r in ok:
        key = (_label(r), r["dtype"], r["tokens"])
        best[key] = min(best.get(key, math.inf), r["median_us"])
    for r in ok:
        ratio = r["median_us"] / best[(_label(r), r["dtype"], r["tokens"])]
        ratios.setdefault(r["op"], {}).setdefault(r["provider"], []).append(ratio)
    lists: dict[str, list[str]] = {}
    for op, per_provider in ratios.items():
        score = {p: math.exp(sum(map(math.log, v)) / len(v)) for p, v in per_provider.items()}
        ranked = sorted(score, key=lambda p: (score[p], p != "native"))
        ranked = ranked[: ranked.index("native") + 1] if "native" in ranked else [*ranked, "native"]
        lists[op] = ranked
    env_value = ";".join(f"{op}={','.join(ps)}" for op, ps in sorted(lists.items()))
    toml = "\n".join(["[priority.eager]"] + [f"{op} = [{', '.join(repr(p) for p in ps)}]".replace("'", '"')
                                              for op, ps in sorted(lists.items())])  # fmt: skip
    uncertain = sorted({w["op"].split("[")[0] for w in report.get("winners") or winner_table(report) if w["uncertain"]})
    return {"lists": lists, "env": env_value, "toml": toml, "uncertain_ops": uncertain}


def _cell(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return r["status"].upper() if r["status"] == "wrong" else r["status"]
    flag = ("!" if r["noisy"] else "") + ("~" if r.get("descheduled_rounds") else "")
    return f"{r['median_us']:.1f}±{r['spread_pct']:.0f}%{flag} ({r['gbps']:.1f}, {r['pct_of_copy']:.0f}%)"


def format_report(report: dict[str, Any]) -> str:
    bw_spread = report.get("copy_bandwidth_spread_pct")
    lines = [
        report["machine"],
        f"copy_ bandwidth on {report['device']}: {report['copy_bandwidth_gbps']:.1f} GB/s"
        + (f" ±{bw_spread:.0f}% over {report['rounds']} rounds" if bw_spread is not None else ""),
    ]
    if report.get("copy_bandwidth_noisy"):
        lines.append(
            f"  the copy_ bandwidth varied by more than {report['noise_limit_pct']:.0f}% between rounds: "
            "the machine is busy, every figure below is rough"
        )
    win = {(w["op"], w["dtype"], w["tokens"]): w for w in report.get("winners") or winner_table(report)}
    by_op: dict[str, list[dict[str, Any]]] = {}
    for r in report["results"]:
        by_op.setdefault(_label(r), []).append(r)
    width = 27
    for op, rows in by_op.items():
        providers = list(dict.fromkeys(r["provider"] for r in rows))
        lines.append("")
        lines.append(f"{op} [tokens, {report['hidden']}]: us ±spread (GB/s, % of copy)")
        header = (
            f"{'dtype':<9}{'tokens':>7}  "
            + "".join(f"{p:>{width}}" for p in providers)
            + f"{'winner':>13}{'dispatch':>12}"
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
                picks = r["dispatcher_picks"] or ""
                cells.append(_cell(r))
            w = win.get((op, dtype, t))
            winner = "-" if w is None else w["winner"] + ("?" if w["uncertain"] else "")
            lines.append(f"{dtype:<9}{t:>7}  " + "".join(f"{c:>{width}}" for c in cells) + f"{winner:>13}{picks:>12}")
        notes = {(r["provider"], r["status"], r["detail"]) for r in rows if r["status"] != "ok"}
        for provider, status, detail in sorted(notes, key=str):
            lines.append(f"  {provider}: {status}: {detail}")
    noisy = [r for r in report["results"] if r.get("noisy")]
    uncertain = [w for w in win.values() if w["uncertain"]]
    lines.append("")
    lines.append(
        f"±: interquartile range of {report.get('rounds', 1)} rounds (more where re-measured) as % of the median; "
        f"!: still wider than {report.get('noise_limit_pct', 100 * NOISE_LIMIT):.0f}% after re-measuring; "
        "?: the runner-up is within the spread; "
        f"~: rounds dropped, the timing thread was off the CPU for over {100 * (1 - DESCHEDULED_BELOW):.0f}% of them"
    )
    if noisy or uncertain:
        lines.append(
            f"too noisy to trust: {len(noisy)} figure(s) flagged !, {len(uncertain)} winner(s) marked ? "
            "(the machine was busy; rerun on an idle machine or with more --rounds before acting on them)"
        )
    for note in report.get("not_measured", []):
        lines.append(f"not measured: {note}")
    return "\n".join(lines)


def format_priority(report: dict[str, Any]) -> str:
    s = report["suggested_priority"]
    if not s["lists"]:
        return "# no figure was measured: no priority to suggest"
    tokens = ",".join(str(t) for t in sorted({r["tokens"] for r in report["results"]}))
    lines = [
        f"# priority that puts the measured winners first (eager calls; hidden {report['hidden']}, tokens {tokens})"
    ]
    if s["uncertain_ops"]:
        lines.append(f"# uncertain (noisy machine) for: {', '.join(s['uncertain_ops'])}")
    lines.append(f'VLLM_IR_OP_PRIORITY="{s["env"]}"')
    lines.append("# or, for eager mode only, in the VLLM_IR_CONFIG file (the variable applies to compile mode too):")
    lines.append(s["toml"])
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
            by_provider = groups.setdefault((_label(r), r["dtype"]), {})
            by_provider.setdefault(r["provider"], []).append((r["tokens"], r["gbps"]))
    # One row per measured case, one column per dtype.
    labels = sorted({label for label, _ in groups})
    dtype_names = sorted({dtype for _, dtype in groups})
    rows, cols = max(1, len(labels)), max(1, len(dtype_names))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.5 * rows), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for (op, dtype), lines in sorted(groups.items()):
        ax = axes[labels.index(op)][dtype_names.index(dtype)]
        ax.set_visible(True)
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


def _check_providers(names: Sequence[str], ops: Sequence[IrOp]) -> None:
    """An unknown provider name is a usage error listing the known ones (one not here is only skipped)."""
    from vllm_ir import env
    from vllm_ir.cli import UsageError

    here = {p for op in ops for p in op.impls}
    known = here | set(env.KNOWN_PROVIDERS) | {r.name for r in vllm_ir.provider_records()}
    for name in names:
        if name not in known:
            raise UsageError(
                f"argument --providers: unknown provider {name!r}; known providers of "
                f"{', '.join(op.name for op in ops)}: {', '.join(sorted(here))}{env.did_you_mean(name, sorted(known))}"
            )


def json_report(report: dict[str, Any], verb: str = "bench") -> dict[str, Any]:
    """The ``--json FILE`` document of ``bench`` (``tune``, ``bench --model``: ``verb``):
    ``schema`` and the ``machine`` block every CLI document starts with
    (`vllm_ir.cli.json_document`), then every figure; the one-line machine summary the table
    prints is ``machine_summary``."""
    from vllm_ir.cli import json_document

    figures = {k: v for k, v in report.items() if k != "machine"}
    return json_document(verb, {"machine_summary": report["machine"], **figures})


def main(args: Any) -> int:
    from vllm_ir.cli import UsageError, check_memory, check_writable, get_op

    dtypes = args.dtype or [torch.float32, torch.bfloat16]
    if args.quick:
        tokens = args.tokens or [1, 16, 256]
        repeats, copy_mib, rounds = 3, 64, 5
    else:
        tokens = args.tokens or [1, 16, 256, 4096]
        repeats, copy_mib, rounds = 8, 256, 5
    rounds = getattr(args, "rounds", None) or rounds
    args.hidden = args.hidden or 4096
    vllm_ir.load_providers()
    if args.device is None:
        args.device = vllm_ir.current_platform().device_type
    ops = [get_op(name, "ops") for name in args.ops] if args.ops else list(vllm_ir.ops)
    if args.providers is not None:
        if not args.providers:
            raise UsageError("argument --providers: no provider named; expected e.g. --providers vllm_c,aten")
        _check_providers(args.providers, ops)
    for argument, path in (("--json", args.json_file), ("--plot", args.plot)):
        if path:
            check_writable(argument, path)
    check_memory("arguments --tokens/--hidden", (max(tokens), args.hidden), dtypes, args.device)
    _, impls, skipped = plan_of([op.name for op in ops], args.providers)
    if not any(impls.values()):
        reasons = "; ".join(skipped) or "no implementation is supported here"
        print(f"vllm-ir bench: error: nothing to measure: {reasons}", file=sys.stderr)
        return 1
    for note in skipped:
        print(f"vllm-ir bench: note: not measured: {note}", file=sys.stderr)
    report = run(
        [op.name for op in ops],
        providers=args.providers,
        dtypes=dtypes,
        tokens=tokens,
        hidden=args.hidden,
        device=args.device,
        repeats=repeats,
        copy_mib=copy_mib,
        rounds=rounds,
    )
    print(format_report(report))  # first: a failing write below must not lose the run
    if getattr(args, "emit_priority", False):
        print()
        print(format_priority(report))
    status = 0
    if args.json_file:
        try:
            with open(args.json_file, "w") as f:
                json.dump(json_report(report), f, indent=2)
        except OSError as exc:
            print(f"vllm-ir bench: error: argument --json: cannot write {args.json_file}: {exc}", file=sys.stderr)
            status = 1
    if args.plot:
        print(plot(report, args.plot))
    wrong = [r for r in report["results"] if r["status"] in ("wrong", "error")]
    if wrong:
        print(f"\n{len(wrong)} implementation(s) failed correctness: exit code 1", file=sys.stderr)
        return 1
    return status
