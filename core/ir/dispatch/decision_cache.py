"""One op's cached dispatch decisions: the dicts the hot path reads, clearing, statistics.

The eager hot path looks a call's key (`vllm_ir.ir.dispatch.cache_key`) up in ``decisions``, or in
``fixed`` when the first candidate of a scope accepts every call (no key needed). Where the
``vllm_ir.ir.dispatch._fast_lookup`` extension is built, a compiled `lookup` reads the same two dicts.
Calls that reach the torch op's kernel (a graph that kept the IR node, a direct
``torch.ops.vllm_ir`` call) keep their own dict, without the fallback policy. Anything that
can change a decision clears all of them through `vllm_ir.ir.registry.invalidate`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm_ir.ir import priority as _priority
from vllm_ir.ir import registry, tuning
from vllm_ir.ir.dispatch import fallback, fast_lookup, observe, selection
from vllm_ir.settings.log import get_logger

if TYPE_CHECKING:
    from vllm_ir.ir.dispatch.selection import Decision
    from vllm_ir.ir.op import IrOp

#: A runaway key space (e.g. a new epsilon every call) resets the cache instead of growing it.
MAX_CACHED_DECISIONS = 4096

_log = get_logger("dispatch")
#: Skips counted by decisions that were dropped (cleared, or never cached).
_retired_skips: Counter[tuple[str, str, str]] = Counter()


class DecisionCache:
    """The cached decisions of one op (see the module docstring)."""

    def __init__(self, op: IrOp):
        self.op = op
        self.fixed: dict[object, Decision] = {}
        self.decisions: dict[tuple, Decision] = {}
        self.kernel_decisions: dict[tuple, Decision] = {}
        #: ``[bucket map]``: set when a tuning table chooses this op by token range, so keys end
        #: with the call's range bucket (`vllm_ir.ir.tuning.bucket_map`); ``[None]``: no bucket.
        self.bucket_cell: list[bytes | None] = [None]
        #: The compiled reader of ``fixed`` and ``decisions`` (None: pure Python).
        self.lookup = fast_lookup.make_lookup(op, self.fixed, self.decisions, _priority.scope_var)
        self.set_buckets(tuning.bucket_map(op.name))
        #: ``key(scope, *args)``: set once the op's entry points are generated.
        self.key: Callable[..., Any] | None = None

    def on_miss(self, key: tuple, args: tuple) -> Decision:
        """Cache miss of the eager hot path: decide, apply the fallback policy, maybe cache."""
        op = self.op
        epoch = registry.epoch
        decision = self._observed_twin(key)
        if decision is None:
            decision = selection.decide(op, args, "eager", key[0])
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug(
                "op %s: chose %s for %s%s%s",
                op.name,
                decision.provider,
                selection.describe_call(op, args),
                "".join(f"; {p} declined: {r}" for p, r in decision.skipped),
                "" if decision.cacheable else " (not cached: a predicate registered with cacheable=False)",
            )
        if decision.skipped:
            fallback.apply(op, decision)
        # Priorities or registrations changed meanwhile (another thread): run it, don't keep it.
        current = epoch == registry.epoch
        if current and not decision.skipped and decision.impl.supports_args is None and not tuning.mentions(op.name):
            # Nothing was skipped, so the first candidate ran, and it accepts every call:
            # no per-call key is needed in this scope (unless a tuning table orders the
            # candidates per dtype and token range: then the first candidate depends on the call).
            self.fixed[key[0]] = decision
        elif current and decision.cacheable:
            if len(self.decisions) >= MAX_CACHED_DECISIONS:
                self.clear()
            self.decisions[key] = decision
        else:
            for provider, reason in decision.skipped:
                _retired_skips[(op.name, provider, reason)] += 1
            decision.calls = -1  # the hot path adds one; this decision is never looked up again
        return decision

    def _observed_twin(self, key: tuple) -> Decision | None:
        """In a traced or profiled scope: the plain scope's cached decision for this call, behind a
        recorder or profiler range (`vllm_ir.ir.dispatch.observe`), so that it keeps the plain decision's
        settled kernels (its first-call result check is not run again); None if it has none."""
        scope = key[0]
        if scope is None or not scope.observed:
            return None
        plain_scope = _priority.with_switches(scope, traced=False, labelled=False)
        plain = self.fixed.get(plain_scope) or self.decisions.get((plain_scope, *key[1:]))
        if plain is None:
            return None
        return observe.observed(self.op, plain, traced=scope.traced, labelled=scope.labelled)

    def for_kernel(self, args: tuple) -> Decision:
        """The decision for a call that reached the torch op's kernel: cached like the eager
        path, in its own dict and without the fallback policy, as an uncached decide answers."""
        scope = _priority.current_scope()
        assert self.key is not None, "the op's entry points set the key before it can be called"
        key = self.key(scope, *args)
        decision = self.kernel_decisions.get(key)
        if decision is None:
            epoch = registry.epoch
            decision = selection.decide(self.op, args, "eager", scope)
            if decision.cacheable and epoch == registry.epoch:
                if len(self.kernel_decisions) >= MAX_CACHED_DECISIONS:
                    self.kernel_decisions.clear()
                self.kernel_decisions[key] = decision
        return decision

    def set_buckets(self, buckets: bytes | None) -> bool:
        """Key calls on their token-range bucket (``buckets``: one byte per token-count bit
        length) or not (None); forgets every decision when that changes. True if it changed."""
        if buckets == self.bucket_cell[0]:
            return False
        self.bucket_cell[0] = buckets
        if self.lookup is not None:
            self.lookup.set_buckets(buckets)
        self.clear()
        return True

    def clear(self) -> None:
        """Forget every decision (their skip counts go to the statistics)."""
        self.kernel_decisions.clear()
        self.fixed.clear()
        if self.decisions:
            _retire(self.decisions, self.op.name)
            self.decisions.clear()
        if self.lookup is not None:  # last: a lookup racing the clear may re-remember an old hit
            self.lookup.forget()


def _retire(decisions: dict[tuple, Decision], op_name: str) -> None:
    """Fold the call counts of decisions about to be dropped into the statistics."""
    for d in decisions.values():
        for provider, reason in d.skipped:
            _retired_skips[(op_name, provider, reason)] += d.calls


def dispatch_stats() -> dict[str, dict[str, dict[str, int]]]:
    """How often each provider was skipped in favour of a lower one: ``{op: {provider: {reason: calls}}}``."""

    counts = Counter(_retired_skips)
    for op in registry.all_ops():
        for d in op.decision_cache.decisions.values():
            for provider, reason in d.skipped:
                counts[(op.name, provider, reason)] += d.calls
    out: dict[str, dict[str, dict[str, int]]] = {}
    for (op_name, provider, reason), n in sorted(counts.items()):
        if n:
            out.setdefault(op_name, {}).setdefault(provider, {})[reason] = n
    return out


def reset_dispatch_stats() -> None:
    """Zero the statistics and forget which warnings were shown."""
    _retired_skips.clear()
    fallback.forget_warnings()
    selection.forget_predicate_errors()
    for op in registry.all_ops():
        for d in op.decision_cache.decisions.values():
            d.calls = 0
