"""vllm_ir.tools.timing's interleaved rounds: what the benchmarks' per-round ratios rest on."""

from __future__ import annotations

from vllm_ir.tools.timing import best_of, interleaved_rounds, median_ratio


def test_interleaved_rounds_time_every_callable_per_round_in_alternating_order():
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    times = interleaved_rounds(fns, rounds=3, inner=2, repeats=4)
    assert len(times) == 3
    assert all(set(t) == {"a", "b", "c"} and all(v > 0 for v in t.values()) for t in times)
    first, later = 3 + 4 * 2, 1 + 4 * 2  # warmup (3 in the first round, then 1), then repeats x inner
    order = calls[: 3 * first : first] + calls[3 * first :: later]
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert len(calls) == 3 * first + 6 * later


def test_best_of_and_median_ratio_read_rounds_as_the_benchmarks_pair_them():
    times = [{"kernel": 10.0, "copy_": 8.0}, {"kernel": 20.0, "copy_": 18.0}, {"kernel": 12.0, "copy_": 6.0}]
    assert best_of(times) == {"kernel": 10.0, "copy_": 6.0}
    # Per round 0.8, 0.9, 0.5: the median is 0.8, where the ratio of the bests would say 0.6.
    assert median_ratio(times, "copy_", "kernel") == 0.8
