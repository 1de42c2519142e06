"""``vllm-ir bench``: validate and time every available implementation, and say which wins.

For each (op, dtype, shape, provider): correctness against native first (a wrong kernel is
reported, never timed), then timing with the shared helpers of `vllm_ir.tools.timing` (CPU: warm-up
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

``--plot`` draws the figure read first (`summary_figure`: the dispatcher's choice's speed-up
over native per op and token count, hatched where noise could explain it); ``--plot-detail``
adds the per-op panels (`detail_figure`). A provider has one colour everywhere (`provider_color`).
"""

from __future__ import annotations

import colorsys
import dataclasses
import datetime
import glob
import hashlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

import vllm_ir
from vllm_ir.ir.dispatch import selection
from vllm_ir.ir.impl import IrOpImpl, reason_of
from vllm_ir.ir.op import IrOp
from vllm_ir.tools.timing import DESCHEDULED_BELOW, interleaved_rounds, machine_summary

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
    #: Bytes one call reads and writes (activations and outputs): the working set that is
    #: compared with the last-level cache before a figure is put against the copy bandwidth.
    bytes_moved: int | None = None


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


def last_level_cache_bytes(device: torch.device) -> int | None:
    """Size of the largest cache one core of ``device`` reaches (a GPU's L2; on a CPU the highest
    level sysfs lists for cpu0, one instance, not the socket's sum), or None where unknown.

    A working set below it is served from cache, so its bandwidth says nothing about memory:
    the plot puts only larger ones against the copy bandwidth.
    """
    if device.type == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        return int(size) or None
    if device.type != "cpu":
        return None
    best: tuple[int, int] | None = None
    for index in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            with open(f"{index}/type") as f:
                kind = f.read().strip()
            with open(f"{index}/level") as f:
                level = int(f.read())
            with open(f"{index}/size") as f:
                text = f.read().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        size = int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text) if text.isdigit() else 0
        if kind != "Instruction" and size and (best is None or level > best[0]):
            best = (level, size)
    return best[1] if best else None


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
                        r.bytes_moved = moved
                        r.pct_of_copy = 100 * r.gbps / bandwidth.median
    if progress and sys.stderr.isatty():
        sys.stderr.write("\r" + " " * 80 + "\r")
    report = {
        "machine": machine_summary(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": str(dev),
        "last_level_cache_bytes": last_level_cache_bytes(dev),
        "threads": torch.get_num_threads(),
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


def _cell(r: dict[str, Any], llc: int | None) -> str:
    """One figure: time, spread and bandwidth; the share of ``copy_``'s bandwidth only where the
    call's bytes exceed the last-level cache (an in-cache call against a DRAM copy reads as
    nonsense, up to thousands of percent), as the plot does."""
    if r["status"] != "ok":
        return r["status"].upper() if r["status"] == "wrong" else r["status"]
    flag = ("!" if r["noisy"] else "") + ("~" if r.get("descheduled_rounds") else "")
    beyond_cache = llc is not None and (r.get("bytes_moved") or 0) > llc
    share = f", {r['pct_of_copy']:.0f}%" if beyond_cache else ""
    return f"{r['median_us']:.1f}±{r['spread_pct']:.0f}%{flag} ({r['gbps']:.1f}{share})"


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
    llc = report.get("last_level_cache_bytes")
    share_note = (
        f", % of copy_ where the call moves more than the {llc / 2**20:.0f} MiB last-level cache"
        if llc
        else "; last-level cache size unknown: no % of copy_"
    )
    by_op: dict[str, list[dict[str, Any]]] = {}
    for r in report["results"]:
        by_op.setdefault(_label(r), []).append(r)
    for op, rows in by_op.items():
        providers = list(dict.fromkeys(r["provider"] for r in rows))
        lines.append("")
        lines.append(f"{op} [tokens, {report['hidden']}]: us ±spread (GB/s{share_note})")
        table = [["dtype", "tokens", *providers, "winner", "dispatch"]]
        for dtype, t in dict.fromkeys((r["dtype"], r["tokens"]) for r in rows):
            cells = []
            picks = ""
            for p in providers:
                r = next((x for x in rows if x["dtype"] == dtype and x["tokens"] == t and x["provider"] == p), None)
                if r is None:
                    cells.append("")
                    continue
                picks = r["dispatcher_picks"] or ""
                cells.append(_cell(r, llc))
            w = win.get((op, dtype, t))
            winner = "-" if w is None else w["winner"] + ("?" if w["uncertain"] else "")
            table.append([dtype, str(t), *cells, winner, picks])
        # Each column as wide as its widest cell, two spaces apart: long figures and provider
        # names never run into their neighbours.
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        for row in table:
            first = f"{row[0]:<{widths[0]}}"
            lines.append("  ".join([first, *(f"{c:>{w}}" for c, w in zip(row[1:], widths[1:], strict=True))]))
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


#: Fixed colours of the providers this project knows (Okabe-Ito: told apart by colour-blind
#: readers too): a provider keeps its colour in every panel and figure, whoever else is shown.
PROVIDER_COLORS: dict[str, str] = {
    "native": "#000000",
    "aten": "#0072b2",
    "vllm_c": "#d55e00",
    "triton": "#009e73",
    "inductor": "#cc79a7",
    "aiter": "#e69f00",
    "xpu_kernels": "#56b4e9",
    "flashinfer": "#8c564b",
    "oink": "#999933",
}


def provider_color(name: str) -> str:
    """``name``'s colour: fixed for a known provider, else a hue drawn from a hash of the name
    itself, so it never depends on which other providers a figure shows."""
    if name in PROVIDER_COLORS:
        return PROVIDER_COLORS[name]
    hue = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") / 2**32
    r, g, b = colorsys.hls_to_rgb(hue, 0.42, 0.75)
    return f"#{round(255 * r):02x}{round(255 * g):02x}{round(255 * b):02x}"


@dataclass(frozen=True)
class SpeedUp:
    """How much faster than native one provider ran one case."""

    provider: str | None
    #: Native's median time over the provider's; None when there is no pair to divide (see ``note``).
    ratio: float | None
    #: Noise could explain the ratio: the two interquartile ranges overlap (faster or slower
    #: cannot be told), a figure stayed wider than `NOISE_LIMIT` after re-measuring, or its
    #: rounds were mostly descheduled (its time is partly the scheduler's, not the kernel's).
    uncertain: bool = False
    note: str = ""


@dataclass(frozen=True)
class HeatCell:
    """One heat-map cell: the dispatcher's choice and the fastest provider measured."""

    chosen: SpeedUp
    fastest: SpeedUp
    #: The fastest's interquartile range overlaps the chosen one's: the choice may well be right.
    close: bool = False


def iqrs_overlap(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two timings' interquartile ranges (``q1_us``..``q3_us``) overlap: noise could
    explain the difference of their medians."""
    return a["q1_us"] <= b["q3_us"] and b["q1_us"] <= a["q3_us"]


def _speed_up(provider: str | None, timed: dict[str, dict[str, Any]]) -> SpeedUp:
    native = timed.get("native")
    if provider is None:
        return SpeedUp(None, None, note="nothing timed")
    r = timed.get(provider)
    if r is None:
        return SpeedUp(provider, None, note="not timed")
    if native is None:
        return SpeedUp(provider, None, note="no native")
    uncertain = any(x.get("noisy") or x.get("descheduled") for x in (r, native))
    uncertain |= provider != "native" and iqrs_overlap(r, native)
    return SpeedUp(provider, native["median_us"] / r["median_us"], uncertain)


def speed_ups(report: dict[str, Any]) -> dict[tuple[str, str, int], HeatCell]:
    """Per (case, dtype, tokens): the speed-up over native of the dispatcher's choice, and of
    the fastest provider measured."""
    timed: dict[tuple[str, str, int], dict[str, dict[str, Any]]] = {}
    picks: dict[tuple[str, str, int], str | None] = {}
    for r in report["results"]:
        key = (_label(r), r["dtype"], r["tokens"])
        picks.setdefault(key, r.get("dispatcher_picks"))
        by_provider = timed.setdefault(key, {})
        if r["status"] == "ok" and r.get("median_us"):
            by_provider[r["provider"]] = r
    out = {}
    for key, by_provider in timed.items():
        fastest = min(by_provider, key=lambda p: by_provider[p]["median_us"]) if by_provider else None
        chosen = by_provider.get(picks[key] or "")
        close = chosen is not None and fastest is not None and iqrs_overlap(chosen, by_provider[fastest])
        out[key] = HeatCell(_speed_up(picks[key], by_provider), _speed_up(fastest, by_provider), close)
    return out


def _title(report: dict[str, Any], what: str) -> str:
    """Three lines: what the figure shows, the machine and date, the versions."""
    machine = report.get("machine")
    if isinstance(machine, dict):
        cpus = f", {machine['cpus']} cpus" if machine.get("cpus") else ""
        threads = report.get("threads") if machine.get("platform") == "cpu" else None
        cpus += f", {threads} thread{'s' if threads != 1 else ''}" if threads else ""
        where = f"{machine.get('device')} ({machine.get('platform')}, {machine.get('isa')}{cpus})"
        versions = [f"vllm-ir {machine.get('vllm_ir')}", f"torch {machine.get('torch')}"]
        versions += [f"{p} {v}" for p, v in (machine.get("providers") or {}).items()]
    else:  # the in-memory report: the one-line summary, versions not looked up
        where, versions = str(report.get("machine_summary", machine)), []
    date = report.get("date")
    when = date.replace("T", " ").replace("Z", " UTC") if date else "date not recorded"
    lines = [f"vllm-ir bench: {what} (hidden {report['hidden']})", f"{where}, {when}"]
    return "\n".join(lines + ([", ".join(versions)] if versions else []))


def summary_figure(report: dict[str, Any]) -> Any:
    """The figure read first: a heat map of ops x token counts, colour = speed-up over native of
    the provider the dispatcher chose, named on its own colour; where another provider measured
    faster, it is named under it. A cell whose speed-up cannot be told from noise is hatched."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    cells = speed_ups(report)
    rows = list(dict.fromkeys((label, dtype) for label, dtype, _ in cells))
    tokens = sorted({t for _, _, t in cells})
    logs = [abs(math.log2(c.chosen.ratio)) for c in cells.values() if c.chosen.ratio]
    limit = min(3.0, max([1.0, *logs]))  # 2x at least, clipped at 8x
    size = (max(8.0, 4.6 + 1.5 * len(tokens)), 2.4 + 0.62 * max(1, len(rows)))
    fig = Figure(figsize=size, layout="constrained")
    fig.suptitle(_title(report, "speed-up over native of the dispatcher's choice"), fontsize=10)
    ax = fig.subplots()
    cmap = ListedColormap(colormaps["RdBu"](np.linspace(0.08, 0.92, 256))).with_extremes(bad="#e8e8e8")
    grid = np.full((max(1, len(rows)), max(1, len(tokens))), np.nan)
    for (label, dtype, t), cell in cells.items():
        chosen, i, j = cell.chosen, rows.index((label, dtype)), tokens.index(t)
        if chosen.ratio:
            grid[i, j] = math.log2(chosen.ratio)
        strong = chosen.ratio is not None and abs(math.log2(chosen.ratio)) > 0.6 * limit
        ink = "white" if strong else "black"
        text = f"{chosen.ratio:.2f}x" if chosen.ratio else chosen.note
        # On the cell's own colour, so the hatching of an uncertain cell never crosses the figures.
        ground = cmap(min(1.0, max(0.0, 0.5 + math.log2(chosen.ratio) / (2 * limit)))) if chosen.ratio else "#e8e8e8"
        plate = {"boxstyle": "square,pad=0.15", "facecolor": ground, "edgecolor": "none"}
        ax.text(j, i + 0.02, text, ha="center", va="center", fontsize=10, color=ink, bbox=plate)
        if chosen.provider:  # the provider's name on its own colour, as in every other figure
            badge = {"boxstyle": "round,pad=0.25", "facecolor": provider_color(chosen.provider), "edgecolor": "none"}
            ax.text(
                j,
                i - 0.27,
                chosen.provider,
                ha="center",
                va="center",
                fontsize=8,
                color="white",
                bbox=badge,
                gid=f"provider:{chosen.provider}",
            )
        fastest = cell.fastest
        if fastest.provider and fastest.provider != chosen.provider and fastest.ratio:
            ratio = "" if fastest.provider == "native" else f" {fastest.ratio:.2f}x"
            note = f"fastest: {fastest.provider}{ratio}" + ("?" if cell.close else "")
            ax.text(j, i + 0.3, note, ha="center", va="center", fontsize=7, color=ink, gid="fastest", bbox=plate)
        if chosen.uncertain:
            lines = "#e0e0e0" if strong else "#606060"  # seen on dark cells too
            hatch = {"fill": False, "hatch": "//", "edgecolor": lines, "linewidth": 0}
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, gid="uncertain", **hatch))
    image = ax.imshow(grid, cmap=cmap, vmin=-limit, vmax=limit, aspect="auto")
    ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
    ax.set_yticks(range(len(rows)), [f"{label} {dtype}" for label, dtype in rows])
    ax.set_xlabel("tokens")
    ax.tick_params(length=0)
    if not rows:
        ax.text(0, 0, "nothing was timed", ha="center", va="center")
    ticks = [k for k in range(-3, 4) if abs(k) <= limit]
    bar = fig.colorbar(image, ax=ax, ticks=ticks, shrink=0.9, pad=0.02)
    bar.ax.set_yticklabels([f"{2.0**k:g}x" for k in ticks])
    bar.set_label("native time / chosen provider's time")
    noise = report.get("noise_limit_pct", 100 * NOISE_LIMIT)
    fig.supxlabel(
        f"Medians over {report.get('rounds', 1)} rounds. Hatched: noise could explain it (the interquartile ranges "
        f"overlap, a figure stayed wider than {noise:.0f}% of its median,\nor most of its rounds were descheduled). "
        "fastest: another provider measured faster (?: within its spread). Grey: no pair to divide.",
        fontsize=8,
    )
    return fig


def detail_figure(report: dict[str, Any]) -> Any:
    """Per-op panels: GB/s against tokens per provider, error bars the interquartile range; the
    share of the copy bandwidth is written only where a call's working set exceeds the last-level
    cache (an in-cache figure against a memory copy means nothing), else bandwidth alone."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    groups: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {}
    for r in report["results"]:
        if r["status"] == "ok" and r.get("median_us"):
            groups.setdefault((_label(r), r["dtype"]), {}).setdefault(r["provider"], []).append(r)
    llc = report.get("last_level_cache_bytes")
    cols = max(1, min(3, len(groups)))
    nrows = max(1, math.ceil(len(groups) / cols))
    fig = Figure(figsize=(4.8 * cols, 3.3 * nrows + 1.6), layout="constrained")
    fig.suptitle(_title(report, "bandwidth per op"), fontsize=10)
    axes = fig.subplots(nrows, cols, squeeze=False)
    for ax in axes.flat[len(groups) :]:
        ax.set_visible(False)
    copy, shown = report["copy_bandwidth_gbps"], set()
    for ax, ((label, dtype), by_provider) in zip(axes.flat, groups.items(), strict=False):
        ax.axhspan(
            report.get("copy_bandwidth_q1_gbps", copy),
            report.get("copy_bandwidth_q3_gbps", copy),
            color="#c8c8c8",
            alpha=0.5,
            linewidth=0,
        )
        ax.axhline(copy, color="#808080", linestyle="--", linewidth=1)
        in_cache: set[int] = set()
        for provider, points in sorted(by_provider.items()):
            points = sorted(points, key=lambda r: r["tokens"])
            moved = [r.get("bytes_moved") or r["gbps"] * r["median_us"] * 1e3 for r in points]
            x = [r["tokens"] for r in points]
            y = [r["gbps"] for r in points]
            low = [y_ - b / r["q3_us"] / 1e3 for y_, b, r in zip(y, moved, points, strict=True)]
            high = [b / r["q1_us"] / 1e3 - y_ for y_, b, r in zip(y, moved, points, strict=True)]
            bars = ax.errorbar(
                x,
                y,
                yerr=[low, high],
                color=provider_color(provider),
                marker="o",
                markersize=4,
                capsize=3,
                linewidth=1.3,
            )
            bars.lines[0].set_gid(f"provider:{provider}")
            off_cpu = [r for r in points if r.get("descheduled")]
            if off_cpu:  # hollow: most rounds were descheduled, the time is partly the scheduler's
                ax.plot(
                    [r["tokens"] for r in off_cpu],
                    [r["gbps"] for r in off_cpu],
                    linestyle="none",
                    marker="o",
                    markersize=6,
                    markerfacecolor="white",
                    color=provider_color(provider),
                    gid="descheduled",
                    zorder=4,
                )
            shown.add(provider)
            for r, b in zip(points, moved, strict=True):
                if llc and b > llc:
                    ax.annotate(
                        f"{r['pct_of_copy']:.0f}%",
                        (r["tokens"], r["gbps"]),
                        textcoords="offset points",
                        xytext=(4, 4),
                        fontsize=7,
                        color=provider_color(provider),
                    )
                elif llc:
                    in_cache.add(r["tokens"])
        xs = sorted({r["tokens"] for points in by_provider.values() for r in points})
        if in_cache:  # shade the token counts whose working set fits in the cache
            edge = [*xs, xs[-1] * 2]
            right = max(in_cache)
            ax.axvspan(
                xs[0] / 1.4,
                math.sqrt(right * edge[edge.index(right) + 1]) if right != xs[-1] else right * 1.4,
                color="#f6f0dc",
                linewidth=0,
                zorder=0,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, [str(t) for t in xs])
        ax.set_xlim(xs[0] / 1.4, xs[-1] * 1.4)
        ax.set_title(f"{label} {dtype}", fontsize=10)
        ax.set_xlabel("tokens")
        ax.set_ylabel("GB/s")
    order = sorted(shown, key=lambda p: (p != "native", p))  # the baseline first
    handles = [Line2D([], [], color=provider_color(p), marker="o", label=p) for p in order]
    handles.append(Line2D([], [], color="#808080", linestyle="--", label=f"copy_ {copy:.1f} GB/s (band: IQR)"))
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, frameon=False)
    if llc:
        cache = (
            "%: share of the copy_ bandwidth, only where a call's working set exceeds the "
            f"{llc / 2**20:.0f} MiB last-level cache; shaded: the working set fits in it, bandwidth alone."
        )
    else:
        cache = "Last-level cache size unknown: the share of the copy_ bandwidth is not shown, bandwidth alone."
    fig.supxlabel(
        f"Error bars: interquartile range over {report.get('rounds', 1)} rounds; hollow: most rounds were "
        f"descheduled, the figure is partly the scheduler's.\n{cache}",
        fontsize=8,
    )
    return fig


def figures(report: dict[str, Any], *, detail: bool = False) -> list[Any]:
    """The summary figure first; the per-op panels after it only with ``detail``."""
    return [summary_figure(report), *([detail_figure(report)] if detail else [])]


def plot(report: dict[str, Any], path: str | None, detail_path: str | None = None) -> str:
    """Write the summary figure to ``path`` and, on request, the per-op panels to ``detail_path``;
    returns what was written, or why nothing was (matplotlib is optional)."""
    wanted = [p for p in (path, detail_path) if p]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"--plot: matplotlib is not installed (pip install matplotlib); {' and '.join(wanted)} not written"
    written = []
    for target, make in ((path, summary_figure), (detail_path, detail_figure)):
        if target:
            make(report).savefig(target, dpi=110)
            written.append(target)
    return f"plot written to {' and '.join(written)}"


def _check_providers(names: Sequence[str], ops: Sequence[IrOp]) -> None:
    """A misspelt provider name (`env.looks_like_typo`) is a usage error listing the known ones;
    any other name not here is only skipped (a provider of other machines)."""
    from vllm_ir.settings import env
    from vllm_ir.tools.arguments import UsageError

    here = {p for op in ops for p in op.impls}
    known = here | {r.name for r in vllm_ir.provider_records()}
    for name in names:
        if name not in known and env.looks_like_typo(name, known):
            raise UsageError(
                f"argument --providers: unknown provider {name!r}; known providers of "
                f"{', '.join(op.name for op in ops)}: {', '.join(sorted(here))}{env.did_you_mean(name, sorted(known))}"
            )


def json_report(report: dict[str, Any], verb: str = "bench") -> dict[str, Any]:
    """The ``--json FILE`` document of ``bench`` (``tune``, ``bench --model``: ``verb``):
    ``schema`` and the ``machine`` block every CLI document starts with
    (`vllm_ir.tools.output.json_document`), then every figure; the one-line machine summary the table
    prints is ``machine_summary``."""
    from vllm_ir.tools.output import json_document

    figures = {k: v for k, v in report.items() if k != "machine"}
    return json_document(verb, {"machine_summary": report["machine"], **figures})


def main(args: Any) -> int:
    from vllm_ir.tools.arguments import UsageError, check_memory, check_writable, get_op

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
    plot_detail = getattr(args, "plot_detail", None)
    for argument, path in (("--json", args.json_file), ("--plot", args.plot), ("--plot-detail", plot_detail)):
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
    document = json_report(report) if args.json_file or args.plot or plot_detail else None
    if args.json_file:
        try:
            with open(args.json_file, "w") as f:
                json.dump(document, f, indent=2)
        except OSError as exc:
            print(f"vllm-ir bench: error: argument --json: cannot write {args.json_file}: {exc}", file=sys.stderr)
            status = 1
    if args.plot or plot_detail:
        print(plot(document, args.plot, plot_detail))  # the document: its machine block names the versions
    wrong = [r for r in report["results"] if r["status"] in ("wrong", "error")]
    if wrong:
        print(f"\n{len(wrong)} implementation(s) failed correctness: exit code 1", file=sys.stderr)
        return 1
    return status
