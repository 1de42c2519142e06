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
from vllm_ir.ir.declarations.rotary import build_cos_sin_cache

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


@pytest.fixture
def on_device(providers, monkeypatch):
    """Stand in for ROCm / XPU tensors: the predicates' device checks pass, so their argument rules
    are unit-tested on CPU tensors."""
    for module in ("", ".activation", ".quant"):
        monkeypatch.setattr(sys.modules[f"vllm_ir_provider_aiter{module}"], "_on_gpu", lambda x: True)
    for module in ("", ".quant", ".rotary"):  # xpu's activation rules take no device: `_supports` asks it
        monkeypatch.setattr(sys.modules[f"vllm_ir_provider_xpu_kernels{module}"], "_on_xpu", lambda x: True)


def supports(op_name: str, provider: str, *args):
    """The provider's registered predicate called with the op's arguments, as the dispatcher calls it."""
    return vllm_ir.ops.__getattr__(op_name).impls[provider].supports_args(*args)


AITER_OPS = ["fused_add_rms_norm", "gelu_and_mul", "gelu_fast", "rms_norm", "silu_and_mul", "static_quant_fp8"]
XPU_OPS = [
    *("dynamic_group_quant_fp8", "dynamic_quant_fp8", "fatrelu_and_mul", "fused_add_rms_norm", "gelu_and_mul"),
    *("gelu_fast", "gelu_new", "mul_and_silu", "quick_gelu", "relu2", "rms_norm", "rotary_embedding"),
    *("silu_and_mul", "static_quant_fp8", "swigluoai_and_mul"),
]


@pytest.mark.subprocess
def test_both_load_and_explain_why_unsupported(tmp_path):
    result = run(tmp_path, "providers", "list", "--json")
    records = {r["name"]: r for r in json.loads(result.stdout)["providers"]}
    assert records["aiter"]["status"] == "unsupported here"
    assert records["aiter"]["reason"] == "torch is a CPU build, AITER needs ROCm"
    assert records["aiter"]["implementations"] == {"aiter": AITER_OPS}
    assert records["xpu_kernels"]["implementations"] == {"xpu_kernels": XPU_OPS}
    assert records["xpu_kernels"]["status"] == "unsupported here"
    assert records["xpu_kernels"]["reason"] == "no XPU device (torch.xpu is not available)"
    text = run(tmp_path, "providers", "list", "--wide").stdout
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
def test_aiter_declines_with_reason(providers, on_device, make, reason):
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
def test_aiter_accepts(providers, on_device, make):
    aiter_provider, _ = providers
    x, w = make()
    assert aiter_provider.rules(x, w, None) is True


def test_predicates_decline_cpu_tensors(providers):
    x, w = torch.randn(4, 64, dtype=BF16), torch.ones(64, dtype=BF16)
    assert supports("rms_norm", "aiter", x, w, 1e-6).reason == "tensors are on cpu; AITER runs on ROCm GPUs"
    assert supports("rms_norm", "xpu_kernels", x, w, 1e-6).reason == "tensors are on cpu; vllm-xpu-kernels runs on XPU"
    r = torch.randn(4, 64, dtype=torch.float16)
    assert "residual must be contiguous with x's dtype" in supports("fused_add_rms_norm", "aiter", x, r, w, 1e-6).reason


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: (torch.randn(4, 64), torch.ones(64), 8), "variance_size is not supported"),
        (lambda: (torch.randn(4, 64, dtype=BF16), torch.ones(64), None), "weight dtype torch.float32 must match"),
        (lambda: (torch.randn(4, 96)[:, :64], torch.ones(64), None), "input must be contiguous"),
    ],
)
def test_xpu_declines_with_reason(providers, on_device, make, reason):
    _, xpu_provider = providers
    x, w, vs = make()
    verdict = xpu_provider.rules(x, w, vs)
    assert not verdict and reason in verdict.reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_xpu_accepts_every_dtype(providers, on_device, dtype):
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
    from vllm_ir.plugins import platforms

    aiter_provider, xpu_provider = providers
    for platform in (platforms.CPU, platforms.CUDA, platforms.ROCM, platforms.XPU):
        for mode in ("eager", "compile"):
            assert platform.default_priority(mode) == {}  # the core's platforms name no provider
    assert aiter_provider.vllm_ir_default_priority(platforms.ROCM, "eager") == {op: ["aiter"] for op in AITER_OPS}
    assert xpu_provider.vllm_ir_default_priority(platforms.XPU, "eager") == {op: ["xpu_kernels"] for op in XPU_OPS}
    for hook, other in ((aiter_provider, platforms.XPU), (xpu_provider, platforms.ROCM)):
        assert hook.vllm_ir_default_priority(other, "eager") is None
        assert hook.vllm_ir_default_priority(platforms.ROCM, "compile") is None


# -- activations ---------------------------------------------------------------------------------

F16 = torch.float16


@pytest.fixture
def aiter_act(providers):
    return sys.modules["vllm_ir_provider_aiter.activation"]


@pytest.fixture
def xpu_act(providers):
    return sys.modules["vllm_ir_provider_xpu_kernels.activation"]


@pytest.mark.parametrize(
    ("x", "reason"),
    [
        (torch.randn(4, 64, dtype=torch.float64), "float32/float16/bfloat16, not torch.float64"),
        (torch.tensor(1.0), "x is 0-d"),
        (torch.randn(4, 24), "last dimension 24 is not a positive multiple of 16"),
        (torch.randn(4, 0), "last dimension 0 is not a positive multiple of 16"),
        (torch.randn(4, 96)[:, :64], "x must be contiguous"),
        (torch.randn(64, 4).t(), "x must be contiguous"),
    ],
)
def test_aiter_gated_declines_with_reason(aiter_act, on_device, x, reason):
    verdict = aiter_act.gated_rules(x)
    assert not verdict and reason in verdict.reason


@pytest.mark.parametrize(
    ("x", "reason"),
    [
        (torch.randn(4, 64, dtype=F16), "bfloat16 only, not torch.float16"),
        (torch.randn(4, 64), "bfloat16 only, not torch.float32"),
        (torch.tensor(1.0, dtype=BF16), "x is 0-d"),
        (torch.randn(4, 12, dtype=BF16), "last dimension 12 is not a multiple of 8"),
        (torch.randn(4, 96, dtype=BF16)[:, :64], "x must be contiguous"),
    ],
)
def test_aiter_gelu_fast_declines_with_reason(aiter_act, on_device, x, reason):
    verdict = aiter_act.gelu_fast_rules(x)
    assert not verdict and reason in verdict.reason


def test_aiter_activation_rules_accept_and_predicates_decline_cpu(aiter_act, aiter_double, monkeypatch):
    x = torch.randn(4, 64, dtype=BF16)
    for verdict in (
        supports("silu_and_mul", "aiter", x),
        supports("gelu_and_mul", "aiter", x, "tanh"),
        supports("gelu_fast", "aiter", x),
    ):
        assert verdict.reason == "tensors are on cpu; AITER runs on ROCm GPUs"
    verdict = supports("gelu_and_mul", "aiter", x, "erf")
    assert "approximate='erf' is neither 'none' nor 'tanh'" in verdict.reason
    with pytest.raises(ValueError, match=r"gelu_and_mul \(provider aiter\): approximate must be"):
        vllm_ir.ops.gelu_and_mul.impls["aiter"].fn(x, "erf")
    assert "fatrelu_and_mul" not in vllm_ir.ops_implemented_by("aiter")  # AITER has no such kernel
    monkeypatch.setattr(aiter_act, "_on_gpu", lambda x: True)  # stand in for a ROCm tensor
    for dtype in (torch.float32, F16, BF16):
        assert aiter_act.gated_rules(torch.randn(2, 3, 64, dtype=dtype)) is True
    aiter_act.ops.has_function.cache_clear()
    assert aiter_act.gelu_fast_rules(torch.randn(2, 3, 8, dtype=BF16)) is True  # the double has gelu_fast
    aiter_act.ops.has_function.cache_clear()


@pytest.mark.parametrize(
    ("op_name", "options", "function", "dtype"),
    [
        ("silu_and_mul", {}, "silu_and_mul", BF16),
        ("silu_and_mul", {}, "silu_and_mul", torch.float32),
        ("gelu_and_mul", {}, "gelu_and_mul", F16),
        ("gelu_and_mul", {"approximate": "tanh"}, "gelu_tanh_and_mul", BF16),
        ("gelu_fast", {}, "gelu_fast", BF16),
    ],
)
def test_aiter_activation_calls_the_vendor_function_with_a_fresh_out(aiter_double, op_name, options, function, dtype):
    op = vllm_ir.ops.__getattr__(op_name)
    args = op.generate_inputs((2, 3, 64), dtype, **options)
    x = args[0]
    out = op.impls["aiter"].fn(*args)
    (call,) = aiter_double.CALLS
    assert call["fn"] == function
    assert call["input"] is x and call["out"] is out  # no copy of an aligned contiguous input
    torch.testing.assert_close(out, op.fn(*args), atol=op.tolerance(dtype)[0], rtol=op.tolerance(dtype)[1])


def test_aiter_activation_copies_a_misaligned_view_and_skips_empty_calls(aiter_double):
    impl = vllm_ir.ops.silu_and_mul.impls["aiter"]
    x = torch.randn(2 * 32 + 1)[1:].view(2, 32)  # contiguous, first element 4 bytes past alignment
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    out = impl.fn(x)
    (call,) = aiter_double.CALLS
    assert call["input"].data_ptr() % 16 == 0 and torch.equal(call["input"], x)
    torch.testing.assert_close(out, vllm_ir.ops.silu_and_mul.fn(x))
    empty = impl.fn(torch.randn(0, 32))
    assert empty.shape == (0, 16) and len(aiter_double.CALLS) == 1  # AITER is not called for no rows


def test_aiter_gelu_fast_declines_when_this_aiter_lacks_it(aiter_double, aiter_act, monkeypatch):
    monkeypatch.setattr(aiter_act, "_on_gpu", lambda x: True)  # stand in for a ROCm tensor
    aiter_act.ops.has_function.cache_clear()
    x = torch.randn(4, 64, dtype=BF16)
    assert supports("gelu_fast", "aiter", x) is True
    monkeypatch.delattr(aiter_double, "gelu_fast")
    aiter_act.ops.has_function.cache_clear()
    assert supports("gelu_fast", "aiter", x).reason == "this AITER has no gelu_fast (a later addition): upgrade AITER"
    aiter_act.ops.has_function.cache_clear()


def test_aiter_activation_is_one_opaque_node_when_traced(aiter_double):
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(4, 64, dtype=BF16)
    gm = make_fx(lambda x: vllm_ir.ops.gelu_and_mul.impls["aiter"].fn(x, "tanh"), tracing_mode="fake")(x)
    calls = [(n.target, n.args[1:]) for n in gm.graph.nodes if n.op == "call_function"]
    assert calls == [(torch.ops.vllm_ir_aiter.activation.default, ("gelu_tanh_and_mul",))]
    assert aiter_double.CALLS == []


@pytest.mark.parametrize(
    ("x", "gated", "reason"),
    [
        (torch.randn(4, 64, dtype=torch.float64), True, "float32/float16/bfloat16, not torch.float64"),
        (torch.tensor(1.0), False, "x is 0-d"),
        (torch.randn(4, 0), False, "last dimension is 0"),
        (torch.randn(4, 7), True, "last dimension 7 is odd"),
        (torch.randn(4, 96)[:, :64], True, "x must be contiguous"),
        (torch.randn(4, 96)[:, :64], False, "x must be contiguous"),
    ],
)
def test_xpu_activation_declines_with_reason(xpu_act, x, gated, reason):
    verdict = xpu_act.rules(x, gated)
    assert not verdict and reason in verdict.reason


def test_xpu_activation_predicates_decline_cpu_and_unknown_approximation(xpu_act):
    x = torch.randn(4, 64, dtype=BF16)
    assert xpu_act.rules(torch.randn(2, 3, 7, dtype=F16), gated=False) is True
    assert supports("relu2", "xpu_kernels", x).reason == "tensors are on cpu; vllm-xpu-kernels runs on XPU"
    assert "approximate='erf'" in supports("gelu_and_mul", "xpu_kernels", x, "erf").reason


XPU_CASES = [
    ("silu_and_mul", {}, "silu_and_mul"),
    ("mul_and_silu", {}, "mul_and_silu"),
    ("gelu_and_mul", {}, "gelu_and_mul"),
    ("gelu_and_mul", {"approximate": "tanh"}, "gelu_tanh_and_mul"),
    ("fatrelu_and_mul", {"threshold": 0.5}, "fatrelu_and_mul"),
    ("swigluoai_and_mul", {}, "swigluoai_and_mul"),
    ("swigluoai_and_mul", {"alpha": 1.0, "limit": 3.0}, "swigluoai_and_mul"),
    ("gelu_new", {}, "gelu_new"),
    ("gelu_fast", {}, "gelu_fast"),
    ("quick_gelu", {}, "gelu_quick"),
    ("relu2", {}, "relu2"),
]


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize(("op_name", "options", "function"), XPU_CASES)
def test_xpu_activation_calls_the_vendor_function(xpu_double, op_name, options, function, dtype):
    op = vllm_ir.ops.__getattr__(op_name)
    args = op.generate_inputs((3, 64), dtype, **options)
    out = op.impls["xpu_kernels"].fn(*args)
    (call,) = xpu_double.CALLS
    assert call["fn"] == function and call["input"] is args[0] and call["out"] is out
    for name in ("alpha", "limit", "threshold"):
        if name in options:
            assert call[name] == options[name]
    atol, rtol = op.tolerance(dtype)
    torch.testing.assert_close(out, op.fn(*args), atol=atol, rtol=rtol)


def test_xpu_fatrelu_passes_the_threshold_as_pytorch_on_xpu_rounds_it(xpu_double, xpu_act):
    gate = torch.tensor([[0.10009765625, 0.5, -1.0, 0.099609375]], dtype=BF16)  # [0] is bf16(0.1)
    out = vllm_ir.ops.fatrelu_and_mul.impls["xpu_kernels"].fn(torch.cat([gate, torch.ones_like(gate)], -1), 0.1)
    assert xpu_double.CALLS[0]["threshold"] == 0.10009765625  # bf16(0.1): what F.threshold compares on XPU
    assert out.tolist() == [[0.0, 0.5, 0.0, 0.0]]
    assert xpu_act.as_dtype(0.1, torch.float32) == torch.tensor(0.1).item()
    assert xpu_act.as_dtype(1e6, F16) == float("inf") and xpu_act.as_dtype(-1e300, torch.float32) == -float("inf")


def test_xpu_activation_hides_the_vendor_mutation_marks_from_compiled_graphs(xpu_double):
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(4, 64)
    gm = make_fx(lambda x: vllm_ir.ops.fatrelu_and_mul.impls["xpu_kernels"].fn(x, 0.5), tracing_mode="fake")(x)
    calls = [(n.target, n.args[1:]) for n in gm.graph.nodes if n.op == "call_function"]
    assert calls == [(torch.ops.vllm_ir_xpu_kernels.activation.default, ("fatrelu_and_mul", [0.5]))]
    assert torch.ops._C.fatrelu_and_mul.default._schema.arguments[1].alias_info.is_write  # the vendor's mark
    assert xpu_double.CALLS == []


def test_xpu_activation_copies_misaligned_views_and_skips_empty_calls(xpu_double):
    impl = vllm_ir.ops.mul_and_silu.impls["xpu_kernels"]
    x = torch.randn(3 * 16 + 2)[2:].view(3, 16)
    assert x.data_ptr() % 16 != 0
    out = impl.fn(x)
    assert xpu_double.CALLS[0]["input"].data_ptr() % 16 == 0
    torch.testing.assert_close(out, vllm_ir.ops.mul_and_silu.fn(x))
    assert impl.fn(torch.randn(0, 16)).shape == (0, 8) and len(xpu_double.CALLS) == 1


def test_xpu_activation_uses_old_names_and_declines_missing_functions(xpu_double, xpu_act, monkeypatch):
    from types import SimpleNamespace

    old_release = SimpleNamespace(relu2_no_mul=torch.ops._C.relu2, silu_and_mul=torch.ops._C.silu_and_mul)
    monkeypatch.setattr(xpu_act, "_vendor_ops", lambda: old_release)
    monkeypatch.setattr(xpu_act, "_on_xpu", lambda x: True)  # stand in for an XPU tensor
    x = torch.randn(2, 16)
    assert xpu_act.vendor_name("relu2") == "relu2_no_mul"
    assert supports("relu2", "xpu_kernels", x) is True
    verdict = supports("swigluoai_and_mul", "xpu_kernels", x)
    assert verdict.reason == "the installed vllm-xpu-kernels has no swigluoai_and_mul: upgrade it"
    torch.testing.assert_close(vllm_ir.ops.relu2.impls["xpu_kernels"].fn(x), vllm_ir.ops.relu2.fn(x))


# -- FP8 quantization and rotary embedding -----------------------------------------------------------

E4M3, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


@pytest.fixture
def aiter_quant(providers):
    return sys.modules["vllm_ir_provider_aiter.quant"]


@pytest.fixture
def xpu_quant(providers):
    return sys.modules["vllm_ir_provider_xpu_kernels.quant"]


@pytest.fixture
def xpu_rotary(providers):
    return sys.modules["vllm_ir_provider_xpu_kernels.rotary"]


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        ((torch.randn(4, 64, dtype=BF16), torch.ones(1), FNUZ, None), "AITER clamps e4m3fnuz to its dtype max 240"),
        ((torch.randn(4, 64), torch.ones(1), E4M3, None), "float16/bfloat16, not torch.float32"),
        ((torch.randn(4, 12, dtype=BF16), torch.ones(1), E4M3, None), "multiple of 8"),
        ((torch.randn(4, 96, dtype=BF16)[:, :64], torch.ones(1), E4M3, None), "x must be contiguous"),
        ((torch.randn(4, 64, dtype=BF16), torch.ones(4, 1), E4M3, None), "one per-tensor scale"),
        ((torch.randn(4, 64, dtype=BF16), torch.ones(64), E4M3, None), "one per-tensor scale"),
        ((torch.randn(4, 64, dtype=BF16), torch.ones(1).double(), E4M3, None), "scale must be float32"),
        ((torch.randn(2, 4, 64, dtype=BF16), torch.ones(1), E4M3, 8), "num_token_padding with a 3-D x"),
    ],
)
def test_aiter_static_quant_declines_with_reason(aiter_quant, on_device, args, reason):
    verdict = supports("static_quant_fp8", "aiter", *args)
    assert not verdict and reason in verdict.reason


def test_aiter_static_quant_accepts_and_declines_cpu_and_other_gpu_fp8(aiter_double, aiter_quant, monkeypatch):
    x = torch.randn(2, 3, 64, dtype=F16)
    assert (
        supports("static_quant_fp8", "aiter", x, torch.ones(1), E4M3).reason
        == "tensors are on cpu; AITER runs on ROCm GPUs"
    )
    monkeypatch.setattr(aiter_quant, "_on_gpu", lambda x: True)  # stand in for a ROCm tensor
    aiter_quant.ops.fp8_dtype.cache_clear()
    assert supports("static_quant_fp8", "aiter", x, torch.ones(1), E4M3) is True
    assert supports("static_quant_fp8", "aiter", x, torch.tensor(0.5), E4M3) is True  # 0-d scale
    monkeypatch.setattr(aiter_double.dtypes, "fp8", FNUZ)  # a gfx942
    aiter_quant.ops.fp8_dtype.cache_clear()
    verdict = supports("static_quant_fp8", "aiter", x, torch.ones(1), E4M3)
    assert verdict.reason == "AITER on this GPU quantizes to torch.float8_e4m3fnuz, not torch.float8_e4m3fn"
    aiter_quant.ops.fp8_dtype.cache_clear()
    assert set(vllm_ir.ops_implemented_by("aiter")) >= {"static_quant_fp8"}
    assert "dynamic_quant_fp8" not in vllm_ir.ops_implemented_by("aiter")  # no floor, scale_ub ignored


@pytest.mark.parametrize("padding", [None, 8])
def test_aiter_static_quant_calls_the_vendor_with_a_fresh_out(aiter_double, padding):
    op = vllm_ir.ops.static_quant_fp8
    x, scale, _, _ = op.generate_inputs((5, 64), BF16)
    q = op.impls["aiter"].fn(x, scale, E4M3, padding)
    (call,) = aiter_double.CALLS
    assert call["fn"] == "static_per_tensor_quant" and call["input"] is x
    assert call["out"].data_ptr() == q.data_ptr() and call["out"].shape == (5, 64)  # the first rows of q
    assert call["scale"].data_ptr() == scale.data_ptr() and call["scale"].shape == (1,)
    assert q.shape == ((8, 64) if padding else (5, 64))
    assert _same_bytes(q[:5], op.fn(x, scale, E4M3))  # exact reciprocal in the stand-in: native's bytes


@pytest.mark.parametrize("shape", [[4, 64], [5, 32], [5, 64, 1]])
def test_aiter_static_quant_custom_op_refuses_a_q_shape_that_cannot_hold_x(aiter_double, shape):
    from vllm_ir_provider_aiter import ops as aiter_ops

    x = torch.randn(5, 64, dtype=BF16)
    with pytest.raises(ValueError, match=r"q of shape .* cannot hold x \[5, 64\]"):
        aiter_ops.static_quant_fp8(x, torch.ones(1), E4M3, shape)
    assert aiter_double.CALLS == []


def test_aiter_static_quant_is_one_opaque_node_and_raises_on_other_scales(aiter_double):
    from torch.fx.experimental.proxy_tensor import make_fx

    impl = vllm_ir.ops.static_quant_fp8.impls["aiter"]
    x, s = torch.randn(4, 64, dtype=BF16), torch.ones(1)
    gm = make_fx(lambda x, s: impl.fn(x, s, E4M3), tracing_mode="fake")(x, s)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.vllm_ir_aiter.static_quant_fp8.default] and aiter_double.CALLS == []
    with pytest.raises(ValueError, match=r"static_quant_fp8 \(provider aiter\): AITER takes one per-tensor scale"):
        impl.fn(x, torch.ones(4, 1), E4M3)


@pytest.mark.parametrize(
    ("op_name", "args", "reason"),
    [
        ("static_quant_fp8", (torch.randn(4, 8), torch.ones(1), FNUZ, None), "quantizes to float8_e4m3fn"),
        ("static_quant_fp8", (torch.randn(4, 8).double(), torch.ones(1), E4M3, None), "not torch.float64"),
        ("static_quant_fp8", (torch.randn(8), torch.ones(1), E4M3, None), "x is 1-D"),
        ("static_quant_fp8", (torch.randn(4, 0), torch.ones(1), E4M3, None), "last dimension is 0"),
        ("static_quant_fp8", (torch.randn(8, 4).t(), torch.ones(1), E4M3, None), "rows have no single stride"),
        ("static_quant_fp8", (torch.randn(2, 4, 8), torch.ones(2, 4, 1), E4M3, None), "scale is 3-D"),
        ("static_quant_fp8", (torch.randn(2, 4, 8), torch.ones(2, 1), E4M3, None), "a 2-D scale with a 3-D x"),
        ("dynamic_quant_fp8", (torch.randn(4, 8), False, E4M3, torch.ones(1), None), "scale_ub with per-tensor scales"),
        ("dynamic_quant_fp8", (torch.randn(4, 16)[:, :8], True, E4M3, None, None), "x must be contiguous"),
        ("dynamic_quant_fp8", (torch.randn(4, 8), True, E4M3, torch.ones(2), None), "scale_ub must be one float32"),
        ("dynamic_group_quant_fp8", (torch.randn(4, 40), 16, False, False, E4M3), "not a multiple of group_size 16"),
        ("dynamic_group_quant_fp8", (torch.randn(4, 64)[:, :32], 16, False, False, E4M3), "x must be contiguous"),
        ("dynamic_group_quant_fp8", (torch.randn(2, 4, 32), 16, True, False, E4M3), "column_major scales of a 3-D x"),
    ],
)
def test_xpu_quant_declines_with_reason(xpu_quant, on_device, op_name, args, reason):
    verdict = supports(op_name, "xpu_kernels", *args)
    assert not verdict and reason in verdict.reason


def test_xpu_quant_predicates_decline_cpu_and_old_static_without_group_shape(xpu_double, xpu_quant, monkeypatch):
    x = torch.randn(4, 64)
    assert (
        supports("dynamic_quant_fp8", "xpu_kernels", x, True, E4M3).reason
        == "tensors are on cpu; vllm-xpu-kernels runs on XPU"
    )
    monkeypatch.setattr(xpu_quant, "_on_xpu", lambda x: True)  # stand in for an XPU tensor
    assert supports("static_quant_fp8", "xpu_kernels", x, torch.ones(1, 64), E4M3) is True
    assert "ambiguous: native refuses it" in supports("static_quant_fp8", "xpu_kernels", x, torch.ones(64), E4M3).reason
    monkeypatch.setattr(xpu_quant, "_has_group_shape", lambda: False)  # a release before group_shape
    assert supports("static_quant_fp8", "xpu_kernels", x, torch.ones(1), E4M3) is True  # one scale needs no group_shape
    verdict = supports("static_quant_fp8", "xpu_kernels", x, torch.ones(1, 64), E4M3)
    assert "has no group_shape (one scale only): upgrade it" in verdict.reason


STATIC_CASES = [
    ("per_tensor", {}, None),
    ("per_token", {"granularity": "token"}, None),
    ("per_channel", {"granularity": "channel"}, None),
    ("group_2x32", {"granularity": "group", "group": (2, 32)}, None),
    ("padded", {"num_token_padding": 8}, None),
]


@pytest.mark.parametrize(("name", "options", "group_shape"), STATIC_CASES, ids=[c[0] for c in STATIC_CASES])
def test_xpu_static_quant_maps_scale_layouts(xpu_double, name, options, group_shape):
    op = vllm_ir.ops.static_quant_fp8
    x, scale, fp8, pad = op.generate_inputs((4, 64), BF16, **options)
    q = op.impls["xpu_kernels"].fn(x, scale, fp8, pad)
    (call,) = xpu_double.CALLS
    assert call["input"] is x and call["scale"] is scale and call["group_shape"] == group_shape
    assert call["out"].data_ptr() == q.data_ptr() and call["out"].shape == (4, 64)
    assert _same_bytes(q[:4], op.fn(x, scale, fp8)[:4])


@pytest.mark.parametrize("per_token", [True, False])
def test_xpu_dynamic_quant_calls_per_token_or_per_tensor(xpu_double, per_token):
    op = vllm_ir.ops.dynamic_quant_fp8
    ub = torch.tensor([2.0]) if per_token else None
    x = op.generate_inputs((2, 3, 32), F16)[0]
    q, scale = op.impls["xpu_kernels"].fn(x, per_token, E4M3, ub)
    (call,) = xpu_double.CALLS
    assert call["fn"] == ("dynamic_per_token_scaled_fp8_quant" if per_token else "dynamic_scaled_fp8_quant")
    assert call["input"] is x and call["out"] is q and call["scale"] is scale
    if per_token:
        assert call["scale_ub"] is ub
    q_ref, scale_ref = op.fn(x, per_token, E4M3, ub)
    assert scale.shape == scale_ref.shape and torch.equal(scale, scale_ref)
    assert _same_bytes(q, q_ref)


def test_xpu_per_tensor_scale_has_no_floor_and_empty_input_skips_the_call(xpu_double):
    impl = vllm_ir.ops.dynamic_quant_fp8.impls["xpu_kernels"]
    q, scale = impl.fn(torch.zeros(2, 8), False, E4M3)
    assert scale.item() == 0.0 and (q.float() * scale).abs().max() == 0  # dequantizes to x (q is +448)
    q, scale = impl.fn(torch.zeros(0, 8), False, E4M3)
    native = vllm_ir.ops.dynamic_quant_fp8.fn(torch.zeros(0, 8), False, E4M3)[1]
    assert torch.equal(scale, native) and len(xpu_double.CALLS) == 1  # the op's scale (the floor), no launch


@pytest.mark.parametrize(
    ("shape", "column_major", "ue8m0"), [((4, 64), False, False), ((4, 64), True, True), ((2, 3, 32), False, True)]
)
def test_xpu_group_quant_passes_2d_scales_in_the_ops_layout(xpu_double, shape, column_major, ue8m0):
    op = vllm_ir.ops.dynamic_group_quant_fp8
    x = op.generate_inputs(shape, BF16)[0]
    q, scales = op.impls["xpu_kernels"].fn(x, 16, column_major, ue8m0, E4M3)
    (call,) = xpu_double.CALLS
    assert call["input"] is x and call["out"] is q and call["group_size"] == 16 and call["scale_ue8m0"] == ue8m0
    assert call["scale"].dim() == 2 and call["scale"].data_ptr() == scales.data_ptr()
    assert (call["eps"], call["fp8_min"], call["fp8_max"]) == (1e-10, -448.0, 448.0)
    q_ref, scales_ref = op.fn(x, 16, column_major, ue8m0, E4M3)
    assert scales.shape == scales_ref.shape and scales.stride() == scales_ref.stride()
    assert torch.equal(scales, scales_ref) and _same_bytes(q, q_ref)


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (lambda p, q, k, c: (p, q.double(), k.double(), 64, c.double(), None), "dtype torch.float64 is not supported"),
        (lambda p, q, k, c: (p.int(), q, k, 64, c, None), "positions are torch.int32"),
        (lambda p, q, k, c: (p, q, k, 64, c.half(), None), "cos_sin_cache is torch.float16"),
        (lambda p, q, k, c: (p, q, k, 64, c.t().contiguous().t(), None), "contiguous [max_position, rotary_dim]"),
        (lambda p, q, k, c: (p, q, k, 64, c, 32), "is not [max_position, rotary_dim=32]"),
        (lambda p, q, k, c: (p, q.view(4, 2, 64)[:, :, ::2], None, 32, c[:, :32].contiguous(), None), "stride 2"),
        (lambda p, q, k, c: (p, q.view(4, 2, 64)[:, :, :32], None, 64, c, None), "unit channel"),
        (lambda p, q, k, c: (p, q, torch.randn(4, 2, 96)[..., :64], 64, c, None), "key's head stride 96"),
    ],
)
def test_xpu_rotary_declines_with_reason(on_device, args, reason):
    p, q, k = torch.randint(0, 8, (4,)), torch.randn(4, 128), torch.randn(4, 128)
    c = torch.randn(8, 64)
    positions, query, key, head_size, cache, rotary_dim = args(p, q, k, c)
    verdict = supports("rotary_embedding", "xpu_kernels", positions, query, key, head_size, cache, True, rotary_dim)
    assert not verdict and reason in verdict.reason


ROTARY_VARIANTS = ["default", "gptj", "partial", "no_key", "sliced", "qkv_slices", "gqa", "heads_3d"]


@pytest.mark.parametrize("variant", ROTARY_VARIANTS)
def test_xpu_rotary_rotates_in_place_through_views(xpu_double, variant):
    op = vllm_ir.ops.rotary_embedding
    options = {} if variant == "default" else op.input_variants[variant]
    args = op.generate_inputs((2, 3, 128), BF16, **options)
    query, key = args[1:3]
    expected = op.fn(*args)
    q_ptr, k_ptr = query.data_ptr(), None if key is None else key.data_ptr()
    out_q, out_k = op.impls["xpu_kernels"].fn(*args)
    (call,) = xpu_double.CALLS
    assert out_q is query and out_k is key  # in place, the donated buffers returned
    assert call["positions"].dim() == 1 and call["query"].data_ptr() == q_ptr and call["query"].dim() == 3
    assert (call["key"] is None) if key is None else call["key"].data_ptr() == k_ptr
    assert call["cache"] is args[4] and call["is_neox"] == args[5] and call["head_size"] == args[3]
    atol, rtol = op.tolerance(BF16)
    torch.testing.assert_close(out_q, expected[0], atol=atol, rtol=rtol)
    if key is not None:
        torch.testing.assert_close(out_k, expected[1], atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    ("query_shape", "positions_shape", "message"),
    [
        ((5, 128), (4,), r"query of shape \[5, 128\] is not \[4 tokens"),  # not a whole number of heads
        ((8, 128), (4,), r"query has 8 token rows, positions 4"),  # whole heads, but other rows than positions
    ],
)
def test_xpu_rotary_refuses_token_counts_unlike_positions(xpu_double, query_shape, positions_shape, message):
    op = vllm_ir.ops.rotary_embedding
    positions, query = torch.randint(0, 8, positions_shape), torch.randn(query_shape, dtype=BF16)
    cache = build_cos_sin_cache(8, 64, BF16)
    with pytest.raises(ValueError, match=message):
        op.impls["xpu_kernels"].fn(positions, query, None, 64, cache, True, None)
    assert not xpu_double.CALLS  # nothing reached the kernel


def test_xpu_rotary_functional_call_leaves_inputs_and_predicate_declines_cpu(xpu_double, xpu_rotary):
    op = vllm_ir.ops.rotary_embedding
    args = op.generate_inputs((4, 128), F16)
    assert (
        supports("rotary_embedding", "xpu_kernels", *args).reason == "tensors are on cpu; vllm-xpu-kernels runs on XPU"
    )
    assert op.impls["xpu_kernels"].inplace
    with pytest.raises(ValueError, match=r"rotary_embedding \(provider xpu_kernels\): query is not"):
        op.impls["xpu_kernels"].fn(args[0], args[1][:, ::2], None, 32, args[4][:, :32].contiguous(), True)
