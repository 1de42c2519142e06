"""vLLM 0.33's IR core features: default tolerances per dtype (and an error for a dtype without
one), registration stacks, ``unfused`` reserved, ``IrOp.set_default`` and ``str(op)``."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import vllm_ir
from tests.conftest import unique
from tests.ops_for_tests import discovery_answering, rms_norm_impl
from vllm_ir import PriorityError, PriorityLayer, RegistrationError, ToleranceError
from vllm_ir.ir.impl import RESERVED_PROVIDERS
from vllm_ir.ir.op import DEFAULT_TOLERANCES, registration_site


def _fresh_op(doc: str | None = "Scale x by a factor.\n\n    More text.") -> vllm_ir.IrOp:
    def scale(x: Tensor, factor: float) -> Tensor:
        return x * factor

    scale.__doc__ = doc
    scale.__name__ = unique("parity_scale")
    return vllm_ir.register_op(scale)


# -- tolerances ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.float8_e4m3fn, (0.1, 0.1)),
        (torch.float8_e4m3fnuz, (0.1, 0.1)),
        (torch.float8_e5m2, (0.2, 0.2)),
        (torch.float4_e2m1fn_x2, (0.3, 0.3)),
        (torch.int8, (1.0, 0.0)),
        (torch.float64, (1e-8, 1e-8)),
        (torch.float32, (1e-5, 1.3e-6)),
        (torch.float16, (1e-3, 1e-3)),
    ],
)
def test_default_tolerances_are_vllms(dtype, expected):
    op = _fresh_op()
    assert op.tolerance(dtype) == expected
    assert op.get_tolerance(dtype) == {"atol": expected[0], "rtol": expected[1]}


def test_a_dtype_without_tolerance_raises_naming_op_and_dtype_as_lookup_and_value_error():
    op = _fresh_op()
    assert torch.int32 not in DEFAULT_TOLERANCES
    with pytest.raises(ToleranceError, match=rf"op '{op.name}' has no tolerance for torch.int32") as info:
        op.get_tolerance(torch.int32)
    assert isinstance(info.value, LookupError) and isinstance(info.value, ValueError)


def test_override_tolerance_is_set_tolerance():
    op = _fresh_op()
    op.override_tolerance(torch.int32, atol=2, rtol=0)
    assert op.tolerance(torch.int32) == (2.0, 0.0)
    with pytest.raises(RegistrationError, match=r"atol for torch\.int32 must be a finite number"):
        op.override_tolerance(torch.int32, atol=-1, rtol=0)


def test_bench_and_kit_name_op_and_dtype_when_a_tolerance_is_missing():
    from vllm_ir.testing import Case, compare
    from vllm_ir.tools.bench import validate_case

    op = _fresh_op()
    impl_fn = op.register_impl("int_kernel")(lambda x, factor: x * factor)
    del impl_fn
    impl = op.impls["int_kernel"]
    args = (torch.arange(8, dtype=torch.int32).reshape(2, 4), 3.0)
    result, timed, _ = validate_case(op, impl, args, (2, 4), torch.int32)
    assert result.status == "error" and timed is None
    assert f"op '{op.name}' has no tolerance for torch.int32" in result.detail
    with pytest.raises(ToleranceError, match=rf"op '{op.name}' has no tolerance for torch.int32"):
        compare(op, impl, Case((2, 4), torch.int32), impl.fn(*args), op.fn(*args), args)


# -- registration stacks ---------------------------------------------------------------------


def test_ops_and_implementations_keep_their_registration_stacks():
    op = _fresh_op()
    assert registration_site(op.registration_stack).startswith(f"{__file__}:")
    assert op.impls["native"].registration_stack == op.registration_stack

    @op.register_impl("stacked")
    def kernel(x, factor):
        return x * factor

    stack = op.impls["stacked"].registration_stack
    assert "test_ops_and_implementations_keep_their_registration_stacks" in stack[-1]
    assert not any("vllm_ir/ir/op.py" in frame for frame in stack)  # the decorator's own frames are cut


def test_a_duplicate_implementation_error_shows_both_registration_sites():
    rms_norm_impl("twice_stacked")
    first_site = registration_site(vllm_ir.ops.rms_norm.impls["twice_stacked"].registration_stack)
    with pytest.raises(RegistrationError, match="already has an implementation") as info:
        rms_norm_impl("twice_stacked")
    message = str(info.value)
    assert f"registered at {first_site}; this one at " in message
    assert "ops_for_tests.py" in first_site


def test_a_duplicate_op_error_shows_both_declaration_sites():
    op = _fresh_op()

    def again(x: Tensor, factor: float) -> Tensor:
        return x

    with pytest.raises(RegistrationError, match=rf"op '{op.name}' is already registered") as info:
        vllm_ir.register_op(name=op.name)(again)
    assert f"at {registration_site(op.registration_stack)}; this declaration at {__file__}:" in str(info.value)


def test_explain_verbose_prints_and_returns_the_registration_stacks(capsys):
    import json

    from vllm_ir.tools.cli import main

    assert main(["explain", "rms_norm", "--shape", "2x8", "--verbose"]) == 0
    text = capsys.readouterr().out
    assert "rms_norm declared at:" in text and "layernorm.py" in text
    assert "rms_norm native at:" in text
    assert main(["explain", "rms_norm", "--shape", "2x8", "--verbose", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert any("layernorm.py" in frame for frame in payload["registration_stacks"]["(op)"])
    assert main(["explain", "rms_norm", "--shape", "2x8"]) == 0
    assert "declared at" not in capsys.readouterr().out


# -- reserved names --------------------------------------------------------------------------


def test_unfused_is_reserved_as_in_vllm():
    assert {"native", "unfused"} == set(RESERVED_PROVIDERS)
    op = _fresh_op()
    with pytest.raises(RegistrationError, match=r"'unfused'.* are reserved provider names"):
        op.register_impl("unfused")(lambda x, factor: x)
    assert "unfused" not in op.impls


# -- set_default -----------------------------------------------------------------------------


@pytest.fixture
def two_providers():
    for name in ("d_first", "d_second"):
        rms_norm_impl(name, supports_args=lambda x, weight, epsilon, variance_size=None: True)
    yield vllm_ir.ops.rms_norm
    vllm_ir.ops.rms_norm.set_default(None)


def test_set_default_replaces_the_hook_defaults_below_every_other_layer(two_providers, monkeypatch):

    op = two_providers
    with discovery_answering(defaults=lambda mode: {"rms_norm": [("d_first", "platform test")]}):
        assert [e.provider for e in op.get_priority()] == ["d_first", "native"]
        op.set_default(["d_second"])
        entries = op.get_priority()
        assert [(e.provider, e.layer, e.source) for e in entries] == [
            ("d_second", PriorityLayer.DEFAULT, "set_default"),
            ("native", PriorityLayer.DEFAULT, "always last"),
        ]
        x = torch.ones(2, 4)
        assert op.dispatch(x, None, 1e-6).provider == "d_second"
        assert op.cached_dispatch(x, None, 1e-6).provider == "d_second"
        monkeypatch.setenv("VLLM_IR_OP_PRIORITY", "rms_norm=d_first")
        vllm_ir.reload_env()
        assert [e.provider for e in op.get_priority()] == ["d_first", "d_second", "native"]
        assert op.cached_dispatch(x, None, 1e-6).provider == "d_first"
        monkeypatch.delenv("VLLM_IR_OP_PRIORITY")
        vllm_ir.reload_env()
        op.set_default(None)
        assert [e.source for e in op.get_priority()] == ["platform test", "always last"]


def test_set_default_per_mode(two_providers):
    op = two_providers
    op.set_default(["d_first"], mode="compile")
    assert [e.provider for e in op.get_priority("compile")] == ["d_first", "native"]
    assert [e.provider for e in op.get_priority("eager")] == ["native"]
    with pytest.raises(PriorityError, match="mode must be one of"):
        op.set_default(["d_first"], mode="lazy")


def test_set_default_refuses_unknown_providers(two_providers):
    with pytest.raises(PriorityError, match=r"set_default: unknown provider 'nope' for op 'rms_norm'; known"):
        two_providers.set_default(["nope"])
    assert [e.provider for e in two_providers.get_priority()] == ["native"]


# -- str(op) ---------------------------------------------------------------------------------


def test_str_shows_the_docstrings_first_line_as_vllm_does():
    op = _fresh_op()
    assert str(op) == f"IrOp('{op.name}') - Scale x by a factor."
    assert str(_fresh_op(doc=None)).startswith("IrOp('parity_scale")
    assert str(vllm_ir.ops.rms_norm).startswith("IrOp('rms_norm') - ")
    assert repr(op).startswith(f"<vllm_ir op {op.name}")
