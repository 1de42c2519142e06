"""Post-grad lowering: every IR node becomes the implementation dispatch picks for it.

Selection is `vllm_ir.ir.dispatch.selection.decide` in ``"compile"`` mode on the node's fake values,
with the priority scope active at compile time: the same function eager dispatch uses, so
eager and compiled runs agree on the kernel. The implementation is traced with ``make_fx``
(Inductor's decompositions) into the graph through the pattern matcher's
``replace_with_graph``; a torch custom op it calls stays one opaque node. An in-place
implementation is traced behind clones of its activations, which keeps the graph's
functional meaning; `CloneCleanupPass` removes the clones that provably are not needed.

Tracing costs ~10 ms per node; the nodes of a model's layers repeat the same call (same
implementation, argument metadata and scalars), so one graph's lowering traces each distinct
call once and copies the traced code for the repeats, with fresh fake values (`_TraceCache`).

Functional implementations are lowered in ``post_grad_custom_pre_pass``, so Inductor's own
post-grad passes (e.g. folding the residual add into ``addmm``) see their code exactly as
they see plain torch code. In-place implementations are lowered in
``post_grad_custom_post_pass``: after Inductor's ``remove_noop_ops``, which treats every
``aten.clone`` as removable in a functional graph and would drop the protecting clones.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import (
    CallFunctionVarArgs,
    Match,
    PatternMatcherPass,
    register_graph_pattern,
    select_decomp_table,
)
from torch.fx.experimental.proxy_tensor import make_fx

from vllm_ir.errors import KernelResultError
from vllm_ir.ir import priority as _priority
from vllm_ir.ir import results
from vllm_ir.ir.dispatch import fallback as _fallback
from vllm_ir.ir.dispatch import selection as _selection
from vllm_ir.ir.op import IrOp
from vllm_ir.passes import cache
from vllm_ir.passes.errors import LoweringError, UnloweredWarning
from vllm_ir.passes.nodes import bound_args, donated_params, fake_args, ir_nodes, ir_op_of, ir_target
from vllm_ir.passes.record import GraphReport, module_path, set_last_selected
from vllm_ir.settings.log import get_logger

OnUnlowered = Literal["error", "warn"]

#: ``node.meta`` key on the clones lowering inserts; read (and dropped) by clone cleanup.
CLONE_META = "vllm_ir_clone"

log = get_logger("passes")


def trace_impl(fn: Callable[..., Any], args: tuple[Any, ...]) -> fx.GraphModule:
    """Trace ``fn`` on fake ``args`` into an aten graph with Inductor's decompositions.

    Unlike Inductor's ``fwd_only`` no "functional" clean-up runs: it would drop the clones
    that protect the activations of an in-place implementation.
    """
    mode = torch._guards.detect_fake_mode(args)
    ctx = mode if mode is not None else contextlib.nullcontext()
    with ctx, enable_python_dispatcher():
        gm = make_fx(fn, select_decomp_table(), tracing_mode="real")(*args)
        _rewrite_out_variants(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


class _TraceCache:
    """Traced implementations of one graph's lowering, by call signature.

    The key is everything tracing can see: the implementation (and whether it runs behind
    clones), each tensor argument's dtype, device, layout, shape, strides, storage offset and
    ``requires_grad`` (symbolic sizes by expression), which arguments are the same value, and
    every other argument's value. A hit copies the traced code; its nodes then get fake values
    of their own (`refresh_values`), so no two nodes share one fake tensor -- Inductor's passes
    read aliasing from the fake values' storages.
    """

    def __init__(self) -> None:
        self.graphs: dict[tuple, fx.GraphModule] = {}
        self.hits = 0

    @staticmethod
    def key(impl: Any, cloned: bool, args: tuple[Any, ...], fakes: tuple[Any, ...]) -> tuple | None:
        parts: list[object] = [id(impl), id(impl.fn), cloned]
        firsts: dict[int, int] = {}
        for i, (arg, fake) in enumerate(zip(args, fakes, strict=True)):
            if isinstance(arg, fx.Node):
                parts.append(firsts.setdefault(id(arg), i))
            described = _describe(fake)
            if described is None:
                return None  # something we cannot key on: trace it afresh
            parts.append(described)
        return tuple(parts)


def _describe(value: Any) -> object | None:
    if isinstance(value, torch.Tensor):
        return (
            "tensor",
            value.dtype,
            value.device,
            value.layout,
            str(tuple(value.shape)),
            str(value.stride()) if value.layout == torch.strided else None,
            str(value.storage_offset()) if value.layout == torch.strided else None,
            value.requires_grad,
        )
    if isinstance(value, (list, tuple)):
        items = [_describe(v) for v in value]
        return None if any(i is None for i in items) else (type(value).__name__, *items)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return (type(value).__name__, repr(value))
    return None  # SymInts, SymFloats and anything else: no cache


def _result_problem(op: IrOp, impl: Any, gm: fx.GraphModule, node: fx.Node) -> str | None:
    """Why the traced kernel's result is not the kind the IR node's is (`vllm_ir.ir.results`), or None."""
    (out,) = (n.args[0] for n in gm.graph.nodes if n.op == "output")
    traced = pytree.tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, out)
    if isinstance(traced, (list, tuple)) and len(traced) == 1 and isinstance(node.meta.get("val"), torch.Tensor):
        traced = traced[0]  # make_fx flattens a lone tensor result into a 1-tuple
    try:
        results.check_traced(op, impl, traced, node.meta.get("val"))
    except KernelResultError as exc:
        return str(exc)
    return None


def _replayable(gm: fx.GraphModule) -> bool:
    """Whether `refresh_values` can recompute every node: aten/custom op overloads and ``getitem``
    only (higher-order ops, e.g. Triton kernel wrappers, and submodules are traced each time)."""
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op != "call_function":
            return False
        if not (isinstance(node.target, torch._ops.OpOverload) or node.target is operator.getitem):
            return False
    return True


def refresh_values(nodes: list[fx.Node], fake_mode: Any) -> None:
    """Give ``nodes`` (copied from a traced graph) fake values computed from their own inputs."""
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
    with ctx, enable_python_dispatcher():
        for node in nodes:
            if node.op != "call_function":
                continue
            args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], (node.args, node.kwargs))
            val = node.target(*args, **kwargs)
            node.meta["val"] = val
            if isinstance(val, torch.Tensor) and "tensor_meta" in node.meta:
                node.meta["tensor_meta"] = _extract_tensor_metadata(val)


def _rewrite_out_variants(graph: fx.Graph) -> None:
    """``op.out(..., out=o)`` -> ``o.copy_(op(...))``: Inductor cannot compile ``out=`` overloads."""
    for node in list(graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if not is_out_overload(target):
            continue
        twin = _functional_twin(target)
        out_names = [a.name for a in target._schema.arguments if a.is_out]
        if twin is None or len(out_names) != 1 or out_names[0] not in node.kwargs:
            raise NotImplementedError(f"the implementation calls {target}, an out= overload Inductor cannot compile")
        kwargs = {k: v for k, v in node.kwargs.items() if k != out_names[0]}
        with graph.inserting_before(node):
            result = graph.call_function(twin, node.args, kwargs)
            copied = graph.call_function(torch.ops.aten.copy_.default, (node.kwargs[out_names[0]], result))
        copied.meta.update(node.meta)
        result.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        if isinstance(node.meta.get("val"), torch.Tensor):
            result.meta["val"] = node.meta["val"].clone()  # a fresh value, not the out= tensor
        node.replace_all_uses_with(copied)
        graph.erase_node(node)


_HAS_OUT_TAG = hasattr(torch.Tag, "out")


def is_out_overload(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` is an ``out=`` overload (``mul.out``): it writes into ``out`` arguments.

    Newer torch (2.13) tags these ``torch.Tag.out`` (``torch._library.utils.is_out``); torch
    2.11 has neither the tag nor the helper (calling it failed every lowering there), and the
    schema says the same: an ``out`` overload has keyword-only ``Tensor(a!)`` arguments whose
    ``Argument.is_out`` is true. Under torch 2.13 both answers agree for every registered op.
    """
    if _HAS_OUT_TAG:
        return torch.Tag.out in op.tags
    return any(a.is_out for a in op._schema.arguments)


def _functional_twin(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The overload of the same op with the same inputs and no ``out`` (``mul.out`` -> ``mul.Tensor``)."""
    inputs = [(a.name, str(a.type)) for a in op._schema.arguments if not a.is_out]
    packet = op.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        schema = candidate._schema
        if schema.is_mutable or len(schema.returns) != 1:
            continue
        if [(a.name, str(a.type)) for a in schema.arguments] == inputs:
            return candidate
    return None


def replace_with_graph(match: Match, gm: fx.GraphModule, args: list[Any]) -> list[fx.Node]:
    """``match.replace_with_graph(gm, args)`` for a one-node match, returning the nodes it added.

    Newer torch (2.13) returns the added nodes, dead ones already erased. torch 2.11 returns
    ``None`` (which failed the lowering of every in-place implementation and every cache hit):
    there the added nodes are found in the graph -- the pattern matcher inserts them, in order,
    right before the matched node, which it then erases with its ``getitem`` users -- and the
    dead ones are erased as newer torch does.
    """
    (node,) = match.nodes
    graph = node.graph
    before = node.prev
    stop = node.next
    while stop.op != "root" and stop.target is operator.getitem and stop.args[0] is node:
        stop = stop.next  # the matcher may erase these; the first node after them stays
    added = match.replace_with_graph(gm, args)
    if added is not None:
        return list(added)
    added = []
    current = before.next
    while current is not stop:
        if current.op == "root":
            raise AssertionError(f"lost the nodes replacing {node.name!r} in the graph")
        added.append(current)
        current = current.next
    for n in reversed(added):
        if not n.users and not n.is_impure() and not isinstance(n.target, torch._ops.HigherOrderOperator):
            graph.erase_node(n)
    return [n for n in added if not n._erased]


class LoweringPass(CustomGraphPass):
    """Replace IR nodes by their selected implementations (see module docstring).

    :param on_unlowered: ``"error"`` raises `LoweringError` listing every node that could not
        be lowered; ``"warn"`` leaves them as opaque calls (they then dispatch eagerly at run
        time) and warns with the list.
    """

    def __init__(self, on_unlowered: OnUnlowered = "error"):
        if on_unlowered not in ("error", "warn"):
            raise ValueError(f"on_unlowered must be 'error' or 'warn', got {on_unlowered!r}")
        self.on_unlowered = on_unlowered
        self._matcher = PatternMatcherPass(pass_name="vllm_ir_lowering")
        self._registered: set[torch._ops.OpOverload] = set()
        self._state: _LoweringState | None = None

    def uuid(self) -> str | None:
        """Priorities, candidate code and compile facts in effect now (None: a provider's facts are unreadable)."""
        scope = _priority.current_scope()
        facts = cache.facts_fingerprint("compile", scope)
        if facts is None:
            return None
        return cache.combine(
            "lowering",
            self.on_unlowered,
            cache.package_fingerprint(),
            cache.priority_fingerprint("compile", scope),
            facts,
        )

    def __call__(
        self,
        graph: fx.Graph,
        report: GraphReport | None = None,
        *,
        functional_only: bool = False,
        order: dict[str, int] | None = None,
    ) -> None:
        """Lower the IR nodes of ``graph``, adding the selections to ``report``.

        :param functional_only: lower only nodes whose implementation is not in-place and
            leave the rest (and any failure) to a later call; see `IrPipelinePass`.
        :param order: node name -> position, to list ``selected_impls`` in graph order across calls.
        """
        report = report if report is not None else GraphReport()
        nodes = list(ir_nodes(graph))
        for node in nodes:
            path = module_path(node.meta)
            if path is not None:
                report.modules.setdefault(node.name, path)
        order = order if order is not None else {n.name: i for i, n in enumerate(nodes)}
        state = _LoweringState(_priority.current_scope(), functional_only)
        if nodes:
            self._state = state
            try:
                self._matcher_for(nodes).apply(graph)
            finally:
                self._state = None
        selected = [(op, name, p) for op, by_node in report.selected_impls.items() for name, p in by_node.items()]
        selected += [(op_name, node.name, p) for (op_name, node), p in state.selected.items()]
        selected.sort(key=lambda entry: order.get(entry[1], len(order)))
        report.selected_impls = {}
        for op_name, name, provider in selected:
            report.selected_impls.setdefault(op_name, {})[name] = provider
        if functional_only:
            return
        set_last_selected(report.selected_impls)
        # Unknown ``vllm_ir`` ops (no registered IrOp) never match a pattern.
        for node in ir_nodes(graph):
            if node not in state.failed:
                self._failed(
                    state,
                    node,
                    "not a registered vllm-ir op"
                    if ir_op_of(node) is None
                    else "skipped by the pattern matcher (unsupported tensor type?)",
                )
        if state.failed:
            self._fail(state.failed, report)

    # -- internals -----------------------------------------------------------------------

    def _matcher_for(self, nodes: list[fx.Node]) -> PatternMatcherPass:
        """One ``CallFunctionVarArgs`` pattern per IR overload in the graph."""
        targets = {ir_target(n) for n in nodes if ir_op_of(n) is not None}
        new = targets - self._registered
        if new:
            register_graph_pattern(CallFunctionVarArgs(sorted(new, key=str)), pass_dict=self._matcher)(self._lower)
            self._registered |= new
        return self._matcher

    def _lower(self, match: Match, *_args: Any, **_kwargs: Any) -> None:
        state = self._state
        assert state is not None and len(match.nodes) == 1
        node = match.nodes[0]
        op = ir_op_of(node)
        assert op is not None
        try:
            decision, fn, args = self._select(op, node, state.scope)
        except Exception as exc:  # every failure is reported with its node, never silently
            self._failed(state, node, f"selecting an implementation failed: {type(exc).__name__}: {exc}")
            return
        impl = decision.impl
        if state.functional_only and impl.inplace:
            log.debug(
                "lowering %s (%s): in-place provider %r waits for the post stage", node.name, op.name, impl.provider
            )
            return  # lowered after Inductor's remove_noop_ops, which would drop its clones
        fakes = fake_args(args)
        key = _TraceCache.key(impl, fn is not impl.fn, args, fakes)
        gm = state.traces.graphs.get(key) if key is not None else None
        cached = gm is not None
        if gm is None:
            try:
                gm = trace_impl(fn, fakes)
            except Exception as exc:
                self._failed(state, node, f"tracing provider {impl.provider!r} failed: {type(exc).__name__}: {exc}")
                return
            problem = _result_problem(op, impl, gm, node)
            if problem is not None:
                self._failed(state, node, problem)
                return
            if key is not None and _replayable(gm):
                state.traces.graphs[key] = gm
        state.selected[(op.name, node)] = impl.provider
        if log.isEnabledFor(logging.DEBUG):
            skipped = "; ".join(f"{p}: {reason}" for p, reason in decision.skipped) or "none"
            log.debug(
                "lowering %s (%s): chose %r%s; skipped providers: %s",
                node.name,
                op.name,
                impl.provider,
                " (in place, behind clones of its activations)" if impl.inplace else "",
                skipped,
            )
        name, donated = node.name, donated_params(node)
        added = replace_with_graph(match, gm, list(args))
        if cached:
            state.traces.hits += 1
            refresh_values(added, torch._guards.detect_fake_mode(fakes))
        if impl.inplace:
            _tag_clones(op, name, args, donated, added)

    @staticmethod
    def _failed(state: _LoweringState, node: fx.Node, reason: str) -> None:
        log.debug("lowering %s (%s): not lowered: %s", node.name, ir_target(node), reason)
        state.failed[node] = reason

    def _select(
        self, op: IrOp, node: fx.Node, scope: Any
    ) -> tuple[_selection.Decision, Callable[..., Any], tuple[Any, ...]]:
        args = bound_args(op, node)
        decision = _selection.decide(op, fake_args(args), "compile", scope)
        if decision.skipped:
            _fallback.apply(op, decision)
        impl = decision.impl
        fn = impl.fn
        if impl.inplace and op.activation_indices:
            fn = _selection.on_copies(fn, op.activation_indices)
        return decision, fn, args

    def _fail(self, failed: dict[fx.Node, str], report: GraphReport) -> None:
        lines = [f"  {node.name} ({ir_target(node)}): {reason}" for node, reason in failed.items()]
        if self.on_unlowered == "warn":
            report.unlowered.update({node.name: reason for node, reason in failed.items()})
            warnings.warn(
                f"vllm-ir: {len(failed)} IR node(s) left unlowered; they run through eager dispatch:\n"
                + "\n".join(lines),
                UnloweredWarning,
                stacklevel=2,
            )
            return
        raise LoweringError(
            f"vllm-ir could not lower {len(failed)} IR node(s):\n"
            + "\n".join(lines)
            + "\n(pass on_unlowered='warn' to vllm_ir.inductor_options() to keep them as opaque calls)"
        )


class _LoweringState:
    def __init__(self, scope: Any, functional_only: bool):
        self.scope = scope
        self.functional_only = functional_only
        self.selected: dict[tuple[str, fx.Node], str] = {}
        self.failed: dict[fx.Node, str] = {}
        self.traces = _TraceCache()


def _tag_clones(op: IrOp, ir_node: str, args: tuple[Any, ...], donated: tuple[str, ...], added: list[fx.Node]) -> None:
    """Mark the clones ``on_copies`` put in front of an in-place kernel (the first clone of each activation)."""
    clone = torch.ops.aten.clone.default
    for param, index in zip(op.activations, op.activation_indices, strict=True):
        source = args[index]
        if not isinstance(source, fx.Node):
            continue
        for node in added:
            if node.target is clone and node.args[0] is source and CLONE_META not in node.meta:
                node.meta[CLONE_META] = {"op": op.name, "ir_node": ir_node, "param": param, "donated": param in donated}
                break
