"""Compile facts: what an implementation's compiled code depends on beyond its own source.

A kernel that picks a variant from an environment variable while it is traced, or a vendor
library upgraded in place, must not be served a graph Inductor cached for the old facts. A
provider declares them (``register_impl(..., compile_facts=...)``); torch's and Triton's
versions and the versions of the libraries an implementation refers to go in by default.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from torch import Tensor
from torch._dynamo.utils import counters

import vllm_ir
from tests.compile_models import KERNEL_CALLS
from vllm_ir import passes
from vllm_ir.passes import cache

ops = vllm_ir.ops
ROOT = Path(__file__).resolve().parent.parent
VARIANT = "VLLM_IR_TEST_KERNEL_VARIANT"
PROVIDER = "test_variant"

pytestmark = pytest.mark.usefixtures("compile_test_providers")


# -- a provider whose kernel choice reads the environment while it is traced -----------------


def variant_rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    if os.environ.get(VARIANT) == "b":
        return torch.ops.vllm_ir_test.rms_norm_b(x, weight, epsilon)
    return torch.ops.vllm_ir_test.rms_norm(x, weight, epsilon)


def variant_facts() -> dict[str, object]:
    return {VARIANT: os.environ.get(VARIANT)}


def register_variant() -> None:
    ops.rms_norm.register_impl(PROVIDER, compile_facts=variant_facts)(variant_rms_norm)


W = torch.randn(32, generator=torch.Generator().manual_seed(11))


def model(x: Tensor) -> Tensor:
    return ops.rms_norm(x, W, 1e-6)


@pytest.fixture
def variant(monkeypatch):
    monkeypatch.delenv(VARIANT, raising=False)
    register_variant()
    vllm_ir.set_priority(rms_norm=[PROVIDER])
    yield monkeypatch


def _uuid() -> str | None:
    return passes.LoweringPass().uuid()


# -- the uuid ----------------------------------------------------------------------------------


def test_a_declared_fact_is_read_at_every_compile_and_changes_the_uuid(variant):
    unset = _uuid()
    variant.setenv(VARIANT, "b")
    with_b = _uuid()
    assert with_b is not None and with_b != unset
    variant.setenv(VARIANT, "a")
    assert _uuid() not in (unset, with_b)
    variant.delenv(VARIANT)
    assert _uuid() == unset
    facts = passes.compile_facts()
    assert facts["rms_norm"][PROVIDER]["declared"] == {VARIANT: "None"}
    assert facts["process"]["torch"] == torch.__version__


def test_static_facts_count_and_only_for_candidates_of_the_compile_priority():
    def impl(x, weight, epsilon, variance_size=None):
        return ops.rms_norm.fn(x, weight, epsilon, variance_size)

    ops.rms_norm.register_impl("built", compile_facts={"build": "1"})(impl)
    not_a_candidate = _uuid()
    ops.rms_norm.remove_impl("built")
    ops.rms_norm.register_impl("built", compile_facts={"build": "2"})(impl)
    assert _uuid() == not_a_candidate  # not in the compile priority: its facts cannot matter
    vllm_ir.set_priority(rms_norm=["built"])
    build_2 = _uuid()
    ops.rms_norm.remove_impl("built")
    ops.rms_norm.register_impl("built", compile_facts={"build": "1"})(impl)
    vllm_ir.set_priority(rms_norm=["built"])
    assert _uuid() != build_2  # same code, another build


def test_torch_and_triton_versions_go_in_by_default(monkeypatch):
    cache.process_facts.cache_clear()
    try:
        base = _uuid()
        facts = dict(cache.process_facts())
        assert facts["torch"] == torch.__version__
        if importlib.util.find_spec("triton") is not None:
            assert facts["triton"] == importlib.metadata.version("triton")
        monkeypatch.setattr(torch, "__version__", torch.__version__ + "+rebuilt")
        cache.process_facts.cache_clear()
        assert _uuid() != base
    finally:
        monkeypatch.undo()
        cache.process_facts.cache_clear()
    assert _uuid() == base


def _vendor_impl(version: str):
    """An implementation calling a "vendor library" (a module of that version) by global name."""
    vendor = types.ModuleType("vllm_ir_test_vendor")
    vendor.__version__ = version
    vendor.rms_norm = lambda x, weight, epsilon: ops.rms_norm.fn(x, weight, epsilon)
    namespace = {"vllm_ir_test_vendor": vendor}
    exec(
        "def vendor_rms_norm(x, weight, epsilon, variance_size=None):\n"
        "    return vllm_ir_test_vendor.rms_norm(x, weight, epsilon)\n",
        namespace,
    )
    return vendor, namespace["vendor_rms_norm"]


def test_the_version_of_a_library_an_implementation_calls_goes_in_by_default(monkeypatch):
    uuids = []
    for version in ("1.0", "1.1"):
        vendor, fn = _vendor_impl(version)
        monkeypatch.setitem(sys.modules, vendor.__name__, vendor)
        cache.library_version.cache_clear()  # a fresh process, after the library was upgraded in place
        ops.rms_norm.register_impl("vendor")(fn)
        vllm_ir.set_priority(rms_norm=["vendor"])
        impl = ops.rms_norm.impls["vendor"]
        assert cache.library_facts(impl)[0] == (("vllm_ir_test_vendor", version),)
        uuids.append(_uuid())
        ops.rms_norm.remove_impl("vendor")
    cache.library_version.cache_clear()
    assert uuids[0] != uuids[1]


@pytest.mark.parametrize(
    "facts, reason",
    [
        (lambda: 1 / 0, "compile_facts() raised ZeroDivisionError"),
        (lambda: ["not", "a", "mapping"], "must be a mapping"),
        ({"tensor": torch.ones(1)}, "plain values"),
        ({1: "x"}, "keys must be strings"),
    ],
)
def test_unreadable_facts_turn_the_cache_off_with_a_warning(facts, reason):
    ops.rms_norm.register_impl("broken_facts", compile_facts=facts)(variant_rms_norm)
    vllm_ir.set_priority(rms_norm=["broken_facts"])
    cache._warned.clear()
    with pytest.warns(vllm_ir.ProviderWarning, match=re.escape(reason)):
        assert _uuid() is None
    assert passes.inductor_options()["post_grad_custom_post_pass"].uuid() is None  # Inductor bypasses its cache
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _uuid() is None  # warned once
    assert "error" in passes.compile_facts()["rms_norm"]["broken_facts"]


def test_the_triton_provider_declares_its_version_interpreter_and_kernel_sources():
    if importlib.util.find_spec("vllm_ir_provider_triton") is None or importlib.util.find_spec("triton") is None:
        pytest.skip("providers/triton_kernels or triton is not installed")
    from vllm_ir.plugins import discovery as plugins

    plugins.load_provider("triton")
    impl = ops.rms_norm.impls["triton"]
    declared = dict(cache.declared_facts(impl))
    assert set(declared) == {"triton", "TRITON_INTERPRET", "sources", "provider"}
    assert declared["TRITON_INTERPRET"] == "True"  # tests/conftest.py runs Triton in its interpreter
    assert all(op.impls["triton"].compile_facts is not None for op in ops if "triton" in op.impls)


# -- Inductor's FX graph cache -----------------------------------------------------------------


def _compile_and_run(x: Tensor) -> tuple[dict[str, int], dict[str, int]]:
    torch._dynamo.reset()  # facts are read at compile time, not guarded per call
    counters.clear()
    before = dict(KERNEL_CALLS)
    out = passes.compile(model)(x)
    torch.testing.assert_close(out, ops.rms_norm.fn(x, W, 1e-6))
    calls = {k: KERNEL_CALLS[k] - before[k] for k in ("rms_norm", "rms_norm_b")}
    stats = counters["inductor"]
    return {"hit": stats["fxgraph_cache_hit"], "miss": stats["fxgraph_cache_miss"]}, calls


@pytest.fixture(scope="module")
def facts_cache_dir(tmp_path_factory, compile_test_providers):
    """A fresh Inductor cache filled in this process under variants a, b, then a again."""
    path = tmp_path_factory.mktemp("inductor_facts_cache")
    saved = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", VARIANT)}
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    register_variant()
    runs = []
    try:
        with (
            torch._inductor.config.patch(fx_graph_cache=True),
            torch._functorch.config.patch(enable_autograd_cache=True),
            vllm_ir.priority(rms_norm=[PROVIDER]),
        ):
            for value in ("a", "b", "a"):
                os.environ[VARIANT] = value
                runs.append((value, *_compile_and_run(torch.ones(4, 32))))
    finally:
        ops.rms_norm.remove_impl(PROVIDER)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return path, runs


def test_a_changed_fact_misses_inductors_cache_and_runs_what_eager_runs(facts_cache_dir):
    _path, runs = facts_cache_dir
    (_, stats_a, calls_a), (_, stats_b, calls_b), (_, stats_again, calls_again) = runs
    assert stats_a == {"hit": 0, "miss": 1} and calls_a == {"rms_norm": 1, "rms_norm_b": 0}
    # The kernel reads "b" while traced: a stale hit would run kernel a; the new fact misses.
    assert stats_b == {"hit": 0, "miss": 1} and calls_b == {"rms_norm": 0, "rms_norm_b": 1}
    assert stats_again == {"hit": 1, "miss": 0} and calls_again == {"rms_norm": 1, "rms_norm_b": 0}


# The implementation's module name is part of its code fingerprint: the child imports this
# module under the name pytest gave it here (``test_compile_facts`` under rootdir imports).
_CHILD = """
import importlib, json, os, sys
sys.path[:0] = [{root!r}, {tests!r}]
import torch
import vllm_ir
from torch._dynamo.utils import counters
from tests.compile_models import KERNEL_CALLS, register_test_providers
this = importlib.import_module({module!r})
register_test_providers()
this.register_variant()
vllm_ir.set_priority(rms_norm=[this.PROVIDER])
results = {{}}
for value in ("b", "c"):
    os.environ[this.VARIANT] = value
    torch._dynamo.reset()
    counters.clear()
    before = dict(KERNEL_CALLS)
    vllm_ir.compile(this.model)(torch.ones(4, 32))
    stats = counters["inductor"]
    results[value] = {{"hit": stats["fxgraph_cache_hit"], "miss": stats["fxgraph_cache_miss"],
                      "kernel_calls": {{k: KERNEL_CALLS[k] - before[k] for k in KERNEL_CALLS}}}}
print(json.dumps(results))
"""


@pytest.mark.subprocess
def test_a_fresh_process_hits_the_entry_of_its_facts_and_misses_for_new_ones(facts_cache_dir):
    path, _runs = facts_cache_dir
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(path), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    child = subprocess.run(
        [sys.executable, "-c", _CHILD.format(root=str(ROOT), tests=str(ROOT / "tests"), module=__name__)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    results = json.loads(child.stdout.strip().splitlines()[-1])
    assert (results["b"]["hit"], results["b"]["miss"]) == (1, 0)  # the entry this process's facts filled
    assert results["b"]["kernel_calls"]["rms_norm_b"] == 1 and results["b"]["kernel_calls"]["rms_norm"] == 0
    assert (results["c"]["hit"], results["c"]["miss"]) == (0, 1)  # facts no process cached
    assert results["c"]["kernel_calls"]["rms_norm"] == 1 and results["c"]["kernel_calls"]["rms_norm_b"] == 0
