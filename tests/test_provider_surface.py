"""`vllm_ir.Provider`: one registration surface per provider (issue 35, point 1)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode

import vllm_ir
from vllm_ir import Provider, RegistrationError, Unsupported
from vllm_ir.plugins.provider import adapt_predicate, default_fakes, empty_group_scales, import_families, weight_or_ones

_count = iter(range(1_000_000))


@pytest.fixture
def ops():
    """A fresh norm-like op with both forms, and a plain one (new names each time: a torch op
    name is not defined twice in one process)."""
    n = next(_count)

    def add_norm(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
        s = x + x_residual
        y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + epsilon)
        return (y if weight is None else y * weight), s

    def scale(x: Tensor, factor: float) -> Tensor:
        return x * factor

    return (
        vllm_ir.register_op(name=f"surface_add_norm_{n}", allow_inplace=True)(add_norm),
        vllm_ir.register_op(name=f"surface_scale_{n}")(scale),
    )


def _prio(**by_op):
    return vllm_ir.priority(**{op.name: [provider] for op, provider in by_op.values()})


def _args():
    x = torch.randn(4, 8)
    return x, torch.randn(4, 8), torch.rand(8) + 0.5, 1e-6


def test_one_call_registers_both_kernel_forms(ops):
    add_norm, _ = ops
    calls = []
    p = Provider("surface_both", batch_invariant=True)

    @p.impl(add_norm)
    def kernel(x, x_residual, weight, epsilon=1e-6, inplace=False):
        calls.append(inplace)
        y, s = add_norm.fn(x, x_residual, weight, epsilon)
        if inplace:
            x_residual.copy_(s)
            x.copy_(y)
            return x, x_residual
        return y, s

    impl = add_norm.impls["surface_both"]
    assert impl.inplace_fn is not None and not impl.inplace and impl.batch_invariant
    assert p.impls == {add_norm.name: impl}
    args = _args()
    with _prio(a=(add_norm, "surface_both")):
        expected = add_norm.fn(*args)
        out = add_norm(*args)
        torch.testing.assert_close(out, expected)
        x, r = args[0].clone(), args[1].clone()
        y, s = add_norm.maybe_inplace(x, r, args[2], args[3])
        assert y.data_ptr() == x.data_ptr() and s.data_ptr() == r.data_ptr()
        torch.testing.assert_close((y, s), expected)
    assert calls == [False, True]


def test_a_kernel_with_inplace_needs_an_op_allowing_it(ops):
    _, scale = ops
    p = Provider("surface_noinplace")
    with pytest.raises(RegistrationError, match="allow_inplace=True") as err:
        p.register(scale, lambda x, factor, inplace=False: x * factor)
    assert err.value.op == scale.name and err.value.provider == "surface_noinplace"
    assert "surface_noinplace" not in scale.impls


def test_predicates_take_only_what_they_read(ops):
    add_norm, scale = ops
    seen = []

    def wants_residual(x_residual, x):  # any order, a subset
        seen.append((x.shape, x_residual.shape))
        return x.shape == x_residual.shape or Unsupported("shapes differ")

    p = Provider("surface_pred")
    p.register(
        add_norm,
        lambda x, x_residual, weight, epsilon=1e-6: add_norm.fn(x, x_residual, weight, epsilon),
        supports=wants_residual,
    )
    p.register(scale, lambda x, factor: x * factor, supports=lambda factor: factor > 0 or Unsupported("factor <= 0"))
    pred = add_norm.impls["surface_pred"].supports_args
    # Adapted once to the op's own parameters: the dispatcher hands it the call's arguments.
    import inspect

    assert list(inspect.signature(pred).parameters) == ["x", "x_residual", "weight", "epsilon"]
    x, r, w, eps = _args()
    with _prio(a=(add_norm, "surface_pred"), s=(scale, "surface_pred")):
        assert add_norm.dispatch(x, r, w, eps).provider == "surface_pred"
        assert seen == [(x.shape, r.shape)]
        assert add_norm.dispatch(x, r[:, :4], w, eps).provider == "native"
        assert "shapes differ" in str(add_norm.explain(x, r[:, :4], w, eps))
        assert scale.dispatch(x, 2.0).provider == "surface_pred"
        assert "factor <= 0" in str(scale.explain(x, -1.0))


def test_a_predicate_naming_an_unknown_parameter_is_refused_leaving_nothing(ops):
    add_norm, _ = ops
    p = Provider("surface_unknown")

    def kernel(x, x_residual, weight, epsilon=1e-6, inplace=False):
        return x, x_residual

    with pytest.raises(RegistrationError) as err:
        p.register(add_norm, kernel, supports=lambda x, variance_size: True)
    message = str(err.value)
    assert f"'{add_norm.name}'" in message and "'surface_unknown'" in message and "'variance_size'" in message
    assert "op parameters: x, x_residual, weight, epsilon" in message
    assert "surface_unknown" not in add_norm.impls and p.impls == {}


def test_a_predicate_default_must_be_the_ops():
    with pytest.raises(RegistrationError, match="default"):
        adapt_predicate(vllm_ir.ops.rms_norm, "surface_defaults", lambda x, variance_size=3: True)
    full = lambda x, weight, epsilon, variance_size=None: True  # noqa: E731
    assert adapt_predicate(vllm_ir.ops.rms_norm, "surface_defaults", full) is full


@pytest.mark.filterwarnings("ignore::vllm_ir.ConfigWarning")
def test_a_supports_tuple_is_checked_member_by_member():
    op = vllm_ir.ops.rms_norm
    with pytest.raises(vllm_ir.RegistrationError, match="supports takes 'scale', which the op does not have"):
        adapt_predicate(op, "surface_tuple", (lambda x: True, lambda scale: True))
    with pytest.raises(vllm_ir.RegistrationError, match="supports is an empty sequence"):
        adapt_predicate(op, "surface_tuple", ())
    both = adapt_predicate(op, "surface_tuple", (lambda x: x.dim() > 0, lambda variance_size: variance_size is None))
    assert list(inspect.signature(both).parameters) == list(op.signature.parameters)
    assert both(torch.ones(2), None, 1e-6) is True
    assert both(torch.ones(()), None, 1e-6) is False
    assert both(torch.ones(2), None, 1e-6, 1) is False


def test_a_missing_library_marks_every_op_unavailable_with_one_reason(ops):
    add_norm, scale = ops
    reason = Unsupported("libsurface not installed")
    p = Provider("surface_missing", available=reason)

    @p.impl(add_norm, supports=lambda x: True)
    def kernel(x, x_residual, weight, epsilon=1e-6, inplace=False):
        raise AssertionError("never called")

    @p.impl(scale, supported=Unsupported("an older build"))
    def scaled(x, factor):
        raise AssertionError("never called")

    assert p.reason == "libsurface not installed"
    for op in ops:
        impl = op.impls["surface_missing"]
        assert impl.supported == reason and impl.unsupported_reason == "libsurface not installed"
    x, r, w, eps = _args()
    with _prio(a=(add_norm, "surface_missing")):
        assert add_norm.dispatch(x, r, w, eps).provider == "native"
    # When the library is there, the implementation's own reason stands.
    q = Provider("surface_present")
    q.register(scale, lambda x, factor: x * factor, supported=Unsupported("an older build"))
    assert scale.impls["surface_present"].unsupported_reason == "an older build"


def test_unknown_options_are_refused(ops):
    with pytest.raises(RegistrationError, match="unknown option"):
        Provider("surface_opts", fast=True)
    with pytest.raises(RegistrationError, match="unknown option"):
        Provider("surface_opts").register(ops[1], lambda x, factor: x, fast=True)
    with pytest.raises(RegistrationError, match="available must be"):
        Provider("surface_opts", available="yes")


def test_default_fakes_for_a_kernel_library_that_writes_its_arguments():
    lib = torch.library.Library("vllm_ir_surface_test", "DEF")
    try:
        lib.define("scale_into(Tensor(a!) out, Tensor x, float s) -> ()")
        lib.define("norm_of(Tensor x) -> Tensor")

        def scale_into(out, x, s):
            out.copy_(x * s)

        lib.impl("scale_into", scale_into, "CompositeExplicitAutograd")
        assert default_fakes("vllm_ir_surface_test") == ["vllm_ir_surface_test::scale_into"]
        assert default_fakes("vllm_ir_surface_test") == []  # already there
        with FakeTensorMode():
            x = torch.empty(3, 5)
            out = torch.empty(3, 5)
            torch.ops.vllm_ir_surface_test.scale_into(out, x, 2.0)
            assert out.shape == (3, 5)
    finally:
        lib._destroy()


@pytest.mark.compile
def test_ops_fake_comes_from_the_op_under_compile_and_fake_mode(ops):
    """A kernel registered through the surface needs no fake of its own: the op's function is it."""
    _, scale = ops
    p = Provider("surface_fake")

    @p.impl(scale)
    def scaled(x, factor):
        return x * factor

    with FakeTensorMode():
        x = torch.empty(2, 7)
        with _prio(s=(scale, "surface_fake")):
            out = scale.torch_op(x, 3.0)
        assert out.shape == (2, 7)

    def f(x):
        return scale(x, 3.0) + 1

    x = torch.randn(2, 7)
    with _prio(s=(scale, "surface_fake")):
        compiled = torch.compile(f, backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), x * 3 + 1)


def test_import_families_imports_public_modules_in_order(tmp_path, monkeypatch):
    pkg = tmp_path / "surface_families"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("b_family", "a_family", "_private"):
        (pkg / f"{name}.py").write_text(f"NAME = {name!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import surface_families

    modules = import_families("surface_families", surface_families.__path__)
    assert [m.NAME for m in modules] == ["a_family", "b_family"]


def test_weight_or_ones_stands_in_a_cached_ones_vector_but_never_caches_a_fake():
    x, w = torch.randn(3, 8, dtype=torch.bfloat16), torch.rand(8, dtype=torch.bfloat16)
    assert weight_or_ones(x, w) is w
    with FakeTensorMode() as mode:
        fake = weight_or_ones(mode.from_tensor(x), None)
    ones = weight_or_ones(x, None)
    assert ones is not fake and type(ones) is torch.Tensor  # the traced call left no fake in the cache
    assert torch.equal(ones, torch.ones(8, dtype=torch.bfloat16)) and weight_or_ones(x, None) is ones
    assert weight_or_ones(x.float(), None).dtype == torch.float32


def test_the_op_declarations_are_found_by_the_same_scan():
    from vllm_ir.ir import declarations, families

    assert import_families is families.import_families  # one scan, re-exported for providers
    names = [m.__name__.rpartition(".")[2] for m in declarations.FAMILIES]
    assert names == sorted(names) and {"activation", "layernorm", "quant"} <= set(names)
    assert {op.fn.__module__ for op in vllm_ir.ops} <= {m.__name__ for m in declarations.FAMILIES}


def test_vllm_c_registers_through_the_surface():
    pytest.importorskip("vllm_ir_provider_vllm_c")
    from vllm_ir_provider_vllm_c._extension import VLLM_C

    assert set(VLLM_C.impls) >= {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"}
    # The Provider's own record: the registry may have been reset since the module was imported.
    fused = VLLM_C.impls["fused_add_rms_norm"]
    assert fused.inplace_fn is not None and not fused.inplace
    assert VLLM_C.impls["rotary_embedding"].inplace


def test_every_in_repo_provider_registers_through_the_surface():
    """Each provider package's `Provider` object holds every implementation it registered."""
    import importlib

    surfaces = {
        "aiter": ("vllm_ir_provider_aiter", "AITER"),
        "xpu_kernels": ("vllm_ir_provider_xpu_kernels", "XPU"),
        "oink": ("vllm_ir_provider_oink", "OINK"),
        "flashinfer": ("vllm_ir_provider_flashinfer", "FLASHINFER"),
        "triton": ("vllm_ir_provider_triton", "TRITON"),
    }
    for name, (module, attr) in surfaces.items():
        pytest.importorskip(module)
        # The Provider's own record (the registry may have been reset since the module loaded).
        surface = getattr(importlib.import_module(module), attr)
        assert isinstance(surface, Provider) and surface.name == name and surface.impls
        for op_name, impl in surface.impls.items():
            assert (impl.op_name, impl.provider) == (op_name, name)
            if not surface.available:  # one reason for every op of a provider whose library is missing
                assert impl.supported.reason == surface.reason


@pytest.mark.parametrize("shape", [(5, 300), (2, 3, 256), (300,)], ids=str)
@pytest.mark.parametrize("column_major", [False, True])
def test_empty_group_scales_take_the_layout_native_returns(shape, column_major):
    """The scales kernels write are laid out as native's: shape, dtype and strides."""
    if column_major and len(shape) < 2:
        pytest.skip("column-major scales need x of 2 or more dimensions (native raises)")
    x = torch.randn(shape)
    _q, want = vllm_ir.ops.dynamic_group_quant_fp8.fn(x, 128, column_major, False, torch.float8_e4m3fn)
    got = empty_group_scales(x.shape, 128, column_major, x.device)
    assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())
