"""What the token-range bucket costs the eager cache hit: the C lookup before and after, in one process.

Issue 33 puts the range bucket of a tuning table into the decision key (`vllm_ir.ir.tuning`).
This times the compiled lookup (``Lookup.lookup``, the whole cache-hit half of dispatch) of
``rms_norm`` three ways, paired and interleaved (`vllm_ir.tools.timing.paired_overhead`):

- "before": the extension built from the commit before the bucket (``--baseline-extension``,
  a ``_fast_lookup*.so`` built from that commit with ``python setup.py build_ext --inplace``),
  loaded under another module name;
- "after, no table": this tree's extension, no bucket map (an op no table orders per range);
- "after, bucketed": this tree's extension with a bucket map set (an op a table orders per range).

Three call patterns: the same call over and over (the last-hit memo answers); two hidden sizes
alternating (every call builds its key and looks it up in the dict, on every variant); and two
token counts of one range alternating (T=16, T=32: one key on every variant, the memo answers).
Token counts of *different* ranges are not a pattern to compare: before the bucket they shared
one key (a memo hit), after it they are two decisions (a dict hit), which is the feature.

    python benchmarks/bucket_overhead.py --baseline-extension /tmp/old/core/_fast_lookup.cpython-311-x86_64-linux-gnu.so
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools

import torch

import vllm_ir
from vllm_ir.ir import priority
from vllm_ir.ir.dispatch import fast_lookup
from vllm_ir.tools.timing import machine_summary, paired_overhead


def _load(path: str):
    spec = importlib.util.spec_from_file_location("baseline_lookup._fast_lookup", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _lookup(module, op, buckets: bytes | None, calls: list[tuple]):
    fixed, decisions = {}, {}
    names = list(op.signature.parameters)
    mask = sum(1 << names.index(n) for n in op.tensor_params)
    token_mask = sum(1 << names.index(n) for n in op.token_params)
    lookup = module.Lookup(fixed, decisions, priority.scope_var, vars(torch.compiler), mask, token_mask, len(names))
    if buckets is not None:
        lookup.set_buckets(buckets)
    decision = object()
    for args in calls:
        decisions[lookup.key(None, *args)] = decision
        assert lookup.lookup(*args) is decision
    return lookup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-extension", required=True, help="_fast_lookup .so built from the earlier commit")
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--inner", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    assert fast_lookup.available(), fast_lookup.unavailable_reason
    old, new = _load(args.baseline_extension), fast_lookup._module
    op = vllm_ir.ops.rms_norm
    buckets = bytes([0] * 4 + [1] * 61)  # T < 8 and T >= 8: two ranges
    print(machine_summary())
    print("us per call of Lookup.lookup (median of paired per-call differences; 95% CI of the median)")
    patterns = {
        "same call (memo hit)": ((16, 4096),),
        "two hidden sizes (dict hit)": ((16, 4096), (16, 2048)),
        "T=16/32, one range (memo hit)": ((16, 4096), (32, 4096)),
    }
    for pattern, shapes in patterns.items():
        calls = [(torch.randn(*s), torch.randn(s[-1]), 1e-6, None) for s in shapes]
        lookups = {
            "before": _lookup(old, op, None, calls),
            "after, no table": _lookup(new, op, None, calls),
            "after, bucketed": _lookup(new, op, buckets, calls),
        }
        runners = {}
        for name, lookup in lookups.items():
            cycle = itertools.cycle(calls)
            runners[name] = lambda f=lookup.lookup, c=cycle: f(*next(c))
        base = runners["before"]
        for name in ("after, no table", "after, bucketed"):
            t = paired_overhead(base, runners[name], samples=args.samples, inner=args.inner)
            lo, hi = t.median_ci_us
            print(f"{pattern:<36} {name:<16} - before: {t.median_us:+.4f} us  (CI {lo:+.4f}..{hi:+.4f})")


if __name__ == "__main__":
    main()
