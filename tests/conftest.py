"""Shared fixtures: every test starts from the core's own state and leaves it that way."""

from __future__ import annotations

import itertools
import os

# Core tests are hermetic: installed providers load only where a test asks for them.
os.environ["VLLM_IR_DISABLE_PLUGIN_AUTOLOAD"] = "1"
# The triton provider's kernels run on CPU in Triton's interpreter; Triton reads this once,
# so it is set before anything (Inductor included) can import triton.
os.environ["TRITON_INTERPRET"] = "1"

import pytest

import vllm_ir
from vllm_ir import plugins
from vllm_ir.ir import registry

_ENV = (
    "VLLM_IR_OP_PRIORITY",
    "VLLM_IR_FALLBACK",
    "VLLM_BATCH_INVARIANT",
    "VLLM_IR_PLATFORM",
    "VLLM_IR_CONFIG",
    "VLLM_IR_TUNING",
)
_names = itertools.count()


def unique(name: str) -> str:
    """Torch library definitions live for the process: test ops get fresh names."""
    return f"{name}_t{next(_names)}"


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    for var in _ENV:
        monkeypatch.delenv(var, raising=False)
    ops_before = dict(registry._ops)
    impls_before = {name: dict(op.impls) for name, op in ops_before.items()}
    vllm_ir.clear_priority()
    vllm_ir.reload_env()
    vllm_ir.reset_dispatch_stats()
    yield
    # Undo plugin loading first, with autoload off, so restoring state cannot rediscover anything.
    os.environ["VLLM_IR_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    plugins.reset_for_tests()
    for name in list(registry._ops):
        if name not in ops_before:
            del registry._ops[name]
    for name, impls in impls_before.items():
        registry._ops[name].impls.clear()
        registry._ops[name].impls.update(impls)
    for var in _ENV:
        os.environ.pop(var, None)
    vllm_ir.clear_priority()
    vllm_ir.reload_env()
    vllm_ir.reset_dispatch_stats()


@pytest.fixture(scope="module")
def compile_test_providers():
    """compile_models' opaque and in-place test kernels, for a whole module.

    Module-scoped, so they are registered before `clean_state` snapshots the registry and
    survive its per-test restore. Use with ``pytestmark = pytest.mark.usefixtures(...)``.
    """
    from tests.compile_models import register_test_providers, unregister_test_providers

    register_test_providers()
    yield
    unregister_test_providers()


@pytest.fixture(scope="module")
def compile_test_providers_passes_forced(compile_test_providers):
    """The test kernels, and Inductor's graph caches off so every compile runs the passes."""
    from tests.compile_models import passes_always_run

    with passes_always_run():
        yield
