"""README.md stays true: every ```python block runs, and the install commands name real distributions and extras.

Each block runs in a fresh interpreter (its registrations and priorities cannot leak into
another), from an empty folder, with no VLLM_IR_* variable set. A block that needs hardware
starts with a marker comment, ``# needs: cuda`` (also ``rocm``, ``xpu``, ``gpu``, or the name
of an importable module, comma-separated), and is skipped where that is missing.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
_BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
_NEEDS = re.compile(r"^\s*#\s*needs:\s*(.+)$", re.M)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, code) of every ```python block."""
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in _BLOCK.finditer(text)]


def missing(code: str) -> list[str]:
    """What a block's ``# needs:`` markers ask for that this machine lacks."""
    out = []
    for marker in _NEEDS.findall(code):
        for need in (n.strip() for n in marker.split(",")):
            if need == "cuda":
                ok = torch.cuda.is_available() and torch.version.cuda is not None
            elif need == "rocm":
                ok = torch.cuda.is_available() and torch.version.hip is not None
            elif need == "gpu":
                ok = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
            elif need == "xpu":
                ok = hasattr(torch, "xpu") and torch.xpu.is_available()
            else:
                ok = importlib.util.find_spec(need) is not None
            if not ok:
                out.append(need)
    return out


_BLOCKS = python_blocks(README.read_text())


def test_the_readme_has_python_blocks():
    assert _BLOCKS


@pytest.mark.parametrize(("line", "code"), _BLOCKS, ids=[f"README.md:{line}" for line, _ in _BLOCKS])
def test_python_block_runs(line, code, tmp_path):
    lacking = missing(code)
    if lacking:
        pytest.skip(f"README.md:{line} needs {', '.join(lacking)}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_IR_", "VLLM_BATCH"))}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600
    )
    assert result.returncode == 0, f"README.md:{line} failed:\n{result.stderr[-3000:]}"


def _declared_extras(distribution: str) -> dict[str, list[str]] | None:
    """The optional dependencies a distribution of this repository declares (None: not ours)."""
    import tomllib

    for pyproject in [REPO / "pyproject.toml", *REPO.glob("providers/*/pyproject.toml")]:
        project = tomllib.loads(pyproject.read_text())["project"]
        if project["name"] == distribution:
            return project.get("optional-dependencies", {})
    return None


def test_triton_declares_the_interpreter_extra():
    """``TRITON_INTERPRET=1`` needs numpy, which Triton does not declare: the ``interpret`` extra does."""
    extras = _declared_extras("vllm-ir-provider-triton")
    assert extras is not None and "interpret" in extras
    assert any(re.match(r"numpy\b", requirement) for requirement in extras["interpret"])


def test_readme_install_commands_name_our_distributions_and_extras():
    text = README.read_text()
    named = re.findall(r"pip install [\"']?(vllm-ir[a-z0-9-]*)(?:\[([a-z0-9_,-]+)\])?", text)
    assert named
    for distribution, extras in named:
        declared = _declared_extras(distribution)
        assert declared is not None, f"README installs {distribution}, which no pyproject.toml here builds"
        for extra in filter(None, extras.split(",")):
            assert extra in declared, f"README installs {distribution}[{extra}], which it does not declare"
    assert "vllm-ir-provider-triton[interpret]" in text  # how to get Triton's interpreter working
