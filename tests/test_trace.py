"""vllm_ir.trace: what ran, per call and per module, eager and compiled; profiler labels;
reference mode; the process trace and ``vllm-ir trace``; bounded memory; bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch
from torch import nn

import vllm_ir
from tests.python_child import run_python
from vllm_ir.ir import priority
from vllm_ir.tools import tracing

ops = vllm_ir.ops
CLI = ("-m", "vllm_ir")  # run_python's arguments
X = torch.randn(8, 64)
W = torch.rand(64) + 0.5


def _env(**extra: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_IR_")}
    environ["VLLM_IR_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    environ.update(extra)
    return environ


def _python(code: str, **extra: str) -> subprocess.CompletedProcess:
    return run_python(["-c", textwrap.dedent(code)], env=_env(**extra))


@pytest.fixture
def declining():
    """A real second provider of rms_norm whose predicate declines float64 (a forced fallback)."""
    from tests.conftest import unique

    name = unique("picky")

    def kernel(x, weight, epsilon, variance_size=None):
        return ops.rms_norm.fn(x, weight, epsilon, variance_size)

    def supports(x, weight, epsilon, variance_size=None):
        return True if x.dtype != torch.float64 else vllm_ir.Unsupported("float64 is not supported")

    ops.rms_norm.register_impl(name, supports_args=supports)(kernel)
    vllm_ir.set_priority(rms_norm=[name])
    return name


def test_each_call_is_recorded_with_provider_form_dtype_and_token_range(declining):
    with vllm_ir.trace() as t:
        for _ in range(3):
            ops.rms_norm(X, W, 1e-6)
        ops.rms_norm(torch.randn(300, 64), W, 1e-6)
    rows = {(r["provider"], r["tokens"]): r for r in t.table()}
    assert rows[(declining, "[8, 16)")]["calls"] == 3
    assert rows[(declining, "[256, 512)")]["calls"] == 1
    assert {r["form"] for r in t.table()} == {"functional"}
    assert {r["dtype"] for r in t.table()} == {"float32"}
    assert t.calls == 4 and sum(r["share"] for r in t.table()) == pytest.approx(1.0)
    assert t.summary().splitlines()[0].startswith("vllm-ir trace: 4 eager calls")


def test_a_forced_fallback_shows_the_declining_providers_reason(declining):
    with warnings.catch_warnings(), vllm_ir.trace() as t:
        warnings.simplefilter("ignore")
        ops.rms_norm(X.double(), W.double(), 1e-6)
    assert t.table()[0]["provider"] == "native"
    assert f"fallback: rms_norm ran native x1 because {declining}: float64 is not supported" in t.summary()


def test_tracing_never_changes_the_choice_or_the_result(declining):
    """The traced decisions are made by the same walk: same provider, bit-identical output, per fact."""
    calls = [(X, W), (X.double(), W.double()), (X.t().contiguous().t(), None), (torch.randn(1, 64), W)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = [(ops.rms_norm.cached_dispatch(x, w, 1e-6).provider, ops.rms_norm(x, w, 1e-6)) for x, w in calls]
        with vllm_ir.trace() as t:
            traced = [(ops.rms_norm.cached_dispatch(x, w, 1e-6).provider, ops.rms_norm(x, w, 1e-6)) for x, w in calls]
    for (p1, y1), (p2, y2) in zip(plain, traced, strict=True):
        assert p1 == p2 and torch.equal(y1, y2)
    assert [e["provider"] for e in t.events] == [p for p, _ in plain]


def test_in_place_calls_are_recorded_as_such():
    from tests.compile_models import inplace_fused_add_rms_norm

    ops.fused_add_rms_norm.register_impl("trace_inplace", inplace=True)(inplace_fused_add_rms_norm)
    vllm_ir.set_priority(fused_add_rms_norm=["trace_inplace"])
    x, residual = torch.randn(4, 64), torch.randn(4, 64)
    with vllm_ir.trace() as t:
        ops.fused_add_rms_norm.maybe_inplace(x, residual, W, 1e-6)
        ops.fused_add_rms_norm(x, residual, W, 1e-6)
    assert sorted((r["provider"], r["form"]) for r in t.table()) == [
        ("trace_inplace", "in-place"),
        ("trace_inplace", "in-place on copies"),
    ]


def test_autograd_calls_inside_a_trace_are_recorded_and_differentiate():
    x = X.clone().requires_grad_()
    with vllm_ir.trace() as t:
        y = ops.rms_norm(x, W, 1e-6)
    y.sum().backward()
    assert x.grad is not None and t.calls == 1


def test_threads_tracing_in_parallel_keep_separate_traces():
    traces: dict[int, tracing.Trace] = {}
    barrier = threading.Barrier(2)

    def work(n: int) -> None:
        with vllm_ir.trace() as t:
            barrier.wait()
            for _ in range(n):
                ops.rms_norm(X, W, 1e-6)
            barrier.wait()
        traces[n] = t

    threads = [threading.Thread(target=work, args=(n,)) for n in (3, 5)]
    for th in threads:
        th.start()
    with vllm_ir.trace() as main:
        for th in threads:
            th.join()
    assert traces[3].calls == 3 and traces[5].calls == 5 and main.calls == 0


def test_nothing_is_recorded_after_the_block_and_priority_scopes_nest():
    with vllm_ir.trace() as t:
        with vllm_ir.priority(rms_norm=["native"]):
            ops.rms_norm(X, W, 1e-6)
    ops.rms_norm(X, W, 1e-6)
    assert t.calls == 1
    assert priority.current_scope() is None


def test_memory_is_bounded():
    with vllm_ir.trace(max_events=5) as t:
        for _ in range(tracing.MAX_SAMPLES + 10):
            ops.rms_norm(X, W, 1e-6)
    assert len(t.events) == 5 and t.calls == tracing.MAX_SAMPLES + 10
    (row,) = t.rows.values()
    assert row.calls == t.calls and len(row.samples) == tracing.MAX_SAMPLES
    assert "the last 5 kept one by one" in t.summary()
    with pytest.raises(ValueError, match="max_events"):
        vllm_ir.trace(max_events=-1)


def test_a_trace_cannot_be_entered_twice():
    t = vllm_ir.trace()
    with t, pytest.raises(RuntimeError, match="already open"):
        t.__enter__()


def test_json_and_chrome_exports(tmp_path):
    with vllm_ir.trace() as t:
        ops.rms_norm(X, W, 1e-6)
        ops.silu_and_mul(torch.randn(4, 128))
    t.to_json(tmp_path / "t.json")
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["schema"] == tracing.SCHEMA and data["calls"] == 2
    assert tracing.Trace.from_dict(data).table() == t.table()
    t.to_chrome_trace(tmp_path / "c.json")
    chrome = json.loads((tmp_path / "c.json").read_text())
    events = chrome["traceEvents"]
    assert [e["name"] for e in events] == ["vllm_ir::rms_norm[native]", "vllm_ir::silu_and_mul[native]"]
    for e in events:
        assert e["ph"] == "X" and e["dur"] >= 0 and {"ts", "pid", "tid", "args"} <= set(e)
        assert e["args"]["shapes"] and e["args"]["dtype"] == "float32"
    assert events[0]["ts"] <= events[1]["ts"]


def test_a_trace_read_back_says_how_many_calls_it_kept():
    """`vllm-ir trace` merges the traces its processes wrote; their kept calls count as kept."""
    whole, cut = vllm_ir.trace(), vllm_ir.trace(max_events=2)
    for t in (whole, cut):
        with t:
            for n in (1, 2, 3):
                ops.rms_norm(torch.randn(n, 64), W, 1e-6)
    back, back_cut = tracing.Trace.from_dict(whole.to_dict()), tracing.Trace.from_dict(cut.to_dict())
    assert back.calls == back_cut.calls == 3
    assert len(back.to_dict()["events"]) == 3 and "kept one by one" not in back.summary()
    assert len(back_cut.to_dict()["events"]) == 2 and "the last 2 kept one by one" in back_cut.summary()


def test_an_unwritable_export_path_is_a_clear_error_and_the_trace_survives(tmp_path):
    with vllm_ir.trace() as t:
        ops.rms_norm(X, W, 1e-6)
    bad = tmp_path / "missing" / "t.json"
    with pytest.raises(vllm_ir.TraceExportError, match="could not write the trace to"):
        t.to_json(bad)
    with pytest.raises(OSError):  # it is an OSError too
        t.to_chrome_trace(bad)
    t.to_json(tmp_path / "t.json")  # nothing was lost
    assert json.loads((tmp_path / "t.json").read_text())["calls"] == 1


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = _Norm()
        self.act = _Act()

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(x + residual))


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(64) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, 1e-6)


class _Act(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(torch.cat([x, x], dim=-1))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, x)
        return x


def test_calls_are_attributed_to_module_paths_and_hooks_are_removed():
    model = _Model()
    with torch.no_grad(), vllm_ir.trace(model) as t:
        for _ in range(2):
            model(X)
        ops.rms_norm(X, W, 1e-6)  # outside the model
    assert t.by_module() == {
        "layers.0.norm": {"rms_norm -> native": 2},
        "layers.0.act": {"silu_and_mul -> native": 2},
        "layers.1.norm": {"rms_norm -> native": 2},
        "layers.1.act": {"silu_and_mul -> native": 2},
        tracing.OUTSIDE: {"rms_norm -> native": 1},
    }
    assert "layers.1.act: silu_and_mul -> native x2" in t.module_table()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_a_module_that_raises_does_not_corrupt_the_attribution():
    model = _Model()
    with torch.no_grad(), vllm_ir.trace(model) as t:
        with pytest.raises(RuntimeError):
            model(torch.randn(8, 63))  # the norm's weight does not fit
        model(X)
    assert t.by_module()["layers.0.act"] == {"silu_and_mul -> native": 1}


def test_hugging_face_llama_trace_names_every_module_and_provider():
    pytest.importorskip("transformers")
    from tests.test_integration_transformers import PROMPT, build
    from vllm_ir.integrations import transformers as hf

    model = build("llama")
    hf.kernelize(model)
    layers = model.config.num_hidden_layers
    with torch.no_grad(), vllm_ir.trace(model) as t:
        model(PROMPT)
    by_module = t.by_module()
    for i in range(layers):
        assert by_module[f"model.layers.{i}.mlp"] == {"silu_and_mul -> native": 1}
        assert by_module[f"model.layers.{i}.input_layernorm"] == {"rms_norm -> native": 1}
        assert by_module[f"model.layers.{i}"] == {"fused_add_rms_norm -> native": 1}
    assert by_module["model.norm"] == {"rms_norm -> native": 1}
    calls = {r["op"]: r["calls"] for r in t.table()}
    assert calls == {"rms_norm": layers + 1, "fused_add_rms_norm": layers, "silu_and_mul": layers}


@pytest.fixture(scope="module")
def compiled_trace():
    """One compile of `_Model` inside a trace, shared (compiles are slow)."""
    model = _Model()
    with torch.no_grad(), vllm_ir.trace(model) as t:
        compiled = vllm_ir.compile(model)
        compiled(X)
    return t


def test_a_compiled_models_trace_lists_lowered_kernels_modules_and_fusions(compiled_trace):
    (graph,) = compiled_trace.compiled
    kernels = sorted((k["op"], k["provider"], k["module"]) for k in graph["kernels"])
    assert kernels == [
        ("fused_add_rms_norm", "native", "layers.0.norm"),
        ("fused_add_rms_norm", "native", "layers.1.norm"),
        ("silu_and_mul", "native", "layers.0.act"),
        ("silu_and_mul", "native", "layers.1.act"),
    ]
    text = compiled_trace.summary()
    origin = "served from Inductor's cache" if graph["from_cache"] else "compiled"
    assert f"compiled graph 0 ({origin}): 4 IR nodes lowered" in text
    assert "fusion add_rms_norm: fired 2x" in text
    assert "fusion quant: requested, did not fire" in text  # no quant op in this model


@pytest.mark.subprocess
def test_a_warm_inductor_cache_still_lists_the_kernels_with_plain_torch_compile(tmp_path):
    """The same script twice in fresh processes: the second compile is an Inductor cache hit."""
    code = """
        import torch, vllm_ir
        f = torch.compile(lambda x, w: vllm_ir.ops.rms_norm(x + x, w, 1e-6), options=vllm_ir.inductor_options())
        with vllm_ir.trace() as t:
            f(torch.randn(4, 64), torch.ones(64))
        (graph,) = t.compiled
        print(graph["from_cache"], sorted((k["op"], k["provider"]) for k in graph["kernels"]), graph["fusions"])
    """
    runs = [_python(code, TORCHINDUCTOR_CACHE_DIR=str(tmp_path)) for _ in range(2)]
    lines = []
    for out in runs:
        assert out.returncode == 0, out.stderr
        lines.append(out.stdout.strip().splitlines()[-1])
    fused = "[('fused_add_rms_norm', 'native')] ['add_rms_norm: add + rms_norm -> fused_add_rms_norm_default']"
    assert lines == [f"False {fused}", f"True {fused}"]


@pytest.mark.subprocess
def test_profiler_labels_every_call_on_the_fast_and_the_python_path():
    code = """
        import torch, vllm_ir
        x, w = torch.randn(8, 64), torch.ones(64)
        vllm_ir.ops.rms_norm(x, w, 1e-6)  # cached before the profiler starts
        with torch.profiler.profile() as prof:
            for _ in range(3):
                vllm_ir.ops.rms_norm(x, w, 1e-6)
        vllm_ir.ops.rms_norm(x, w, 1e-6)
        counts = {e.key: e.count for e in prof.key_averages() if e.key.startswith("vllm_ir::")}
        print(counts)
    """
    for fast in ("1", "0"):
        out = _python(code, VLLM_IR_FAST_LOOKUP=fast)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == "{'vllm_ir::rms_norm[native]': 3}", (fast, out.stdout)


def test_reference_mode_runs_native_eager_and_says_so(declining):
    assert ops.rms_norm.cached_dispatch(X, W, 1e-6).provider == declining
    with vllm_ir.reference():
        assert ops.rms_norm.cached_dispatch(X, W, 1e-6).provider == "native"
        explanation = ops.rms_norm.explain(X, W, 1e-6)
        with vllm_ir.trace() as t:
            ops.rms_norm(X, W, 1e-6)
    assert explanation.chosen == "native"
    assert [v.status for v in explanation.verdicts if v.provider == declining] == ["reference mode"]
    assert "REFERENCE MODE (pinned to native by vllm_ir.reference())" in t.summary()
    assert ops.rms_norm.cached_dispatch(X, W, 1e-6).provider == declining  # undone on exit


@pytest.mark.subprocess
def test_reference_mode_from_the_environment_pins_compiled_graphs_too():
    code = """
        import torch, vllm_ir
        from tests.compile_models import opaque_rms_norm
        vllm_ir.ops.rms_norm.register_impl("opaque")(opaque_rms_norm)
        vllm_ir.set_priority(rms_norm=["opaque"])
        f = vllm_ir.compile(lambda x, w: vllm_ir.ops.rms_norm(x, w, 1e-6))
        f(torch.randn(4, 64), torch.ones(64))
        print(vllm_ir.passes.record_of(f).selected_impls)
        print(vllm_ir.ops.rms_norm.cached_dispatch(torch.randn(4, 64), torch.ones(64), 1e-6).provider)
    """
    out = run_python(["-c", textwrap.dedent(code)], env=_env(VLLM_IR_REFERENCE="1", PYTHONPATH=os.getcwd()))
    assert out.returncode == 0, out.stderr
    selected, eager = out.stdout.strip().splitlines()[-2:]
    assert "'native'" in selected and "opaque" not in selected and eager == "native"


@pytest.mark.subprocess
def test_doctor_reports_reference_mode_and_a_malformed_trace_variable():
    out = run_python([*CLI, "doctor", "--json"], env=_env(VLLM_IR_REFERENCE="1", VLLM_IR_TRACE="sometimes"))
    report = json.loads(out.stdout)
    assert report["reference_mode"] == "pinned to native by VLLM_IR_REFERENCE=1"
    assert report["tracing"]["process"] is False
    assert any(p["setting"] == "VLLM_IR_TRACE" for p in report["problems"]), report["problems"]


SCRIPT = """
import torch, vllm_ir
x, w = torch.randn(8, 64), torch.ones(64)
for _ in range(4):
    vllm_ir.ops.rms_norm(x, w, 1e-6)
vllm_ir.ops.silu_and_mul(torch.randn(2, 32))
"""


@pytest.mark.subprocess
def test_process_trace_prints_the_summary_at_exit():
    out = _python(SCRIPT, VLLM_IR_TRACE="1")
    assert out.returncode == 0, out.stderr
    assert "vllm-ir trace: 5 eager calls" in out.stderr
    assert "rms_norm" in out.stderr and "silu_and_mul" in out.stderr


@pytest.mark.subprocess
def test_the_config_file_turns_tracing_and_reference_mode_on_and_the_environment_overrides_it(tmp_path):
    config = tmp_path / "vllm-ir.toml"
    config.write_text("trace = true\nreference = true\n")
    code = SCRIPT + "\nprint(vllm_ir.ir.priority.reference_reason())\n"
    out = _python(code, VLLM_IR_CONFIG=str(config))
    assert out.returncode == 0, out.stderr
    assert "vllm-ir trace: 5 eager calls" in out.stderr and "REFERENCE MODE" in out.stderr
    assert out.stdout.strip().splitlines()[-1] == f"pinned to native by config {config}, key reference"
    out = _python(code, VLLM_IR_CONFIG=str(config), VLLM_IR_TRACE="0", VLLM_IR_REFERENCE="0")
    assert out.returncode == 0, out.stderr
    assert "vllm-ir trace" not in out.stderr and out.stdout.strip().splitlines()[-1] == "None"
    config.write_text('trace = "yes"\n')
    out = _python("import vllm_ir; print(vllm_ir.ir.priority.process_traced)", VLLM_IR_CONFIG=str(config))
    assert out.returncode == 0 and out.stdout.strip() == "False"


@pytest.mark.subprocess
def test_vllm_ir_trace_runs_a_script_and_writes_files_after_the_summary(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    json_file, bad = tmp_path / "t.json", tmp_path / "missing" / "c.json"
    out = run_python(
        [*CLI, "trace", "--json", str(json_file), "--chrome", str(bad), "--", sys.executable, str(script)], env=_env()
    )
    assert out.returncode == 1  # the Chrome file could not be written
    assert "1 process(es) traced" in out.stdout and "vllm-ir trace: 5 eager calls" in out.stdout
    assert f"could not write the Chrome trace to {str(bad)!r}" in out.stderr
    assert json.loads(json_file.read_text())["calls"] == 5
    empty = run_python([*CLI, "trace"], env=_env())
    assert empty.returncode == 2 and "give the command to trace" in empty.stderr
    failing = run_python([*CLI, "trace", "--", sys.executable, "-c", "raise SystemExit(3)"], env=_env())
    assert failing.returncode == 3 and "nothing was traced" in failing.stderr


def _token_variants(op, args: tuple):
    """The generated call, then its first token tensor as 1-D float, 1-D integer, 3-D, sparse and absent."""
    yield args
    index = list(op.signature.parameters).index(op.token_params[0])
    lead = args[index]
    if not isinstance(lead, torch.Tensor):
        return
    for other in (
        lead.reshape(-1)[:5].float(),
        torch.arange(5),
        lead.reshape(1, *lead.shape),
        lead.float().reshape(lead.shape[0], -1).to_sparse(),
        None,
    ):
        yield (*args[:index], other, *args[index + 1 :])


@pytest.mark.parametrize("op", [op for op in vllm_ir.ir.registry.all_ops() if op.token_params], ids=lambda op: op.name)
def test_the_traced_facts_equal_the_reference_readers(op):
    """What the trace records of a call: the compiled reader answers as the Python reference
    does (or hands over, None), and both as reading each tensor and `first_token_count` would,
    for every op, with the lead tensor in every form it can take."""
    from vllm_ir.ir.dispatch.cache_key import first_token_count
    from vllm_ir.ir.dispatch.observe import call_site, compiled_call_facts, decode_shapes, python_call_facts

    site = call_site(op, "native", "functional")
    where = (site.tensor_indices, site.token_indices, site.first_tensor)
    handed_over = 0
    for case in [(3, 64), (1, 7), (2, 3, 64)]:
        for args in _token_variants(op, op.generate_inputs(case, torch.float32, "cpu")):
            reference = python_call_facts(args, *where)
            dtype, cuda, shapes, tokens = reference
            expected = [None if args[i] is None else list(args[i].shape) for i in op.tensor_param_indices]
            assert decode_shapes(shapes) == expected
            assert tokens == first_token_count(*(args[i] for i in site.token_indices)), (case, expected)
            lead = None if site.first_tensor is None else args[site.first_tensor]
            assert (dtype, cuda) == ((None, False) if lead is None else (lead.dtype, lead.is_cuda))
            if compiled_call_facts is not None:
                compiled = compiled_call_facts(args, *where)
                handed_over += compiled is None
                assert compiled is None or compiled == reference, (case, expected)
    if compiled_call_facts is not None:  # the sparse lead is the one form Python reads itself
        assert handed_over <= 3, handed_over


def test_the_compiled_fact_reader_hands_subclasses_and_bad_indices_to_python():
    """Anything the C reader cannot read as Python would (a tensor subclass, which may redefine
    its shape; an index out of range) is handed back, never answered differently."""
    from vllm_ir.ir.dispatch.observe import compiled_call_facts, python_call_facts

    if compiled_call_facts is None:
        pytest.skip("vllm_ir.ir.dispatch._fast_lookup is not built")

    class Sub(torch.Tensor):
        pass

    x = torch.randn(2, 8)
    assert compiled_call_facts((x.as_subclass(Sub), W), (0, 1), (0,), 0) is None
    assert compiled_call_facts((x, W), (0, 5), (0,), 0) is None
    assert compiled_call_facts((x, None), (0, 1), (0,), 0) == python_call_facts((x, None), (0, 1), (0,), 0)
    assert compiled_call_facts((x, W), (0, 1), (), None) == python_call_facts((x, W), (0, 1), (), None)
    with pytest.raises(TypeError, match="three tuples"):
        compiled_call_facts([x, W], (0, 1), (0,), 0)


def test_one_trace_shared_by_threads_counts_every_call():
    """The process trace takes calls from many threads at once without a lock on the hot path."""
    trace = tracing.Trace()
    per_thread, threads = 2000, 4
    from vllm_ir.ir.dispatch.observe import call_site, python_call_facts

    site = call_site(ops.rms_norm, "native", "functional")
    shapes = [torch.randn(n, 64) for n in (1, 3, 8, 40)]

    def work(k: int) -> None:
        for i in range(per_thread):
            args = (shapes[(i + k) % 4], W, 1e-6)
            trace.record(site, python_call_facts(args, site.tensor_indices, site.token_indices, 0), i, 10)

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads between bytecodes as often as the interpreter can
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(interval)
    assert trace.calls == per_thread * threads
    assert sum(r.calls for r in trace.rows.values()) == trace.calls
    assert sum(r.total_ns for r in trace.rows.values()) == 10 * trace.calls
    events = trace.events
    assert len(events) == per_thread * threads and {tuple(e["shapes"][0]) for e in events} == {
        (n, 64) for n in (1, 3, 8, 40)
    }
    assert {e["tokens"] for e in events} == {1, 3, 8, 40}


def test_events_past_the_numbered_shape_sets_keep_their_shapes(monkeypatch):
    monkeypatch.setattr(tracing, "MAX_SHAPE_SETS", 2)
    with vllm_ir.trace() as t:
        for n in (1, 2, 3, 4):
            ops.rms_norm(torch.randn(n, 64), W, 1e-6)
    assert [e["shapes"] for e in t.events] == [[[n, 64], [64]] for n in (1, 2, 3, 4)]
    assert [e["tokens"] for e in t.events] == [1, 2, 3, 4]


# -- the compiled recorder against the Python one ----------------------------------------------

needs_compiled_recorder = pytest.mark.skipif(
    vllm_ir.ir.dispatch.fast_lookup.Recorder is None, reason="vllm_ir.ir.dispatch._fast_lookup is not built"
)


def _content(t: tracing.Trace) -> dict:
    """What a trace holds, less what differs between two runs of the same calls: times, the
    process, thread idents; rows, modules and fallbacks sorted (each recorder numbers its own)."""
    data = t.to_dict()
    for key in ("started", "ended", "pid"):
        del data[key]
    for r in data["rows"]:
        assert len(r.pop("recent_ns")) == min(r["calls"], tracing.MAX_SAMPLES)
        del r["total_ns"]
    threads: dict[int, int] = {}
    for e in data["events"]:
        assert e.pop("duration_ns") >= 0
        del e["start_ns"], e["pid"]
        e["tid"] = threads.setdefault(e["tid"], len(threads))  # the order threads first appear in
    for key in ("rows", "modules", "fallbacks"):
        data[key] = sorted(data[key], key=lambda r: json.dumps(r, sort_keys=True))
    return data


def _both_recorders(monkeypatch, calls, model=None, max_events: int = tracing.MAX_EVENTS):
    """``calls()`` traced twice: into the compiled recorder, then with it off (the compiled
    runners hand every call to the Python recorder). Returns both traces."""
    traces = []
    for compiled in (True, False):
        monkeypatch.setattr(tracing, "compiled_recorder", compiled)
        with warnings.catch_warnings(), vllm_ir.trace(model, max_events=max_events) as t:
            warnings.simplefilter("ignore")
            calls()
        traces.append(t)
    native, python = traces
    assert python._recorder is None and native._recorder is not None
    return native, python


def _assert_same(native: tracing.Trace, python: tracing.Trace, *, all_compiled: bool = True) -> None:
    assert _content(native) == _content(python)
    header = [re.sub(r"[0-9.]+ ms in kernels", "", t.summary().splitlines()[0]) for t in (native, python)]
    assert header[0] == header[1]
    assert native.calls == python.calls > 0
    if all_compiled:  # the compiled recorder took every call: the comparison above compared it
        assert native._recorder.calls == native.calls


@needs_compiled_recorder
def test_the_compiled_recorder_records_what_the_python_one_does(monkeypatch, declining):
    """Rows per token range and dtype, fallbacks with reasons, shapes with None and strides, events in order."""

    def calls():
        for _ in range(3):
            ops.rms_norm(X, W, 1e-6)
        ops.rms_norm(torch.randn(300, 64), W, 1e-6)
        ops.rms_norm(X.double(), W.double(), 1e-6)  # the declining provider's fallback
        ops.rms_norm(X.t().contiguous().t(), None, 1e-6)
        ops.rms_norm(torch.randn(1, 64), W, 1e-6)
        ops.silu_and_mul(torch.randn(4, 128))
        ops.rms_norm(torch.randn(64), W, 1e-6)  # 1-D floating: no token count

    native, python = _both_recorders(monkeypatch, calls)
    _assert_same(native, python)
    assert any(f["declined"] for f in native.to_dict()["fallbacks"])
    assert [e["tokens"] for e in native.events] == [8, 8, 8, 300, 8, 8, 1, 4, None]


@needs_compiled_recorder
def test_the_compiled_recorder_agrees_on_in_place_and_autograd_calls(monkeypatch):
    from tests.compile_models import inplace_fused_add_rms_norm

    ops.fused_add_rms_norm.register_impl("trace_inplace_c", inplace=True)(inplace_fused_add_rms_norm)
    vllm_ir.set_priority(fused_add_rms_norm=["trace_inplace_c"])

    def calls():
        x, residual = torch.randn(4, 64), torch.randn(4, 64)
        ops.fused_add_rms_norm.maybe_inplace(x, residual, W, 1e-6)
        ops.fused_add_rms_norm(x, residual, W, 1e-6)
        ops.rms_norm(X.clone().requires_grad_(), W, 1e-6).sum().backward()

    native, python = _both_recorders(monkeypatch, calls)
    _assert_same(native, python)
    assert {r["form"] for r in native.table()} == {"in-place", "in-place on copies", "functional"}


@needs_compiled_recorder
def test_the_compiled_recorder_attributes_modules_as_the_python_one_does(monkeypatch):
    model = _Model()

    def calls():
        with torch.no_grad():
            for _ in range(2):
                model(X)
            with pytest.raises(RuntimeError):
                model(torch.randn(8, 63))  # a module that raises
            ops.rms_norm(X, W, 1e-6)  # outside the model

    native, python = _both_recorders(monkeypatch, calls, model=model)
    _assert_same(native, python)
    assert native.by_module()["layers.1.act"] == {"silu_and_mul -> native": 2}
    assert {e["module"] for e in native.events} >= {"layers.0.norm", tracing.OUTSIDE}


@needs_compiled_recorder
def test_calls_the_compiled_runner_hands_over_merge_into_one_trace(monkeypatch):
    """A tensor subclass and a full shape table go to the Python recorder; bounded event lists
    keep the same last calls; both recorders' rows and events merge as one recorder's would."""

    class Sub(torch.Tensor):
        pass

    monkeypatch.setattr(tracing, "MAX_SHAPE_SETS", 3)

    def calls():
        for n in (1, 2, 3, 4, 5, 2):  # the shape table holds 3: the 4th and 5th are handed over
            ops.rms_norm(torch.randn(n, 64), W, 1e-6)
        ops.rms_norm(X.as_subclass(Sub), W, 1e-6)
        ops.rms_norm(X, W, 1e-6)

    native, python = _both_recorders(monkeypatch, calls)
    _assert_same(native, python, all_compiled=False)
    assert 0 < native._recorder.calls < native.calls  # both recorders took calls
    assert [e["tokens"] for e in native.events] == [1, 2, 3, 4, 5, 2, 8, 8]
    native, python = _both_recorders(monkeypatch, calls, max_events=3)
    _assert_same(native, python, all_compiled=False)
    assert [e["tokens"] for e in native.events] == [2, 8, 8]
    assert "the last 3 kept one by one" in native.summary()


@needs_compiled_recorder
def test_the_compiled_recorder_agrees_with_threads_sharing_one_trace_and_with_their_own(monkeypatch):
    import contextvars

    def shared(compiled: bool) -> tracing.Trace:
        monkeypatch.setattr(tracing, "compiled_recorder", compiled)
        t = vllm_ir.trace()
        context = contextvars.copy_context()
        context.run(t.__enter__)

        # All three live at once: a thread that ended could hand its id to the next one, and
        # events are told apart by thread id.
        started = threading.Barrier(3)

        def work(k: int) -> None:
            started.wait()
            for i in range(200):
                ops.rms_norm(torch.empty(k + 1 + i % 2, 64), W, 1e-6)

        threads = [threading.Thread(target=context.copy().run, args=(work, k)) for k in (0, 2, 4)]
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        finally:
            sys.setswitchinterval(interval)
        context.run(t.close)
        return t

    native, python = shared(True), shared(False)
    assert native._recorder.calls == native.calls == python.calls == 600
    a, b = _content(native), _content(python)
    assert a["rows"] == b["rows"]
    # Threads interleave differently in each run; each thread's own calls keep their order.
    for data in (a, b):
        by_thread: dict[int, list[int]] = {}
        for e in data.pop("events"):
            by_thread.setdefault(e["tid"], []).append(e["tokens"])
        assert sorted(by_thread.values()) == [[k + 1 + i % 2 for i in range(200)] for k in (0, 2, 4)]
    assert a == b

    own: dict[tuple[bool, int], tracing.Trace] = {}

    def work(compiled: bool, n: int) -> None:
        with vllm_ir.trace() as t:
            for _ in range(n):
                ops.rms_norm(torch.randn(n, 64), W, 1e-6)
        own[(compiled, n)] = t

    for compiled in (True, False):
        monkeypatch.setattr(tracing, "compiled_recorder", compiled)
        threads = [threading.Thread(target=work, args=(compiled, n)) for n in (3, 5)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    for n in (3, 5):
        _assert_same(own[(True, n)], own[(False, n)])
