"""The conformance kit over providers/vllm_c (numerics grid, predicates, overloads, opcheck, compile).

vllm_c-specific behaviour (rounding points, strided rows, build records, CPU variants, the
CUDA sources compiling) is in tests/test_provider_vllm_c.py.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm_ir_provider_vllm_c") is None:
    pytest.skip("providers/vllm_c is not installed (scripts/setup.sh installs it)", allow_module_level=True)

from vllm_ir.testing import conformance_tests

globals().update(conformance_tests("vllm_c"))
