"""Defining IR ops in the ``vllm_ir`` torch library namespace.

Each op gets its own `torch.library.Library` fragment so a refused registration can be
undone completely. The kernel is registered for ``CompositeExplicitAutograd`` (AOTAutograd
keeps the op as one node instead of decomposing it) and the fake delegates to the op's
current fake function, which `IrOp.register_fake` may replace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from vllm_ir.errors import RegistrationError

if TYPE_CHECKING:
    from vllm_ir.ir.op import IrOp

NAMESPACE = "vllm_ir"
MAYBE_INPLACE = "maybe_inplace"


def define(op: IrOp, run_functional: Callable[..., Any]) -> torch.library.Library:
    """Define ``vllm_ir::<op>`` (and ``.maybe_inplace``); undo everything on failure."""
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    overloads = [op.name] + ([f"{op.name}.{MAYBE_INPLACE}"] if op.allow_inplace else [])
    try:
        for qualname in overloads:
            lib.define(f"{qualname}{op.schema}")
            # Outside our eager fast path (a direct torch.ops call, or a compiled graph that
            # kept the node) both overloads keep the functional contract: "maybe" in-place
            # permits reuse of the inputs, it never requires it.
            lib.impl(qualname, run_functional, "CompositeExplicitAutograd")
            torch.library.register_fake(f"{NAMESPACE}::{qualname}", lambda *args: op.fake_fn(*args), lib=lib)
    except Exception as exc:
        lib._destroy()
        raise RegistrationError(
            f"op {op.name!r}: cannot define torch.ops.{NAMESPACE}.{op.name}: {exc}", op=op.name
        ) from exc
    return lib


def overload(op_name: str, name: str = "default") -> torch._ops.OpOverload:
    return getattr(getattr(torch.ops, NAMESPACE), op_name).__getattr__(name)
