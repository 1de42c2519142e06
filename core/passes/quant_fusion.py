"""Norm / activation + FP8 quant fusion over IR nodes, decided by the compile-mode priority.

Candidates are a quant IR node (`static_quant_fp8`, per-token `dynamic_quant_fp8`,
`dynamic_group_quant_fp8`) whose input is the result of an `rms_norm`, `fused_add_rms_norm`
(its normalized output) or `silu_and_mul` IR node. Nothing about the kernels is matched: every epsilon, weight dtype and
scale layout the fused op's native function accepts is a candidate, and lowering then picks
the fused op's kernel like any other node's.

A candidate is fused only when the current compile-mode priority would run the fused op on a
provider other than ``native``: the native fused op is the same composition the unfused pair
computes, so it gains nothing, and a non-native unfused pair (e.g. two ``vllm_c`` kernels)
would lose its kernels. The decision is `vllm_ir.ir.dispatch.selection.decide` on the fused call's fake
values, exactly what lowering will ask.

When the intermediate (the norm's or activation's output) has users other than the quant,
the candidate is rejected: keeping the intermediate means computing the norm twice (once
alone, once in the fused kernel), which reads x twice and writes the intermediate anyway --
the traffic the fusion exists to remove. Every rejection is recorded with its reason in
``GraphReport.fusions_rejected``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import fx

from vllm_ir.ir import priority as _priority
from vllm_ir.ir import registry
from vllm_ir.ir.dispatch import selection as _selection
from vllm_ir.ir.impl import NATIVE
from vllm_ir.passes.fusion import GraphFusion
from vllm_ir.passes.nodes import bound_args, donated_params, fake_args, ir_op_of, mark_donated, value_of

if TYPE_CHECKING:
    from vllm_ir.passes.record import GraphReport


@dataclass
class _Candidate:
    """One quant node and the producer of its input, with everything the rewrite needs."""

    quant: fx.Node
    producer: fx.Node  # rms_norm / fused_add_rms_norm / silu_and_mul
    normed: fx.Node  # the node the quant reads: producer, or getitem(producer, 0)
    fused_op: str
    fused_args: tuple[Any, ...]

    def describe(self) -> str:
        return (
            f"{self.producer.name} ({ir_op_of(self.producer).name}) + {self.quant.name} ({ir_op_of(self.quant).name})"
        )


def _getitems(node: fx.Node, index: int) -> list[fx.Node]:
    return [u for u in node.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == index]


class QuantFusion(GraphFusion):
    """``quant(rms_norm | fused_add_rms_norm | silu_and_mul)`` -> one fused FP8 op (see module doc)."""

    name = "quant"

    def apply(self, graph: fx.Graph, report: GraphReport | None) -> None:
        scope = _priority.current_scope()
        for quant in [n for n in graph.nodes if _quant_kind(n) is not None]:
            candidate, reason = self._candidate(quant)
            if candidate is None:
                if reason is not None and report is not None:
                    report.fusions_rejected.append(f"{self.name}: {reason}")
                continue
            reason = self._rejection(candidate, scope)
            if reason is not None:
                if report is not None:
                    report.fusions_rejected.append(f"{self.name}: {candidate.describe()}: {reason}")
                continue
            done = self._rewrite(graph, candidate)
            if report is not None:
                report.fusions.append(f"{self.name}: {done}")

    # -- matching --------------------------------------------------------------------------

    def _candidate(self, quant: fx.Node) -> tuple[_Candidate | None, str | None]:
        """The candidate at ``quant``, or (None, why not) -- (None, None) when the quant's input
        comes from no fusable IR node at all (not a candidate, nothing to report)."""
        kind = _quant_kind(quant)
        qop = ir_op_of(quant)
        qargs = bound_args(qop, quant)
        src = qargs[0]
        if not isinstance(src, fx.Node):
            return None, None
        producer, normed = src, src
        if src.op == "call_function" and src.target is operator.getitem and isinstance(src.args[0], fx.Node):
            if src.args[1] != 0:
                return None, None
            producer = src.args[0]
        pop = ir_op_of(producer)
        if pop is None or pop.name not in ("rms_norm", "fused_add_rms_norm", "silu_and_mul"):
            return None, None
        if (pop.name == "fused_add_rms_norm") != (producer is not normed):
            return None, None
        where = f"{producer.name} ({pop.name}) + {quant.name} ({qop.name})"
        others = [u.name for u in normed.users if u is not quant]
        if others:
            return None, f"{where}: the intermediate {normed.name} has other uses ({', '.join(others)})"
        strays = [u.name for u in producer.users if u is not normed and u not in _getitems(producer, 1)]
        if producer is not normed and strays:
            return None, f"{where}: {producer.name} is also read by {', '.join(strays)}"
        pargs = bound_args(pop, producer)
        if pop.name != "silu_and_mul" and pargs[-1] is not None:
            return None, f"{where}: variance_size={pargs[-1]} (the fused ops normalize over the whole row)"
        if kind == "static":
            _, scale, fp8_dtype, padding = qargs
            if padding is not None:
                return None, f"{where}: num_token_padding={padding} (the fused ops do not pad)"
            if pop.name == "silu_and_mul":
                return _Candidate(
                    quant, producer, normed, "silu_and_mul_static_fp8_quant", (pargs[0], scale, fp8_dtype)
                ), None
            if pop.name == "rms_norm":
                x, weight, eps, _ = pargs
                return _Candidate(
                    quant, producer, normed, "rms_norm_static_fp8_quant", (x, weight, eps, scale, fp8_dtype)
                ), None
            x, residual, weight, eps, _ = pargs
            fused_args = (x, residual, weight, eps, scale, fp8_dtype)
            return _Candidate(quant, producer, normed, "fused_add_rms_norm_static_fp8_quant", fused_args), None
        if kind == "group":
            _, group_size, column_major, use_ue8m0, fp8_dtype = qargs
            quant_args = (group_size, column_major, use_ue8m0, fp8_dtype)
            if pop.name == "silu_and_mul":
                return _Candidate(
                    quant, producer, normed, "silu_and_mul_group_fp8_quant", (pargs[0], *quant_args)
                ), None
            if pop.name == "rms_norm":
                x, weight, eps, _ = pargs
                residual = None
            else:
                x, residual, weight, eps, _ = pargs
            fused_args = (x, residual, weight, eps, *quant_args)
            return _Candidate(quant, producer, normed, "rms_norm_group_fp8_quant", fused_args), None
        _, per_token, fp8_dtype, scale_ub, padding = qargs
        if not per_token:
            return None, f"{where}: per-tensor dynamic quant (its scale needs every row first: no one-pass fused op)"
        if padding is not None:
            return None, f"{where}: num_token_padding={padding} (the fused ops do not pad)"
        if pop.name == "silu_and_mul":
            return None, f"{where}: no fused op for silu_and_mul with dynamic per-token quant"
        if pop.name == "rms_norm":
            x, weight, eps, _ = pargs
            residual = None
        else:
            x, residual, weight, eps, _ = pargs
        fused_args = (x, residual, weight, eps, fp8_dtype, scale_ub)
        return _Candidate(quant, producer, normed, "rms_norm_dynamic_per_token_fp8_quant", fused_args), None

    def _rejection(self, c: _Candidate, scope: Any) -> str | None:
        """Why ``c`` stays unfused (None: fuse it)."""
        if self._anchor(c) is None:
            return "the new residual is used between the norm and the quant, before the quant's scale exists"
        op = registry.get_op(c.fused_op)
        try:
            decision = _selection.decide(op, fake_args(c.fused_args), "compile", scope)
        except Exception as exc:  # a fused call the op rejects is no fusion, with the reason
            return f"{c.fused_op} rejects the call: {type(exc).__name__}: {exc}"
        if decision.provider == NATIVE:
            skipped = "; ".join(f"{p}: {why}" for p, why in decision.skipped) or "no other provider in the priority"
            return f"only the native {c.fused_op} would run under the current priority ({skipped})"
        return None

    @staticmethod
    def _anchor(c: _Candidate) -> fx.Node | None:
        """The node the fused node is inserted before: right after the producer when the quant's
        other inputs exist there, else at the quant when nothing reads the residual before it."""
        extra = [a for a in c.fused_args if isinstance(a, fx.Node)]
        if all(a < c.producer for a in extra if a is not c.producer):
            return c.producer.next
        residual_users = [u for g in _getitems(c.producer, 1) for u in g.users]
        if all(c.quant < u for u in residual_users):
            return c.quant
        return None

    # -- rewriting -------------------------------------------------------------------------

    def _rewrite(self, graph: fx.Graph, c: _Candidate) -> str:
        op = registry.get_op(c.fused_op)
        anchor = self._anchor(c)
        assert anchor is not None
        q_val = value_of(c.quant)
        residual_getitems = _getitems(c.producer, 1) if c.producer is not c.normed else []
        residual_val = value_of(c.producer)[1] if c.producer is not c.normed else None
        with graph.inserting_before(anchor):
            fused = graph.call_function(op.torch_op.default, c.fused_args)
        for key in ("stack_trace", "nn_module_stack"):
            if key in c.producer.meta:
                fused.meta[key] = c.producer.meta[key]
        donated = donated_params(c.producer)
        if donated:
            mark_donated(fused, donated)
        if c.fused_op in ("rms_norm_dynamic_per_token_fp8_quant", "rms_norm_group_fp8_quant"):
            fused.meta["val"] = (*q_val, residual_val)
            c.quant.replace_all_uses_with(fused)  # (q, scale) keep their getitem positions
            residual_index = 2
        elif c.fused_op == "fused_add_rms_norm_static_fp8_quant":
            fused.meta["val"] = (q_val, residual_val)
            with graph.inserting_after(fused):
                q = graph.call_function(operator.getitem, (fused, 0))
            q.meta["val"] = q_val
            c.quant.replace_all_uses_with(q)
            residual_index = 1
        else:  # one output (static) or (q, scales) (group): the quant's own
            fused.meta["val"] = q_val
            c.quant.replace_all_uses_with(fused)
            residual_index = -1
        for old in residual_getitems:
            with graph.inserting_after(fused):
                new = graph.call_function(operator.getitem, (fused, residual_index))
            new.meta["val"] = value_of(old)
            old.replace_all_uses_with(new)
            graph.erase_node(old)
        graph.erase_node(c.quant)
        if c.normed is not c.producer:
            graph.erase_node(c.normed)
        graph.erase_node(c.producer)
        return f"{c.producer.name} + {c.quant.name} -> {fused.name} ({c.fused_op})"


def _quant_kind(node: fx.Node) -> str | None:
    op = ir_op_of(node)
    if op is None:
        return None
    return {"static_quant_fp8": "static", "dynamic_quant_fp8": "dynamic", "dynamic_group_quant_fp8": "group"}.get(
        op.name
    )
