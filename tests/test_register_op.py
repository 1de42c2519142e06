"""Declaring ops: forms, the torch library definition, and every refusal."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import vllm_ir
from tests.conftest import unique
from vllm_ir import RegistrationError


def _declare(name: str, **options):
    def scale(x: Tensor, factor: float = 2.0) -> Tensor:
        return x * factor

    return vllm_ir.register_op(name=name, **options)(scale)


def test_bare_decorator_uses_function_name_and_is_reachable_from_ops():
    name = unique("bare")
    ns: dict = {}
    exec(f"def {name}(x: Tensor, y: Tensor) -> Tensor:\n    return x + y", {"Tensor": Tensor}, ns)
    op = vllm_ir.register_op(ns[name])
    assert vllm_ir.ops.__getattr__(name) is op
    assert torch.equal(op(torch.ones(2), torch.ones(2)), torch.full((2,), 2.0))
    assert "native" in op.impls


def test_named_op_defines_torch_op_with_schema():
    name = unique("scaled")
    op = _declare(name)
    packet = getattr(torch.ops.vllm_ir, name)
    assert str(packet.default._schema) == f"vllm_ir::{name}(Tensor x, float factor=2.) -> Tensor"
    assert "maybe_inplace" not in packet.overloads()
    assert op.schema == "(Tensor x, float factor=2.0) -> Tensor"
    assert torch.equal(packet.default(torch.ones(2)), torch.full((2,), 2.0))


def test_allow_inplace_adds_maybe_inplace_overload():
    name = unique("inpl")
    _declare(name, allow_inplace=True)
    packet = getattr(torch.ops.vllm_ir, name)
    assert set(packet.overloads()) == {"default", "maybe_inplace"}


def test_core_ops_exist_in_torch_namespace():
    assert str(torch.ops.vllm_ir.rms_norm.default._schema) == (
        "vllm_ir::rms_norm(Tensor x, Tensor? weight, float epsilon, SymInt? variance_size=None) -> Tensor"
    )
    assert str(torch.ops.vllm_ir.fused_add_rms_norm.maybe_inplace._schema).startswith(
        "vllm_ir::fused_add_rms_norm.maybe_inplace(Tensor x, Tensor x_residual, Tensor? weight"
    )


def test_activations_default_to_x_prefixed_tensor_parameters():
    assert vllm_ir.ops.fused_add_rms_norm.activations == ("x", "x_residual")
    assert vllm_ir.ops.rms_norm.activations == ("x",)


def test_explicit_activations_must_be_tensor_parameters():
    with pytest.raises(RegistrationError, match="activation 'factor' is not a Tensor parameter"):
        _declare(unique("act"), activations=["factor"])


def test_fake_is_native_unless_replaced():
    from torch._subclasses.fake_tensor import FakeTensorMode

    name = unique("fakeable")
    op = _declare(name)
    with FakeTensorMode():
        out = getattr(torch.ops.vllm_ir, name).default(torch.empty(3, 5))
    assert out.shape == (3, 5)

    def fake(x, factor=2.0):
        return x.new_empty(x.shape[0])

    op.register_fake(fake)
    with FakeTensorMode():
        out = getattr(torch.ops.vllm_ir, name).default(torch.empty(3, 5))
    assert out.shape == (3,)


@pytest.mark.parametrize("bad", ["Upper", "1abc", "with-dash", "", "has space"])
def test_refuses_bad_names(bad):
    with pytest.raises(RegistrationError, match="lowercase Python identifiers"):
        _declare(bad)
    assert bad not in vllm_ir.ops


def test_refuses_duplicate_op_name():
    name = unique("dup")
    _declare(name)
    with pytest.raises(RegistrationError, match=f"op '{name}' is already registered"):
        _declare(name)


def test_refuses_keyword_only_parameters():
    def kw(x: Tensor, *, factor: float) -> Tensor:
        return x * factor

    name = unique("kw")
    with pytest.raises(RegistrationError, match="keyword-only parameter 'factor'"):
        vllm_ir.register_op(name=name)(kw)
    assert name not in vllm_ir.ops
    assert not hasattr(torch.ops.vllm_ir, name)


def test_refuses_unannotated_function_without_leaving_a_torch_definition():
    def loose(x, factor):
        return x * factor

    name = unique("loose")
    with pytest.raises(RegistrationError, match="cannot infer a torch schema"):
        vllm_ir.register_op(name=name)(loose)
    assert name not in vllm_ir.ops
    assert not hasattr(torch.ops.vllm_ir, name)


def test_unknown_op_lists_known_ops():
    with pytest.raises(vllm_ir.UnknownOpError, match=r"known ops: .*fused_add_rms_norm.*rms_norm"):
        vllm_ir.ops.no_such_op  # noqa: B018


def test_op_without_allow_inplace_has_a_maybe_inplace_that_says_why_not():
    op = _declare(unique("scale_no_inplace"))
    with pytest.raises(TypeError, match=r"op 'scale_no_inplace_t\d+' has no maybe_inplace overload"):
        op.maybe_inplace(torch.ones(2), 2.0)


def test_op_is_complete_when_constructed_and_has_its_own_class():
    op = _declare(unique("scale_own_class"))
    assert type(op).__name__ == f"IrOp_{op.name}" and type(op).__mro__[1] is vllm_ir.IrOp
    assert type(vllm_ir.ops.rms_norm) is not type(op)
    assert op.decision_cache.key is not None and op(torch.ones(2), 3.0).tolist() == [3.0, 3.0]


def test_token_params_must_be_tensor_parameters():
    with pytest.raises(RegistrationError, match="token parameter 'factor' is not a Tensor parameter"):
        _declare(unique("scale_bad_token"), token_params=["factor"])


def test_generated_code_shows_in_tracebacks():
    import traceback

    try:
        vllm_ir.ops.rms_norm(torch.ones(2, 4), "not a tensor", 1e-6)
    except TypeError as exc:
        text = "".join(traceback.format_exception(exc))
    assert "<vllm_ir.ops.rms_norm." in text
    assert "_bad_arguments(" in text  # the generated line itself, from linecache
