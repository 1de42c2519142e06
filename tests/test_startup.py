"""Start-up imports nothing heavy: ``import vllm_ir`` and discovery of every installed provider
(benchmarks/startup.py measures the time; this checks what gets imported and defined, and that a
second process reads the generated entry points back from the code cache instead of compiling)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

#: Libraries no provider needs to declare its support here (each costs 0.1-2 s to import).
HEAVY = ("numpy", "transformers", "triton", "matplotlib")
#: The custom-op namespace of each vendor provider whose ops are defined only where it can run.
VENDOR_NAMESPACES = {"aiter": "vllm_ir_aiter", "flashinfer": "vllm_ir_flashinfer", "xpu_kernels": "vllm_ir_xpu_kernels"}

PROBE = r"""
import json, sys
import torch
before = set(sys.modules)
opdefs = set(torch._library.custom_ops.OPDEFS)
compiled = []  # every compile() of a generated function (an audit hook: nothing of vllm_ir imported yet)
sys.addaudithook(lambda event, args: event == "compile" and compiled.append(str(args[1])))
import vllm_ir
records = vllm_ir.load_providers()
print(json.dumps({
    "new": sorted(set(sys.modules) - before),
    "providers": {r.name: r.status.value for r in records},
    "custom_ops": sorted(set(torch._library.custom_ops.OPDEFS) - opdefs),
    "compiled": [f for f in compiled if f.startswith("<vllm_ir.ops.")],
}))
"""


def _probe(**env: str) -> dict:
    environ = {
        k: v for k, v in os.environ.items() if not k.startswith(("VLLM_IR_", "VLLM_BATCH")) and k != "TRITON_INTERPRET"
    }
    environ.update(env)
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=environ, check=False
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_and_discovery_import_no_heavy_library():
    """numpy comes with torch; what vllm_ir adds must not include it (nor a submodule of it) or the others."""
    report = _probe()
    assert "vllm_ir" in report["new"]
    heavy = [m for m in report["new"] if m.split(".")[0] in HEAVY]
    assert heavy == [], f"imported at start-up: {heavy} (providers: {report['providers']})"


def test_vendor_providers_that_cannot_run_define_no_custom_op():
    """Their kernel bindings are registered (unsupported); their custom ops wait for a first call."""
    report = _probe()
    for name, namespace in VENDOR_NAMESPACES.items():
        defined = [q for q in report["custom_ops"] if q.startswith(f"{namespace}::")]
        if report["providers"].get(name) == "unsupported here":
            assert defined == [], f"{name} cannot run here but defined {defined}"


def test_a_second_process_reads_the_entry_points_from_the_code_cache(tmp_path):
    # Written as bytecode is (an empty PYTHONDONTWRITEBYTECODE is unset), into a cache of its own.
    first = _probe(XDG_CACHE_HOME=str(tmp_path), PYTHONDONTWRITEBYTECODE="")
    declared = [f for f in first["compiled"] if f.endswith(".default>")]
    assert len(declared) >= 20, "a fresh cache compiles every declared op's entry points"
    assert any(".supports." in f for f in first["compiled"]), "and the providers' adapted predicates"
    assert os.listdir(tmp_path / "vllm_ir" / "code")
    second = _probe(XDG_CACHE_HOME=str(tmp_path), PYTHONDONTWRITEBYTECODE="")
    assert second["compiled"] == [], "the second process compiled generated code again"
    assert second["providers"] == first["providers"]
