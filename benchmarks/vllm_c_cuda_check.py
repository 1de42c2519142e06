"""vllm_c's CUDA kernels on a GPU machine: build, check against native, measure bandwidth.

Needs a CUDA build of torch and nvcc. Builds the provider in place for this GPU's
architecture only (a minute or two), unless it is already built with CUDA kernels, then:

1. correctness: ``rms_norm`` and ``fused_add_rms_norm`` through vllm-ir dispatch with
   ``priority([vllm_c])`` against the native op, fp32/bf16/fp16, several shapes, with and
   without weight, row-strided views; the fused op in both forms (``op(...)``: the
   out-of-place kernel, ``maybe_inplace``: the in-place one on the donated tensors), which
   must agree bit for bit;
   the activation ops (gated and elementwise, every scalar variant, remainders, row-strided
   gated inputs, non-contiguous elementwise inputs, NaN and inf) against native within the
   ops' tolerances;
2. bandwidth: [T, hidden] for several T, the vllm_c torch ops (preallocated outputs; the fused
   op in place and out of place; the activations) against native eager and ``copy_`` of the
   same bytes, CUDA-event timed.

    python benchmarks/vllm_c_cuda_check.py [--no-build] [--hidden 4096]

Exit status 0 when every correctness case passes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def build() -> None:
    major, minor = torch.cuda.get_device_capability()
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")}
    env.setdefault("MAX_JOBS", str(min(16, os.cpu_count() or 2)))
    env["VLLM_IR_C_STRICT_BUILD"] = "1"  # here a failed build is the finding
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-build-isolation",
        "--no-deps",
        "-e",
        str(REPO / "providers/vllm_c"),
    ]
    print("building:", " ".join(cmd), f"(TORCH_CUDA_ARCH_LIST={env['TORCH_CUDA_ARCH_LIST']})", flush=True)
    subprocess.run(cmd, check=True, env=env)


def check_correctness(vllm_ir) -> int:
    failures = 0
    rms, fused = vllm_ir.ops.rms_norm, vllm_ir.ops.fused_add_rms_norm
    cases = [(t, h) for t in (1, 3, 64, 4096) for h in (1, 7, 64, 4096, 5120)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        atol, rtol = rms.tolerance(dtype)
        for tokens, hidden in cases:
            for with_weight in (True, False):
                x, res, w, eps, _ = fused.generate_inputs((tokens, hidden), dtype, "cuda", with_weight=with_weight)
                with vllm_ir.priority(rms_norm=["vllm_c"], fused_add_rms_norm=["vllm_c"]):
                    chosen = (rms.dispatch(x, w, eps).provider, fused.dispatch(x, res, w, eps).provider)
                    got = [rms(x, w, eps), *fused(x, res, w, eps)]
                want = [rms.fn(x, w, eps), *fused.fn(x, res, w, eps)]
                name = f"{dtype} [{tokens}, {hidden}] weight={with_weight}"
                failures += _compare(name, chosen, got, want, atol, rtol)
        # Row-strided views and the in-place overload.
        wide_x = torch.randn(64, 4096 + 8, device="cuda").to(dtype)
        wide_r = torch.randn(64, 4096 + 8, device="cuda").to(dtype)
        x, res = wide_x[:, 8:], wide_r[:, :4096]
        w = (torch.rand(4096, device="cuda") + 0.5).to(dtype)
        want = [rms.fn(x, w, 1e-6), *fused.fn(x, res, w, 1e-6)]
        with vllm_ir.priority(rms_norm=["vllm_c"], fused_add_rms_norm=["vllm_c"]):
            chosen = (rms.dispatch(x, w, 1e-6).provider, fused.dispatch(x, res, w, 1e-6).provider)
            y = rms(x, w, 1e-6)
            out, new_res = fused.maybe_inplace(x, res, w, 1e-6)
        aliased = out.data_ptr() == x.data_ptr() and new_res.data_ptr() == res.data_ptr()
        failures += _compare(f"{dtype} row-strided, maybe_inplace", chosen, [y, out, new_res], want, atol, rtol)
        if not aliased:
            print(f"FAIL {dtype} maybe_inplace did not return the donated tensors")
            failures += 1
        # Both forms of the fused op: the same row function, so the same bits.
        x, res, w, eps, _ = fused.generate_inputs((64, 5120), dtype, "cuda")
        with vllm_ir.priority(fused_add_rms_norm=["vllm_c"]):
            functional = fused(x, res, w, eps)
            donated = fused.maybe_inplace(x.clone(), res.clone(), w, eps)
        if not all(torch.equal(a, b) for a, b in zip(functional, donated, strict=True)):
            print(f"FAIL {dtype} the out-of-place and in-place fused kernels differ")
            failures += 1
    return failures


#: Activation ops and the scalar arguments each is checked with.
ACTIVATION_CALLS = {
    "silu_and_mul": [()],
    "mul_and_silu": [()],
    "gelu_and_mul": [("none",), ("tanh",)],
    "fatrelu_and_mul": [(0.0,), (0.5,)],
    "swigluoai_and_mul": [(1.702, 7.0), (1.0, 3.0)],
    "gelu_new": [()],
    "gelu_fast": [()],
    "quick_gelu": [()],
    "relu2": [()],
}
GATED = ("silu_and_mul", "mul_and_silu", "gelu_and_mul", "fatrelu_and_mul", "swigluoai_and_mul")


def check_activations(vllm_ir) -> int:
    failures = 0
    for name, calls in ACTIVATION_CALLS.items():
        op = getattr(vllm_ir.ops, name)
        gated = name in GATED
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            atol, rtol = op.tolerance(dtype)
            inputs = []
            for tokens, width in ((1, 7), (3, 64), (64, 4096), (257, 4099)):
                inputs.append(
                    (f"[{tokens}, {width}]", 3 * torch.randn(tokens, width * (2 if gated else 1), device="cuda"))
                )
            wide = 3 * torch.randn(16, 2 * 1000 + 6, device="cuda")
            inputs.append(("row-strided", wide[:, 3 : 3 + (2000 if gated else 1000)]))
            if not gated:
                inputs.append(("transposed", wide[:, :1000].t()))
                inputs.append(("stride 3", wide[:, ::3]))
            special = 3 * torch.randn(4, 2 * 72 if gated else 72, device="cuda")
            special[:, :7] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e4, -1e4])
            inputs.append(("nan/inf", special))
            for label, x32 in inputs:
                x = x32.to(dtype)
                for scalars in calls:
                    args = (x, *scalars)
                    with vllm_ir.priority(**{name: ["vllm_c"]}):
                        chosen = (op.dispatch(*args).provider,)
                        got = [op(*args)]
                    want = [op.fn(*args)]
                    failures += _compare(f"{name}{scalars} {dtype} {label}", chosen, got, want, atol, rtol)
    return failures


def _compare(name, chosen, got, want, atol, rtol) -> int:
    if set(chosen) != {"vllm_c"}:
        print(f"FAIL {name}: dispatch chose {chosen}")
        return 1
    for g, w in zip(got, want, strict=True):
        try:
            torch.testing.assert_close(g, w, atol=atol, rtol=rtol, equal_nan=True)
        except AssertionError as e:
            print(f"FAIL {name}: {str(e).splitlines()[0]}")
            return 1
    return 0


def _time_us(fn, iters: int = 200) -> float:
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return sorted(samples)[len(samples) // 2]


def _cases(vllm_ir, tokens: int, hidden: int, dtype: torch.dtype) -> dict:
    """Per op: (native, vllm_c torch op, copy_ of the same bytes, bytes vllm_c moves)."""
    rms, fused = vllm_ir.ops.rms_norm, vllm_ir.ops.fused_add_rms_norm
    kernel, fused_kernel = torch.ops.vllm_ir_c.rms_norm.default, torch.ops.vllm_ir_c.fused_add_rms_norm.default
    fused_out_kernel = torch.ops.vllm_ir_c.fused_add_rms_norm_out.default
    x, res, w, eps, _ = fused.generate_inputs((tokens, hidden), dtype, "cuda")
    out, dst = torch.empty_like(x), torch.empty_like(x)
    new_out, new_res = torch.empty_like(x), torch.empty_like(x)
    src2, dst2 = torch.cat([x, res]), torch.empty(2 * tokens, hidden, dtype=dtype, device="cuda")
    nbytes = 2 * x.numel() * x.element_size()
    return {
        "rms_norm": (lambda: rms.fn(x, w, eps), lambda: kernel(out, x, w, eps), lambda: dst.copy_(x), nbytes),
        "fused_add_rms_norm": (
            lambda: fused.fn(x, res, w, eps),
            lambda: fused_kernel(x, res, w, eps),  # in place, call after call
            lambda: dst2.copy_(src2),
            2 * nbytes,
        ),
        "fused_add_rms_norm_out": (
            lambda: fused.fn(x, res, w, eps),
            lambda: fused_out_kernel(new_out, new_res, x, res, w, eps),
            lambda: dst2.copy_(src2),
            2 * nbytes,
        ),
        **_activation_cases(vllm_ir, tokens, hidden, dtype),
    }


def _activation_cases(vllm_ir, tokens: int, hidden: int, dtype: torch.dtype) -> dict:
    cases = {}
    for name, calls in ACTIVATION_CALLS.items():
        op, kernel = getattr(vllm_ir.ops, name), getattr(torch.ops.vllm_ir_c, name).default
        x = torch.randn(tokens, 2 * hidden if name in GATED else hidden, device="cuda").to(dtype)
        out = torch.empty(tokens, hidden, device="cuda", dtype=dtype)
        moved = (x.numel() + out.numel()) * x.element_size()
        src = torch.empty(moved // 2 // x.element_size(), device="cuda", dtype=dtype)
        dst = torch.empty_like(src)
        args = (x, *calls[0])
        cases[name] = (
            lambda op=op, args=args: op.fn(*args),
            lambda kernel=kernel, out=out, args=args: kernel(out, *args),
            lambda src=src, dst=dst: dst.copy_(src),
            moved,
        )
    return cases


def measure_bandwidth(vllm_ir, hidden: int) -> None:
    print(f"\n{torch.cuda.get_device_name()}: [T, {hidden}], us per call (median of 5 x 200); GB/s of vllm_c")
    print(f"{'op':<22} {'dtype':<9} {'T':>6} {'native':>9} {'vllm_c':>9} {'copy_':>9} {'GB/s':>7} {'of copy':>7}")
    for dtype in (torch.bfloat16, torch.float32):
        for tokens in (1, 16, 256, 4096, 16384):
            for op_name, (native, vllm_c, copy, moved) in _cases(vllm_ir, tokens, hidden, dtype).items():
                t_native, t_vllm_c, t_copy = _time_us(native), _time_us(vllm_c), _time_us(copy)
                print(
                    f"{op_name:<22} {str(dtype)[6:]:<9} {tokens:>6} {t_native:>9.2f} {t_vllm_c:>9.2f} {t_copy:>9.2f} "
                    f"{moved / t_vllm_c / 1e3:>7.0f} {t_copy / t_vllm_c:>7.2f}"
                )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-build", action="store_true", help="use the installed build as it is")
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.version.cuda is None:
        print(f"needs a CUDA GPU and a CUDA build of torch (torch {torch.__version__}, cuda {torch.version.cuda})")
        return 2
    try:
        import vllm_ir_provider_vllm_c as provider

        built = provider.STATUS.loaded and provider.STATUS.cuda_kernels
    except ImportError:
        built = False
    if not built and not args.no_build:
        build()
        # A fresh interpreter imports the new library (a loaded one cannot be replaced).
        return subprocess.run([sys.executable, __file__, "--no-build", "--hidden", str(args.hidden)]).returncode

    import vllm_ir_provider_vllm_c as provider

    import vllm_ir

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, vllm_c status: {provider.STATUS}")
    if not (provider.STATUS.loaded and provider.STATUS.cuda_kernels):
        print("vllm_c has no CUDA kernels in this build")
        return 1
    failures = check_correctness(vllm_ir) + check_activations(vllm_ir)
    print(f"correctness: {'all passed' if failures == 0 else f'{failures} FAILED'}")
    measure_bandwidth(vllm_ir, args.hidden)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
