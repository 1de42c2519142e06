"""What the pipeline did, kept for the user: selected kernels, donations, clones, timings.

A `PipelineRecord` belongs to one set of options (one ``inductor_options()`` call); every
graph lowered with them adds a report. A graph served from Inductor's FX graph cache runs
none of our passes: the report of the compile that filled the cache entry is stored next to
it (``<cache dir>/vllm_ir_reports``) and named in the Inductor counters the cache replays:
`vllm_ir.passes.compile` finds it again at once (``from_cache=True``), and with plain
``torch.compile(options=inductor_options())`` `record_of` finds it when it is read (`PipelineRecord.settle`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import weakref
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_ir.passes.functionalize import FunctionalizeReport

#: {op_name: {node_name: provider}}
SelectedImpls = dict[str, dict[str, str]]


@dataclass
class CloneDecision:
    """A clone the lowering inserted in front of an in-place kernel, and what cleanup did with it."""

    node: str
    op: str
    ir_node: str
    param: str
    removed: bool
    reason: str


@dataclass
class GraphReport:
    """The post-grad passes' work on one graph."""

    selected_impls: SelectedImpls = field(default_factory=dict)
    fusions: list[str] = field(default_factory=list)
    #: Fusion candidates left unfused: ``"<fusion>: <nodes>: <reason>"``.
    fusions_rejected: list[str] = field(default_factory=list)
    clones: list[CloneDecision] = field(default_factory=list)
    #: IR nodes left in the graph (``on_unlowered="warn"``), with the reason.
    unlowered: dict[str, str] = field(default_factory=dict)
    #: Functional collectives in the graph after the pipeline, ``{kind: count}``
    #: (``all_reduce``, ``reduce_scatter_tensor``, ``all_gather_into_tensor``, ...).
    collectives: dict[str, int] = field(default_factory=dict)
    #: The graph after the pipeline (Inductor's own passes and codegen follow).
    code: str = ""
    #: True when the graph came from Inductor's cache and this report from the compile that filled it.
    from_cache: bool = False
    #: The fusions the options asked for, by name (those in ``fusions`` fired; the others did not).
    fusions_requested: list[str] = field(default_factory=list)
    #: IR node -> the module path it came from (``layers.0.mlp``), where the graph carries it.
    modules: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GraphReport:
        data = dict(data)
        data["clones"] = [CloneDecision(**c) for c in data.get("clones", [])]
        return cls(**data)

    @property
    def clones_removed(self) -> list[CloneDecision]:
        return [c for c in self.clones if c.removed]

    @property
    def clones_kept(self) -> list[CloneDecision]:
        return [c for c in self.clones if not c.removed]


@dataclass
class PipelineRecord:
    """Reports of every graph compiled with one set of vllm-ir options."""

    functionalized: list[FunctionalizeReport] = field(default_factory=list)
    graphs: list[GraphReport] = field(default_factory=list)
    #: Seconds spent in each pass, summed over graphs.
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    #: Compiles begun since the last `settle`: (Inductor's counters then, len(graphs) then).
    _begun: list[tuple[Any, int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        with _last_lock:
            _live.append(weakref.ref(self))
            _live[:] = [r for r in _live if r() is not None]

    @property
    def selected_impls(self) -> SelectedImpls:
        """``{op: {node: provider}}`` over every graph lowered (names prefixed ``g<i>.`` when several)."""
        if len(self.graphs) == 1:
            return {op: dict(nodes) for op, nodes in self.graphs[0].selected_impls.items()}
        out: SelectedImpls = {}
        for i, g in enumerate(self.graphs):
            for op, nodes in g.selected_impls.items():
                out.setdefault(op, {}).update({f"g{i}.{n}": p for n, p in nodes.items()})
        return out

    @property
    def pass_seconds(self) -> float:
        return sum(self.seconds.values())

    def add_functionalize(self, report: FunctionalizeReport, seconds: float) -> None:
        self.functionalized.append(report)
        self.seconds["functionalize"] += seconds
        self.begin_compile()

    def begin_compile(self) -> None:
        """A compile with these options began. Pre-grad passes run before Inductor's cache lookup,
        hit or miss; the post-grad ones only on a miss. So a compile that adds no report by the
        next `settle` was a cache hit, and the counters it replayed name the stored reports."""
        from torch._dynamo.utils import counters

        with _last_lock:
            self._begun.append((counters["inductor"].copy(), len(self.graphs)))

    def settle(self) -> None:
        """Add the stored reports of graphs served from Inductor's cache since `begin_compile`
        (plain ``torch.compile(options=inductor_options())``, which no back-end of ours wraps)."""
        from torch._dynamo.utils import counters

        with _last_lock:
            begun, self._begun = self._begun, []
            if not begun:
                return
            ends = [*begun[1:], (counters["inductor"].copy(), len(self.graphs))]
            found = []
            for (start, graphs_then), (end, graphs_after) in zip(begun, ends, strict=True):
                if graphs_after == graphs_then:  # none of our post-grad passes ran: a cache hit
                    found.append((graphs_then, reports_from_counters(end - start)))
            for at, reports in reversed(found):
                self.graphs[at:at] = reports
            if found and found[-1][1]:
                _set_last_selected_locked(found[-1][1][-1].selected_impls)

    def add_time(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds


_last_lock = threading.Lock()
_last_selected: SelectedImpls = {}
#: Every record alive, so that a trace can list the graphs compiled while it ran, by any route.
_live: list[weakref.ref[PipelineRecord]] = []


def live_records() -> list[PipelineRecord]:
    """The records alive now, oldest first."""
    with _last_lock:
        return [r for r in (ref() for ref in _live) if r is not None]


def module_path(meta: dict[str, Any]) -> str | None:
    """``layers.0.mlp``: the innermost module of a node's ``nn_module_stack``, as ``named_modules`` spells it."""
    stack = meta.get("nn_module_stack")
    if not stack:
        return None
    path = str(list(stack.values())[-1][0])
    for prefix in ("L['self'].", "L['self']", "L['mod'].", "L['model']."):
        if path.startswith(prefix):
            path = path[len(prefix) :]
            break
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    return path.removeprefix("._modules.").replace("._modules.", ".").strip(".")


def set_last_selected(selected: SelectedImpls) -> None:
    with _last_lock:
        _set_last_selected_locked(selected)


def _set_last_selected_locked(selected: SelectedImpls) -> None:
    global _last_selected
    _last_selected = {op: dict(nodes) for op, nodes in selected.items()}


def last_selected_impls() -> SelectedImpls:
    """``{op: {node: provider}}`` of the graph lowered most recently in this process."""
    with _last_lock:
        return {op: dict(nodes) for op, nodes in _last_selected.items()}


# -- reports of cached graphs ----------------------------------------------------------------

#: Prefix of the Inductor counter naming a stored report; Inductor replays counters on a cache hit.
COUNTER_PREFIX = "vllm_ir_report:"


def _reports_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "vllm_ir_reports"


def publish(report: GraphReport) -> None:
    """Store ``report`` for cache hits of this graph and name it in Inductor's counters."""
    from torch._dynamo.utils import counters
    from torch._inductor import config

    if not config.fx_graph_cache:
        return
    text = json.dumps(report.to_json(), sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:24]
    try:
        folder = _reports_dir()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{digest}.json"
        if not path.exists():
            tmp = folder / f".{digest}.{os.getpid()}.tmp"
            tmp.write_text(text)
            os.replace(tmp, path)
    except OSError:
        return  # no report on a later hit; the compiled graph itself is unaffected
    counters["inductor"][COUNTER_PREFIX + digest] += 1


def reports_from_counters(delta: dict[str, int]) -> list[GraphReport]:
    """The stored reports named by counters a cache hit replayed (``delta``: counters gained)."""
    out = []
    for key in sorted(delta):
        if not key.startswith(COUNTER_PREFIX) or delta[key] <= 0:
            continue
        path = _reports_dir() / f"{key[len(COUNTER_PREFIX) :]}.json"
        try:
            report = GraphReport.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            report = GraphReport(unlowered={"?": f"report {path} of this cached graph is missing"})
        report.from_cache = True
        out.append(report)
    return out
