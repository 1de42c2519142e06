"""The compiled cache-hit path (vllm_ir.ir.dispatch._fast_lookup) decides exactly like the Python path.

The Python path is the reference: every call here is made through both and through
`decide()` (no cache at all), over arguments that differ in each fact the key holds.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import vllm_ir
from tests.ops_for_tests import rms_norm_impl
from tests.python_child import run_python
from vllm_ir.ir import torch_library
from vllm_ir.ir.dispatch import decision_cache, fast_lookup, selection
from vllm_ir.ir.dispatch import entry_points as dispatch

ROOT = Path(__file__).resolve().parents[1]
op = vllm_ir.ops.rms_norm

needs_extension = pytest.mark.skipif(
    not fast_lookup.available(), reason=f"vllm_ir.ir.dispatch._fast_lookup: {fast_lookup.unavailable_reason}"
)


def test_the_dev_environment_runs_the_compiled_lookup():
    # scripts/setup.sh builds it wherever a C++ compiler exists; without it this suite and the
    # benchmarks would silently cover the pure-Python path only.
    if os.environ.get(fast_lookup.ENV_VAR) == "0":
        pytest.skip(f"{fast_lookup.ENV_VAR}=0")
    if not fast_lookup.available() and not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip(f"no C++ compiler here, so vllm_ir.ir.dispatch._fast_lookup is {fast_lookup.unavailable_reason}")
    assert fast_lookup.describe() == f"compiled (vllm_ir.ir.dispatch._fast_lookup, built for torch {torch.__version__})"
    assert op.decision_cache.lookup is not None


class Tagged(torch.Tensor):
    """A tensor subclass: the compiled path leaves it to Python."""


def _predicates():
    """Each provider accepts calls that differ in exactly one key fact."""
    return {
        # Facts beyond dtype / device / rank / layout class (issue 12): any of them may decide.
        "p_odd_hidden": lambda x, weight, epsilon, variance_size=None: x.shape[-1] % 2 == 1,
        "p_heads": lambda x, weight, epsilon, variance_size=None: x.dim() == 3 and x.shape[1] == 5,
        "p_row_stride": lambda x, weight, epsilon, variance_size=None: x.stride(-2) == x.shape[-1] + 8,
        "p_weight_fp32": lambda x, weight, epsilon, variance_size=None: (
            weight is not None and weight.dtype == torch.float32 and x.dtype != torch.float32
        ),
        "p_meta": lambda x, weight, epsilon, variance_size=None: x.device.type == "meta",
        "p_bf16": lambda x, weight, epsilon, variance_size=None: x.dtype == torch.bfloat16,
        "p_strided": lambda x, weight, epsilon, variance_size=None: not x.is_contiguous() and x.stride(-1) != 1,
        "p_rows": lambda x, weight, epsilon, variance_size=None: not x.is_contiguous(),
        "p_3d": lambda x, weight, epsilon, variance_size=None: x.dim() == 3,
        "p_no_weight": lambda x, weight, epsilon, variance_size=None: weight is None,
        "p_eps": lambda x, weight, epsilon, variance_size=None: epsilon == 1e-5,
        "p_variance": lambda x, weight, epsilon, variance_size=None: variance_size is not None,
    }


def _argument_grid():
    layouts = {
        "contiguous": lambda t: t,
        "rows": lambda t: torch.cat([t, t], dim=-1)[..., : t.shape[-1]],  # unit inner stride, not contiguous
        "rows_pad8": lambda t: torch.cat([t, t[..., :8]], dim=-1)[..., : t.shape[-1]],  # another row stride
        "strided": lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2),  # inner stride != 1
    }
    for dtype, layout, shape, weight, eps, variance, device in itertools.product(
        (torch.float32, torch.bfloat16),
        layouts,
        ((4, 16), (4, 24), (4, 17), (2, 3, 16), (2, 5, 16)),
        ("tensor", "parameter", "fp32", None),
        (1e-6, 1e-5),
        (None, 8),
        ("cpu", "meta"),
    ):
        x = layouts[layout](torch.randn(*shape, dtype=dtype, device=device))
        w = None if weight is None else torch.randn(shape[-1], dtype=dtype, device=device)
        if weight == "parameter":
            w = torch.nn.Parameter(w)
        elif weight == "fp32":
            w = w.float()
        yield x, w, eps, variance
    yield torch.randn(4, 16).as_subclass(Tagged), torch.randn(16), 1e-6, None


@pytest.fixture
def picky_providers(monkeypatch):
    monkeypatch.setenv("VLLM_IR_FALLBACK", "allow")
    vllm_ir.reload_env()
    log: list[str] = []
    for name, predicate in _predicates().items():

        def body(x, weight, epsilon, variance_size=None, name=name):
            log.append(name)
            return op.fn(x, weight, epsilon, variance_size)

        rms_norm_impl(name, body=body, supports_args=predicate)
    vllm_ir.set_priority(rms_norm=list(_predicates()))
    return log


def _pure_python_entry():
    """``op.__call__`` as generated without the compiled lookup (call it as ``entry(op, ...)``)."""
    overload = torch_library.overload("rms_norm")
    return dispatch.build_entry_points(op, op.decision_cache, overload, overload, None).call


def _ran(log: list[str], fn, *args) -> str:
    """The provider whose kernel ran for ``fn(*args)``."""
    log.clear()
    fn(*args)
    return log[-1] if log else "native"


def test_compiled_and_python_paths_choose_like_decide(picky_providers):
    python_call = _pure_python_entry()
    log = picky_providers
    seen = set()
    grid = list(_argument_grid())
    with torch.no_grad():  # nn.Parameter requires grad: with grad on, calls take the autograd route
        for rounds in range(2):  # the second round meets a cache warmed by every other call
            for args in grid if rounds == 0 else reversed(grid):
                expected = selection.decide(op, args).provider
                seen.add(expected)
                # Twice each: the first call may miss, the second hits the cache (and the last-hit memo).
                got = [_ran(log, op, *args) for _ in range(2)]
                got += [_ran(log, python_call, op, *args) for _ in range(2)]
                got.append(op.cached_dispatch(*args).provider)
                assert got == [expected] * 5, (expected, got, [(type(a), getattr(a, "shape", a)) for a in args])
    assert seen == {*_predicates(), "native"}  # the grid reaches every provider


def test_vmap_dispatches_on_the_per_example_tensor_on_both_paths(picky_providers):
    python_call = _pure_python_entry()
    log, w = picky_providers, torch.randn(16)
    batch = torch.randn(3, 4, 16)
    for entry, args in ((op, ()), (python_call, (op,))):
        for _ in range(2):
            log.clear()
            out = torch.vmap(lambda x, entry=entry, args=args: entry(*args, x, w, 1e-6))(batch)
            assert log == [] and out.shape == batch.shape  # 2-D per example: native (which logs nothing)
            log.clear()
            torch.vmap(lambda x, entry=entry, args=args: entry(*args, x, w, 1e-6))(batch.unsqueeze(1))
            assert log == ["p_3d"]


def test_alternating_signatures_and_priority_changes_never_serve_a_stale_decision(picky_providers):
    log = picky_providers
    fp32 = (torch.randn(4, 16), torch.randn(16), 1e-6)
    bf16 = (torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16), 1e-6)
    assert [_ran(log, op, *a) for a in (fp32, bf16, fp32, fp32, bf16)] == [
        "native",
        "p_bf16",
        "native",
        "native",
        "p_bf16",
    ]
    vllm_ir.set_priority(rms_norm=["p_no_weight"])
    assert _ran(log, op, *bf16) == "native"
    rms_norm_impl("late_arrival", body=lambda *a: log.append("late_arrival") or op.fn(*a))
    vllm_ir.set_priority(rms_norm=["late_arrival"])
    assert _ran(log, op, *bf16) == "late_arrival"
    with vllm_ir.priority(rms_norm=["p_bf16"]):
        assert _ran(log, op, *bf16) == "p_bf16"
        assert _ran(log, op, *fp32) == "late_arrival"
    assert _ran(log, op, *bf16) == "late_arrival"


def test_equal_scalars_share_a_decision_and_unequal_ones_do_not(picky_providers):
    log = picky_providers
    x, w = torch.randn(4, 16), torch.randn(16)
    assert _ran(log, op, x, w, 1e-5) == "p_eps"
    assert _ran(log, op, x, w, float("1e-5")) == "p_eps"  # another float object, equal
    assert _ran(log, op, x, w, 1e-6) == "native"
    assert _ran(log, op, x, w, 1e-6, 8) == "p_variance"


def test_the_memo_never_treats_a_merely_equal_object_as_the_same_scalar(picky_providers):
    # 0.5 == tensor(0.5) is truthy, but a dict keys the tensor apart (its hash is its identity):
    # the memo must not hand the float's decision to the tensor.
    log = picky_providers
    rms_norm_impl(
        "p_float_eps",
        body=lambda *a: log.append("p_float_eps") or op.fn(*a),
        supports_args=lambda x, weight, epsilon, variance_size=None: type(epsilon) is float,
    )
    vllm_ir.set_priority(rms_norm=["p_float_eps"])
    x, w = torch.randn(4, 16), torch.randn(16)
    assert [_ran(log, op, x, w, 0.5) for _ in range(2)] == ["p_float_eps"] * 2
    assert _ran(log, op, x, w, torch.tensor(0.5)) == "native"
    assert _ran(log, op, x, w, 0.5) == "p_float_eps"


def test_a_call_racing_an_invalidation_cannot_leave_a_stale_memo(picky_providers, monkeypatch):
    log = picky_providers
    bf16 = (torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16), 1e-6)
    assert [_ran(log, op, *bf16) for _ in range(2)] == ["p_bf16"] * 2
    retire = decision_cache._retire

    def retire_while_another_call_runs(decisions, op_name):
        op(*bf16)  # what another thread may do while the dicts are being cleared
        retire(decisions, op_name)

    monkeypatch.setattr(decision_cache, "_retire", retire_while_another_call_runs)
    vllm_ir.set_priority(rms_norm=["p_no_weight"])
    assert _ran(log, op, *bf16) == "native"


def test_a_finalizer_calling_the_op_while_the_memo_changes(picky_providers):
    log = picky_providers
    fp32 = (torch.randn(4, 16), torch.randn(16))
    bf16 = (fp32[0].bfloat16(), fp32[1].bfloat16())

    class Eps(float):
        def __del__(self):
            op(*fp32, 0.5)  # re-enters the lookup while it replaces the remembered hit

    for args in (fp32, fp32, bf16, bf16):
        op(*args, 0.5)
    op(*fp32, Eps(0.5))  # the remembered key now holds the only reference to the Eps
    op(*bf16, 0.5)  # replacing the memo frees the Eps, whose __del__ calls the op
    assert _ran(log, op, *fp32, 0.5) == "native"
    assert _ran(log, op, *bf16, 0.5) == "p_bf16"


def test_calls_while_torch_is_compiling_reach_the_torch_op(picky_providers, monkeypatch):
    # torch.compiler.is_compiling() is true with no dispatch mode during compile and export
    # sessions (a custom backend calling the op eagerly): the call must go through torch.ops.
    asked = []
    rms_norm_impl("p_counted", supports_args=lambda x, weight, epsilon, variance_size=None: asked.append(1) or True)
    vllm_ir.set_priority(rms_norm=["p_counted"])
    x, w = torch.randn(4, 16), torch.randn(16)
    op(x, w, 1e-6)
    op(x, w, 1e-6)
    assert len(asked) == 1  # cached
    monkeypatch.setattr(torch.compiler, fast_lookup.COMPILING_FLAG, True)
    op(x, w, 1e-6)
    assert len(asked) == 2  # the torch op's kernel decides afresh (no cache on that path)


class _Recording(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@needs_extension
def test_a_dispatch_mode_sees_the_ir_op_even_when_the_decision_is_cached():
    x, w = torch.randn(4, 16), torch.randn(16)
    op(x, w, 1e-6)
    op(x, w, 1e-6)  # cached in C now
    with _Recording() as mode:
        op(x, w, 1e-6)
    assert mode.ops[0] == "vllm_ir.rms_norm.default"


def test_bad_arguments_get_the_python_error_through_the_compiled_path(picky_providers):
    x, w = torch.randn(4, 16), torch.randn(16)  # a predicate runs: the key is built
    op(x, w, 1e-6)
    with pytest.raises(TypeError, match="op 'rms_norm': argument 'weight' must be a Tensor, got int"):
        op(x, 3, 1e-6)
    with pytest.raises(TypeError, match="unhashable"):
        op(x, w, [1e-6])


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return run_python(["-c", code], env={**os.environ, "VLLM_IR_DISABLE_PLUGIN_AUTOLOAD": "1", **env}, timeout=120)


@needs_extension
@pytest.mark.subprocess
def test_an_extension_built_for_another_torch_is_refused_and_python_runs():
    result = _run(
        "import torch; torch.__version__ = '9.9.9'\n"
        "import vllm_ir; from vllm_ir.ir.dispatch import fast_lookup\n"
        "print(fast_lookup.describe())\n"
        "print(vllm_ir.ops.rms_norm(torch.ones(2, 8), None, 1e-6).sum().item())\n"
    )
    assert result.returncode == 0, result.stderr
    detail, value = result.stdout.splitlines()
    assert detail == (
        "pure Python (not loadable: vllm_ir.ir.dispatch._fast_lookup was built for torch "
        f"{torch.__version__} but torch 9.9.9 is running)"
    )
    assert float(value) == pytest.approx(16.0, rel=1e-4)


@pytest.mark.subprocess
def test_the_pure_python_path_passes_the_dispatch_tests():
    """VLLM_IR_FAST_LOOKUP=0 (or no extension) must behave identically: run the suites again."""
    tests = ["tests/test_dispatch.py", "tests/test_semantics.py", "tests/test_priority.py", __file__]
    result = run_python(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not pure_python", *tests],
        cwd=ROOT,
        env={**os.environ, "VLLM_IR_FAST_LOOKUP": "0"},
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout.splitlines()[-1]


def _write_table(path: Path, entries: list[dict]) -> Path:
    from vllm_ir.ir import tuning

    doc = {
        "schema": tuning.SCHEMA,
        "machine": tuning.machine_facts("cpu"),
        "measured": "2026-12-02",
        "entries": entries,
    }
    path.write_text(json.dumps(doc))
    return path


def test_token_range_buckets_choose_alike_on_every_path(picky_providers, tmp_path, monkeypatch):
    """A tuning table that orders rms_norm per dtype and token range: the compiled lookup, the
    Python path and decide() agree for every T, across bucket edges, in any call order."""
    from vllm_ir.ir import tuning

    log = picky_providers
    entries = [
        {"op": "rms_norm", "dtype": "float32", "tokens": [1, 4], "providers": ["p_rows", "native"]},
        {"op": "rms_norm", "dtype": "float32", "tokens": [4, 64], "providers": ["p_eps", "native"]},
        {"op": "rms_norm", "dtype": "float32", "tokens": [64, None], "providers": ["p_rows", "native"]},
        {"op": "rms_norm", "dtype": "bfloat16", "tokens": [2, 8], "providers": ["p_no_weight", "native"]},
    ]
    monkeypatch.setenv("VLLM_IR_TUNING", str(_write_table(tmp_path / "t.json", entries)))
    vllm_ir.clear_priority()  # the table, not set_priority, orders these calls
    vllm_ir.reload_env()
    python_call = _pure_python_entry()
    calls = []
    for t, dtype, eps in itertools.product(
        (0, 1, 2, 3, 4, 5, 7, 8, 63, 64, 65, 200), (torch.float32, torch.bfloat16), (1e-6, 1e-5)
    ):
        x = torch.randn(t, 16, dtype=dtype)
        for w in (torch.randn(16, dtype=dtype), None):
            calls.append((torch.cat([x, x], dim=-1)[:, :16] if t % 2 else x, w, eps, None))
    seen = set()
    for args in calls + calls[::-1]:
        expected = selection.decide(op, args).provider
        seen.add(expected)
        got = [_ran(log, op, *args) for _ in range(2)]
        got += [_ran(log, python_call, op, *args) for _ in range(2)]
        got.append(op.cached_dispatch(*args).provider)
        assert got == [expected] * 5, (expected, got, args[0].shape, args[0].dtype, args[1] is None, args[2])
    assert {"p_rows", "p_eps", "p_no_weight", "native"} <= seen
    buckets = op.decision_cache.bucket_cell[0]
    assert buckets is not None and buckets == tuning.bucket_map("rms_norm")
    # The key holds the bucket, never T: every count of one bucket shares one decision.
    before = len(op.decision_cache.decisions)
    for t in (16, 17, 30, 33, 40):
        op(torch.randn(t, 16), torch.randn(16), 1e-5)
    assert len(op.decision_cache.decisions) == before


def test_an_op_no_table_mentions_keeps_its_key_without_a_bucket(picky_providers, tmp_path, monkeypatch):
    entries = [{"op": "rms_norm", "dtype": "float32", "tokens": [1, None], "providers": ["p_eps", "native"]}]
    monkeypatch.setenv("VLLM_IR_TUNING", str(_write_table(tmp_path / "t.json", entries)))
    vllm_ir.clear_priority()
    vllm_ir.reload_env()
    x = torch.randn(4, 16)
    assert op.dispatch(x, torch.randn(16), 1e-5).provider == "p_eps"
    # One range for every T: nothing to bucket, the key is today's.
    assert op.decision_cache.bucket_cell[0] is None
    assert vllm_ir.ops.fused_add_rms_norm.decision_cache.bucket_cell[0] is None


# -- the compiled traced runner (vllm_ir.ir.dispatch.observe) ------------------------------------


@pytest.mark.skipif(fast_lookup.TracedRunner is None, reason="vllm_ir.ir.dispatch._fast_lookup is not built")
def test_the_traced_runner_hands_what_it_cannot_record_to_the_python_runner():
    """No sink: the kernel alone. A sink that is no Trace, keyword arguments, a profiler: the
    Python runner (the reference) takes the call. A Trace: the compiled recorder does."""
    import contextvars

    from vllm_ir.ir.dispatch import observe
    from vllm_ir.tools import tracing

    op = vllm_ir.ops.rms_norm
    site = observe.call_site(op, "native", "functional")

    class Decision:
        functional = staticmethod(lambda *args, **kwargs: ("kernel", args, kwargs))

    handed: list[tuple] = []

    def fallback(*args, **kwargs):
        handed.append((args, kwargs))
        return "python"

    active: contextvars.ContextVar = contextvars.ContextVar("sink", default=None)
    sinks: list = [None]
    runner = fast_lookup.TracedRunner(
        Decision(), "functional", site, site.tensor_indices, site.token_indices, site.first_tensor,
        active, sinks, vars(torch.autograd.profiler), fallback,
    )  # fmt: skip
    x, w = torch.randn(3, 8), torch.ones(8)
    assert runner(x, w, 1e-6) == ("kernel", (x, w, 1e-6), {}) and not handed
    active.set(object())  # a sink without a compiled recorder
    assert runner(x, w, 1e-6) == "python" and len(handed) == 1
    trace = tracing.Trace()
    active.set(trace)
    assert runner(x, w, 1e-6) == ("kernel", (x, w, 1e-6), {}) and trace._recorder.calls == 1
    assert runner(x, w, epsilon=1e-6) == "python" and handed[-1] == ((x, w), {"epsilon": 1e-6})
    with torch.profiler.profile():
        assert runner(x, w, 1e-6) == "python"
    active.set(None)
    sinks[0] = trace  # the process trace
    assert runner(torch.randn(5, 8), w, 1e-6)[0] == "kernel" and trace._recorder.calls == 2
    assert [e["tokens"] for e in trace.events] == [3, 5] and len(handed) == 3
    with pytest.raises(TypeError, match="never initialized"):
        fast_lookup.TracedRunner.__new__(fast_lookup.TracedRunner)(x)
