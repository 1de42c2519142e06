"""Acceptance of the compile pipeline on a small Llama-style decoder (CPU, Inductor C++ backend).

One compiled model per dtype is shared by the tests of this module: it is compiled with the
opaque ``rms_norm`` kernel and the in-place ``fused_add_rms_norm`` kernel of
``tests/compile_models.py`` first in the priority, with ``maybe_inplace`` in the model.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import vllm_ir
from tests.compile_models import (
    KERNEL_CALLS,
    count_ir_nodes,
    make_decoder,
    passes_always_run,
    peak_bytes,
)
from vllm_ir import passes

ops = vllm_ir.ops
PRIORITY = {"rms_norm": ["test_opaque"], "fused_add_rms_norm": ["test_inplace"]}
TOKENS = 8
HIDDEN = 64


class Compiled:
    """A decoder, its compiled twin and what the pipeline recorded while compiling it."""

    def __init__(self, dtype: torch.dtype, layers: int):
        self.dtype = dtype
        self.model, _plain = make_decoder(hidden=HIDDEN, layers=layers, dtype=dtype)
        self.compiled = passes.compile(self.model)
        self.record = passes.record_of(self.compiled)
        x = self.input(TOKENS)
        torch._dynamo.mark_dynamic(x, 0)
        graphs_before = counters["stats"]["unique_graphs"]
        with vllm_ir.priority(**PRIORITY), torch.no_grad():
            self.compiled(x)
        self.graphs_compiled = counters["stats"]["unique_graphs"] - graphs_before

    def input(self, tokens: int, seed: int = 1) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed + tokens)
        return torch.randn(tokens, HIDDEN, generator=g).to(self.dtype)

    def both(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(eager, compiled) outputs; each gets its own copy since the model donates its input."""
        with vllm_ir.priority(**PRIORITY), torch.no_grad():
            return self.model(x.clone()), self.compiled(x.clone())


pytestmark = pytest.mark.usefixtures("compile_test_providers")


@pytest.fixture(scope="module")
def fp32(compile_test_providers):
    with passes_always_run():
        yield Compiled(torch.float32, layers=2)


@pytest.fixture(scope="module")
def bf16(compile_test_providers):
    with passes_always_run(), torch._inductor.config.patch(emulate_precision_casts=True):
        yield Compiled(torch.bfloat16, layers=1)


@pytest.mark.parametrize("which", ["fp32", "bf16"])
def test_compiled_decoder_matches_eager_within_op_tolerance(request, which):
    c = request.getfixturevalue(which)
    atol, rtol = ops.fused_add_rms_norm.tolerance(c.dtype)
    eager, compiled = c.both(c.input(TOKENS))
    torch.testing.assert_close(compiled, eager, atol=atol, rtol=rtol)


@pytest.mark.parametrize("which", ["fp32", "bf16"])
def test_no_ir_node_survives_lowering(request, which):
    c = request.getfixturevalue(which)
    assert c.graphs_compiled == 1 and len(c.record.graphs) == 1
    report = c.record.graphs[0]
    assert not report.unlowered
    assert count_ir_nodes(report.code) == 0
    layers = len(c.model.layers)
    assert len(report.selected_impls["rms_norm"]) == 1
    assert len(report.selected_impls["fused_add_rms_norm"]) == 2 * layers


def test_lowered_provider_is_what_eager_dispatch_picks(fp32):
    x = fp32.input(TOKENS)
    w = fp32.model.norm
    with vllm_ir.priority(**PRIORITY):
        eager_rms = ops.rms_norm.dispatch(x, w, 1e-6).provider
        eager_fused = ops.fused_add_rms_norm.dispatch(x, x.clone(), w, 1e-6).provider
    selected = fp32.record.selected_impls
    assert set(selected["rms_norm"].values()) == {eager_rms} == {"test_opaque"}
    assert set(selected["fused_add_rms_norm"].values()) == {eager_fused} == {"test_inplace"}


def test_compiled_graph_runs_the_same_kernels_as_eager(fp32):
    """The opaque kernels count their calls at run time: one compiled step calls each as often as eager."""
    x = fp32.input(TOKENS)
    before = dict(KERNEL_CALLS)
    with vllm_ir.priority(**PRIORITY), torch.no_grad():
        fp32.model(x.clone())
    eager = {k: KERNEL_CALLS[k] - before[k] for k in KERNEL_CALLS}
    before = dict(KERNEL_CALLS)
    with vllm_ir.priority(**PRIORITY), torch.no_grad():  # the priority it was compiled under (guarded)
        fp32.compiled(x.clone())
    compiled = {k: KERNEL_CALLS[k] - before[k] for k in KERNEL_CALLS}
    layers = len(fp32.model.layers)
    assert eager == compiled == {"rms_norm": 1, "rms_norm_b": 0, "fused_add_rms_norm_": 2 * layers}


def test_opaque_kernels_stay_single_nodes(fp32):
    code = fp32.record.graphs[0].code
    layers = len(fp32.model.layers)
    assert code.count("torch.ops.vllm_ir_test.rms_norm.default(") == 1
    assert code.count("torch.ops.vllm_ir_test.fused_add_rms_norm_.default(") == 2 * layers


def test_inplace_kernel_runs_without_clones_of_donated_activations(fp32):
    report = fp32.record.graphs[0]
    layers = len(fp32.model.layers)
    assert len(report.clones) == 2 * (2 * layers)  # x and x_residual of every fused call
    assert report.clones_kept == []
    assert "aten.clone" not in report.code
    # The model's input is the first residual: donated through maybe_inplace, it is updated in
    # place by every fused call; the hidden states are intermediates nobody reads afterwards.
    reasons = {(c.param, c.reason) for c in report.clones_removed}
    assert reasons == {("x_residual", "donated graph input"), ("x", "not used after the kernel")}
    assert fp32.record.functionalized[0].donated_inputs == ["L['x']"]


def test_compiled_step_peak_memory_is_not_above_eager(fp32):
    x = fp32.input(64)
    with vllm_ir.priority(**PRIORITY), torch.no_grad():
        fp32.model(x.clone())
        fp32.compiled(x.clone())  # warm
        eager = peak_bytes(lambda: fp32.model(x.clone()))
        compiled = peak_bytes(lambda: fp32.compiled(x.clone()))
    assert 0 < compiled <= eager


def test_new_batch_sizes_reuse_the_compiled_graph(fp32):
    graphs_before = counters["stats"]["unique_graphs"]
    lowered_before = len(fp32.record.graphs)
    atol, rtol = ops.fused_add_rms_norm.tolerance(fp32.dtype)
    for tokens in (2, 3, 5, 17, 64):
        eager, compiled = fp32.both(fp32.input(tokens))
        torch.testing.assert_close(compiled, eager, atol=atol, rtol=rtol)
    assert counters["stats"]["unique_graphs"] == graphs_before
    assert len(fp32.record.graphs) == lowered_before
