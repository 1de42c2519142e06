"""Which hardware this process runs on, detected from torch or claimed by a plugin.

The platform contributes its default priorities through the same
``vllm_ir_default_priority`` hook as providers do; its contribution is merged first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

#: Seed defaults per platform and mode (the vLLM IR design's platform defaults).
_CUDA_LIKE_COMPILE = {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}


@dataclass(frozen=True)
class Platform:
    """A platform: its name, torch device type and default priorities per mode.

    Out-of-tree platforms construct one (or subclass it) and return it from the
    ``vllm_ir_platform`` hook.
    """

    name: str
    device_type: str
    defaults: Mapping[str, Mapping[str, Sequence[str]]] = field(default_factory=dict)
    #: Which plugin claimed the process (None for the built-in detection).
    claimed_by: str | None = None

    def default_priority(self, mode: str) -> Mapping[str, Sequence[str]]:
        return self.defaults.get(mode, {})

    def is_cuda_alike(self) -> bool:
        return self.name in ("cuda", "rocm")

    def describe(self) -> str:
        return self.name if self.claimed_by is None else f"{self.name} (claimed by {self.claimed_by})"


def _both(ops: Mapping[str, Sequence[str]]) -> dict[str, Mapping[str, Sequence[str]]]:
    return {"eager": ops, "compile": ops}


CPU_DEFAULTS: dict[str, Mapping[str, Sequence[str]]] = {"eager": {}, "compile": {}}
CUDA = Platform(
    "cuda",
    "cuda",
    {
        "eager": {"rms_norm": ["vllm_c", "native"], "fused_add_rms_norm": ["vllm_c", "native"]},
        "compile": _CUDA_LIKE_COMPILE,
    },
)
ROCM = Platform(
    "rocm",
    "cuda",
    {
        "eager": {"rms_norm": ["aiter", "vllm_c", "native"], "fused_add_rms_norm": ["aiter", "vllm_c", "native"]},
        "compile": _CUDA_LIKE_COMPILE,
    },
)
XPU = Platform(
    "xpu",
    "xpu",
    {
        "eager": {"rms_norm": ["xpu_kernels", "native"], "fused_add_rms_norm": ["xpu_kernels", "native"]},
        "compile": _CUDA_LIKE_COMPILE,
    },
)
CPU = Platform("cpu", "cpu", CPU_DEFAULTS)


def detect() -> Platform:
    """The built-in platform for this torch build and machine (no plugin involved)."""
    if torch.version.hip is not None and torch.cuda.is_available():
        return ROCM
    if torch.version.cuda is not None and torch.cuda.is_available():
        return CUDA
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return XPU
    return CPU
