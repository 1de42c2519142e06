"""Provider ``triton``: registers the Triton implementations when Triton can run them here.

Triton (and its kernels) are imported only when a GPU back-end is active or
``TRITON_INTERPRET=1`` asks for the CPU interpreter; otherwise the implementations are
registered as unsupported with the reason, so ``vllm-ir providers list`` stays cheap.

Layout: ``ops/<family>.py`` registers one op family's implementations and predicates through
`TRITON` (a `vllm_ir.Provider`; every module there is imported); ``kernels/<family>.py`` holds
its Triton code, imported by the family module only when Triton can run here. Adding an op
family is adding those two files.

Every implementation declares `compile_facts` (what a compiled graph that runs it depends on
beyond the implementation's own code): the installed Triton, whether the interpreter runs the
kernels, and a digest of the package's kernel sources -- the lowering cache key hashes an
implementation's code, not the ``kernels/`` modules it launches.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
from pathlib import Path

import torch

import vllm_ir
from vllm_ir import Provider
from vllm_ir.plugins.provider import import_families

__version__ = "0.1.0"


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (read by Triton once, at import)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def availability() -> bool | vllm_ir.Unsupported:
    """Whether Triton kernels can run in this process, and if not, why."""
    if importlib.util.find_spec("triton") is None:
        return vllm_ir.Unsupported("triton is not installed")
    if interpreting():
        return True
    if torch.cuda.is_available():  # CUDA or ROCm builds of torch
        return True
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return True
    return vllm_ir.Unsupported("no GPU back-end for Triton here (TRITON_INTERPRET=1 runs the kernels on CPU)")


SUPPORTED = availability()
#: The activation dtypes the kernels take.
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def on_cpu_verdict(t: torch.Tensor) -> bool | vllm_ir.Unsupported:
    """CPU tensors run only in the interpreter."""
    if t.device.type == "cpu" and not interpreting():
        return vllm_ir.Unsupported("CPU tensors need TRITON_INTERPRET=1")
    return True


def dtype_and_device_verdict(x: torch.Tensor) -> bool | vllm_ir.Unsupported:
    """``x`` of one of `DTYPES`, on a device Triton runs on here."""
    if x.dtype not in DTYPES:
        return vllm_ir.Unsupported(f"dtype {x.dtype} is not one of float32, float16, bfloat16")
    if x.device.type not in ("cpu", "cuda", "xpu"):
        return vllm_ir.Unsupported(f"x is on {x.device.type}; Triton runs on GPUs (or CPU when interpreting)")
    return on_cpu_verdict(x)


@functools.cache
def _sources_digest() -> str:
    """Digest of the package's Python sources (kernels included), as imported by this process."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _triton_version() -> str | None:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def compile_facts() -> dict[str, object]:
    """What compiled graphs running these kernels depend on (read at every compile)."""
    return {
        "triton": _triton_version(),
        "TRITON_INTERPRET": interpreting(),
        "sources": _sources_digest(),
        "provider": __version__,
    }


#: Why compiled graphs cannot run these kernels here: the interpreter executes each program on
#: real data, and lowering traces kernels on fake tensors, which have none.
INTERPRETER_NOT_LOWERABLE = vllm_ir.Unsupported(
    "Triton's CPU interpreter (TRITON_INTERPRET=1) cannot run kernels traced on fake tensors; "
    "compiled Triton kernels need a GPU"
)


PROVIDER = "triton"
#: The registration surface of every family: unavailable with `availability`'s reason, every
#: implementation declaring `compile_facts`, and under the interpreter not lowerable (compile-mode
#: priorities skip it). Batch invariant unless a family says otherwise.
TRITON = Provider(
    PROVIDER,
    available=SUPPORTED,
    batch_invariant=True,
    compile_facts=compile_facts,
    lowerable=INTERPRETER_NOT_LOWERABLE if interpreting() else True,
)

from vllm_ir_provider_triton import ops as _ops  # noqa: E402  (its families need TRITON)

#: The op family modules of ``ops/``, each registered through `TRITON`.
FAMILIES = import_families(_ops.__name__, _ops.__path__)
