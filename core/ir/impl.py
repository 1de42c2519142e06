"""Implementations of an op and the verdicts that say why one is not used."""

from __future__ import annotations

import linecache
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, overload

#: Provider name of the op's own PyTorch function: semantics, fallback and test oracle.
NATIVE: Final = "native"
#: Names no implementation may take (``unfused`` is kept for fusion passes).
RESERVED_PROVIDERS: Final = frozenset({NATIVE, "unfused"})


class Unsupported:
    """A falsy verdict that carries the reason an implementation cannot be used.

    Return it from a ``supports_args`` predicate, or pass it as ``supported=``, so that
    ``op.explain(...)`` and ``vllm-ir explain`` can say *why* a provider was skipped::

        def supports(x, weight, epsilon, variance_size=None):
            if variance_size is not None:
                return Unsupported("variance_size is not supported")
            return True
    """

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = str(reason)

    def __bool__(self) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Unsupported) and other.reason == self.reason

    def __hash__(self) -> int:
        return hash(("Unsupported", self.reason))

    def __repr__(self) -> str:
        return f"Unsupported({self.reason!r})"


def reason_of(verdict: object, default: str) -> str:
    """The human-readable reason of a falsy verdict (an `Unsupported` or plain ``False``)."""
    return verdict.reason if isinstance(verdict, Unsupported) else default


class RegistrationStack(Sequence[str]):
    """Where an op or implementation was registered: `traceback.format_stack` lines, innermost
    last (vLLM keeps the same on its ops). Only (file, line, function) is taken at registration,
    the frames' summaries and source lines when first shown: start-up registers ~110 ops and
    implementations, each from an import ~30 frames deep."""

    __slots__ = ("_frames", "_lines", "_where")

    def __init__(self, frames: Sequence[traceback.FrameSummary] = ()):
        self._where: tuple[tuple[str, int | None, str], ...] = ()
        self._frames: tuple[traceback.FrameSummary, ...] | None = tuple(frames)
        self._lines: tuple[str, ...] | None = None

    @classmethod
    def here(cls, skip_files: Sequence[str] = ()) -> RegistrationStack:
        """The caller's stack without the frames of ``skip_files`` and of the import machinery."""
        where = []
        frame: Any = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            filename = code.co_filename
            if filename not in skip_files and not filename.startswith("<frozen "):
                where.append((filename, frame.f_lineno, code.co_name))
                linecache.lazycache(filename, frame.f_globals)  # as traceback does: sources of zipped modules
            frame = frame.f_back
        where.reverse()
        stack = cls()
        stack._where, stack._frames = tuple(where), None
        return stack

    @property
    def frames(self) -> tuple[traceback.FrameSummary, ...]:
        """The frames, outermost first (source lines not read yet)."""
        if self._frames is None:
            self._frames = tuple(
                traceback.FrameSummary(filename, lineno, name, lookup_line=False)
                for filename, lineno, name in self._where
            )
        return self._frames

    @property
    def lines(self) -> tuple[str, ...]:
        if self._lines is None:
            frames = self.frames
            for filename in {f.filename for f in frames}:
                linecache.checkcache(filename)
            self._lines = tuple(traceback.format_list(list(frames)))
        return self._lines

    def site(self) -> str:
        """The innermost frame on one line: ``file:line in function``."""
        if self._frames is None:
            if not self._where:
                return "unknown place"
            filename, lineno, name = self._where[-1]
            return f"{filename}:{lineno} in {name}"
        if not self._frames:
            return "unknown place"
        f = self._frames[-1]
        return f"{f.filename}:{f.lineno} in {f.name}"

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...
    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        return self.lines[i]

    def __len__(self) -> int:
        return len(self._where) if self._frames is None else len(self._frames)

    def __iter__(self) -> Iterator[str]:
        return iter(self.lines)

    def __repr__(self) -> str:
        return f"RegistrationStack({self.site()})"


@dataclass(eq=False)
class IrOpImpl:
    """One provider's implementation of one op.

    ``supported`` is decided once (is the library importable, is the device here);
    ``supports_args`` is asked once per decision key (`vllm_ir.ir.dispatch.cache_key`: the scalar
    arguments and each tensor's dtype, device, shape and strides, the token count left out)
    and its answer cached, unless ``cacheable`` is False: a predicate that reads what the key
    leaves out (the token count, tensor values, state outside the call) then runs every call.
    """

    op_name: str
    provider: str
    fn: Callable[..., Any]
    supported: bool | Unsupported = True
    supports_args: Callable[..., bool | Unsupported] | None = None
    inplace: bool = False
    batch_invariant: bool = False
    cacheable: bool = True
    #: Results are bit-identical to native's (the conformance kit then compares exactly).
    exact: bool = False
    #: Which plugin distribution registered it (filled in by provider discovery).
    origin: str | None = field(default=None)
    #: The same provider's in-place kernel when ``fn`` is its functional one (both forms
    #: registered): ``maybe_inplace`` runs it, ``op(...)`` runs ``fn`` without clones.
    inplace_fn: Callable[..., Any] | None = field(default=None, repr=False)
    #: What the code traced into compiled graphs depends on beyond its own source (library
    #: versions, build ids, environment variables it reads): a mapping of names to plain
    #: values, or a callable returning one, re-read at every compile. It goes into the compile
    #: cache key (`vllm_ir.passes.cache.facts_fingerprint`), so a changed fact recompiles.
    compile_facts: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = field(default=None, repr=False)
    #: Whether lowering can trace it into compiled graphs in this process (an `Unsupported`
    #: says why not, e.g. Triton's CPU interpreter, which needs real data): where it cannot,
    #: compile-mode priorities skip it with that reason and the kit skips its compiled check.
    lowerable: bool | Unsupported = True
    #: Where it was registered (`traceback.format_stack` lines, innermost last; filled in by
    #: `IrOp.add_impl`): shown when a conflicting registration is refused and by
    #: ``vllm-ir explain --verbose``.
    registration_stack: RegistrationStack = field(default_factory=RegistrationStack, repr=False)

    @property
    def has_inplace_kernel(self) -> bool:
        return self.inplace or self.inplace_fn is not None

    @property
    def is_supported(self) -> bool:
        return bool(self.supported)

    @property
    def unsupported_reason(self) -> str | None:
        if self.supported:
            return None
        return reason_of(self.supported, "marked unsupported on this platform")

    def __repr__(self) -> str:
        flags = [
            f
            for f, on in (
                ("inplace", self.inplace),
                ("both forms", self.inplace_fn is not None),
                ("batch_invariant", self.batch_invariant),
                ("exact", self.exact),
            )
            if on
        ]
        return f"IrOpImpl({self.op_name}:{self.provider}{', ' + ', '.join(flags) if flags else ''})"
