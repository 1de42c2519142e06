"""Clone cleanup: a clone in front of an in-place kernel goes only when nothing can see the write.

Most cases run the passes directly on graphs traced with ``make_fx`` (fake tensors, like the
post-grad graph Inductor hands us) and then execute the rewritten graph on real tensors;
one case goes through torch.compile end to end.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import vllm_ir
from tests.compile_models import passes_always_run
from vllm_ir import passes
from vllm_ir.passes.nodes import ir_nodes, mark_donated

ops = vllm_ir.ops
EPS = 1e-6
fused = ops.fused_add_rms_norm


pytestmark = pytest.mark.usefixtures("compile_test_providers")


@pytest.fixture(autouse=True)
def inplace_kernel():
    with vllm_ir.priority(fused_add_rms_norm=["test_inplace"]):
        yield


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g), torch.randn(16, generator=g)


def _lower_and_clean(fn, donate: tuple[str, ...] = ()):
    """Trace ``fn`` with fake tensors, lower it and clean clones; return the module and the report."""
    gm = make_fx(fn, tracing_mode="fake")(*_inputs())
    for node in ir_nodes(gm.graph):
        mark_donated(node, donate)
    report = passes.GraphReport()
    passes.LoweringPass()(gm.graph, report)
    passes.CloneCleanupPass()(gm.graph, report)
    gm.recompile()
    return gm, report


def _decisions(report):
    return {c.param: (c.removed, c.reason) for c in report.clones}


def _check_values(gm, fn):
    x, r, w = _inputs()
    with vllm_ir.priority(fused_add_rms_norm=["native"]):
        expected = fn(x.clone(), r.clone(), w)
    got = gm(x.clone(), r.clone(), w)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_intermediate_not_used_afterwards_loses_its_clone_and_undonated_input_keeps_it():
    def fn(x, r, w):
        return fused(x * 2, r, w, EPS)

    gm, report = _lower_and_clean(fn)
    decisions = _decisions(report)
    assert decisions["x"] == (True, "not used after the kernel")
    assert decisions["x_residual"][0] is False
    assert "not donated" in decisions["x_residual"][1]
    _check_values(gm, fn)


def test_donated_graph_input_loses_its_clone():
    def fn(x, r, w):
        return fused(x * 2, r, w, EPS)

    gm, report = _lower_and_clean(fn, donate=("x", "x_residual"))
    assert _decisions(report)["x_residual"] == (True, "donated graph input")
    assert report.clones_kept == []
    x, r, w = _inputs()
    out, new_res = gm(x, r, w)
    assert (
        new_res.data_ptr() == r.data_ptr() and out.data_ptr() != x.data_ptr()
    )  # the kernel wrote the caller's donated tensor


def test_view_of_the_cloned_value_read_after_the_kernel_keeps_the_clone():
    def fn(x, r, w):
        h = x * 2
        head = h[:, :4]
        out, res = fused(h, r * 1, w, EPS)
        return out, res, head * 3

    gm, report = _lower_and_clean(fn)
    decisions = _decisions(report)
    assert decisions["x"][0] is False and "through its alias" in decisions["x"][1]
    assert decisions["x_residual"] == (True, "not used after the kernel")
    _check_values(gm, fn)


def test_base_of_a_cloned_view_read_after_the_kernel_keeps_the_clone():
    def fn(x, r, w):
        h = x * 2
        out, res = fused(h.view(4, 16), r * 1, w, EPS)
        return out, res, h.sum(dim=-1)

    gm, report = _lower_and_clean(fn)
    assert _decisions(report)["x"][0] is False
    _check_values(gm, fn)


def test_alias_through_unsafe_view_keeps_the_clone():
    """``_unsafe_view`` has no alias annotation in its schema but shares storage."""

    def fn(x, r, w):
        h = x * 2
        flat = torch.ops.aten._unsafe_view.default(h, [64])
        out, res = fused(h, r * 1, w, EPS)
        return out, res, flat + 1

    gm, report = _lower_and_clean(fn)
    assert _decisions(report)["x"][0] is False
    _check_values(gm, fn)


def test_cloned_value_returned_from_the_graph_keeps_the_clone():
    def fn(x, r, w):
        h = x * 2
        out, res = fused(h, r * 1, w, EPS)
        return out, res, h

    gm, report = _lower_and_clean(fn)
    decisions = _decisions(report)
    assert decisions["x"][0] is False and "the graph output" in decisions["x"][1]
    _check_values(gm, fn)


def test_part_of_a_donated_graph_input_keeps_the_clone():
    """Donating rows of an input gives up those rows only: the kernel must not write the input."""

    def fn(x, r, w):
        return fused(x[:2] * 2, r[:2], w, EPS)

    gm, report = _lower_and_clean(fn, donate=("x", "x_residual"))
    decisions = _decisions(report)
    assert decisions["x_residual"][0] is False and "aliases graph input" in decisions["x_residual"][1]
    _check_values(gm, fn)


def test_whole_view_of_a_donated_graph_input_loses_its_clone():
    """``r[:, :]`` is exactly ``r``'s memory (same storage, sizes, strides, offset): donated as a whole."""

    def fn(x, r, w):
        return fused(x * 2, r[:, :], w, EPS)

    gm, report = _lower_and_clean(fn, donate=("x", "x_residual"))
    assert _decisions(report)["x_residual"] == (True, "donated graph input")
    x, r, w = _inputs()
    _out, new_res = gm(x, r, w)
    assert new_res.data_ptr() == r.data_ptr()


def test_same_value_as_both_activations_keeps_one_clone():
    def fn(x, r, w):
        h = x * 2
        return fused(h, h, w, EPS)

    gm, report = _lower_and_clean(fn)
    assert [c.removed for c in report.clones] == [True, False]
    _check_values(gm, fn)


def test_chain_of_inplace_kernels_reuses_one_buffer():
    """Each kernel's outputs alias its inputs after cleanup; the next call may donate them again."""

    def fn(x, r, w):
        h = x * 2
        a, r1 = fused(h, r * 1, w, EPS)
        b, r2 = fused(a * 3, r1, w, EPS)
        return b, r2

    gm, report = _lower_and_clean(fn)
    assert report.clones_kept == []
    _check_values(gm, fn)


def test_view_read_after_kernel_end_to_end_through_inductor():
    def fn(x, r, w):
        h = x * 2
        head = h[:, :4]
        out, res = fused(h, r, w, EPS)
        return out, res, head * 3

    x, r, w = _inputs()
    with vllm_ir.priority(fused_add_rms_norm=["native"]):
        expected = fn(x, r, w)
    torch._dynamo.reset()
    options = passes.inductor_options()
    with passes_always_run():
        got = torch.compile(fn, options=options)(x, r, w)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)
    report = passes.record_of(options).graphs[0]
    assert {c.param: c.removed for c in report.clones} == {"x": False, "x_residual": False}
    torch.testing.assert_close(r, _inputs()[1])  # the caller's (undonated) residual is untouched
