"""How vllm-ir times kernels: one implementation shared by ``vllm-ir bench`` and ``benchmarks/``.

This machine class is noisy (2 shared cores), so comparisons are made side by side in one
process: paired, interleaved samples whose order alternates, reduced to medians.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Median and spread of per-call wall time, in microseconds."""

    median_us: float
    p10_us: float
    p90_us: float
    samples: int
    #: Distribution-free 95% confidence interval of the median (order statistics n/2 -+ 0.98 sqrt(n)).
    median_ci_us: tuple[float, float] = (float("nan"), float("nan"))
    #: The median over samples of the calling thread's CPU time over wall time (`time.thread_time`):
    #: well below 1 when the thread was descheduled (another tenant took the core) or slept for
    #: most samples, so the median itself is the scheduler's. 1.0 where not measured (CUDA events).
    on_cpu: float = 1.0


#: A round whose thread was on the CPU for less than this share of its wall time was
#: descheduled: its figure is the scheduler's, not the kernel's (`vllm-ir bench` drops it).
DESCHEDULED_BELOW = 0.6


def time_call(fn: Callable[[], object], *, warmup: int = 10, repeats: int = 50, inner: int = 1) -> Timing:
    """Median wall time of ``fn()`` over ``repeats`` samples of ``inner`` calls each (CPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    shares = []
    for _ in range(repeats):
        c0 = cpu_clock()
        t0 = clock()
        for _ in range(inner):
            fn()
        t1 = clock()
        shares.append(min(1.0, (cpu_clock() - c0) / (t1 - t0)) if t1 > t0 else 1.0)
        samples.append((t1 - t0) / inner / 1e3)
    return dataclasses.replace(_summarize(samples), on_cpu=statistics.median(shares))


def interleaved_rounds(
    fns: dict[str, Callable[[], object]],
    *,
    rounds: int,
    inner: int = 1,
    repeats: int = 15,
    stat: str = "median_us",
    device: torch.device | str = "cpu",
    on_cpu: list[dict[str, float]] | None = None,
) -> list[dict[str, float]]:
    """Each round times every callable (``repeats`` samples, ``stat`` of their Timing, µs; CUDA
    events on a GPU ``device``), the order reversed every other round; returns each round's
    times. The one round loop of `vllm-ir bench` and the benchmarks. Bests are a minimum per
    name; a ratio of two callables is best taken within each round (neighbours in ``fns`` run
    back to back), which this VM's slow and fast memory phases do not skew as a ratio of bests
    does. ``on_cpu``, when given, receives each round's `Timing.on_cpu` per name (a round
    well below 1 was descheduled: see `DESCHEDULED_BELOW`)."""
    extra = {"inner": inner} if inner != 1 else {}  # CUDA events time single calls
    times = []
    for r in range(rounds):
        this_round = {}
        shares = {}
        for name in list(fns) if r % 2 == 0 else list(reversed(fns)):
            timing = time_kernel(fns[name], device, warmup=3 if r == 0 else 1, repeats=repeats, **extra)
            this_round[name] = getattr(timing, stat)
            shares[name] = timing.on_cpu
        times.append(this_round)
        if on_cpu is not None:
            on_cpu.append(shares)
    return times


def best_of(times: list[dict[str, float]]) -> dict[str, float]:
    """Each callable's best round of ``interleaved_rounds``' result."""
    return {name: min(t[name] for t in times) for name in times[0]}


def median_ratio(times: list[dict[str, float]], numerator: str, denominator: str) -> float:
    """The median over ``interleaved_rounds``' rounds of one callable's time over another's."""
    return statistics.median(t[numerator] / t[denominator] for t in times)


def paired_overhead(
    baseline: Callable[[], object], candidate: Callable[[], object], *, samples: int = 2000, inner: int = 20
) -> Timing:
    """Median per-call difference (candidate - baseline) over interleaved blocks of ``inner`` calls.

    Blocks alternate which callable runs first; medians of per-pair differences cancel the
    drift (frequency, other tenants) that separate runs of each callable would absorb.
    """
    for _ in range(max(10, samples // 20)):
        baseline()
        candidate()
    clock = time.perf_counter_ns
    diffs = []
    for i in range(samples):
        first, second = (candidate, baseline) if i & 1 else (baseline, candidate)
        t0 = clock()
        for _ in range(inner):
            first()
        t1 = clock()
        for _ in range(inner):
            second()
        t2 = clock()
        a, b = (t1 - t0), (t2 - t1)
        diffs.append(((a - b) if i & 1 else (b - a)) / inner / 1e3)
    return _summarize(diffs)


def _summarize(samples: list[float]) -> Timing:
    q = statistics.quantiles(samples, n=10) if len(samples) >= 2 else [samples[0]] * 9
    ordered = sorted(samples)
    n = len(ordered)
    half_width = 0.98 * n**0.5
    low, high = max(0, int(n / 2 - half_width)), min(n - 1, int(n / 2 + half_width))
    return Timing(statistics.median(samples), q[0], q[-1], n, (ordered[low], ordered[high]))


def machine_summary() -> str:
    """One line naming the machine, torch build and thread count, printed by every benchmark."""
    build = (
        f"cuda {torch.version.cuda}"
        if torch.version.cuda
        else ("rocm " + torch.version.hip if torch.version.hip else "cpu")
    )
    return (
        f"{platform.machine()} {platform.processor() or platform.system()}, {os.cpu_count()} cpus, "
        f"torch {torch.__version__} ({build}), {torch.get_num_threads()} threads, python {platform.python_version()}"
    )


def time_cuda(fn: Callable[[], object], *, warmup: int = 10, repeats: int = 50, use_graph: bool = True) -> Timing:
    """Median GPU time of ``fn()`` with CUDA events, replayed from a CUDA graph when capturable."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    run = fn
    if use_graph:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            run = graph.replay
        except Exception:  # not capturable (host sync, allocation pattern): time plain launches
            run = fn
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return _summarize(samples)


def time_kernel(fn: Callable[[], object], device: torch.device | str, **kwargs: int) -> Timing:
    """`time_cuda` on GPUs, `time_call` on CPU: the one entry point benchmarks use."""
    if torch.device(device).type == "cuda":
        return time_cuda(fn, **kwargs)
    return time_call(fn, **kwargs)
