"""Outputs of one IR node are distinct values: functionalization, donations and clones per model
and provider (the table of vLLM's tests/compile/passes/ir functionalization tests).

Before the fix the alias analysis joined a multi-output node with each of its outputs, so
``x1`` and ``ro1`` of ``x1, ro1 = fused_add_rms_norm.maybe_inplace(...)`` were "aliases" and
donating ``x1`` while returning ``ro1`` failed the compile. The fast tests check the analysis
on ``make_fx`` graphs; the table compiles each model with every provider available here.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import vllm_ir
from tests.compile_models import (
    MORE_TEST_PROVIDERS,
    compile_with_passes,
    load_installed_provider,
    passes_always_run,
    register_test_providers,
    unregister_test_providers,
)
from vllm_ir.passes.aliasing import AliasAnalysis, same_memory
from vllm_ir.passes.functionalize import functionalize

ops = vllm_ir.ops
fused = ops.fused_add_rms_norm
EPS = 1e-6

# An in-place kernel whose results alias exactly the inputs they were donated from.
torch.library.define("vllm_ir_test::pair_inplace_", "(Tensor(a!) x, Tensor(b!) r) -> (Tensor(a!), Tensor(b!))")


@torch.library.impl("vllm_ir_test::pair_inplace_", "CompositeExplicitAutograd")
def _pair_inplace(x, r):
    r.add_(x)
    return x.mul_(2), r


@torch.library.register_fake("vllm_ir_test::pair_inplace_")
def _(x, r):
    return x, r


def _getitems(gm, target):
    node = next(n for n in gm.graph.nodes if n.target == target)
    return [u for u in node.users]


def _placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _tensors(n=3, shape=(4, 16)):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


# -- the analysis on make_fx graphs (no Inductor) -----------------------------------------------


def test_outputs_of_a_functional_node_are_distinct_values():
    def f(x, r, w):
        return fused.maybe_inplace(x, r, w, EPS)

    gm = make_fx(f, tracing_mode="fake")(*_tensors(2), torch.ones(16))
    out, res = _getitems(gm, fused.torch_op.maybe_inplace)
    x, r, _w = _placeholders(gm)
    aliases = AliasAnalysis(gm.graph)
    assert not aliases.aliased(out, res)
    assert not any(aliases.aliased(a, b) for a in (out, res) for b in (x, r))


def test_outputs_of_an_inplace_kernel_alias_exactly_the_inputs_they_were_donated_from():
    def f(x, r):
        return torch.ops.vllm_ir_test.pair_inplace_(x, r)

    gm = make_fx(f, tracing_mode="fake")(*_tensors(2))
    out0, out1 = _getitems(gm, torch.ops.vllm_ir_test.pair_inplace_.default)
    x, r = _placeholders(gm)
    aliases = AliasAnalysis(gm.graph)
    assert aliases.aliased(out0, x) and aliases.aliased(out1, r)
    assert not aliases.aliased(out0, r) and not aliases.aliased(out1, x) and not aliases.aliased(x, r)
    assert same_memory(out0, x) and same_memory(out1, r) and not same_memory(out0, r)


def test_functionalize_accepts_the_issue_model():
    def model(x, r1, r2, w1, w2):
        x1, ro1 = fused.maybe_inplace(x, r1, w1, EPS)
        x2, ro2 = fused.maybe_inplace(x1, r2, w2, EPS)
        return x2, ro1, ro2

    gm = make_fx(model, tracing_mode="fake")(*_tensors(3), torch.ones(16), torch.ones(16))
    report = functionalize(gm.graph)
    assert len(report.rewritten) == 2
    assert [(d.node, d.param, d.graph_input) for d in report.donations] == [
        ("fused_add_rms_norm", "x", "x_1"),
        ("fused_add_rms_norm", "x_residual", "r1_1"),
        ("fused_add_rms_norm_1", "x", None),  # x1: computed in the graph
        ("fused_add_rms_norm_1", "x_residual", "r2_1"),
    ]


def _donating_x_after_pair_inplace(returned: int):
    """``a, b = pair_inplace_(x, r); fused.maybe_inplace(x, ...)``, returning ``a`` or ``b``."""

    def f(x, r, r2, w):
        ab = torch.ops.vllm_ir_test.pair_inplace_(x, r)
        out, res = fused.maybe_inplace(x, r2, w, EPS)
        return out, res, ab[returned]

    gm = make_fx(f, tracing_mode="fake")(*_tensors(3), torch.ones(16))
    # make_fx hands the IR call the kernel's result for x (it *is* x); donate x itself instead.
    x = _placeholders(gm)[0]
    node = next(n for n in gm.graph.nodes if n.target == fused.torch_op.maybe_inplace)
    node.args = (x, *node.args[1:])
    return gm


def test_donation_still_sees_the_true_alias_among_several_outputs():
    """The in-place kernel's first output *is* x: returning it after donating x is an error; its
    second output is r, which may be returned."""
    with pytest.raises(vllm_ir.DonationError, match=r"argument 'x' .* through its view/alias 'getitem'"):
        functionalize(_donating_x_after_pair_inplace(0).graph)
    assert len(functionalize(_donating_x_after_pair_inplace(1).graph).rewritten) == 1


# -- the table, through torch.compile ----------------------------------------------------------


class TwoMaybeInplace(nn.Module):
    """The issue's model: ``x1`` is donated, ``ro1`` (its sibling output) is returned."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(1 + 0.1 * torch.randn(16, generator=g))
        self.w2 = nn.Parameter(1 + 0.1 * torch.randn(16, generator=g))

    def forward(self, x, r1, r2):
        x1, ro1 = fused.maybe_inplace(x, r1, self.w1, EPS)
        x2, ro2 = fused.maybe_inplace(x1, r2, self.w2, EPS)
        return x2, ro1, ro2


class TwoFunctional(TwoMaybeInplace):
    def forward(self, x, r1, r2):
        x1, ro1 = fused(x, r1, self.w1, EPS)
        x2, ro2 = fused(x1, r2, self.w2, EPS)
        return x2, ro1, ro2


class Mixed(TwoMaybeInplace):
    """vLLM's mixed model: maybe_inplace, then functional on its output, which is returned too."""

    def forward(self, x, r1, r2):
        x1, ro1 = fused.maybe_inplace(x, r1, self.w1, EPS)
        x2, ro2 = fused(x1, r2, self.w2, EPS)
        return x1, x2, ro1, ro2


class MixedReversed(TwoMaybeInplace):
    """Functional, then maybe_inplace donating ``x1`` while its sibling ``ro1`` is returned."""

    def forward(self, x, r1, r2):
        x1, ro1 = fused(x, r1, self.w1, EPS)
        x2, ro2 = fused.maybe_inplace(x1, r2, self.w2, EPS)
        return x2, ro1, ro2


class TritonStyleAfterMaybeInplace(TwoMaybeInplace):
    """A functional kernel that writes a caller-allocated output (``rms_norm_out(out, x, ...)``,
    the Triton style) follows the maybe_inplace calls and reads ``ro1``, whose sibling ``x1``
    was donated."""

    def forward(self, x, r1, r2):
        x1, ro1 = fused.maybe_inplace(x, r1, self.w1, EPS)
        x2, ro2 = fused.maybe_inplace(x1, r2, self.w2, EPS)
        return x2, ro2, ops.rms_norm(ro1, self.w2, EPS)


#: model -> (maybe_inplace nodes functionalized, donations, donated graph inputs,
#:           clones left with a functional / an in-place / a residual-only in-place kernel)
TABLE = {
    TwoMaybeInplace: (2, 4, ["L['x']", "L['r1']", "L['r2']"], (0, 0, 0)),
    TwoFunctional: (0, 0, [], (0, 3, 2)),
    Mixed: (1, 2, ["L['x']", "L['r1']"], (0, 2, 1)),
    MixedReversed: (1, 2, ["L['r2']"], (0, 2, 1)),
    TritonStyleAfterMaybeInplace: (2, 4, ["L['x']", "L['r1']", "L['r2']"], (0, 0, 0)),
}
# With an in-place kernel, clones stay exactly for what the caller still owns or reads later:
# TwoFunctional: x, r1 and r2 (not donated); the clone of x1 goes (dead after the kernel).
# Mixed: x1 (returned after the second kernel writes it) and r2. MixedReversed: x and r1.
# The residual-only kernel never writes x: its read-only clones of x (and x1) go as well.

#: provider of fused_add_rms_norm -> which clone column applies
PROVIDERS = {
    "native": 0,
    "inductor": 0,  # under torch.compile: native's code, traced in
    "vllm_c": 0,  # functional C++ kernel writing caller-allocated outputs (Triton style)
    "test_opaque_fused": 0,  # opaque functional custom op with two outputs
    "aten": 1,  # in place from in-place torch ops
    "test_inplace": 1,  # opaque in-place custom op
    "test_residual_inplace": 2,  # in place on the residual only
}
INSTALLED = ("aten", "inductor", "vllm_c")


@pytest.fixture(scope="module")
def providers(compile_test_providers_passes_forced):
    """Test kernels registered; installed providers loaded ({name: None, or why it is unavailable}).

    Installed providers stay registered afterwards, as when test modules load them at
    collection: a provider module imported once cannot register again in this process.
    """
    register_test_providers(MORE_TEST_PROVIDERS)
    unavailable = {name: load_installed_provider(name) for name in INSTALLED}
    for name in INSTALLED:
        impl = fused.impls.get(name)
        if unavailable[name] is None and impl is not None and not impl.supported:
            unavailable[name] = f"{name} is unsupported here: {impl.unsupported_reason}"
    yield unavailable
    unregister_test_providers(MORE_TEST_PROVIDERS)


@pytest.mark.parametrize("provider", list(PROVIDERS))
@pytest.mark.parametrize("model_class", list(TABLE), ids=lambda c: c.__name__)
def test_functionalization_table(providers, model_class, provider):
    if providers.get(provider):
        pytest.skip(providers[provider])
    functionalized, donations, donated_inputs, clones = TABLE[model_class]
    model = model_class()
    inputs = _tensors()
    with vllm_ir.priority(fused_add_rms_norm=["native"], rms_norm=["native"]), torch.no_grad():
        expected = model(*[t.clone() for t in inputs])
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}

    with (
        passes_always_run(),
        vllm_ir.priority(fused_add_rms_norm=[provider], rms_norm=["test_triton_style"]),
        torch.no_grad(),
    ):
        compiled, record = compile_with_passes(model)
        given = [t.clone() for t in inputs]
        got = compiled(*given)

    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)
    (functionalize,) = record.functionalized
    assert len(functionalize.rewritten) == functionalized
    assert len(functionalize.donations) == donations
    assert sorted(functionalize.donated_inputs) == sorted(donated_inputs)
    (report,) = record.graphs
    assert set(report.selected_impls["fused_add_rms_norm"].values()) == {provider}
    assert report.code.count("torch.ops.aten.clone.default(") == clones[PROVIDERS[provider]]
    assert len(report.clones_kept) == clones[PROVIDERS[provider]]
    # What the caller still owns is never written: inputs it did not donate, and the weights.
    for name, before, now in zip(("x", "r1", "r2"), inputs, given, strict=True):
        if f"L['{name}']" not in donated_inputs:
            torch.testing.assert_close(now, before, msg=f"{name} was not donated but was written")
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), weights[name])
