"""Recognising IR nodes in FX graphs and reading their arguments the way the op declares them."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import fx

from vllm_ir.ir import registry, torch_library
from vllm_ir.ir.op import IrOp

#: Key in ``node.meta["custom"]`` (copied by AOTAutograd onto the nodes it derives) under
#: which the pre-grad pass records which parameters of an IR call were donated.
META_KEY = "vllm_ir"
_PACKAGE_DIR = Path(__file__).resolve().parent.parent


def ir_target(node: fx.Node) -> torch._ops.OpOverload | None:
    """The ``torch.ops.vllm_ir`` overload ``node`` calls, if any."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    if node.target.namespace != torch_library.NAMESPACE:
        return None
    return node.target


def ir_op_of(node: fx.Node) -> IrOp | None:
    """The registered op behind an IR node (None for other nodes and unknown ``vllm_ir`` ops)."""
    target = ir_target(node)
    if target is None:
        return None
    name = target._opname
    return registry.get_op(name) if registry.has_op(name) else None


def is_maybe_inplace(node: fx.Node) -> bool:
    target = ir_target(node)
    return target is not None and target._overloadname == torch_library.MAYBE_INPLACE


def ir_nodes(graph: fx.Graph) -> Iterator[fx.Node]:
    """Every node calling a ``torch.ops.vllm_ir`` overload, in graph order."""
    for node in graph.nodes:
        if ir_target(node) is not None:
            yield node


def bound_args(op: IrOp, node: fx.Node) -> tuple[Any, ...]:
    """The node's arguments in the op's parameter order, defaults filled in.

    AOTAutograd drops trailing defaults and may pass arguments by keyword; patterns and
    dispatch want the op's full positional form.
    """
    bound = op.signature.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.values())


def normalize(op: IrOp, node: fx.Node) -> None:
    """Rewrite an IR node to the full positional form (one pattern per op then matches every call)."""
    args = bound_args(op, node)
    if node.args != args or node.kwargs:
        node.args = args
        node.kwargs = {}


def canonicalize(op: IrOp, node: fx.Node) -> None:
    """Back to the form AOTAutograd emits (trailing defaults dropped), which Inductor expects
    for a call it keeps as an opaque kernel."""
    args = list(bound_args(op, node))
    params = list(op.signature.parameters.values())
    while args and params[len(args) - 1].default is not inspect.Parameter.empty:
        if args[-1] is not params[len(args) - 1].default and args[-1] != params[len(args) - 1].default:
            break
        args.pop()
    node.args = tuple(args)
    node.kwargs = {}


def value_of(node: fx.Node) -> Any:
    """The fake value a node produces (``val`` after AOTAutograd, ``example_value`` before it)."""
    meta = node.meta
    if "val" in meta:
        return meta["val"]
    return meta.get("example_value")


def fake_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Replace every node in ``args`` by its fake value (lists included)."""

    def one(a: Any) -> Any:
        if isinstance(a, fx.Node):
            value = value_of(a)
            if value is None:
                raise ValueError(f"node {a.name!r} has no fake value (meta['val'])")
            return value
        if isinstance(a, (list, tuple)):
            return type(a)(one(x) for x in a)
        return a

    return tuple(one(a) for a in args)


def donated_params(node: fx.Node) -> tuple[str, ...]:
    """Parameters of an IR node that the pre-grad pass found donated by ``maybe_inplace``."""
    return tuple(node.meta.get("custom", {}).get(META_KEY, {}).get("donated", ()))


def mark_donated(node: fx.Node, params: tuple[str, ...]) -> None:
    custom = dict(node.meta.get("custom") or {})
    custom[META_KEY] = {**custom.get(META_KEY, {}), "donated": tuple(params)}
    node.meta["custom"] = custom


def where(node: fx.Node) -> str:
    """``node 'name' at file, line N, in fn: `code``` for the user code that created ``node``.

    Frames of vllm-ir itself (the generated ``op(...)`` entry points) are skipped.
    """
    trace = node.meta.get("stack_trace")
    if not trace:
        return f"node {node.name!r}"
    lines = [line.strip() for line in trace.strip().splitlines()]
    frames = [i for i, line in enumerate(lines) if line.startswith("File ")]
    user = [i for i in frames if not _is_internal(lines[i])]
    if not (user or frames):
        return f"node {node.name!r}"
    i = (user or frames)[-1]
    loc = lines[i][len("File ") :].replace('"', "")
    code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
    return f"node {node.name!r} at {loc}" + (f": `{code}`" if code else "")


def _is_internal(frame_line: str) -> bool:
    return '"<vllm_ir.' in frame_line or f"{_PACKAGE_DIR}" in frame_line


def input_name(node: fx.Node) -> str:
    """A graph input as the user knows it (Dynamo's source, e.g. ``L['residual']``)."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is not None:
        name = source.name  # a property in torch 2.13, a method before
        return str(name() if callable(name) else name)
    return node.name
