"""The pipeline's paths for older torch (2.11), exercised under the torch this suite runs.

torch 2.11 differs from 2.13 in three places the passes touch: it has neither
``torch.Tag.out`` nor ``torch._library.utils.is_out``; ``Match.replace_with_graph`` returns
``None`` instead of the nodes it added; and its FX graph / AOTAutograd cache keys pickle the
``pre_grad_custom_pass`` object itself. The first two failed every lowering there
(`LoweringError`, seen on an H200 with torch 2.11.0+cu130); the third made those caches never
hit. Each test below switches the pipeline to the older behaviour and checks the result is
the one the newer path gives.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch._inductor.pattern_matcher import Match

import vllm_ir
from tests.compile_models import compile_with_passes, make_decoder
from vllm_ir.passes import entry, lowering

ops = vllm_ir.ops
EPS = 1e-6

pytestmark = pytest.mark.usefixtures("compile_test_providers_passes_forced")


def _aten_overloads() -> list[torch._ops.OpOverload]:
    found = []
    for full in torch._C._dispatch_get_all_op_names():
        ns, _, rest = full.partition("::")
        name, _, overload = rest.partition(".")
        if ns != "aten":
            continue
        try:
            found.append(getattr(getattr(torch.ops.aten, name), overload or "default"))
        except (AttributeError, RuntimeError):
            continue
    return found


def test_out_overloads_are_recognised_with_and_without_the_out_tag(monkeypatch):
    overloads = _aten_overloads()
    with_tag = [lowering.is_out_overload(op) for op in overloads]
    monkeypatch.setattr(lowering, "_HAS_OUT_TAG", False)  # torch 2.11
    assert [lowering.is_out_overload(op) for op in overloads] == with_tag
    aten = torch.ops.aten
    assert lowering.is_out_overload(aten.mul.out) and lowering.is_out_overload(aten.add.out)
    assert not lowering.is_out_overload(aten.mul.Tensor) and not lowering.is_out_overload(aten.add_.Tensor)


def _inplace_out_model_code() -> tuple[str, list[tuple[str, bool]]]:
    from tests.ops_for_tests import inplace_fused_add_rms_norm

    if "aten_inplace" not in ops.fused_add_rms_norm.impls:
        ops.fused_add_rms_norm.register_impl("aten_inplace", inplace=True)(inplace_fused_add_rms_norm)
    w = torch.randn(32)

    def model(x, r):
        return ops.fused_add_rms_norm.maybe_inplace(x * 2, r, w, EPS)

    x, r = torch.randn(4, 32), torch.randn(4, 32)
    with vllm_ir.priority(fused_add_rms_norm=["aten_inplace"]):
        compiled, record = compile_with_passes(model)
        out = compiled(x, r.clone())
    for a, b in zip(out, ops.fused_add_rms_norm.fn(x * 2, r, w, EPS), strict=True):
        torch.testing.assert_close(a, b)
    report = record.graphs[0]
    return report.code, [(c.param, c.removed) for c in report.clones]


def test_an_implementation_with_out_ops_lowers_without_the_out_tag(monkeypatch):
    expected = _inplace_out_model_code()
    monkeypatch.setattr(lowering, "_HAS_OUT_TAG", False)
    code, clones = _inplace_out_model_code()
    assert ".out(" not in code and "aten.copy_" in code
    assert (code, clones) == expected


def _decoder_run(priority: dict[str, list[str]]) -> tuple[torch.Tensor, str, list, dict]:
    model, _plain = make_decoder(hidden=64, layers=3)
    x = torch.randn(8, 64)
    with vllm_ir.priority(**priority), torch.no_grad():
        eager = model(x.clone())
        compiled, record = compile_with_passes(model)
        out = compiled(x.clone())
    torch.testing.assert_close(out, eager)
    report = record.graphs[0]
    return out, report.code, [(c.op, c.param, c.removed) for c in report.clones], report.selected_impls


@pytest.mark.parametrize(
    "priority",
    [
        {"rms_norm": ["test_opaque"], "fused_add_rms_norm": ["test_inplace"]},  # in place: clones tagged
        {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]},  # traced code, repeats copied
    ],
    ids=["inplace", "native"],
)
def test_lowering_finds_the_added_nodes_when_replace_with_graph_returns_none(monkeypatch, priority):
    """Repeated layers hit the trace cache (their copied nodes get fresh fake values) and the
    in-place kernel's clones are tagged: both need the nodes the replacement added."""
    expected = _decoder_run(priority)
    original = Match.replace_with_graph

    def returns_none(self, replacement_graph, args):  # torch 2.11
        original(self, replacement_graph, args)

    monkeypatch.setattr(Match, "replace_with_graph", returns_none)
    out, code, clones, selected = _decoder_run(priority)
    torch.testing.assert_close(out, expected[0], rtol=0, atol=0)
    assert (code, clones, selected) == expected[1:]


def test_a_pass_chain_pickles_as_its_uuid_and_is_not_deep_copied():
    """torch 2.11 deep-copies and pickles ``pre_grad_custom_pass`` into its cache keys."""
    options = vllm_ir.inductor_options()
    chain = options[entry.PRE_GRAD]
    assert copy.deepcopy(chain) is chain
    uid = chain.uuid()
    assert uid is not None and pickle.loads(pickle.dumps(chain)) == uid
    chain(torch.fx.symbolic_trace(lambda x: x + 1).graph)  # running it (records, logs) changes nothing
    assert pickle.loads(pickle.dumps(vllm_ir.inductor_options()[entry.PRE_GRAD])) == uid


def test_a_pass_chain_without_a_uuid_refuses_to_pickle():
    chain = entry.ChainedPass([lambda graph: None], "test chain")
    assert chain.uuid() is None
    with pytest.raises(pickle.PicklingError, match="no uuid"):
        pickle.dumps(chain)
