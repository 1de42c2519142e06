"""The conformance kit over the pure-PyTorch providers (aten, inductor) from providers/native."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("vllm_ir_provider_native") is None:
    pytest.skip("providers/native is not installed (scripts/setup.sh installs it)", allow_module_level=True)

from vllm_ir.testing import conformance_tests

globals().update(conformance_tests("aten"))

# Each dtype x input variant x layout is one Inductor compile (1-4 s here): fp32 exercises
# every compiled variant; bf16/fp16 go through the same generated code with other casts.
globals().update(conformance_tests("inductor", dtypes=(torch.float32,), examples=5))
