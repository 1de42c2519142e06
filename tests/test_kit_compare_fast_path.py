"""The kit's comparisons take an identical output as no error, and only that: a one-ulp
difference, a NaN where native has none, a differing fp8 byte or a row that differs between
batches still fails (the fast path must not hide what the full comparison finds)."""

from __future__ import annotations

import pytest
import torch

import vllm_ir
from vllm_ir.testing import checks
from vllm_ir.testing.cases import Case


def _op_impl(name: str):
    op = getattr(vllm_ir.ops, name)
    return op, op.impls["native"]


def test_identical_values_and_bytes() -> None:
    x = torch.randn(4, 8)
    assert checks._identical(x, x.clone())
    assert not checks._identical(x, torch.nextafter(x, torch.full_like(x, float("inf"))))
    nan = x.clone()
    nan[1, 2] = float("nan")
    assert not checks._identical(nan, nan.clone())  # NaN: the full comparison decides
    assert not checks._identical(x, x[:3])
    q = x.to(torch.float8_e4m3fn)
    assert checks._identical(q, q.clone())
    other = q.clone()
    other.view(torch.uint8)[0, 0] ^= 1
    assert not checks._identical(q, other)


def test_compare_still_fails_what_differs() -> None:
    op, impl = _op_impl("rms_norm")
    case = Case((4, 8), torch.float32)
    x = torch.randn(4, 8)
    assert checks._compare_tolerance(op, impl, case, [x], [x.clone()]) == (0.0, 0.0)
    nan = x.clone()
    nan[0, 0] = float("nan")
    assert checks._compare_tolerance(op, impl, case, [nan], [nan.clone()]) == (0.0, 0.0)
    with pytest.raises(AssertionError, match="NaN"):
        checks._compare_tolerance(op, impl, case, [nan], [x])
    with pytest.raises(AssertionError, match="tolerance"):
        checks._compare_tolerance(op, impl, case, [x + 1.0], [x])
