"""Registering implementations: every check, and that a refusal leaves no trace."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import vllm_ir
from tests.ops_for_tests import inplace_fused_add_rms_norm, rms_norm_impl
from vllm_ir import RegistrationError

rms_norm = vllm_ir.ops.rms_norm


def _refused(match: str, provider: str = "bad", **options):
    before = dict(rms_norm.impls)
    epoch_dispatch = rms_norm.dispatch(torch.ones(2, 4), None, 1e-6).provider
    with pytest.raises(RegistrationError, match=match) as info:
        yield_fn = options.pop("fn", None)
        rms_norm.register_impl(provider, **options)(yield_fn)
    assert rms_norm.impls == before
    assert rms_norm.dispatch(torch.ones(2, 4), None, 1e-6).provider == epoch_dispatch
    return info.value


def _impl(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    return x


def test_registers_and_reports_flags():
    rms_norm.register_impl("good", inplace=False, batch_invariant=True)(_impl)
    impl = rms_norm.impls["good"]
    assert (impl.provider, impl.batch_invariant, impl.inplace, impl.cacheable) == ("good", True, False, True)


def test_refuses_different_parameter_name():
    def renamed(y: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
        return y

    err = _refused("implementation signature does not match", fn=renamed)
    assert err.op == "rms_norm" and err.provider == "bad"
    assert "(Tensor y," in str(err) and "(Tensor x," in str(err)


def test_refuses_different_annotation():
    def retyped(x: Tensor, weight: Tensor, epsilon: float, variance_size: int | None = None) -> Tensor:
        return x

    _refused("does not match", fn=retyped)


def test_refuses_different_default():
    def redefault(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = 4) -> Tensor:
        return x

    _refused("does not match", fn=redefault)


def test_refuses_different_return_type():
    def returns_two(
        x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
    ) -> tuple[Tensor, Tensor]:
        return x, x

    _refused("does not match", fn=returns_two)


def test_refuses_keyword_only_implementation():
    def kw(x: Tensor, weight: Tensor | None, *, epsilon: float, variance_size: int | None = None) -> Tensor:
        return x

    _refused("keyword-only parameter 'epsilon'", fn=kw)


def test_refuses_predicate_with_other_parameters():
    _refused("supports_args must take the op's parameters", fn=_impl, supports_args=lambda x, weight, epsilon: True)
    _refused(
        "supports_args must take the op's parameters",
        fn=_impl,
        supports_args=lambda x, weight, epsilon, variance_size=3: True,
    )


def test_refuses_inplace_for_op_without_allow_inplace():
    _refused("inplace=True needs an op declared with allow_inplace=True", fn=_impl, inplace=True)


@pytest.mark.parametrize("reserved", ["native", "unfused"])
def test_refuses_reserved_provider_names(reserved):
    _refused("reserved provider names", provider=reserved, fn=_impl)


def test_refuses_second_implementation_of_same_provider():
    rms_norm_impl("twice")
    err = _refused("already has an implementation", provider="twice", fn=_impl)
    assert "one functional and/or one in-place (inplace=True) kernel per op" in str(err)


def test_refuses_non_bool_supported():
    _refused("supported must be a bool or vllm_ir.Unsupported", fn=_impl, supported="yes")


def test_inplace_registration_allowed_on_allow_inplace_op():
    vllm_ir.ops.fused_add_rms_norm.register_impl("mine", inplace=True)(inplace_fused_add_rms_norm)
    assert vllm_ir.ops.fused_add_rms_norm.impls["mine"].inplace


def test_native_cannot_be_removed_and_removal_invalidates():
    rms_norm_impl("gone")
    vllm_ir.set_priority(rms_norm=["gone"])
    x, w, eps = torch.ones(2, 4), None, 1e-6
    assert rms_norm.dispatch(x, w, eps).provider == "gone"
    rms_norm(x, w, eps)
    vllm_ir.clear_priority()
    rms_norm.remove_impl("gone")
    assert rms_norm.dispatch(x, w, eps).provider == "native"
    with pytest.raises(RegistrationError, match="native implementation cannot be removed"):
        rms_norm.remove_impl("native")


def test_unannotated_implementation_takes_the_op_signature():
    @rms_norm.register_impl("plain")
    def plain(x, weight, epsilon, variance_size=None):
        return rms_norm.fn(x, weight, epsilon, variance_size) + 1

    x = torch.randn(2, 4)
    with vllm_ir.priority(rms_norm=["plain"]):
        torch.testing.assert_close(rms_norm(x, None, 1e-6), rms_norm.fn(x, None, 1e-6) + 1)
        assert rms_norm.cached_dispatch(x, None, 1e-6).provider == "plain"


@pytest.mark.parametrize(
    "fn",
    [
        lambda y, weight, epsilon, variance_size=None: y,
        lambda x, weight, epsilon, variance_size=4: x,
        lambda x, weight, epsilon: x,
    ],
    ids=["renamed", "other-default", "missing-parameter"],
)
def test_unannotated_implementation_must_still_take_the_op_parameters(fn):
    err = _refused("the implementation must take the op's parameters with the same names and defaults", fn=fn)
    assert "op expects:    (x, weight, epsilon, variance_size=None)" in str(err)


@pytest.mark.parametrize("name", ["Mine", "my-provider", "1st", "mine.v2", ""])
def test_refuses_provider_names_outside_lowercase_identifiers(name):
    _refused(r"must match \[a-z_\]\[a-z0-9_\]\*", provider=name, fn=_impl)


def _functional_fused(
    x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> tuple[Tensor, Tensor]:
    _functional_fused.calls += 1
    return vllm_ir.ops.fused_add_rms_norm.fn(x, x_residual, weight, epsilon, variance_size)


_functional_fused.calls = 0


@pytest.mark.parametrize("first", ["functional", "inplace"])
def test_a_provider_registers_both_kernel_forms_under_one_name(first):
    fused = vllm_ir.ops.fused_add_rms_norm
    forms = {"functional": (_functional_fused, False), "inplace": (inplace_fused_add_rms_norm, True)}
    order = [first, *(f for f in forms if f != first)]
    for form in order:
        fn, inplace = forms[form]
        fused.register_impl("both", inplace=inplace, batch_invariant=True)(fn)
    impl = fused.impls["both"]
    assert (impl.fn, impl.inplace, impl.inplace_fn) == (_functional_fused, False, inplace_fused_add_rms_norm)
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    expected = fused.fn(x, r, w, 1e-6)
    _functional_fused.calls = 0
    with vllm_ir.priority(fused_add_rms_norm=["both"]), torch.no_grad():
        out = fused(x.clone(), r.clone(), w, 1e-6)  # the functional kernel: no clones
        assert _functional_fused.calls == 1
        xi, ri = x.clone(), r.clone()
        out_inplace = fused.maybe_inplace(xi, ri, w, 1e-6)  # the in-place kernel, on the donated buffers
        assert _functional_fused.calls == 1
        assert out_inplace[0].data_ptr() == xi.data_ptr() and out_inplace[1].data_ptr() == ri.data_ptr()
        fused.maybe_inplace(xi, xi, w, 1e-6)  # aliased: the functional kernel instead
        assert _functional_fused.calls == 2
    for got in (out, out_inplace):
        torch.testing.assert_close(got, expected)


def test_second_form_must_repeat_the_options_and_differ_in_kind():
    fused = vllm_ir.ops.fused_add_rms_norm
    fused.register_impl("twice", batch_invariant=True)(_functional_fused)
    with pytest.raises(RegistrationError, match="one functional and/or one in-place"):
        fused.register_impl("twice", inplace=True)(inplace_fused_add_rms_norm)  # batch_invariant differs
    with pytest.raises(RegistrationError, match="one functional and/or one in-place"):
        fused.register_impl("twice", batch_invariant=True)(_functional_fused)  # the same form again
    assert fused.impls["twice"].inplace_fn is None


def test_register_unsupported_records_the_reason_without_a_kernel():
    impl = rms_norm.register_unsupported("far_away", "needs the FarAway accelerator")
    assert not impl.supported and impl.unsupported_reason == "needs the FarAway accelerator"
    x = torch.randn(2, 4)
    with vllm_ir.priority(rms_norm=["far_away"]):
        verdicts = {v.provider: v for v in rms_norm.explain(x, None, 1e-6).verdicts}
        assert verdicts["far_away"].status == "unsupported"
        assert verdicts["far_away"].reason == "needs the FarAway accelerator"
        assert rms_norm.cached_dispatch(x, None, 1e-6).provider == "native"
    with pytest.raises(AssertionError, match="never dispatched"):
        impl.fn(x, None, 1e-6)
    with pytest.raises(RegistrationError, match="already has an implementation"):
        rms_norm.register_unsupported("far_away", "again")
    with pytest.raises(RegistrationError, match="inplace=True needs an op declared with allow_inplace"):
        rms_norm.register_unsupported("far_inplace", "x", inplace=True)
