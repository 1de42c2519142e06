"""providers/aiter and providers/xpu_kernels: install/load here, decline rules, argument mapping.

The vendor libraries need ROCm / XPU hardware, so argument mapping is checked against the
recording test doubles in tests/vendor_doubles/ (put on sys.path only inside these tests).
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

DOUBLES = Path(__file__).parent / "vendor_doubles"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm_ir_provider_aiter") is None
    or importlib.util.find_spec("vllm_ir_provider_xpu_kernels") is None,
    reason="providers/aiter and providers/xpu_kernels are installed by scripts/setup.sh",
)


def _load_wrappers():
    """Loaded at collection, so every test's registry snapshot (tests/conftest.py) holds them."""
    if importlib.util.find_spec("vllm_ir_provider_aiter") is None:
        return None
    vllm_ir.load_provider("aiter")
    vllm_ir.load_provider("xpu_kernels")
    import vllm_ir_provider_aiter as aiter_provider
    import vllm_ir_provider_xpu_kernels as xpu_provider

    return aiter_provider, xpu_provider


_WRAPPERS = _load_wrappers()


@pytest.fixture
def providers():
    return _WRAPPERS


def test_both_load_and_explain_why_unsupported(tmp_path):
    result = run(tmp_path, "providers", "list", "--json")
    records = {r["name"]: r for r in json.loads(result.stdout)["providers"]}
    assert records["aiter"]["status"] == "unsupported here"
    assert records["aiter"]["reason"] == "torch is a CPU build, AITER needs ROCm"
    assert records["aiter"]["implementations"] == {"aiter": ["fused_add_rms_norm", "rms_norm"]}
    assert records["xpu_kernels"]["status"] == "unsupported here"
    assert records["xpu_kernels"]["reason"] == "no XPU device (torch.xpu is not available)"
    text = run(tmp_path, "providers", "list").stdout
    assert "torch is a CPU build, AITER needs ROCm" in text
    assert "aiter" not in sys.modules  # discovery never imports the vendor library


# -- decline rules and accept cases (metadata only, real CPU tensors) --------------------------

BF16 = torch.bfloat16


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: (torch.randn(4, 64, dtype=BF16), torch.ones(64, dtype=BF16), 8), "variance_size is not supported"),
        (lambda: (torch.randn(4, 64), torch.ones(64), None), "float16/bfloat16, not torch.float32"),
        (lambda: (torch.randn(4, 64, dtype=BF16), torch.ones(64), None), "weight dtype torch.float32 must match"),
        (  # a per-head view of a fused QKV projection: [tokens, heads, head_dim] sliced out of [tokens, 3*...]
            lambda: (
                torch.randn(4, 3 * 8 * 16, dtype=BF16).view(4, 3 * 8, 16)[:, 8:16],
                torch.ones(16, dtype=BF16),
                None,
            ),
            "cannot be flattened to 2-D without a copy",
        ),
        (lambda: (torch.randn(64, 4, dtype=BF16).t(), torch.ones(64, dtype=BF16), None), "flattened to 2-D"),
    ],
)
def test_aiter_declines_with_reason(providers, make, reason):
    aiter_provider, _ = providers
    x, w, vs = make()
    verdict = aiter_provider.rules(x, w, vs)
    assert not verdict and reason in verdict.reason


@pytest.mark.parametrize(
    "make",
    [
        lambda: (torch.randn(4, 64, dtype=BF16), torch.ones(64, dtype=BF16)),
        lambda: (torch.randn(4, 64, dtype=torch.float16), None),
        lambda: (torch.randn(2, 3, 64, dtype=BF16), torch.ones(64, dtype=BF16)),  # contiguous 3-D
        lambda: (torch.randn(4, 96, dtype=BF16)[:, :64], torch.ones(64, dtype=BF16)),  # row-strided 2-D
    ],
)
def test_aiter_accepts(providers, make):
    aiter_provider, _ = providers
    x, w = make()
    assert aiter_provider.rules(x, w, None) is True


def test_predicates_decline_cpu_tensors(providers):
    aiter_provider, xpu_provider = providers
    x, w = torch.randn(4, 64, dtype=BF16), torch.ones(64, dtype=BF16)
    assert aiter_provider.rms_norm_supports(x, w, 1e-6).reason == "tensors are on cpu; AITER runs on ROCm GPUs"
    assert xpu_provider.rms_norm_supports(x, w, 1e-6).reason == "tensors are on cpu; vllm-xpu-kernels runs on XPU"
    r = torch.randn(4, 64, dtype=torch.float16)
    assert (
        "residual must be contiguous with x's dtype" in aiter_provider.fused_add_rms_norm_supports(x, r, w, 1e-6).reason
    )


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: (torch.randn(4, 64), torch.ones(64), 8), "variance_size is not supported"),
        (lambda: (torch.randn(4, 64, dtype=BF16), torch.ones(64), None), "weight dtype torch.float32 must match"),
        (lambda: (torch.randn(4, 96)[:, :64], torch.ones(64), None), "input must be contiguous"),
    ],
)
def test_xpu_declines_with_reason(providers, make, reason):
    _, xpu_provider = providers
    x, w, vs = make()
    verdict = xpu_provider.rules(x, w, vs)
    assert not verdict and reason in verdict.reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_xpu_accepts_every_dtype(providers, dtype):
    _, xpu_provider = providers
    assert xpu_provider.rules(torch.randn(2, 3, 64, dtype=dtype), torch.ones(64, dtype=dtype), None) is True


# -- argument mapping against recording doubles ------------------------------------------------


@pytest.fixture
def aiter_double(providers, monkeypatch):
    monkeypatch.syspath_prepend(str(DOUBLES / "aiter_double"))
    sys.modules.pop("aiter", None)
    double = importlib.import_module("aiter")
    assert double.IS_TEST_DOUBLE
    double.CALLS.clear()
    yield double
    sys.modules.pop("aiter", None)


def test_aiter_rms_norm_passes_a_2d_view_weight_and_epsilon(aiter_double):
    op = vllm_ir.ops.rms_norm
    x, w, eps, _ = op.generate_inputs((2, 3, 64), BF16)
    out = op.impls["aiter"].fn(x, w, eps)
    (call,) = aiter_double.CALLS
    assert call["fn"] == "rmsnorm2d_fwd"
    assert call["input"].shape == (6, 64) and call["input"].data_ptr() == x.data_ptr()  # a view, no copy
    assert call["weight"] is w and call["epsilon"] == eps
    assert out.shape == x.shape
    torch.testing.assert_close(out, op.fn(x, w, eps), atol=1e-2, rtol=1.6e-2)


def test_aiter_rms_norm_without_weight_passes_ones(aiter_double):
    op = vllm_ir.ops.rms_norm
    x, _, eps, _ = op.generate_inputs((4, 64), BF16)
    op.impls["aiter"].fn(x, None, eps)
    weight = aiter_double.CALLS[0]["weight"]
    assert torch.equal(weight, torch.ones(64, dtype=BF16))


def test_aiter_fused_add_writes_fresh_buffers_and_leaves_inputs(aiter_double):
    op = vllm_ir.ops.fused_add_rms_norm
    x, res, w, eps, _ = op.generate_inputs((5, 64), BF16)
    x0, res0 = x.clone(), res.clone()
    out, new_res = op.impls["aiter"].fn(x, res, w, eps)
    (call,) = aiter_double.CALLS
    assert call["fn"] == "rmsnorm2d_fwd_with_add"
    assert call["input"].data_ptr() == x.data_ptr() and call["residual_in"].data_ptr() == res.data_ptr()
    assert call["out"].data_ptr() == out.data_ptr() and call["residual_out"].data_ptr() == new_res.data_ptr()
    assert out.data_ptr() not in (x.data_ptr(), res.data_ptr())
    assert torch.equal(x, x0) and torch.equal(res, res0)  # not in place: registered inplace=False
    expected = op.fn(x, res, w, eps)
    torch.testing.assert_close(out, expected[0], atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(new_res, expected[1])


def test_aiter_call_is_one_opaque_node_when_traced(aiter_double):
    from torch.fx.experimental.proxy_tensor import make_fx

    x, w, eps, _ = vllm_ir.ops.rms_norm.generate_inputs((4, 64), BF16)
    gm = make_fx(lambda x, w: vllm_ir.ops.rms_norm.impls["aiter"].fn(x, w, eps), tracing_mode="fake")(x, w)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.vllm_ir_aiter.rms_norm.default]
    assert aiter_double.CALLS == []  # the fake ran, not the vendor


@pytest.fixture
def xpu_double(providers, monkeypatch):
    monkeypatch.syspath_prepend(str(DOUBLES / "xpu_double"))
    double = importlib.import_module("vllm_xpu_kernels._C")  # defines torch.ops._C.* once per process
    assert sys.modules["vllm_xpu_kernels"].IS_TEST_DOUBLE
    providers[1]._vendor_ops.cache_clear()
    double.CALLS.clear()
    yield double
    providers[1]._vendor_ops.cache_clear()


def test_xpu_rms_norm_writes_into_a_fresh_out(xpu_double):
    op = vllm_ir.ops.rms_norm
    x, w, eps, _ = op.generate_inputs((3, 64), BF16)
    out = op.impls["xpu_kernels"].fn(x, w, eps)
    (call,) = xpu_double.CALLS
    assert call["fn"] == "rms_norm" and call["out"].data_ptr() == out.data_ptr()
    assert call["input"].data_ptr() == x.data_ptr() and call["weight"].data_ptr() == w.data_ptr()
    torch.testing.assert_close(out, op.fn(x, w, eps), atol=1e-2, rtol=1.6e-2)


def test_xpu_fused_add_is_in_place_and_returns_the_donated_buffers(xpu_double):
    op = vllm_ir.ops.fused_add_rms_norm
    x, res, w, eps, _ = op.generate_inputs((3, 64), BF16)
    expected = op.fn(x, res, w, eps)
    out, new_res = op.impls["xpu_kernels"].fn(x, res, w, eps)
    (call,) = xpu_double.CALLS
    assert call["input"] is x and call["residual"] is res
    assert out is x and new_res is res
    torch.testing.assert_close(out, expected[0], atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(new_res, expected[1])


def test_each_provider_states_its_own_platform_defaults(providers):
    from vllm_ir import platforms

    aiter_provider, xpu_provider = providers
    for platform in (platforms.CPU, platforms.CUDA, platforms.ROCM, platforms.XPU):
        for mode in ("eager", "compile"):
            assert platform.default_priority(mode) == {}  # the core's platforms name no provider
    assert aiter_provider.vllm_ir_default_priority(platforms.ROCM, "eager") == {
        "fused_add_rms_norm": ["aiter"],
        "rms_norm": ["aiter"],
    }
    assert xpu_provider.vllm_ir_default_priority(platforms.XPU, "eager") == {
        "fused_add_rms_norm": ["xpu_kernels"],
        "rms_norm": ["xpu_kernels"],
    }
    for hook, other in ((aiter_provider, platforms.XPU), (xpu_provider, platforms.ROCM)):
        assert hook.vllm_ir_default_priority(other, "eager") is None
        assert hook.vllm_ir_default_priority(platforms.ROCM, "compile") is None
