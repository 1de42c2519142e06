"""Autograd of IR ops: the forward runs the selected kernel, the backward is native's VJP.

Gradients through ``torch.ops.vllm_ir.<op>`` (what eager calls that need grad and compiled
training graphs reach) must equal those of the op's native function under plain autograd,
whichever provider ran the forward; under ``vllm_ir.compile`` too.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

import vllm_ir
from tests.compile_models import make_decoder
from tests.conftest import unique
from vllm_ir.ir import registry

# The providers of this repo register their implementations on import (as plugin discovery
# would), before conftest's per-test registry snapshot.
if importlib.util.find_spec("vllm_ir_provider_native") is not None:
    import vllm_ir_provider_native.aten
    import vllm_ir_provider_native.inductor  # noqa: F401
if importlib.util.find_spec("vllm_ir_provider_vllm_c") is not None:
    import vllm_ir_provider_vllm_c  # noqa: F401

# Without a formula torch falls back to differentiating the kernel's own ops, with this
# warning; for opaque or in-place kernels that loses or corrupts gradients. Never acceptable.
pytestmark = pytest.mark.filterwarnings("error:.*an autograd kernel was not registered")

ops = vllm_ir.ops
EPS = 1e-6
SHAPE = (3, 32)
PROVIDERS = ("native", "aten", "inductor", "vllm_c")  # triton needs its interpreter: not here

#: (dtype, input generator options) per case; fp32 weight on bf16 x promotes the output.
CASES = {
    "fp32": (torch.float32, {}),
    "bf16": (torch.bfloat16, {}),
    "fp32_no_weight": (torch.float32, {"with_weight": False}),
    "bf16_fp32_weight": (torch.bfloat16, {"weight_dtype": torch.float32}),
}


def _tensors(args: tuple) -> list[int]:
    return [i for i, a in enumerate(args) if isinstance(a, Tensor)]


def _loss(outputs: Tensor | tuple[Tensor, ...], seed: int = 1) -> Tensor:
    """Every output counts, and non-linearly: the gradient depends on the forward's values."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    g = torch.Generator().manual_seed(seed)
    total = torch.zeros((), dtype=torch.float32)
    for out in outputs:
        weights = torch.randn(out.shape, generator=g)
        total = total + (out.float() * weights).sum() + 0.25 * out.float().pow(2).sum()
    return total


def _grads(fn, args: tuple) -> list[Tensor | None]:
    """Gradients of `_loss(fn(*args))` w.r.t. every tensor argument (fresh leaves)."""
    leaves = [a.detach().clone().requires_grad_() if isinstance(a, Tensor) else a for a in args]
    wrt = [leaves[i] for i in _tensors(args)]
    return list(torch.autograd.grad(_loss(fn(*leaves)), wrt))


def _assert_grads_close(actual, expected, tolerance: tuple[float, float], what: str) -> None:
    assert len(actual) == len(expected)
    atol, rtol = tolerance
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a is not None, f"{what}: no gradient for tensor argument {i}"
        assert a.dtype == e.dtype and a.shape == e.shape, f"{what}: argument {i}"
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol, msg=lambda m, i=i: f"{what}, argument {i}: {m}")


# ---------------------------------------------------------------------------------------
# eager, through the torch op


@pytest.mark.filterwarnings("ignore::vllm_ir.FallbackWarning")
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("op_name", ["rms_norm", "fused_add_rms_norm"])
def test_torch_op_gradients_equal_native_autograd_for_every_provider(op_name, case, provider):
    op = getattr(ops, op_name)
    if provider not in op.impls:
        pytest.skip(f"provider {provider!r} is not installed")
    dtype, options = CASES[case]
    args = op.generate_inputs(SHAPE, dtype, **options)
    with vllm_ir.priority(**{op_name: [provider]}):
        chosen = op.dispatch(*args)
        if chosen.provider != provider:
            verdict = next(v for v in op.explain(*args).verdicts if v.provider == provider)
            pytest.skip(f"{provider} declines {case}: {verdict.reason}")
        actual = _grads(op.torch_op.default, args)
    expected = _grads(op.fn, args)
    _assert_grads_close(actual, expected, op.tolerance(dtype), f"{op_name} [{case}] forward by {provider}")


def test_output_has_a_grad_fn_and_backward_reaches_every_input():
    x, w = (t.requires_grad_() for t in ops.rms_norm.generate_inputs(SHAPE, torch.float32)[:2])
    y = torch.ops.vllm_ir.rms_norm.default(x, w, EPS)
    assert y.grad_fn is not None
    y.sum().backward()
    assert x.grad is not None and w.grad is not None


def test_inputs_that_do_not_require_grad_and_unused_outputs_get_none():
    x, r, w, eps, _ = ops.fused_add_rms_norm.generate_inputs(SHAPE, torch.float32)
    x.requires_grad_()
    out, residual = torch.ops.vllm_ir.fused_add_rms_norm.default(x, r, w, eps)
    assert residual.grad_fn is not None
    (grad_x,) = torch.autograd.grad(out.sum(), [x])  # the residual output is unused

    leaf = x.detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad(ops.fused_add_rms_norm.fn(leaf, r, w, eps)[0].sum(), [leaf])
    torch.testing.assert_close(grad_x, expected, atol=0, rtol=0)
    assert r.grad is None and w.grad is None


def test_maybe_inplace_overload_is_functional_and_differentiable_like_default():
    """``maybe_inplace`` has the functional schema (register_autograd refuses mutable ones), so it
    gets the same formula; outside the eager fast path it never writes its inputs."""
    overload = torch.ops.vllm_ir.fused_add_rms_norm.maybe_inplace
    assert not overload._schema.is_mutable
    op = ops.fused_add_rms_norm
    args = op.generate_inputs(SHAPE, torch.float32)
    inplace = [p for p in ("vllm_c", "aten") if p in op.impls and op.impls[p].inplace]
    for provider in [*inplace, "native"]:
        with vllm_ir.priority(fused_add_rms_norm=[provider]):
            x, r = (a.detach().clone().requires_grad_() for a in args[:2])
            before = (x.detach().clone(), r.detach().clone())
            outputs = overload(x, r, *args[2:])
            torch.testing.assert_close((x.detach(), r.detach()), before, atol=0, rtol=0)
            grads = torch.autograd.grad(_loss(outputs), [x, r])
            expected = _grads(op.fn, args)[:2]
        _assert_grads_close(list(grads), expected, op.tolerance(torch.float32), f"maybe_inplace by {provider}")


def test_non_floating_inputs_and_outputs_get_no_gradient():
    @vllm_ir.register_op(name=unique("gather_scale"))
    def gather_scale(x: Tensor, index: Tensor, bias: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
        out = x[index] * scale
        return (out if bias is None else out + bias), index + 1

    torch_op = gather_scale.torch_op.default
    x = torch.randn(5, requires_grad=True)
    index = torch.tensor([0, 2, 2])
    out, shifted = torch_op(x, index, None, 3.0)
    assert not shifted.requires_grad and shifted.dtype == torch.int64
    (out.sum() + shifted.sum()).backward()
    torch.testing.assert_close(x.grad, torch.tensor([3.0, 0.0, 6.0, 0.0, 0.0]))

    bias = torch.zeros(3, requires_grad=True)
    (grad_bias,) = torch.autograd.grad(torch_op(x, index, bias, 3.0)[0].sum(), [bias])
    torch.testing.assert_close(grad_bias, torch.ones(3))


def test_double_backward_through_the_native_vjp():
    @vllm_ir.register_op(name=unique("tanh_mix"))
    def tanh_mix(x: Tensor, y: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
        return torch.tanh(x) * scale + (0 if y is None else y * x), x.sum(-1)

    torch_op = tanh_mix.torch_op.default
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x, y: torch_op(x, y, 2.0), (x, y))
    assert torch.autograd.gradgradcheck(lambda x: torch_op(x, None, 2.0), (x,))


def test_a_native_function_that_calls_another_ir_op():
    """The backward recomputes native, which differentiates the inner IR op through its own formula."""

    @vllm_ir.register_op(name=unique("norm_twice"))
    def norm_twice(x: Tensor, weight: Tensor) -> Tensor:
        return torch.ops.vllm_ir.rms_norm.default(x, weight, EPS) * 2

    x, w = ops.rms_norm.generate_inputs(SHAPE, torch.float32)[:2]
    actual = _grads(norm_twice.torch_op.default, (x, w))
    expected = _grads(lambda x, w: ops.rms_norm.fn(x, w, EPS) * 2, (x, w))
    _assert_grads_close(actual, expected, (0, 0), "norm_twice")


def test_tensor_list_parameters_and_results_get_gradients_per_element():
    @vllm_ir.register_op(name=unique("scale_each"))
    def scale_each(xs: list[Tensor], scales: Tensor) -> list[Tensor]:
        return [x * s for x, s in zip(xs, scales, strict=True)]

    xs = [torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)]
    scales = torch.tensor([2.0, -1.0], requires_grad=True)
    out = scale_each.torch_op.default(xs, scales)
    grads = torch.autograd.grad(out[0].sum() + (out[1] * 3).sum(), [*xs, scales])
    torch.testing.assert_close(grads[0], torch.full((3,), 2.0))
    torch.testing.assert_close(grads[1], torch.full((2,), -3.0))
    torch.testing.assert_close(grads[2], torch.stack([xs[0].sum(), 3 * xs[1].sum()]).detach())


@pytest.mark.parametrize(
    "overload", ["rms_norm.default", "fused_add_rms_norm.default", "fused_add_rms_norm.maybe_inplace"]
)
def test_opcheck_with_inputs_that_require_grad(overload):
    """Schema, fake, autograd registration and AOT dispatch (dynamic shapes included) with grads,
    and without them (the Autograd kernel's shortcut for calls that need no grad)."""
    op_name, name = overload.split(".")
    op = getattr(ops, op_name)
    args = op.generate_inputs((4, 16), torch.float32)
    args = tuple(a.requires_grad_() if isinstance(a, Tensor) else a for a in args)
    torch.library.opcheck(getattr(op.torch_op, name), args)
    with torch.no_grad():
        torch.library.opcheck(getattr(op.torch_op, name), args)


# ---------------------------------------------------------------------------------------
# compiled


@pytest.mark.usefixtures("compile_test_providers")
@pytest.mark.parametrize(
    "priority",
    [
        {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]},
        {"rms_norm": ["test_opaque"], "fused_add_rms_norm": ["test_inplace"]},
    ],
    ids=["native", "opaque_and_inplace"],
)
def test_compiled_training_gradients_equal_eager_native_ones(priority):
    """One small decoder, compiled once per priority: parameters' and input's gradients.

    The in-place forward kernel runs on protective clones: the backward reads the inputs it
    would otherwise have overwritten.
    """
    torch._dynamo.reset()
    ir, plain = make_decoder(hidden=16, intermediate=32, layers=1)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))

    def run(model):
        leaf = x.clone().requires_grad_()
        out = model(leaf)
        params = dict(model.named_parameters())
        grads = torch.autograd.grad(_loss(out), [leaf, *params.values()])
        return out.detach(), dict(zip(["input", *params], grads, strict=True))

    with vllm_ir.priority(**priority):
        compiled = vllm_ir.compile(ir)
        out, grads = run(compiled)
    expected_out, expected = run(plain)

    selected = vllm_ir.passes.record_of(compiled).selected_impls
    assert {op: set(nodes.values()) for op, nodes in selected.items()} == {
        op: set(providers) for op, providers in priority.items()
    }
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    grads = {name.removeprefix("_orig_mod."): g for name, g in grads.items()}
    assert grads.keys() == expected.keys()
    for name, g in expected.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def _differentiable_cases() -> list[tuple[str, tuple]]:
    """(label, float32 inputs) of every registered op whose gradients can be compared, by rule.

    An op is differentiable here when its native function, on the op's own generated inputs,
    returns floating outputs of which none is an fp8 dtype (quantizing ops have no gradient)
    and dispatches no collective (`COLLECTIVE_NAMESPACES`: no autograd formula). Besides the default
    inputs, each input variant that leaves a tensor argument out (``None``: rotary without a
    key, a norm without weight) is a case of its own. New ops join automatically.
    """
    cases = []
    for op in registry.all_ops():
        default = op.generate_inputs(GRAD_SHAPE, torch.float32)
        present = [isinstance(a, Tensor) for a in default]
        args_per_case = {op.name: default}
        for variant, options in op.input_variants.items():
            args = op.generate_inputs(GRAD_SHAPE, torch.float32, **options)
            if [isinstance(a, Tensor) for a in args] != present:
                args_per_case[f"{op.name}[{variant}]"] = args
        if _native_is_differentiable(op, default):
            cases += list(args_per_case.items())
    return cases


def _native_is_differentiable(op, args: tuple) -> bool:
    leaves = [a.detach().clone().requires_grad_() if _floating(a) else a for a in args]
    with _RecordOps() as recorded:
        outputs = op.fn(*leaves)
    outputs = [o for o in (outputs if isinstance(outputs, tuple) else (outputs,)) if isinstance(o, Tensor)]
    if not outputs or any(not o.is_floating_point() or o.dtype in FP8_DTYPES for o in outputs):
        return False
    return not recorded.namespaces & COLLECTIVE_NAMESPACES


class _RecordOps(TorchDispatchMode):
    """The namespaces of the ops a call dispatches (below autograd)."""

    def __init__(self):
        super().__init__()
        self.namespaces: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.namespaces.add(func.namespace)
        return func(*args, **(kwargs or {}))


#: Collectives have no autograd formula (torch differentiates them with its "autograd kernel was
#: not registered" fallback, which is wrong across ranks): ops that dispatch one are not compared.
COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional"}


def _floating(a: object) -> bool:
    return isinstance(a, Tensor) and a.is_floating_point()


GRAD_SHAPE = (2, 32)
FP8_DTYPES = {d for d in vars(torch).values() if isinstance(d, torch.dtype) and "float8" in str(d)}


@pytest.mark.subprocess
def test_compiled_gradients_of_every_differentiable_op_equal_eager_native_ones():
    """Every differentiable op (by rule: `_differentiable_cases`), called once each in ONE
    function compiled by ``vllm_ir.compile`` (Inductor, default priority): every input's
    gradient equals eager native's (``torch.autograd.grad`` of ``op.fn``), within the op's
    tolerances."""
    cases = _differentiable_cases()
    names = {label.split("[")[0] for label, _ in cases}
    assert {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"} <= names
    assert "rotary_embedding[no_key]" in dict(cases)
    assert not [n for n in names if "quant" in n or n.startswith("all_reduce")]
    ops_of = {label: getattr(ops, label.split("[")[0]) for label, _ in cases}
    slots = [(label, i) for label, args in cases for i, a in enumerate(args) if _floating(a)]
    constants = {label: args for label, args in cases}

    def call_every_op(*tensors):
        given = dict(zip(slots, tensors, strict=True))
        outputs = []
        for label, args in constants.items():
            call = [given.get((label, i), a) for i, a in enumerate(args)]
            out = ops_of[label](*call)
            outputs += [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, Tensor)]
        return tuple(outputs)

    inputs = [constants[label][i] for label, i in slots]

    def grads_of(fn):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        return torch.autograd.grad(_loss(fn(*leaves)), leaves, allow_unused=True)

    torch._dynamo.reset()
    compiled = vllm_ir.compile(call_every_op)
    actual = grads_of(compiled)
    selected = vllm_ir.passes.record_of(compiled).selected_impls
    assert set(selected) == {ops_of[label].name for label, _ in cases}, "every op went through the passes"

    def native(*tensors):
        given = dict(zip(slots, tensors, strict=True))
        outputs = []
        for label, args in constants.items():
            out = ops_of[label].fn(*[given.get((label, i), a) for i, a in enumerate(args)])
            outputs += [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, Tensor)]
        return tuple(outputs)

    expected = grads_of(native)
    for (label, i), a, e in zip(slots, actual, expected, strict=True):
        what = f"{label}: gradient of argument {i}"
        assert e is not None, f"{what}: eager native has none"
        assert a is not None, f"{what}: missing through vllm_ir.compile"
        atol, rtol = ops_of[label].tolerance(torch.float32)
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol, msg=lambda m, w=what: f"{w}: {m}")
