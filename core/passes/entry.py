"""Wiring the passes into Inductor and other back-ends: `inductor_options`, `compile`, chaining.

Stages (Inductor config key -> passes, in order):

* ``pre_grad_custom_pass``: the compiled frame is made to guard on the compile-mode priority
  (`ChainedPass` with ``guard_priority``), then `FunctionalizeInplacePass`, then the user's
  pre-grad passes (they see the functional graph). Our options run this stage *before*
  Inductor's cache lookups (``pre_grad_pass_timing="early"``): an AOTAutograd cache hit skips
  a late pre-grad stage, and the frame would lose its guard.
* ``post_grad_custom_pre_pass``: the user's passes (IR ops are still single nodes: this is
  where IR-level passes go), then `IrPipelinePass` ``"pre"``: fusion, and lowering of the
  nodes whose implementation is functional -- Inductor's own post-grad passes then optimise
  that code like plain torch code.
* ``post_grad_custom_post_pass``: `IrPipelinePass` ``"post"``: lowering of in-place
  implementations (after Inductor's ``remove_noop_ops``, which would delete the clones that
  protect their inputs), clone cleanup; then the user's passes.

A user's pass is taken from the options given, else from ``torch._inductor.config`` at the
time of the call, and chained with ours; the chain's uuid combines every member's uuid
(``None`` if any member has none, which turns Inductor's cache off, as it would for that
pass alone).

Other back-ends (`compile` with ``backend="aot_eager"`` or a callable): the same passes run
around AOTAutograd, which they need for the functional aten graph with fake values that
fusion, lowering and clone cleanup work on. `PipelineBackend` guards and functionalizes
Dynamo's graph, has AOTAutograd trace it (input mutations kept in the graph, as Inductor
does), runs fusion, lowering and clone cleanup on each forward graph, then hands the graph
to the back-end's compiler: ``aot_eager`` runs it as is; a callable gets it as a
``fw_compiler``/``bw_compiler`` of ``torch._dynamo.backends.common.aot_autograd`` would.
"""

from __future__ import annotations

import functools
import pickle
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import torch
from torch import fx
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

try:
    from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass

    _INFERENCE_AWARE: tuple[type, ...] = (CustomInferenceAwareGraphPass,)
except ImportError:  # torch <= 2.11: Inductor calls every custom pass with the graph only
    CustomInferenceAwareGraphPass = CustomGraphPass  # type: ignore[misc,assignment]
    _INFERENCE_AWARE = ()

from vllm_ir.passes import cache
from vllm_ir.passes.clone_cleanup import CloneCleanupPass
from vllm_ir.passes.collective_fusion import collective_counts
from vllm_ir.passes.functionalize import FunctionalizeInplacePass
from vllm_ir.passes.fusion import FusionPass, GraphFusion, IrFusion
from vllm_ir.passes.lowering import LoweringPass, OnUnlowered
from vllm_ir.passes.nodes import ir_nodes
from vllm_ir.passes.record import GraphReport, PipelineRecord, publish, reports_from_counters, set_last_selected
from vllm_ir.settings.log import get_logger

F = TypeVar("F", bound=Callable[..., Any])

PRE_GRAD = "pre_grad_custom_pass"
PRE_GRAD_TIMING = "pre_grad_pass_timing"
POST_PRE = "post_grad_custom_pre_pass"
POST_POST = "post_grad_custom_post_pass"
_RECORD_ATTR = "_vllm_ir_record"

log = get_logger("passes")


class IrPipelinePass(CustomInferenceAwareGraphPass):
    """Fusion, lowering and clone cleanup on one post-grad graph, reported to a `PipelineRecord`.

    Two instances share the work on a graph. ``stage="pre"`` (``post_grad_custom_pre_pass``)
    fuses and lowers functional implementations, so Inductor's own post-grad passes optimise
    their code as they would plain torch code. ``stage="post"`` (``post_grad_custom_post_pass``,
    after Inductor's ``remove_noop_ops``, which would drop the clones) lowers the in-place
    implementations, removes the clones it can, and checks that no IR node is left. A post
    stage that finds its graph not seen by a pre stage does all of it.
    """

    def __init__(
        self,
        record: PipelineRecord,
        *,
        stage: Literal["pre", "post"] = "post",
        on_unlowered: OnUnlowered = "error",
        fusions: Sequence[IrFusion | GraphFusion] | None = None,
        keep_code: bool = True,
        shared: weakref.WeakKeyDictionary[fx.Graph, tuple[GraphReport, dict[str, int]]] | None = None,
    ):
        if stage not in ("pre", "post"):
            raise ValueError(f"stage must be 'pre' or 'post', got {stage!r}")
        self.record = record
        self.stage = stage
        self.fusion = FusionPass(fusions)
        self.lowering = LoweringPass(on_unlowered)
        self.cleanup = CloneCleanupPass()
        self.keep_code = keep_code
        #: Graph -> (its report, IR node order), handed from the pre to the post stage.
        self.shared = shared if shared is not None else weakref.WeakKeyDictionary()

    def __call__(self, graph: fx.Graph, is_inference: bool = True) -> None:
        if self.stage == "pre":
            if next(ir_nodes(graph), None) is None:
                return
            report = GraphReport()
            self._fuse(graph, report)
            order = {n.name: i for i, n in enumerate(ir_nodes(graph))}
            self.shared[graph] = (report, order)
            self._timed("lowering", self.lowering, graph, report, functional_only=True, order=order)
            return
        seen = self.shared.pop(graph, None)
        if seen is None:
            if next(ir_nodes(graph), None) is None:
                return  # nothing of ours in this graph (e.g. a piece without IR ops)
            report = GraphReport()
            self._fuse(graph, report)
            order = {n.name: i for i, n in enumerate(ir_nodes(graph))}
        else:
            report, order = seen
        self.record.graphs.append(report)
        self._timed("lowering", self.lowering, graph, report, order=order)
        self._timed("clone_cleanup", self.cleanup, graph, report)
        report.collectives = collective_counts(graph)
        if self.keep_code:
            report.code = graph.python_code("self").src
        publish(report)

    def _fuse(self, graph: fx.Graph, report: GraphReport) -> None:
        report.fusions_requested = [f.name for f in self.fusion.fusions]
        before = len(report.fusions)
        self._timed("fusion", self.fusion, graph, report)
        for done in report.fusions[before:]:
            log.debug("fusion %s", done)
        for why in report.fusions_rejected:
            log.debug("fusion rejected %s", why)

    def _timed(self, name: str, stage: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        try:
            stage(*args, **kwargs)
        finally:
            self.record.add_time(name, time.perf_counter() - start)

    def uuid(self) -> str | None:
        lowering = self.lowering.uuid()
        if lowering is None:
            return None  # see LoweringPass.uuid: caching is off for this compile
        parts = (self.fusion.uuid(), lowering)
        if self.stage == "post":
            parts += (self.cleanup.uuid(),)
        return cache.combine("pipeline", self.stage, parts)


class ChainedPass(CustomInferenceAwareGraphPass):
    """Several custom passes run in order as one, with a combined uuid.

    Inductor hands post-grad passes ``is_inference``; pre-grad passes are called with the
    graph only. Members that are inference-aware get the flag, others just the graph.

    :param guard_priority: first make the Dynamo frame being compiled guard on the
        compile-mode priority, when the graph has IR ops (`cache.install_priority_guard`):
        a later call under another priority -- after ``set_priority``, inside or after a
        ``priority()`` scope, in a thread with another scope -- then recompiles, or reuses
        the entry compiled for that priority. The pre-grad chain of `inductor_options` does.
    """

    def __init__(self, passes: Sequence[Any], name: str = "custom passes", *, guard_priority: bool = False):
        self.passes = tuple(passes)
        #: What the chain is for (the Inductor config key), in log messages.
        self.name = name
        self.guard_priority = guard_priority
        self._logged_uuid: str | None = None

    def __call__(self, graph: fx.Graph, is_inference: bool = True) -> None:
        if self.guard_priority:
            cache.install_priority_guard(graph)
        for p in self.passes:
            if isinstance(p, _INFERENCE_AWARE):
                p(graph, is_inference)
            else:
                p(graph)

    def __deepcopy__(self, memo: dict[int, Any]) -> ChainedPass:
        return self  # one chain, its records and caches shared: a copy would report to nobody

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled, a chain is its cache identity: ``uuid()`` (an uncacheable chain refuses).

        torch 2.11 leaves ``pre_grad_custom_pass`` in the config it hashes for its FX graph and
        AOTAutograd caches (newer torch leaves it out, or hashes its ``uuid()``), and pickles
        the pass object itself, records and logging state included: the key then changed on
        every compile and those caches never hit. A chain without a uuid fails to pickle,
        which torch turns into a cache bypass.
        """
        uid = self.uuid()
        if uid is None:
            raise pickle.PicklingError(f"{self.name}: a member has no uuid(), so the chain has no cache identity")
        return (_chain_identity, (uid,))

    def uuid(self) -> str | None:
        ids = []
        for p in self.passes:
            uid = p.uuid() if isinstance(p, CustomGraphPass) else None
            if uid is None:
                if self._logged_uuid != "":
                    self._logged_uuid = ""
                    log.debug("compile cache off for %s: %s has no uuid()", self.name, type(p).__name__)
                return None  # an uncacheable member makes the chain uncacheable
            ids.append(uid if isinstance(uid, (str, bytes, int)) else repr(uid))
        uid = cache.combine("chain", tuple(ids), "guard_priority" if self.guard_priority else "")
        if uid != self._logged_uuid:  # Inductor asks several times per compile: log changes only
            self._logged_uuid = uid
            log.debug(
                "compile cache uuid of %s: %s (from %s)",
                self.name,
                uid,
                ", ".join(f"{type(p).__name__}={i}" for p, i in zip(self.passes, ids, strict=True)),
            )
        return uid


def _chain_identity(uid: str) -> str:
    """What an unpickled `ChainedPass` becomes: its uuid (see `ChainedPass.__reduce__`)."""
    return uid


def _flatten(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, ChainedPass):
        return list(value.passes)
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _flatten(v)]
    return [value]


def inductor_options(
    *,
    on_unlowered: OnUnlowered = "error",
    fusions: Sequence[IrFusion | GraphFusion] | None = None,
    **user_options: Any,
) -> dict[str, Any]:
    """Inductor options that run the vllm-ir pipeline: ``torch.compile(model, options=...)``.

    :param on_unlowered: ``"error"`` (default) fails the compile when an IR node cannot be
        lowered; ``"warn"`` keeps such nodes as opaque calls and warns with the node list.
    :param fusions: IR fusions to run (default: `AddRmsNormFusion`, then `QuantFusion`); ``[]`` disables fusion.
        The tensor-parallel passes (sequence parallelism, all-reduce + RMSNorm fusion) are off
        by default: ``fusions=vllm_ir.passes.tensor_parallel_fusions(sequence_parallel=True)``.
    :param user_options: any other Inductor options; custom passes among them (or already
        set in ``torch._inductor.config``) are chained with ours, not replaced.
        ``pre_grad_pass_timing`` is always ``"early"``: the pre-grad stage installs the
        priority guard, which a frame served from Inductor's caches must get too.

    Example::

        options = vllm_ir.inductor_options(max_autotune=True)
        compiled = torch.compile(model, options=options)
        compiled(x)
        vllm_ir.passes.record_of(options).selected_impls   # {op: {node: provider}}
    """
    record = PipelineRecord()
    options = dict(user_options)
    timing = options.pop(PRE_GRAD_TIMING, "early")
    if timing not in ("early", "default"):
        raise ValueError(
            f"{PRE_GRAD_TIMING}={timing!r}: vllm-ir's pre-grad passes must run before Inductor's cache "
            'lookup ("early"), so that a compiled frame served from the cache still guards on the priority'
        )
    if hasattr(inductor_config, PRE_GRAD_TIMING):  # older torch ran pre-grad passes before its caches anyway
        options[PRE_GRAD_TIMING] = "early"
    shared: weakref.WeakKeyDictionary[fx.Graph, tuple[GraphReport, dict[str, int]]] = weakref.WeakKeyDictionary()
    stage = {
        name: IrPipelinePass(record, stage=name, on_unlowered=on_unlowered, fusions=fusions, shared=shared)
        for name in ("pre", "post")
    }
    user = {key: _flatten(options.get(key, getattr(inductor_config, key))) for key in (PRE_GRAD, POST_PRE, POST_POST)}
    options[PRE_GRAD] = ChainedPass([FunctionalizeInplacePass(record), *user[PRE_GRAD]], PRE_GRAD, guard_priority=True)
    options[POST_PRE] = ChainedPass([*user[POST_PRE], stage["pre"]], POST_PRE)
    options[POST_POST] = ChainedPass([stage["post"], *user[POST_POST]], POST_POST)
    setattr(options[POST_POST], _RECORD_ATTR, record)
    return options


try:
    from torch import _TorchCompileInductorWrapper as _InductorBackend
except ImportError:  # pragma: no cover - torch without the wrapper class
    _InductorBackend = None  # type: ignore[assignment,misc]


if _InductorBackend is not None:

    class _RecordingInductor(_InductorBackend):  # type: ignore[misc,valid-type]
        """``torch.compile``'s own Inductor backend, plus: a graph served from Inductor's cache gets
        the report stored by the compile that filled the cache entry."""

        def __init__(self, mode: str | None, options: dict[str, Any], dynamic: bool | None):
            super().__init__(mode, options, dynamic)
            self.record = record_of(options)

        def __call__(self, model_: Any, inputs_: Any, **kwargs: Any) -> Any:
            from torch._dynamo.utils import counters

            lowered = len(self.record.graphs)
            before = counters["inductor"].copy()
            compiled = super().__call__(model_, inputs_, **kwargs)
            if len(self.record.graphs) == lowered:  # none of our passes ran: a cache hit (or no IR op)
                for report in reports_from_counters(counters["inductor"] - before):
                    log.debug("graph served from Inductor's cache; selected: %s", report.selected_impls)
                    self.record.graphs.append(report)
                    set_last_selected(report.selected_impls)
            return compiled


#: Back-ends `compile` accepts by name (a callable back-end is accepted too).
BACKENDS = ("inductor", "aot_eager")


class PipelineBackend:
    """A Dynamo back-end: vllm-ir's passes in front of a compiler other than Inductor.

    ``compiler(gm, example_inputs) -> callable`` receives each graph AOTAutograd produces
    (the forward one fused, lowered and cleaned; the backward one as is -- it has no IR ops:
    their autograd formula is native's, traced to aten), exactly like a ``fw_compiler`` /
    ``bw_compiler`` of ``torch._dynamo.backends.common.aot_autograd``. The callable it returns
    is called with the inputs unpacked, or with one list if it has ``_boxed_call = True``.
    """

    def __init__(
        self,
        compiler: Callable[..., Any],
        record: PipelineRecord,
        *,
        on_unlowered: OnUnlowered = "error",
        fusions: Sequence[IrFusion | GraphFusion] | None = None,
        partition_fn: Callable[..., Any] | None = None,
    ):
        from torch._dynamo.backends.common import aot_autograd

        self.compiler = compiler
        self.record = record
        self.functionalize = FunctionalizeInplacePass(record)
        self.pipeline = IrPipelinePass(record, stage="post", on_unlowered=on_unlowered, fusions=fusions)
        extra = {"partition_fn": partition_fn} if partition_fn is not None else {}
        self._aot = aot_autograd(
            fw_compiler=functools.partial(self._compile, is_inference=False),
            bw_compiler=functools.partial(self._compile, is_inference=False),
            inference_compiler=functools.partial(self._compile, is_inference=True),
            keep_inference_input_mutations=True,
            **extra,
        )

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        cache.install_priority_guard(gm)
        self.functionalize(gm.graph)
        gm.recompile()
        return self._aot(gm, example_inputs, **kwargs)

    def _compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], *, is_inference: bool) -> Any:
        self.pipeline(gm.graph, is_inference)
        gm.recompile()
        return self.compiler(gm, example_inputs)


def _backend(
    backend: str | Callable[..., Any],
    record: PipelineRecord,
    on_unlowered: OnUnlowered,
    fusions: Sequence[IrFusion | GraphFusion] | None,
) -> PipelineBackend:
    if backend == "aot_eager":
        from functorch.compile import min_cut_rematerialization_partition
        from torch._dynamo.backends.debugging import boxed_nop

        return PipelineBackend(
            boxed_nop,
            record,
            on_unlowered=on_unlowered,
            fusions=fusions,
            partition_fn=min_cut_rematerialization_partition,
        )
    if isinstance(backend, str) or not callable(backend):
        raise ValueError(
            f"vllm_ir.compile: backend={backend!r} is not supported; use one of {', '.join(map(repr, BACKENDS))} "
            "or a callable (gm, example_inputs) -> callable, which then compiles the lowered aten graphs. "
            "Other named back-ends run their own pipeline that the passes cannot enter "
            "(torch.compile(model, backend=...) without vllm-ir runs the IR ops through eager dispatch)"
        )
    return PipelineBackend(backend, record, on_unlowered=on_unlowered, fusions=fusions)


def compile(
    model: Callable[..., Any] | None = None,
    *,
    options: dict[str, Any] | None = None,
    mode: str | None = None,
    dynamic: bool | None = None,
    backend: str | Callable[..., Any] = "inductor",
    on_unlowered: OnUnlowered = "error",
    fusions: Sequence[IrFusion | GraphFusion] | None = None,
    **torch_compile_kwargs: Any,
) -> Any:
    """``torch.compile`` with the vllm-ir pipeline; usable as ``@vllm_ir.compile`` or ``@vllm_ir.compile(...)``.

    Takes ``torch.compile``'s arguments (``mode`` and ``options`` may be combined; both are
    Inductor's). The record of what the passes did is `record_of(compiled)`; unlike plain
    ``torch.compile`` with `inductor_options`, it also covers graphs served from Inductor's cache.

    :param backend: ``"inductor"`` (default: the passes run inside Inductor),
        ``"aot_eager"`` (AOTAutograd, the passes, then the graph runs as is -- no code
        generation; for debugging or where Inductor is unavailable), or a callable
        ``(gm, example_inputs) -> callable`` that compiles each graph AOTAutograd produces
        after the passes (see `PipelineBackend`). Other names are refused.

    A compiled call always runs the kernels the current compile-mode priority picks: Dynamo
    guards every frame with IR ops on that priority, so ``set_priority(...)`` or a
    ``priority(...)`` scope recompiles once per distinct priority (Dynamo keeps up to
    ``torch._dynamo.config.recompile_limit`` entries per frame, then runs it eagerly, which
    dispatches by priority too). Calls under an unchanged priority never recompile for it.
    """
    if model is None:

        def decorator(fn: F) -> F:
            return compile(
                fn,
                options=options,
                mode=mode,
                dynamic=dynamic,
                backend=backend,
                on_unlowered=on_unlowered,
                fusions=fusions,
                **torch_compile_kwargs,
            )

        return decorator
    if backend != "inductor":
        if options or mode is not None:
            raise ValueError(f"vllm_ir.compile: options= and mode= are Inductor's; backend={backend!r} takes neither")
        record = PipelineRecord()
        compiled = torch.compile(
            model, backend=_backend(backend, record, on_unlowered, fusions), dynamic=dynamic, **torch_compile_kwargs
        )
        object.__setattr__(compiled, _RECORD_ATTR, record)
        return compiled
    opts = inductor_options(on_unlowered=on_unlowered, fusions=fusions, **(options or {}))
    if _InductorBackend is not None:
        backend_obj = _RecordingInductor(mode, opts, dynamic)
        compiled = torch.compile(model, backend=backend_obj, dynamic=dynamic, **torch_compile_kwargs)
    else:  # pragma: no cover
        base = dict(torch._inductor.list_mode_options(mode, dynamic)) if mode else {}
        compiled = torch.compile(model, options={**base, **opts}, dynamic=dynamic, **torch_compile_kwargs)
    object.__setattr__(compiled, _RECORD_ATTR, record_of(opts))
    return compiled


def record_of(obj: Any) -> PipelineRecord:
    """The `PipelineRecord` of options from `inductor_options` or of a model from `compile`."""
    if isinstance(obj, dict):
        chain = obj.get(POST_POST)
        record = getattr(chain, _RECORD_ATTR, None)
    else:
        record = getattr(obj, _RECORD_ATTR, None)
    if record is None:
        raise ValueError("not options from vllm_ir.inductor_options() nor a model from vllm_ir.compile()")
    record.settle()
    return record
