"""The dispatch settings, read in one place: the fallback policy, batch invariance, reference
mode, whole-process tracing, and the priority lists of ``VLLM_IR_OP_PRIORITY`` and the config
file.

Everything is read leniently: a malformed value is left out and becomes a `Finding` saying
what is used instead, so a bad variable never stops a process. Only the syntax is checked
here; whether an op or provider name exists is the IR core's question
(`vllm_ir.ir.priority.check_names`), because only it knows the names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm_ir.errors import ConfigError, Finding
from vllm_ir.settings import env


@dataclass(frozen=True)
class PriorityList:
    """One op's providers as a setting wrote them (names unchecked), and where: the variable
    entry (``rms_norm=vllm_c,native``) or the config key, for the messages about it."""

    providers: tuple[str, ...]
    source: str
    #: The entry as written (``VLLM_IR_OP_PRIORITY``); "" for a config key.
    text: str = ""


@dataclass(frozen=True)
class DispatchSettings:
    fallback: str = "warn"
    batch_invariant: bool = False
    reference: bool = False
    #: op -> its ``VLLM_IR_OP_PRIORITY`` list.
    env_priority: Mapping[str, PriorityList] = field(default_factory=dict)
    #: mode -> op -> its list from the config file.
    config_priority: Mapping[str, Mapping[str, PriorityList]] = field(default_factory=dict)
    #: The config layer's source string, ``"config /path/file.toml"``.
    config_source: str = "config"
    findings: tuple[Finding, ...] = ()


def read(environ: Mapping[str, str]) -> DispatchSettings:
    """The environment over the config file (`vllm_ir.settings.config`), every value checked."""
    from vllm_ir.settings import config

    site = config.current()
    findings: list[Finding] = []

    def choice(name: str, default: str, choices: tuple[str, ...], what: str) -> str:
        value = env.raw(name, environ)
        if value is None:
            return default
        try:
            return env.parse_choice(name, value, choices)
        except ConfigError as exc:
            findings.append(env.ignored(exc.finding, f"{name} is ignored, so {what} is {default!r}"))
            return default

    def boolean(name: str, default: bool, what: str) -> bool:
        value = env.raw(name, environ)
        if value is None:
            return default
        try:
            return env.parse_bool(name, value)
        except ConfigError as exc:
            findings.append(env.ignored(exc.finding, f"{name} is ignored, so {what} is {'on' if default else 'off'}"))
            return default

    fallback = choice(env.ENV_FALLBACK, site.fallback or "warn", env.FALLBACK_POLICIES, "the policy")
    batch_invariant = boolean(env.ENV_BATCH_INVARIANT, bool(site.batch_invariant), "batch invariance")
    reference = boolean(env.ENV_REFERENCE, bool(site.reference), "reference mode")
    env_priority, notes = parse_priority(environ.get(env.ENV_PRIORITY, ""), env.ENV_PRIORITY)
    findings += notes
    config_priority = {
        mode: {
            op: PriorityList(
                tuple(providers), site.priority_where.get(mode, {}).get(op) or site.where(f"priority.{op}")
            )
            for op, providers in lists.items()
        }
        for mode, lists in site.priority.items()
    }
    return DispatchSettings(
        fallback=fallback,
        batch_invariant=batch_invariant,
        reference=reference,
        env_priority=env_priority,
        config_priority=config_priority,
        config_source=site.source,
        findings=tuple(findings),
    )


def parse_priority(spec: str, source: str) -> tuple[dict[str, PriorityList], list[Finding]]:
    """Every well-formed ``op=provider[,provider...]`` entry of ``spec`` (``;``-separated), and a
    finding per entry left out."""
    out: dict[str, PriorityList] = {}
    findings: list[Finding] = []
    for raw in spec.split(";"):
        item = raw.strip()
        if not item:
            continue
        op, sep, rest = item.partition("=")
        op = op.strip()
        providers = tuple(p.strip() for p in rest.split(","))
        if not sep or not op:
            problem = f"{item!r} is not of the form op=provider[,provider...] (in {spec!r})"
        elif not rest.strip() or any(not p for p in providers):
            problem = f"op {op!r} has an empty provider name in {item!r}; expected op=provider[,provider...]"
        elif op in out:
            problem = f"op {op!r} is given twice"
        else:
            out[op] = PriorityList(providers, source, item)
            continue
        findings.append(env.ignored(priority_error(source, problem).finding, f"the entry {item!r} is ignored"))
    return out, findings


def priority_error(source: str, message: str, fix: str | None = None) -> ConfigError:
    """A malformed or unknown priority entry of ``source`` (a variable or config key)."""
    return ConfigError(
        Finding(source, f"{source}: {message}", fix or f"write {source} as op=provider[,provider...];op=...")
    )


def process_traced(environ: Mapping[str, str] | None = None) -> bool:
    """``VLLM_IR_TRACE=1`` (or the config's ``trace = true``): trace the whole process."""
    default = False
    if env.raw(env.ENV_TRACE, environ) is None and env.raw(env.ENV_CONFIG, environ) is not None:
        from vllm_ir.settings import config  # read now only when the variable leaves it to the file

        default = bool(config.current().trace)
    return env.read_bool(env.ENV_TRACE, default, env=environ)
