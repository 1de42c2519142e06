"""vllm-ir provider ``vllm_c``: C++ kernels, one module per op family (``layernorm``: ``rms_norm``
and ``fused_add_rms_norm``).

Importing this module (vllm-ir does it through the ``vllm_ir.providers`` entry point) loads the
``vllm_ir_c`` torch library and registers the implementations. It never raises: when the
extension is missing, failed to build or was built against another torch, the implementations
are registered as unsupported with that reason, which ``vllm-ir providers list`` shows::

    import vllm_ir, vllm_ir_provider_vllm_c
    print(vllm_ir_provider_vllm_c.STATUS)
    with vllm_ir.priority(rms_norm=["vllm_c"]):
        y = vllm_ir.ops.rms_norm(x, weight, 1e-6)

Op families are found, not listed: every public module of this package (a name without a
leading underscore) is imported (`vllm_ir.plugins.provider.import_families`); it registers its kernels
through ``_extension.VLLM_C`` (a `vllm_ir.Provider`), or through a ``register(status)``
function, which is then called; its optional
``EAGER_FIRST`` maps platform names to the ops for which ``vllm_c`` goes first in eager mode
where no measured table speaks (see `vllm_ir_tuning_tables`). Adding an op therefore adds files
(csrc/cpu/<op>.cpp, csrc/cuda/<op>.cu, <op>.py) and edits none.

Eager order comes from measurement first: ``tuning/*.json`` are ``vllm-ir tune`` tables
(``--providers vllm_c,native``) measured on the machines they name; each applies only where its
machine facts hold (platform, CPU capability or GPU, this package's version), above the
defaults below. The ``EAGER_FIRST`` lists are the defaults for machines no table was measured on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

from vllm_ir.plugins.hookspecs import hookimpl
from vllm_ir.plugins.provider import default_fakes, import_families

from ._extension import PROVIDER, STATUS, ExtensionStatus

__version__ = "0.1.0"
__all__ = [
    "FAMILIES",
    "STATUS",
    "ExtensionStatus",
    "cpu_capability",
    "vllm_ir_default_priority",
    "vllm_ir_environment_variables",
    "vllm_ir_provider_facts",
    "vllm_ir_tuning_tables",
]


def _register_families(status: ExtensionStatus) -> tuple[ModuleType, ...]:
    """Import every op family module of this package (each registers its implementations), then
    give the library's ops that only write their arguments their fakes."""
    families = import_families(__name__, __path__)
    for module in families:
        if hasattr(module, "register"):
            module.register(status)
    if status.loaded:
        default_fakes("vllm_ir_c")
    return families


#: The op family modules, each registered.
FAMILIES: tuple[ModuleType, ...] = _register_families(STATUS)


def cpu_capability() -> str | None:
    """Which compiled CPU variant runs (DEFAULT, AVX2, AVX512, AVX512_BF16), or None without the extension."""
    if not STATUS.loaded:
        return None
    import torch

    return torch.ops.vllm_ir_c.cpu_capability()


@hookimpl
def vllm_ir_provider_facts() -> Mapping[str, str]:
    """For ``vllm-ir doctor`` / ``providers list``: the CPU variant running and how its 16-bit
    activation tables are read here (``activation.table_path``: fixed per machine)."""
    if not STATUS.loaded:
        return {"extension": f"not loaded: {STATUS.reason}"}
    from .activation import table_path

    return {"cpu_capability": str(cpu_capability()), "tables": table_path() or "unknown (library predates it)"}


@hookimpl
def vllm_ir_environment_variables() -> Mapping[str, str]:
    """What the kernels and the build read (README "VLLM_IR_C_TABLES"), so ``doctor`` knows them."""
    return {
        "VLLM_IR_C_TABLES": "16-bit activation tables: unset or 1 (per machine), 0, lookup, computed or measure",
        "VLLM_IR_C_CPU_CAPABILITY": "caps the CPU kernel variant (DEFAULT, AVX2, AVX512, AVX512_BF16)",
        "VLLM_IR_C_STRICT_BUILD": "1: a failed kernel build fails pip install (read at build time)",
    }


@hookimpl
def vllm_ir_default_priority(platform, mode: str) -> Mapping[str, Sequence[str]] | None:
    """Eager mode only: ``vllm_c`` first for the ops each family's ``EAGER_FIRST`` lists for
    this platform (where its kernels exist and measured faster; see the family modules).

    Not under compile: an opaque kernel stops Inductor from fusing the norm with its
    neighbours, and native lowering measured 8-23% faster on a norm-heavy decoder
    (benchmarks/compile_pipeline.py --no-linear).
    """
    if mode != "eager":
        return None
    ops = [op for family in FAMILIES for op in getattr(family, "EAGER_FIRST", {}).get(platform.name, ())]
    return {op: [PROVIDER] for op in ops} or None


#: The shipped tuning tables (package data).
TABLES = Path(__file__).with_name("tuning")


@hookimpl
def vllm_ir_tuning_tables(platform) -> Sequence[str] | None:
    """Every table this package ships: each names the machine facts it was measured under, and
    the tuning layer applies only those that hold here (so all are offered on every platform)."""
    return sorted(str(p) for p in TABLES.glob("*.json")) or None
