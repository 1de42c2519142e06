"""The torch.compile pipeline of vllm-ir: functionalization, fusion, lowering, clone cleanup.

``torch.compile(model, options=vllm_ir.inductor_options())`` or ``vllm_ir.compile(model)``;
see `vllm_ir.passes.entry` for where each pass runs in Inductor.

What the passes decide (lowering choices with the providers skipped and why, donations,
clone removals, fusions, the cache uuid Inductor keys on) is logged at DEBUG on the
``vllm_ir.passes`` logger (``VLLM_IR_LOG_LEVEL=DEBUG``); only compiles log, never eager calls.

Importing this package is cheap: Inductor (several seconds to import) is loaded on first use,
so ``import vllm_ir`` stays fast for eager users.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> submodule defining it (loaded on first access).
_LAZY = {
    "AliasAnalysis": "aliasing",
    "CloneCleanupPass": "clone_cleanup",
    "compile_facts": "cache",
    "ChainedPass": "entry",
    "IrPipelinePass": "entry",
    "PipelineBackend": "entry",
    "compile": "entry",
    "inductor_options": "entry",
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
    "GraphFusion": "fusion",
    "QuantFusion": "quant_fusion",
    "AllReduceRmsNormFusion": "collective_fusion",
    "SequenceParallelism": "collective_fusion",
    "tensor_parallel_fusions": "collective_fusion",
    "collective_counts": "collective_fusion",
    "ir_call": "fusion",
    "LoweringPass": "lowering",
    "trace_impl": "lowering",
    "CloneDecision": "record",
    "GraphReport": "record",
    "PipelineRecord": "record",
    "last_selected_impls": "record",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vllm_ir.passes' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"vllm_ir.passes.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = sorted(_LAZY)
