"""``vllm-ir tune``: measure every provider per op, dtype and token count, and write a tuning table.

It runs ``vllm-ir bench``'s machinery (correctness against native before any timing, so a
WRONG kernel never enters the table; interleaved rounds; descheduled rounds dropped; the spread
rule), then orders the providers of each measured case:

- a case any of whose figures is still flagged (too wide a spread, or mostly descheduled) is
  not learned: its range gets no entry, and the other layers decide there;
- the fastest provider goes first, unless the provider dispatch runs today (the incumbent) lies
  within the spread of it (the winner's q3 reaches the incumbent's q1): then the incumbent
  stays first, and the rest follow by median;
- each measured token count T_i gets the power-of-two range around it: boundaries at the power
  of two nearest above sqrt(T_i * T_i+1); the first range starts at 1, the last is open.

A run whose copy bandwidth varied by more than the noise limit, or a quarter of whose figures
were flagged, was on a busy machine: it says so and writes nothing unless ``--force``. Entries
of the output file for (op, dtype) pairs this run did not measure are kept. The format is in
`vllm_ir.ir.tuning`.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

import vllm_ir
from vllm_ir.ir import tuning
from vllm_ir.tools import bench

#: Share of flagged figures above which the machine counts as busy.
BUSY_SHARE = 0.25
DEFAULT_OUT = "vllm-ir-tuning.json"


def boundaries(tokens: Sequence[int]) -> list[int]:
    """The range boundaries between measured token counts (powers of two, increasing)."""
    out: list[int] = []
    ts = sorted(set(tokens))
    for a, b in itertools.pairwise(ts):
        bound = 1 << max(0, math.ceil(math.log2(math.sqrt(a * b))))
        bound = min(bound, 1 << (b.bit_length() - 1))  # at most b: b lies above it
        if bound > a and (not out or bound > out[-1]):
            out.append(bound)
    return out


def order_case(rows: Sequence[dict[str, Any]], incumbent: str | None) -> tuple[list[str] | None, str]:
    """The provider order one measured case teaches, or None (not learned), and why."""
    ok = [r for r in rows if r["status"] == "ok" and r["median_us"] is not None]
    if not ok:
        return None, "nothing was timed"
    flagged = [r["provider"] for r in ok if r["noisy"]]
    if flagged:
        return None, f"not learned: {', '.join(flagged)} flagged (noisy or descheduled)"
    ranked = sorted(ok, key=lambda r: r["median_us"])
    best = ranked[0]
    note = f"{best['provider']} fastest"
    current = next((r for r in ranked if r["provider"] == incumbent), None)
    if current is not None and current is not best and best["q3_us"] >= current["q1_us"]:
        ranked.remove(current)
        ranked.insert(0, current)
        note = f"{incumbent} kept: {best['provider']} is faster only within the spread"
    names = [r["provider"] for r in ranked]
    if "native" in names:
        names = names[: names.index("native") + 1]
    else:
        names.append("native")
    return names, note


def build_entries(report: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Table entries from a bench report (default inputs only) and one line per measured case."""
    cases: dict[tuple[str, str], dict[int, list[dict[str, Any]]]] = {}
    for r in report["results"]:
        if r.get("variant", "default") == "default":
            cases.setdefault((r["op"], r["dtype"]), {}).setdefault(r["tokens"], []).append(r)
    entries: list[dict[str, Any]] = []
    lines: list[str] = []
    for (op, dtype), per_tokens in cases.items():
        ts = sorted(per_tokens)
        bounds = boundaries(ts)
        edges = [1, *bounds, None]
        for i, t in enumerate(ts):
            rows = per_tokens[t]
            incumbent = rows[0]["dispatcher_picks"]
            order, note = order_case(rows, incumbent)
            if i >= len(edges) - 1:
                break  # two counts in one power-of-two range: the first one speaks for it
            low, high = edges[i], edges[i + 1]
            rng = f"[{low}, {'∞' if high is None else high})"
            if order is None:
                lines.append(f"{op} {dtype} T={t} {rng}: {note}; dispatch keeps {incumbent}")
                continue
            change = f"{incumbent} -> {order[0]}" if order[0] != incumbent else f"{incumbent} (unchanged)"
            lines.append(f"{op} {dtype} T={t} {rng}: {change}; {note}; order {', '.join(order)}")
            measured = {
                r["provider"]: {"us": round(r["median_us"], 3), "spread_pct": round(r["spread_pct"], 1)}
                for r in sorted(rows, key=lambda r: r["median_us"] or math.inf)
                if r["status"] == "ok" and r["median_us"] is not None
            }
            entries.append(
                {
                    "op": op,
                    "mode": "eager",
                    "dtype": dtype,
                    "tokens": [low, high],
                    "providers": order,
                    "measured_at_tokens": t,
                    "hidden": report["hidden"],
                    "measured": measured,
                }
            )
    return entries, lines


def busy_reason(report: dict[str, Any]) -> str | None:
    """Why this run's machine counts as busy, or None."""
    timed = [r for r in report["results"] if r["status"] == "ok" and r["median_us"] is not None]
    flagged = [r for r in timed if r["noisy"]]
    if report.get("copy_bandwidth_noisy"):
        return f"the copy bandwidth varied by {report['copy_bandwidth_spread_pct']:.0f}% between rounds"
    if timed and len(flagged) > BUSY_SHARE * len(timed):
        return f"{len(flagged)} of {len(timed)} figures were flagged noisy or descheduled"
    return None


def merge(old_path: str, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``entries`` plus the old file's entries for (mode, op, dtype) pairs not re-measured."""
    try:
        with open(old_path, encoding="utf-8") as f:
            old = json.load(f)
    except (OSError, ValueError):
        return entries
    if not isinstance(old, dict) or old.get("schema") != tuning.SCHEMA or not isinstance(old.get("entries"), list):
        return entries
    fresh = {(e["mode"], e["op"], e["dtype"]) for e in entries}
    kept = [
        e
        for e in old["entries"]
        if isinstance(e, dict) and (e.get("mode", "eager"), e.get("op"), e.get("dtype")) not in fresh
    ]
    return kept + entries


def main(args: Any) -> int:
    from vllm_ir.plugins import discovery as plugins
    from vllm_ir.tools.arguments import UsageError, check_writable, get_op

    vllm_ir.load_providers()
    dtypes = args.dtype or [torch.float32, torch.bfloat16]
    quick = args.quick
    tokens = args.tokens or ([1, 16, 256] if quick else [1, 16, 256, 4096])
    repeats, copy_mib = (3, 64) if quick else (8, 256)
    rounds = args.rounds or 5
    hidden = args.hidden or 4096
    device = args.device or vllm_ir.current_platform().device_type
    ops = [get_op(name, "ops") for name in args.ops] if args.ops else list(vllm_ir.ops)
    ops = [
        op for op in ops if sum(bool(i.supported) for i in op.impls.values()) > 1 and op._input_generator is not None
    ]
    if not ops:
        raise UsageError("nothing to tune: no named op has a provider besides native here")
    out = args.out or (os.environ.get(tuning.ENV_TUNING, "").split(os.pathsep)[0] or DEFAULT_OUT)
    check_writable("--out", out)
    json_file = args.json_file
    if json_file:
        check_writable("--json", json_file)
    report = bench.run(
        [op.name for op in ops],
        providers=args.providers,
        dtypes=dtypes,
        tokens=tokens,
        hidden=hidden,
        device=device,
        repeats=repeats,
        copy_mib=copy_mib,
        rounds=rounds,
        variants=False,
    )
    if json_file:
        with open(json_file, "w", encoding="utf-8") as f:
            json.dump(bench.json_report(report, "tune"), f, indent=1)
    wrong = [r for r in report["results"] if r["status"] in ("wrong", "error")]
    entries, lines = build_entries(report)
    busy = busy_reason(report)
    print(report["machine"])
    for line in lines:
        print(line)
    for r in wrong:
        print(f"left out: {r['op']} {r['dtype']} T={r['tokens']} {r['provider']}: {r['status']}: {r['detail']}")
    if busy and not args.force:
        print(
            f"vllm-ir tune: the machine was busy ({busy}): {out} not written; rerun on an idle machine, "
            "or pass --force to write it anyway",
            file=sys.stderr,
        )
        return 2
    facts = plugins.tuning_facts()
    used = {p for e in entries for p in e["providers"]}
    versions = {p: v for p, v in facts.provider_versions.items() if p in used}
    table = {
        "schema": tuning.SCHEMA,
        "machine": tuning.machine_facts(facts.platform, versions),
        "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "vllm-ir tune " + " ".join(sys.argv[2:] if len(sys.argv) > 2 else []),
        "busy": busy,
        "entries": merge(out, entries),
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print(
        f"wrote {len(table['entries'])} entries to {out}" + (f" (forced; the machine was busy: {busy})" if busy else "")
    )
    if os.path.abspath(out) not in [p for _o, p in tuning.site_tables()]:
        print(f"to use it: VLLM_IR_TUNING={os.path.abspath(out)} (or tuning = [...] in the VLLM_IR_CONFIG file)")
    return 1 if wrong else 0
