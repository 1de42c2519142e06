"""Which FX nodes may share memory: the basis of the donation check and of clone cleanup.

Two values are put in the same alias class when either source of evidence says they may
share storage: the op schema (a returned ``Tensor(a)`` aliases the argument annotated
``(a)`` or ``(a!)``) or the fake values (same untyped storage). Nodes whose aliasing cannot
be determined are assumed to alias every tensor they take. Classes only ever merge, so the
analysis errs towards "aliased": a clone may be kept needlessly, never removed wrongly.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from vllm_ir.passes.nodes import value_of

#: Ops whose schema does not say so but whose result shares its input's storage.
_UNANNOTATED_VIEWS = {torch.ops.aten._unsafe_view.default}


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _storage_key(t: torch.Tensor) -> StorageWeakRef | None:
    try:
        return StorageWeakRef(t.untyped_storage())
    except Exception:  # tensors without storage (e.g. some subclasses): no evidence
        return None


def _arg_nodes(args: Iterable[Any]) -> Iterator[fx.Node]:
    for a in args:
        if isinstance(a, fx.Node):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _arg_nodes(a)


def _schema_aliases(node: fx.Node, schema: torch._C.FunctionSchema, out_index: int | None) -> list[fx.Node]:
    """Arguments that output ``out_index`` (None: the single output) may alias per the schema."""
    returns = schema.returns
    if out_index is not None and out_index < len(returns):
        ret = [returns[out_index]]
    else:
        ret = list(returns)
    sets: set[str] = set()
    wildcard = False
    for r in ret:
        if r.alias_info is not None:
            sets |= set(r.alias_info.after_set) | set(r.alias_info.before_set)
        elif not isinstance(r.type, torch.TensorType):  # Tensor[] / Tensor? results: be generous
            wildcard = True
    if not sets and not wildcard:
        return []
    out: list[fx.Node] = []
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None:
            continue
        arg_sets = set(info.before_set) | set(info.after_set)
        if not (wildcard or "*" in arg_sets or sets & arg_sets or "*" in sets):
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        out.extend(_arg_nodes([value]))
    return out


class AliasAnalysis:
    """Alias classes over a graph (union-find), with graph positions for "used after" queries."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.position: dict[fx.Node, int] = {}
        self._parent: dict[fx.Node, fx.Node] = {}
        self._members: dict[fx.Node, list[fx.Node]] = {}
        by_storage: dict[StorageWeakRef, fx.Node] = {}
        for i, node in enumerate(graph.nodes):
            self.position[node] = i
            self._parent[node] = node
            self._members[node] = [node]
            for other in self._direct_aliases(node):
                self.union(node, other)
            for t in _tensors(value_of(node)):
                key = _storage_key(t)
                if key is None:
                    continue
                first = by_storage.setdefault(key, node)
                if first is not node:
                    self.union(first, node)

    # -- classes ------------------------------------------------------------------------

    def find(self, node: fx.Node) -> fx.Node:
        parent = self._parent
        root = node
        while parent[root] is not root:
            root = parent[root]
        while parent[node] is not root:
            parent[node], node = root, parent[node]
        return root

    def union(self, a: fx.Node, b: fx.Node) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is rb:
            return
        if len(self._members[ra]) < len(self._members[rb]):
            ra, rb = rb, ra
        self._parent[rb] = ra
        self._members[ra].extend(self._members.pop(rb))

    def members(self, node: fx.Node) -> list[fx.Node]:
        """Every node that may share memory with ``node`` (itself included)."""
        return [m for m in self._members[self.find(node)] if not m._erased]

    def aliased(self, a: fx.Node, b: fx.Node) -> bool:
        return self.find(a) is self.find(b)

    def uses_from(self, node: fx.Node, start: int, exclude: Iterable[fx.Node] = ()) -> list[tuple[fx.Node, fx.Node]]:
        """``(user, alias)`` pairs: nodes at position >= ``start`` reading any alias of ``node``."""
        skip = set(exclude)
        found = []
        for member in self.members(node):
            if member in skip:
                continue
            for user in member.users:
                if user in skip:
                    continue
                pos = self.position.get(user)
                if pos is not None and pos >= start:
                    found.append((user, member))
        found.sort(key=lambda pair: self.position[pair[0]])
        return found

    # -- evidence from the node itself --------------------------------------------------

    def _direct_aliases(self, node: fx.Node) -> list[fx.Node]:
        if node.op in ("placeholder", "get_attr", "output"):
            return []
        target = node.target
        if node.op == "call_function" and target is operator.getitem:
            source = node.args[0]
            if not isinstance(source, fx.Node):
                return []
            if isinstance(source.target, torch._ops.OpOverload) and isinstance(node.args[1], int):
                return _schema_aliases(source, source.target._schema, node.args[1])
            if isinstance(value_of(source), (list, tuple)) and value_of(node) is not None:
                return []  # the fake values are the evidence (storage pass)
            return [source]
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
            if target in _UNANNOTATED_VIEWS:
                return list(_arg_nodes(node.args[:1]))
            if len(target._schema.returns) > 1:
                return []  # per output, through getitem
            return _schema_aliases(node, target._schema, None)
        if value_of(node) is not None:
            # Pre-grad torch functions and methods ran on fake tensors: their storages tell.
            return []
        return list(_arg_nodes([node.args, node.kwargs]))
