"""Why a collective failed, in words a user can act on: the rank, the group and the collective.

torch.distributed reports a collective that cannot complete in the back-end's words (gloo:
"Timed out waiting 3000ms for recv operation to complete"; "Connection closed by peer"),
without saying which rank saw it or which collective it was. The native functions of the
collective IR ops, and `vllm_ir.integrations.distributed.collective_errors` around any code,
rename such failures to `CollectiveError` with these functions.
"""

from __future__ import annotations

from typing import Any

from vllm_ir.errors import VllmIrError

#: Substrings of back-end messages that mean a collective could not complete.
_FAILURE_MARKERS = (
    "gloo",
    "nccl",
    "timed out",
    "timeout",
    "monitoredbarrier",
    "connection",
    "mismatch between collectives",
    "processgroup",
    "c10d",
    "peer",
)


class CollectiveError(VllmIrError, RuntimeError):
    """A collective that failed or timed out on this rank (see the module doc)."""

    def __init__(self, message: str, *, rank: int | None, world_size: int | None, group: str | None, collective: str):
        super().__init__(message)
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.collective = collective


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a back-end's report of a collective that could not complete."""
    if isinstance(exc, CollectiveError):
        return False  # already named
    try:
        from torch.distributed import DistError

        if isinstance(exc, DistError):
            return True
    except ImportError:  # pragma: no cover - torch without distributed
        pass
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(marker in text for marker in _FAILURE_MARKERS)


def _group_facts(group: Any) -> tuple[int | None, int | None, str | None]:
    """(rank in the group, its size, its name); Nones where the group is unknown here."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return None, None, group if isinstance(group, str) else None
        if isinstance(group, str):
            pg = dist.distributed_c10d._resolve_process_group(group)
        else:
            pg = group if group is not None else dist.group.WORLD
        return pg.rank(), pg.size(), pg.group_name
    except Exception:
        return None, None, group if isinstance(group, str) else None


def named_failure(exc: BaseException, group: Any, collective: str) -> CollectiveError:
    """`CollectiveError` for ``exc``, a back-end failure of ``collective`` on ``group`` (name or group)."""
    rank, world, name = _group_facts(group)
    who = f"rank {rank} of {world}" if rank is not None else "this rank (outside an initialized group)"
    message = (
        f"{who} in process group {name!r}: collective {collective} did not complete "
        f"(a peer died, is stuck, or calls another collective; the back-end said: "
        f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else '(no message)'})"
    )
    return CollectiveError(message, rank=rank, world_size=world, group=name, collective=collective)
