"""Write-aware clone cleanup: which nodes write which values, and every clone that is provably
unnecessary goes while every needed one stays.

The cases of vLLM's clone-elimination tests run on hand-built FX graphs (``make_fx``, fake
tensors, no Inductor); every rewritten graph is executed and compared with the original. One
case goes through torch.compile: an in-place kernel that only reads one of its activations.
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

import vllm_ir
from tests.compile_models import (
    MORE_TEST_PROVIDERS,
    compile_with_passes,
    passes_always_run,
    register_test_providers,
    unregister_test_providers,
)
from vllm_ir import passes
from vllm_ir.passes.aliasing import writes

ops = vllm_ir.ops
EPS = 1e-6
CLONE = torch.ops.aten.clone.default


def _trace(fn, *inputs):
    return make_fx(fn, tracing_mode="fake")(*inputs)


def _inputs(n=1):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 6, generator=g) for _ in range(n)]


def _clean(fn, n_inputs=1, donated=()):
    """Trace ``fn``, run the pass; return the module, the original's results, the report."""
    gm = _trace(fn, *_inputs(n_inputs))
    expected = gm(*[t.clone() for t in _inputs(n_inputs)])
    report = passes.GraphReport()
    passes.CloneCleanupPass()(gm.graph, report, donated_inputs=donated)
    gm.graph.lint()
    gm.recompile()
    return gm, expected, report


def _clones(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is CLONE)


def _check(gm, expected, n_inputs=1, donated=()):
    """Same results as before the pass; inputs not donated are left as they were."""
    inputs = _inputs(n_inputs)
    got = gm(*inputs)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    got = got if isinstance(got, (tuple, list)) else (got,)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)
    for i, (now, before) in enumerate(zip(inputs, _inputs(n_inputs), strict=True)):
        if i not in donated:
            torch.testing.assert_close(now, before, msg=f"input {i} was not donated but was written")


def _removed(report) -> list[bool]:
    return [c.removed for c in report.clones]


# -- which node writes what ---------------------------------------------------------------


def _node(gm, target):
    return next(n for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


def _placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def test_write_analysis_reads_the_schemas():
    def f(x, y):
        s = x + y
        x.add_(y)
        y.copy_(s)
        torch.mul(s, y, out=x)
        return s

    gm = _trace(f, *_inputs(2))
    x, y = _placeholders(gm)
    add, add_, copy_, mul_out = (
        _node(gm, t)
        for t in (
            torch.ops.aten.add.Tensor,
            torch.ops.aten.add_.Tensor,
            torch.ops.aten.copy_.default,
            torch.ops.aten.mul.out,
        )
    )
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert not writes(add, x) and not writes(add, y)  # read-only op
    assert writes(add_, x) and not writes(add_, y)  # add_ writes its first argument only
    assert writes(copy_, y) and not writes(copy_, add)  # copy_ writes its destination
    # make_fx passes x as add_ (the result of x.add_(y) *is* x) and y as copy_.
    assert writes(mul_out, add_) and not writes(mul_out, add) and not writes(mul_out, copy_)  # out= is a keyword
    assert not writes(output, add)  # the graph output never writes


def test_write_analysis_of_custom_kernels_getitem_and_unknown_callables():
    """The test kernels of tests/compile_models.py, defined with ``torch.library.custom_op``."""

    def f(x, r):
        torch.ops.vllm_ir_test.add_residual_(x, r)
        return torch.ops.vllm_ir_test.fused_add_rms_norm(x, r, x[0], EPS)

    gm = _trace(f, *_inputs(2))
    x, r = _placeholders(gm)
    kernel = _node(gm, torch.ops.vllm_ir_test.add_residual_.default)
    pair = _node(gm, torch.ops.vllm_ir_test.fused_add_rms_norm.default)
    getitem = next(n for n in gm.graph.nodes if n.target is operator.getitem)
    assert writes(kernel, r) and not writes(kernel, x)  # mutates_args=("x_residual",)
    assert not writes(pair, x) and not writes(pair, r)  # mutates_args=()
    assert not writes(getitem, pair)
    with gm.graph.inserting_before(getitem):
        unknown = gm.graph.call_function(print, (x,))  # no schema: assumed to write what it takes
    assert writes(unknown, x)


# -- clones on hand-built graphs ------------------------------------------------------------


def test_read_only_clone_of_a_graph_input_is_removed():
    def f(x):
        return x.clone() + 1

    gm, expected, report = _clean(f)
    assert _clones(gm) == 0
    assert report.clones[0].reason.startswith("only read")
    assert (report.clones[0].op, report.clones[0].param) == ("", "")  # not a clone lowering put there
    _check(gm, expected)


def test_written_clone_stays_while_the_original_is_read_later_and_a_read_only_one_goes():
    def f(x):
        h = x.relu()  # not a graph input
        c = h.clone()
        c.add_(1)
        ro = h.clone()
        return h, c, ro * 2

    gm, expected, report = _clean(f)
    assert _removed(report) == [False, True]
    assert "'relu' is used by node 'clone_1' at or after 'add_' writes the copy" == report.clones[0].reason
    assert _clones(gm) == 1
    _check(gm, expected)


def test_written_clone_is_removed_when_the_original_is_dead():
    def f(x):
        h = x.relu()
        c = h.clone()
        c.add_(1)
        return c

    gm, expected, report = _clean(f)
    assert _clones(gm) == 0
    assert report.clones[0].reason == "the original is not used after the copy is written"
    _check(gm, expected)


def test_clone_stays_when_the_original_is_written_while_the_copy_is_read():
    def f(x):
        h = x.relu()
        c = h.clone()
        h.add_(1)
        return c + h

    gm, expected, report = _clean(f)
    assert _removed(report) == [False]
    assert "is written by 'add_' while the copy is still read" in report.clones[0].reason
    _check(gm, expected)


def test_chain_of_clones_goes_entirely():
    def f(x):
        h = x.relu()
        a = h.clone()
        b = a.clone()
        return b + 1

    gm, expected, report = _clean(f)
    assert _removed(report) == [True, True] and _clones(gm) == 0
    _check(gm, expected)


def test_chain_of_clones_keeps_the_written_link_whose_original_is_returned():
    """``a`` goes (only read); then ``b`` copies ``h`` itself, which is returned: ``b`` stays."""

    def f(x):
        h = x.relu()
        a = h.clone()
        b = a.clone()
        b.add_(1)
        return a, b

    gm, expected, report = _clean(f)
    assert _removed(report) == [True, False]
    _check(gm, expected)


def test_several_read_only_clones_of_one_input_all_go():
    def f(x):
        return x.clone() + x.clone() * x.clone()

    gm, expected, report = _clean(f)
    assert _removed(report) == [True, True, True] and _clones(gm) == 0
    _check(gm, expected)


@pytest.mark.parametrize("donated", [(), (0,)], ids=["not-donated", "donated"])
def test_several_written_clones_of_one_input(donated):
    """Two copies written differently: at most one of them may become the input's buffer."""

    def f(x):
        a = x.clone()
        a.add_(1)
        b = x.clone()
        b.mul_(2)
        return a, b

    gm, expected, report = _clean(f, donated=donated)
    # a: x is still read (cloned into b) after a's write; b: x is dead after b's write.
    assert _removed(report) == ([False, True] if donated else [False, False])
    _check(gm, expected, donated=donated)


def test_donated_graph_input_loses_the_clone_and_undonated_one_keeps_it():
    def f(x, y):
        a = x.clone()
        a.add_(1)
        b = y.clone()
        b.add_(2)
        return a, b

    gm, expected, report = _clean(f, n_inputs=2, donated=(0,))
    assert [(c.removed, c.reason) for c in report.clones] == [
        (True, "donated graph input"),
        (False, "is graph input y_1, not donated with maybe_inplace (module state never is)"),
    ]
    _check(gm, expected, n_inputs=2, donated=(0,))  # y untouched; x may be written


def test_returned_clone_of_a_graph_input_stays_and_of_an_intermediate_goes():
    """Returning the input itself would alias an output with the caller's tensor."""

    def f(x):
        return x.clone(), (x * 2).clone()

    gm, expected, report = _clean(f)
    assert _removed(report) == [False, True]
    assert "aliases graph input" in report.clones[0].reason
    _check(gm, expected)


def test_clone_of_a_value_also_returned_stays():
    def f(x):
        h = x * 2
        return h, h.clone(), x.clone() - 1

    gm, expected, report = _clean(f)
    assert _removed(report) == [False, True]
    assert "both returned" in report.clones[0].reason
    _check(gm, expected)


def test_clone_that_changes_the_layout_stays():
    def f(x):
        return x[:, ::2].clone() + 1, x.t().clone() + 1  # strided -> contiguous; transposed stays transposed

    gm, expected, report = _clean(f)
    assert _removed(report) == [False, True]
    assert "layout" in report.clones[0].reason
    _check(gm, expected)


def test_clone_written_by_an_unknown_callable_is_assumed_written():
    def f(x):
        h = x.relu()
        c = h.clone()
        return h, c + 1

    gm = _trace(f, *_inputs())
    clone = next(n for n in gm.graph.nodes if n.target is CLONE)
    add = next(iter(clone.users))
    with gm.graph.inserting_before(add):
        gm.graph.call_function(torch.Tensor.add_, (clone, 1))  # no schema: may write the copy
    report = passes.GraphReport()
    passes.CloneCleanupPass()(gm.graph, report)
    assert _removed(report) == [False]


def test_running_the_pass_twice_changes_nothing():
    def f(x, y):
        h = x.relu()
        a = h.clone()
        a.add_(1)
        b = y.clone()
        b.add_(1)
        return h, a, b, x.clone() * 2

    gm = _trace(f, *_inputs(2))
    expected = gm(*_inputs(2))
    first = passes.GraphReport()
    passes.CloneCleanupPass()(gm.graph, first)
    code = gm.recompile().src
    assert _removed(first) == [False, False, True]
    second = passes.GraphReport()
    passes.CloneCleanupPass()(gm.graph, second)
    assert gm.recompile().src == code
    assert _removed(second) == [False, False]
    assert [c.reason for c in second.clones] == [c.reason for c in first.clones_kept]
    _check(gm, expected, n_inputs=2)


def test_views_of_a_clone_returned_in_a_list_keep_the_clone():
    """``split`` of a clone returned as one list (no ``getitem``): its outputs alias the copy,
    and the graph output reads them, so the copy of the input stays. The read-only one goes."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 6)

    def call(target, *args, val):
        node = graph.call_function(target, args)
        node.meta["val"] = val
        return node

    c = call(CLONE, x, val=torch.empty(4, 6))
    parts = call(torch.ops.aten.split.Tensor, c, 2, val=list(c.meta["val"].split(2)))
    d = call(CLONE, x, val=torch.empty(4, 6))
    plus = call(torch.ops.aten.add.Tensor, d, 1, val=torch.empty(4, 6))
    graph.output((parts, plus))
    report = passes.GraphReport()
    passes.CloneCleanupPass()(graph, report)
    assert _removed(report) == [False, True]
    assert "aliases graph input x" in report.clones[0].reason


# -- through torch.compile ---------------------------------------------------------------


@pytest.fixture(scope="module")
def residual_inplace_kernel():
    register_test_providers(MORE_TEST_PROVIDERS)
    yield
    unregister_test_providers(MORE_TEST_PROVIDERS)


def test_read_only_clone_of_a_graph_input_goes_in_a_compiled_graph(residual_inplace_kernel):
    """An in-place kernel that writes the residual and only reads ``x``: the clone of the caller's
    ``x`` goes, the clone of its residual stays, and neither input changes."""
    w = torch.randn(16, generator=torch.Generator().manual_seed(2))

    def model(x, r):
        out, res = ops.fused_add_rms_norm(x, r, w, EPS)
        return out * 2, res

    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    x0, r0 = x.clone(), r.clone()
    with vllm_ir.priority(fused_add_rms_norm=["native"]):
        expected = model(x, r)
    with passes_always_run(), vllm_ir.priority(fused_add_rms_norm=["test_residual_inplace"]):
        compiled, record = compile_with_passes(model)
        got = compiled(x, r)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(x, x0)
    torch.testing.assert_close(r, r0)
    (report,) = record.graphs
    assert report.selected_impls == {"fused_add_rms_norm": {"fused_add_rms_norm": "test_residual_inplace"}}
    decisions = {c.param: (c.removed, c.reason) for c in report.clones}
    assert decisions["x"] == (True, "only read: neither the copy nor the original is written while the copy is in use")
    assert decisions["x_residual"][0] is False and "not donated" in decisions["x_residual"][1]
    assert report.code.count("torch.ops.aten.clone.default(") == 1
