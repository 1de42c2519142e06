"""Every environment variable vllm-ir reads, the one parser for their values, and their problems.

A value vllm-ir cannot read (``VLLM_IR_STRICT_PLUGINS=maybe``, ``VLLM_IR_PROVIDERS='aten; vllm_c'``,
an unknown provider in ``VLLM_IR_OP_PRIORITY``) is a `ConfigError` that names the variable,
the value and the accepted values. Where it is raised depends on who asked:

- an explicit request (`vllm_ir.reload_env`, ``vllm-ir doctor``, a CLI argument) raises or
  reports it;
- an implicit read (``import vllm_ir``, provider discovery, the first op call) never raises:
  the malformed value (or only the malformed entry of a list) is ignored as if unset, one
  `ConfigWarning` says so, and ``vllm-ir doctor`` lists it with its fix. An op call never fails
  because of the environment.

A setting that is valid but names something this machine lacks (``rms_norm=triton`` on a
machine without Triton) is a `Finding` with ``here_only=True``: a warning once, and a
"not for this machine" note in ``doctor``, not a problem.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence

from vllm_ir.errors import ConfigError, ConfigWarning, Finding  # defined with the others; importable here too
from vllm_ir.settings.log import ENV_LOG_LEVEL

# Every variable, with what it takes (``vllm-ir doctor`` lists the same; docs/settings.md is generated
# from it by scripts/gen_reference.py).
ENV_PRIORITY = "VLLM_IR_OP_PRIORITY"
ENV_FALLBACK = "VLLM_IR_FALLBACK"
ENV_BATCH_INVARIANT = "VLLM_BATCH_INVARIANT"
ENV_ALLOW = "VLLM_IR_PROVIDERS"
ENV_DENY = "VLLM_IR_DISABLE_PROVIDERS"
ENV_NO_AUTOLOAD = "VLLM_IR_DISABLE_PLUGIN_AUTOLOAD"
ENV_STRICT = "VLLM_IR_STRICT_PLUGINS"
ENV_FAST_LOOKUP = "VLLM_IR_FAST_LOOKUP"
ENV_PLATFORM = "VLLM_IR_PLATFORM"
ENV_CONFIG = "VLLM_IR_CONFIG"
ENV_TUNING = "VLLM_IR_TUNING"
ENV_TRACE = "VLLM_IR_TRACE"
ENV_TRACE_DIR = "VLLM_IR_TRACE_DIR"
ENV_REFERENCE = "VLLM_IR_REFERENCE"

VARIABLES: dict[str, str] = {
    ENV_PRIORITY: "op=provider[,provider...] entries separated by ';'",
    ENV_FALLBACK: "allow, warn or error",
    ENV_BATCH_INVARIANT: "a boolean",
    ENV_ALLOW: "provider entry point names separated by ','",
    ENV_DENY: "provider entry point names separated by ','",
    ENV_NO_AUTOLOAD: "a boolean",
    ENV_STRICT: "a boolean",
    ENV_FAST_LOOKUP: "a boolean",
    ENV_PLATFORM: "the name of a plugin that claims the platform, or 'builtin'",
    ENV_CONFIG: "the path of a TOML file",
    ENV_TUNING: "paths of tuning tables (JSON, written by vllm-ir tune) separated by ':'",
    ENV_TRACE: "a boolean: trace every op call of the process, summary at exit (vllm_ir.trace)",
    ENV_TRACE_DIR: "a folder: where a traced process writes its trace at exit instead of printing it",
    ENV_REFERENCE: "a boolean: run every op native, eager and compiled (vllm_ir.reference)",
    ENV_LOG_LEVEL: "a log level of the vllm_ir logger: CRITICAL, ERROR, WARNING, INFO or DEBUG (any case)",
}

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
BOOLEAN_VALUES = "1, true, yes, on (or 0, false, no, off; any case)"
FALLBACK_POLICIES = ("allow", "warn", "error")
#: What an entry point (and so a provider) name may look like.
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-@]*")


# ---------------------------------------------------------------------------------------
# The parser: one function per kind of value, raising ConfigError.


def raw(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The variable's value, or None when it is unset or blank."""
    value = (os.environ if env is None else env).get(name)
    return value if value is not None and value.strip() else None


def parse_bool(name: str, value: str, *, where: str | None = None) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (any case, surrounding blanks ignored)."""
    v = value.strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    where = where or f"{name}={value!r}"
    raise ConfigError(
        Finding(name, f"{where} is not a boolean; accepted values: {BOOLEAN_VALUES}", f"set {name}=1 or {name}=0")
    )


def parse_choice(name: str, value: str, choices: Sequence[str], *, where: str | None = None) -> str:
    v = value.strip().lower()
    if v in choices:
        return v
    where = where or f"{name}={value!r}"
    hint = _did_you_mean(v, choices)
    raise ConfigError(
        Finding(
            name,
            f"{where} is not accepted; accepted values: {', '.join(choices)}{hint}",
            f"set {name} to one of: {', '.join(choices)}",
        )
    )


def parse_names(name: str, value: str) -> tuple[str, ...]:
    """Names separated by commas (blanks around each ignored, empty items skipped)."""
    items = [item.strip() for item in value.split(",")]
    bad = [item for item in items if item and not NAME.fullmatch(item)]
    if bad:
        recovered = ",".join(n for n in re.split(r"[\s,;:|]+", value) if n)
        raise ConfigError(
            Finding(
                name,
                f"{name}={value!r}: {bad[0]!r} is not a provider name; accepted: provider entry point names "
                f"separated by commas, e.g. {name}=aten,vllm_c",
                f"write {name}={recovered}" if recovered else f"unset {name}",
            )
        )
    return tuple(dict.fromkeys(item for item in items if item))


def read_bool(name: str, default: bool, *, owner: str | None = None, env: Mapping[str, str] | None = None) -> bool:
    """The variable as a boolean; a malformed value is reported (see `report`) and ``default`` used."""
    value = raw(name, env)
    if value is None:
        return default
    try:
        return parse_bool(name, value)
    except ConfigError as exc:
        report(owner or name, [ignored(exc.finding, f"{name} is ignored, so it is {'on' if default else 'off'}")])
        return default


def ignored(finding: Finding, consequence: str) -> Finding:
    """``finding`` with what happens instead (``...; VLLM_IR_FALLBACK is ignored, so ...``)."""
    return Finding(finding.setting, f"{finding.message}; {consequence}", finding.fix, finding.here_only)


#: How close (difflib's ratio) an unknown provider name must be to a known one to be its typo.
TYPO_CUTOFF = 0.8


def looks_like_typo(name: str, known: Iterable[str]) -> bool:
    """Whether a provider name nothing here answers to is a misspelling: a near miss of a name
    discovery knows (``vlm_c`` for ``vllm_c``). Any other name is taken for a provider installed
    on other machines (a setting shared between machines may name a third-party one), so no
    list of provider names lives in the core. "Near" is difflib's ratio >= 0.8 (one or two
    letters off), stricter than `did_you_mean`'s 0.6 hint, under which ``aiter`` (another
    machine's) would count as a misspelling of ``aten``."""
    import difflib

    return bool(difflib.get_close_matches(name, list(known), n=1, cutoff=TYPO_CUTOFF))


def unknown_names(
    setting: str, names: Iterable[str], installed: Iterable[str], *, what: str, consequence: str
) -> list[Finding]:
    """Findings for names that are not ``installed`` (every entry point discovery found, loaded or
    not): a typo of one of them (problem), else a provider absent here (note)."""
    installed = sorted(set(installed))
    out = []
    for n in names:
        if n in installed:
            continue
        listing = ", ".join(installed) or "(none)"
        if not looks_like_typo(n, installed):
            out.append(
                Finding(
                    setting,
                    f"{setting} names {n!r}, which is not installed here ({what}: {listing}); {consequence}",
                    f"nothing to do if {n} is meant for other machines; else install it",
                    here_only=True,
                )
            )
        else:
            out.append(
                Finding(
                    setting,
                    f"{setting} names {n!r}, which is no known provider ({what}: {listing})"
                    f"{_did_you_mean(n, installed)}; {consequence}",
                    f"correct the name in {setting}",
                )
            )
    return out


def _did_you_mean(name: str, choices: Iterable[str]) -> str:
    import difflib  # only when there is a mistake to explain: keeps `import vllm_ir` lean

    close = difflib.get_close_matches(name, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


did_you_mean = _did_you_mean


# ---------------------------------------------------------------------------------------
# Problems: recorded per owner (replaced when the owner re-reads), warned about once.

_recorded: dict[str, list[Finding]] = {}
_warned: set[str] = set()


def report(owner: str, findings: Sequence[Finding], *, warn: bool = True, replace: bool = False) -> None:
    """Record ``findings`` under ``owner`` (for ``doctor``) and warn once about each."""
    current = [] if replace else _recorded.get(owner, [])
    for f in findings:
        if f not in current:
            current.append(f)
    _recorded[owner] = current
    if warn:
        for f in findings:
            if f.message not in _warned:
                _warned.add(f.message)
                warnings.warn(f"{f.message} (fix: {f.fix})", ConfigWarning, stacklevel=user_stacklevel())


def clear(owner: str) -> None:
    _recorded.pop(owner, None)


def findings() -> list[Finding]:
    """Every recorded finding, problems and notes, in the order they were recorded."""
    seen: list[Finding] = []
    for group in _recorded.values():
        seen += [f for f in group if f not in seen]
    return seen


def forget_warnings() -> None:
    _warned.clear()


#: Frames of vllm_ir itself: every module of the package (this file is in its settings/) and the
#: generated entry points.
_OWN_CODE = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep, "<vllm_ir.")


def user_stacklevel(*, skip_importlib: bool = True) -> int:
    """``stacklevel`` for a warning its caller raises: the first frame outside vllm_ir (and,
    with ``skip_importlib``, outside importlib, for settings read while a module imports). The
    one walker of vllm_ir's warnings."""
    frame, level = sys._getframe(1), 1  # 1: the function that calls warnings.warn
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith(_OWN_CODE) or (skip_importlib and "importlib" in frame.f_code.co_filename)
    ):
        frame, level = frame.f_back, level + 1
    return level
