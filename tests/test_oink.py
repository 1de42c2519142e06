"""providers/oink: installs and loads here as "unsupported here" with its reason; decline rules; argument mapping.

Oink needs an SM100+ NVIDIA GPU, so argument mapping is checked against the recording test
double in tests/vendor_doubles/oink_double (put on sys.path only inside these tests; not Oink).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

import vllm_ir
from tests.python_child import run_python
from tests.test_cli import run

DOUBLE = Path(__file__).parent / "vendor_doubles" / "oink_double"


def _load_wrapper():
    """Loaded at collection, so every test's registry snapshot (tests/conftest.py) holds it."""
    if importlib.util.find_spec("vllm_ir_provider_oink") is None:
        return None
    vllm_ir.load_provider("oink")
    import vllm_ir_provider_oink

    return vllm_ir_provider_oink


_WRAPPER = _load_wrapper()


@pytest.fixture
def oink():
    if _WRAPPER is None:
        pytest.fail("providers/oink is not installed (scripts/setup.sh installs every provider)")
    return _WRAPPER


def test_loads_as_unsupported_here_with_its_reason(tmp_path):
    result = run(tmp_path, "providers", "list", "--json")
    record = {r["name"]: r for r in json.loads(result.stdout)["providers"]}["oink"]
    assert record["distribution"] == "vllm-ir-provider-oink"
    assert record["status"] == "unsupported here"
    if torch.version.cuda is None:
        assert record["reason"] == "torch is a CPU build; Oink needs CUDA on an SM100+ (Blackwell) GPU"
    assert record["implementations"] == {"oink": ["fused_add_rms_norm", "rms_norm"]}
    doctor = json.loads(run(tmp_path, "doctor", "--json").stdout)
    assert "oink" not in {p["provider"] for p in doctor["problems"]}
    assert "oink" in {n["provider"] for n in doctor["not_for_this_machine"]}


def test_discovery_never_imports_oink_even_where_it_is_importable():
    code = "import sys, vllm_ir; vllm_ir.provider_records(); print([m for m in sys.modules if 'kernelagent' in m])"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_IR_")}
    # The double is importable, as Oink would be on a Blackwell machine.
    environ["PYTHONPATH"] = os.pathsep.join([str(DOUBLE), os.environ.get("PYTHONPATH", "")])
    result = run_python(["-c", code], env=environ)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_no_default_priority_anywhere(oink):
    for mode in ("eager", "compile"):
        assert "oink" not in [e.provider for e in vllm_ir.ops.rms_norm.get_priority(mode)]


# -- decline rules and accept cases (metadata only, real CPU tensors) --------------------------

BF16 = torch.bfloat16


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: (torch.randn(4, 64, dtype=BF16), torch.ones(64, dtype=BF16), 8), "variance_size is not supported"),
        (lambda: (torch.randn(4, 64, dtype=torch.float64), None, None), "float16/bfloat16/float32, not torch.float64"),
        (lambda: (torch.randn(4, 64, dtype=BF16), torch.ones(64), None), "weight dtype torch.float32 must match"),
        (lambda: (torch.randn(4, 64, dtype=BF16), torch.ones(1, 64, dtype=BF16), None), "contiguous 1-D [hidden]"),
        (lambda: (torch.randn(64, dtype=BF16), torch.ones(64, dtype=BF16), None), "a 1-D input has no rows"),
        (  # a per-head view of a fused QKV projection: [tokens, heads, head_dim] sliced out of [tokens, 3*...]
            lambda: (
                torch.randn(4, 3 * 8 * 16, dtype=BF16).view(4, 3 * 8, 16)[:, 8:16],
                torch.ones(16, dtype=BF16),
                None,
            ),
            "cannot be viewed as [rows, hidden] without a copy",
        ),
        (
            lambda: (torch.randn(64, 4, dtype=BF16).t(), torch.ones(64, dtype=BF16), None),
            "must be contiguous (stride 1)",
        ),
        (
            lambda: (torch.randn(4, 7, dtype=BF16), torch.ones(7, dtype=BF16), None),
            "row stride 7 is not a multiple of 16",
        ),
        (lambda: (torch.randn(4, 12), torch.ones(12), None), "row stride 12 is not a multiple of 8 elements"),
    ],
)
def test_declines_with_reason(oink, make, reason):
    x, w, vs = make()
    verdict = oink.rules(x, w, vs)
    assert not verdict and reason in verdict.reason, verdict


@pytest.mark.parametrize(
    "make",
    [
        lambda: (torch.randn(4, 64, dtype=BF16), torch.ones(64, dtype=BF16)),
        lambda: (torch.randn(4, 64, dtype=torch.float16), None),
        lambda: (torch.randn(4, 4096), torch.ones(4096)),
        lambda: (torch.randn(2, 3, 64, dtype=BF16), torch.ones(64, dtype=BF16)),  # contiguous 3-D
        lambda: (torch.randn(4, 96, dtype=BF16)[:, :64], torch.ones(64, dtype=BF16)),  # padded rows (MLA-style)
    ],
)
def test_accepts(oink, make):
    x, w = make()
    assert oink.rules(x, w, None) is True


def test_predicates_decline_cpu_tensors_and_fused_add_wants_matching_contiguous_buffers(oink):
    fused_supports = vllm_ir.ops.fused_add_rms_norm.impls["oink"].supports_args  # called with the op's arguments
    x, w = torch.randn(4, 64, dtype=BF16), torch.ones(64, dtype=BF16)
    assert (
        vllm_ir.ops.rms_norm.impls["oink"].supports_args(x, w, 1e-6).reason
        == "tensors are on cpu; Oink runs on CUDA GPUs"
    )
    r = torch.randn(4, 64, dtype=BF16)
    assert fused_supports(x, r, w, 1e-6).reason == "tensors are on cpu; Oink runs on CUDA GPUs"
    assert "residual must have x's shape and dtype" in fused_supports(x, r[:1], w, 1e-6).reason
    padded = torch.randn(4, 96, dtype=BF16)[:, :64]
    assert "must be contiguous" in fused_supports(x, padded, w, 1e-6).reason


def test_dispatch_never_picks_it_here_and_explain_says_why(oink):
    x, w, eps, _ = vllm_ir.ops.rms_norm.generate_inputs((4, 64), BF16)
    with vllm_ir.priority(rms_norm=["oink"]):
        verdicts = {v.provider: v for v in vllm_ir.ops.rms_norm.explain(x, w, eps).verdicts}
        assert vllm_ir.ops.rms_norm.dispatch(x, w, eps).provider != "oink"
    assert verdicts["oink"].status == "unsupported"
    assert verdicts["oink"].reason == oink.SUPPORTED.reason


# -- argument mapping against the recording double ---------------------------------------------


@pytest.fixture
def oink_double(oink, monkeypatch):
    monkeypatch.syspath_prepend(str(DOUBLE))
    double = importlib.import_module("kernelagent_oink")
    assert double.IS_TEST_DOUBLE
    importlib.import_module("kernelagent_oink.blackwell.oink_custom_ops")  # torch.ops.oink.*, once per process
    oink._vendor_ops.cache_clear()
    double.CALLS.clear()
    yield double.CALLS
    oink._vendor_ops.cache_clear()


def test_rms_norm_passes_a_2d_view_weight_and_epsilon(oink, oink_double):
    op = vllm_ir.ops.rms_norm
    x, w, eps, _ = op.generate_inputs((2, 3, 64), BF16)
    out = op.impls["oink"].fn(x, w, eps)
    (call,) = oink_double
    assert call["fn"] == "rmsnorm"
    assert call["x"].shape == (6, 64) and call["x"].data_ptr() == x.data_ptr()  # a view, no copy
    assert call["weight"] is w and call["eps"] == eps
    assert out.shape == x.shape
    torch.testing.assert_close(out, op.fn(x, w, eps), atol=1e-2, rtol=1.6e-2)


def test_rms_norm_keeps_padded_rows_and_passes_ones_without_weight(oink, oink_double):
    op = vllm_ir.ops.rms_norm
    x = torch.randn(4, 96, dtype=BF16)[:, :64]
    assert oink.rules(x, None, None) is True
    out = op.impls["oink"].fn(x, None, 1e-6)
    (call,) = oink_double
    assert call["x"].stride() == (96, 1) and call["x"].data_ptr() == x.data_ptr()
    assert torch.equal(call["weight"], torch.ones(64, dtype=BF16))
    torch.testing.assert_close(out, op.fn(x, None, 1e-6), atol=1e-2, rtol=1.6e-2)


def test_fused_add_is_in_place_on_2d_views_and_returns_the_donated_buffers(oink, oink_double):
    op = vllm_ir.ops.fused_add_rms_norm
    assert op.impls["oink"].inplace
    x, res, w, eps, _ = op.generate_inputs((2, 3, 64), BF16)
    expected = op.fn(x, res, w, eps)
    out, new_res = op.impls["oink"].fn(x, res, w, eps)
    (call,) = oink_double
    assert call["fn"] == "fused_add_rms_norm"
    assert call["x"].shape == (6, 64) and call["x"].data_ptr() == x.data_ptr()
    assert call["residual"].shape == (6, 64) and call["residual"].data_ptr() == res.data_ptr()
    assert call["weight"] is w and call["eps"] == eps
    assert out is x and new_res is res  # the outputs are the donated buffers
    torch.testing.assert_close(out, expected[0], atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(new_res, expected[1])


def test_empty_inputs_do_not_reach_the_vendor(oink, oink_double):
    x, w = torch.randn(0, 64, dtype=BF16), torch.ones(64, dtype=BF16)
    assert vllm_ir.ops.rms_norm.impls["oink"].fn(x, w, 1e-6).shape == (0, 64)
    vllm_ir.ops.fused_add_rms_norm.impls["oink"].fn(x, x.clone(), w, 1e-6)
    assert oink_double == []


def test_a_call_is_one_opaque_node_when_traced(oink, oink_double):
    from torch.fx.experimental.proxy_tensor import make_fx

    x, w, eps, _ = vllm_ir.ops.rms_norm.generate_inputs((4, 64), BF16)
    gm = make_fx(lambda x, w: vllm_ir.ops.rms_norm.impls["oink"].fn(x, w, eps), tracing_mode="fake")(x, w)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.oink.rmsnorm.default in targets
    assert not [t for t in targets if "rsqrt" in str(t) or "pow" in str(t)]  # the kernel stays opaque
    assert oink_double == []  # the fake ran, not the double's kernel
