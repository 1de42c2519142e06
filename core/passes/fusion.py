"""Post-grad fusion passes over IR ops, written once per op pattern and blind to kernels.

A fusion sees the functional graph before lowering: IR ops are still single nodes, so a
pattern names ``torch.ops.vllm_ir.<op>.default`` with the op's full argument list (the pass
normalizes every IR node to that form first) and never depends on which provider will run.
Patterns use Inductor's pattern matcher (``CallFunction`` trees); a fusion rewrites the
matched nodes in its `IrFusion.rewrite`.

The pattern fusion shipped here: ``s = x + residual; y = rms_norm(s, w, eps)`` becomes
``y, s = fused_add_rms_norm(x, residual, w, eps)``. In float32 the values are identical; in
lower precision the fused op normalizes the unrounded float32 sum (its documented
semantics), which differs from the rounded sum by at most the op's tolerance.

A `GraphFusion` walks the graph itself instead, so that it can also report the candidates it
leaves unfused and why (``GraphReport.fusions_rejected``): `QuantFusion`
(vllm_ir/passes/quant_fusion.py, norm / activation + FP8 quant) runs after the pattern fusions,
so it also sees the ``fused_add_rms_norm`` nodes they create.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import (
    MULTIPLE,
    CallFunction,
    KeywordArg,
    Match,
    PatternExpr,
    PatternMatcherPass,
    register_graph_pattern,
)

from vllm_ir.ir import registry
from vllm_ir.passes import cache
from vllm_ir.passes.nodes import canonicalize, ir_nodes, ir_op_of, normalize, value_of

if TYPE_CHECKING:
    from vllm_ir.passes.record import GraphReport

aten = torch.ops.aten


class IrFusion(ABC):
    """One rewrite of IR ops: a pattern over ``torch.ops.vllm_ir`` nodes and the rewrite itself."""

    #: Short name used in reports.
    name: str

    @abstractmethod
    def pattern(self) -> PatternExpr:
        """The pattern; IR nodes are matched with every parameter positional (defaults included)."""

    def check(self, match: Match) -> bool:
        """Extra conditions the pattern cannot express (shapes, dtypes, argument values)."""
        return True

    @abstractmethod
    def rewrite(self, match: Match, graph: fx.Graph) -> str:
        """Rewrite the matched nodes; return a one-line description for the report."""


def ir_call(op_name: str, *args: Any, overload: str = "default", **kwargs: Any) -> CallFunction:
    """``CallFunction`` on an IR op's overload (``ir_call("rms_norm", x, w, eps, vs)``)."""
    target = getattr(registry.get_op(op_name).torch_op, overload)
    return CallFunction(target, *args, **kwargs)


class AddRmsNormFusion(IrFusion):
    """``rms_norm(x + residual, ...)`` -> ``fused_add_rms_norm(x, residual, ...)``; the sum's other
    users read the fused op's new residual."""

    name = "add_rms_norm"

    def pattern(self) -> PatternExpr:
        add = CallFunction(aten.add.Tensor, KeywordArg("x"), KeywordArg("residual"), _users=MULTIPLE)
        return ir_call("rms_norm", add, KeywordArg("weight"), KeywordArg("epsilon"), KeywordArg("variance_size"))

    def check(self, match: Match) -> bool:
        norm = match.output_node()
        add = norm.args[0]
        x, residual = add.args
        if add.kwargs.get("alpha", 1) != 1 or not isinstance(x, fx.Node) or not isinstance(residual, fx.Node):
            return False
        s, xv, rv = value_of(add), value_of(x), value_of(residual)
        if not all(isinstance(t, torch.Tensor) for t in (s, xv, rv)):
            return False
        if not (s.dtype == xv.dtype == rv.dtype and s.dtype.is_floating_point):
            return False
        if not (s.shape == xv.shape == rv.shape and s.device == xv.device == rv.device):
            return False  # broadcasting or type promotion: not the fused op's semantics
        weight = norm.args[1]
        if isinstance(weight, fx.Node) and not weight < add:
            return False  # the fused node goes right after the add; its inputs must exist there
        return True

    def rewrite(self, match: Match, graph: fx.Graph) -> str:
        norm = match.output_node()
        add = norm.args[0]
        x, residual = add.args
        _, weight, epsilon, variance_size = norm.args
        fused_op = registry.get_op("fused_add_rms_norm").torch_op.default
        with graph.inserting_after(add):
            fused = graph.call_function(fused_op, (x, residual, weight, epsilon, variance_size))
        with graph.inserting_after(fused):
            normed = graph.call_function(operator.getitem, (fused, 0))
        with graph.inserting_after(normed):
            new_residual = graph.call_function(operator.getitem, (fused, 1))
        for new, old in ((fused, norm), (normed, norm), (new_residual, add)):
            for key in ("stack_trace", "nn_module_stack", "custom"):
                if key in old.meta:
                    new.meta[key] = old.meta[key]
        normed.meta["val"] = value_of(norm)
        new_residual.meta["val"] = value_of(add)
        fused.meta["val"] = (value_of(norm), value_of(add))
        norm.replace_all_uses_with(normed)
        add.replace_all_uses_with(new_residual)
        graph.erase_node(norm)
        graph.erase_node(add)
        return f"{add.name} + {norm.name} -> {fused.name}"


class GraphFusion(ABC):
    """A fusion that walks the graph itself, so that it can report every candidate it rejects."""

    #: Short name used in reports.
    name: str

    @abstractmethod
    def apply(self, graph: fx.Graph, report: GraphReport | None) -> None:
        """Rewrite ``graph``; add applied fusions to ``report.fusions`` and rejected
        candidates, with the reason, to ``report.fusions_rejected``."""


def default_fusions() -> list[IrFusion | GraphFusion]:
    from vllm_ir.passes.quant_fusion import QuantFusion

    return [AddRmsNormFusion(), QuantFusion()]


class FusionPass(CustomGraphPass):
    """Run `IrFusion` rewrites over the IR ops of a post-grad graph."""

    def __init__(self, fusions: Sequence[IrFusion | GraphFusion] | None = None):
        self.fusions = list(default_fusions() if fusions is None else fusions)
        self._matcher: PatternMatcherPass | None = None
        self._report: GraphReport | None = None

    def _build(self) -> PatternMatcherPass:
        matcher = PatternMatcherPass(pass_name="vllm_ir_fusion")
        for fusion in self.fusions:
            if not isinstance(fusion, IrFusion):
                continue

            def handler(match: Match, *args: Any, _fusion: IrFusion = fusion, **kwargs: Any) -> None:
                done = _fusion.rewrite(match, match.graph)
                if self._report is not None:
                    self._report.fusions.append(f"{_fusion.name}: {done}")

            register_graph_pattern(fusion.pattern(), extra_check=fusion.check, pass_dict=matcher)(handler)
        return matcher

    def __call__(self, graph: fx.Graph, report: GraphReport | None = None) -> None:
        if not self.fusions:
            return
        for node in ir_nodes(graph):
            op = ir_op_of(node)
            if op is not None:
                normalize(op, node)
        if self._matcher is None:
            self._matcher = self._build()
        self._report = report
        try:
            self._matcher.apply(graph)
            for fusion in self.fusions:
                if isinstance(fusion, GraphFusion):
                    fusion.apply(graph, report)
        finally:
            self._report = None
            for node in ir_nodes(graph):
                op = ir_op_of(node)
                if op is not None:
                    canonicalize(op, node)

    def uuid(self) -> str:
        """Changes with the pipeline's code, each fusion's code and each fusion's own settings."""
        return cache.combine(
            "fusion",
            cache.package_fingerprint(),
            tuple((f.name, cache.code_fingerprint(type(f)), _uuid_parts(f)) for f in self.fusions),
        )


def _uuid_parts(fusion: IrFusion | GraphFusion) -> tuple[Any, ...]:
    """What a fusion's rewrite depends on besides its code (``uuid_parts()``, when it has one):
    its options, or facts such as the rank whose rows a sequence-parallel graph keeps."""
    parts = getattr(fusion, "uuid_parts", None)
    return tuple(parts()) if callable(parts) else ()
