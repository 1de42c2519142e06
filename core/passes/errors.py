"""Errors the compile pipeline raises, as vllm-ir exception types.

Dynamo wraps an exception raised by a backend in ``BackendCompilerFailed`` unless it is a
``ShortenTraceback``; the donation error derives from it so ``except vllm_ir.DonationError``
works around ``torch.compile`` exactly as it does around the pre-grad pass itself.
"""

from __future__ import annotations

from vllm_ir.errors import DonationError, VllmIrError

try:  # pragma: no branch - torch >= 2.1 has it
    from torch._dynamo.exc import ShortenTraceback as _PassThrough
except ImportError:  # pragma: no cover
    _PassThrough = RuntimeError  # type: ignore[assignment,misc]


class CompileDonationError(DonationError, _PassThrough):  # type: ignore[misc]
    """A donated activation is used after ``maybe_inplace`` in a graph being compiled.

    A `vllm_ir.DonationError`; it reaches the caller of the compiled model unwrapped.
    """

    def __init__(self, message: str):
        RuntimeError.__init__(self, message)
        self.first_useful_frame = None


class LoweringError(VllmIrError, RuntimeError):
    """IR nodes could not be replaced by an implementation; lists every node and why.

    Raised inside Inductor, so ``torch.compile`` reports it as ``InductorError`` whose
    ``inner_exception`` is this error.
    """


class UnloweredWarning(UserWarning):
    """IR nodes stay opaque (``on_unlowered="warn"``): they run through eager dispatch at run time."""
