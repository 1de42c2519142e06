"""vllm-ir: declare LLM-inference ops once, pick a kernel per call from a priority list.

import vllm_ir
y = vllm_ir.ops.rms_norm(x, weight, 1e-6)
print(vllm_ir.ops.rms_norm.explain(x, weight, 1e-6))
"""

from vllm_ir.errors import (
    DonationError,
    FallbackError,
    FallbackWarning,
    PredicateError,
    PriorityError,
    ProviderWarning,
    RegistrationError,
    ToleranceError,
    UnknownOpError,
    VllmIrError,
)
from vllm_ir.ir import declarations as _declarations  # noqa: F401  (registers the core ops)
from vllm_ir.ir import priority as _priority_module
from vllm_ir.ir.comparison import Comparison
from vllm_ir.ir.dispatch.decision_cache import dispatch_stats, reset_dispatch_stats
from vllm_ir.ir.dispatch.selection import Decision, Explanation, Verdict
from vllm_ir.ir.impl import IrOpImpl, Unsupported
from vllm_ir.ir.op import IrOp, register_op
from vllm_ir.ir.priority import (
    PriorityEntry,
    PriorityLayer,
    clear_priority,
    priority,
    reference,
    reload_env,
    set_priority,
)
from vllm_ir.ir.registry import ops, ops_implemented_by
from vllm_ir.plugins import discovery as _plugins
from vllm_ir.plugins.discovery import (
    PluginError,
    ProviderRecord,
    ProviderStatus,
    current_platform,
    load_provider,
    load_providers,
    provider_records,
)
from vllm_ir.plugins.hookspecs import hookimpl
from vllm_ir.plugins.platforms import Platform
from vllm_ir.plugins.provider import Provider
from vllm_ir.settings import log as _log
from vllm_ir.settings.env import ConfigError, ConfigWarning

_log.configure_from_env()
_plugins.install()
if _priority_module.process_traced:  # VLLM_IR_TRACE=1
    from vllm_ir.tools import tracing as _tracing

    _tracing.start_process_trace()

#: Loaded on first use: the compile pipeline imports Inductor, which ``import vllm_ir`` must not pay for.
_LAZY = {
    "compile": "vllm_ir.passes",
    "inductor_options": "vllm_ir.passes",
    "passes": "vllm_ir.passes",
    "trace": "vllm_ir.tools.tracing",
    "Trace": "vllm_ir.tools.tracing",
    "TraceExportError": "vllm_ir.tools.tracing",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vllm_ir' has no attribute {name!r}")
    import importlib

    loaded = importlib.import_module(module)
    return loaded if name == "passes" else getattr(loaded, name)


__version__ = "0.1.0"

__all__ = [
    "Comparison",
    "ConfigError",
    "ConfigWarning",
    "Platform",
    "PluginError",
    "ProviderRecord",
    "ProviderStatus",
    "current_platform",
    "hookimpl",
    "inductor_options",
    "load_provider",
    "load_providers",
    "provider_records",
    "Decision",
    "DonationError",
    "Explanation",
    "FallbackError",
    "FallbackWarning",
    "IrOp",
    "IrOpImpl",
    "PredicateError",
    "PriorityEntry",
    "PriorityError",
    "Provider",
    "ProviderWarning",
    "PriorityLayer",
    "RegistrationError",
    "ToleranceError",
    "Unsupported",
    "UnknownOpError",
    "Verdict",
    "VllmIrError",
    "clear_priority",
    "compile",
    "dispatch_stats",
    "ops",
    "ops_implemented_by",
    "priority",
    "register_op",
    "reference",
    "reload_env",
    "reset_dispatch_stats",
    "set_priority",
    "trace",
    "Trace",
    "TraceExportError",
]
