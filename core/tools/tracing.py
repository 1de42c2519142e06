"""What did run: a per-call trace of vllm-ir ops, summarised per kernel and per module.

``explain`` answers what *would* run for a shape; a trace answers what *did* run, how often
and for how long::

    with vllm_ir.trace(model) as t:
        model(x)
    print(t.summary())        # per (op, provider, form, dtype, token range): calls, time, share
    print(t.module_table())   # per module path: which ops ran there, on which provider
    t.to_json("trace.json"); t.to_chrome_trace("trace.chrome.json")  # Perfetto, chrome://tracing

Eager calls are recorded as they run (`vllm_ir.ir.dispatch.observe`); graphs compiled while the trace
is open are listed with the kernel each IR node was lowered to, its module path and the
fusions that fired or did not (`vllm_ir.passes.record`), whether the graph was compiled or
served from Inductor's cache. ``VLLM_IR_TRACE=1`` traces a whole process and prints the
summary at exit (``vllm-ir trace -- CMD`` runs a command so). Memory is bounded: counts and
totals cover every call; medians the last `MAX_SAMPLES` calls of each row; the event list (for
the Chrome trace) the last ``max_events`` calls.

Two recorders fill a trace. With the compiled extension most calls are recorded in C, by the
traced runner itself, into the trace's `fast_lookup.Recorder` (``_recorder``); `Trace.record`
is the Python reference, and records the calls the C runner hands over (no extension, tensor
subclasses, CUDA events, a profiler). Every reader merges both: rows by key, events by start
time (both recorders read the same monotonic clock).
"""

from __future__ import annotations

import atexit
import heapq
import json
import os
import sys
import threading
import time
from _thread import get_ident
from collections import Counter, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_ir.errors import VllmIrError
from vllm_ir.ir import priority as _priority
from vllm_ir.ir.dispatch import fast_lookup, observe
from vllm_ir.ir.dispatch.observe import decode_shapes
from vllm_ir.settings import env

if TYPE_CHECKING:
    import torch

    from vllm_ir.ir.dispatch.observe import CallSite

SCHEMA = "vllm-ir.trace/1"
#: Calls kept one by one (for the Chrome trace and ``events`` in JSON); older ones are dropped.
MAX_EVENTS = 50_000
#: Durations kept per summary row for its median (the most recent ones).
MAX_SAMPLES = 1024
#: CUDA event pairs held before the oldest are read (which waits for them).
MAX_PENDING_EVENTS = 8192
#: Distinct shape sets an event names by number; beyond, events hold the shapes themselves.
MAX_SHAPE_SETS = 1 << 16
#: Module path of calls made outside every module of the traced model.
OUTSIDE = "(outside the model)"
#: Give new traces a compiled recorder where the extension has one (tests turn it off to
#: compare the two recorders: compiled runners then hand every call to the Python one).
compiled_recorder = True


class TraceExportError(VllmIrError, OSError):
    """A trace could not be written; the trace itself is intact (write it elsewhere)."""


@dataclass
class _Row:
    calls: int = 0
    total_ns: int = 0
    samples: deque[int] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    #: The raw row's key (call site, dtype, token-count bit length) and its number, which events
    #: name it by (merged rows have neither).
    key: tuple[Any, ...] | None = None
    index: int = -1


class _Shard:
    """What one thread recorded. Only that thread writes it, so recording takes no lock; readers
    copy its dicts (a copy is one C call under the GIL). Rows of calls timed by CUDA events are
    apart: `Trace._resolve` adds their times, under the trace's lock, from any thread."""

    __slots__ = ("cuda_rows", "modules", "rows")

    def __init__(self) -> None:
        #: (call site, dtype, token-count bit length) -> row.
        self.rows: dict[tuple[Any, ...], _Row] = {}
        self.cuda_rows: dict[tuple[Any, ...], _Row] = {}
        #: (module path, call site) -> calls (with a model).
        self.modules: Counter[tuple[str, CallSite]] = Counter()


#: (op, provider, form, dtype, token range)
RowKey = tuple[str, str, str, str, str]


def token_range(tokens: int | None) -> str:
    """The power-of-two range a token count falls in, as tuning tables cut them: ``[128, 256)``."""
    if tokens is None:
        return "-"
    low = 1 << (max(tokens, 1).bit_length() - 1)
    return f"[{low}, {low * 2})"


class Trace:
    """The calls of one ``with vllm_ir.trace():`` block (this thread or task only) or of a process.

    :param model: an ``nn.Module`` whose submodules name the calls they make (`by_module`).
    :param max_events: how many calls to keep one by one (the Chrome trace); counts keep every call.
    """

    def __init__(self, model: torch.nn.Module | None = None, *, max_events: int = MAX_EVENTS):
        if max_events < 0:
            raise ValueError(f"vllm_ir.trace: max_events must be >= 0, got {max_events}")
        self.model = model
        self.max_events = max_events
        #: Per thread: the hot structures `record` updates (`rows` names them). Merged traces of
        #: other processes add to ``_merged_*`` instead.
        self._shards: dict[int, _Shard] = {}
        self._merged_rows: dict[RowKey, _Row] = {}
        self._merged_calls = 0
        self._merged_modules: Counter[tuple[str, str, str, str]] = Counter()
        self._merged_fallbacks: Counter[tuple[str, str, tuple[tuple[str, str], ...]]] = Counter()
        #: The last ``max_events`` calls as tuples of plain values (`events` decodes them):
        #: ``(start_ns, duration, row number, shape set, tokens, module, thread)``. Nothing in them
        #: is tracked by the garbage collector, so a full ring never makes Python's collections
        #: walk it (which cost microseconds per call when events held call sites and ``torch.Size``).
        self._events: deque[tuple[Any, ...]] = deque(maxlen=max_events)
        self._row_list: list[_Row] = []
        #: Shapes of a call (`observe.python_call_facts`' bytes) -> number.
        self._shape_ids: dict[bytes, int] = {}
        self._shape_list: list[bytes] = []
        #: Reports of the graphs compiled (or served from Inductor's cache) while tracing, as JSON.
        self.compiled: list[dict[str, Any]] = []
        #: Why every op ran native (reference mode), or None.
        self.reference: str | None = None
        self.started: float | None = None
        self.ended: float | None = None
        self._lock = threading.Lock()
        self._pending: deque[tuple[_Row, Any]] = deque()
        #: Thread -> the module paths entered (with a model; None: calls are not attributed).
        self._stacks: dict[int, list[str]] | None = None
        self._hooks: list[Any] = []
        self._tokens: list[Any] = []
        self._records_before: dict[int, set[int]] = {}
        #: Events of other processes' traces (`merge`), as JSON.
        self._imported_events: list[dict[str, Any]] = []
        #: What the compiled traced runners record (`observe`), or None: every call comes to `record`.
        self._recorder: Any = None
        if compiled_recorder and fast_lookup.Recorder is not None:
            self._recorder = fast_lookup.Recorder(max_events, MAX_SAMPLES, MAX_SHAPE_SETS, OUTSIDE)

    # -- recording ------------------------------------------------------------------------

    def record(self, site: CallSite, facts: observe.CallFacts, start_ns: int, duration: Any) -> None:
        """One call (`vllm_ir.ir.dispatch.observe`): its facts (`observe.python_call_facts`, read before
        the kernel ran); ``duration`` is ns, or a pair of CUDA events.

        Kept to a few dict and deque operations on this thread's shard (the issue's budget is
        1 us per call): names, ranges and medians are worked out when the trace is read."""
        dtype, _cuda, shapes, tokens = facts
        bits = 0 if tokens is None else (tokens if tokens > 0 else 1).bit_length()
        thread = get_ident()
        shard = self._shards.get(thread) or self._new_shard(thread)
        key = (site, dtype, bits)
        if type(duration) is int:
            row = shard.rows.get(key) or self._new_row(shard.rows, key)
            row.calls += 1
            row.total_ns += duration
            row.samples.append(duration)
        else:  # CUDA events: their rows are timed by `_resolve`, in whichever thread reads them
            row = shard.cuda_rows.get(key) or self._new_row(shard.cuda_rows, key)
            row.calls += 1
            with self._lock:
                self._pending.append((row, duration))
                if len(self._pending) > MAX_PENDING_EVENTS:
                    self._resolve(len(self._pending) // 2)
        module = OUTSIDE
        stacks = self._stacks
        if stacks is not None:
            stack = stacks.get(thread)
            if stack:
                module = stack[-1]
            shard.modules[(module, site)] += 1
        if self.max_events:
            shape_id = self._shape_ids.get(shapes)
            if shape_id is None:
                shape_id = self._intern(shapes)
            self._events.append((start_ns, duration, row.index, shape_id, tokens, module, thread))

    def _new_shard(self, thread: int) -> _Shard:
        with self._lock:
            shard = self._shards[thread] = _Shard()
        return shard

    def _new_row(self, rows: dict[tuple[Any, ...], _Row], key: tuple[Any, ...]) -> _Row:
        with self._lock:
            row = rows[key] = _Row(key=key, index=len(self._row_list))
            self._row_list.append(row)
        return row

    @property
    def calls(self) -> int:
        """Every call recorded (none dropped: counts are not bounded by ``max_events``)."""
        return self._merged_calls + sum(row.calls for row in self._raw_rows())

    def _raw_rows(self) -> list[_Row]:
        """The rows of both recorders (a key recorded by both has a row in each)."""
        with self._lock:
            rows = list(self._row_list)
        return rows + [row for row, _ in self._compiled_rows()]

    def _compiled_rows(self) -> list[tuple[_Row, tuple[Any, ...]]]:
        """The compiled recorder's rows, with their keys, in its numbering."""
        if self._recorder is None:
            return []
        out = []
        for site, dtype, bits, calls, total_ns, samples in self._recorder.rows():
            key = (site, dtype, bits)
            out.append((_Row(calls, total_ns, deque(samples, maxlen=MAX_SAMPLES), key=key), key))
        return out

    def _intern(self, shapes: bytes) -> int | bytes:
        """The number of a new shape set, or (past `MAX_SHAPE_SETS`) the shapes themselves."""
        with self._lock:
            n = self._shape_ids.get(shapes)
            if n is not None:  # another thread numbered it meanwhile
                return n
            if len(self._shape_list) >= MAX_SHAPE_SETS:
                return shapes
            self._shape_ids[shapes] = n = len(self._shape_list)
            self._shape_list.append(shapes)
            return n

    @property
    def events(self) -> list[dict[str, Any]]:
        """The calls kept one by one (the last ``max_events``), oldest first, as in `to_dict`."""
        with self._lock:
            self._resolve()
            recorded = list(self._events)
            rows, shape_list = self._row_list, self._shape_list
            python = [
                (start, duration, rows[row].key, shape_list[shapes] if type(shapes) is int else shapes, *rest)
                for start, duration, row, shapes, *rest in recorded
            ]
        compiled: list[tuple[Any, ...]] = []
        if self._recorder is not None:
            keys = [key for _, key in self._compiled_rows()]
            compiled = [(start, d, keys[row], *rest) for start, d, row, *rest in self._recorder.events()]
        merged = list(heapq.merge(python, compiled, key=lambda e: e[0])) if compiled else python
        return [self._event_json(e) for e in merged[max(0, len(merged) - self.max_events) :]]

    def _kept(self) -> int:
        """How many calls are kept one by one (those read back from other traces included)."""
        compiled = 0 if self._recorder is None else self._recorder.kept
        return len(self._imported_events) + min(self.max_events, len(self._events) + compiled)

    def _event_json(self, e: tuple[Any, ...]) -> dict[str, Any]:
        start, duration, key, shapes, tokens, module, thread = e
        site, dtype, _bits = key
        return {
            "start_ns": start,
            "duration_ns": duration if type(duration) is int else _cuda_ns(duration),
            "op": site.op.name,
            "provider": site.provider,
            "form": site.form,
            "dtype": _dtype_name(dtype),
            "shapes": decode_shapes(shapes),
            "tokens": tokens,
            "module": module,
            "pid": os.getpid(),
            "tid": thread % (1 << 31),
        }

    def _resolve(self, count: int | None = None) -> None:
        """Read the CUDA events of ``count`` pending calls (all: None), oldest first."""
        n = len(self._pending) if count is None else count
        for _ in range(n):
            row, events = self._pending.popleft()
            ns = _cuda_ns(events)
            row.total_ns += ns
            row.samples.append(ns)

    @property
    def rows(self) -> dict[RowKey, _Row]:
        """Per (op, provider, form, dtype, token range): calls, total and recent durations."""
        out: dict[RowKey, _Row] = {}
        named = []
        for row in self._raw_rows():
            site, dtype, bits = row.key
            named.append(((site.op.name, site.provider, site.form, _dtype_name(dtype), _range_of_bits(bits)), row))
        for key, row in [*named, *self._merged_rows.items()]:
            into = out.get(key)
            if into is None:
                into = out[key] = _Row()
            into.calls += row.calls
            into.total_ns += row.total_ns
            into.samples.extend(row.samples)
        return out

    @property
    def module_calls(self) -> Counter[tuple[str, str, str, str]]:
        """(module path, op, provider, form) -> calls."""
        out = Counter(self._merged_modules)
        with self._lock:
            shards = list(self._shards.values())
        for shard in shards:
            for (module, site), n in dict(shard.modules).items():
                out[(module, site.op.name, site.provider, site.form)] += n
        if self._recorder is not None:
            for module, site, n in self._recorder.modules():
                out[(module, site.op.name, site.provider, site.form)] += n
        return out

    @property
    def fallbacks(self) -> Counter[tuple[str, str, tuple[tuple[str, str], ...]]]:
        """(op, provider that ran, ((declined provider, reason), ...)) -> calls."""
        out = Counter(self._merged_fallbacks)
        for row in self._raw_rows():
            site = row.key[0]
            if site.skipped:
                out[(site.op.name, site.provider, site.skipped)] += row.calls
        return out

    # -- the block --------------------------------------------------------------------------

    def __enter__(self) -> Trace:
        if self._tokens:
            raise RuntimeError("vllm_ir.trace: this trace is already open; use a new vllm_ir.trace() per block")
        self.started = time.time()
        self._snapshot_records()
        self._install_hooks()
        self._tokens = [observe.active.set(self), _priority.scope_var.set(_traced_scope())]
        self.reference = _priority.reference_reason(_priority.current_scope())
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """End the block: stop recording, remove the module hooks, collect compiled graphs."""
        if self._tokens:
            trace_token, scope_token = self._tokens
            self._tokens = []
            _priority.scope_var.reset(scope_token)
            observe.active.reset(trace_token)
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._collect_compiled()
        with self._lock:
            self._resolve()
        self.ended = time.time()

    def _install_hooks(self) -> None:
        if self.model is None:
            return
        from torch import compiler as torch_compiler

        stacks: dict[int, list[str]] = {}
        self._stacks = stacks
        if self._recorder is not None:
            self._recorder.set_stacks(stacks)

        # Under compile the hooks do nothing (Dynamo folds the test away): a compiled graph's
        # modules come from its nodes' nn_module_stack, and a hook Dynamo cannot trace would split it.
        compiling = torch_compiler.is_compiling

        def enter(name: str) -> Any:
            def hook(module: Any, args: Any) -> None:
                if not compiling():
                    stacks.setdefault(get_ident(), []).append(name)

            return hook

        def leave(module: Any, args: Any, output: Any) -> None:
            if compiling():
                return
            stack = stacks.get(get_ident())
            if stack:
                stack.pop()

        for name, module in self.model.named_modules():
            label = name or type(module).__name__
            self._hooks.append(module.register_forward_pre_hook(enter(label)))
            self._hooks.append(module.register_forward_hook(leave, always_call=True))

    def _snapshot_records(self) -> None:
        if "vllm_ir.passes.record" not in sys.modules:
            return  # nothing compiled yet in this process
        from vllm_ir.passes import record

        self._records_before = {id(r): {id(g) for g in r.graphs} for r in record.live_records()}

    def _collect_compiled(self) -> None:
        if "vllm_ir.passes.record" not in sys.modules:
            return
        from vllm_ir.passes import record

        for r in record.live_records():
            r.settle()  # graphs served from Inductor's cache since they were compiled
            before = self._records_before.get(id(r), set())
            for g in r.graphs:
                if id(g) not in before:
                    self.compiled.append(_graph_summary(g))
        self._records_before = {}

    # -- reading ----------------------------------------------------------------------------

    @property
    def traced_ns(self) -> int:
        return sum(r.total_ns for r in self.rows.values())

    def table(self) -> list[dict[str, Any]]:
        """One row per (op, provider, form, dtype, token range), most time first."""
        import statistics

        total = self.traced_ns or 1
        out = []
        for (op, provider, form, dtype, tokens), row in self.rows.items():
            median = statistics.median(row.samples) if row.samples else 0
            out.append(
                {
                    "op": op,
                    "provider": provider,
                    "form": form,
                    "dtype": dtype,
                    "tokens": tokens,
                    "calls": row.calls,
                    "total_us": row.total_ns / 1e3,
                    "median_us": median / 1e3,
                    "share": row.total_ns / total,
                }
            )
        out.sort(key=lambda r: (-r["total_us"], r["op"], r["provider"]))
        return out

    def by_module(self) -> dict[str, dict[str, int]]:
        """``{module path: {"op -> provider": calls}}`` (with a model given to `vllm_ir.trace`)."""
        out: dict[str, dict[str, int]] = {}
        for (module, op, provider, _form), n in sorted(self.module_calls.items()):
            where = out.setdefault(module, {})
            where[f"{op} -> {provider}"] = where.get(f"{op} -> {provider}", 0) + n
        return out

    def summary(self) -> str:
        """A table a person reads: header, one line per row, fallbacks with reasons, compiled graphs."""
        lines = [self._header()]
        rows = self.table()
        if rows:
            cells = [
                (
                    r["op"],
                    r["provider"],
                    r["form"],
                    r["dtype"],
                    r["tokens"],
                    str(r["calls"]),
                    f"{r['total_us'] / 1e3:.3f}",
                    f"{r['median_us']:.1f}",
                    f"{100 * r['share']:.1f}%",
                )
                for r in rows
            ]
            head = ("op", "provider", "form", "dtype", "tokens", "calls", "total ms", "median us", "share")
            lines += _aligned([head, *cells], right_from=5)
        elif not self.compiled:
            lines.append("  no vllm-ir op ran eagerly in this trace")
        for (op, provider, skipped), n in sorted(self.fallbacks.items()):
            why = "; ".join(f"{p}: {reason}" for p, reason in skipped)
            lines.append(f"  fallback: {op} ran {provider} x{n} because {why}")
        for i, graph in enumerate(self.compiled):
            lines += _describe_graph(i, graph)
        return "\n".join(lines)

    def module_table(self) -> str:
        """``layers.3.mlp: silu_and_mul -> vllm_c x32``, one line per module path."""
        if self.model is None:
            return "(no model was given to vllm_ir.trace, so calls are not attributed to modules)"
        lines = []
        for module, calls in self.by_module().items():
            lines.append(f"{module}: " + ", ".join(f"{what} x{n}" for what, n in calls.items()))
        return "\n".join(lines) or "(no vllm-ir op ran inside the model)"

    def _header(self) -> str:
        ms = self.traced_ns / 1e6
        kept = f"; the last {self._kept()} kept one by one" if self._kept() < self.calls else ""
        ref = f"; REFERENCE MODE ({self.reference})" if self.reference else ""
        return f"vllm-ir trace: {self.calls} eager calls, {ms:.3f} ms in kernels{kept}{ref}"

    # -- export ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Everything the trace holds, as JSON (schema `SCHEMA`)."""
        events = [*self._imported_events, *self.events]
        rows = [
            {
                "op": k[0],
                "provider": k[1],
                "form": k[2],
                "dtype": k[3],
                "tokens": k[4],
                "calls": r.calls,
                "total_ns": r.total_ns,
                "recent_ns": list(r.samples),
            }
            for k, r in self.rows.items()
        ]
        modules = [
            {"module": m, "op": o, "provider": p, "form": f, "calls": n}
            for (m, o, p, f), n in self.module_calls.items()
        ]
        fallbacks = [
            {"op": o, "provider": p, "declined": [list(s) for s in skipped], "calls": n}
            for (o, p, skipped), n in self.fallbacks.items()
        ]
        return {
            "schema": SCHEMA,
            "pid": os.getpid(),
            "started": self.started,
            "ended": self.ended,
            "reference": self.reference,
            "calls": self.calls,
            "rows": rows,
            "modules": modules,
            "fallbacks": fallbacks,
            "compiled": self.compiled,
            "events": events,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Trace:
        """A trace read back from `to_dict` (e.g. written by another process)."""
        if data.get("schema") != SCHEMA:
            raise ValueError(f"not a vllm-ir trace of schema {SCHEMA!r} (schema {data.get('schema')!r})")
        t = cls()
        t.merge(data)
        return t

    def merge(self, data: Mapping[str, Any]) -> None:
        """Add another trace's `to_dict` to this one (several processes of one command)."""
        self._merged_calls += data["calls"]
        self.reference = self.reference or data.get("reference")
        for r in data["rows"]:
            row = self._merged_rows.setdefault((r["op"], r["provider"], r["form"], r["dtype"], r["tokens"]), _Row())
            row.calls += r["calls"]
            row.total_ns += r["total_ns"]
            row.samples.extend(r["recent_ns"])
        for m in data["modules"]:
            self._merged_modules[(m["module"], m["op"], m["provider"], m["form"])] += m["calls"]
        for f in data["fallbacks"]:
            self._merged_fallbacks[(f["op"], f["provider"], tuple(tuple(s) for s in f["declined"]))] += f["calls"]
        self.compiled += data["compiled"]
        self._imported_events += data["events"]
        if data.get("started") is not None:
            self.started = min(filter(None, (self.started, data["started"])))
        if data.get("ended") is not None:
            self.ended = max(filter(None, (self.ended, data["ended"])))

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write `to_dict` to ``path``; a path that cannot be written raises `TraceExportError`."""
        _write(path, json.dumps(self.to_dict(), indent=1), "trace")

    def to_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write the kept calls in the Trace Event Format (Perfetto, chrome://tracing)."""
        data = self.to_dict()
        pid = data["pid"]
        events = data["events"]
        trace_events = [
            {
                "name": f"vllm_ir::{e['op']}[{e['provider']}]",
                "cat": "vllm_ir",
                "ph": "X",
                "ts": e["start_ns"] / 1e3,
                "dur": e["duration_ns"] / 1e3,
                "pid": e.get("pid", pid),
                "tid": e.get("tid", 0),
                "args": {k: e[k] for k in ("form", "dtype", "shapes", "tokens", "module")},
            }
            for e in events
        ]
        text = json.dumps({"traceEvents": trace_events, "displayTimeUnit": "ns", "otherData": {"schema": SCHEMA}})
        _write(path, text, "Chrome trace")


def _cuda_ns(events: tuple[Any, Any]) -> int:
    begin, end = events
    end.synchronize()
    return int(begin.elapsed_time(end) * 1e6)


def _dtype_name(dtype: Any) -> str:
    return "-" if dtype is None else str(dtype).removeprefix("torch.")


def _range_of_bits(bits: int) -> str:
    """`token_range` of any count of this bit length (0: no token count)."""
    return "-" if bits == 0 else token_range(1 << (bits - 1))


def _write(path: str | os.PathLike[str], text: str, what: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as exc:
        raise TraceExportError(f"vllm-ir: could not write the {what} to {os.fspath(path)!r}: {exc}") from exc


def _graph_summary(report: Any) -> dict[str, Any]:
    return {
        "from_cache": report.from_cache,
        "kernels": [
            {"node": node, "op": op, "provider": provider, "module": report.modules.get(node)}
            for op, nodes in report.selected_impls.items()
            for node, provider in nodes.items()
        ],
        "fusions_requested": list(report.fusions_requested),
        "fusions": list(report.fusions),
        "fusions_rejected": list(report.fusions_rejected),
        "unlowered": dict(report.unlowered),
    }


def _describe_graph(i: int, graph: Mapping[str, Any]) -> list[str]:
    origin = "served from Inductor's cache" if graph["from_cache"] else "compiled"
    lines = [f"  compiled graph {i} ({origin}): {len(graph['kernels'])} IR nodes lowered"]
    for k in graph["kernels"]:
        where = f"  [{k['module']}]" if k["module"] else ""
        lines.append(f"    {k['node']}: {k['op']} -> {k['provider']}{where}")
    fired = Counter(f.split(":", 1)[0] for f in graph["fusions"])
    for name in graph["fusions_requested"]:
        n = fired.get(name, 0)
        lines.append(f"    fusion {name}: fired {n}x" if n else f"    fusion {name}: requested, did not fire")
    for why in graph["fusions_rejected"]:
        lines.append(f"    fusion rejected: {why}")
    for node, why in graph["unlowered"].items():
        lines.append(f"    not lowered: {node}: {why}")
    return lines


def _aligned(rows: list[tuple[str, ...]], right_from: int) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i >= right_from else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        out.append("  " + "  ".join(cells).rstrip())
    return out


def _traced_scope() -> Any:
    return _priority.with_switches(_priority.current_scope(), traced=True)


def trace(model: torch.nn.Module | None = None, *, max_events: int = MAX_EVENTS) -> Trace:
    """Record every vllm-ir call of this thread or task inside the block (see the module docstring)."""
    return Trace(model, max_events=max_events)


# -- the process trace (VLLM_IR_TRACE=1) ------------------------------------------------------

_process: Trace | None = None


def process_trace() -> Trace | None:
    """The trace of the whole process when ``VLLM_IR_TRACE=1``, else None."""
    return _process


def start_process_trace() -> None:
    """Trace every call of the process; at exit print the summary to stderr, or with
    ``VLLM_IR_TRACE_DIR`` write ``trace-<pid>.json`` there (how ``vllm-ir trace`` collects it)."""
    global _process
    if _process is not None:
        return
    _process = Trace()
    _process.started = time.time()
    _process.reference = None
    observe.set_process_sink(_process)
    atexit.register(_finish_process_trace)


def _finish_process_trace() -> None:
    t = _process
    if t is None:
        return
    t.close()
    t.reference = _priority.reference_reason(None)
    folder = env.raw(env.ENV_TRACE_DIR)
    if folder:
        try:
            t.to_json(Path(folder) / f"trace-{os.getpid()}.json")
            return
        except TraceExportError as exc:
            print(f"{exc}; the summary follows", file=sys.stderr)
    print(t.summary(), file=sys.stderr)


def load_traces(folder: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The traces processes wrote to ``folder`` (`start_process_trace`)."""
    for path in sorted(Path(folder).glob("trace-*.json")):
        try:
            yield json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"vllm-ir trace: skipped unreadable {path}: {exc}", file=sys.stderr)


def run_command(command: list[str], *, json_file: str | None = None, chrome_file: str | None = None) -> int:
    """``vllm-ir trace -- COMMAND``: run it traced, print the merged summary, then write the files.

    The summary is printed before any file is written, so a path that cannot be written loses
    nothing on screen; it makes the status 1 (else the command's own status is returned).
    """
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="vllm-ir-trace-") as folder:
        environ = dict(os.environ, **{env.ENV_TRACE: "1", env.ENV_TRACE_DIR: folder})
        try:
            status = subprocess.call(command, env=environ)
        except OSError as exc:
            print(f"vllm-ir trace: cannot run {command[0]!r}: {exc}", file=sys.stderr)
            return 127
        merged = Trace()
        processes = 0
        for data in load_traces(folder):
            merged.merge(data)
            processes += 1
    if processes == 0:
        print("vllm-ir trace: no process of the command imported vllm_ir; nothing was traced", file=sys.stderr)
    else:
        print(f"vllm-ir trace: {processes} process(es) traced, command exit status {status}")
        print(merged.summary())
    for path, write in ((json_file, merged.to_json), (chrome_file, merged.to_chrome_trace)):
        if path is None:
            continue
        try:
            write(path)
        except TraceExportError as exc:
            print(f"vllm-ir trace: error: {exc}", file=sys.stderr)
            status = status or 1
    return status
