"""Post-grad clean-up: remove every clone that provably changes nothing.

Every ``aten.clone`` of the graph is examined: the clones lowering put in front of in-place
kernels (tagged, reported with their op and argument) and any other clone left in the graph.
Replacing ``c = clone(v)`` by ``v`` makes ``c`` and ``v`` one buffer, which is safe only when
nothing can tell (`AliasAnalysis` gives the aliases of each, ``aliasing.writes`` who writes):

1. **Writes to the copy** (the in-place kernel writing ``c``, an ``add_``/``copy_``/``out=``
   on ``c`` or a view of it) would reach ``v``. Allowed only when no alias of ``v`` (views,
   bases, anything sharing its storage) is read at or after the first such write -- the
   graph output included -- and ``v`` is not memory the caller still owns: it must not alias
   a graph input or a constant, unless it *is* a graph input donated with ``maybe_inplace``
   (exactly its memory: `aliasing.same_memory`). Donations are recorded by the pre-grad pass
   on the IR node and carried by lowering's clone tags.
2. **Writes to the original** after the clone would reach ``c``: allowed only when no alias
   of ``c`` is read at or after the first such write.
3. **Outputs.** If ``c`` is returned, ``v`` must not alias a graph input or a constant (the
   caller would get its own tensor back, unless it donated it), nor be returned itself (two
   outputs would become one tensor).
4. The clone must not change the layout (shape, strides, dtype, device).

A clone that is never written, and whose original is not written while the clone is read,
is removed whatever it copies: read-only clones of graph inputs go. Otherwise it stays and
the report says why. Decisions are taken in graph order on the current graph: after a
removal ``c`` and ``v`` are one alias class, and later decisions see that.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from vllm_ir.passes import cache
from vllm_ir.passes.aliasing import AliasAnalysis, same_memory
from vllm_ir.passes.lowering import CLONE_META
from vllm_ir.passes.nodes import bound_args, donated_params, input_name, ir_nodes, ir_op_of, value_of
from vllm_ir.passes.record import CloneDecision, GraphReport
from vllm_ir.settings.log import get_logger

log = get_logger("passes")

#: Removal reasons (the report's ``reason`` of a removed clone).
UNUSED = "the copy is never read"
DONATED = "donated graph input"
DEAD_AFTER_KERNEL = "not used after the kernel"
DEAD_AFTER_WRITE = "the original is not used after the copy is written"
READ_ONLY = "only read: neither the copy nor the original is written while the copy is in use"


def is_clone(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.aten.clone.default


class CloneCleanupPass(CustomGraphPass):
    """Remove the clones that no use can observe (see module docstring)."""

    def __call__(
        self,
        graph: fx.Graph,
        report: GraphReport | None = None,
        *,
        donated_inputs: Iterable[fx.Node | int] = (),
    ) -> None:
        """Clean ``graph``, adding each decision to ``report``.

        :param donated_inputs: graph inputs (placeholders, or their indices) the caller gave
            up, besides those named by the IR nodes' donation marks.
        """
        clones = [n for n in graph.nodes if is_clone(n)]
        if not clones:
            return
        aliases = AliasAnalysis(graph)
        donated = _donated_placeholders(graph, clones, donated_inputs)
        for clone in clones:
            info = clone.meta.pop(CLONE_META, None)
            removed, reason = decide(clone, aliases, donated, lowered=info is not None)
            if removed:
                source = clone.args[0]
                aliases.union(clone, source)
                clone.replace_all_uses_with(source)
                graph.erase_node(clone)
            if info is not None:
                what = f"argument {info['param']} of {info['op']} node {info['ir_node']}"
            else:
                what = "not inserted by lowering"
            log.debug("clone cleanup: %s %s (%s): %s", "removed" if removed else "kept", clone.name, what, reason)
            if report is not None:
                if info is not None:
                    decision = CloneDecision(clone.name, info["op"], info["ir_node"], info["param"], removed, reason)
                else:  # the model's own clone (or Inductor's): no IR op behind it
                    decision = CloneDecision(clone.name, "", "", "", removed, reason)
                report.clones.append(decision)

    def uuid(self) -> str:
        return cache.combine("clone_cleanup", cache.package_fingerprint())


def _donated_placeholders(graph: fx.Graph, clones: list[fx.Node], extra: Iterable[fx.Node | int]) -> set[fx.Node]:
    """Graph inputs the caller donated: named by lowering's clone tags, by IR nodes left in the
    graph (their donation marks), and by ``extra``."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    donated: set[fx.Node] = set()
    for item in extra:
        donated.add(placeholders[item] if isinstance(item, int) else item)
    for clone in clones:
        info = clone.meta.get(CLONE_META)
        source = clone.args[0] if clone.args else None
        if info is not None and info["donated"] and isinstance(source, fx.Node):
            # The donated activation, or a tensor that is exactly the input's memory.
            donated.update(p for p in placeholders if same_memory(source, p))
    for node in ir_nodes(graph):  # unlowered (on_unlowered="warn")
        op = ir_op_of(node)
        params = donated_params(node)
        if op is None or not params:
            continue
        args = bound_args(op, node)
        for param, index in zip(op.activations, op.activation_indices, strict=True):
            value = args[index]
            if param in params and isinstance(value, fx.Node):
                donated.update(p for p in placeholders if same_memory(value, p))
    return donated


def decide(clone: fx.Node, aliases: AliasAnalysis, donated: set[fx.Node], lowered: bool = False) -> tuple[bool, str]:
    """``(removable, reason)`` for ``clone`` (see the module docstring for the rules).

    :param donated: graph inputs the caller donated.
    :param lowered: the clone protects an in-place kernel's argument (the reasons say "kernel").
    """
    source = clone.args[0] if clone.args else None
    if not isinstance(source, fx.Node):
        return False, "the cloned value is not a graph value"
    if not clone.users:
        return True, UNUSED
    if not _same_layout(clone, source):
        return False, "the copy's layout (shape, strides, dtype or device) differs from the original's"
    position = aliases.position
    start = position[clone]
    copy_readers = aliases.readers(clone)
    copy_writers = [user for user, _ in aliases.writers(clone) if position[user] > start]
    source_writers = [user for user, _ in aliases.writers(source) if position[user] > start and user is not clone]

    # 1. A write to the copy would reach the original.
    if copy_writers:
        owned = _caller_owned(source, aliases, donated)
        if owned is not None:
            return False, owned
        writer = copy_writers[0]
        later = aliases.uses_from(source, position[writer], exclude=(clone,))
        if later:
            user, alias = later[0]
            via = "" if alias is source else f" through its alias {alias.name!r}"
            what = "the graph output" if user.op == "output" else f"node {user.name!r}"
            when = "the in-place kernel" if lowered else f"{writer.name!r} writes the copy"
            return False, f"{source.name!r} is used{via} by {what} at or after {when}"

    # 2. A write to the original would reach the copy.
    if source_writers:
        writer = source_writers[0]
        last = max(position[user] for user, _ in copy_readers)
        if last >= position[writer]:
            return False, f"{source.name!r} is written by {writer.name!r} while the copy is still read"

    # 3. Returning the copy must not return the caller's memory, nor one buffer twice.
    if any(user.op == "output" for user, _ in copy_readers):
        if any(user.op == "output" for user, _ in aliases.uses_from(source, 0, exclude=(clone,))):
            return False, f"the copy and {source.name!r} are both returned: the outputs would share memory"
        if _donated_input(source, donated) is None:
            owned = _caller_owned(source, aliases, donated, returned=True)
            if owned is not None:
                return False, owned

    if copy_writers:
        if _donated_input(source, donated) is not None:
            return True, DONATED
        return True, DEAD_AFTER_KERNEL if lowered else DEAD_AFTER_WRITE
    return True, READ_ONLY


def _caller_owned(source: fx.Node, aliases: AliasAnalysis, donated: set[fx.Node], returned: bool = False) -> str | None:
    """Why ``source`` is memory the caller still owns (None: it is not)."""
    for member in aliases.members(source):
        if member.op == "get_attr":
            return f"aliases the constant {member.name!r}"
        if member.op != "placeholder":
            continue
        if returned:
            return f"the copy is returned and {source.name!r} aliases graph input {input_name(member)}"
        if not same_memory(source, member):
            return f"aliases graph input {input_name(member)} (a view or alias of it is cloned)"
        if member not in donated:
            what = "is" if member is source else "is the memory of"
            return f"{what} graph input {input_name(member)}, not donated with maybe_inplace (module state never is)"
    return None


def _donated_input(source: fx.Node, donated: set[fx.Node]) -> fx.Node | None:
    """The donated graph input ``source`` is (itself, or exactly its memory: ``x.add_(y)``)."""
    for placeholder in donated:
        if same_memory(source, placeholder):
            return placeholder
    return None


def _same_layout(a: fx.Node, b: fx.Node) -> bool:
    """Same shape, strides, dtype, device and conj/neg bits (per the fake values)."""
    va, vb = value_of(a), value_of(b)
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
        return False
    from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

    return (
        va.layout == vb.layout
        and va.dtype == vb.dtype
        and va.device == vb.device
        and statically_known_true(sym_eq(va.size(), vb.size()))
        and (va.layout != torch.strided or statically_known_true(sym_eq(va.stride(), vb.stride())))
        and va.is_conj() == vb.is_conj()
        and va.is_neg() == vb.is_neg()
    )
