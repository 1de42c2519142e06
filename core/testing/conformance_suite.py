"""Collected by ``pytest --vllm-ir-conformance``: the kit's tests for each requested provider."""

from __future__ import annotations

import vllm_ir
from vllm_ir.testing import conformance_tests, pytest_plugin

_config = pytest_plugin.active_config()


def _providers() -> list[str]:
    named = _config.getoption("--vllm-ir-provider")
    if named:
        return named
    loaded = (vllm_ir.ProviderStatus.LOADED, vllm_ir.ProviderStatus.UNSUPPORTED)
    return sorted({p for r in vllm_ir.provider_records() if r.status in loaded for p in r.implementations})


for _provider in _providers():
    globals().update(
        conformance_tests(
            _provider,
            small=_config.getoption("--vllm-ir-small"),
            examples=_config.getoption("--vllm-ir-examples"),
            compiled="--vllm-ir-skip-compile given" if _config.getoption("--vllm-ir-skip-compile") else True,
            device=_config.getoption("--vllm-ir-device"),
            seed=_config.getoption("--vllm-ir-seed"),
        )
    )
