"""vLLM IR's own eager dispatch overhead (``vllm.ir``, vLLM 0.33.0), measured like dispatch_overhead.py.

Runs under the reference environment that ``scripts/setup_vllm_reference.sh`` creates (the
same torch 2.13.0 CPU build, ``vllm==0.33.0`` installed without its dependencies, plus the
few pure-Python packages ``import vllm.ir`` needs), never under .venv, and without vllm_ir:
each side is measured in a process of its own (beside vLLM, vllm_ir moves its ops to the
``vllm_ir_core`` namespace; see README, "Using vllm-ir providers from vLLM").
``benchmarks/dispatch_overhead.py`` runs this script in fresh processes alternating
with its own and prints the figures side by side.

The cases are dispatch_overhead.py's: ``vllm.ir.ops.rms_norm`` at [1, 4096] and [16, 4096]
fp32 with priority [native] and [a provider whose ``supports_args`` declines, native],
timed with the same ``paired_overhead`` (vllm_ir's ``timing.py``, loaded from its file so
that vllm_ir itself is not imported here). Figures, each a median of per-pair differences, us:
- "with kernel": ``op(x, w, eps)`` vs ``op.impls["native"].impl_fn(x, w, eps)``, with torch
  wrapping off, which is what vLLM runs eagerly: ``ir_enable_torch_wrap`` defaults to True
  only for VLLM_COMPILE with the Inductor backend, and the CPU platform sets it to False;
- "dispatch only": the same priority ending in a no-op kernel instead of native;
- "torch.ops path": dispatch only with torch wrapping on (``op.torch_op``, the torch
  dispatcher, then ``_inner_call``): vLLM's eager call under VLLM_COMPILE + Inductor.

    build/vllm-reference/bin/python benchmarks/vllm_reference.py [--samples 2000] [--inner 20] [--threads 1]

prints one JSON object: the environment and one row per case.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
from pathlib import Path

import torch
from torch import Tensor

CASES = [(tokens, head) for tokens in (1, 16) for head in ((), ("bench_declines",))]
COLUMNS = ("with kernel", "dispatch only", "torch.ops path")
DEFAULT_TIMING = Path(__file__).resolve().parent.parent / "core" / "timing.py"


def _load_timing(path: Path):
    """vllm_ir's timing module from its file: the same measuring code, without vllm_ir's imports."""
    spec = importlib.util.spec_from_file_location("_vllm_ir_timing", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load the timing helpers from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _register_bench_providers(ir) -> None:
    op = ir.ops.rms_norm

    def declines(x, weight, epsilon, variance_size=None):
        return False

    def never(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
        raise AssertionError("never selected")

    def noop(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
        return x

    op.register_impl("bench_declines", supports_args=declines)(never)
    op.register_impl("bench_noop")(noop)


def measure_in_this_process(timing_path: Path, samples: int, inner: int) -> dict:
    timing = _load_timing(timing_path)
    import vllm
    import vllm.ir as ir

    _register_bench_providers(ir)
    op = ir.ops.rms_norm
    native = op.impls["native"].impl_fn
    noop = op.impls["bench_noop"].impl_fn

    def overhead(entry, kernel, x: Tensor, w: Tensor) -> float:
        def direct():
            return kernel(x, w, 1e-6)

        def dispatched():
            return entry(x, w, 1e-6)

        return timing.paired_overhead(direct, dispatched, samples=samples, inner=inner).median_us

    rows = []
    for tokens, head in CASES:
        x, w = torch.randn(tokens, 4096), torch.randn(4096)
        op.set_default([*head, "native"])
        assert op.get_priority() == [*head, "native"], op.get_priority()
        assert op.dispatch(x, w, 1e-6).provider == "native"
        row = {"tokens": tokens, "priority": [*head, "native"]}
        with ir.enable_torch_wrap(False):
            torch.testing.assert_close(op(x, w, 1e-6), native(x, w, 1e-6), rtol=0, atol=0)
            row["with kernel"] = overhead(op, native, x, w)
            op.set_default([*head, "bench_noop"])
            assert op(x, w, 1e-6) is x
            row["dispatch only"] = overhead(op, noop, x, w)
        with ir.enable_torch_wrap(True):
            op(x, w, 1e-6)  # through torch.ops.vllm_ir.rms_norm: the dispatcher, then the no-op kernel
            row["torch.ops path"] = overhead(op, noop, x, w)
        rows.append(row)
    # Nothing compiled from vLLM ran: vllm.ir is pure Python over torch.library.
    compiled = sorted(name for name in sys.modules if name.startswith("vllm._") and name != "vllm._version")
    assert not compiled, compiled
    return {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2000, help="interleaved pairs of blocks")
    parser.add_argument("--inner", type=int, default=20, help="calls per block")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--timing", type=Path, default=DEFAULT_TIMING, help="vllm_ir's timing.py to measure with")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    json.dump(measure_in_this_process(args.timing, args.samples, args.inner), sys.stdout)


if __name__ == "__main__":
    main()
