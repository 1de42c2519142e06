"""GPU check of the Triton provider (run on a lent GPU machine, a few minutes).

Correctness against native on CUDA for fp32/bf16/fp16, bandwidth of [4096, 8192] bf16 as
GB/s and % of the H200's 4.8 TB/s, latency for [1..64, 4096], and, when the compile
pipeline is available, that torch.compile lowers the IR op to the Triton kernel.

    python benchmarks/triton_gpu_check.py
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import torch

import vllm_ir
from vllm_ir.tools.timing import machine_summary, time_cuda

PEAK_GBPS = 4800.0


def _outputs(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def check_correctness() -> int:
    failures = 0
    for op in (vllm_ir.ops.rms_norm, vllm_ir.ops.fused_add_rms_norm):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for shape in ((1, 4096), (7, 5120), (64, 8192), (3, 5, 4096)):
                args = op.generate_inputs(shape, dtype, "cuda")
                expected = op.fn(*args)
                with vllm_ir.priority(**{op.name: ["triton"]}):
                    assert op.dispatch(*args).provider == "triton"
                    got = op(*args)
                atol, rtol = op.tolerance(dtype)
                for g, e in zip(_outputs(got), _outputs(expected), strict=True):
                    if not torch.allclose(g.float(), e.float(), atol=atol, rtol=rtol):
                        failures += 1
                        err = (g.float() - e.float()).abs().max().item()
                        print(f"MISMATCH {op.name} {dtype} {shape}: max err {err:.3g}")
    print("correctness:", "ok" if not failures else f"{failures} failures")
    return failures


def measure(op: Any) -> None:
    impl = op.impls["triton"].fn
    args = op.generate_inputs((4096, 8192), torch.bfloat16, "cuda")
    x = args[0]
    t = time_cuda(lambda: impl(*args))
    bytes_moved = x.numel() * x.element_size() * (4 if op.name == "fused_add_rms_norm" else 2)
    gbps = bytes_moved / t.median_us / 1e3
    print(f"{op.name} [4096, 8192] bf16: {t.median_us:.1f} us, {gbps:.0f} GB/s, {gbps / PEAK_GBPS:.0%} of 4.8 TB/s")
    native = time_cuda(lambda: op.fn(*args))
    print(f"  native eager: {native.median_us:.1f} us ({native.median_us / t.median_us:.1f}x the Triton time)")
    for tokens in (1, 4, 16, 64):
        small = op.generate_inputs((tokens, 4096), torch.bfloat16, "cuda")
        print(f"  [{tokens}, 4096] latency {time_cuda(lambda s=small: impl(*s)).median_us:.2f} us")


def check_compiled() -> int:
    if importlib.util.find_spec("vllm_ir.passes") is None:
        print("vllm_ir.passes not available: compile check skipped")
        return 0

    def model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return vllm_ir.ops.rms_norm(x, w, 1e-6) * 2

    x, w, _, _ = vllm_ir.ops.rms_norm.generate_inputs((32, 4096), torch.bfloat16, "cuda")
    with vllm_ir.priority(rms_norm=["triton"]):
        out = vllm_ir.compile(model)(x, w)
    ok = torch.allclose(out.float(), model(x, w).float(), atol=2e-2, rtol=2e-2)
    print("torch.compile with vllm-ir passes over triton:", "ok" if ok else "MISMATCH")
    return 0 if ok else 1


def check_activations() -> int:
    """gelu_and_mul_sparse (both approximations, eager within tolerance, latency against native,
    torch.compile over its triton_op) and gelu_new / gelu_fast against native's bits for every
    finite 16-bit value (the step rounding; torch's CUDA pow rounds x * x for fp16 too)."""
    failures = 0
    op = vllm_ir.ops.gelu_and_mul_sparse
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape in ((1, 2048), (7, 5120), (64, 8192)):
            for approximate in ("tanh", "none"):
                x, m, _ = op.generate_inputs(shape, dtype, "cuda")
                expected = op.fn(x, m, approximate)
                with vllm_ir.priority(gelu_and_mul_sparse=["triton"]):
                    assert op.dispatch(x, m, approximate).provider == "triton"
                    got = op(x, m, approximate)
                atol, rtol = op.tolerance(dtype)
                if not torch.allclose(got.float(), expected.float(), atol=atol, rtol=rtol):
                    failures += 1
                    print(f"MISMATCH gelu_and_mul_sparse {dtype} {shape} {approximate}")
    impl = op.impls["triton"].fn
    for tokens in (1, 16, 256, 4096):
        args = op.generate_inputs((tokens, 8192), torch.bfloat16, "cuda")
        t, n = time_cuda(lambda a=args: impl(*a)), time_cuda(lambda a=args: op.fn(*a))
        print(f"gelu_and_mul_sparse [{tokens}, 8192] bf16: triton {t.median_us:.1f} us, native {n.median_us:.1f} us")

    def model(x: torch.Tensor) -> torch.Tensor:
        return vllm_ir.ops.gelu_and_mul_sparse(x * 2, 1.6448536269514722, "tanh") + 1

    x = op.generate_inputs((32, 8192), torch.bfloat16, "cuda")[0]
    with vllm_ir.priority(gelu_and_mul_sparse=["triton"]):
        out = vllm_ir.compile(model)(x)
    ok = torch.allclose(out.float(), model(x).float(), atol=2e-2, rtol=2e-2)
    print("torch.compile over the gelu_and_mul_sparse triton_op:", "ok" if ok else "MISMATCH")
    failures += not ok
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32, device="cuda").to(torch.int16)
    for name in ("gelu_new", "gelu_fast"):
        elementwise = getattr(vllm_ir.ops, name)
        for dtype in (torch.bfloat16, torch.float16):
            v = every.view(dtype)
            v = v[v.isfinite()]
            want = elementwise.fn(v)
            with vllm_ir.priority(**{name: ["triton"]}):
                got = elementwise(v)
            keep = ~(want.isnan() & got.isnan())
            differ = int((got.view(torch.int16) != want.view(torch.int16))[keep].sum())
            print(f"{name} {dtype} triton vs native: {differ} of {v.numel()} values differ in bits")
    return failures


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this script needs a GPU")
        return 2
    print(machine_summary(), torch.cuda.get_device_name())
    record = vllm_ir.load_provider("triton")
    print("triton provider:", record.status.value, record.reason or "")
    failures = check_correctness()
    for op in (vllm_ir.ops.rms_norm, vllm_ir.ops.fused_add_rms_norm):
        measure(op)
    failures += check_compiled()
    failures += check_activations()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
