"""Loading the compiled ``vllm_ir_c`` library, or saying why it cannot be used, and the few
helpers every op family module shares (nothing here names an op).

Nothing here raises: a provider import must never break the host. The checks run before the
shared library is loaded, because loading one built against another torch can fail with an
undefined symbol or, worse, load and misbehave.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from vllm_ir import Provider, Unsupported

#: The provider name every implementation of this package registers under.
PROVIDER = "vllm_c"
REBUILD = "rebuild with: MAX_JOBS=2 pip install --no-build-isolation -e providers/vllm_c"


@dataclass(frozen=True)
class ExtensionStatus:
    """Whether the kernels can run in this process; ``reason`` says why not."""

    loaded: bool
    reason: str | None = None
    cuda_kernels: bool = False
    torch_version: str | None = None
    #: The loaded shared library (for the compile facts: a rebuild in place changes it).
    library: str | None = None


def check_build(info: ModuleType | Any | None, torch_version: str) -> str | None:
    """Why a build described by ``_build_info`` cannot be loaded into ``torch_version`` (None: it can)."""
    if info is None:
        return f"the C++ extension is not built; {REBUILD}"
    error = getattr(info, "BUILD_ERROR", None)
    if error:
        return f"the C++ extension failed to build ({error}); {REBUILD}"
    built_for = getattr(info, "TORCH_VERSION", None)
    if built_for != torch_version:
        return f"the C++ extension was built against torch {built_for} but torch {torch_version} is running; {REBUILD}"
    return None


def load(package: str) -> ExtensionStatus:
    """Check the build record and import ``<package>._C``, which registers every op's schema and kernels."""
    try:
        info = importlib.import_module(f"{package}._build_info")
    except ImportError:
        info = None
    reason = check_build(info, torch.__version__)
    if reason is not None:
        return ExtensionStatus(False, reason)
    try:
        library = importlib.import_module(f"{package}._C").__file__
    except Exception as e:  # ImportError, OSError (undefined symbol), RuntimeError (duplicate library)
        return ExtensionStatus(False, f"the C++ extension failed to load: {type(e).__name__}: {e}; {REBUILD}")
    return ExtensionStatus(True, None, bool(info.CUDA_KERNELS), info.TORCH_VERSION, library)


def compile_facts(status: ExtensionStatus) -> dict[str, object]:
    """What a graph compiled with these kernels depends on beyond their Python source (the
    compile cache's key): the build's torch, whether CUDA kernels are in it, and the library
    file itself (size and modification time), so a rebuild in place misses the cache."""
    facts: dict[str, object] = {"vllm_c.torch": status.torch_version, "vllm_c.cuda_kernels": status.cuda_kernels}
    if status.library is not None:
        stat = os.stat(status.library)
        facts["vllm_c.library"] = (stat.st_size, stat.st_mtime_ns)
    return facts


def supported(status: ExtensionStatus) -> bool | Unsupported:
    """The ``supported=`` of every implementation: True, or why the kernels cannot run."""
    return True if status.loaded else Unsupported(status.reason or "not loaded")


def devices(status: ExtensionStatus) -> tuple[str, ...]:
    """Device types the compiled kernels cover."""
    return ("cpu", "cuda") if status.cuda_kernels and torch.version.hip is None else ("cpu",)


#: The activation dtypes the kernels take.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def dtype_and_device_verdict(x: torch.Tensor, device_types: tuple[str, ...]) -> bool | Unsupported:
    """``x`` of one of `DTYPES` on one of ``device_types``, or why not."""
    if x.dtype not in DTYPES:
        return Unsupported(f"dtype {x.dtype} is not supported (float32, bfloat16, float16)")
    if x.device.type not in device_types:
        return Unsupported(f"device {x.device.type} is not supported (kernels built for: {', '.join(device_types)})")
    return True


def rows_on(device_types: tuple[str, ...]) -> Callable[[torch.Tensor], bool | Unsupported]:
    """The predicate of ``x`` for kernels over rows of its last dimension built for
    ``device_types``: `dtype_and_device_verdict`, not 0-d, a unit-stride last dimension."""

    def x_verdict(x: torch.Tensor) -> bool | Unsupported:
        verdict = dtype_and_device_verdict(x, device_types)
        if not verdict:
            return verdict
        if x.dim() == 0:
            return Unsupported("x is 0-d (the kernels work along a last dimension)")
        if x.stride(-1) != 1 and x.size(-1) != 1:
            return Unsupported(f"x has stride {x.stride(-1)} along the last dimension (the kernels need 1)")
        return True

    return x_verdict


def residual_stride_verdict(x_residual: torch.Tensor | None) -> bool | Unsupported:
    """No residual, or one with a unit-stride last dimension (after its dtype, device and shape's check)."""
    if x_residual is not None and x_residual.stride(-1) != 1 and x_residual.size(-1) != 1:
        return Unsupported(
            f"x_residual has stride {x_residual.stride(-1)} along the last dimension (the kernels need 1)"
        )
    return True


def torch_op(status: ExtensionStatus, name: str) -> Callable[..., Any]:
    """``torch.ops.vllm_ir_c.<name>.default``, or a stand-in that raises the load failure's reason."""
    if status.loaded:
        return getattr(torch.ops.vllm_ir_c, name).default

    def kernel(*args: object) -> None:
        raise RuntimeError(f"vllm_c kernels are not available: {status.reason}")

    return kernel


#: Whether the compiled kernels are usable in this process, and why not.
STATUS: ExtensionStatus = load(__name__.rpartition(".")[0])
#: The device types this build's kernels cover.
DEVICES = devices(STATUS)
#: The registration surface of every family: unavailable with the load failure's reason if not loaded.
VLLM_C = Provider(PROVIDER, available=supported(STATUS), compile_facts=compile_facts(STATUS))
