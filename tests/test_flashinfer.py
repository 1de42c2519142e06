"""providers/flashinfer: loads here as "unsupported here" with its reason; decline rules; argument
mapping, results and the all-reduce fusion pass against the recording double in
tests/vendor_doubles/flashinfer_double (put on sys.path only inside these tests; not FlashInfer).

The double's all-reduce is a real torch.distributed one over a one-rank gloo group. FlashInfer
serves 2, 4 or 8 ranks and CUDA tensors only, so the tests that run the wrapper stand in for
those checks (``_on_gpu`` and ``WORLD_SIZES`` patched, ``supported`` set), as the AITER tests do.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import vllm_ir
from tests.test_cli import run
from vllm_ir.passes import record_of, tensor_parallel_fusions

DOUBLE = Path(__file__).parent / "vendor_doubles" / "flashinfer_double"
OPS = ("all_reduce_fused_add_rms_norm", "all_reduce_rms_norm")


def _load_wrapper():
    """Loaded at collection, so every test's registry snapshot (tests/conftest.py) holds it."""
    if importlib.util.find_spec("vllm_ir_provider_flashinfer") is None:
        return None
    vllm_ir.load_provider("flashinfer")
    import vllm_ir_provider_flashinfer

    return vllm_ir_provider_flashinfer


_WRAPPER = _load_wrapper()


@pytest.fixture(scope="module")
def group() -> str:
    import torch.distributed as dist

    if dist.is_initialized():
        yield dist.group.WORLD.group_name
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fi():
    if _WRAPPER is None:
        pytest.fail("providers/flashinfer is not installed (scripts/setup.sh installs every provider)")
    return _WRAPPER


@pytest.mark.subprocess
def test_loads_as_unsupported_here_with_its_reason(tmp_path, fi):
    record = {r["name"]: r for r in json.loads(run(tmp_path, "providers", "list", "--json").stdout)["providers"]}
    record = record["flashinfer"]
    assert record["distribution"] == "vllm-ir-provider-flashinfer"
    assert record["status"] == "unsupported here"
    if torch.version.cuda is None:
        assert record["reason"] == "torch is a CPU build; FlashInfer's all-reduce fusion needs CUDA"
    assert record["implementations"] == {"flashinfer": list(OPS)}
    assert "flashinfer" not in sys.modules  # discovery never imports the vendor
    for mode in ("eager", "compile"):  # no default priority
        assert "flashinfer" not in [e.provider for e in vllm_ir.ops.all_reduce_rms_norm.get_priority(mode)]


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: (torch.randn(4, 64, dtype=torch.float64), None), "takes float16/bfloat16/float32, not torch.float64"),
        (lambda: (torch.randn(64, 4).t(), None), "x must be contiguous"),
        (lambda: (torch.randn(4, 36, dtype=torch.bfloat16), None), "hidden size 36 is not a multiple of 8"),
        (lambda: (torch.randn(4, 64), torch.ones(64, dtype=torch.bfloat16)), "weight dtype torch.bfloat16 must match"),
        (lambda: (torch.randn(4, 64), torch.ones(32)), "weight must be a contiguous 1-D [hidden] tensor"),
        (lambda: (torch.randn(4, 64), None), "world size 1; FlashInfer's TRT-LLM all-reduce fusion serves (2, 4, 8)"),
    ],
)
def test_declines_with_reason(fi, group, make, reason, monkeypatch):
    monkeypatch.setattr(fi, "_on_gpu", lambda x: True)  # stand in for a CUDA tensor
    x, w = make()
    verdict = fi.rules(x, w, group)
    assert isinstance(verdict, vllm_ir.Unsupported) and reason in verdict.reason


def test_predicates_decline_cpu_unknown_groups_and_mismatched_residuals(fi, group, monkeypatch):
    fused_supports = vllm_ir.ops.all_reduce_fused_add_rms_norm.impls["flashinfer"].supports_args  # the op's arguments
    x, w = torch.randn(4, 64), torch.ones(64)
    assert (
        vllm_ir.ops.all_reduce_rms_norm.impls["flashinfer"]
        .supports_args(x, w, 1e-6, group)
        .reason.startswith("tensors are on cpu")
    )
    assert "residual must be contiguous" in fused_supports(x, x[:2], w, 1e-6, group).reason
    monkeypatch.setattr(fi, "_on_gpu", lambda x: True)  # stand in for a CUDA tensor
    monkeypatch.setattr(fi, "WORLD_SIZES", (1,))
    assert fi.rules(x, w, group) is True
    assert "process group 'nope' is unknown here" in fi.rules(x, w, "nope").reason


@pytest.fixture
def double(fi, group, monkeypatch):
    """The double importable, the device and world-size checks stood in for, the impls supported."""
    monkeypatch.syspath_prepend(str(DOUBLE))
    for name in ("flashinfer", "flashinfer.comm"):
        sys.modules.pop(name, None)
    comm = importlib.import_module("flashinfer.comm")
    assert comm.IS_TEST_DOUBLE
    comm.CALLS.clear()
    monkeypatch.setattr(fi, "_on_gpu", lambda x: True)  # stand in for a CUDA tensor
    monkeypatch.setattr(fi, "WORLD_SIZES", (1,))  # the one-rank gloo group stands in for 2+ GPUs
    for name in OPS:
        monkeypatch.setattr(getattr(vllm_ir.ops, name).impls["flashinfer"], "supported", True)
    monkeypatch.setattr(fi.ops, "_WORKSPACES", {})
    yield comm
    for name in ("flashinfer", "flashinfer.comm"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("with_weight", [True, False])
def test_dispatch_picks_it_passes_the_pattern_and_equals_native(double, group, with_weight):
    op = vllm_ir.ops.all_reduce_fused_add_rms_norm
    x, res, w, eps, name = op.generate_inputs((3, 64), torch.float32, with_weight=with_weight)
    with vllm_ir.priority(all_reduce_fused_add_rms_norm=["flashinfer"]):
        assert op.dispatch(x, res, w, eps, name).provider == "flashinfer"
        out, new_res = op(x, res, w, eps, name)
    created, call = double.CALLS
    assert created["backend"] == "trtllm" and created["workspace"].world_size == 1
    assert call["pattern"] == double.AllReduceFusionPattern.kARResidualRMSNorm == 1
    assert call["input"].shape == (3, 64) and call["rms_eps"] == eps and call["use_oneshot"] is None
    assert call["residual_in"].data_ptr() == res.data_ptr()
    assert torch.equal(call["rms_gamma"], w if with_weight else torch.ones(64))
    assert call["norm_out"].data_ptr() == out.data_ptr() and call["residual_out"].data_ptr() == new_res.data_ptr()
    expected = op.impls["native"].fn(x, res, w, eps, name)
    torch.testing.assert_close((out, new_res), expected)


def test_no_residual_op_passes_a_zero_residual_and_returns_the_sum(double, group):
    op = vllm_ir.ops.all_reduce_rms_norm
    x, w, eps, name = op.generate_inputs((1, 64), torch.float32)
    out, reduced = op.impls["flashinfer"].fn(x, w, eps, name)
    (_, call) = double.CALLS
    assert torch.equal(call["residual_in"], torch.zeros(1, 64))
    assert call["use_oneshot"] is True  # as many tokens as ranks: the two-shot path would assert
    torch.testing.assert_close((out, reduced), op.impls["native"].fn(x, w, eps, name))


def test_workspace_is_reused_and_regrown(double, group, fi, monkeypatch):
    monkeypatch.setattr(fi.ops, "MIN_TOKENS", 4)
    op = vllm_ir.ops.all_reduce_rms_norm.impls["flashinfer"].fn
    w = torch.ones(64)
    op(torch.randn(3, 64), w, 1e-6, group)
    op(torch.randn(4, 64), w, 1e-6, group)
    op(torch.randn(0, 64), w, 1e-6, group)  # empty: no kernel call
    op(torch.randn(5, 64), w, 1e-6, group)
    assert [c["fn"] for c in double.CALLS] == [
        *("create_allreduce_fusion_workspace", "allreduce_fusion", "allreduce_fusion"),
        *("destroy", "create_allreduce_fusion_workspace", "allreduce_fusion"),
    ]
    assert double.CALLS[-2]["workspace"].max_token_num == 8


@pytest.mark.compile
def test_fusion_pass_fuses_without_force_when_flashinfer_is_first(double, group):
    import torch.distributed._functional_collectives as funcol

    def fn(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out, new_res = vllm_ir.ops.fused_add_rms_norm(funcol.all_reduce(x, "sum", group), res, w, 1e-6)
        return out + new_res

    x, res, w = torch.randn(4, 64), torch.randn(4, 64), torch.rand(64) + 0.5
    expected = fn(x, res, w)
    unfused = vllm_ir.compile(fn, fusions=tensor_parallel_fusions(all_reduce=True), backend="aot_eager")
    torch.testing.assert_close(unfused(x, res, w), expected)
    assert "only the native" in record_of(unfused).graphs[-1].fusions_rejected[0]  # not first: no fusion
    double.CALLS.clear()
    with vllm_ir.priority(all_reduce_fused_add_rms_norm=["flashinfer"]):
        compiled = vllm_ir.compile(fn, fusions=tensor_parallel_fusions(all_reduce=True), backend="aot_eager")
        torch.testing.assert_close(compiled(x, res, w), expected)
    report = record_of(compiled).graphs[-1]
    assert len(report.fusions) == 1, report.fusions_rejected
    assert "flashinfer" in str(report.selected_impls["all_reduce_fused_add_rms_norm"])
    assert [c["fn"] for c in double.CALLS][-1] == "allreduce_fusion"
