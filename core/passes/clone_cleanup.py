"""Post-grad clean-up: drop the clones lowering put in front of in-place kernels, when provably safe.

A clone ``c = clone(v)`` protects ``v`` from the in-place kernel that writes ``c``. Replacing
``c`` by ``v`` is safe only if nothing can observe the write:

* no alias of ``v`` (``v`` itself, its views and bases, anything sharing its storage per
  `AliasAnalysis`) is used from the first use of ``c`` onwards -- graph outputs included;
* ``v`` is not memory the caller still owns: it must not alias a graph input or a constant,
  unless it *is* a graph input that the user donated with ``maybe_inplace`` (recorded by the
  pre-grad pass in the IR node's metadata).

Otherwise the clone stays and the report says why. Every decision is taken on the current
graph: after a removal the kernel's outputs alias ``v``, and later decisions see that.
"""

from __future__ import annotations

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from vllm_ir.log import get_logger
from vllm_ir.passes import cache
from vllm_ir.passes.aliasing import AliasAnalysis
from vllm_ir.passes.lowering import CLONE_META
from vllm_ir.passes.nodes import input_name
from vllm_ir.passes.record import CloneDecision, GraphReport

log = get_logger("passes")


class CloneCleanupPass(CustomGraphPass):
    """Remove lowering's clones that no later use can observe (see module docstring)."""

    def __call__(self, graph: fx.Graph, report: GraphReport | None = None) -> None:
        clones = [n for n in graph.nodes if CLONE_META in n.meta]
        if not clones:
            return
        aliases = AliasAnalysis(graph)
        for clone in clones:
            info = clone.meta.pop(CLONE_META)
            source = clone.args[0]
            reason = unsafe_reason(clone, source, info["donated"], aliases)
            removed = reason is None
            if removed:
                reason = "donated graph input" if source.op == "placeholder" else "not used after the kernel"
                aliases.union(clone, source)
                clone.replace_all_uses_with(source)
                graph.erase_node(clone)
            log.debug(
                "clone cleanup: %s %s (argument %s of %s node %s): %s",
                "removed" if removed else "kept",
                clone.name,
                info["param"],
                info["op"],
                info["ir_node"],
                reason,
            )
            if report is not None:
                report.clones.append(
                    CloneDecision(clone.name, info["op"], info["ir_node"], info["param"], removed, reason)
                )

    def uuid(self) -> str:
        return cache.combine("clone_cleanup", cache.package_fingerprint())


def unsafe_reason(clone: fx.Node, source: object, donated: bool, aliases: AliasAnalysis) -> str | None:
    """Why ``clone`` must stay (None when removing it is safe)."""
    if not isinstance(source, fx.Node):
        return "the cloned value is not a graph value"
    if not clone.users:
        return None
    first = min(aliases.position[u] for u in clone.users)
    for member in aliases.members(source):
        if member.op == "get_attr":
            return f"aliases the constant {member.name!r}"
        if member.op != "placeholder":
            continue
        if member is not source:
            return f"aliases graph input {input_name(member)} (a view or alias of it is cloned)"
        if not donated:
            return f"is graph input {input_name(member)}, not donated with maybe_inplace (module state never is)"
    later = aliases.uses_from(source, first, exclude=(clone,))
    if later:
        user, alias = later[0]
        via = "" if alias is source else f" through its alias {alias.name!r}"
        what = "the graph output" if user.op == "output" else f"node {user.name!r}"
        return f"{source.name!r} is used{via} by {what} at or after the in-place kernel"
    return None
