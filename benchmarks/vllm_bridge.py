"""What the vLLM bridge costs vLLM: start-up per process, and eager dispatch per call.

Runs under a Python that has vLLM 0.33.0 and vllm-ir (tests/test_vllm_bridge.py caches one at
build/vllm-bridge/venv/bin/python; default here). Two figures, each a median:

- start-up: ``load_general_plugins()`` in fresh processes (after ``import vllm.ir``), with
  ``VLLM_PLUGINS=vllm_ir`` (the bridge: imports vllm_ir, loads its providers, registers) vs
  ``VLLM_PLUGINS=none`` (nothing), alternating, ``--starts`` pairs;
- per call: ``vllm.ir.ops.rms_norm`` at [1, 4096] and [16, 4096] fp32, torch wrapping off (vLLM's
  eager CPU path), priority ``[vllm_ir_vllm_c, native]`` vs calling the same vllm_c kernel
  directly (paired, vllm-ir's ``timing.paired_overhead``): the bridge's predicate (vLLM asks
  it on every call; vLLM has no decision cache) plus vLLM's own dispatch.

    build/vllm-bridge/venv/bin/python benchmarks/vllm_bridge.py [--starts 5] [--samples 1000]

Set OMP_NUM_THREADS the same way for every run you compare; the machine is shared, so state the load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

STARTUP = """
import time, vllm.ir
from vllm.plugins import load_general_plugins
t = time.perf_counter(); load_general_plugins(); print(time.perf_counter() - t)
"""


def startup(starts: int) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    times: dict[str, list[float]] = {"vllm_ir": [], "none": []}
    for _ in range(starts):
        for plugins in times:
            out = subprocess.run(
                [sys.executable, "-c", STARTUP], env={**env, "VLLM_PLUGINS": plugins}, capture_output=True, text=True
            )
            if out.returncode != 0:
                raise SystemExit(out.stderr[-2000:])
            times[plugins].append(float(out.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def per_call(samples: int, inner: int) -> list[dict[str, float]]:
    import torch
    import vllm.ir
    from vllm.plugins import load_general_plugins

    from vllm_ir.integrations import vllm as vllm_bridge
    from vllm_ir.tools import timing

    os.environ.pop("VLLM_PLUGINS", None)
    load_general_plugins()
    assert vllm_bridge.state.status == "active", vllm_bridge.state
    op = vllm.ir.ops.rms_norm
    impl = op.impls["vllm_ir_vllm_c"]
    rows = []
    for tokens in (1, 16):
        x, w = torch.randn(tokens, 4096), torch.randn(4096)
        op.set_default(["vllm_ir_vllm_c", "native"])
        with vllm.ir.enable_torch_wrap(False):
            assert op.dispatch(x, w, 1e-6) is impl
            torch.testing.assert_close(op(x, w, 1e-6), op.impls["native"].impl_fn(x, w, 1e-6))
            kernel = impl.impl_fn

            def direct(kernel=kernel, x=x, w=w):
                return kernel(x, w, 1e-6)

            def dispatched(x=x, w=w):
                return op(x, w, 1e-6)

            result = timing.paired_overhead(direct, dispatched, samples=samples, inner=inner)
        rows.append({"tokens": tokens, "dispatch overhead us": result.median_us})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=5, help="fresh-process pairs for the start-up figure")
    parser.add_argument("--samples", type=int, default=1000, help="interleaved pairs of blocks per call figure")
    parser.add_argument("--inner", type=int, default=20)
    args = parser.parse_args()
    t0 = time.perf_counter()
    ms = startup(args.starts)
    rows = per_call(args.samples, args.inner)
    import torch
    import vllm

    print(
        json.dumps(
            {
                "vllm": vllm.__version__,
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "load_general_plugins ms (median)": ms,
                "bridge start-up ms": ms["vllm_ir"] - ms["none"],
                "per call": rows,
                "wall s": round(time.perf_counter() - t0, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
