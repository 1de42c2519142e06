"""Compiled code follows priority changes: Dynamo guards every frame with IR ops on the priority.

A frame is lowered for the compile-mode priority in effect when it is compiled. Calls under
another priority (``set_priority``, a ``priority()`` scope, leaving the scope it was compiled
in, another thread's scope) recompile once per distinct priority, or reuse the entry compiled
for it; calls under an unchanged priority never recompile for it.

The models lower to the two opaque test kernels (Inductor then generates no C++), whose call
counters say which kernel a compiled call ran; ``native`` is lowered once, for the default.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import Tensor
from torch._dynamo.utils import counters

import vllm_ir
from tests.compile_models import KERNEL_CALLS
from vllm_ir.passes import cache

ops = vllm_ir.ops
pytestmark = pytest.mark.usefixtures("compile_test_providers")

W = torch.randn(32, generator=torch.Generator().manual_seed(5))
EPS = 1e-6
A, B, NONE = {"rms_norm": 1, "rms_norm_b": 0}, {"rms_norm": 0, "rms_norm_b": 1}, {"rms_norm": 0, "rms_norm_b": 0}


def model(x: Tensor) -> Tensor:
    return ops.rms_norm(x, W, EPS)


def _fresh() -> None:
    """An empty Dynamo cache (``model`` is shared by the tests) and zeroed counters."""
    torch._dynamo.reset()
    counters.clear()


def _compiles() -> int:
    return counters["stats"]["unique_graphs"]


def _run(compiled, x: Tensor) -> dict[str, int]:
    """Call ``compiled``; which opaque kernels ran (native runs none), numerics checked."""
    before = dict(KERNEL_CALLS)
    out = compiled(x)
    torch.testing.assert_close(out, ops.rms_norm.fn(x, W, EPS))
    return {k: KERNEL_CALLS[k] - before[k] for k in ("rms_norm", "rms_norm_b")}


def test_set_priority_after_compiling_under_the_default_runs_the_new_kernel():
    _fresh()
    compiled = vllm_ir.compile(model)
    x = torch.randn(4, 32)
    assert _run(compiled, x) == NONE  # lowered to native, the compile default here
    assert _run(compiled, x) == NONE and _compiles() == 1

    vllm_ir.set_priority(rms_norm=["test_opaque"])
    assert _run(compiled, x) == A  # eager would run test_opaque: so does the compiled call
    assert _compiles() == 2
    assert vllm_ir.passes.record_of(compiled).graphs[-1].selected_impls == {"rms_norm": {"rms_norm": "test_opaque"}}
    vllm_ir.set_priority(rms_norm=["test_opaque_b"])
    assert _run(compiled, x) == B and _compiles() == 3

    vllm_ir.clear_priority()  # back to the default: the first entry serves it, no recompile
    assert _run(compiled, x) == NONE
    vllm_ir.set_priority(rms_norm=["test_opaque"])
    assert _run(compiled, x) == A and _compiles() == 3


def test_a_function_compiled_in_a_scope_keeps_no_kernel_of_it_after_the_scope():
    vllm_ir.set_priority(rms_norm=["test_opaque"])
    _fresh()
    compiled = vllm_ir.compile(model)
    x = torch.randn(4, 32)
    with vllm_ir.priority(rms_norm=["test_opaque_b"]):
        assert _run(compiled, x) == B
    assert _run(compiled, x) == A  # the scope is gone: its kernel is not run any more
    assert _compiles() == 2
    with vllm_ir.priority(rms_norm=["test_opaque_b"]):  # entering it again reuses its entry
        assert _run(compiled, x) == B
        assert _compiles() == 2
        with vllm_ir.priority(rms_norm=["test_opaque"]):  # nested: the inner list goes first
            assert _run(compiled, x) == A
    assert _compiles() == 3


def test_each_thread_runs_the_kernel_of_its_own_scope():
    vllm_ir.set_priority(rms_norm=["test_opaque"])
    _fresh()
    compiled = vllm_ir.compile(model)
    x = torch.randn(4, 32)
    assert _run(compiled, x) == A
    seen: list[dict[str, int]] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            with vllm_ir.priority(rms_norm=["test_opaque_b"]):
                seen.append(_run(compiled, x))
            seen.append(_run(compiled, x))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert not errors and seen == [B, A]
    assert _run(compiled, x) == A  # the main thread never had the scope


def test_no_recompiles_while_the_priority_stays_the_same():
    vllm_ir.set_priority(rms_norm=["test_opaque"])
    _fresh()
    compiled = vllm_ir.compile(model, dynamic=True)
    for tokens in (2, 3, 5, 8, 3):
        assert _run(compiled, torch.randn(tokens, 32)) == A
    assert _compiles() == 1  # one graph for every batch size, the guard adds no recompile
    vllm_ir.reload_env()  # invalidates every cached decision, changes none
    vllm_ir.set_priority(rms_norm=["test_opaque", "native"])  # another list, the same candidates
    for tokens in (2, 7):
        assert _run(compiled, torch.randn(tokens, 32)) == A
    assert _compiles() == 1

    vllm_ir.set_priority(rms_norm=["test_opaque_b"])  # a real change: exactly one recompile
    for tokens in (2, 3, 9):
        assert _run(compiled, torch.randn(tokens, 32)) == B
    assert _compiles() == 2
    vllm_ir.set_priority(rms_norm=["test_opaque"])
    for tokens in (4, 6):
        assert _run(compiled, torch.randn(tokens, 32)) == A
    assert _compiles() == 2


def test_torch_compile_with_inductor_options_follows_the_priority_from_inductors_caches(tmp_path, monkeypatch):
    """An AOTAutograd cache hit skips a late pre-grad stage: our options run it early, so the
    frame served from the cache still gets its guard."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x = torch.randn(4, 32)
    vllm_ir.set_priority(rms_norm=["test_opaque"])
    with torch._inductor.config.patch(fx_graph_cache=True), torch._functorch.config.patch(enable_autograd_cache=True):
        for attempt in ("fills the caches", "hits them"):
            _fresh()
            compiled = torch.compile(model, options=vllm_ir.inductor_options())
            assert _run(compiled, x) == A, attempt
            vllm_ir.set_priority(rms_norm=["test_opaque_b"])
            assert _run(compiled, x) == B, attempt
            vllm_ir.set_priority(rms_norm=["test_opaque"])
            assert _run(compiled, x) == A, attempt
        assert counters["aot_autograd"]["autograd_cache_hit"] == 2
    if hasattr(torch._inductor.config, "pre_grad_pass_timing"):  # torch 2.11 has no such option (runs them early)
        assert vllm_ir.inductor_options()["pre_grad_pass_timing"] == "early"
    with pytest.raises(ValueError, match="pre_grad_pass_timing"):
        vllm_ir.inductor_options(pre_grad_pass_timing="late")


def test_a_recompile_a_priority_change_would_need_is_a_clear_error_when_recompiles_are_refused():
    vllm_ir.set_priority(rms_norm=["test_opaque"])
    _fresh()
    compiled = vllm_ir.compile(model)
    x = torch.randn(4, 32)
    assert _run(compiled, x) == A
    vllm_ir.set_priority(rms_norm=["test_opaque_b"])
    with torch.compiler.set_stance("fail_on_recompile"), pytest.raises(RuntimeError) as info:
        compiled(x)
    assert cache.GUARD_DESCRIPTION in str(info.value)


def test_graphs_without_ir_ops_do_not_guard_on_the_priority():
    _fresh()

    def plain(x: Tensor) -> Tensor:
        return x * 2

    compiled = vllm_ir.compile(plain, backend="aot_eager")
    compiled(torch.ones(3))
    vllm_ir.set_priority(rms_norm=["test_opaque_b"])
    compiled(torch.ones(3))
    assert _compiles() == 1
    assert not cache.install_priority_guard(torch.fx.symbolic_trace(model))  # outside Dynamo: nothing to guard
