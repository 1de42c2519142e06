"""The fallback policy: what a user hears when a higher-priority provider declines a call.

``VLLM_IR_FALLBACK=allow`` says nothing, ``warn`` (default) warns once per op, provider and
reason, pointing at the caller's line, ``error`` raises `FallbackError`.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from vllm_ir.errors import FallbackError, FallbackWarning
from vllm_ir.ir import priority as _priority
from vllm_ir.settings import env

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
                stacklevel=env.user_stacklevel(),
            )


def forget_warnings() -> None:
    """Warn again about declines already warned about (`vllm_ir.reset_dispatch_stats`)."""
    _warned.clear()
