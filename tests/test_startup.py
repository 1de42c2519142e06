"""Start-up imports nothing heavy: ``import vllm_ir`` and discovery of every installed provider
(benchmarks/startup.py measures the time; this checks what gets imported, which does not vary)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

#: Libraries no provider needs to declare its support here (each costs 0.1-2 s to import).
HEAVY = ("numpy", "transformers", "triton", "matplotlib")

PROBE = r"""
import json, sys
import torch
before = set(sys.modules)
import vllm_ir
records = vllm_ir.load_providers()
print(json.dumps({"new": sorted(set(sys.modules) - before), "providers": {r.name: r.status.value for r in records}}))
"""


def test_import_and_discovery_import_no_heavy_library():
    """numpy comes with torch; what vllm_ir adds must not include it (nor a submodule of it) or the others."""
    environ = {
        k: v for k, v in os.environ.items() if not k.startswith(("VLLM_IR_", "VLLM_BATCH")) and k != "TRITON_INTERPRET"
    }
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=environ, check=False
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "vllm_ir" in report["new"]
    heavy = [m for m in report["new"] if m.split(".")[0] in HEAVY]
    assert heavy == [], f"imported at start-up: {heavy} (providers: {report['providers']})"
