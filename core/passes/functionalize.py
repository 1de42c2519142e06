"""Pre-grad pass: ``maybe_inplace`` calls become the functional overload, donations are checked.

Runs on Dynamo's graph before AOTAutograd, which would otherwise treat the overloads as
unrelated ops. For each ``torch.ops.vllm_ir.<op>.maybe_inplace`` node:

* every donated activation (and every view or alias of it) must have no user after the
  node in graph order -- the graph output counts, since it hands the tensor to code after
  the compiled region -- else `CompileDonationError` names the op, the argument and the use;
* the node is retargeted to ``.default`` and the donated parameters are recorded in
  ``node.meta["custom"]``, which AOTAutograd copies onto the node it emits (placeholder
  metadata does not survive AOTAutograd; the IR node's does).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from vllm_ir.ir.dispatch.donation import disjoint_rows
from vllm_ir.passes import cache
from vllm_ir.passes.aliasing import AliasAnalysis
from vllm_ir.passes.errors import CompileDonationError
from vllm_ir.passes.nodes import bound_args, input_name, ir_op_of, is_maybe_inplace, mark_donated, value_of, where
from vllm_ir.settings.log import get_logger

if TYPE_CHECKING:
    from vllm_ir.passes.record import PipelineRecord

log = get_logger("passes")


@dataclass
class Donation:
    """One activation handed to ``maybe_inplace``."""

    op: str
    node: str
    param: str
    #: The graph input donated (Dynamo's source name), None for values computed in the graph.
    graph_input: str | None
    #: The input is a parameter or buffer of a module: it keeps its clone (the module reuses it).
    module_state: bool = False


@dataclass
class FunctionalizeReport:
    """What the pre-grad pass did to one graph."""

    rewritten: list[str] = field(default_factory=list)
    donations: list[Donation] = field(default_factory=list)

    @property
    def donated_inputs(self) -> list[str]:
        """Graph inputs the compiled graph may overwrite (module parameters and buffers excluded)."""
        return [d.graph_input for d in self.donations if d.graph_input is not None and not d.module_state]


class FunctionalizeInplacePass(CustomGraphPass):
    """``maybe_inplace`` -> ``default`` with the donation check (Inductor ``pre_grad_custom_pass``)."""

    def __init__(self, record: PipelineRecord | None = None):
        self.record = record

    def __call__(self, graph: fx.Graph) -> None:
        start = time.perf_counter()
        report = functionalize(graph)
        if self.record is not None:
            self.record.add_functionalize(report, time.perf_counter() - start)

    def uuid(self) -> str:
        return cache.combine("functionalize", cache.package_fingerprint())


def functionalize(graph: fx.Graph) -> FunctionalizeReport:
    """Check donations and retarget every ``maybe_inplace`` node of ``graph``."""
    report = FunctionalizeReport()
    nodes = [n for n in graph.nodes if is_maybe_inplace(n)]
    if not nodes:
        return report
    aliases = AliasAnalysis(graph)
    for node in nodes:
        op = ir_op_of(node)
        if op is None:
            continue  # unknown vllm_ir op: lowering reports it
        args = bound_args(op, node)
        donated = []
        for param, index in zip(op.activations, op.activation_indices, strict=True):
            value = args[index]
            if not isinstance(value, fx.Node):
                continue
            _check_not_passed_twice(op.name, node, param, value, args, op, aliases)
            _check_no_later_use(op.name, node, param, value, aliases)
            graph_input = value if value.op == "placeholder" else None
            if graph_input is None and value_of(value) is not None:
                roots = [m for m in aliases.members(value) if m.op == "placeholder"]
                graph_input = roots[0] if len(roots) == 1 else None
            module_state = graph_input is not None and _is_module_state(graph_input)
            if not module_state:
                donated.append(param)
            report.donations.append(
                Donation(
                    op.name,
                    node.name,
                    param,
                    input_name(graph_input) if graph_input is not None else None,
                    module_state,
                )
            )
        node.target = op.torch_op.default
        mark_donated(node, tuple(donated))
        report.rewritten.append(node.name)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "functionalize %s: %s.maybe_inplace -> %s.default; donations: %s",
                node.name,
                op.name,
                op.name,
                "; ".join(_describe_donation(d) for d in report.donations if d.node == node.name) or "none",
            )
    return report


def _describe_donation(d: Donation) -> str:
    if d.module_state:
        return f"{d.param} = module state {d.graph_input} (not donated: the module reads it again)"
    if d.graph_input is not None:
        return f"{d.param} = graph input {d.graph_input} (donated)"
    return f"{d.param} = a value computed in the graph (donated)"


def _is_module_state(placeholder: fx.Node) -> bool:
    """A parameter or buffer of an ``nn.Module``: the next call reads it again, so it is never overwritten."""
    grapharg = placeholder.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is not None:
        guard_source = source.guard_source  # a property in torch 2.13, a method before
        guard_source = guard_source() if callable(guard_source) else guard_source
        if "NN_MODULE" in guard_source.name or "FSDP" in guard_source.name:
            return True
    return isinstance(getattr(grapharg, "example", None), torch.nn.Parameter)


def _describe(value: fx.Node) -> str:
    if value.op == "placeholder":
        return f"graph input {input_name(value)}"
    return f"value {value.name!r}"


def _check_not_passed_twice(op_name, node, param, value, args, op, aliases: AliasAnalysis) -> None:
    names = list(op.signature.parameters)
    for i, other in enumerate(args):
        if names[i] == param or not isinstance(other, fx.Node):
            continue
        if other is value or (aliases.aliased(other, value) and not _disjoint(other, value)):
            raise CompileDonationError(
                f"op {op_name!r}: argument {param!r} is donated to maybe_inplace ({where(node)}) but the same "
                f"memory ({_describe(value)}) is also passed as {names[i]!r}; an in-place kernel would read "
                "what it overwrites. Pass distinct tensors or use the default overload."
            )


def _disjoint(a: fx.Node, b: fx.Node) -> bool:
    """Two values of one storage that provably share no element (column slices of one tensor,
    e.g. q and k split from qkv), by their fake values; clone cleanup still treats them as aliases."""
    va, vb = value_of(a), value_of(b)
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
        return False
    for v in (va, vb):  # decide on plain integers only: never guard on a symbolic size
        facts = (*v.stride(), *v.shape[1:], v.storage_offset())
        if not all(type(f) is int for f in facts):
            return False
    try:
        return disjoint_rows(va, vb)
    except Exception:  # symbolic sizes or strides that cannot be decided: not proven
        return False


#: Views that may address any element of their storage, not only their source's.
_ESCAPING_VIEWS = frozenset(
    {torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_.default, torch.as_strided, "as_strided", "set_"}
)


def _disjoint_lineage(alias: fx.Node, value: fx.Node, aliases: AliasAnalysis) -> bool:
    """``alias``, or a tensor it was viewed from, provably shares no element with ``value``.

    A view addresses only elements of its source (``as_strided`` excepted), so once ``v`` split
    from ``qkv`` is disjoint from the donated ``q``, ``v.view(...).transpose(...)`` is too.
    """
    node, seen = alias, set()
    while node not in seen:
        seen.add(node)
        if _disjoint(node, value):
            return True
        sources = aliases.view_sources(node)
        if node.target in _ESCAPING_VIEWS or len(sources) != 1 or sources[0] is value:
            return False
        node = sources[0]
    return False


def _check_no_later_use(op_name: str, node: fx.Node, param: str, value: fx.Node, aliases: AliasAnalysis) -> None:
    later = aliases.uses_from(value, aliases.position[node] + 1)
    # A view of the same storage that shares no element with the donated value (v, when q and
    # k split from one qkv are donated, and any view of v) reads nothing the kernel writes.
    later = [(user, alias) for user, alias in later if alias is value or not _disjoint_lineage(alias, value, aliases)]
    if not later:
        return
    user, alias = later[0]
    via = "" if alias is value else f" through its view/alias {alias.name!r}"
    if user.op == "output":
        use = (
            f"is returned from the compiled graph{via} (node 'output'): a donated tensor must not be used "
            "after the call, including in code after a graph break"
        )
    else:
        use = f"is used afterwards{via} by {where(user)}"
    raise CompileDonationError(
        f"op {op_name!r}: argument {param!r} ({_describe(value)}) is donated to maybe_inplace "
        f"({where(node)}) but {use}. An in-place kernel may have overwritten it: use the default overload "
        f"{op_name}(...) or clone the tensor before donating it."
    )
