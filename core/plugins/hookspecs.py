"""The pluggy hooks a provider or platform package may implement, and what each may return.

Hooks run when the registry or the priorities are built (provider discovery, a priority
change), never per op call: one pluggy call costs microseconds.

A provider module marks its implementations with ``@vllm_ir.hookimpl``::

    @vllm_ir.hookimpl
    def vllm_ir_default_priority(platform, mode):
        if platform.name == "cpu":
            return {"rms_norm": ["vllm_c"], "fused_add_rms_norm": ["vllm_c"]}

Every result is checked here, at the boundary, by the ``check_*`` functions: a result that
breaks its hook's contract raises `HookResultError`, and discovery fails that plugin with
the message as its reason, so a bad result can never reach dispatch, ``explain`` or the CLI.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

from vllm_ir.errors import VllmIrError
from vllm_ir.ir import registry, signature
from vllm_ir.ir.priority import MODES

if TYPE_CHECKING:
    from vllm_ir.plugins.platforms import Platform

PROJECT = "vllm_ir"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def vllm_ir_platform() -> Platform | None:
    """Claim the process for an out-of-tree platform by returning its `Platform`, else None.

    When two plugins claim it, ``VLLM_IR_PLATFORM`` (or the config file's ``platform``) picks one;
    without a choice the built-in platform is used, with a warning naming both, and both stay loaded.
    """


@hookspec
def vllm_ir_default_priority(platform: Platform, mode: str) -> Mapping[str, Sequence[str]] | None:
    """Contribute default priority lists, ``{op_name: [provider, ...]}``, for ``mode``.

    ``mode`` is ``"eager"`` or ``"compile"``. The platform's contribution comes first, then
    providers in hook order (pluggy's ``tryfirst``/``trylast`` apply); the first occurrence
    of a provider wins. Every op must be registered; providers are identifiers and may name
    ones that are not installed (they show as "not installed", like a platform's seeds).
    """


@hookspec
def vllm_ir_adjust_priority(op_name: str, priority: list[str], platform: Platform, mode: str) -> list[str] | None:
    """Reorder or filter an op's merged default priority (site policy); return None to keep it.

    Called in hook order, each call seeing the previous result. Providers a hook adds must
    have an implementation of the op; entries it keeps keep their origin, entries it moves
    are marked as adjusted.
    """


@hookspec
def vllm_ir_tuning_tables(platform: Platform) -> Sequence[str] | None:
    """Paths of the measured tuning tables this provider ships (``vllm-ir tune`` output, as
    package data), or None. Every table lists the machine facts it was measured under and
    applies only where they hold (`vllm_ir.ir.tuning`), so a provider may return all of its
    tables on every platform. Read once at discovery, never per call.
    """


@hookspec
def vllm_ir_provider_facts() -> Mapping[str, str] | None:
    """Facts about how this provider runs here, for ``vllm-ir doctor`` and ``providers list``:
    ``{name: one line}`` (e.g. which compiled CPU variant runs, which table path it took), or
    None. Called only by those commands, never per op call; a raising hook shows as its error.
    """


@hookspec
def vllm_ir_environment_variables() -> Mapping[str, str] | None:
    """The environment variables this provider reads itself: ``{name: one line}`` (what it
    takes and does), or None. ``vllm-ir doctor`` lists them, and does not take a set one for a
    misspelling of vllm-ir's own. Called only by the CLI, never per op call.
    """


# ---------------------------------------------------------------------------------------
# What a hook may return


class HookResultError(VllmIrError, ValueError):
    """A hook returned something its spec does not allow (the message names hook, op and value)."""


def check_platform(result: Any) -> Platform | None:
    """``vllm_ir_platform``: a `Platform` (whose defaults are themselves valid) or None."""
    from vllm_ir.plugins.platforms import Platform

    if result is None:
        return None
    if not isinstance(result, Platform):
        raise HookResultError(f"vllm_ir_platform returned {_show(result)}; expected a vllm_ir.Platform or None")
    if not isinstance(result.name, str) or not result.name:
        raise HookResultError(f"vllm_ir_platform returned a Platform named {_show(result.name)}; expected a name")
    for mode in MODES:
        check_default_priority(
            _read(lambda m=mode: result.default_priority(m), f"platform {result.name!r} default_priority({mode!r})"),
            what=f"platform {result.name!r} default_priority({mode!r})",
        )
    return result


def check_default_priority(result: Any, *, what: str = "vllm_ir_default_priority") -> dict[str, tuple[str, ...]]:
    """``{op_name: [provider, ...]}`` or None, as a plain dict of tuples (None: empty)."""
    if result is None:
        return {}
    if not isinstance(result, Mapping):
        raise HookResultError(f"{what} returned {_show(result)}; expected a dict {{op_name: [provider, ...]}} or None")
    items = _read(lambda: list(result.items()), what)
    out: dict[str, tuple[str, ...]] = {}
    for op_name, providers in items:
        if not isinstance(op_name, str):
            raise HookResultError(f"{what}: op name {_show(op_name)} is not a string")
        if not registry.has_op(op_name):
            known = ", ".join(op.name for op in registry.all_ops())
            raise HookResultError(f"{what}: unknown op {op_name!r}; known ops: {known}")
        out[op_name] = _provider_names(providers, f"{what}, op {op_name!r}")
    return out


def check_tuning_tables(result: Any) -> tuple[str, ...]:
    """``vllm_ir_tuning_tables``: None or a list of paths (str or os.PathLike) of existing files."""
    import os

    if result is None:
        return ()
    where = "vllm_ir_tuning_tables"
    if isinstance(result, (str, bytes, os.PathLike)) or not isinstance(result, Iterable):
        raise HookResultError(f"{where} returned {_show(result)}; expected a list of paths or None")
    paths = []
    for item in _read(lambda: list(result), where):
        if not isinstance(item, (str, os.PathLike)):
            raise HookResultError(f"{where}: {_show(item)} is not a path")
        paths.append(os.path.abspath(os.fspath(item)))
    return tuple(paths)


def check_adjusted_priority(result: Any, *, op_name: str, before: Sequence[str]) -> tuple[str, ...] | None:
    """``vllm_ir_adjust_priority``: None (keep) or a list of providers, each added one implemented."""
    if result is None:
        return None
    where = f"vllm_ir_adjust_priority, op {op_name!r}"
    names = _provider_names(result, where)
    impls = registry.get_op(op_name).impls
    for provider in names:
        if provider not in before and provider not in impls:
            known = ", ".join(sorted(impls))
            raise HookResultError(
                f"{where}: added unknown provider {provider!r}; known providers of {op_name}: {known}"
            )
    return names


def check_environment_variables(result: Any) -> dict[str, str]:
    """``vllm_ir_environment_variables``: None or ``{NAME: one line}`` (names as environment
    variables are written, descriptions on one line)."""
    where = "vllm_ir_environment_variables"
    if result is None:
        return {}
    if not isinstance(result, Mapping):
        raise HookResultError(f"{where} returned {_show(result)}; expected a dict {{name: description}} or None")
    out: dict[str, str] = {}
    for name, description in _read(lambda: list(result.items()), where):
        if not isinstance(name, str) or not name.isidentifier() or not name.isupper():
            raise HookResultError(f"{where}: {_show(name)} is not a variable name (e.g. VLLM_IR_MY_OPTION)")
        if not isinstance(description, str) or not description.strip() or "\n" in description.strip():
            raise HookResultError(f"{where}: {name}'s description {_show(description)} is not one line of text")
        out[name] = description.strip()
    return out


def _provider_names(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise HookResultError(f"{where}: expected a list of provider names, got {_show(value)}")
    names = _read(lambda: list(value), where)
    for name in names:
        if not isinstance(name, str):
            raise HookResultError(f"{where}: provider {_show(name)} is not a string")
        if not signature.NAME.match(name):
            raise HookResultError(
                f"{where}: {name!r} is not a provider name (an identifier); provider names match [a-z_][a-z0-9_]*"
            )
    return tuple(dict.fromkeys(names))


def _read(thunk: Any, where: str) -> Any:
    """Run ``thunk`` (iterating a returned object), turning its failure into a `HookResultError`."""
    try:
        return thunk()
    except Exception as exc:
        raise HookResultError(f"{where}: reading the result raised {type(exc).__name__}: {exc}") from exc


def _show(value: Any) -> str:
    """``int 3``, ``str 'x'``: the type, and a short repr that cannot itself fail."""
    try:
        text = reprlib.repr(value)
    except Exception:
        text = "<unprintable>"
    return f"{type(value).__name__} {text}"
