"""Which FX values may share memory, and which nodes write them: the basis of the donation
check and of clone cleanup.

**Values, not nodes.** A node returning one tensor is one value. A node returning several
(a tuple or list: a multi-output op, ``split``, an opaque kernel returning two tensors) is a
*container*: each of its outputs is a value of its own (``(node, i)``, named in the graph by
``getitem(node, i)``), and the container itself holds no memory. Outputs of one node are
therefore only aliased when the evidence says so for each output: two fresh outputs of a
functional op are two storages; the outputs of an in-place kernel
``(Tensor(a!) x, Tensor(b!) r) -> (Tensor(a!), Tensor(b!))`` alias exactly ``x`` and ``r``.

Two values are put in the same alias class when either source of evidence says they may
share storage: the op schema (a returned ``Tensor(a)`` aliases the argument annotated
``(a)`` or ``(a!)``; a ``Tensor[]`` or ``Tensor?`` result any annotated argument) or the fake
values (same untyped storage). Nodes whose aliasing cannot be determined are assumed to alias
every tensor they take. Classes only ever merge, so the analysis errs towards "aliased": a
clone may be kept needlessly, never removed wrongly.

**Writes.** `writes` says whether a node may write the memory of one of its arguments: never
for the graph output or ``getitem``; for an ``OpOverload`` exactly the arguments its schema
marks ``(a!)`` (``add_``, ``copy_``, ``out=`` arguments, in-place custom kernels); for any
other callable (Python functions, higher-order ops, methods, modules) every tensor argument,
unless it is known to be functional.

**Identity.** `same_memory` is stronger than "aliased": the very same elements (``x`` and
``x.add_(y)``, which *is* ``x``; or two views with equal sizes, strides and offset). A write
through one is a write of exactly the other, and nothing else.
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

#: Output ``i`` of a container node (one returning a tuple or list of values).
Element = tuple[fx.Node, int]
#: What the classes are made of: single-valued nodes and outputs of containers.
Key = fx.Node | Element


def _functional_callables() -> frozenset[Any]:
    """Callables other than ``OpOverload``s known never to write their arguments."""
    found: set[Any] = {operator.getitem}
    higher_order = getattr(torch.ops, "higher_order", None)
    # auto_functionalized(_v2) runs a mutating op on copies of its inputs (a functional HOP).
    for name in ("auto_functionalized", "auto_functionalized_v2"):
        try:
            found.add(getattr(higher_order, name))
        except (AttributeError, RuntimeError):
            pass
    return frozenset(found)


_FUNCTIONAL_CALLABLES = _functional_callables()


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
        elif isinstance(a, dict):
            yield from _arg_nodes(a.values())


def _schema_arg(node: fx.Node, index: int, arg: torch._C.Argument) -> Any:
    """The value ``node`` passes for schema argument ``index`` (positional or keyword)."""
    if index < len(node.args) and not arg.kwarg_only:
        return node.args[index]
    return node.kwargs.get(arg.name)


def _schema_aliases(node: fx.Node, schema: torch._C.FunctionSchema, out_index: int | None) -> list[fx.Node]:
    """Arguments that output ``out_index`` (None: every output) may alias per the schema.

    ``out_index`` counts the schema's returns; for a single ``Tensor[]`` return it is an
    index into the list, and the list's annotation applies to every element.
    """
    returns = schema.returns
    ret = [returns[out_index]] if out_index is not None and out_index < len(returns) else list(returns)
    sets: set[str] = set()
    wildcard = False
    for r in ret:
        if not isinstance(r.type, torch.TensorType):
            # Tensor[] / Tensor? results carry their annotation on the element type: be generous.
            wildcard = True
        elif r.alias_info is not None:
            sets |= set(r.alias_info.after_set) | set(r.alias_info.before_set)
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
        out.extend(_arg_nodes([_schema_arg(node, i, arg)]))
    return out


def writes(user: fx.Node, value: fx.Node) -> bool:
    """Whether running ``user`` may write the memory ``value`` (one of its arguments) refers to.

    From the schema of an ``OpOverload`` (arguments annotated ``(a!)``: ``add_``, ``copy_``,
    ``out=``, custom ops with ``mutates_args``); the graph output and functional callables
    never write; anything else is assumed to write every tensor it takes.
    """
    if user.op in ("output", "placeholder", "get_attr"):
        return False
    if user.op != "call_function":
        return True  # call_method / call_module: unknown
    target = user.target
    if isinstance(target, torch._ops.OpOverload):
        for i, arg in enumerate(target._schema.arguments):
            info = arg.alias_info
            if info is not None and info.is_write and value in _arg_nodes([_schema_arg(user, i, arg)]):
                return True
        return False
    return target not in _FUNCTIONAL_CALLABLES


def _written_argument(node: fx.Node, schema: torch._C.FunctionSchema, ret: torch._C.Argument) -> fx.Node | None:
    """The argument a ``Tensor(a!)`` result *is* (in-place and ``out=`` ops return it as is)."""
    info = ret.alias_info
    if not isinstance(ret.type, torch.TensorType) or info is None or not info.is_write:
        return None
    found = [
        _schema_arg(node, i, arg)
        for i, arg in enumerate(schema.arguments)
        if arg.alias_info is not None
        and arg.alias_info.is_write
        and set(arg.alias_info.after_set) & set(info.after_set)
    ]
    return found[0] if len(found) == 1 and isinstance(found[0], fx.Node) else None


def identity_root(node: fx.Node) -> fx.Node:
    """The node whose tensor ``node`` is, following results of in-place and ``out=`` ops
    (``x.add_(y)`` is ``x``, also through ``getitem`` of a multi-output in-place op)."""
    seen: set[fx.Node] = set()
    while node not in seen:
        seen.add(node)
        source, ret = node, None
        if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            source, index = node.args[0], node.args[1]
            target = source.target
            if source.op == "call_function" and isinstance(target, torch._ops.OpOverload) and isinstance(index, int):
                returns = target._schema.returns
                ret = returns[index] if len(returns) > 1 and -len(returns) <= index < len(returns) else None
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            returns = node.target._schema.returns
            ret = returns[0] if len(returns) == 1 else None
        if ret is None:
            break
        arg = _written_argument(source, source.target._schema, ret)
        if arg is None:
            break
        node = arg
    return node


def same_memory(a: fx.Node, b: fx.Node) -> bool:
    """Whether ``a`` and ``b`` are provably the same elements of the same storage: the same
    tensor per the schemas (`identity_root`), or per the fake values (one storage, equal
    dtypes, sizes, strides and offsets, e.g. ``x`` and ``x[:, :]``)."""
    if a is b or identity_root(a) is identity_root(b):
        return True
    va, vb = value_of(a), value_of(b)
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
        return False
    ka, kb = _storage_key(va), _storage_key(vb)
    if ka is None or kb is None or ka != kb:
        return False
    from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

    return (
        va.dtype == vb.dtype
        and statically_known_true(sym_eq(va.size(), vb.size()))
        and statically_known_true(sym_eq(va.stride(), vb.stride()))
        and statically_known_true(va.storage_offset() == vb.storage_offset())
    )


class AliasAnalysis:
    """Alias classes over a graph's values (union-find), with graph positions for "used after" queries.

    Single-valued nodes stand for themselves; output ``i`` of a container node is the key
    ``(node, i)``. `members` lists nodes only (a container's outputs through their
    ``getitem`` nodes); `readers` also finds users of a container that read its outputs
    without a ``getitem`` (the graph output returning the whole tuple, say).
    """

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.position: dict[fx.Node, int] = {}
        self._parent: dict[Key, Key] = {}
        self._members: dict[Key, list[Key]] = {}
        #: Container node -> its output keys.
        self._elements: dict[fx.Node, list[Element]] = {}
        by_storage: dict[StorageWeakRef, Key] = {}

        def note_storages(key: Key, value: Any) -> None:
            for t in _tensors(value):
                storage = _storage_key(t)
                if storage is None:
                    continue
                first = by_storage.setdefault(storage, key)
                if first != key:
                    self.union(first, key)

        for i, node in enumerate(graph.nodes):
            self.position[node] = i
            value = value_of(node)
            if isinstance(value, (list, tuple)):
                elements = [(node, j) for j in range(len(value))]
                self._elements[node] = elements
                for j, element in enumerate(elements):
                    self._add(element)
                    for other in self._element_evidence(node, j, len(value)):
                        self.union(element, other)
                    note_storages(element, value[j])
                continue
            self._add(node)
            for other in self._direct_aliases(node):
                self.union(node, other)
            note_storages(node, value)

    # -- classes ------------------------------------------------------------------------

    def _add(self, key: Key) -> None:
        self._parent[key] = key
        self._members[key] = [key]

    def find(self, key: Key) -> Key:
        parent = self._parent
        if key not in parent:  # a node added to the graph after the analysis: its own class
            self._add(key)
        root = key
        while parent[root] != root:
            root = parent[root]
        while parent[key] != root:
            parent[key], key = root, parent[key]
        return root

    def union(self, a: Key, b: Key) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        if len(self._members[ra]) < len(self._members[rb]):
            ra, rb = rb, ra
        self._parent[rb] = ra
        self._members[ra].extend(self._members.pop(rb))

    def _keys(self, node: fx.Node) -> list[Key]:
        """The values ``node`` stands for: itself, or each output of a container."""
        return list(self._elements.get(node, ())) or [node]

    def members(self, node: fx.Node) -> list[fx.Node]:
        """Every node that may share memory with ``node`` (itself included).

        For a container: the nodes sharing memory with any of its outputs.
        """
        out: list[fx.Node] = []
        seen: set[fx.Node] = set()
        for key in self._keys(node):
            for m in self._members[self.find(key)]:
                if isinstance(m, fx.Node) and not m._erased and m not in seen:
                    seen.add(m)
                    out.append(m)
        return out

    def aliased(self, a: fx.Node, b: fx.Node) -> bool:
        """Whether ``a`` and ``b`` may share memory (a container: any of its outputs)."""
        roots = {self.find(k) for k in self._keys(a)}
        return any(self.find(k) in roots for k in self._keys(b))

    def readers(self, node: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
        """``(user, alias)`` pairs, in graph order: every node taking an alias of ``node``.

        ``alias`` is the node the user takes (for a container's output read without a
        ``getitem``, the container itself).
        """
        found: list[tuple[fx.Node, fx.Node]] = []
        seen: set[tuple[fx.Node, fx.Node]] = set()
        for key in self._keys(node):
            for member in self._members[self.find(key)]:
                if isinstance(member, fx.Node):
                    if member._erased:
                        continue
                    pairs = [(user, member) for user in member.users]
                else:
                    container = member[0]
                    if container._erased:
                        continue
                    # getitem users are members themselves (or read another output).
                    pairs = [(user, container) for user in container.users if not _is_getitem_of(user, container)]
                for pair in pairs:
                    if pair not in seen:
                        seen.add(pair)
                        found.append(pair)
        for user, _ in found:
            if user not in self.position:
                raise RuntimeError(f"node {user.name!r} was added to the graph after its alias analysis")
        found.sort(key=lambda pair: self.position[pair[0]])
        return found

    def uses_from(self, node: fx.Node, start: int, exclude: Iterable[fx.Node] = ()) -> list[tuple[fx.Node, fx.Node]]:
        """``(user, alias)`` pairs: nodes at position >= ``start`` reading any alias of ``node``."""
        skip = set(exclude)
        return [
            (user, alias)
            for user, alias in self.readers(node)
            if user not in skip and alias not in skip and self.position[user] >= start
        ]

    def writers(self, node: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
        """``(user, alias)`` pairs, in graph order: nodes that may write an alias of ``node``."""
        return [(user, alias) for user, alias in self.readers(node) if writes(user, alias)]

    # -- evidence from the node itself --------------------------------------------------

    def _element_evidence(self, node: fx.Node, index: int, count: int) -> list[Key]:
        """What output ``index`` of container ``node`` may alias, besides storage evidence."""
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
            out_index = index if len(target._schema.returns) == count else None
            return list(_schema_aliases(node, target._schema, out_index))
        if node.op == "call_function" and target is operator.getitem:
            # A tuple inside a tuple: its outputs alias whatever the outer output may alias.
            source, i = node.args[0], node.args[1]
            if isinstance(source, fx.Node) and source in self._elements and isinstance(i, int):
                return [self._elements[source][i]]
            return list(_arg_nodes(node.args[:1]))
        # Torch functions, methods and higher-order ops ran on fake tensors: their storages tell.
        return []

    def view_sources(self, node: fx.Node) -> list[fx.Node]:
        """The values ``node``'s result is a view of, or the same tensor as (an in-place op's input).

        Pre-grad torch functions and methods carry no alias annotation: there, the tensor
        arguments whose fake values share the result's storage.
        """
        if node.op in ("call_function", "call_method") and not isinstance(node.target, torch._ops.OpOverload):
            storages = {_storage_key(t) for t in _tensors(value_of(node))} - {None}
            if storages and node.target is not operator.getitem:
                return [
                    a for a in _arg_nodes([node.args, node.kwargs])
                    if {_storage_key(t) for t in _tensors(value_of(a))} & storages
                ]  # fmt: skip
        return [k for k in self._direct_aliases(node) if isinstance(k, fx.Node)]

    def _direct_aliases(self, node: fx.Node) -> list[Key]:
        if node.op in ("placeholder", "get_attr", "output"):
            return []
        target = node.target
        if node.op == "call_function" and target is operator.getitem:
            source, index = node.args[0], node.args[1]
            if not isinstance(source, fx.Node):
                return []
            if source in self._elements:  # one output of a container: that output only
                elements = self._elements[source]
                if isinstance(index, int) and -len(elements) <= index < len(elements):
                    return [elements[index]]
                return list(elements)
            if isinstance(source.target, torch._ops.OpOverload) and isinstance(index, int):
                return list(_schema_aliases(source, source.target._schema, index))
            return [source]  # indexing a tensor (a view), or a container of unknown outputs
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
            if target in _UNANNOTATED_VIEWS:
                return list(_arg_nodes(node.args[:1]))
            if len(target._schema.returns) > 1:
                # A container without fake values: each ``getitem`` takes its own output's
                # annotation; joining the outputs here would alias them with each other.
                return []
            return list(_schema_aliases(node, target._schema, None))
        if value_of(node) is not None:
            # Pre-grad torch functions and methods ran on fake tensors: their storages tell.
            return []
        out: list[Key] = []
        for arg in _arg_nodes([node.args, node.kwargs]):
            out.extend(self._keys(arg))
        return out


def _is_getitem_of(user: fx.Node, container: fx.Node) -> bool:
    return (
        user.op == "call_function"
        and user.target is operator.getitem
        and user.args[0] is container
        and isinstance(user.args[1], int)
    )
