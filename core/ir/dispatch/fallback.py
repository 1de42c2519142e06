"""The fallback policy: what a user hears when a higher-priority provider declines a call.

``VLLM_IR_FALLBACK=allow`` says nothing, ``warn`` (default) warns once per op, provider and
reason, pointing at the caller's line, ``error`` raises `FallbackError`.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_ir.errors import FallbackError, FallbackWarning
from vllm_ir.ir import priority as _priority

if TYPE_CHECKING:
    from vllm_ir.ir.dispatch.selection import Decision
    from vllm_ir.ir.op import IrOp

_warned: set[tuple[str, str, str]] = set()


def apply(op: IrOp, decision: Decision) -> None:
    policy = _priority.settings().fallback
    if policy == "allow":
        return
    provider, reason = decision.skipped[0]
    message = f"op {op.name!r}: provider {provider!r} declined the call ({reason}); {decision.provider!r} runs instead"
    if policy == "error":
        raise FallbackError(message + " [VLLM_IR_FALLBACK=error]")
    for provider, reason in decision.skipped:
        if (op.name, provider, reason) not in _warned:
            _warned.add((op.name, provider, reason))
            warnings.warn(
                f"op {op.name!r}: provider {provider!r} declined the call ({reason}); "
                f"{decision.provider!r} runs instead (shown once; VLLM_IR_FALLBACK=allow silences it)",
                FallbackWarning,
                stacklevel=user_stacklevel(),
            )


#: Frames of vllm_ir itself: its modules and its generated entry points.
_OWN_CODE = (str(Path(__file__).resolve().parents[1]) + os.sep, "<vllm_ir.")


def user_stacklevel() -> int:
    """``stacklevel`` for a warning raised in here that points at the caller's line."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_OWN_CODE):
        frame, level = frame.f_back, level + 1
    return level


def forget_warnings() -> None:
    """Warn again about declines already warned about (`vllm_ir.reset_dispatch_stats`)."""
    _warned.clear()
