"""The vllm_c provider: C++ kernels against the native oracle, declines with reasons, tracing.

Importing ``vllm_ir_provider_vllm_c`` registers its implementations (as plugin discovery
would); that happens at collection, before conftest's per-test registry snapshot, so every
test sees them. Kernel tests are skipped, with the provider's own reason, when the extension
is not usable; the import-safety and CUDA compile checks run regardless.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch

import vllm_ir
from vllm_ir import platforms

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
    assert FUSED.impls["vllm_c"].inplace and not RMS.impls["vllm_c"].inplace
    # Batch-invariant only where no CUDA kernels are built (their reduction order varies).
    cuda_built = provider.STATUS.cuda_kernels and torch.version.hip is None
    assert RMS.impls["vllm_c"].batch_invariant == FUSED.impls["vllm_c"].batch_invariant == (not cuda_built)


def test_default_priority_puts_vllm_c_first_on_cpu_in_eager_mode_only():
    contribution = provider.vllm_ir_default_priority(platforms.CPU, "eager")
    assert contribution == {"rms_norm": ["vllm_c"], "fused_add_rms_norm": ["vllm_c"]}
    # Compiled, Inductor fuses native norms with their neighbours (benchmarks/compile_pipeline.py).
    assert provider.vllm_ir_default_priority(platforms.CPU, "compile") is None
    assert provider.vllm_ir_default_priority(platforms.CUDA, "eager") is None
    assert provider.vllm_ir_default_priority(platforms.ROCM, "compile") is None


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
    mismatches = (out != native).sum().item()
    assert mismatches <= out.numel() // 1000, f"{mismatches} elements differ from native"


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
        ("weight_dtype", "weight dtype torch.float32 differs from x dtype torch.bfloat16"),
        ("float64", "dtype torch.float64 is not supported"),
        ("meta_device", "device meta is not supported (kernels built for: cpu"),
        ("weight_2d", "weight is 2-d"),
    ],
)
def test_rms_norm_declines_with_reason(case, reason):
    x, w, eps, _ = RMS.generate_inputs((3, 16), torch.bfloat16)
    args = {
        "variance_size": (x, w, eps, 8),
        "weight_dtype": (x, w.float(), eps, None),
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
    assert verdict.status == "declined" and "x_residual dtype torch.float32 differs" in verdict.reason


@needs_kernels
def test_kernels_reject_inconsistent_arguments():
    x = torch.randn(3, 16)
    with pytest.raises(RuntimeError, match=r"weight must have shape \[16\]"):
        torch.ops.vllm_ir_c.rms_norm(torch.empty_like(x), x, torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="residual has shape"):
        torch.ops.vllm_ir_c.fused_add_rms_norm(x, torch.randn(2, 16), None, 1e-6)
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        torch.ops.vllm_ir_c.rms_norm(torch.empty_like(x.double()), x.double(), None, 1e-6)


# ---------------------------------------------------------------------------------------
# tracing


@needs_kernels
def test_ops_trace_as_single_opaque_nodes():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, res, w):
        out = torch.empty_like(x)
        torch.ops.vllm_ir_c.rms_norm(out, x, w, 1e-6)
        torch.ops.vllm_ir_c.fused_add_rms_norm(x, res, w, 1e-6)
        return out, x, res

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 32), torch.randn(4, 32), torch.ones(32))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.vllm_ir_c.rms_norm.default) == 1
    assert targets.count(torch.ops.vllm_ir_c.fused_add_rms_norm.default) == 1


@needs_kernels
def test_impls_compile_with_fake_tensors():
    rms_impl, fused_impl = RMS.impls["vllm_c"].fn, FUSED.impls["vllm_c"].fn

    def f(x, res, w):
        y = rms_impl(x, w, 1e-6)
        out, new_res = fused_impl(x.clone(), res.clone(), w, 1e-6)
        return y, out, new_res

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
        atol, rtol = rms.tolerance(dtype)
        for shape in ((5, 7), (3, 4096), (2, 3, 100)):
            for with_weight in (True, False):
                x, res, w, eps, _ = fused.generate_inputs(shape, dtype, with_weight=with_weight)
                assert rms.dispatch(x, w, eps).provider == "vllm_c"
                pairs = [(rms(x, w, eps), rms.fn(x, w, eps))]
                pairs += list(zip(fused(x, res, w, eps), fused.fn(x, res, w, eps)))
                for got, want in pairs:
                    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
print("ok")
"""


@needs_kernels
@pytest.mark.parametrize("variant", ["DEFAULT", "AVX2", "AVX512", "AVX512_BF16"])
def test_every_compiled_cpu_variant_matches_native(variant):
    from vllm_ir_provider_vllm_c import _build_info

    if variant not in _build_info.CPU_CAPABILITIES:
        pytest.skip(f"the {variant} kernels were not compiled on this machine")
    if variant == provider.cpu_capability():
        pytest.skip(f"{variant} runs in this process: covered by the other tests")
    env = {**os.environ, "VLLM_IR_C_CPU_CAPABILITY": variant}
    done = subprocess.run([sys.executable, "-c", _VARIANT_CHECK], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    ran, verdict = done.stdout.split()
    if ran != variant:
        pytest.skip(f"this CPU cannot run {variant} (ran {ran})")
    assert verdict == "ok"


# ---------------------------------------------------------------------------------------
# CUDA sources: compile-checked wherever nvcc exists, even with a CPU build of torch


def _torch_includes() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    return [f"-I{p}" for p in include_paths()]


def _cuda_include_dir(nvcc: str) -> Path | None:
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    candidates.append(str(Path(nvcc).resolve().parents[1]))
    for root in filter(None, candidates):
        if (Path(root) / "include" / "cuda_runtime.h").exists():
            return Path(root) / "include"
    return None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: CUDA kernels not compile-checked")
def test_cuda_sources_compile(tmp_path):
    """nvcc compiles the kernels; the host compiler checks the torch glue (sm_90, torch's flags).

    A CPU build of torch lacks one generated header of c10/cuda (cuda_cmake_macros.h); the
    glue check supplies its one-line content from a temporary directory.
    """
    nvcc = shutil.which("nvcc")
    cuda_include = _cuda_include_dir(nvcc)
    if cuda_include is None:
        pytest.skip(f"no CUDA include directory with cuda_runtime.h found next to {nvcc}")
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
    kernels = [nvcc, "-c", str(SOURCES / "cuda" / "rms_norm_kernels.cu"), "-o", str(tmp_path / "k.o")]
    kernels += ["-std=c++20", "-O1", "-gencode", "arch=compute_90,code=sm_90", *torch_flags, *_torch_includes()]
    glue = [shutil.which("c++") or "g++", "-fsyntax-only", "-std=c++20", str(SOURCES / "cuda" / "ops_cuda.cpp")]
    glue += [f"-I{tmp_path / 'stub'}", *_torch_includes(), f"-I{cuda_include}", f"-I{sysconfig.get_paths()['include']}"]
    jobs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for cmd in (kernels, glue)
    ]
    for cmd, job in zip((kernels, glue), jobs, strict=True):
        output, _ = job.communicate(timeout=300)
        assert job.returncode == 0, f"{' '.join(cmd)}\n{output[-4000:]}"
