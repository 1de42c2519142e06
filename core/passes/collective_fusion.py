"""Collective-aware IR passes for tensor-parallel models: all-reduce + RMSNorm fusion, sequence parallelism.

Both start from the same candidate, found on the post-grad graph before lowering: a
functional all-reduce (``_c10d_functional.all_reduce(p, "sum", group)`` then
``wait_tensor``, what ``torch.distributed._functional_collectives.all_reduce`` traces to)
whose result feeds an ``rms_norm`` or ``fused_add_rms_norm`` IR node (as ``x`` or as
``x_residual``: the sum is commutative). They are off by default -- `tensor_parallel_fusions`
turns them on::

    options = vllm_ir.inductor_options(fusions=tensor_parallel_fusions(sequence_parallel=True))
    compiled = vllm_ir.compile(model, fusions=tensor_parallel_fusions(all_reduce=True))

`AllReduceRmsNormFusion` rewrites the pair into one `all_reduce_fused_add_rms_norm` /
`all_reduce_rms_norm` IR node, which a provider with a one-shot kernel runs in one launch.
As `QuantFusion` does, it fuses only when the compile-mode priority would run the fused op
on a provider other than ``native`` (native is the same composition: nothing to gain, and
the norm would lose its own kernel); ``force=True`` fuses regardless.

`SequenceParallelism` rewrites ``all_reduce(p) -> norm`` into ``reduce_scatter(p)`` over the
token (leading) dimension, the norm on this rank's token shard, and ``all_gather`` of the
normalized shard, which the following (column-parallel) projection consumes. The residual
stays sharded between layers: a norm whose residual input is a residual this pass gathered
reads the shard instead, and gathers nobody reads are removed; a residual coming from
elsewhere (the first layer's input) is sliced to this rank's rows. A ring all-reduce moves
the same bytes as a reduce-scatter plus an all-gather, so the saving is the norm (and the
residual add) computed on 1/world of the tokens, and the residual kept at 1/world of its
size. It applies only where the token count is static and divisible by the group's size;
otherwise the all-reduce stays, with the reason in ``GraphReport.fusions_rejected``.

The shard's row offset is this rank's: the compiled graph is rank-specific, so the pass's
cache key (`uuid`) includes the rank and world size of the default group.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from vllm_ir.ir import priority as _priority
from vllm_ir.ir import registry
from vllm_ir.ir.dispatch import selection as _selection
from vllm_ir.ir.impl import NATIVE
from vllm_ir.passes.fusion import GraphFusion, IrFusion, default_fusions
from vllm_ir.passes.nodes import bound_args, donated_params, fake_args, ir_op_of, mark_donated, value_of

if TYPE_CHECKING:
    from vllm_ir.passes.record import GraphReport

c10d = torch.ops._c10d_functional
aten = torch.ops.aten

#: Collective ops of ``_c10d_functional`` by base name (in-place variants count as theirs).
COLLECTIVE_KINDS = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single", "broadcast")


def collective_counts(graph: fx.Graph) -> dict[str, int]:
    """``{kind: count}`` of the functional collectives in ``graph`` (``wait_tensor`` not counted)."""
    counts: dict[str, int] = {}
    for node in graph.nodes:
        kind = collective_kind(node)
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def collective_kind(node: fx.Node) -> str | None:
    """``"all_reduce"`` for ``_c10d_functional.all_reduce(_)`` and so on; None for other nodes."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if target.namespace != "_c10d_functional":
        return None
    base = target._opname.removesuffix("_")
    return base if base in COLLECTIVE_KINDS else None


@dataclass
class _Candidate:
    """``wait(all_reduce(partial))`` read by a norm IR node."""

    all_reduce: fx.Node
    wait: fx.Node
    partial: fx.Node
    group: str
    norm: fx.Node
    op_name: str  # rms_norm | fused_add_rms_norm
    weight: Any
    epsilon: float
    residual: Any  # the other summand of fused_add_rms_norm (None for rms_norm)
    residual_param: str | None  # which parameter of the norm held it

    def describe(self) -> str:
        return f"{self.all_reduce.name} (all_reduce) + {self.norm.name} ({self.op_name})"


def _getitems(node: fx.Node, index: int) -> list[fx.Node]:
    return [u for u in node.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == index]


def _all_reduce_behind(value: Any) -> tuple[fx.Node, fx.Node, fx.Node, str] | None:
    """(all_reduce, wait, partial, group) when ``value`` is ``wait_tensor(all_reduce(partial, "sum", group))``."""
    if not isinstance(value, fx.Node) or value.op != "call_function" or value.target is not c10d.wait_tensor.default:
        return None
    ar = value.args[0]
    if not isinstance(ar, fx.Node) or ar.target is not c10d.all_reduce.default:
        return None
    partial, reduce_op, group = ar.args[:3]
    if reduce_op != "sum" or not isinstance(partial, fx.Node) or not isinstance(group, str):
        return None
    return ar, value, partial, group


def _candidates(graph: fx.Graph, name: str, report: GraphReport | None) -> Iterator[_Candidate]:
    """Every all-reduce + norm pair of ``graph`` in order; pairs that cannot be rewritten are reported.

    Each norm's arguments are read when the walk reaches it, so a rewrite of an earlier pair
    (which replaces the residual this norm reads) is seen.
    """
    for norm in list(graph.nodes):
        if getattr(norm, "_erased", False) or norm.op != "call_function":
            continue
        op = ir_op_of(norm)
        if op is None or op.name not in ("rms_norm", "fused_add_rms_norm"):
            continue
        args = bound_args(op, norm)
        if op.name == "rms_norm":
            x, weight, epsilon, variance_size = args
            slots = [(x, None, None)]
        else:
            x, residual, weight, epsilon, variance_size = args
            slots = [(x, residual, "x_residual"), (residual, x, "x")]
        for value, other, other_param in slots:
            behind = _all_reduce_behind(value)
            if behind is None:
                continue
            ar, wait, partial, group = behind
            where = f"{ar.name} (all_reduce) + {norm.name} ({op.name})"
            why = None
            if variance_size is not None:
                why = f"variance_size={variance_size} (the rewritten ops normalize over the whole row)"
            elif list(ar.users) != [wait]:
                why = f"the all-reduce {ar.name} is read by other nodes than its wait"
            elif op.name == "rms_norm" and any(u < norm for u in wait.users if u is not norm):
                early = ", ".join(u.name for u in wait.users if u is not norm and u < norm)
                why = f"the all-reduced {wait.name} is read before the norm (by {early})"
            elif op.name == "fused_add_rms_norm" and value is other:
                why = "the norm adds the all-reduced tensor to itself"
            elif op.name == "fused_add_rms_norm" and set(wait.users) != {norm}:
                others = ", ".join(u.name for u in wait.users if u is not norm)
                why = (
                    f"the all-reduced {wait.name} is also read by {others} "
                    "(the fused ops return only its sum with the residual)"
                )
            if why is not None:
                if report is not None:
                    report.fusions_rejected.append(f"{name}: {where}: {why}")
                break
            yield _Candidate(ar, wait, partial, group, norm, op.name, weight, epsilon, other, other_param)
            break


def _copy_meta(new: fx.Node, old: fx.Node) -> None:
    for key in ("stack_trace", "nn_module_stack"):
        if key in old.meta:
            new.meta[key] = old.meta[key]


def _fake_call(target: Any, args: tuple[Any, ...]) -> Any:
    """``target(*args)`` on the nodes' fake values, under their fake mode: the new node's ``val``."""
    fakes = fake_args(args)
    mode = torch._guards.detect_fake_mode(fakes)
    if mode is None:
        raise ValueError(f"no fake mode on the arguments of {target}")
    with mode:
        return target(*fakes)


def _call(graph: fx.Graph, target: Any, args: tuple[Any, ...], like: fx.Node) -> fx.Node:
    """A new node ``target(*args)`` with its fake value (inserted at the graph's insertion point)."""
    node = graph.call_function(target, args)
    node.meta["val"] = _fake_call(target, args)
    _copy_meta(node, like)
    return node


def _getitem(graph: fx.Graph, node: fx.Node, index: int) -> fx.Node:
    item = graph.call_function(operator.getitem, (node, index))
    item.meta["val"] = value_of(node)[index]
    _copy_meta(item, node)
    return item


def _replace_outputs(c: _Candidate, normed: fx.Node, new_sum: Callable[[], fx.Node] | None) -> None:
    """Point the old norm's users at ``normed`` (and, for fused_add_rms_norm, at the new residual
    ``new_sum()``, called once if anything reads the old one), then erase the old nodes."""
    graph = c.norm.graph
    if c.op_name == "rms_norm":
        c.norm.replace_all_uses_with(normed)
    else:
        for old in _getitems(c.norm, 0):
            old.replace_all_uses_with(normed)
            graph.erase_node(old)
        olds = _getitems(c.norm, 1)
        if olds and new_sum is not None:
            summed = new_sum()
            for old in olds:
                old.replace_all_uses_with(summed)
                graph.erase_node(old)
    graph.erase_node(c.norm)


# -- all-reduce + norm fusion ------------------------------------------------------------------


class AllReduceRmsNormFusion(GraphFusion):
    """``norm(all_reduce(p))`` -> one `all_reduce_rms_norm` / `all_reduce_fused_add_rms_norm` node.

    :param force: fuse even where only the native fused op would run (it then computes exactly
        what the pair did; the norm runs as traced native code instead of its own kernel).
    """

    name = "all_reduce_rms_norm"

    def __init__(self, *, force: bool = False):
        self.force = force

    def apply(self, graph: fx.Graph, report: GraphReport | None) -> None:
        scope = _priority.current_scope()
        for c in _candidates(graph, self.name, report):
            if c.op_name == "rms_norm":
                fused_name, args = "all_reduce_rms_norm", (c.partial, c.weight, c.epsilon, c.group)
            else:
                fused_name = "all_reduce_fused_add_rms_norm"
                args = (c.partial, c.residual, c.weight, c.epsilon, c.group)
            why = None if self.force else _native_only(fused_name, args, scope)
            if why is not None:
                if report is not None:
                    report.fusions_rejected.append(f"{self.name}: {c.describe()}: {why}")
                continue
            done = self._rewrite(graph, c, fused_name, args)
            if report is not None:
                report.fusions.append(f"{self.name}: {done}")

    @staticmethod
    def _rewrite(graph: fx.Graph, c: _Candidate, fused_name: str, args: tuple[Any, ...]) -> str:
        op = registry.get_op(fused_name)
        with graph.inserting_before(c.norm):
            fused = _call(graph, op.torch_op.default, args, c.norm)
            normed = _getitem(graph, fused, 0)
            summed = _getitem(graph, fused, 1)
        if c.residual_param is not None and c.residual_param in donated_params(c.norm):
            mark_donated(fused, ("x_residual",))
        if c.op_name == "rms_norm":
            c.wait.replace_all_uses_with(summed)  # other readers of the reduced tensor
        _replace_outputs(c, normed, lambda: summed)
        for node in (summed, normed):
            if not node.users:
                graph.erase_node(node)
        if not c.wait.users:
            graph.erase_node(c.wait)
            graph.erase_node(c.all_reduce)
        return f"{c.describe()} -> {fused.name} ({fused_name})"

    def uuid_parts(self) -> tuple[Any, ...]:
        return (self.force,)


def _native_only(op_name: str, args: tuple[Any, ...], scope: Any) -> str | None:
    op = registry.get_op(op_name)
    try:
        decision = _selection.decide(op, fake_args(args), "compile", scope)
    except Exception as exc:
        return f"{op_name} rejects the call: {type(exc).__name__}: {exc}"
    if decision.provider == NATIVE:
        skipped = "; ".join(f"{p}: {why}" for p, why in decision.skipped) or "no other provider in the priority"
        return f"only the native {op_name} would run under the current priority ({skipped}); force=True fuses anyway"
    return None


# -- sequence parallelism ----------------------------------------------------------------------


def _group_facts(group: str) -> tuple[int, int] | str:
    """(rank, world size) of the group named ``group`` in this process, or why they are unknown."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return "torch.distributed is not initialized in this process"
    try:
        pg = dist.distributed_c10d._resolve_process_group(group)
    except Exception as exc:
        return f"process group {group!r} is unknown here ({type(exc).__name__}: {exc})"
    return pg.rank(), pg.size()


class SequenceParallelism(GraphFusion):
    """``norm(all_reduce(p))`` -> ``all_gather(norm(reduce_scatter(p)))`` (see the module doc)."""

    name = "sequence_parallel"

    def apply(self, graph: fx.Graph, report: GraphReport | None) -> None:
        #: all-gathered residual (wait node) -> (the shard it gathered, its group), for the next layer's norm.
        gathered: dict[fx.Node, tuple[fx.Node, str]] = {}
        for c in _candidates(graph, self.name, report):
            why = self._rejection(c, gathered)
            if why is not None:
                if report is not None:
                    report.fusions_rejected.append(f"{self.name}: {c.describe()}: {why}; the all-reduce stays")
                continue
            done = self._rewrite(graph, c, gathered)
            if report is not None:
                report.fusions.append(f"{self.name}: {done}")
        for wait, _shard in gathered.items():  # residuals no later norm reads in full
            if not wait.users:
                ag = wait.args[0]
                graph.erase_node(wait)
                graph.erase_node(ag)

    @staticmethod
    def _rejection(c: _Candidate, gathered: dict[fx.Node, tuple[fx.Node, str]]) -> str | None:
        facts = _group_facts(c.group)
        if isinstance(facts, str):
            return facts
        _rank, world = facts
        value = value_of(c.partial)
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            return "the all-reduced value is not a tensor of [tokens, ..., hidden]"
        tokens = value.shape[0]
        if not isinstance(tokens, int):
            return f"the token count {tokens} is symbolic (sequence parallelism needs static shapes)"
        if tokens % world:
            return f"the token count {tokens} does not divide by the world size {world}"
        if c.residual is not None:
            rv = value_of(c.residual) if isinstance(c.residual, fx.Node) else None
            if c.residual not in gathered and not (isinstance(rv, torch.Tensor) and rv.shape == value.shape):
                return "the residual does not have the all-reduced tensor's shape"
        return None

    @staticmethod
    def _rewrite(graph: fx.Graph, c: _Candidate, gathered: dict[fx.Node, tuple[fx.Node, str]]) -> str:
        rank, world = _group_facts(c.group)  # type: ignore[misc]
        tokens = value_of(c.partial).shape[0]
        shard_rows = tokens // world
        op = registry.get_op(c.op_name)
        with graph.inserting_before(c.norm):
            rs = _call(graph, c10d.reduce_scatter_tensor.default, (c.partial, "sum", world, c.group), c.all_reduce)
            shard = _call(graph, c10d.wait_tensor.default, (rs,), c.all_reduce)
            if c.op_name == "rms_norm":
                norm = _call(graph, op.torch_op.default, (shard, c.weight, c.epsilon, None), c.norm)
                normed_shard, summed_shard, residual_from = norm, shard, "none"
            else:
                residual_shard, group = gathered.get(c.residual, (None, None))
                if group != c.group:  # sharded over another group: slice the gathered tensor instead
                    residual_shard = None
                residual_from = "the previous layer's shard"
                if residual_shard is None:
                    residual_from = f"rows {rank * shard_rows}:{(rank + 1) * shard_rows} of {c.residual.name}"
                    residual_shard = _call(
                        graph,
                        aten.slice.Tensor,
                        (c.residual, 0, rank * shard_rows, (rank + 1) * shard_rows),
                        c.norm,
                    )
                norm = _call(graph, op.torch_op.default, (shard, residual_shard, c.weight, c.epsilon, None), c.norm)
                normed_shard, summed_shard = _getitem(graph, norm, 0), _getitem(graph, norm, 1)
            ag = _call(graph, c10d.all_gather_into_tensor.default, (normed_shard, world, c.group), c.norm)
            normed = _call(graph, c10d.wait_tensor.default, (ag,), c.norm)

        def gather_sum() -> fx.Node:
            with graph.inserting_before(c.norm):
                ag_sum = _call(graph, c10d.all_gather_into_tensor.default, (summed_shard, world, c.group), c.norm)
                summed = _call(graph, c10d.wait_tensor.default, (ag_sum,), c.norm)
            gathered[summed] = (summed_shard, c.group)
            return summed

        if c.op_name == "rms_norm" and len(c.wait.users) > 1:  # the reduced tensor read elsewhere (a residual)
            summed = gather_sum()
            c.wait.replace_all_uses_with(summed)  # the old norm reads it too: it is erased below
        _replace_outputs(c, normed, gather_sum)
        graph.erase_node(c.wait)
        graph.erase_node(c.all_reduce)
        return (
            f"{c.describe()} -> reduce_scatter {rs.name} + {norm.name} on {shard_rows} of {tokens} tokens "
            f"(residual: {residual_from}) + all_gather {ag.name}"
        )

    def uuid_parts(self) -> tuple[Any, ...]:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return (dist.get_rank(), dist.get_world_size())
        return (None,)


def tensor_parallel_fusions(
    *, sequence_parallel: bool = False, all_reduce: bool = False, force: bool = False
) -> list[IrFusion | GraphFusion]:
    """The default fusions plus the collective passes asked for (for ``inductor_options(fusions=...)``).

    Sequence parallelism runs first: the all-reduces it leaves (indivisible token counts)
    are then candidates of the all-reduce fusion. ``force`` is `AllReduceRmsNormFusion`'s.
    """
    fusions: list[IrFusion | GraphFusion] = list(default_fusions())
    if sequence_parallel:
        fusions.append(SequenceParallelism())
    if all_reduce:
        fusions.append(AllReduceRmsNormFusion(force=force))
    return fusions
