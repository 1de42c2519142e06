"""Does eager dispatch run the measured winner? Reads a `vllm-ir bench --json` report.

Issue 33's acceptance: in every case whose winner lies outside the spread (its q3 below every
other provider's q1, not flagged noisy), dispatch picks the winner; and in no case does dispatch
run a provider measured 1.5x or more slower than the winner. Prints each violation and a count.

    vllm-ir bench --quick --json r.json && python benchmarks/dispatch_vs_winner.py r.json
"""

from __future__ import annotations

import argparse
import json


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a vllm-ir bench --json file")
    report = json.load(open(parser.parse_args().report, encoding="utf-8"))
    cases: dict[tuple, dict[str, dict]] = {}
    for r in report["results"]:
        if r["status"] == "ok" and r["median_us"]:
            key = (r["op"], r.get("variant", "default"), r["dtype"], r["tokens"])
            cases.setdefault(key, {})[r["provider"]] = r
    mismatched = slow = 0
    for key, per in sorted(cases.items()):
        picks = next(iter(per.values()))["dispatcher_picks"]
        best = min(per.values(), key=lambda r: r["median_us"])
        clear = not best["noisy"] and all(best["q3_us"] < r["q1_us"] for r in per.values() if r is not best)
        figures = {p: round(r["median_us"], 1) for p, r in per.items()}
        if picks in per and per[picks]["median_us"] >= 1.5 * best["median_us"]:
            slow += 1
            print(f"dispatch >= 1.5x slower: {key}: dispatch {picks}, {figures}")
        if clear and picks != best["provider"]:
            mismatched += 1
            print(f"dispatch != winner: {key}: dispatch {picks}, {figures}")
    print(f"{len(cases)} cases; dispatch != a clear winner: {mismatched}; dispatch >= 1.5x slower: {slow}")
    return 1 if mismatched or slow else 0


if __name__ == "__main__":
    raise SystemExit(main())
