"""vllm-ir provider ``vllm_c``: C++ kernels for ``rms_norm`` and ``fused_add_rms_norm``.

Importing this module (vllm-ir does it through the ``vllm_ir.providers`` entry point) loads the
``vllm_ir_c`` torch library and registers the implementations. It never raises: when the
extension is missing, failed to build or was built against another torch, the implementations
are registered as unsupported with that reason, which ``vllm-ir providers list`` shows::

    import vllm_ir, vllm_ir_provider_vllm_c
    print(vllm_ir_provider_vllm_c.STATUS)
    with vllm_ir.priority(rms_norm=["vllm_c"]):
        y = vllm_ir.ops.rms_norm(x, weight, 1e-6)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vllm_ir.hookspecs import hookimpl

from . import impls
from ._extension import ExtensionStatus, load

__version__ = "0.1.0"
__all__ = ["STATUS", "ExtensionStatus", "cpu_capability", "vllm_ir_default_priority"]

#: Whether the compiled kernels are usable in this process, and why not.
STATUS: ExtensionStatus = load(__name__)
impls.register(STATUS)


def cpu_capability() -> str | None:
    """Which compiled CPU variant runs (DEFAULT, AVX2 or AVX512), or None without the extension."""
    if not STATUS.loaded:
        return None
    import torch

    return torch.ops.vllm_ir_c.cpu_capability()


@hookimpl
def vllm_ir_default_priority(platform, mode: str) -> Mapping[str, Sequence[str]] | None:
    """On CPU in eager mode, ``vllm_c`` first for both ops (benchmarks/kernels.py).

    Not under compile: an opaque kernel stops Inductor from fusing the norm with its
    neighbours, and native lowering measured 8-23% faster on a norm-heavy decoder
    (benchmarks/compile_pipeline.py --no-linear). CUDA and ROCm platforms already list
    ``vllm_c`` in their own defaults.
    """
    if platform.name == "cpu" and mode == "eager":
        return {"rms_norm": [impls.PROVIDER], "fused_add_rms_norm": [impls.PROVIDER]}
    return None
