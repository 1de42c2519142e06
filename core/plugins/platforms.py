"""Which hardware this process runs on, detected from torch or claimed by a plugin.

A platform's own defaults are merged first, then every provider's
``vllm_ir_default_priority`` hook. The built-in platforms name no provider (their defaults
are ``native`` alone): each provider says where it belongs through its own hook, so the
core never lists a provider or an op.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Platform:
    """A platform: its name, torch device type and default priorities per mode.

    Out-of-tree platforms construct one (or subclass it) and return it from the
    ``vllm_ir_platform`` hook.
    """

    name: str
    #: The torch device type of this platform (``explain`` and ``bench`` default to it).
    device_type: str
    defaults: Mapping[str, Mapping[str, Sequence[str]]] = field(default_factory=dict)
    #: Which plugin claimed the process (None for the built-in detection).
    claimed_by: str | None = None

    def default_priority(self, mode: str) -> Mapping[str, Sequence[str]]:
        return self.defaults.get(mode, {})

    def describe(self) -> str:
        return self.name if self.claimed_by is None else f"{self.name} (claimed by {self.claimed_by})"


CPU = Platform("cpu", "cpu")
CUDA = Platform("cuda", "cuda")
ROCM = Platform("rocm", "cuda")
XPU = Platform("xpu", "xpu")


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
