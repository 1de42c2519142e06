"""Start-up cost: ``import vllm_ir`` plus discovery of every installed provider, over ``import torch``.

Target (issue 3): under 150 ms on this machine (the existing ``import vllm.ir`` adds ~1.2 s).
Each sample is a fresh interpreter that imports torch first, then times vllm_ir on top.

    python benchmarks/startup.py [--runs 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from vllm_ir.timing import machine_summary

PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import vllm_ir
t2 = time.perf_counter()
records = vllm_ir.load_providers()
t3 = time.perf_counter()
heavy = sorted(m for m in ("triton", "aiter", "vllm_xpu_kernels", "intel_extension_for_pytorch") if m in sys.modules)
print(json.dumps({"torch": t1 - t0, "import": t2 - t1, "discovery": t3 - t2,
                  "providers": {r.name: r.status.value for r in records}, "heavy": heavy}))
"""

TARGET_MS = 150.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    print(machine_summary())
    samples = []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
        samples.append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {k: statistics.median(s[k] for s in samples) * 1e3 for k in ("torch", "import", "discovery")}
    total = statistics.median((s["import"] + s["discovery"]) * 1e3 for s in samples)
    print(f"providers: {samples[-1]['providers'] or 'none installed'}")
    print(f"heavy vendor modules imported by discovery: {samples[-1]['heavy'] or 'none'}")
    print(f"median over {args.runs} fresh processes (ms):")
    print(f"  import torch                  {med['torch']:8.1f}")
    print(f"  import vllm_ir                {med['import']:8.1f}")
    print(f"  load_providers()              {med['discovery']:8.1f}")
    verdict = "meets" if total <= TARGET_MS else "misses"
    print(f"  vllm_ir total over torch      {total:8.1f}  ({verdict} the {TARGET_MS:.0f} ms target)")


if __name__ == "__main__":
    main()
