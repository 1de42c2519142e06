"""Throw-away provider distributions: a real ``*.dist-info`` with METADATA and entry_points.txt.

Put on ``sys.path`` (or ``PYTHONPATH`` for a subprocess), importlib.metadata finds them
exactly like installed wheels, so discovery runs its real code path.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

GOOD_IMPL = """
import vllm_ir
from torch import Tensor

@vllm_ir.ops.rms_norm.register_impl({provider!r})
def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    CALLS.append({provider!r})
    return vllm_ir.ops.rms_norm.fn(x, weight, epsilon, variance_size)

CALLS = []
"""


def make_dist(
    root: Path,
    dist: str,
    source: str,
    *,
    entry: str | None = None,
    module: str | None = None,
    version: str = "1.0.0",
    requires: tuple[str, ...] = ("vllm-ir>=0.1",),
) -> Path:
    """Write module ``module`` and a dist-info declaring entry point ``entry`` for it."""
    module = module or dist.replace("-", "_")
    entry = entry or module
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    meta = ["Metadata-Version: 2.1", f"Name: {dist}", f"Version: {version}"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(meta) + "\n")
    (info / "entry_points.txt").write_text(f"[vllm_ir.providers]\n{entry} = {module}\n")
    return root


def isolated_site(root: Path, monkeypatch: Any) -> Iterator[Path]:
    """Body of a ``site`` fixture: ``root`` on sys.path, plugin env vars unset, discovery reset.

    Modules named ``tp_*`` that a test imported are forgotten afterwards. Use as
    ``yield from isolated_site(tmp_path, monkeypatch)``.
    """
    from vllm_ir.plugins import discovery as plugins

    monkeypatch.syspath_prepend(str(root))
    for var in (
        "VLLM_IR_DISABLE_PLUGIN_AUTOLOAD",
        "VLLM_IR_PROVIDERS",
        "VLLM_IR_DISABLE_PROVIDERS",
        "VLLM_IR_STRICT_PLUGINS",
        "VLLM_IR_OOT_PLATFORM",
        "VLLM_IR_PLATFORM",
        "VLLM_IR_CONFIG",
    ):
        monkeypatch.delenv(var, raising=False)
    importlib.invalidate_caches()
    plugins.reset_for_tests()
    modules_before = set(sys.modules)
    yield root
    sys.path.remove(str(root))
    importlib.invalidate_caches()
    plugins.reset_for_tests()
    for name in set(sys.modules) - modules_before:
        if name.startswith("tp_"):
            del sys.modules[name]
