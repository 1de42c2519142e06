"""Loading the compiled ``vllm_ir_c`` library, or saying why it cannot be used.

Nothing here raises: a provider import must never break the host. The checks run before the
shared library is loaded, because loading one built against another torch can fail with an
undefined symbol or, worse, load and misbehave.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

REBUILD = "rebuild with: MAX_JOBS=2 pip install --no-build-isolation -e providers/vllm_c"


@dataclass(frozen=True)
class ExtensionStatus:
    """Whether the kernels can run in this process; ``reason`` says why not."""

    loaded: bool
    reason: str | None = None
    cuda_kernels: bool = False
    torch_version: str | None = None


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
    """Check the build record, import ``<package>._C`` and register the ops' fake kernels."""
    try:
        info = importlib.import_module(f"{package}._build_info")
    except ImportError:
        info = None
    reason = check_build(info, torch.__version__)
    if reason is not None:
        return ExtensionStatus(False, reason)
    try:
        importlib.import_module(f"{package}._C")
        _register_fakes()
    except Exception as e:  # ImportError, OSError (undefined symbol), RuntimeError (duplicate library)
        return ExtensionStatus(False, f"the C++ extension failed to load: {type(e).__name__}: {e}; {REBUILD}")
    return ExtensionStatus(True, None, bool(info.CUDA_KERNELS), info.TORCH_VERSION)


def _register_fakes() -> None:
    """Fake kernels: the ops only mutate their arguments, so tracing needs no outputs.

    With them the ops trace as single opaque nodes on fake tensors (make_fx, torch.compile);
    the real kernels check shapes and dtypes.
    """

    @torch.library.register_fake("vllm_ir_c::rms_norm")
    def _rms_norm_fake(out, input, weight, epsilon):
        return None

    @torch.library.register_fake("vllm_ir_c::fused_add_rms_norm")
    def _fused_add_rms_norm_fake(input, residual, weight, epsilon):
        return None
