"""The pluggy hooks a provider or platform package may implement.

Hooks run when the registry or the priorities are built (provider discovery, a priority
change), never per op call: one pluggy call costs microseconds.

A provider module marks its implementations with ``@vllm_ir.hookimpl``::

    @vllm_ir.hookimpl
    def vllm_ir_default_priority(platform, mode):
        if platform.name == "cpu":
            return {"rms_norm": ["vllm_c"], "fused_add_rms_norm": ["vllm_c"]}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from vllm_ir.platforms import Platform

PROJECT = "vllm_ir"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def vllm_ir_platform() -> Platform | None:
    """Claim the process for an out-of-tree platform by returning its `Platform`, else None.

    Two plugins claiming the process is an error naming both.
    """


@hookspec
def vllm_ir_default_priority(platform: Platform, mode: str) -> Mapping[str, Sequence[str]] | None:
    """Contribute default priority lists, ``{op_name: [provider, ...]}``, for ``mode``.

    ``mode`` is ``"eager"`` or ``"compile"``. The platform's contribution comes first, then
    providers in hook order (pluggy's ``tryfirst``/``trylast`` apply); the first occurrence
    of a provider wins.
    """


@hookspec
def vllm_ir_adjust_priority(op_name: str, priority: list[str], platform: Platform, mode: str) -> list[str] | None:
    """Reorder or filter an op's merged default priority (site policy); return None to keep it.

    Called in hook order, each call seeing the previous result. Providers a hook adds must
    be known; entries it keeps keep their origin, entries it moves are marked as adjusted.
    """
