"""The torch.compile pipeline of vllm-ir: functionalization, fusion, lowering, clone cleanup.

``torch.compile(model, options=vllm_ir.inductor_options())`` or ``vllm_ir.compile(model)``;
see `vllm_ir.passes.entry` for where each pass runs in Inductor.

Importing this package is cheap: Inductor (several seconds to import) is loaded on first use,
so ``import vllm_ir`` stays fast for eager users.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from vllm_ir.passes.fusion import IrFusion

#: Public name -> submodule defining it (loaded on first access).
_LAZY = {
    "AliasAnalysis": "aliasing",
    "CloneCleanupPass": "clone_cleanup",
    "ChainedPass": "entry",
    "IrPipelinePass": "entry",
    "record_of": "entry",
    "CompileDonationError": "errors",
    "LoweringError": "errors",
    "UnloweredWarning": "errors",
    "Donation": "functionalize",
    "FunctionalizeInplacePass": "functionalize",
    "FunctionalizeReport": "functionalize",
    "functionalize": "functionalize",
    "AddRmsNormFusion": "fusion",
    "FusionPass": "fusion",
    "IrFusion": "fusion",
    "ir_call": "fusion",
    "LoweringPass": "lowering",
    "trace_impl": "lowering",
    "CloneDecision": "record",
    "GraphReport": "record",
    "PipelineRecord": "record",
    "last_selected_impls": "record",
}


def inductor_options(
    *,
    on_unlowered: Literal["error", "warn"] = "error",
    fusions: Sequence[IrFusion] | None = None,
    **user_options: Any,
) -> dict[str, Any]:
    """Inductor options running the vllm-ir pipeline (see `vllm_ir.passes.entry.inductor_options`)."""
    from vllm_ir.passes import entry

    return entry.inductor_options(on_unlowered=on_unlowered, fusions=fusions, **user_options)


def compile(
    model: Callable[..., Any] | None = None,
    *,
    options: dict[str, Any] | None = None,
    mode: str | None = None,
    dynamic: bool | None = None,
    backend: str = "inductor",
    on_unlowered: Literal["error", "warn"] = "error",
    fusions: Sequence[IrFusion] | None = None,
    **torch_compile_kwargs: Any,
) -> Any:
    """``torch.compile`` with the vllm-ir pipeline (see `vllm_ir.passes.entry.compile`)."""
    from vllm_ir.passes import entry

    return entry.compile(
        model,
        options=options,
        mode=mode,
        dynamic=dynamic,
        backend=backend,
        on_unlowered=on_unlowered,
        fusions=fusions,
        **torch_compile_kwargs,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vllm_ir.passes' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"vllm_ir.passes.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = sorted(["compile", "inductor_options", *_LAZY])
