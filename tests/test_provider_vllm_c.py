"""The vllm_c provider: C++ kernels against the native oracle, declines with reasons, tracing.

Importing ``vllm_ir_provider_vllm_c`` registers its implementations (as plugin discovery
would); that happens at collection, before conftest's per-test registry snapshot, so every
test sees them. Kernel tests are skipped, with the provider's own reason, when the extension
is not usable; the import-safety and CUDA compile checks run regardless.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import vllm_ir
from vllm_ir.ir.declarations.fused_quant import FUSED_QUANT_OPS
from vllm_ir.plugins import platforms

provider = pytest.importorskip(
    "vllm_ir_provider_vllm_c",
    reason="vllm-ir-provider-vllm-c is not installed (pip install --no-build-isolation -e providers/vllm_c)",
)
from vllm_ir_provider_vllm_c import _extension  # noqa: E402

needs_kernels = pytest.mark.skipif(
    not provider.STATUS.loaded, reason=f"vllm_c kernels not usable: {provider.STATUS.reason}"
)

RMS = vllm_ir.ops.rms_norm
FUSED = vllm_ir.ops.fused_add_rms_norm
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SOURCES = Path(__file__).resolve().parents[1] / "providers" / "vllm_c" / "csrc"


def _close(actual, expected, dtype):
    atol, rtol = RMS.tolerance(dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def _verdict(op, args, provider_name="vllm_c"):
    with vllm_ir.priority(**{op.name: [provider_name]}):
        return next(v for v in op.explain(*args).verdicts if v.provider == provider_name)


# ---------------------------------------------------------------------------------------
# registration and import safety (no kernels needed)


def test_impls_are_registered_and_survive_the_registry_snapshot():
    assert "vllm_c" in RMS.impls and "vllm_c" in FUSED.impls
    rms, fused = RMS.impls["vllm_c"], FUSED.impls["vllm_c"]
    assert not rms.inplace and rms.inplace_fn is None
    # Both forms of the fused op under one name: the functional kernel, and the in-place one.
    assert not fused.inplace and fused.inplace_fn is not None and fused.has_inplace_kernel
    assert "vllm_ir_provider_vllm_c.layernorm" in [f.__name__ for f in provider.FAMILIES]
    # Batch-invariant only where no CUDA kernels are built (their reduction order varies).
    cuda_built = provider.STATUS.cuda_kernels and torch.version.hip is None
    assert RMS.impls["vllm_c"].batch_invariant == FUSED.impls["vllm_c"].batch_invariant == (not cuda_built)


def test_default_priority_puts_vllm_c_first_in_eager_mode_only():
    contribution = provider.vllm_ir_default_priority(platforms.CPU, "eager")
    activations = ["silu_and_mul", "mul_and_silu", "gelu_and_mul", "fatrelu_and_mul", "swigluoai_and_mul"]
    activations += ["gelu_new", "gelu_fast", "quick_gelu", "relu2"]
    activations.append("gelu_and_mul_sparse")
    quant = ("static_quant_fp8", "dynamic_quant_fp8", "dynamic_group_quant_fp8")
    fused_quant = [op.name for op in FUSED_QUANT_OPS]
    assert contribution == {
        "rms_norm": ["vllm_c"],
        "fused_add_rms_norm": ["vllm_c"],
        **{a: ["vllm_c"] for a in activations},
        **{op: ["vllm_c"] for op in quant},
        **{op: ["vllm_c"] for op in fused_quant},
        "rotary_embedding": ["vllm_c"],
    }
    # The core's CUDA and ROCm platforms name no provider: vllm_c states its place itself,
    # for the ops whose kernels it has measured there (CUDA: every family, on an H200), not on
    # ROCm (no HIP kernels). On CUDA, not the ops with a row statistic or fused quant (no H200 figure).
    cpu_only = {"gelu_and_mul_sparse", *fused_quant}
    cuda = {op: p for op, p in contribution.items() if op not in cpu_only}
    assert provider.vllm_ir_default_priority(platforms.CUDA, "eager") == cuda
    assert provider.vllm_ir_default_priority(platforms.ROCM, "eager") is None
    # Compiled, Inductor fuses native norms with their neighbours (benchmarks/compile_pipeline.py).
    for platform in (platforms.CPU, platforms.CUDA, platforms.ROCM):
        assert provider.vllm_ir_default_priority(platform, "compile") is None
    assert provider.vllm_ir_default_priority(platforms.XPU, "eager") is None


def test_build_record_problems_are_reasons():
    class Info:
        TORCH_VERSION = torch.__version__
        BUILD_ERROR = None
        CUDA_KERNELS = False

    assert _extension.check_build(Info, torch.__version__) is None
    assert "not built" in _extension.check_build(None, torch.__version__)
    stale = _extension.check_build(Info, "0.0.1")
    assert f"built against torch {torch.__version__}" in stale and "torch 0.0.1 is running" in stale
    Info.BUILD_ERROR = "CompileError: gcc failed"
    assert "failed to build (CompileError: gcc failed)" in _extension.check_build(Info, torch.__version__)


def test_a_supports_tuple_asks_its_checks_in_order_and_returns_the_first_refusal():
    """The families register ``supports=(check, ...)``, each check reading only the parameters it
    names: the implementation's predicate takes the op's parameters and stops at the first
    refusal (here the fp8 dtype before x, x before the group size, that before column_major)."""
    supports = vllm_ir.ops.rms_norm_group_fp8_quant.impls["vllm_c"].supports_args
    e4m3, x = torch.float8_e4m3fn, torch.randn(4, 16)

    def reason(*args):
        return supports(*args).reason

    assert reason(x.to(torch.int32), None, None, 1e-6, 0, False, False, torch.float16).startswith("fp8_dtype")
    assert reason(x.to(torch.int32), None, None, 1e-6, 0, False, False, e4m3).startswith("dtype torch.int32")
    assert reason(x[0], None, None, 1e-6, 0, True, False, e4m3) == "group_size 0 < 1 (native raises)"
    assert reason(x[0], None, None, 1e-6, 16, True, False, e4m3) == "column_major scales of a 1-D x (native raises)"
    assert supports(x, x.clone(), torch.ones(16), 1e-6, 8, True, False, e4m3) is True


@pytest.mark.subprocess
def test_import_without_a_loadable_extension_registers_unsupported_impls():
    # A fresh interpreter where loading the compiled library fails like an ABI mismatch would.
    code = textwrap.dedent(
        """
        import sys, importlib.abc
        class Broken(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "vllm_ir_provider_vllm_c._C":
                    raise ImportError("undefined symbol: _ZN3c104impl3fooEv")
        sys.meta_path.insert(0, Broken())
        import vllm_ir, vllm_ir_provider_vllm_c as p
        assert not p.STATUS.loaded and p.cpu_capability() is None
        impl = vllm_ir.ops.rms_norm.impls["vllm_c"]
        assert not impl.is_supported
        print(impl.unsupported_reason)
        x, w, eps, _ = vllm_ir.ops.rms_norm.generate_inputs((2, 8), __import__("torch").float32)
        with vllm_ir.priority(rms_norm=["vllm_c"]):
            assert vllm_ir.ops.rms_norm.dispatch(x, w, eps).provider == "native"
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "failed to load: ImportError: undefined symbol" in done.stdout


# ---------------------------------------------------------------------------------------
# numerics against native


@needs_kernels
def test_bf16_rounds_before_and_after_the_weight_like_native():
    # Values where rounding once (fp32 norm * weight) and twice (native) differ.
    x, w, eps, _ = RMS.generate_inputs((64, 4096), torch.bfloat16, seed=3)
    with vllm_ir.priority(rms_norm=["vllm_c"]):
        out = RMS(x, w, eps)
    once = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * w.float()).bfloat16()
    native = RMS.fn(x, w, eps)
    assert not torch.equal(once, native)
    assert torch.equal(out, native)


def _native_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    same = got.view(torch.int16 if got.element_size() == 2 else torch.int32) == want.view(
        torch.int16 if want.element_size() == 2 else torch.int32
    )
    return bool((same | (got.isnan() & want.isnan())).all())


#: Row lengths around every boundary of ATen's summation order (norm_vec.h): fewer than 8
#: (scalars), a tail after whole 8-lane vectors, 1-3 vectors after whole groups of 32, and the
#: cascade's levels (16, 256, 4096 groups of 32 values).
ROW_LENGTHS = (1, 3, 4, 7, 8, 9, 31, 33, 64 + 8 * 3 + 5, 511, 512, 513, 4096, 8191, 8192 + 40, 4099 * 3)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norms_give_natives_bits_at_every_row_length_and_weight_dtype(dtype):
    """vLLM's native sums the squares with torch's CPU sum; the kernels add in its order (8-lane
    vectors, 4 partial sums, a 4-level cascade, the tail first), so every output is native's."""
    for hidden, weight_dtype in itertools.product(ROW_LENGTHS, (None, dtype, torch.float32)):
        g = torch.Generator().manual_seed(hidden)
        x = (4 * torch.randn(3, hidden, generator=g)).to(dtype)
        res = torch.randn(3, hidden, generator=g).to(dtype)
        w = None if weight_dtype is None else torch.randn(hidden, generator=g).to(weight_dtype)
        where = f"{dtype} hidden {hidden} weight {weight_dtype}"
        with vllm_ir.priority(rms_norm=["vllm_c"], fused_add_rms_norm=["vllm_c"]):
            assert RMS.dispatch(x, w, 1e-6).provider == "vllm_c", where
            assert _native_bits(RMS(x, w, 1e-6), RMS.fn(x, w, 1e-6)), where
            for got, want in zip(FUSED(x, res, w, 1e-6), FUSED.fn(x, res, w, 1e-6), strict=True):
                assert _native_bits(got, want), where


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_lone_long_row_is_summed_as_atens_two_pass_reduction_splits_it(threads):
    """A single row of >= 32768 values: ATen sums one chunk per thread, then the chunks' sums."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for hidden in (32767, 32768, 65537, 100003):
            x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(hidden)) * 3
            with vllm_ir.priority(rms_norm=["vllm_c"], fused_add_rms_norm=["vllm_c"]):
                assert torch.equal(RMS(x, None, 1e-6), RMS.fn(x, None, 1e-6)), (threads, hidden)
                for got, want in zip(FUSED(x, x, None, 1e-6), FUSED.fn(x, x, None, 1e-6), strict=True):
                    assert torch.equal(got, want), (threads, hidden)
    finally:
        torch.set_num_threads(before)


@needs_kernels
def test_bf16_denormal_and_nan_results_are_kept_like_native():
    # Hardware bf16 conversion (AVX512_BF16) flushes denormals; the kernels must not.
    x = torch.ones(4, 64, dtype=torch.bfloat16)
    x[0, 5] = 1e-39  # a denormal stays denormal after scaling by ~1
    x[1, 7] = float("nan")
    with vllm_ir.priority(rms_norm=["vllm_c"]):
        out = RMS(x, None, 1e-6)
    native = RMS.fn(x, None, 1e-6)
    assert out[0, 5] != 0 and out[0, 5] == native[0, 5]
    assert out[1].isnan().all() and native[1].isnan().all()
    _close(out[2:], native[2:], torch.bfloat16)


# ---------------------------------------------------------------------------------------
# layouts


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_strided_views_run_in_place_of_the_view(dtype):
    hidden = 72
    wide_x = torch.randn(6, 2 * hidden + 3).to(dtype)
    wide_res = torch.randn(6, hidden + 5).to(dtype)
    x, res = wide_x[:, 1 : hidden + 1], wide_res[:, :hidden]
    w = torch.rand(hidden).to(dtype) + 0.5
    assert not x.is_contiguous() and x.stride(-1) == 1
    expected_out, expected_res = FUSED.fn(x, res, w, 1e-6)
    before_x, before_res = wide_x.clone(), wide_res.clone()
    with vllm_ir.priority(rms_norm=["vllm_c"], fused_add_rms_norm=["vllm_c"]):
        assert RMS.dispatch(x, w, 1e-6).provider == "vllm_c"
        _close(RMS(x, w, 1e-6), RMS.fn(x, w, 1e-6), dtype)
        out, new_res = FUSED.maybe_inplace(x, res, w, 1e-6)
    assert out.data_ptr() == x.data_ptr() and new_res.data_ptr() == res.data_ptr()
    _close(out, expected_out, dtype)
    _close(new_res, expected_res, dtype)
    # Columns outside the views are untouched.
    torch.testing.assert_close(wide_x[:, 0], before_x[:, 0], atol=0, rtol=0)
    torch.testing.assert_close(wide_x[:, hidden + 1 :], before_x[:, hidden + 1 :], atol=0, rtol=0)
    torch.testing.assert_close(wide_res[:, hidden:], before_res[:, hidden:], atol=0, rtol=0)


@needs_kernels
def test_batch_dims_that_do_not_collapse():
    # Slicing the middle dimension leaves rows at irregular offsets.
    big = torch.randn(3, 10, 48)
    x = big[:, 2:7]
    w = torch.rand(48) + 0.5
    with vllm_ir.priority(rms_norm=["vllm_c"]):
        assert RMS.dispatch(x, w, 1e-5).provider == "vllm_c"
        _close(RMS(x, w, 1e-5), RMS.fn(x, w, 1e-5), torch.float32)


@needs_kernels
def test_strided_last_dimension_is_declined_with_a_reason():
    x = torch.randn(4, 64)[:, ::2]
    w = torch.rand(32) + 0.5
    verdict = _verdict(RMS, (x, w, 1e-6))
    assert verdict.status == "declined" and "stride 2 along the last dimension" in verdict.reason
    res = torch.randn(4, 64)[:, ::2]
    verdict = _verdict(FUSED, (x.contiguous(), res, w, 1e-6))
    assert verdict.status == "declined" and "x_residual has stride 2" in verdict.reason


@needs_kernels
def test_torch_ops_accept_any_layout():
    # Dispatch caches decisions by contiguity, not strides: the ops themselves must stay correct.
    x = torch.randn(4, 64)[:, ::2]
    res = torch.randn(32, 4).t()
    w = torch.rand(32) + 0.5
    out = torch.empty(32, 4).t()
    torch.ops.vllm_ir_c.rms_norm(out, x, w, 1e-6)
    _close(out, RMS.fn(x, w, 1e-6), torch.float32)
    expected = FUSED.fn(x, res, w, 1e-6)
    new_out, new_res = torch.empty(32, 4).t(), torch.empty(4, 64)[:, ::2]
    torch.ops.vllm_ir_c.fused_add_rms_norm_out(new_out, new_res, x, res, w, 1e-6)
    _close(new_out, expected[0], torch.float32)
    _close(new_res, expected[1], torch.float32)
    torch.ops.vllm_ir_c.fused_add_rms_norm(x, res, w, 1e-6)
    _close(x, expected[0], torch.float32)
    _close(res, expected[1], torch.float32)


# ---------------------------------------------------------------------------------------
# overload semantics


@needs_kernels
@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("variance_size", "variance_size is not supported"),
        ("weight_dtype", "weight dtype torch.float16 is neither x's (torch.bfloat16) nor float32"),
        ("float64", "dtype torch.float64 is not supported"),
        ("meta_device", "device meta is not supported (kernels built for: cpu"),
        ("weight_2d", "weight of shape [1, 16] for rows of 16"),
    ],
)
def test_rms_norm_declines_with_reason(case, reason):
    x, w, eps, _ = RMS.generate_inputs((3, 16), torch.bfloat16)
    args = {
        "variance_size": (x, w, eps, 8),
        "weight_dtype": (x, w.half(), eps, None),  # an fp32 weight is taken (vLLM's semantics)
        "float64": (x.double(), w.double(), eps, None),
        "meta_device": (x.to("meta"), w.to("meta"), eps, None),
        "weight_2d": (x, w[None], eps, None),
    }[case]
    verdict = _verdict(RMS, args)
    assert verdict.status == "declined" and reason in verdict.reason, verdict


@needs_kernels
def test_fused_declines_a_residual_of_another_dtype():
    x, res, w, eps, _ = FUSED.generate_inputs((3, 16), torch.bfloat16)
    verdict = _verdict(FUSED, (x, res.float(), w, eps))
    assert verdict.status == "declined" and "x_residual (torch.float32, [3, 16], cpu) differs from x" in verdict.reason


@needs_kernels
def test_kernels_reject_inconsistent_arguments():
    x = torch.randn(3, 16)
    with pytest.raises(RuntimeError, match=r"weight must have shape \[16\]"):
        torch.ops.vllm_ir_c.rms_norm(torch.empty_like(x), x, torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="residual has shape"):
        torch.ops.vllm_ir_c.fused_add_rms_norm(x, torch.randn(2, 16), None, 1e-6)
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        torch.ops.vllm_ir_c.rms_norm(torch.empty_like(x.double()), x.double(), None, 1e-6)
    res, out = torch.randn(3, 16), torch.empty(3, 16)
    with pytest.raises(RuntimeError, match="residual_out has shape"):
        torch.ops.vllm_ir_c.fused_add_rms_norm_out(out, torch.empty(3, 8), x, res, None, 1e-6)
    # The out-of-place op writes other tensors: outputs overlapping an input or each other are refused.
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        torch.ops.vllm_ir_c.fused_add_rms_norm_out(out, res, x, res, None, 1e-6)
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        torch.ops.vllm_ir_c.fused_add_rms_norm_out(out, out, x, res, None, 1e-6)


# ---------------------------------------------------------------------------------------
# both kernel forms of fused_add_rms_norm


def _run_profiled(fn):
    """fn's result and the names of the torch ops it ran (dispatcher-level, in order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn()
    return result, [e.name for e in prof.events()]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_functional_call_runs_the_out_of_place_kernel_without_clones(dtype):
    x, res, w, eps, _ = FUSED.generate_inputs((8, 200), dtype)
    x_before, res_before = x.clone(), res.clone()
    with vllm_ir.priority(fused_add_rms_norm=["vllm_c"]):
        assert FUSED.dispatch(x, res, w, eps).provider == "vllm_c"
        FUSED(x, res, w, eps)  # a first call fills the decision cache
        (out, new_res), ran = _run_profiled(lambda: FUSED(x, res, w, eps))
    assert ran.count("vllm_ir_c::fused_add_rms_norm_out") == 1, ran
    assert not {"aten::clone", "aten::copy_", "vllm_ir_c::fused_add_rms_norm"} & set(ran), ran
    assert torch.equal(x, x_before) and torch.equal(res, res_before)
    assert len({t.data_ptr() for t in (x, res, out, new_res)}) == 4
    want_out, want_res = FUSED.fn(x, res, w, eps)
    _close(out, want_out, dtype)
    _close(new_res, want_res, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_maybe_inplace_runs_the_in_place_kernel_on_the_donated_buffers(dtype):
    x, res, w, eps, _ = FUSED.generate_inputs((8, 200), dtype)
    want_out, want_res = FUSED.fn(x, res, w, eps)
    with vllm_ir.priority(fused_add_rms_norm=["vllm_c"]):
        FUSED.maybe_inplace(x.clone(), res.clone(), w, eps)  # a first call fills the decision cache
        (out, new_res), ran = _run_profiled(lambda: FUSED.maybe_inplace(x, res, w, eps))
    assert ran.count("vllm_ir_c::fused_add_rms_norm") == 1, ran
    assert not {"aten::clone", "aten::copy_", "aten::empty_like", "vllm_ir_c::fused_add_rms_norm_out"} & set(ran), ran
    assert out.data_ptr() == x.data_ptr() and new_res.data_ptr() == res.data_ptr()
    _close(out, want_out, dtype)
    _close(new_res, want_res, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [1, 7, 64, 4099])
def test_out_of_place_and_in_place_kernels_agree_bit_for_bit(dtype, hidden):
    """One row function serves both ops: same sums, same roundings, whatever the tail."""
    for with_weight in (True, False):
        x, res, w, eps, _ = FUSED.generate_inputs((5, hidden), dtype, with_weight=with_weight)
        out, new_res = torch.empty_like(x), torch.empty_like(x)
        torch.ops.vllm_ir_c.fused_add_rms_norm_out(out, new_res, x, res, w, eps)
        x_inplace, res_inplace = x.clone(), res.clone()
        torch.ops.vllm_ir_c.fused_add_rms_norm(x_inplace, res_inplace, w, eps)
        assert torch.equal(out, x_inplace) and torch.equal(new_res, res_inplace)


# ---------------------------------------------------------------------------------------
# tracing


@needs_kernels
def test_ops_trace_as_single_opaque_nodes():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, res, w):
        out, new_out, new_res = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
        torch.ops.vllm_ir_c.rms_norm(out, x, w, 1e-6)
        torch.ops.vllm_ir_c.fused_add_rms_norm_out(new_out, new_res, x, res, w, 1e-6)
        torch.ops.vllm_ir_c.fused_add_rms_norm(x, res, w, 1e-6)
        return out, new_out, new_res, x, res

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 32), torch.randn(4, 32), torch.ones(32))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    for op in ("rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_out"):
        assert targets.count(getattr(torch.ops.vllm_ir_c, op).default) == 1, op


@needs_kernels
@pytest.mark.compile
def test_impls_compile_with_fake_tensors():
    rms_impl, fused_impl = RMS.impls["vllm_c"].fn, FUSED.impls["vllm_c"].fn
    fused_inplace = FUSED.impls["vllm_c"].inplace_fn

    def f(x, res, w):
        y = rms_impl(x, w, 1e-6)
        out, new_res = fused_impl(x, res, w, 1e-6)
        out2, new_res2 = fused_inplace(x.clone(), res.clone(), w, 1e-6)
        return y, out, new_res, out2, new_res2

    x, res, w, _, _ = FUSED.generate_inputs((4, 64), torch.float32)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(x, res, w), f(x, res, w), strict=True):
        torch.testing.assert_close(got, want)


@needs_kernels
def test_cpu_capability_is_reported():
    assert provider.cpu_capability() in ("DEFAULT", "AVX2", "AVX512", "AVX512_BF16")


_VARIANT_CHECK = """
import sys, torch, vllm_ir, vllm_ir_provider_vllm_c as p
print(p.cpu_capability())
rms, fused = vllm_ir.ops.rms_norm, vllm_ir.ops.fused_add_rms_norm
with vllm_ir.priority(rms_norm=["vllm_c"], fused_add_rms_norm=["vllm_c"]):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape in ((5, 7), (3, 4096), (2, 3, 100)):
            for with_weight in (True, False):
                x, res, w, eps, _ = fused.generate_inputs(shape, dtype, with_weight=with_weight)
                assert rms.dispatch(x, w, eps).provider == "vllm_c"
                want = fused.fn(x, res, w, eps)
                pairs = [(rms(x, w, eps), rms.fn(x, w, eps))]
                pairs += list(zip(fused(x, res, w, eps), want))
                donated = fused.maybe_inplace(x.clone(), res.clone(), w, eps)
                pairs += list(zip(donated, want))
                for got, want in pairs:  # native's bits: ATen's summation order at any vector width
                    assert torch.equal(got, want), (dtype, shape, with_weight)
print("ok")
"""


@needs_kernels
@pytest.mark.parametrize("variant", ["DEFAULT", "AVX2", "AVX512", "AVX512_BF16"])
@pytest.mark.subprocess
def test_every_compiled_cpu_variant_matches_native(variant):
    assert verdict_in_variant(variant, _VARIANT_CHECK, timeout=120) == "ok"


def verdict_in_variant(variant: str, script: str, *argv: str, timeout: int) -> str:
    """What ``script`` prints after the variant that ran, in a child whose vllm_c kernels are
    capped at ``variant``; skips where that variant was not compiled, is this process's own
    (the in-process tests cover it), or this CPU cannot run it."""
    from vllm_ir_provider_vllm_c import _build_info

    if variant not in _build_info.CPU_CAPABILITIES:
        pytest.skip(f"the {variant} kernels were not compiled on this machine")
    if variant == provider.cpu_capability():
        pytest.skip(f"{variant} runs in this process: covered by the other tests")
    env = {**os.environ, "VLLM_IR_C_CPU_CAPABILITY": variant}
    done = subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ran, verdict = done.stdout.split()
    if ran != variant:
        pytest.skip(f"this CPU cannot run {variant} (ran {ran})")
    return verdict


# ---------------------------------------------------------------------------------------
# an op is its own files: csrc/cpu/<op>.cpp, csrc/cuda/<op>.cu, vllm_ir_provider_vllm_c/<op>.py

PACKAGE_ROOT = SOURCES.parent
#: What every op shares; none of it may name an op, or adding one would mean editing it.
SHARED_FILES = [
    "setup.py",
    "MANIFEST.in",
    "pyproject.toml",
    "csrc/torch_bindings.cpp",
    "csrc/kernel_common.h",
    "csrc/ops_common.h",
    "csrc/cpu/dispatch_stub.h",
    "vllm_ir_provider_vllm_c/__init__.py",
    "vllm_ir_provider_vllm_c/_extension.py",
]


def _code(path: Path) -> str:
    """A source file without its comments and docstrings (examples there may name any op)."""
    import ast

    text = path.read_text()
    if path.suffix == ".py":
        tree = ast.parse(text)
        documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        for node in ast.walk(tree):
            if isinstance(node, documented) and ast.get_docstring(node, clean=False) is not None:
                node.body = node.body[1:] or [ast.Pass()]
        return ast.unparse(tree)
    if path.suffix in (".cpp", ".h", ".cu"):
        return re.sub(r"//[^\n]*", "", text)
    return re.sub(r"#[^\n]*", "", text)  # MANIFEST.in, pyproject.toml


def test_shared_files_name_no_op():
    families = sorted(p.stem for p in (SOURCES / "cpu").glob("*.cpp"))
    ops = [op for op in vllm_ir.ops if "vllm_c" in op.impls]
    names = re.compile("|".join(re.escape(n) for n in [*families, *(op.name for op in ops)]), re.IGNORECASE)
    for name in SHARED_FILES:
        found = [m for m in names.findall(_code(PACKAGE_ROOT / name)) if m.lower() != "activation"]
        assert not found, f"{name} names an op ({sorted(set(found))}): adding an op would have to edit it"
    # The op files are the ones the build, the sdist and the package scan find by themselves:
    # every C++ family file has the Python module of the same name that registers its ops.
    modules = {p.stem for p in (PACKAGE_ROOT / "vllm_ir_provider_vllm_c").glob("*.py") if not p.stem.startswith("_")}
    assert set(families) <= modules, f"C++ families without a Python module: {set(families) - modules}"
    assert {p.stem for p in (SOURCES / "cuda").glob("*.cu")} <= set(families)
    assert {"rms_norm", "fused_add_rms_norm", "silu_and_mul"} <= {op.name for op in ops}


_TOY_CPP = r"""
// A toy op written like every vllm_c op: its own file, schema, kernels and registrations.
#include "../kernel_common.h"
#include "dispatch_stub.h"

namespace vllm_ir_c {
VLLM_IR_C_DECLARE_DISPATCH(const char* (*)(float*, const float*, int64_t, float), toy_scale_stub);
namespace CPU_CAPABILITY {
namespace {
const char* toy_scale_kernel(float* out, const float* x, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = x[i] * s;
  }
  return C10_STRINGIZE(CPU_CAPABILITY);
}
}  // namespace
}  // namespace CPU_CAPABILITY
VLLM_IR_C_REGISTER_DISPATCH(toy_scale_stub, &CPU_CAPABILITY::toy_scale_kernel);
}  // namespace vllm_ir_c

#if VLLM_IR_C_TORCH_SIDE
#include <ATen/core/Tensor.h>
#include <torch/library.h>

namespace {
std::string toy_scale_cpu(at::Tensor& out, const at::Tensor& x, double s) {
  return vllm_ir_c::toy_scale_stub(out.mutable_data_ptr<float>(), x.const_data_ptr<float>(), x.numel(),
                                   static_cast<float>(s));
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_ir_c, m) {
  m.def("toy_scale(Tensor(a!) out, Tensor x, float s) -> str");
}
TORCH_LIBRARY_IMPL(vllm_ir_c, CPU, m) {
  m.impl("toy_scale", &toy_scale_cpu);
}
#endif
"""

_TOY_PY = '''"""A toy op family; it declares its IR op itself (a real one is declared in vllm-ir)."""

import torch
from torch import Tensor

import vllm_ir

from ._extension import PROVIDER, supported, torch_op

EAGER_FIRST = {"cpu": ("toy_scale",)}


@vllm_ir.register_op
def toy_scale(x: Tensor, s: float) -> Tensor:
    return x * s


def register(status):
    if status.loaded:
        torch.library.register_fake("vllm_ir_c::toy_scale")(lambda out, x, s: "")
    kernel = torch_op(status, "toy_scale")

    @vllm_ir.ops.toy_scale.register_impl(PROVIDER, supported=supported(status))
    def toy(x: Tensor, s: float) -> Tensor:
        out = torch.empty_like(x)
        kernel(out, x, s)
        return out
'''

_TOY_CHECK = """
import torch, vllm_ir, vllm_ir_provider_vllm_c as p
from vllm_ir.plugins import platforms
assert p.STATUS.loaded, p.STATUS
assert [f.__name__ for f in p.FAMILIES] == ["vllm_ir_provider_vllm_c.toy"]
assert p.vllm_ir_default_priority(platforms.CPU, "eager") == {"toy_scale": ["vllm_c"]}
x = torch.randn(100)
out = torch.empty_like(x)
ran = torch.ops.vllm_ir_c.toy_scale(out, x, 3.0)
assert torch.equal(out, x * 3)
with vllm_ir.priority(toy_scale=["vllm_c"]):
    assert vllm_ir.ops.toy_scale.dispatch(x, 3.0).provider == "vllm_c"
    assert torch.equal(vllm_ir.ops.toy_scale(x, 3.0), x * 3)
print(ran, p.cpu_capability())
"""


@pytest.mark.build
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
@pytest.mark.subprocess
def test_a_new_op_is_new_files_only(tmp_path):
    """The package without its op files, plus a toy op's two files, builds, registers and dispatches.

    The shared files are copied unchanged. Only DEFAULT and AVX2 are compiled (about a minute
    on two cores); the toy kernel returns the capability whose stub slot ran, which must be
    the one the library reports, under each VLLM_IR_C_CPU_CAPABILITY cap.
    """
    root = tmp_path / "vllm_c"
    skip = shutil.ignore_patterns(
        "layernorm.*",
        "activation.*",
        "quant.*",
        "rotary.*",
        "fused_quant.*",
        "_C*.so",
        "_build_info.py",
        "build",
        "*.egg-info",
        "__pycache__",
    )
    shutil.copytree(PACKAGE_ROOT, root, ignore=skip)
    (root / "csrc" / "cpu" / "toy_scale.cpp").write_text(_TOY_CPP)
    (root / "vllm_ir_provider_vllm_c" / "toy.py").write_text(_TOY_PY)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_IR_C_")}
    build_env = {**clean, "VLLM_IR_C_CPU_CAPABILITIES": "AVX2", "VLLM_IR_C_CUDA": "0", "VLLM_IR_C_STRICT_BUILD": "1"}
    build_env.setdefault("MAX_JOBS", "2")
    done = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=root,
        env=build_env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    from_build = {**clean, "PYTHONPATH": str(root), "VLLM_IR_DISABLE_PLUGIN_AUTOLOAD": "1"}
    for cap in ("DEFAULT", "AVX2", None):
        env = from_build if cap is None else {**from_build, "VLLM_IR_C_CPU_CAPABILITY": cap}
        check = subprocess.run([sys.executable, "-c", _TOY_CHECK], env=env, capture_output=True, text=True, timeout=120)
        assert check.returncode == 0, check.stderr[-3000:]
        ran, reported = check.stdout.split()
        assert ran == reported, f"the stub ran {ran}, the library reports {reported}"
        if cap == "DEFAULT" or torch.backends.cpu.get_cpu_capability() == "DEFAULT":
            assert ran == "DEFAULT"
        else:  # AVX2 is the best variant compiled there, capped or not
            assert ran == "AVX2"


# ---------------------------------------------------------------------------------------
# CUDA sources: compile-checked wherever nvcc exists, even with a CPU build of torch


def _torch_includes() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    return [f"-I{p}" for p in include_paths()]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: CUDA kernels not compile-checked")
@pytest.mark.build
@pytest.mark.subprocess
def test_cuda_sources_compile(tmp_path):
    """nvcc compiles every csrc/cuda/*.cu, kernels and torch side (sm_90, torch's flags).

    As one translation unit that includes them all (a unity build): nvcc's front ends spend
    ~25 s of CPU per file on torch's headers, so one unit is a quarter of the cost of five. It
    also holds the files to one rule of their own: no two define the same name (shared helpers
    live in cuda_common.h). What it cannot see is a file relying on an include an earlier file
    made; the provider's CUDA build (setup.py on a CUDA machine) compiles them one by one.

    A CPU build of torch lacks one generated header of c10/cuda (cuda_cmake_macros.h); the
    check supplies its one-line content from a temporary directory.
    """
    nvcc = shutil.which("nvcc")
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    torch_flags = [
        "-D__CUDA_NO_HALF_OPERATORS__",
        "-D__CUDA_NO_HALF_CONVERSIONS__",
        "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-D__CUDA_NO_HALF2_OPERATORS__",
        "--expt-relaxed-constexpr",
    ]
    sources = sorted((SOURCES / "cuda").glob("*.cu"))
    assert sources, "no CUDA sources found"
    unit = tmp_path / "all_cuda_sources.cu"
    unit.write_text("".join(f'#include "{src}"\n' for src in sources))
    flags = ["-std=c++20", "-O1", "-gencode", "arch=compute_90,code=sm_90", *torch_flags]
    flags += [f"-I{tmp_path / 'stub'}", *_torch_includes()]
    command = [nvcc, "-c", str(unit), "-o", str(tmp_path / "all_cuda_sources.o"), *flags]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-4000:]}"


def test_compile_facts_name_the_build_and_the_library_file():
    from vllm_ir_provider_vllm_c import _extension

    facts = vllm_ir.ops.rms_norm.impls["vllm_c"].compile_facts
    assert facts == _extension.compile_facts(provider.STATUS)
    assert facts["vllm_c.torch"] == torch.__version__
    size, mtime = facts["vllm_c.library"]
    stat = os.stat(provider.STATUS.library)
    assert (size, mtime) == (stat.st_size, stat.st_mtime_ns)
    rebuilt = _extension.ExtensionStatus(True, None, False, torch.__version__, __file__)  # another file
    assert _extension.compile_facts(rebuilt)["vllm_c.library"] != facts["vllm_c.library"]


# ---------------------------------------------------------------------------------------
# activations (csrc/cpu/activation.cpp): what the conformance kit does not see

from vllm_ir_provider_vllm_c import activation as act_family  # noqa: E402

GATED_OPS = [getattr(vllm_ir.ops, n) for n in act_family.GATED]
ELEMENTWISE_OPS = [getattr(vllm_ir.ops, n) for n in act_family.ELEMENTWISE]
#: Scalar arguments per gated op (besides the defaults): the variants the tests run.
GATED_CALLS = {
    "silu_and_mul": [()],
    "mul_and_silu": [()],
    "gelu_and_mul": [("none",), ("tanh",)],
    "fatrelu_and_mul": [(0.0,), (0.1,)],
    "swigluoai_and_mul": [(1.702, 7.0), (1.0, 3.0)],
}


def test_activation_impls_registered_with_their_claims():
    cuda_built = provider.STATUS.cuda_kernels and torch.version.hip is None
    for op in (*GATED_OPS, *ELEMENTWISE_OPS):
        impl = op.impls["vllm_c"]
        assert impl.batch_invariant and not impl.inplace, op.name
        assert impl.exact == (op.name in act_family.EXACT_ON_CPU and not cuda_built), op.name


def _with_vllm_c(op, args):
    with vllm_ir.priority(**{op.name: ["vllm_c"]}):
        assert op.dispatch(*args).provider == "vllm_c", op.name
        return op(*args)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_activations_propagate_nan_and_inf_like_native(dtype):
    """NaN and +-inf in the vector body and in a row's scalar remainder (d = 70)."""
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e4, -1e4])
    for op in (*GATED_OPS, *ELEMENTWISE_OPS):
        gated = op in GATED_OPS
        x = torch.randn(4, 140 if gated else 70)
        x[0, : specials.numel()] = specials  # gate values (swigluoai: both halves interleaved)
        x[1, -specials.numel() :] = specials  # up values (halves) / the tail
        x[2, 60:67] = specials  # across the vector body / remainder boundary
        x = x.to(dtype)
        for scalars in GATED_CALLS.get(op.name, [()]):
            args = (x, *scalars)
            got, want = _with_vllm_c(op, args), op.fn(*args)
            where = f"{op.name}{scalars} {dtype}"
            assert torch.equal(got.isnan(), want.isnan()), where
            assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got[got.isinf()], want[want.isinf()]), where
            atol, rtol = op.tolerance(dtype)
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol, equal_nan=True, msg=where)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threshold", [0.0, 0.5, 0.1, -1.25])
def test_fatrelu_zeroes_gate_values_at_the_threshold(dtype, threshold):
    """gate == threshold -> 0 (F.threshold compares x <= threshold in fp32); just above it stays."""
    op = vllm_ir.ops.fatrelu_and_mul
    d = 70  # 64 in the vector body, 6 in the scalar remainder
    at = torch.tensor(threshold).to(dtype).float().item()  # the nearest value x can hold
    above = torch.tensor(at).to(dtype).float().nextafter(torch.tensor(float("inf"))).to(dtype).float().item()
    gate = torch.full((3, d), at)
    gate[1] = torch.tensor(above).to(dtype).float()  # may round back to `at` in bf16/fp16: compare to native
    gate[2, ::2] = threshold
    x = torch.cat([gate, torch.full((3, d), 3.0)], dim=-1).to(dtype)
    got, want = _with_vllm_c(op, (x, threshold)), op.fn(x, threshold)
    assert torch.equal(got, want)
    if at <= threshold:
        assert (got[0] == 0).all(), "a gate value equal to the threshold must give 0"


@needs_kernels
def test_gelu_and_mul_rejects_a_bad_approximate_naming_op_and_provider():
    x = torch.randn(2, 16)
    with vllm_ir.priority(gelu_and_mul=["vllm_c"]):
        with pytest.raises(
            ValueError, match=r"gelu_and_mul \(provider vllm_c\): approximate must be 'none' or 'tanh', not 'erf'"
        ):
            vllm_ir.ops.gelu_and_mul(x, "erf")
    with pytest.raises(ValueError, match="vllm_ir_c::gelu_and_mul: approximate must be 'none' or 'tanh', not 'fast'"):
        torch.ops.vllm_ir_c.gelu_and_mul(torch.empty(2, 8), x, "fast")


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("alpha", "limit"), [(1.702, 7.0), (1.0, 3.0), (0.5, 0.25)])
def test_swigluoai_clamps_gate_above_and_up_both_ways(dtype, alpha, limit):
    op = vllm_ir.ops.swigluoai_and_mul
    g = torch.Generator().manual_seed(1)
    x = (4 * limit * torch.randn(5, 2 * 37, generator=g)).to(dtype)  # a third beyond +-limit, odd d
    x[0, 0], x[0, 1] = 100.0, -100.0  # gate far above the limit, up far below -limit
    got, want = _with_vllm_c(op, (x, alpha, limit)), op.fn(x, alpha, limit)
    atol, rtol = op.tolerance(dtype)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    # (clamp(up) + 1) * g * sigmoid(alpha g), with g = limit and clamp(up) = -limit, in x's dtype.
    lim = torch.tensor(limit).to(dtype)
    expected = (-lim + 1) * (lim * torch.sigmoid(lim * alpha))
    torch.testing.assert_close(got[0, 0], expected, atol=atol, rtol=rtol)


@needs_kernels
def test_fp32_exp_and_erf_activations_are_natives_bits_across_every_exponent():
    """With AVX512 the kernels inline ATen's exp and erf (Sleef's algorithm, act_vec.h) rather
    than call them: fp32 silu and gelu of gates spread over every exponent and both signs
    (subnormals, the underflow and overflow edges of exp) are native's bits. Rows of whole
    vector steps (d = 1024), so native runs its vector form throughout."""
    bits = torch.arange(0, 2**32, 4093, dtype=torch.int64)[: 1024 * 1024]
    gate = bits.to(torch.int32).view(torch.float32).reshape(1024, 1024)
    gate = torch.where(gate.isfinite(), gate, 1.0)  # NaN and inf: test_activations_propagate_nan_and_inf_like_native
    x = torch.cat([gate, torch.full_like(gate, 1.5)], dim=-1)
    for op, args in ((vllm_ir.ops.silu_and_mul, ()), (vllm_ir.ops.gelu_and_mul, ("none",))):
        got, want = _with_vllm_c(op, (x, *args)), op.fn(x, *args)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), op.name
    got, want = _with_vllm_c(vllm_ir.ops.mul_and_silu, (x.flip(-1),)), vllm_ir.ops.mul_and_silu.fn(x.flip(-1))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def _swigluoai_unrounded_limit(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """swigluoai_and_mul rounding every step to x's dtype but the clamps (a kernel that would
    skip their rounding for any limit)."""
    r = lambda v: v.to(x.dtype).float()  # noqa: E731
    gate, up = x[..., ::2].float(), x[..., 1::2].float()
    g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
    glu = r(g * r(torch.sigmoid(r(g * alpha))))
    return (r(u + 1) * glu).to(x.dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("limit", [7.0, 7.327, 2.007])
def test_swigluoai_rounds_a_limit_its_dtype_cannot_hold_like_native(dtype, limit):
    """The clamps skip their rounding only where the limit is a value of x's dtype (7.0): a
    clamped 7.327 is rounded to x's dtype before alpha, the sigmoid and the product see it. Rows
    of whole vector steps: native's vector form throughout, so the bits are native's."""
    g = torch.Generator().manual_seed(2)
    gate = limit + 2 * torch.rand(2, 64, generator=g) - 0.5  # most above the limit
    up = 3 * limit * torch.randn(2, 64, generator=g)  # many beyond +-limit
    x = torch.stack([gate, up], dim=-1).reshape(2, 128).to(dtype)
    op = vllm_ir.ops.swigluoai_and_mul
    told_apart = False  # by some alpha, from a kernel skipping the clamps' rounding
    for alpha in (1.702, 0.3, 0.05):
        got, want = _with_vllm_c(op, (x, alpha, limit)), op.fn(x, alpha, limit)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), alpha
        told_apart |= not torch.equal(_swigluoai_unrounded_limit(x, alpha, limit), want)
    assert told_apart == (limit != 7.0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_swigluoai_gives_natives_bits_for_more_parameters_than_it_keeps_tables_for(dtype):
    """16-bit swigluoai looks glu(gate) up in a table per (alpha, limit), keeping at most 16 of
    them per process and computing for the rest: 20 (alpha, limit) pairs unused elsewhere (each
    alpha with four limits, each limit with five alphas: a table keyed on either alone would
    serve the wrong pair), twice each (the second call reads the table the first built), are
    all native's bits."""
    g = torch.Generator().manual_seed(3)
    x = (6 * torch.randn(3, 128, generator=g)).to(dtype)
    x[0, :8] = torch.tensor([float("nan"), 1.0, float("inf"), -1.0, -float("inf"), 0.5, 100.0, -100.0])
    op = vllm_ir.ops.swigluoai_and_mul
    for alpha, limit in itertools.product([0.9 + k / 64 for k in range(5)], [5.0 + k / 8 for k in range(4)]):
        want = op.fn(x, alpha, limit)
        for _ in range(2):
            got = _with_vllm_c(op, (x, alpha, limit))
            both_nan = got.isnan() & want.isnan()
            assert torch.equal(got[~both_nan].view(torch.int16), want[~both_nan].view(torch.int16)), (alpha, limit)
            assert torch.equal(got.isnan(), want.isnan()), (alpha, limit)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_elementwise_activations_take_any_shape_and_layout(dtype):
    base = (3 * torch.randn(6, 40)).to(dtype)
    inputs = {
        "0-d": base[0, 0].clone(),
        "1-D": base[0].clone(),
        "3-D": base.reshape(2, 3, 40),
        "transposed (dense)": base.t(),
        "strided": base[:, ::3],
        "row slice": base[1:5, 3:33],
        "expanded (stride 0)": base[:1].expand(6, 40),
    }
    for op in ELEMENTWISE_OPS:
        atol, rtol = op.tolerance(dtype)
        for label, x in inputs.items():
            got, want = _with_vllm_c(op, (x,)), op.fn(x)
            assert got.shape == x.shape, (op.name, label)
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=f"{op.name} {label}")
            if x.is_contiguous() or label.startswith("transposed"):  # dense: out keeps x's layout
                assert got.stride() == x.stride(), (op.name, label)


@needs_kernels
def test_activation_kernels_reject_inconsistent_arguments():
    x = torch.randn(3, 16)
    with pytest.raises(RuntimeError, match=r"vllm_ir_c::mul_and_silu: input must end in an even dimension"):
        torch.ops.vllm_ir_c.mul_and_silu(torch.empty(3, 7), torch.randn(3, 15))
    with pytest.raises(RuntimeError, match=r"vllm_ir_c::swigluoai_and_mul: out has shape \[3, 16\], expected \[3, 8\]"):
        torch.ops.vllm_ir_c.swigluoai_and_mul(torch.empty(3, 16), x, 1.702, 7.0)
    with pytest.raises(RuntimeError, match="vllm_ir_c::fatrelu_and_mul: out is BFloat16, input is Float"):
        torch.ops.vllm_ir_c.fatrelu_and_mul(torch.empty(3, 8, dtype=torch.bfloat16), x, 0.0)
    with pytest.raises(RuntimeError, match="vllm_ir_c::relu2: unsupported dtype Double"):
        torch.ops.vllm_ir_c.relu2(torch.empty(3, 16, dtype=torch.float64), x.double())
    with pytest.raises(RuntimeError, match=r"vllm_ir_c::gelu_new: out has shape \[16\], input has \[3, 16\]"):
        torch.ops.vllm_ir_c.gelu_new(torch.empty(16), x)
    with pytest.raises(RuntimeError, match="unsupported operation"):  # out overlapping the input
        torch.ops.vllm_ir_c.silu_and_mul(x.view(-1)[:24].view(3, 8), x)


@needs_kernels
def test_activation_predicates_decline_with_reasons():
    gelu = vllm_ir.ops.gelu_and_mul
    cases = [
        (vllm_ir.ops.silu_and_mul, (torch.randn(3, 15),), "last dimension 15 is odd"),
        (vllm_ir.ops.swigluoai_and_mul, (torch.randn(3, 32)[:, ::2], 1.702, 7.0), "stride 2 along the last dimension"),
        (gelu, (torch.randn(3, 16, dtype=torch.float64), "none"), "dtype torch.float64 is not supported"),
        (vllm_ir.ops.quick_gelu, (torch.randn(3, 16, device="meta"),), "device meta is not supported"),
        (vllm_ir.ops.mul_and_silu, (torch.tensor(1.0),), "x is 0-d"),
    ]
    for op, args, reason in cases:
        verdict = _verdict(op, args)
        assert verdict.status == "declined" and reason in verdict.reason, (op.name, verdict)


def _every_finite_16_bit_value(dtype: torch.dtype) -> torch.Tensor:
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return every[every.isfinite()]


def _vllm_gelu_new(x: torch.Tensor) -> torch.Tensor:
    """vLLM 0.33's NewGELU.forward_native, verbatim."""
    c = math.sqrt(2.0 / math.pi)
    return 0.5 * x * (1.0 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3.0))))


def _vllm_gelu_fast(x: torch.Tensor) -> torch.Tensor:
    """vLLM 0.33's FastGELU.forward_native, verbatim."""
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("name", "vllm"), [("gelu_new", _vllm_gelu_new), ("gelu_fast", _vllm_gelu_fast)])
def test_gelu_new_and_gelu_fast_give_vllms_bits_for_every_16_bit_value(name, vllm, dtype):
    """vLLM rounds after every step in x's dtype (``1 + t`` cancels in bf16 for x in about
    [-4, -1.8]): native and vllm_c give vLLM's forward_native bits for every finite value."""
    op = getattr(vllm_ir.ops, name)
    x = _every_finite_16_bit_value(dtype)
    want = vllm(x)
    for got in (op.fn(x), _with_vllm_c(op, (x,))):
        both_nan = got.isnan() & want.isnan()
        assert torch.equal(got.view(torch.int16)[~both_nan], want.view(torch.int16)[~both_nan]), name


@needs_kernels
def test_gelu_new_in_bf16_is_vllms_not_the_fp32_value_rounded_once():
    """The issue's repro: vLLM's values, not the closer-to-exact [-0.0569, -0.0391, -0.0354]."""
    x = torch.tensor([-1.875, -2.078125, -2.125], dtype=torch.bfloat16)
    want = torch.tensor([-0.0549316, -0.0366211, -0.0373535], dtype=torch.bfloat16)
    assert torch.equal(vllm_ir.ops.gelu_new.fn(x), want)
    assert torch.equal(_with_vllm_c(vllm_ir.ops.gelu_new, (x,)), want)


def _sparse_calls(dtype: torch.dtype):
    """gelu_and_mul_sparse arguments: vLLM's generator, erf, another sparsity, widths with a
    remainder, a 3-D batch, a row slice of a wider buffer, one row; rows with NaN, inf, a
    constant gate (std 0) and zeros."""
    op = vllm_ir.ops.gelu_and_mul_sparse
    for tokens, d in ((1, 64), (9, 80), (5, 199), (4, 4099)):
        x, m, approximate = op.generate_inputs((tokens, d), dtype, seed=d)
        yield x, m, approximate
        yield x, m, "none"
        yield x, 0.6744897501960817, approximate
    yield x.reshape(2, 2, -1), m, approximate
    wide = (2 * torch.randn(6, 3 * 96)).to(dtype)
    yield wide[:, : 2 * 96], m, "none"
    special = (2 * torch.randn(5, 2 * 70)).to(dtype)
    special[0, 3] = float("nan")
    special[1, 5] = float("inf")
    special[2, :70] = 1.25
    special[3, :70] = 0.0
    special[4, 70:75] = float("nan")  # up values
    yield special, m, "tanh"
    yield special, m, "none"


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_and_mul_sparse_gives_natives_bits(dtype):
    """Row means from ATen's own mean, the std in double as ATen computes it, every step rounded
    to x's dtype; the erf form and every fp32 call run ATen's own gelu (oneDNN's for a contiguous
    fp32 or bf16 gate) on the sparse gate: native's (vLLM's) bits in every dtype."""
    op = vllm_ir.ops.gelu_and_mul_sparse
    for args in _sparse_calls(dtype):
        got, want = _with_vllm_c(op, args), op.fn(*args)
        where = f"{dtype} {list(args[0].shape)} {args[1:]}"
        assert got.shape == want.shape and got.dtype == want.dtype, where
        assert torch.equal(got.isnan(), want.isnan()), where
        keep = ~want.isnan()
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(got.view(bits)[keep], want.view(bits)[keep]), where


#: How many of the 65,536 16-bit codes ATen's scalar and vector tanh GELU round differently, per
#: ATen CPU capability (its vector form is the capability's; DEFAULT has none, so no difference).
_GELU_TANH_SCALAR_VECTOR_DIFFERENCES = {
    "AVX512": {torch.bfloat16: 4, torch.float16: 26},
    "AVX2": {torch.bfloat16: 4, torch.float16: 15},
    "DEFAULT": {torch.bfloat16: 0, torch.float16: 0},
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_atens_scalar_and_vector_gelu_tanh_differ_at_a_few_16_bit_values(dtype):
    """What 16-bit tanh gelu_and_mul_sparse calls on vllm_c leave open (cpu/activation.cpp): the
    fused kernel computes ATen's vector form everywhere; native's F.gelu takes its scalar form
    on the tail of each thread's chunk, which rounds differently at these few values only."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _GELU_TANH_SCALAR_VECTOR_DIFFERENCES:
        pytest.skip(f"ATen capability {capability}: its count was not measured")
    count = _GELU_TANH_SCALAR_VECTOR_DIFFERENCES[capability][dtype]
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    vector = torch.nn.functional.gelu(every, approximate="tanh")  # 65536 = whole vector steps
    scalar = torch.cat([torch.nn.functional.gelu(every[i : i + 63].clone(), approximate="tanh")
                        for i in range(0, 65536, 63)])  # fmt: skip
    differ = (vector.view(torch.int16) != scalar.view(torch.int16)) & ~(vector.isnan() & scalar.isnan())
    assert int(differ.sum()) == count


@needs_kernels
def test_gelu_and_mul_sparse_rejects_bad_arguments_naming_op_and_provider():
    x = torch.randn(2, 16)
    with vllm_ir.priority(gelu_and_mul_sparse=["vllm_c"]):
        with pytest.raises(ValueError, match=r"gelu_and_mul_sparse \(provider vllm_c\): approximate must be"):
            vllm_ir.ops.gelu_and_mul_sparse(x, 1.6, "erf")
    with pytest.raises(ValueError, match="vllm_ir_c::gelu_and_mul_sparse: approximate must be 'none' or 'tanh'"):
        torch.ops.vllm_ir_c.gelu_and_mul_sparse(torch.empty(2, 8), x, 1.6, "fast")
    with pytest.raises(RuntimeError, match="vllm_ir_c::gelu_and_mul_sparse: input must end in an even dimension"):
        torch.ops.vllm_ir_c.gelu_and_mul_sparse(torch.empty(2, 7), torch.randn(2, 15), 1.6, "none")
    verdict = _verdict(vllm_ir.ops.gelu_and_mul_sparse, (torch.randn(3, 32)[:, ::2], 1.6, "none"))
    assert verdict.status == "declined" and "stride 2 along the last dimension" in verdict.reason


_TABLE_PATH = """
import vllm_ir_provider_vllm_c as p
from vllm_ir_provider_vllm_c import activation
print(p.cpu_capability())
print(activation.table_path())
"""


def _table_path(tables: str | None) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_IR_C_TABLES"}
    if tables is not None:
        env["VLLM_IR_C_TABLES"] = tables
    done = subprocess.run([sys.executable, "-c", _TABLE_PATH], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    capability, path = done.stdout.strip().splitlines()
    return capability, path


@needs_kernels
@pytest.mark.subprocess
def test_table_path_is_fixed_per_machine_shown_and_overridable():
    """table16::Reader's computed-or-looked-up choice: by CPU vendor (AMD computes, others look
    up), the same in every process, overridden by VLLM_IR_C_TABLES, and reported (the doctor
    shows it among vllm_c's facts). Below AVX512 nothing is looked up."""
    capability, default = _table_path(None)
    assert _table_path(None)[1] == default  # no timing race: every process chooses alike
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if capability in ("AVX512", "AVX512_BF16"):
        amd = "AuthenticAMD" in cpuinfo
        assert default.startswith("computed: AuthenticAMD" if amd else "lookup: "), default
        assert _table_path("lookup")[1].startswith("lookup: VLLM_IR_C_TABLES=lookup")
        assert _table_path("computed")[1].startswith("computed: VLLM_IR_C_TABLES=computed")
        assert _table_path("measure")[1].startswith("measure: ")
        assert _table_path("0")[1].startswith("off: ")
    else:
        assert default == f"none: the {capability} kernels compute every element (the tables need AVX512)"
        assert _table_path("lookup")[1] == default
    facts = provider.vllm_ir_provider_facts()
    assert facts["cpu_capability"] == provider.cpu_capability()
    assert facts["tables"] == act_family.table_path()


_ACTIVATION_VARIANT_CHECK = """
import hashlib, torch, vllm_ir, vllm_ir_provider_vllm_c as p
from vllm_ir_provider_vllm_c import activation as fam
print(p.cpu_capability())
claims = {name: getattr(vllm_ir.ops, name).impls["vllm_c"].exact for name in fam.EXP_BASED}
calls = {"gelu_and_mul": [("none",), ("tanh",)], "fatrelu_and_mul": [(0.1,)], "swigluoai_and_mul": [(1.0, 3.0)]}
digest, inexact = hashlib.sha256(), []
for name in (*fam.GATED, *fam.ELEMENTWISE):
    op = getattr(vllm_ir.ops, name)
    gated = name in fam.GATED
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        atol, rtol = op.tolerance(dtype)
        # d with remainders; rows >= 2 (native hands a one-row gate, contiguous, to oneDNN's
        # gelu) and even (native's gelu splits its > 16384 elements in halves: here at a row end)
        for shape in ((3, 7), (2, 48), (2, 100), (4, 4099), (2, 3, 64)):
            g = torch.Generator().manual_seed(sum(shape))
            x = (3 * torch.randn(*shape[:-1], shape[-1] * (2 if gated else 1), generator=g)).to(dtype)
            for scalars in calls.get(name, [()]):
                with vllm_ir.priority(**{name: ["vllm_c"]}):
                    got = op(x, *scalars)
                want = op.fn(x, *scalars)
                torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
                exact = op.impls["vllm_c"].exact or (name == "gelu_and_mul" and fam.same_exp_as_aten())
                if exact and not torch.equal(got, want):
                        inexact.append(f"{name}{scalars} {dtype} {shape}")
                digest.update(got.view(torch.int16 if dtype != torch.float32 else torch.int32).numpy().tobytes())
print(digest.hexdigest()[:16])
print(";".join(inexact) or "exact")
print(all(claims.values()) == fam.same_exp_as_aten())  # exp-based ops claim exact only then
"""


@needs_kernels
@pytest.mark.subprocess
def test_every_compiled_cpu_variant_gives_natives_bits_for_activations():
    """Each compiled CPU variant, with ATen running the same ISA (ATEN_CPU_CAPABILITY) and each
    vector variant with ATen at the other vector ISA (a wheel built with fewer variants, or a
    capped VLLM_IR_C_CPU_CAPABILITY: the split between ATen's vector and scalar forms follows
    ATen's vectors, not the kernel's), is bit-identical to native for the exact ops and
    gelu_and_mul (multi-row), within tolerance for the others; AVX512 and AVX512_BF16 (which
    differ only in their bf16 conversions) give the same bits for every op. DEFAULT beside a
    vector ATen (a library built without vector variants) stays within tolerance, and its
    exp-based ops do not claim ``exact`` there (ATen's vector exp is Sleef's, DEFAULT's the C
    library's)."""
    from vllm_ir_provider_vllm_c import _build_info

    aten_isa = {"DEFAULT": "default", "AVX2": "avx2", "AVX512": "avx512", "AVX512_BF16": "avx512"}
    other_isa = {"DEFAULT": "avx2", "AVX2": "avx512", "AVX512": "avx2", "AVX512_BF16": "avx2"}
    # ATen obeys ATEN_CPU_CAPABILITY without asking the CPU: an ISA this CPU lacks is SIGILL, not a skip.
    clean = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    here = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        capture_output=True, text=True, env=clean, check=True,
    ).stdout.strip()  # fmt: skip
    runnable = {"default"} | ({"avx2"} if here != "DEFAULT" else set()) | ({"avx512"} if "AVX512" in here else set())
    runs = [(v, aten_isa[v]) for v in _build_info.CPU_CAPABILITIES]
    runs += [(v, other_isa[v]) for v in _build_info.CPU_CAPABILITIES if v in other_isa]
    runs = [(v, aten) for v, aten in runs if aten in runnable]
    digests = {}
    for variant, aten in runs:
        env = {**os.environ, "VLLM_IR_C_CPU_CAPABILITY": variant, "ATEN_CPU_CAPABILITY": aten}
        done = subprocess.run(
            [sys.executable, "-c", _ACTIVATION_VARIANT_CHECK], capture_output=True, text=True, env=env, timeout=300
        )
        assert done.returncode == 0, f"{variant} under ATen {aten}: {done.stderr[-3000:]}"
        ran, digest, inexact, claims_agree = done.stdout.strip().splitlines()  # inexact: one line
        if ran != variant:
            continue  # this CPU cannot run it
        assert inexact == "exact", f"{variant} under ATen {aten}: differs from native: {inexact}"
        assert claims_agree == "True", f"{variant} under ATen {aten}: the exp-based ops' exact claims"
        if aten == aten_isa[variant]:
            digests[variant] = digest
    assert digests, "no variant ran"
    if {"AVX512", "AVX512_BF16"} <= set(digests):
        assert digests["AVX512"] == digests["AVX512_BF16"]


# Every bf16 / fp16 bit pattern through each looked-up activation (csrc/cpu/table16.h): as the
# gate of a gated op (up = 1.5, then 1) and as the input of an elementwise op. Rows of 65536: the
# whole row is the vector body.
_EVERY_16_BIT_VALUE = """
import sys, torch, vllm_ir, vllm_ir_provider_vllm_c
every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
results = {}
for dtype in (torch.bfloat16, torch.float16):
    x = every.view(dtype).reshape(1, -1)
    gated = torch.cat([x, torch.full_like(x, 1.5)], dim=-1)
    for name, args in (("silu_and_mul", ()), ("mul_and_silu", ()), ("gelu_and_mul", ("none",)),
                       ("gelu_and_mul", ("tanh",))):
        inputs = gated if name != "mul_and_silu" else gated.flip(-1)
        out = torch.empty_like(x)
        getattr(torch.ops.vllm_ir_c, name)(out, inputs, *args)
        results[f"{name}{args} {dtype}"] = out
    for name in ("gelu_new", "gelu_fast", "quick_gelu"):
        out = torch.empty_like(x)
        getattr(torch.ops.vllm_ir_c, name)(out, x)
        results[f"{name} {dtype}"] = out
    # Its sigmoid's argument is round(min(gate, limit) * alpha): every value with (1, inf).
    interleaved = torch.stack([x, torch.full_like(x, 1.5)], dim=-1).reshape(1, -1)
    for args in ((1.0, float("inf")), (1.702, 7.0)):
        out = torch.empty_like(x)
        torch.ops.vllm_ir_c.swigluoai_and_mul(out, interleaved, *args)
        results[f"swigluoai_and_mul{args} {dtype}"] = out
    q = torch.empty(1, 2**16 // 2, dtype=torch.float8_e4m3fn)
    torch.ops.vllm_ir_c.silu_and_mul_static_fp8_quant(q, gated[:, ::2].contiguous(), torch.tensor([0.05]))
    results[f"silu_and_mul_static_fp8_quant {dtype}"] = q.view(torch.uint8)
torch.save(results, sys.argv[1])
"""


@needs_kernels
@pytest.mark.subprocess
def test_looked_up_activations_equal_computed_ones_for_every_16_bit_value(tmp_path):
    """Differential: AVX512 kernels look activations of bf16/fp16 values up in tables built by the
    vector code, and compute the exp-based ones' bf16 table values (silu, quick_gelu,
    swigluoai's sigmoid) by a cheaper exp where that gives the table's bits (steps it cannot vouch for
    are looked up) where this machine computes (the default, 1: fixed by CPU vendor);
    VLLM_IR_C_TABLES=computed computes wherever it can vouch, =lookup looks every step up,
    =measure takes whichever timed faster in this process, =0 computes every element by the
    vector code. Same bits, every value, all five."""
    if provider.cpu_capability() not in ("AVX512", "AVX512_BF16"):
        pytest.skip(f"{provider.cpu_capability()} kernels compute: no tables to compare")
    paths = {}
    for tables in ("1", "computed", "lookup", "measure", "0"):
        paths[tables] = tmp_path / f"tables{tables}.pt"
        env = {**os.environ, "VLLM_IR_C_TABLES": tables}
        done = subprocess.run(
            [sys.executable, "-c", _EVERY_16_BIT_VALUE, str(paths[tables])],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    computed = torch.load(paths["0"])
    assert len(computed) == 20
    for tables in ("1", "computed", "lookup", "measure"):
        by_tables = torch.load(paths[tables])
        assert by_tables.keys() == computed.keys()
        for case, got in by_tables.items():
            want = computed[case]
            if got.is_floating_point():
                # NaN's sign and payload follow the compiler's operand order (kit: any NaN is NaN).
                both_nan = got.isnan() & want.isnan()
                got, want = got.view(torch.int16)[~both_nan], want.view(torch.int16)[~both_nan]
            assert torch.equal(got, want), (tables, case)


def test_vllm_c_goes_first_only_on_platforms_it_has_kernels_for():
    """vllm_c builds CPU and CUDA kernels, no HIP ones: on ROCm it could only decline every GPU
    call, so no family puts it first there (aiter's and the others' defaults lead)."""
    import vllm_ir_provider_vllm_c as vllm_c

    first = {family.__name__: set(getattr(family, "EAGER_FIRST", {})) for family in vllm_c.FAMILIES}
    assert all(platforms <= {"cpu", "cuda"} for platforms in first.values()), first
