"""Clear failures of collectives: a dead or misconfigured peer is an error naming the rank and the collective.

torch.distributed reports a collective that cannot complete in the back-end's words (gloo:
"Timed out waiting 3000ms for recv operation to complete"; "Connection closed by peer"),
without saying which rank saw it or which collective it was. vllm-ir adds no communication
of its own; it renames those failures:

* the native functions of the collective IR ops (`vllm_ir.ops.all_reduce_fused_add_rms_norm`,
  ...) raise `CollectiveError` naming the op, the rank and the group;
* `collective_errors` does the same around any code -- a compiled tensor-parallel step,
  whose collectives run inside generated code -- naming the collectives it was given (for a
  model from `vllm_ir.compile`, `describe_collectives` lists those of its compiled graphs).

A rank never hangs as long as its process group has a timeout (``init_process_group(...,
timeout=timedelta(seconds=...))``): the back-end then fails the collective after it, and
this module turns that into a `CollectiveError`. With ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
torch additionally checks before every collective that all ranks call the same one with the
same shapes, and names both sides of a mismatch (the cost: a store round-trip per collective).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from vllm_ir.ir.collectives import CollectiveError, is_collective_failure, named_failure

__all__ = ["CollectiveError", "collective_errors", "describe_collectives", "is_collective_failure", "named_failure"]


@contextlib.contextmanager
def collective_errors(
    group: Any = None, collectives: str | Sequence[str] | Callable[[], str] = "a collective"
) -> Iterator[None]:
    """Turn back-end failures of collectives inside the block into `CollectiveError`.

    :param group: the process group (or its name) the block communicates over; default: the world.
    :param collectives: what the block runs, for the message (``"all_reduce x4"``), or a
        callable asked at the failure (``lambda: describe_collectives(compiled)``: a model
        compiled by its first call inside the block has its record only then).
    """
    try:
        yield
    except Exception as exc:
        if not is_collective_failure(exc):
            raise
        if callable(collectives):
            what = collectives()
        else:
            what = collectives if isinstance(collectives, str) else ", ".join(collectives)
        raise named_failure(exc, group, what) from exc


def describe_collectives(compiled: Any) -> str:
    """The functional collectives of a model's compiled graphs (`vllm_ir.compile`), e.g.
    ``"reduce_scatter_tensor x4, all_gather_into_tensor x4 (compiled graph)"``."""
    from vllm_ir.passes import record_of

    counts: dict[str, int] = {}
    for report in record_of(compiled).graphs:
        for kind, n in report.collectives.items():
            counts[kind] = counts.get(kind, 0) + n
    if not counts:
        return "the collectives of the compiled graph (none recorded)"
    return ", ".join(f"{kind} x{n}" for kind, n in counts.items()) + " (compiled graph)"
