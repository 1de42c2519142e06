"""``maybe_inplace`` under torch.compile: use-after-donation errors and donated graph inputs."""

from __future__ import annotations

import pytest
import torch

import vllm_ir
from tests.compile_models import compile_with_passes
from vllm_ir import passes

ops = vllm_ir.ops
EPS = 1e-6
W = torch.randn(16, generator=torch.Generator().manual_seed(0))


pytestmark = pytest.mark.usefixtures("compile_test_providers_passes_forced")


def _inputs(n=2):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 16, generator=g) for _ in range(n)]


def _donation_error(fn) -> vllm_ir.DonationError:
    compiled, _ = compile_with_passes(fn)
    with pytest.raises(vllm_ir.DonationError) as info:
        compiled(*_inputs())
    return info.value


def test_use_after_donation_names_op_argument_and_later_node():
    def model(x, r):
        out, res = ops.fused_add_rms_norm.maybe_inplace(x, r, W, EPS)
        return out + x, res

    message = str(_donation_error(model))
    assert "op 'fused_add_rms_norm'" in message
    assert "argument 'x' (graph input L['x'])" in message
    assert "used afterwards by node 'add'" in message and "`return out + x, res`" in message


def test_use_through_a_view_taken_before_the_donation():
    def model(x, r):
        first_row = x[0]
        out, res = ops.fused_add_rms_norm.maybe_inplace(x, r, W, EPS)
        return out, res, first_row * 2

    message = str(_donation_error(model))
    assert "argument 'x'" in message and "through its view/alias 'first_row'" in message


def test_use_through_the_base_of_a_donated_view():
    def model(x, r):
        h = x * 2
        out, res = ops.fused_add_rms_norm.maybe_inplace(h[:, :16], r, W, EPS)
        return out, res, h.sum()

    message = str(_donation_error(model))
    assert "argument 'x'" in message and "through its view/alias 'h'" in message


def _rope_cache():
    return vllm_ir.ir.declarations.rotary.build_cos_sin_cache(8, 4, torch.float32)


def test_a_view_of_a_disjoint_slice_used_after_donating_its_neighbours_is_allowed():
    # Llama's attention: q and k of one qkv projection rotated in place, then v viewed per head.
    cache = _rope_cache()

    def model(x, r):
        qkv = torch.cat([x, r, x * r], dim=-1)  # [4, 48]
        q, k, v = qkv.split([16, 16, 16], dim=-1)
        q, k = ops.rotary_embedding.maybe_inplace(torch.arange(4), q, k, 8, cache, True, 4)
        return q, k, v.reshape(4, 2, 8).transpose(0, 1) * 2

    compiled, _ = compile_with_passes(model)
    x, r = _inputs()
    with vllm_ir.priority(rotary_embedding=["native"]):
        expected = model(x.clone(), r.clone())
    for got, want in zip(compiled(x, r), expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("later", ["base", "as_strided"])
def test_a_later_view_that_may_reach_the_donated_slice_is_refused(later):
    cache = _rope_cache()

    def model(x, r):
        qkv = torch.cat([x, r, x * r], dim=-1)
        q, k, v = qkv.split([16, 16, 16], dim=-1)
        q, k = ops.rotary_embedding.maybe_inplace(torch.arange(4), q, k, 8, cache, True, 4)
        # The whole projection, or a view of v re-strided over the storage, reads what was rotated.
        seen = qkv.sum(-1) if later == "base" else v.as_strided((4, 16), (48, 1), 0).sum(-1)
        return q, k, seen

    message = str(_donation_error(model))
    assert "op 'rotary_embedding'" in message and "argument 'query'" in message


def test_returning_a_donated_intermediate_is_a_later_use():
    def model(x, r):
        h = x * 2
        out, res = ops.fused_add_rms_norm.maybe_inplace(h, r, W, EPS)
        return out, res, h

    message = str(_donation_error(model))
    assert "is returned from the compiled graph" in message


def test_donating_the_same_memory_twice_in_one_call():
    def model(x, r):
        return ops.fused_add_rms_norm.maybe_inplace(x, x, W, EPS)

    message = str(_donation_error(model))
    assert "also passed as 'x_residual'" in message


def test_donation_error_is_raised_before_any_kernel_is_compiled():
    def model(x, r):
        out, res = ops.fused_add_rms_norm.maybe_inplace(x, r, W, EPS)
        return out + x, res

    error = _donation_error(model)
    assert isinstance(error, passes.CompileDonationError) and isinstance(error, vllm_ir.VllmIrError)


def _reference(x, r):
    """Eager with the functional native implementation, on copies."""
    a, r2 = ops.fused_add_rms_norm.fn(x.clone(), r.clone(), W, EPS)
    return ops.fused_add_rms_norm.fn(a * 2, r2, W, EPS)


def test_donated_inputs_of_every_graph_piece_are_updated_in_place():
    """Two donated graph inputs, and a graph break: both pieces drop every clone."""

    def model(x, r):
        a, r2 = ops.fused_add_rms_norm.maybe_inplace(x, r, W, EPS)
        torch._dynamo.graph_break()
        return ops.fused_add_rms_norm.maybe_inplace(a * 2, r2, W, EPS)

    x, r = _inputs()
    expected = _reference(x, r)
    with vllm_ir.priority(fused_add_rms_norm=["test_inplace"]):
        compiled, record = compile_with_passes(model)
        xc, rc = x.clone(), r.clone()
        out = compiled(xc, rc)
    for a, b in zip(out, expected, strict=True):
        torch.testing.assert_close(a, b)
    assert len(record.functionalized) == len(record.graphs) == 2
    first, second = record.functionalized
    assert sorted(first.donated_inputs) == ["L['r']", "L['x']"]
    assert len(second.donated_inputs) == 1  # r2, an output of the first piece; a * 2 is computed
    for report in record.graphs:
        assert report.clones_kept == [] and len(report.clones_removed) == 2
    assert [c.reason for c in record.graphs[0].clones_removed] == ["donated graph input"] * 2
    assert sorted(c.reason for c in record.graphs[1].clones_removed) == [
        "donated graph input",
        "not used after the kernel",
    ]
    # The donated inputs were the kernels' buffers: the caller's x holds the first normalized
    # output, its residual buffer went through both pieces and holds the final residual.
    a, _r2 = ops.fused_add_rms_norm.fn(x, r, W, EPS)
    torch.testing.assert_close(xc, a)
    assert rc.data_ptr() == out[1].data_ptr()


def test_maybe_inplace_with_a_functional_kernel_adds_no_clone():
    def model(x, r):
        return ops.fused_add_rms_norm.maybe_inplace(x * 2, r, W, EPS)

    x, r = _inputs()
    compiled, record = compile_with_passes(model)
    for a, b in zip(compiled(x, r.clone()), ops.fused_add_rms_norm.fn(x * 2, r, W, EPS), strict=True):
        torch.testing.assert_close(a, b)
    assert record.graphs[0].clones == []
    assert "aten.clone" not in record.graphs[0].code


def test_donation_marks_survive_aot_autograd_on_the_ir_node():
    """The pre-grad pass marks the IR node (``meta["custom"]``); AOTAutograd copies that onto the
    node it emits, which is what clone cleanup reads. (Placeholder metadata is not carried over.)"""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from vllm_ir.passes.nodes import donated_params, ir_nodes

    seen = []

    class Look(CustomGraphPass):
        def __call__(self, graph):
            seen.extend((n.target._overloadname, donated_params(n)) for n in ir_nodes(graph))

        def uuid(self):
            return "look"

    def model(x, r):
        a, r2 = ops.fused_add_rms_norm.maybe_inplace(x, r, W, EPS)
        return ops.fused_add_rms_norm(a, r2, W, EPS)

    torch._dynamo.reset()
    torch.compile(model, options=passes.inductor_options(post_grad_custom_pre_pass=Look()))(*_inputs())
    assert seen == [("default", ("x", "x_residual")), ("default", ())]


class _DonatesItsBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("residual", torch.randn(4, 16))

    def forward(self, x):
        return ops.fused_add_rms_norm.maybe_inplace(x * 2, self.residual, W, EPS)


def test_module_state_passed_to_maybe_inplace_is_never_overwritten():
    """The next call reads the buffer again: compiled code keeps the clone of module state."""
    module = _DonatesItsBuffer()
    before = module.residual.clone()
    with vllm_ir.priority(fused_add_rms_norm=["test_inplace"]):
        compiled, record = compile_with_passes(module)
        with torch.no_grad():
            compiled(_inputs()[0])
    torch.testing.assert_close(module.residual, before)
    (donation_of_residual,) = [d for d in record.functionalized[0].donations if d.param == "x_residual"]
    assert donation_of_residual.module_state and record.functionalized[0].donated_inputs == []
    kept = {c.param: c.reason for c in record.graphs[0].clones_kept}
    assert list(kept) == ["x_residual"] and "not donated" in kept["x_residual"]
