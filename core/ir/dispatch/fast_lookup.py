"""The compiled cache-hit path of eager dispatch (``vllm_ir.ir.dispatch._fast_lookup``), when it is there.

Building a decision-cache key in Python is most of the cost of a call that must consult a
predicate (~0.5 us of ~0.9 us). The extension builds the same kind of key from the
TensorImpl in one C call and looks it up; everything else (misses, tracing, tensor
subclasses, errors) stays in the Python path it falls back to. It is compiled against the
installed torch (``pip install --no-build-isolation``) and refuses to load under another.
``VLLM_IR_FAST_LOOKUP=0`` (or ``false``/``no``/``off``) turns it off.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch  # also loads the libraries the extension links against

from vllm_ir.settings import env

if TYPE_CHECKING:
    from vllm_ir.ir.op import IrOp

ENV_VAR = env.ENV_FAST_LOOKUP
#: What torch.compiler.is_compiling() returns outside TorchScript; the lookup reads it directly.
COMPILING_FLAG = "_is_compiling_flag"
#: The key holds one bit per parameter in a 64-bit mask; larger ops use the Python path.
MAX_PARAMETERS = 64


def _load() -> tuple[ModuleType | None, str | None]:
    # One boolean parser for every variable (vllm_ir.settings.env): 0/false/no/off turn it off; a
    # malformed value leaves it on, with a warning and a `vllm-ir doctor` problem.
    if not env.read_bool(ENV_VAR, True):
        return None, f"turned off by {ENV_VAR}={os.environ[ENV_VAR].strip()}"
    if not isinstance(vars(torch.compiler).get(COMPILING_FLAG), bool):
        return None, f"torch {torch.__version__} has no torch.compiler.{COMPILING_FLAG}, which it reads"
    try:
        from vllm_ir.ir.dispatch import _fast_lookup
    except ModuleNotFoundError:
        return None, "not built (install vllm-ir with --no-build-isolation and a C++ compiler to build it)"
    except ImportError as e:  # built for another torch, or its libraries did not resolve
        return None, f"not loadable: {e}"
    return _fast_lookup, None


_module, unavailable_reason = _load()
#: ``call_facts(args, tensor_indices, token_indices, first)``: what the trace records of a call,
#: in one C call (`vllm_ir.ir.dispatch.observe.python_call_facts` is its reference), or None.
call_facts = getattr(_module, "call_facts", None)
#: ``Recorder(max_events, max_samples, max_shape_sets, outside)``: what a trace's compiled runners
#: record (`vllm_ir.tools.tracing.Trace` reads it back), or None without the extension.
Recorder = getattr(_module, "Recorder", None)
#: ``TracedRunner(...)``: a traced decision's runner in one C call (`vllm_ir.ir.dispatch.observe`
#: builds them; its Python runner is the reference and where it hands over), or None.
TracedRunner = getattr(_module, "TracedRunner", None)


def available() -> bool:
    return _module is not None


def describe() -> str:
    """One line for ``vllm-ir doctor``."""
    if _module is None:
        return f"pure Python ({unavailable_reason})"
    return f"compiled (vllm_ir.ir.dispatch._fast_lookup, built for torch {_module.BUILT_FOR_TORCH})"


def make_lookup(op: IrOp, fixed: dict, decisions: dict, scope_var: Any) -> Any | None:
    """The C lookup over an op's two decision dicts, or None without the extension."""
    names = list(op.signature.parameters)
    if _module is None or len(names) > MAX_PARAMETERS:
        return None
    mask = sum(1 << names.index(name) for name in op.tensor_params)
    token_mask = sum(1 << names.index(name) for name in op.token_params)
    return _module.Lookup(fixed, decisions, scope_var, vars(torch.compiler), mask, token_mask, len(names))


def donation_conflict_checker(op: IrOp) -> tuple[Any, Any, Any]:
    """``(check, donated, tensors)``: ``check(donated, tensors, *args) -> (i, j) | None`` for
    ``maybe_inplace`` calls of ``op`` (see vllm_ir.ir.dispatch.donation), compiled where possible."""
    if _module is None or len(op.signature.parameters) > MAX_PARAMETERS:
        from vllm_ir.ir.dispatch.donation import donation_conflict

        return (lambda d, t, *args: donation_conflict(d, t, args)), op.activation_indices, op.tensor_param_indices
    donated_mask = sum(1 << i for i in op.activation_indices)
    tensor_mask = sum(1 << i for i in op.tensor_param_indices)
    return _module.donation_conflict, donated_mask, tensor_mask
