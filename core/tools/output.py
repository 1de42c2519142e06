"""How every ``vllm-ir`` verb prints: tables fitted to the terminal, one-line cells, and the
``--json`` document (``schema`` and the ``machine`` block first).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

#: Version of every ``--json`` document's layout (``"schema": "vllm-ir.<verb>/<version>"``);
#: raised when a field changes meaning or goes away (new fields do not raise it).
JSON_VERSION = 1


def one_line(text: str | None) -> str:
    """The first line of a (multi-line) reason, saying how much is left out: a table row stays one row."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    return f"{lines[0]} (+{len(lines) - 1} more lines: --json)"


def _fit(natural: list[int], room: int) -> list[int]:
    """Column widths within ``room``: narrow columns keep their width, the wide ones share the rest."""
    if sum(natural) <= room:
        return natural
    widths = list(natural)
    order = sorted(range(len(natural)), key=lambda i: natural[i])
    left = room
    for k, i in enumerate(order):
        share = max(left // (len(order) - k), 6)
        widths[i] = min(natural[i], share)
        left -= widths[i]
    return widths


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], columns: int | None = None, indent: int = 0
) -> str:
    """Aligned columns; with ``columns``, cells wrap (at words) so no line is wider than that.

    A cell's own line breaks are kept (a continuation stays in its column), so a multi-line
    reason never breaks the table.
    """
    cells = [[str(c) if c is not None else "" for c in row] for row in rows]
    natural = [
        max([len(h)] + [len(line) for r in cells for line in r[i].splitlines() or [""]]) for i, h in enumerate(headers)
    ]
    widths = natural if columns is None else _fit(natural, columns - indent - 2 * (len(headers) - 1))

    def render(row: Sequence[str]) -> list[str]:
        parts = [
            _wrap(cell, w) if columns is not None else cell.splitlines() or [""]
            for cell, w in zip(row, widths, strict=True)
        ]
        return [
            "  ".join((p[k] if k < len(p) else "").ljust(w) for p, w in zip(parts, widths, strict=True)).rstrip()
            for k in range(max(len(p) for p in parts))
        ]

    lines = [*render(list(headers)), "  ".join("-" * w for w in widths)]
    for r in cells:
        lines += render(r)
    return "\n".join(" " * indent + line for line in lines)


def _wrap(cell: str, width: int) -> list[str]:
    out: list[str] = []
    for line in cell.splitlines() or [""]:
        out += textwrap.wrap(line, width, subsequent_indent=" ") or [""]
    return out


def machine_block() -> dict[str, Any]:
    """The machine every JSON document was made on, as a program compares two runs.

    The facts a tuning table records (`vllm_ir.ir.tuning.machine_facts`: platform, CPU model
    and ISA or GPU name and compute capability, core count, torch), the versions of every
    loaded provider, vllm-ir and Python, and the OS and architecture.
    """
    import platform

    import vllm_ir
    from vllm_ir.ir import tuning
    from vllm_ir.plugins import discovery as plugins

    try:
        facts = plugins.tuning_facts()
        block = tuning.machine_facts(facts.platform, facts.provider_versions)
    except Exception as exc:  # no platform (doctor says why): the CPU's facts all the same
        block = tuning.machine_facts("unknown", {})
        block["platform_error"] = f"{type(exc).__name__}: {exc}"
    block["vllm_ir"] = vllm_ir.__version__
    block["python"] = platform.python_version()
    block["os"] = platform.system()
    block["arch"] = platform.machine()
    return block


def json_document(verb: str, payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` behind the ``schema`` and ``machine`` keys every ``--json`` output starts with."""
    return {"schema": f"vllm-ir.{verb}/{JSON_VERSION}", "machine": machine_block(), **payload}
