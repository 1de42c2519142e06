"""Measured tuning tables: the priority layer that chooses a provider per op, dtype and token range.

A tuning table is a JSON file written by ``vllm-ir tune`` (or shipped by a provider, see the
``vllm_ir_tuning_tables`` hook)::

    {
      "schema": "vllm-ir.tuning/1",
      "machine": {"platform": "cpu", "isa": "AVX512", "device": "AMD EPYC", "cpus": 2,
                  "torch": "2.13.0", "providers": {"vllm_c": "0.1.0", "aten": "0.1.0"}},
      "measured": "2026-12-02T08:10:00Z",
      "command": "vllm-ir tune --quick",
      "entries": [
        {"op": "rms_norm", "mode": "eager", "dtype": "bfloat16", "tokens": [1, 4],
         "providers": ["vllm_c", "native"], "hidden": 4096,
         "measured": {"vllm_c": {"us": 6.1, "spread_pct": 3.0}, "native": {"us": 27.2, "spread_pct": 2.0}}}
      ]
    }

``tokens`` is ``[low, high)``: powers of two, ``high`` null for "and above". A call's token
count T (the leading dimension of its first token tensor; 1 for a 1-D activation) falls in one
range. An entry holds only on the machine facts it was measured under: the **platform**, the
**ISA** (CPU: torch's ATen capability, e.g. AVX512; GPU: the compute capability, e.g. sm_90),
on GPUs the **device name**, and the **version of every provider it orders** that is installed
here. The CPU model string, the core count and the torch version are recorded and shown, not
required: two AVX-512 CPUs run the same compiled kernels. An entry whose facts differ is
ignored with a reason (``explain``, ``doctor``'s "not for this machine"); a malformed file or
entry is ignored with a warning naming the file and entry (a ``doctor`` problem).

Where tables come from, highest first: the site (``VLLM_IR_TUNING``, then the config file's
``tuning`` key) and the providers' shipped tables. For one (op, mode, dtype) the highest table
that has entries supplies all of them (ranges from two tables are never mixed).

The layer sits above the platform/provider defaults and below the config file, the
environment and user code (DESIGN.md contract 5). The eager decision cache keys calls of a
tuned op on the range bucket (`bucket_map`, read by the C lookup too), never on T itself; an op
no table mentions, or whose entries all cover every T, keeps today's key at no cost.

Under compile, a static token count chooses by its range; a dynamic one (a SymInt) keeps a
single choice: the table's entry when every range of that dtype orders the providers alike,
else no tuning entry (the defaults decide), and ``explain`` says so.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import platform as _platform
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm_ir.ir import registry
from vllm_ir.settings import env
from vllm_ir.settings.env import Finding

if TYPE_CHECKING:
    from vllm_ir.ir.op import IrOp

SCHEMA = "vllm-ir.tuning/1"
ENV_TUNING = env.ENV_TUNING
MODES = ("eager", "compile")
#: Bit lengths a token count can have (the bucket map has one byte per bit length).
MAX_BITS = 64
_OWNER = "tuning"


@dataclass(frozen=True)
class Measurement:
    """One provider's figure behind an entry: median µs and interquartile spread (% of median)."""

    provider: str
    us: float
    spread_pct: float | None = None

    def __str__(self) -> str:
        spread = f" ±{self.spread_pct:.0f}%" if self.spread_pct is not None else ""
        return f"{self.provider} {self.us:.1f} µs{spread}"


@dataclass(frozen=True)
class TuningEntry:
    """The ordered providers for one op, mode, dtype and token range ``[low, high)``."""

    op: str
    mode: str
    dtype: str
    low: int
    high: int | None
    providers: tuple[str, ...]
    measured: tuple[Measurement, ...]
    #: The table file and the entry's position in it (for messages).
    path: str
    index: int
    hidden: int | None = None

    def covers(self, tokens: int) -> bool:
        t = max(tokens, 1)
        return self.low <= t and (self.high is None or t < self.high)

    def range_text(self) -> str:
        return f"T ∈ [{self.low}, {'∞' if self.high is None else self.high})"


@dataclass(frozen=True)
class TuningTable:
    path: str
    #: Who installed it: ``VLLM_IR_TUNING``, ``config <file>``, ``provider vllm_c (dist 0.1.0)``.
    origin: str
    machine: Mapping[str, Any]
    measured: str | None
    entries: tuple[TuningEntry, ...]

    def describe_machine(self) -> str:
        m = self.machine
        parts = [str(m.get("device") or m.get("platform") or "?")]
        if m.get("isa"):
            parts.append(str(m["isa"]))
        if m.get("cpus"):
            parts.append(f"{m['cpus']} cpus")
        return ", ".join(parts)


@dataclass(frozen=True)
class Choice:
    """What the tuning layer says for one call: its entry, or why it says nothing."""

    entry: TuningEntry | None
    table: TuningTable | None = None
    #: Why no entry applies (no table for the op, T outside every range, a dynamic T, ...).
    note: str | None = None

    def describe(self) -> str:
        """``chosen by tuning table F (measured D on M: vllm_c 6.1 µs ±3%, native 27.2 µs at T ∈ [1, 2))``."""
        if self.entry is None or self.table is None:
            return self.note or "no tuning entry"
        e = self.entry
        figures = ", ".join(str(m) for m in e.measured) or "no figures recorded"
        when = (self.table.measured or "?")[:10]
        hidden = f", hidden {e.hidden}" if e.hidden else ""
        return (
            f"tuning table {e.path} (measured {when} on {self.table.describe_machine()}: {figures} "
            f"at {e.range_text()}{hidden})"
        )


@dataclass(frozen=True)
class Facts:
    """What discovery tells the tuning layer about this process (`registry.Discovery.tuning_facts`)."""

    platform: str
    #: provider name -> its distribution version ("" when unknown).
    provider_versions: Mapping[str, str] = field(default_factory=dict)
    #: (origin, path) of every table the providers ship.
    shipped: tuple[tuple[str, str], ...] = ()


def _no_facts() -> Facts:
    return Facts(platform="cpu")


@dataclass
class _Layer:
    tables: list[TuningTable]
    #: (mode, op) -> dtype -> entries sorted by ``low``.
    entries: dict[tuple[str, str], dict[str, list[TuningEntry]]]
    #: (mode, op) -> the sorted range boundaries (powers of two) over every dtype.
    boundaries: dict[tuple[str, str], tuple[int, ...]]
    #: op -> why entries were ignored here (facts), for explain.
    ignored: dict[str, list[str]]
    findings: list[Finding]
    fingerprint: dict[str, str]


_layer: _Layer | None = None


def reload() -> None:
    """Forget the loaded tables; the next call that needs them reads them again."""
    global _layer
    with registry.lock:
        had = _layer is not None
        _layer = None
        env.clear(_OWNER)
        for op in registry.all_ops():
            op.decision_cache.set_buckets(None)
        if had:
            registry.invalidate()


registry.on_connect(reload)  # another discovery: other platform, versions and shipped tables


def layer() -> _Layer:
    """The tables in force (read once, after provider discovery; `reload` forgets them)."""
    current = _layer
    if current is not None:
        return current
    registry.ensure_providers_loaded()
    return _build()


def _build() -> _Layer:
    global _layer
    with registry.lock:
        if _layer is not None:
            return _layer
        facts = (registry.discovery().tuning_facts or _no_facts)()
        here = machine_facts(facts.platform)
        findings: list[Finding] = []
        quiet: list[Finding] = []  # doctor's notes that warn nobody (see below)
        tables: list[TuningTable] = []
        shipped = {path for _origin, path in facts.shipped}
        for origin, path in site_tables() + list(facts.shipped):
            table, problems = read_table(path, origin)
            findings += problems
            if table is not None:
                tables.append(table)
        entries: dict[tuple[str, str], dict[str, list[TuningEntry]]] = {}
        ignored: dict[str, list[str]] = {}
        claimed: set[tuple[str, str, str]] = set()
        for table in tables:
            mismatch = machine_mismatch(table.machine, here)
            if mismatch:
                # A provider ships tables for the machines its authors measured: on any other
                # machine that is the normal state, nothing to warn about at every start-up
                # (doctor still notes it). A table the site named itself warns.
                (quiet if table.path in shipped else findings).append(
                    Finding(
                        f"tuning table {table.path}",
                        f"tuning table {table.path} ({table.origin}): measured on {mismatch}; "
                        f"its {len(table.entries)} entries are ignored here",
                        "nothing to do if the table is shared with machines it was measured on; "
                        "else run vllm-ir tune here",
                        here_only=True,
                    )
                )
                for e in table.entries:
                    ignored.setdefault(e.op, []).append(f"{table.path} entry {e.index}: measured on {mismatch}")
                continue
            mine: dict[tuple[str, str, str], list[TuningEntry]] = {}
            for e in table.entries:
                stale = _version_mismatch(e, table.machine, facts.provider_versions)
                if stale:
                    ignored.setdefault(e.op, []).append(f"{table.path} entry {e.index}: {stale}")
                    findings.append(
                        Finding(
                            f"tuning table {table.path}",
                            f"tuning table {table.path}, entry {e.index} ({e.op}): {stale}; the entry is ignored",
                            "run vllm-ir tune again with the installed providers",
                            here_only=True,
                        )
                    )
                    continue
                mine.setdefault((e.mode, e.op, e.dtype), []).append(e)
            for key, group in mine.items():
                if key in claimed:
                    continue  # a higher table already supplies this (mode, op, dtype)
                claimed.add(key)
                entries.setdefault((key[0], key[1]), {})[key[2]] = sorted(group, key=lambda e: e.low)
        boundaries = {key: _boundaries(per_dtype) for key, per_dtype in entries.items()}
        fingerprint = {mode: _fingerprint(entries, mode) for mode in MODES}
        built = _Layer(tables, entries, boundaries, ignored, findings + quiet, fingerprint)
        env.report(_OWNER, findings, replace=True)
        env.report(_OWNER, quiet, warn=False)
        _layer = built
        changed = False
        for op in registry.all_ops():
            changed |= op.decision_cache.set_buckets(bucket_map(op.name))
        if changed:
            registry.invalidate()  # decisions cached under keys without the bucket are dropped
        return built


def _boundaries(per_dtype: Mapping[str, list[TuningEntry]]) -> tuple[int, ...]:
    """Where the choice can change with T, over every dtype: an entry's edge, unless the
    neighbouring entry continues it with the same providers (then T there changes nothing)."""
    bounds = {1}
    for group in per_dtype.values():
        for prev, e in zip([None, *group], group, strict=False):
            if prev is None or prev.high != e.low or prev.providers != e.providers:
                bounds.add(e.low)
                if prev is not None and prev.high is not None:
                    bounds.add(prev.high)
        if group[-1].high is not None:
            bounds.add(group[-1].high)
    return tuple(sorted(bounds))


def _fingerprint(entries: Mapping[tuple[str, str], Mapping[str, list[TuningEntry]]], mode: str) -> str:
    parts = sorted(
        (op, dtype, e.low, e.high or 0, e.providers)
        for (m, op), per_dtype in entries.items()
        if m == mode
        for dtype, group in per_dtype.items()
        for e in group
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def fingerprint(mode: str) -> str:
    """Hash of the entries in force for ``mode`` (the compile cache key covers it)."""
    return layer().fingerprint[mode]


def site_tables() -> list[tuple[str, str]]:
    """(origin, path) of the site's tables: ``VLLM_IR_TUNING`` (paths separated by ``os.pathsep``),
    then the config file's ``tuning`` key."""
    from vllm_ir.settings import config

    out: list[tuple[str, str]] = []
    value = env.raw(ENV_TUNING)
    if value is not None:
        out += [(ENV_TUNING, os.path.abspath(os.path.expanduser(p))) for p in value.split(os.pathsep) if p.strip()]
    site = config.current()
    out += [(site.where("tuning"), p) for p in site.tuning]
    return out


# -- the file ------------------------------------------------------------------------------


def read_table(path: str, origin: str) -> tuple[TuningTable | None, list[Finding]]:
    """Parse one table; a malformed file is (None, one finding), a malformed entry one finding each."""
    where = f"tuning table {path}"
    fix = "regenerate it with vllm-ir tune, or remove it from " + origin.split(",")[0]
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as exc:
        return None, [Finding(where, f"{where} ({origin}): cannot read it ({exc.strerror or exc}); ignored", fix)]
    except ValueError as exc:
        return None, [Finding(where, f"{where} ({origin}): not valid JSON ({exc}); the file is ignored", fix)]
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        got = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        return None, [
            Finding(where, f"{where} ({origin}): schema is {got!r}, not {SCHEMA!r}; the file is ignored", fix)
        ]
    machine = doc.get("machine")
    if not isinstance(machine, dict) or not isinstance(machine.get("platform"), str):
        return None, [Finding(where, f"{where} ({origin}): 'machine' must name the platform; the file is ignored", fix)]
    raw_entries = doc.get("entries")
    if not isinstance(raw_entries, list):
        return None, [Finding(where, f"{where} ({origin}): 'entries' must be a list; the file is ignored", fix)]
    findings: list[Finding] = []
    entries: list[TuningEntry] = []
    for i, raw in enumerate(raw_entries):
        try:
            entries.append(_entry(raw, path, i))
        except ValueError as exc:
            name = raw.get("op") if isinstance(raw, dict) else None
            label = f"entry {i}" + (f" ({name})" if isinstance(name, str) else "")
            findings.append(Finding(where, f"{where} ({origin}), {label}: {exc}; the entry is ignored", fix))
    seen: dict[tuple[str, str, str], list[TuningEntry]] = {}
    kept = []
    for e in entries:
        overlap = [o for o in seen.get((e.mode, e.op, e.dtype), []) if _overlaps(o, e)]
        if overlap:
            findings.append(
                Finding(
                    where,
                    f"{where} ({origin}), entry {e.index} ({e.op}): {e.range_text()} overlaps entry "
                    f"{overlap[0].index}; the entry is ignored",
                    fix,
                )
            )
            continue
        seen.setdefault((e.mode, e.op, e.dtype), []).append(e)
        kept.append(e)
    measured = doc.get("measured") if isinstance(doc.get("measured"), str) else None
    return TuningTable(path, origin, dict(machine), measured, tuple(kept)), findings


def _overlaps(a: TuningEntry, b: TuningEntry) -> bool:
    a_high, b_high = a.high or 1 << MAX_BITS, b.high or 1 << MAX_BITS
    return a.low < b_high and b.low < a_high


def _power_of_two(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1 and value & (value - 1) == 0


def _entry(raw: Any, path: str, index: int) -> TuningEntry:
    if not isinstance(raw, dict):
        raise ValueError(f"expected an object, got {type(raw).__name__}")
    op_name = raw.get("op")
    if not isinstance(op_name, str) or not registry.has_op(op_name):
        known = ", ".join(sorted(o.name for o in registry.all_ops()))
        raise ValueError(f"unknown op {op_name!r}{env.did_you_mean(str(op_name), known.split(', '))}")
    mode = raw.get("mode", "eager")
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    dtype = raw.get("dtype")
    if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype name (e.g. 'bfloat16')")
    tokens = raw.get("tokens")
    if (
        not isinstance(tokens, list)
        or len(tokens) != 2
        or not _power_of_two(tokens[0])
        or not (tokens[1] is None or (_power_of_two(tokens[1]) and tokens[1] > tokens[0]))
    ):
        raise ValueError(f"tokens {tokens!r} must be [low, high) with powers of two, high > low or null")
    providers = raw.get("providers")
    op = registry.get_op(op_name)
    if not isinstance(providers, list) or not providers or not all(isinstance(p, str) for p in providers):
        raise ValueError(f"providers {providers!r} must be a non-empty list of provider names")
    known = {p for o in registry.all_ops() for p in o.impls} | set(registry.discovery().known_names())
    for p in providers:  # a table shared between machines may name providers absent here
        if p not in known and env.looks_like_typo(p, known):
            raise ValueError(f"unknown provider {p!r}; known providers of {op_name}: {', '.join(sorted(op.impls))}")
    measured = []
    figures = raw.get("measured", {})
    if not isinstance(figures, dict):
        raise ValueError("measured must map provider -> {us, spread_pct}")
    for p, fig in figures.items():
        if not isinstance(fig, dict) or not isinstance(fig.get("us"), (int, float)):
            raise ValueError(f"measured[{p!r}] must be {{'us': number, 'spread_pct': number}}")
        spread = fig.get("spread_pct")
        measured.append(Measurement(p, float(fig["us"]), float(spread) if isinstance(spread, (int, float)) else None))
    measured.sort(key=lambda m: m.us)
    hidden = raw.get("hidden") if isinstance(raw.get("hidden"), int) else None
    return TuningEntry(
        op_name, mode, dtype, tokens[0], tokens[1], tuple(providers), tuple(measured), path, index, hidden
    )


# -- machine facts ---------------------------------------------------------------------------


def machine_facts(platform_name: str, provider_versions: Mapping[str, str] | None = None) -> dict[str, Any]:
    """This machine's facts as a table records them (``vllm-ir tune`` writes these)."""
    facts: dict[str, Any] = {"platform": platform_name}
    if platform_name in ("cuda", "rocm") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts["device"] = props.name
        facts["isa"] = getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}"
    else:
        facts["device"] = cpu_model()
        facts["isa"] = torch.backends.cpu.get_cpu_capability()
        facts["cpus"] = os.cpu_count()
    facts["torch"] = torch.__version__
    if provider_versions is not None:
        facts["providers"] = dict(sorted(provider_versions.items()))
    return facts


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine()


def machine_mismatch(recorded: Mapping[str, Any], here: Mapping[str, Any]) -> str | None:
    """None when a table's machine facts hold here, else what differs (``isa AVX2, this machine AVX512``)."""
    if recorded.get("platform") != here.get("platform"):
        return f"platform {recorded.get('platform')}, this machine is {here.get('platform')}"
    if recorded.get("isa") is not None and recorded.get("isa") != here.get("isa"):
        return f"{recorded.get('platform')} {recorded.get('isa')}, this machine has {here.get('isa')}"
    gpu = here.get("platform") in ("cuda", "rocm")
    if gpu and recorded.get("device") is not None and recorded.get("device") != here.get("device"):
        return f"{recorded.get('device')}, this machine has {here.get('device')}"
    return None


def _version_mismatch(entry: TuningEntry, machine: Mapping[str, Any], installed: Mapping[str, str]) -> str | None:
    recorded = machine.get("providers")
    if not isinstance(recorded, dict):
        return None
    for p in entry.providers:
        then, now = recorded.get(p), installed.get(p)
        if then is not None and now and then != now:
            return f"measured with {p} {then}, {p} {now} is installed"
    return None


# -- lookups -------------------------------------------------------------------------------


def bucket_map(op_name: str, mode: str = "eager") -> bytes | None:
    """One byte per token-count bit length: the index of the range bucket; None when one bucket serves all T."""
    current = _layer
    if current is None:
        return None
    bounds = current.boundaries.get((mode, op_name))
    if bounds is None:
        return None
    out = bytes(bucket_of_bits(bounds, b) for b in range(MAX_BITS + 1))
    return None if len(set(out)) == 1 else out


def bucket_of_bits(bounds: Sequence[int], bits: int) -> int:
    """How many boundaries lie at or below a count of ``bits`` bits (0 counts as 1 token)."""
    return sum(1 for b in bounds if b.bit_length() <= max(bits, 1))


def dtype_param(op: IrOp) -> str | None:
    """The parameter whose dtype a table chooses by: the first activation, else the first tensor."""
    if op.activations:
        return op.activations[0]
    return next(iter(op.tensor_params), None)


def token_count(op: IrOp, args: Sequence[Any]) -> Any:
    """T of a call, as the decision key reads it (`cache_key.token_count`); 1 without a token tensor."""
    from vllm_ir.ir.dispatch.cache_key import token_count as count

    names = list(op.signature.parameters)
    found = count(*(args[names.index(p)] for p in op.token_params))
    return 1 if found is None else found


def choice(op: IrOp, args: Sequence[Any], mode: str) -> Choice:
    """The tuning entry for a call of ``op`` with ``args`` in ``mode`` (or why there is none)."""
    current = layer()
    per_dtype = current.entries.get((mode, op.name))
    if per_dtype is None:
        reasons = current.ignored.get(op.name)
        return Choice(None, note=f"tuning entries ignored: {'; '.join(reasons)}" if reasons else None)
    name = dtype_param(op)
    value = args[list(op.signature.parameters).index(name)] if name is not None else None
    dtype = str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else None
    group = per_dtype.get(dtype or "")
    if not group:
        return Choice(None, note=f"no tuning entry for {op.name} {dtype} ({mode})")
    tokens = token_count(op, args)
    if not isinstance(tokens, int):  # a dynamic token dimension under compile: one choice or none
        if all(e.providers == group[0].providers for e in group) and group[0].low == 1 and _contiguous(group):
            return Choice(group[0], _table_of(current, group[0]))
        return Choice(
            None,
            note=f"the token count is dynamic and the tuning table orders {op.name} {dtype} differently per range; "
            "the defaults decide (compile with a static token count to choose by range)",
        )
    for e in group:
        if e.covers(tokens):
            return Choice(e, _table_of(current, e))
    ignored = current.ignored.get(op.name)
    why = f"; entries ignored here: {'; '.join(ignored)}" if ignored else ""
    return Choice(None, note=f"T={tokens} is outside every tuning range of {op.name} {dtype}{why}")


def _contiguous(group: Sequence[TuningEntry]) -> bool:
    return all(a.high == b.low for a, b in itertools.pairwise(group)) and group[-1].high is None


def _table_of(current: _Layer, entry: TuningEntry) -> TuningTable:
    return next(t for t in current.tables if t.path == entry.path)


def context(op: IrOp, args: Sequence[Any], mode: str) -> Choice | None:
    """`choice` for ops a table mentions in ``mode``, else None (most ops: no work at all)."""
    current = layer()
    if (mode, op.name) not in current.entries:
        return None
    return choice(op, args, mode)


def mentions(op_name: str, mode: str = "eager") -> bool:
    """Whether an entry in force orders ``op_name``'s providers in ``mode`` (per dtype and range)."""
    return (mode, op_name) in layer().entries


def tables() -> list[TuningTable]:
    """Every table read (whether or not its facts hold here)."""
    return list(layer().tables)


def applied_entries(mode: str | None = None) -> Iterable[TuningEntry]:
    for (m, _op), per_dtype in layer().entries.items():
        if mode is None or m == mode:
            for group in per_dtype.values():
                yield from group
