"""`import_families`: the one family-discovery scan (op declarations and providers share it).

It lives in ``ir`` so the declarations can use it without importing the registration surface
(`vllm_ir.plugins.provider` re-exports it for providers).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from types import ModuleType


def import_families(
    package: str, path: Iterable[str], skip: Callable[[str], bool] | None = None
) -> tuple[ModuleType, ...]:
    """Import every public module (no leading underscore) of ``package`` at ``path`` in name
    order, so adding an op family is adding a file; the modules, in that order."""
    modules = []
    for name in sorted(m.name for m in pkgutil.iter_modules(list(path))):
        if name.startswith("_") or (skip is not None and skip(name)):
            continue
        modules.append(importlib.import_module(f"{package}.{name}"))
    return tuple(modules)
