"""Write the manual's generated references from their one source of truth, so they cannot drift.

- docs/settings.md, section ``variables``: every variable of `vllm_ir.settings.env.VARIABLES`;
- docs/settings.md, section ``config-keys``: every key the config loader accepts
  (`vllm_ir.settings.config.KEYS`; what each takes is written here, and a key without a line here, or
  a line for a key the loader no longer has, is an error);
- docs/cli.md, section ``cli``: every verb and option of the argparse parsers
  (`vllm_ir.tools.cli.build_parser`).

Each section sits between two marker comments in its file; the prose around it is written by
hand. ``python scripts/gen_reference.py`` rewrites the sections, ``--check`` only says which
files differ (exit 1), as tests/test_readme.py does.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMAND = "python scripts/gen_reference.py"
BEGIN = "<!-- BEGIN GENERATED {name}: written by " + COMMAND + " from the code; do not edit -->"
END = "<!-- END GENERATED {name} -->"
#: The width argparse formats usage lines at here (a terminal's width must not change the text).
WIDTH = 100

#: What each config-file key takes, and how it meets its environment variable (by the
#: variable's constant in vllm_ir.settings.env). Switches (`vllm_ir.settings.config.SWITCHES`) take true or false.
CONFIG_KEYS: dict[str, tuple[str, str, str]] = {
    "platform": ('a plugin name, or `"builtin"`', "ENV_PLATFORM", "yields to"),
    "fallback": ('`"allow"`, `"warn"` or `"error"`', "ENV_FALLBACK", "yields to"),
    "batch_invariant": ("", "ENV_BATCH_INVARIANT", "yields to"),
    "trace": ("", "ENV_TRACE", "yields to"),
    "reference": ("", "ENV_REFERENCE", "yields to"),
    "providers": ("a list of provider names (allow-list)", "ENV_ALLOW", "used only when this is unset:"),
    "disable_providers": ("a list of provider names (deny-list)", "ENV_DENY", "added to"),
    "priority": (
        "tables of `op = [providers]`: `[priority]` (both modes), `[priority.eager]`, `[priority.compile]`",
        "ENV_PRIORITY",
        "a priority layer below",
    ),
    "tuning": (
        "a path or a list of paths of tuning tables, relative to the file",
        "ENV_TUNING",
        "below the tables of",
    ),
}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def variables() -> str:
    from vllm_ir.settings import env

    rows = ["| variable | takes |", "|---|---|"]
    rows += [f"| `{name}` | {_cell(takes)} |" for name, takes in env.VARIABLES.items()]
    return "\n".join(rows)


def config_keys() -> str:
    from vllm_ir.settings import config, env

    keys = set(config.KEYS)
    if keys != set(CONFIG_KEYS):
        raise SystemExit(
            f"{COMMAND}: the config loader's keys and CONFIG_KEYS here differ: "
            f"not described here {sorted(keys - set(CONFIG_KEYS))}, no longer keys {sorted(set(CONFIG_KEYS) - keys)}"
        )
    rows = ["| key | takes | environment variable |", "|---|---|---|"]
    for key in config.KEYS:
        takes, variable, relation = CONFIG_KEYS[key]
        if key in config.SWITCHES:
            takes = "`true` or `false`"
        rows.append(f"| `{key}` | {_cell(takes)} | {relation} `{getattr(env, variable)}` |")
    return "\n".join(rows)


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = parser.formatter_class(prog=parser.prog, width=WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return formatter.format_help().strip()


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser.formatter_class(prog=parser.prog, width=WIDTH)
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            name = ", ".join(f"`{o}`" for o in action.option_strings)
            value = (
                ""
                if action.nargs == 0
                else formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
            )
        else:
            metavar = action.metavar or formatter._get_default_metavar_for_positional(action)
            name = f"`{metavar}`"
            value = {"*": "zero or more", "+": "one or more", "?": "optional", argparse.REMAINDER: "the rest"}.get(
                action.nargs, ""
            )
        if value and action.option_strings:
            value = f"`{value}`"
        help_text = formatter._expand_help(action) if action.help else ""
        rows.append(f"| {name} | {_cell(value)} | {_cell(help_text)} |")
    return rows


def _verb(parser: argparse.ArgumentParser, level: str) -> list[str]:
    out = [f"{level} `{parser.prog}`", ""]
    if parser.description:
        out += [parser.description[0].upper() + parser.description[1:] + ".", ""]
    out += ["```text", _usage(parser), "```", ""]
    rows = _options(parser)
    if rows:
        out += ["| argument | value | what it does |", "|---|---|---|", *rows, ""]
    if parser.epilog:
        out += ["```text", parser.epilog.strip(), "```", ""]
    for sub in _subcommands(parser).values():
        out += _verb(sub, level + "#")
    return out


def cli() -> str:
    from vllm_ir.tools import cli as vllm_ir_cli

    top = vllm_ir_cli.build_parser()
    verbs = _subcommands(top)
    out = ["Verbs: " + ", ".join(f"[`{name}`](#vllm-ir-{name})" for name in verbs) + ".", ""]
    for parser in verbs.values():
        out += _verb(parser, "###")
    return "\n".join(out).rstrip()


#: file -> section name -> what writes it.
SECTIONS: dict[str, dict[str, Callable[[], str]]] = {
    "docs/settings.md": {"variables": variables, "config-keys": config_keys},
    "docs/cli.md": {"cli": cli},
}


def render(text: str, name: str, body: str, where: str = "") -> str:
    """``text`` with the section ``name`` (between its markers) replaced by ``body``."""
    pattern = re.compile(re.escape(BEGIN.format(name=name)) + r"\n.*?" + re.escape(END.format(name=name)), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{COMMAND}: {where} has no section {name!r} (its marker lines: {BEGIN.format(name=name)})")
    return pattern.sub(lambda _: f"{BEGIN.format(name=name)}\n{body}\n{END.format(name=name)}", text, count=1)


def generate(repo: Path = REPO) -> dict[Path, tuple[str, str]]:
    """Every generated file: (the text checked in, the text the code makes now)."""
    out = {}
    for file, sections in SECTIONS.items():
        path = repo / file
        old = path.read_text()
        new = old
        for name, make in sections.items():
            new = render(new, name, make(), file)
        out[path] = (old, new)
    return out


def stale(repo: Path = REPO) -> list[str]:
    """The generated files whose checked-in text differs from what the code makes now."""
    return [path.relative_to(repo).as_posix() for path, (old, new) in generate(repo).items() if old != new]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is out of date")
    args = parser.parse_args(argv)
    status = 0
    for path, (old, new) in generate().items():
        if old == new:
            continue
        name = path.relative_to(REPO).as_posix()
        if args.check:
            print(f"{name} is out of date: run {COMMAND}", file=sys.stderr)
            status = 1
        else:
            path.write_text(new)
            print(f"wrote {name}")
    return status


if __name__ == "__main__":
    sys.exit(main())
