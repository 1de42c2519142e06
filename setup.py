"""Builds the optional ``vllm_ir.ir.dispatch._fast_lookup`` extension; metadata lives in pyproject.toml.

The extension reads the eager decision-cache key straight from torch's tensors, so it is
compiled against the installed torch, which is only visible without build isolation::

    pip install --no-build-isolation -e .

An isolated build (plain ``pip install``) does not see torch and installs pure Python; so
does any failed build (a warning, never an error). vllm_ir behaves the same either way, the
eager hot path is just slower (``vllm-ir doctor`` says which one runs and why).
``VLLM_IR_BUILD_EXTENSION=0`` skips the build; ``=1`` makes a failure an error (for CI).
"""

from __future__ import annotations

import os
import sys

from setuptools import setup

EXTENSION = "vllm_ir.ir.dispatch._fast_lookup"
SOURCES = ["core/ir/dispatch/fast_lookup.cpp"]
WANTED = os.environ.get("VLLM_IR_BUILD_EXTENSION", "auto")


def _torch_build_tools():
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return None
    return torch, cpp_extension


def _setup_kwargs() -> dict:
    tools = None if WANTED == "0" else _torch_build_tools()
    if tools is None:
        if WANTED == "1":
            raise RuntimeError(f"{EXTENSION}: VLLM_IR_BUILD_EXTENSION=1 but torch is not importable at build time")
        return {}
    torch, cpp_extension = tools

    class OptionalBuildExtension(cpp_extension.BuildExtension):
        """A failed build installs pure Python instead of failing the install."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as e:
                if WANTED == "1":
                    raise
                print(f"WARNING: {EXTENSION} was not built ({e}); vllm_ir runs pure Python", file=sys.stderr)

    ext = cpp_extension.CppExtension(
        EXTENSION,
        SOURCES,
        define_macros=[("VLLM_IR_BUILT_FOR_TORCH", f'"{torch.__version__}"')],
        extra_compile_args=["-O2", "-g0"] if sys.platform != "win32" else [],
        optional=True,  # setuptools then tolerates the missing output of a failed build
    )
    return {"ext_modules": [ext], "cmdclass": {"build_ext": OptionalBuildExtension}}


setup(**_setup_kwargs())
