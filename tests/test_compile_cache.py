"""Inductor's FX graph cache stays correct: new priorities or kernel code recompile, nothing else does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor
from torch._dynamo.utils import counters

import vllm_ir
from tests.compile_models import KERNEL_CALLS
from tests.ops_for_tests import discovery_answering
from vllm_ir import passes
from vllm_ir.ir import registry

ops = vllm_ir.ops
ROOT = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("compile_test_providers")


def _lowering_uuid() -> str:
    return passes.LoweringPass().uuid()


def _rms_a(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    return ops.rms_norm.fn(x, weight, epsilon, variance_size)


def _rms_b(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    return ops.rms_norm.fn(x, weight, epsilon, variance_size) * 1.0


# -- uuid ------------------------------------------------------------------------------------


def test_uuid_is_stable_while_nothing_changes():
    first = _lowering_uuid()
    vllm_ir.reload_env()  # invalidates every cache, changes no decision
    assert _lowering_uuid() == first
    assert passes.inductor_options()["post_grad_custom_post_pass"].uuid() == (
        passes.inductor_options()["post_grad_custom_post_pass"].uuid()
    )


def test_uuid_follows_priority_including_scoped_priority():
    base = _lowering_uuid()
    vllm_ir.set_priority(rms_norm=["test_opaque"])
    global_list = _lowering_uuid()
    assert global_list != base
    vllm_ir.clear_priority()
    assert _lowering_uuid() == base
    with vllm_ir.priority(rms_norm=["test_opaque"]):
        assert _lowering_uuid() == global_list  # same effective compile priority, same key
    with vllm_ir.priority(fused_add_rms_norm=["test_inplace"]):
        assert _lowering_uuid() not in (base, global_list)


def test_uuid_ignores_eager_only_defaults():
    previous = registry.discovery().defaults
    base = _lowering_uuid()

    def eager_only(mode):
        extra = {"rms_norm": [("test_opaque", "test")]} if mode == "eager" else {}
        return {**dict(previous(mode)), **extra}

    with discovery_answering(defaults=eager_only):
        assert ops.rms_norm.get_priority("eager")[0].provider == "test_opaque"
        assert _lowering_uuid() == base


def test_uuid_follows_the_code_of_candidate_implementations_and_predicates():
    ops.rms_norm.register_impl("swappable")(_rms_a)
    vllm_ir.set_priority(rms_norm=["swappable"])
    with_a = _lowering_uuid()
    ops.rms_norm.remove_impl("swappable")
    ops.rms_norm.register_impl("swappable")(_rms_b)
    vllm_ir.set_priority(rms_norm=["swappable"])
    assert _lowering_uuid() != with_a
    ops.rms_norm.remove_impl("swappable")
    ops.rms_norm.register_impl("swappable")(_rms_a)
    vllm_ir.set_priority(rms_norm=["swappable"])
    assert _lowering_uuid() == with_a
    ops.rms_norm.remove_impl("swappable")
    ops.rms_norm.register_impl("swappable", supports_args=lambda x, weight, epsilon, variance_size=None: True)(_rms_a)
    vllm_ir.set_priority(rms_norm=["swappable"])
    assert _lowering_uuid() != with_a


def test_uuid_follows_helpers_an_implementation_calls():
    from vllm_ir.passes.cache import code_fingerprint

    def make(scale):
        def helper(x):
            return x * scale

        def impl(x):
            return helper(x)

        return impl

    assert code_fingerprint(make(1.0)) == code_fingerprint(make(1.0))
    assert code_fingerprint(make(1.0)) != code_fingerprint(make(2.0))


# -- compiling -------------------------------------------------------------------------------

W = torch.randn(32, generator=torch.Generator().manual_seed(3))


def model(x: Tensor) -> Tensor:
    """Lowered to one of two opaque kernels, Inductor generates no C++: compiles stay cheap."""
    return ops.rms_norm(x, W, 1e-6)


def _compile_and_run(x: Tensor) -> tuple[Tensor, dict[str, int], dict[str, int], passes.PipelineRecord]:
    torch._dynamo.reset()
    counters.clear()
    before = dict(KERNEL_CALLS)
    compiled = passes.compile(model)
    out = compiled(x)
    calls = {k: KERNEL_CALLS[k] - before[k] for k in ("rms_norm", "rms_norm_b")}
    return out, dict(counters["inductor"]), calls, passes.record_of(compiled)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A fresh Inductor cache, filled in this process: kernel A first, then kernel B, then A again."""
    path = tmp_path_factory.mktemp("inductor_cache")
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    x = torch.ones(4, 32)
    runs = []
    try:
        with (
            torch._inductor.config.patch(fx_graph_cache=True),
            torch._functorch.config.patch(enable_autograd_cache=True),
        ):
            for provider in ("test_opaque", "test_opaque_b", "test_opaque"):
                vllm_ir.set_priority(rms_norm=[provider])
                runs.append((provider, *_compile_and_run(x)))
                vllm_ir.clear_priority()
    finally:
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
    return path, runs


def test_priority_change_between_compiles_in_one_process(cache_dir):
    _path, runs = cache_dir
    (_, out_a, stats_a, calls_a, rec_a), (_, out_b, stats_b, calls_b, rec_b), (_, out_again, stats, calls, rec) = runs
    assert stats_a.get("fxgraph_cache_miss") == 1 and calls_a == {"rms_norm": 1, "rms_norm_b": 0}
    assert rec_a.selected_impls == {"rms_norm": {"rms_norm": "test_opaque"}}
    # New priority: a cache miss, and the new kernel runs.
    assert stats_b.get("fxgraph_cache_miss") == 1 and calls_b == {"rms_norm": 0, "rms_norm_b": 1}
    assert rec_b.selected_impls == {"rms_norm": {"rms_norm": "test_opaque_b"}}
    # Back to the first priority: a cache hit that runs the first kernel.
    assert stats.get("fxgraph_cache_hit") == 1 and not stats.get("fxgraph_cache_miss")
    assert calls == {"rms_norm": 1, "rms_norm_b": 0}
    # The passes did not run, yet the record has the report of the compile that filled the entry.
    assert [g.from_cache for g in rec.graphs] == [True]
    assert rec.selected_impls == {"rms_norm": {"rms_norm": "test_opaque"}}
    torch.testing.assert_close(out_a, out_b)
    torch.testing.assert_close(out_a, out_again)


_CHILD = """
import json, sys
sys.path.insert(0, {root!r})
import torch
import vllm_ir
from torch._dynamo.utils import counters
from tests.compile_models import KERNEL_CALLS, register_test_providers
from tests.test_compile_cache import model
register_test_providers()
vllm_ir.set_priority(rms_norm=[sys.argv[1]])
compiled = vllm_ir.passes.compile(model)
out = compiled(torch.ones(4, 32))
record = vllm_ir.passes.record_of(compiled)
print(json.dumps({{"hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"],
                  "kernel_calls": KERNEL_CALLS, "out": out.sum().item(), "selected": record.selected_impls,
                  "from_cache": [g.from_cache for g in record.graphs]}}))
"""


@pytest.mark.subprocess
def test_fresh_processes_find_the_entry_of_their_own_priority(cache_dir):
    """Each process computes the same uuid for the same priority: it hits that entry, not a stale one."""
    path, runs = cache_dir
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(path), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    children = {
        provider: subprocess.Popen(
            [sys.executable, "-c", _CHILD.format(root=str(ROOT)), provider],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for provider in ("test_opaque", "test_opaque_b")
    }
    results = {}
    for provider, child in children.items():
        stdout, stderr = child.communicate(timeout=300)
        assert child.returncode == 0, stderr[-3000:]
        results[provider] = json.loads(stdout.strip().splitlines()[-1])
    for provider, kernel, other in (
        ("test_opaque", "rms_norm", "rms_norm_b"),
        ("test_opaque_b", "rms_norm_b", "rms_norm"),
    ):
        result = results[provider]
        assert (result["hit"], result["miss"]) == (1, 0)
        assert (result["kernel_calls"][kernel], result["kernel_calls"][other]) == (1, 0)
        assert result["selected"] == {"rms_norm": {"rms_norm": provider}} and result["from_cache"] == [True]
    expected = runs[0][1].sum().item()
    assert results["test_opaque"]["out"] == pytest.approx(expected) == pytest.approx(results["test_opaque_b"]["out"])


_PLAIN_CHILD = """
import json, sys
sys.path.insert(0, {root!r})
import torch
import vllm_ir
from torch._dynamo.utils import counters
from tests.compile_models import register_test_providers
from tests.test_compile_cache import model
register_test_providers()
vllm_ir.set_priority(rms_norm=["test_opaque"])
options = vllm_ir.inductor_options()
compiled = torch.compile(model, options=options)
compiled(torch.ones(4, 32))
record = vllm_ir.passes.record_of(options)
print(json.dumps({{"hit": counters["inductor"]["fxgraph_cache_hit"], "selected": record.selected_impls,
                  "from_cache": [g.from_cache for g in record.graphs]}}))
"""


@pytest.mark.subprocess
def test_plain_torch_compile_keeps_its_record_when_inductors_cache_is_warm(tmp_path):
    """``torch.compile(options=inductor_options())`` run twice: the second run's graph comes from the
    cache, its passes do not run, and record_of(options) still lists what the first lowering chose."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    results = []
    for _ in range(2):
        child = subprocess.run(
            [sys.executable, "-c", _PLAIN_CHILD.format(root=str(ROOT))],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert child.returncode == 0, child.stderr[-3000:]
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
    cold, warm = results
    assert cold["hit"] == 0 and cold["from_cache"] == [False]
    assert warm["hit"] == 1 and warm["from_cache"] == [True]
    assert cold["selected"] == warm["selected"] == {"rms_norm": {"rms_norm": "test_opaque"}}
