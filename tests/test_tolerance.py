"""Per-dtype tolerances of an op: torch's fp32 default, overrides, and no silent guess."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import vllm_ir
from tests.conftest import unique
from vllm_ir.ir.op import DEFAULT_TOLERANCES


def _fresh_op() -> vllm_ir.IrOp:
    def scale(x: Tensor, factor: float) -> Tensor:
        return x * factor

    scale.__name__ = unique("tolerance_scale")
    return vllm_ir.register_op(scale)


def test_float32_default_is_torch_assert_close_default():
    # torch.testing.assert_close: rtol 1.3e-6, atol 1e-5 for float32.
    assert _fresh_op().tolerance(torch.float32) == (1e-5, 1.3e-6)
    assert DEFAULT_TOLERANCES[torch.float32] == (1e-5, 1.3e-6)


def test_op_tolerance_overrides_the_default_for_its_dtype_only():
    op = _fresh_op()
    op.set_tolerance(torch.float16, atol=2e-3, rtol=5e-3)
    assert op.tolerance(torch.float16) == (2e-3, 5e-3)
    assert op.tolerance(torch.bfloat16) == DEFAULT_TOLERANCES[torch.bfloat16]


def test_unknown_dtype_is_an_error_naming_op_and_dtype():
    op = _fresh_op()
    with pytest.raises(LookupError, match=rf"op '{op.name}' has no tolerance for torch.int32: call .*set_tolerance"):
        op.tolerance(torch.int32)


def test_set_tolerance_makes_a_new_dtype_known():
    op = _fresh_op()
    op.set_tolerance(torch.float8_e4m3fn, atol=0.1, rtol=0.1)
    assert op.tolerance(torch.float8_e4m3fn) == (0.1, 0.1)


@pytest.mark.parametrize("atol", [-1e-3, float("nan"), float("inf"), "1e-3", True])
def test_set_tolerance_refuses_a_bad_value(atol):
    op = _fresh_op()
    with pytest.raises(vllm_ir.RegistrationError, match=rf"op '{op.name}': atol for torch.float32 must be a finite"):
        op.set_tolerance(torch.float32, atol=atol, rtol=1e-3)
    assert op.tolerance(torch.float32) == DEFAULT_TOLERANCES[torch.float32]


def test_set_tolerance_refuses_a_non_dtype():
    op = _fresh_op()
    with pytest.raises(vllm_ir.RegistrationError, match=r"needs a torch\.dtype, got str"):
        op.set_tolerance("float32", atol=1e-3, rtol=1e-3)
