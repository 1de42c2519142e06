"""Site policy without packaging: a TOML file named by ``VLLM_IR_CONFIG``.

::

    # /etc/vllm-ir.toml  (VLLM_IR_CONFIG=/etc/vllm-ir.toml)
    platform = "builtin"                 # or the plugin to take the platform from (VLLM_IR_PLATFORM)
    fallback = "warn"                    # allow | warn | error (VLLM_IR_FALLBACK)
    batch_invariant = false              # (VLLM_BATCH_INVARIANT)
    trace = false                        # trace the whole process, summary at exit (VLLM_IR_TRACE)
    reference = false                    # every op runs native, eager and compiled (VLLM_IR_REFERENCE)
    disable_providers = ["inductor"]     # added to VLLM_IR_DISABLE_PROVIDERS
    # providers = ["aten", "vllm_c"]     # allow-list, used when VLLM_IR_PROVIDERS is unset

    [priority]                           # both modes
    rms_norm = ["vllm_c", "native"]

    [priority.compile]                   # one mode; replaces [priority]'s list for that op
    rms_norm = ["native"]

    tuning = ["tuning.json"]             # measured tables (vllm-ir tune), relative to this file;
                                         # below VLLM_IR_TUNING's, above the providers' shipped ones

The file's priorities are a layer of their own, above the platform and provider defaults and
below ``VLLM_IR_OP_PRIORITY`` (so one run can still override the site), shown in ``vllm-ir
ops`` and ``explain`` as ``config <path>``. Every other key yields to its environment
variable when that is set. The file is parsed with the standard library's `tomllib` here;
the names in it (ops, providers) are checked once providers are loaded. Errors name the
file, the line (where it can be found) and the key; like a malformed environment variable
(`vllm_ir.settings.env`), a bad entry is ignored with a warning at an implicit read, listed by
``vllm-ir doctor``, and raised by `vllm_ir.reload_env`.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_ir.settings import env
from vllm_ir.settings.env import Finding

MODES = ("eager", "compile")
KEYS = (
    "platform",
    "fallback",
    "batch_invariant",
    "trace",
    "reference",
    "providers",
    "disable_providers",
    "priority",
    "tuning",
)
#: Keys that take true or false.
SWITCHES = ("batch_invariant", "trace", "reference")
OWNER = "config"


@dataclass(frozen=True)
class SiteConfig:
    """The parsed file (empty when ``VLLM_IR_CONFIG`` is unset). Names are not checked yet."""

    path: str | None = None
    platform: str | None = None
    fallback: str | None = None
    batch_invariant: bool | None = None
    trace: bool | None = None
    reference: bool | None = None
    providers: tuple[str, ...] | None = None
    disable_providers: tuple[str, ...] = ()
    #: mode -> op -> providers, as written (checked against the registry by vllm_ir.ir.priority).
    priority: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)
    #: mode -> op -> where the list was written (for messages).
    priority_where: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    #: Tuning tables named by the ``tuning`` key, as absolute paths (read by vllm_ir.ir.tuning).
    tuning: tuple[str, ...] = ()
    findings: tuple[Finding, ...] = ()

    @property
    def source(self) -> str:
        """The origin string of its priority entries: ``config /abs/path.toml``."""
        return f"config {self.path}"

    def where(self, key: str) -> str:
        return f"config {self.path}, key {key}"


_current: SiteConfig | None = None


def current() -> SiteConfig:
    """The site config of this process (read once; `reload` reads it again)."""
    global _current
    if _current is None:
        _current = load()
        env.report(OWNER, list(_current.findings), replace=True)
    return _current


def reload() -> SiteConfig:
    global _current
    _current = None
    env.clear(OWNER)
    return current()


def reset() -> None:
    global _current
    _current = None
    env.clear(OWNER)


def load(environ: Mapping[str, str] | None = None) -> SiteConfig:
    """Read and validate the file ``VLLM_IR_CONFIG`` names; problems are in ``findings``."""
    value = env.raw(env.ENV_CONFIG, environ)
    if value is None:
        return SiteConfig()
    path = os.path.abspath(os.path.expanduser(value.strip()))
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        return SiteConfig(
            path,
            findings=(
                Finding(
                    env.ENV_CONFIG,
                    f"{env.ENV_CONFIG}={value!r}: cannot read {path} ({reason}); the config file is ignored",
                    f"point {env.ENV_CONFIG} at a readable TOML file, or unset it",
                ),
            ),
        )
    text = data.decode("utf-8", errors="replace")
    try:
        toml = _tomllib()
    except ImportError:
        return SiteConfig(
            path,
            findings=(
                Finding(
                    env.ENV_CONFIG,
                    f"config {path}: reading TOML needs Python 3.11 (tomllib) or the tomli package; "
                    "the file is ignored",
                    "pip install tomli, or use Python 3.11+",
                ),
            ),
        )
    try:
        doc = toml.loads(text)
    except toml.TOMLDecodeError as exc:
        line = getattr(exc, "lineno", None) or _line_from_message(str(exc))
        where = f"config {path}" + (f", line {line}" if line else "")
        return SiteConfig(
            path,
            findings=(
                Finding(where, f"{where}: not valid TOML ({exc}); the config file is ignored", "fix the TOML syntax"),
            ),
        )
    return _validate(path, doc, text.splitlines())


def _tomllib() -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib


def _validate(path: str, doc: dict[str, Any], lines: list[str]) -> SiteConfig:
    findings: list[Finding] = []
    values: dict[str, Any] = {}

    def where(*key: str) -> str:
        line = line_of(lines, key)
        return f"config {path}" + (f", line {line}" if line else "") + f", key {'.'.join(key)}"

    def bad(key: tuple[str, ...], message: str, fix: str) -> None:
        w = where(*key)
        findings.append(Finding(w, f"{w}: {message}; the key is ignored", fix))

    for key, value in doc.items():
        if key not in KEYS:
            bad((key,), f"unknown key{env.did_you_mean(key, KEYS)}; accepted keys: {', '.join(KEYS)}", "remove it")
        elif key == "platform":
            if isinstance(value, str) and value.strip():
                values["platform"] = value.strip()
            else:
                bad((key,), f"must be a plugin name or 'builtin', not {value!r}", 'write platform = "builtin"')
        elif key == "fallback":
            policy = value.strip().lower() if isinstance(value, str) else None
            if policy in env.FALLBACK_POLICIES:
                values["fallback"] = policy
            else:
                bad((key,), f"{value!r} is not accepted; accepted values: {', '.join(env.FALLBACK_POLICIES)}",
                    'write fallback = "warn"')  # fmt: skip
        elif key in SWITCHES:
            if isinstance(value, bool):
                values[key] = value
            else:
                bad((key,), f"must be true or false, not {value!r}", f"write {key} = true")
        elif key in ("providers", "disable_providers"):
            names = _names(value)
            if names is None:
                bad((key,), f"must be a list of provider names, not {value!r}", f'write {key} = ["aten"]')
            else:
                values[key] = names
        elif key == "tuning":
            names = [value] if isinstance(value, str) else value
            if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
                bad((key,), f"must be a path or a list of paths of tuning tables, not {value!r}",
                    'write tuning = ["tuning.json"]')  # fmt: skip
            else:
                base = os.path.dirname(path)
                values["tuning"] = tuple(os.path.join(base, os.path.expanduser(n.strip())) for n in names)
        elif key == "priority":
            if not isinstance(value, dict):
                bad((key,), f"must be a table of op = [providers], not {value!r}", "write [priority] on its own line")
                continue
            _priority(value, values, bad, where)
    return SiteConfig(path, findings=tuple(findings), **values)


def _priority(table: dict[str, Any], values: dict[str, Any], bad: Any, where: Any) -> None:
    both: dict[str, tuple[str, ...]] = {}
    both_where: dict[str, str] = {}
    per_mode: dict[str, dict[str, tuple[str, ...]]] = {m: {} for m in MODES}
    per_mode_where: dict[str, dict[str, str]] = {m: {} for m in MODES}
    for key, value in table.items():
        if key in MODES:
            if not isinstance(value, dict):
                bad(("priority", key), f"must be a table of op = [providers], not {value!r}", f"write [priority.{key}]")
                continue
            for op, providers in value.items():
                names = _names(providers)
                if names is None or not names:
                    bad(("priority", key, op), f"must be a non-empty list of provider names, not {providers!r}",
                        f"write {op} = {_as_list(providers)}")  # fmt: skip
                else:
                    per_mode[key][op] = names
                    per_mode_where[key][op] = where("priority", key, op)
            continue
        names = _names(value)
        if isinstance(value, dict):  # [priority.eagr]: a table, so meant as a mode
            mode = next((m for m in MODES if env.did_you_mean(key, [m])), None)
            close = f"; did you mean {mode!r}?" if mode else ""
            bad(("priority", key), f"[priority.{key}] is not a mode; accepted: [priority.eager], "
                f"[priority.compile] or op = [providers] in [priority]{close}",
                f"rename the table [priority.{mode or 'eager'}]")  # fmt: skip
        elif names is None or not names:
            bad(("priority", key), f"must be a non-empty list of provider names (or a [priority.eager] / "
                f"[priority.compile] table), not {value!r}", f"write {key} = {_as_list(value)}")  # fmt: skip
        else:
            both[key] = names
            both_where[key] = where("priority", key)
    values["priority"] = {m: {**both, **per_mode[m]} for m in MODES}
    values["priority_where"] = {m: {**both_where, **per_mode_where[m]} for m in MODES}


def _as_list(value: Any) -> str:
    """The fix for a priority that is not a list of names: the names it holds as a TOML list
    (``"aten"`` -> ``["aten"]``, ``"vllm_c, native"`` -> ``["vllm_c", "native"]``), else ``["native"]``."""
    items = value if isinstance(value, list) else [value]
    names = [n.strip() for v in items if isinstance(v, str) for n in v.split(",") if env.NAME.fullmatch(n.strip())]
    return "[" + ", ".join(f'"{n}"' for n in dict.fromkeys(names or ["native"])) + "]"


def _names(value: Any) -> tuple[str, ...] | None:
    if not isinstance(value, list) or not all(isinstance(v, str) and env.NAME.fullmatch(v.strip()) for v in value):
        return None
    return tuple(dict.fromkeys(v.strip() for v in value))


_KEY = r"(?:[A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*')"


@functools.cache
def _line_patterns() -> tuple[re.Pattern[str], re.Pattern[str]]:
    """A table header and a key assignment: compiled when a config file has a problem to place,
    not at ``import vllm_ir``."""
    return re.compile(r"^\s*\[\s*([^\[\]]+?)\s*\]\s*(#.*)?$"), re.compile(rf"^\s*({_KEY}(?:\s*\.\s*{_KEY})*)\s*=")


def _key_parts(text: str) -> tuple[str, ...]:
    return tuple(p.strip().strip("\"'") for p in re.split(r"\s*\.\s*(?=(?:[^\"']|\"[^\"]*\"|'[^']*')*$)", text))


def line_of(lines: list[str], key: tuple[str, ...]) -> int | None:
    """1-based line where ``key`` (a dotted path) is assigned or its table opens, best effort."""
    table: tuple[str, ...] = ()
    header_pattern, assign_pattern = _line_patterns()
    for number, line in enumerate(lines, 1):
        header = header_pattern.match(line)
        if header:
            table = _key_parts(header.group(1))
            if table == key:
                return number
            continue
        assign = assign_pattern.match(line)
        if assign and table + _key_parts(assign.group(1)) == key:
            return number
    return None


def _line_from_message(message: str) -> int | None:
    m = re.search(r"line (\d+)", message)
    return int(m.group(1)) if m else None
