"""Exception types of vllm-ir.

Every error the framework raises itself names the op and, where one is involved, the
provider, so a user reading a traceback from deep inside a model knows where to look.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Finding:
    """One problem with a setting: where it is, what is wrong, and how to fix it."""

    #: The variable (``VLLM_IR_PROVIDERS``) or config location (``config /etc/x.toml, line 3, key fallback``).
    setting: str
    message: str
    fix: str
    #: Valid, but names something this machine lacks: a note, not a problem.
    here_only: bool = False

    def __str__(self) -> str:
        return self.message

    def to_json(self) -> dict[str, object]:
        return {"setting": self.setting, "message": self.message, "fix": self.fix}


class VllmIrError(Exception):
    """Base class of every error raised by vllm-ir itself."""


class RegistrationError(VllmIrError, ValueError):
    """An op or implementation was refused at registration time; nothing was registered.

    :param op: name of the op concerned (or the name that was refused).
    :param provider: provider of the refused implementation, ``None`` for op declarations.
    """

    def __init__(self, message: str, *, op: str | None = None, provider: str | None = None):
        super().__init__(message)
        self.op = op
        self.provider = provider


class PriorityError(VllmIrError, ValueError):
    """A priority list (from code, environment or a context) names something unknown or is malformed."""


class ConfigError(PriorityError):
    """A setting (environment variable or config-file entry) is malformed or names something unknown.

    The message names the variable (or file, line and key), the value and the accepted values;
    `finding` (a `vllm_ir.settings.env.Finding`) carries the same with a suggested fix. A `PriorityError`
    because `vllm_ir.reload_env`, which re-reads the priority and policy settings, documents
    raising one; also importable as ``vllm_ir.settings.env.ConfigError``.
    """

    def __init__(self, finding: Any, *, setting: str = "", fix: str = ""):
        if isinstance(finding, str):
            finding = Finding(setting, finding, fix)
        super().__init__(finding.message)
        self.finding = finding

    @property
    def setting(self) -> str:
        return self.finding.setting

    @property
    def fix(self) -> str:
        return self.finding.fix


class UnknownOpError(PriorityError, AttributeError):
    """No op of that name is registered."""


class ToleranceError(VllmIrError, LookupError, ValueError):
    """An op has no tolerance for a dtype (neither its own nor a default): set one with
    ``op.set_tolerance``. A ValueError too, as vLLM's ``get_tolerance`` raises."""


class PredicateError(VllmIrError, TypeError):
    """A ``supports_args`` predicate returned something other than a bool or `Unsupported`."""


class FallbackError(VllmIrError, RuntimeError):
    """``VLLM_IR_FALLBACK=error`` and a higher-priority provider declined a call."""


class DonationError(VllmIrError, RuntimeError):
    """An activation donated to ``maybe_inplace`` is used again afterwards."""


class FallbackWarning(UserWarning):
    """A higher-priority provider declined a call and a lower one ran (``VLLM_IR_FALLBACK=warn``)."""


class ConfigWarning(UserWarning):
    """A setting was ignored (malformed) or names something not available here; shown once each."""


class ProviderWarning(UserWarning):
    """A provider misbehaved (e.g. its predicate raised) and was skipped; shown once per op and provider."""


class KernelResultError(VllmIrError, TypeError):
    """A kernel returned the wrong kind of result for its op: ``None``, the wrong number of
    tensors, another dtype, shape or device than native's, or an input where a fresh tensor is owed."""
