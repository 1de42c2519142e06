"""First dispatch from many threads at once: every thread sees the fully loaded providers.

Each test runs in a fresh interpreter, where discovery has not run yet, with a real test-built
provider distribution whose import is slow enough that the other threads arrive mid-load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import vllm_ir
from tests.plugin_dists import isolated_site, make_dist
from vllm_ir import ProviderRecord, ProviderStatus

THREADS = 8

#: A provider that takes a while to import and asks to be the default for rms_norm.
SLOW_PROVIDER = """
import threading
import time

import vllm_ir
from torch import Tensor

time.sleep(0.5)  # the other threads reach their first call while this import runs
RAN_IN = []

@vllm_ir.ops.rms_norm.register_impl("tp_slow")
def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    RAN_IN.append(threading.get_ident())
    return vllm_ir.ops.rms_norm.fn(x, weight, epsilon, variance_size)

@vllm_ir.hookimpl
def vllm_ir_default_priority(platform, mode):
    return {"rms_norm": ["tp_slow"]}
"""

#: Eight threads make their first call behind a barrier; prints what each one saw as JSON.
RACE = """
import json
import sys
import threading

import torch

import vllm_ir

SCOPED = sys.argv[1] == "scoped"
barrier = threading.Barrier({threads})
results = {{}}


def first_call(i):
    x, w = torch.randn(4, 16), torch.ones(16)
    barrier.wait()
    try:
        if SCOPED:
            with vllm_ir.priority(rms_norm=["tp_slow"]):
                vllm_ir.ops.rms_norm(x, w, 1e-6)
                results[i] = vllm_ir.ops.rms_norm.dispatch(x, w, 1e-6).provider
        else:
            vllm_ir.ops.rms_norm(x, w, 1e-6)
            results[i] = vllm_ir.ops.rms_norm.dispatch(x, w, 1e-6).provider
    except BaseException as exc:
        results[i] = f"{{type(exc).__name__}}: {{exc}}"


threads = [threading.Thread(target=first_call, args=(i,)) for i in range({threads})]
for t in threads:
    t.start()
for t in threads:
    t.join()
x, w = torch.randn(4, 16), torch.ones(16)
print(json.dumps({{
    "results": [results.get(i, "no result") for i in range({threads})],
    "kernel_threads": len(set(sys.modules["tp_slow"].RAN_IN)),
    "later": vllm_ir.ops.rms_norm.explain(x, w, 1e-6).chosen,
}}))
"""


@pytest.fixture
def race(tmp_path) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    make_dist(site, "tp-slow", SLOW_PROVIDER)
    script = tmp_path / "race.py"
    script.write_text(textwrap.dedent(RACE.format(threads=THREADS)))
    return script


def _run(script: Path, variant: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_IR_DISABLE_PLUGIN_AUTOLOAD", "VLLM_IR_PROVIDERS")}
    env["VLLM_IR_PROVIDERS"] = "tp_slow"  # only the test provider: fast and deterministic
    env["PYTHONPATH"] = os.pathsep.join([str(script.parent / "site"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script), variant], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_first_calls_from_many_threads_all_see_the_loaded_providers(race):
    out = _run(race, "plain")
    assert out["later"] == "tp_slow"
    assert out["results"] == ["tp_slow"] * THREADS
    assert out["kernel_threads"] == THREADS  # each thread's very first call ran the provider's kernel


def test_first_scoped_priorities_from_many_threads_know_every_provider(race):
    out = _run(race, "scoped")
    assert out["later"] == "tp_slow"
    assert out["results"] == ["tp_slow"] * THREADS
    assert out["kernel_threads"] == THREADS


#: A provider whose import re-enters discovery: it asks for the records, the platform and a call.
REENTRANT = """
import torch

import vllm_ir
from torch import Tensor

@vllm_ir.ops.rms_norm.register_impl("tp_reentrant")
def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    return vllm_ir.ops.rms_norm.fn(x, weight, epsilon, variance_size)

SEEN = [r.name for r in vllm_ir.load_providers()]
PLATFORM = vllm_ir.current_platform().name
vllm_ir.ops.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    yield from isolated_site(tmp_path, monkeypatch)


def test_discovery_reentered_by_a_plugin_import_does_not_deadlock(site):
    make_dist(site, "tp-reentrant", REENTRANT)
    done: list[list[ProviderRecord]] = []
    worker = threading.Thread(target=lambda: done.append(vllm_ir.provider_records()), daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "discovery deadlocked on itself"
    records = {r.name: r for r in done[0]}
    assert records["tp_reentrant"].status is ProviderStatus.LOADED
    assert "tp_reentrant" in sys.modules["tp_reentrant"].SEEN
    x, w = torch.randn(3, 16), torch.ones(16)
    with vllm_ir.priority(rms_norm=["tp_reentrant"]):
        assert vllm_ir.ops.rms_norm.dispatch(x, w, 1e-6).provider == "tp_reentrant"
