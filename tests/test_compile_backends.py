"""`vllm_ir.compile` in front of back-ends other than Inductor: ``aot_eager`` and plain callables.

The passes (functionalize, fuse, lower, clone cleanup) run around AOTAutograd, which gives
them the functional aten graph they work on; the back-end then gets the lowered graph. No
Inductor code generation here: these compiles are cheap.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, fx

import vllm_ir
from tests.compile_models import KERNEL_CALLS, count_ir_nodes, make_decoder

ops = vllm_ir.ops
pytestmark = pytest.mark.usefixtures("compile_test_providers")

PRIORITY = {"rms_norm": ["test_opaque"], "fused_add_rms_norm": ["test_inplace"]}
EPS = 1e-6


class Seen:
    """A plain callable back-end: keeps every graph it is given and runs it as is."""

    def __init__(self):
        self.graphs: list[fx.GraphModule] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> object:
        self.graphs.append(gm)
        return gm


BACKENDS = {"aot_eager": lambda: "aot_eager", "callable": Seen}


def _kernels(fn) -> tuple[object, dict[str, int]]:
    before = dict(KERNEL_CALLS)
    out = fn()
    return out, {k: KERNEL_CALLS[k] - before[k] for k in KERNEL_CALLS}


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_decoder_lowered_to_opaque_and_in_place_kernels_matches_eager(name):
    backend = BACKENDS[name]()
    model, _plain = make_decoder(hidden=64, layers=2)
    x = torch.randn(8, 64)
    torch._dynamo.reset()
    compiled = vllm_ir.compile(model, backend=backend)
    with vllm_ir.priority(**PRIORITY), torch.no_grad():
        eager, eager_calls = _kernels(lambda: model(x.clone()))
        out, calls = _kernels(lambda: compiled(x.clone()))
    torch.testing.assert_close(out, eager)
    assert calls == eager_calls == {"rms_norm": 1, "rms_norm_b": 0, "fused_add_rms_norm_": 4}
    record = vllm_ir.passes.record_of(compiled)
    (report,) = record.graphs
    assert count_ir_nodes(report.code) == 0 and not report.unlowered
    assert set(report.selected_impls["rms_norm"].values()) == {"test_opaque"}
    assert set(report.selected_impls["fused_add_rms_norm"].values()) == {"test_inplace"}
    assert len(report.selected_impls["fused_add_rms_norm"]) == 4
    # Clone cleanup ran: the donated input and every dead activation are written in place.
    assert report.clones and report.clones_kept == []
    assert "aten.clone" not in report.code
    # Functionalized first: four maybe_inplace calls, each donating x and x_residual.
    assert [len(r.donations) for r in record.functionalized] == [8]
    if isinstance(backend, Seen):
        (gm,) = backend.graphs  # the back-end got the lowered aten graph
        assert count_ir_nodes(gm.code) == 0 and "torch.ops.vllm_ir_test.fused_add_rms_norm_" in gm.code


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_fusion_and_native_lowering(name):
    backend = BACKENDS[name]()
    w = torch.randn(32)

    def fn(x: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
        s = x + r
        return ops.rms_norm(s, w, EPS), s * 2

    torch._dynamo.reset()
    compiled = vllm_ir.compile(fn, backend=backend)
    x, r = torch.randn(4, 32), torch.randn(4, 32)
    out = compiled(x, r)
    for a, b in zip(out, fn(x, r), strict=True):
        torch.testing.assert_close(a, b)
    (report,) = vllm_ir.passes.record_of(compiled).graphs
    assert len(report.fusions) == 1 and list(report.selected_impls) == ["fused_add_rms_norm"]
    assert list(report.selected_impls["fused_add_rms_norm"].values()) == ["native"]
    assert count_ir_nodes(report.code) == 0


def test_training_through_aot_eager_gets_native_gradients():
    model, _plain = make_decoder(hidden=32, intermediate=64, layers=1)
    torch._dynamo.reset()
    compiled = vllm_ir.compile(model, backend="aot_eager")
    x = torch.randn(4, 32, requires_grad=True)
    compiled(x.clone()).square().sum().backward()
    compiled_grad, x.grad = x.grad, None
    model(x.clone()).square().sum().backward()
    torch.testing.assert_close(compiled_grad, x.grad)
    assert count_ir_nodes(vllm_ir.passes.record_of(compiled).graphs[0].code) == 0


def test_a_priority_change_reaches_aot_eager_compiled_code_too():
    w = torch.randn(32)

    def fn(x: Tensor) -> Tensor:
        return ops.rms_norm(x, w, EPS)

    torch._dynamo.reset()
    compiled = vllm_ir.compile(backend="aot_eager")(fn)  # the decorator form takes the back-end too
    x = torch.randn(4, 32)
    for provider, kernel in (("test_opaque", "rms_norm"), ("test_opaque_b", "rms_norm_b"), ("test_opaque", "rms_norm")):
        vllm_ir.set_priority(rms_norm=[provider])
        out, calls = _kernels(lambda: compiled(x))
        torch.testing.assert_close(out, fn(x))
        assert calls[kernel] == 1 and sum(calls.values()) == 1
    assert len(vllm_ir.passes.record_of(compiled).graphs) == 2


def test_donated_input_used_later_is_refused_by_every_back_end():
    w = torch.randn(32)

    def fn(x: Tensor, r: Tensor) -> Tensor:
        out, _res = ops.fused_add_rms_norm.maybe_inplace(x, r, w, EPS)
        return out + x  # x was donated

    torch._dynamo.reset()
    with pytest.raises(vllm_ir.DonationError, match="fused_add_rms_norm"):
        vllm_ir.compile(fn, backend=Seen())(torch.randn(4, 32), torch.randn(4, 32))


def test_unsupported_back_ends_and_inductor_only_arguments_are_refused():
    with pytest.raises(ValueError, match=r"backend='eager' is not supported.*'inductor', 'aot_eager'"):
        vllm_ir.compile(lambda x: x, backend="eager")
    with pytest.raises(ValueError, match="options= and mode= are Inductor's"):
        vllm_ir.compile(lambda x: x, backend="aot_eager", mode="max-autotune")
    with pytest.raises(ValueError, match="options= and mode= are Inductor's"):
        vllm_ir.compile(lambda x: x, backend=Seen(), options={"max_autotune": True})


def test_lowering_traces_each_distinct_call_once_and_gives_every_copy_its_own_fake_values(monkeypatch):
    from vllm_ir.passes import lowering

    traced = []
    trace_impl = lowering.trace_impl

    def counting(fn, args):
        traced.append(fn)
        return trace_impl(fn, args)

    monkeypatch.setattr(lowering, "trace_impl", counting)
    model, _plain = make_decoder(hidden=32, intermediate=64, layers=3)
    backend = Seen()
    torch._dynamo.reset()
    compiled = vllm_ir.compile(model, backend=backend)
    x = torch.randn(4, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x.clone()), model(x.clone()))
    (report,) = vllm_ir.passes.record_of(compiled).graphs
    assert sum(len(nodes) for nodes in report.selected_impls.values()) == 7  # 1 rms_norm, 6 fused
    assert len(traced) == 2  # one trace per distinct call: the layers repeat the same one
    (gm,) = backend.graphs
    values = [n.meta["val"] for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    assert len({id(v) for v in values}) == len(values)  # native is functional: no two nodes share a value
