"""The folders of ``vllm_ir`` import one way only, so each part can be read (and replaced) from
the bottom up: settings know nothing of the IR core, the IR core nothing of the plugin layer,
the plugin layer nothing of the compile passes, and only the tools see everything.

Every ``import`` counts, at module level or inside a function, with or without
``TYPE_CHECKING``: a deferred import is still a dependency, it only hides a cycle from Python.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

CORE = pathlib.Path(__file__).resolve().parents[1] / "core"

#: Bottom to top. A module may import its own part and the parts before it.
LAYERS = ("errors", "settings", "ir", "plugins", "passes", "integrations", "testing", "tools")

#: Parts that may use the public facade (``import vllm_ir``, ``from vllm_ir import ops``):
#: the facade imports the parts below them, so nothing beneath may lean on it.
FACADE_USERS = ("integrations", "testing", "tools")


def _part(module: str) -> str:
    """``vllm_ir.ir.dispatch.selection`` -> ``ir``; the facade (``vllm_ir``) -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(CORE).with_suffix("")
    name = ".".join(("vllm_ir", *rel.parts))
    return name.removesuffix(".__init__")


def _is_module(name: str) -> bool:
    rel = pathlib.Path(*name.split(".")[1:])
    return (CORE / rel).with_suffix(".py").is_file() or (CORE / rel / "__init__.py").is_file()


def imports_of(path: pathlib.Path) -> list[tuple[int, str]]:
    """Every vllm_ir module ``path`` imports, with the line: ``from a import b`` names ``a.b``
    where ``b`` is a module, else ``a``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "vllm_ir"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm_ir":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append((node.lineno, sub if _is_module(sub) else node.module))
    return found


MODULES = sorted(p for p in CORE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_belongs_to_a_part():
    loose = [_module_name(p) for p in MODULES if _part(_module_name(p)) not in (*LAYERS, "", "__main__")]
    assert not loose, f"modules outside the parts {LAYERS}: {loose}"


def violations(path: pathlib.Path) -> list[str]:
    here = _module_name(path)
    part = _part(here)
    if part in ("", "__main__"):  # the facade and ``python -m vllm_ir`` may import anything
        return []
    rank = LAYERS.index(part)
    bad = []
    for line, target in imports_of(path):
        there = _part(target)
        if there == "":
            if part not in FACADE_USERS:
                bad.append(f"{path.relative_to(CORE)}:{line} imports the facade (vllm_ir) from {part}/")
        elif LAYERS.index(there) > rank:
            bad.append(f"{path.relative_to(CORE)}:{line} {part}/ imports {target} ({there}/ is above it)")
    return bad


@pytest.mark.parametrize("part", LAYERS)
def test_parts_import_only_downwards(part):
    bad = [v for p in MODULES if _part(_module_name(p)) == part for v in violations(p)]
    assert not bad, "imports against the layer order " + " < ".join(LAYERS) + ":\n" + "\n".join(bad)


def test_the_check_sees_a_violation(tmp_path):
    """The checker itself: an upward import, and one hidden in a function, are both caught."""
    fake = CORE / "settings" / "_architecture_probe.py"
    fake.write_text("def f():\n    from vllm_ir.ir import op\n")
    try:
        assert violations(fake) == [
            "settings/_architecture_probe.py:2 settings/ imports vllm_ir.ir.op (ir/ is above it)"
        ]
    finally:
        fake.unlink()


def test_only_the_entry_points_import_the_cli():
    """The verbs share `vllm_ir.tools.arguments` and `vllm_ir.tools.output`; the CLI module
    itself is a leaf (``vllm-ir`` and ``python -m vllm_ir``), so tools never import in a circle."""
    users = [
        f"{p.relative_to(CORE)}:{line}"
        for p in MODULES
        if _module_name(p) not in ("vllm_ir.__main__", "vllm_ir.tools.cli")
        for line, target in imports_of(p)
        if target == "vllm_ir.tools.cli"
    ]
    assert not users, f"modules importing vllm_ir.tools.cli: {users}"
