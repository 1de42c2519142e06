"""examples/oot_platform end to end: installed (by the set-up), discovered, claims, dispatches, matches."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest
import torch

import vllm_ir
from tests.plugin_dists import make_dist
from vllm_ir import ProviderStatus
from vllm_ir.plugins import discovery as plugins

# Only a hook asking for "triton" first (the triton provider itself may or may not be loaded).
TRITON_DEFAULTS = """
import vllm_ir

@vllm_ir.hookimpl
def vllm_ir_default_priority(platform, mode):
    return {"rms_norm": ["triton"]}
"""


@pytest.fixture
def oot(monkeypatch, tmp_path):
    if importlib.util.find_spec("vllm_ir_oot_platform") is None:
        pytest.skip("examples/oot_platform is not installed (scripts/setup.sh installs it)")
    monkeypatch.setenv("VLLM_IR_OOT_PLATFORM", "1")
    monkeypatch.delenv("VLLM_IR_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    # A provider that contributes triton by default, to see the example's site policy act on it.
    make_dist(tmp_path, "tp-fake-triton", TRITON_DEFAULTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    sys.modules.pop("vllm_ir_oot_platform", None)  # it reads the simulated device at import
    plugins.reset_for_tests()
    yield
    sys.path.remove(str(tmp_path))
    importlib.invalidate_caches()
    plugins.reset_for_tests()
    sys.modules.pop("vllm_ir_oot_platform", None)
    sys.modules.pop("tp_fake_triton", None)


def test_listed_loaded_and_claims_the_platform(oot):
    record = {r.name: r for r in vllm_ir.provider_records()}["oot_example"]
    assert record.status is ProviderStatus.LOADED
    assert record.distribution == "vllm-ir-example-oot-platform"
    assert record.implementations == {"oot_example": ["fused_add_rms_norm", "rms_norm"]}
    platform = vllm_ir.current_platform()
    assert (platform.name, platform.claimed_by) == ("oot_example", "oot_example")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selected_by_dispatch_and_matches_native(oot, dtype):
    rms = vllm_ir.ops.rms_norm
    x, w, eps, _ = rms.generate_inputs((5, 3, 96), dtype)
    assert rms.dispatch(x, w, eps).provider == "oot_example"
    atol, rtol = rms.tolerance(dtype)
    torch.testing.assert_close(rms(x, w, eps), rms.fn(x, w, eps), atol=atol, rtol=rtol)

    fused = vllm_ir.ops.fused_add_rms_norm
    x, res, w, eps, _ = fused.generate_inputs((7, 96), dtype)
    expected = fused.fn(x, res, w, eps)
    out, new_res = fused.maybe_inplace(x, res, w, eps)
    assert out.data_ptr() == x.data_ptr() and new_res.data_ptr() == res.data_ptr()
    for got, want in zip((out, new_res), expected, strict=True):
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_declines_with_reason_and_policy_drops_triton(oot):
    rms = vllm_ir.ops.rms_norm
    x, w, eps, _ = rms.generate_inputs((2, 32), torch.float32)
    verdicts = {v.provider: v for v in rms.explain(x, w, eps, 16).verdicts}
    assert verdicts["oot_example"].status == "declined"
    assert "full hidden size" in verdicts["oot_example"].reason
    # The example's vllm_ir_adjust_priority removes triton from the defaults on its platform.
    assert [r.entry.provider for r in vllm_ir.ir.priority.resolve(rms).entries] == ["oot_example", "native"]


def test_without_the_device_it_reports_why(monkeypatch, oot):
    monkeypatch.setenv("VLLM_IR_OOT_PLATFORM", "0")
    sys.modules.pop("vllm_ir_oot_platform", None)
    plugins.reset_for_tests()
    record = {r.name: r for r in vllm_ir.provider_records()}["oot_example"]
    assert record.status is ProviderStatus.UNSUPPORTED
    assert record.reason == "oot_example device not present (VLLM_IR_OOT_PLATFORM!=1)"
    assert vllm_ir.current_platform().name == "cpu"
