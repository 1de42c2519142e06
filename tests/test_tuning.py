"""Measured tuning tables: the layer, its place in the order, per-range choice, explain/doctor,
bad and foreign files, compile (static and dynamic token counts), and `vllm-ir tune`'s rules.

Tables are written here as a user's `vllm-ir tune` would write them; the providers are test
kernels that compute like native and record their calls.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import Tensor

import vllm_ir
from tests.compile_models import KERNEL_CALLS
from tests.ops_for_tests import discovery_answering, rms_norm_impl
from tests.test_cli import run
from vllm_ir import ConfigWarning, PriorityLayer
from vllm_ir.ir import tuning
from vllm_ir.passes import cache
from vllm_ir.tools import tune

ops = vllm_ir.ops
W = torch.randn(32, generator=torch.Generator().manual_seed(3))


def table(path: Path, entries: list[dict], **machine: object) -> Path:
    facts = {**tuning.machine_facts("cpu"), **machine}
    doc = {"schema": tuning.SCHEMA, "machine": facts, "measured": "2026-12-02T08:00:00+00:00", "entries": entries}
    path.write_text(json.dumps(doc))
    return path


def entry(providers: list[str], low: int = 1, high: int | None = None, dtype: str = "float32", **extra: object):
    return {"op": "rms_norm", "dtype": dtype, "tokens": [low, high], "providers": providers, **extra}


def use(monkeypatch, *paths: Path) -> None:
    monkeypatch.setenv("VLLM_IR_TUNING", ":".join(str(p) for p in paths))
    vllm_ir.reload_env()


@pytest.fixture
def two_kernels():
    a, b = (
        rms_norm_impl("tp_tune_a"),
        rms_norm_impl("tp_tune_b", supports_args=lambda x, weight, epsilon, variance_size=None: x.dim() >= 1),
    )
    return a.calls, b.calls


def _chosen(t: int, dtype=torch.float32) -> str:
    return ops.rms_norm.dispatch(torch.randn(t, 32, dtype=dtype), W.to(dtype), 1e-6).provider


def test_a_table_chooses_per_dtype_and_token_range(two_kernels, tmp_path, monkeypatch):
    use(monkeypatch, table(tmp_path / "t.json", [entry(["tp_tune_a"], 1, 8), entry(["tp_tune_b"], 8)]))
    assert [_chosen(t) for t in (1, 7, 8, 4096)] == ["tp_tune_a", "tp_tune_a", "tp_tune_b", "tp_tune_b"]
    assert _chosen(4, torch.bfloat16) == "native"  # no bfloat16 entry: the defaults decide
    calls_a, calls_b = two_kernels
    ops.rms_norm(torch.randn(2, 32), W, 1e-6)
    ops.rms_norm(torch.randn(20, 32), W, 1e-6)
    assert calls_a == ["tp_tune_a"] and calls_b == ["tp_tune_b"]


def test_the_table_sits_above_the_defaults_and_below_config_env_and_code(two_kernels, tmp_path, monkeypatch):
    use(monkeypatch, table(tmp_path / "t.json", [entry(["tp_tune_a", "native"])]))
    x = torch.randn(4, 32)
    layers = [(v.provider, v.layer) for v in ops.rms_norm.explain(x, W, 1e-6).verdicts]
    assert layers[0] == ("tp_tune_a", PriorityLayer.TUNING)
    assert PriorityLayer.DEFAULT < PriorityLayer.TUNING < PriorityLayer.CONFIG < PriorityLayer.ENV
    monkeypatch.setenv("VLLM_IR_OP_PRIORITY", "rms_norm=tp_tune_b")
    vllm_ir.reload_env()
    assert _chosen(4) == "tp_tune_b"
    monkeypatch.delenv("VLLM_IR_OP_PRIORITY")
    vllm_ir.reload_env()
    vllm_ir.set_priority(rms_norm=["tp_tune_b"])
    assert _chosen(4) == "tp_tune_b"
    vllm_ir.clear_priority()
    with vllm_ir.priority(rms_norm=["tp_tune_b"]):
        assert _chosen(4) == "tp_tune_b"
    assert _chosen(4) == "tp_tune_a"


@pytest.mark.subprocess
def test_explain_shows_the_measurement_and_the_range_of_the_shape(two_kernels, tmp_path, monkeypatch):
    measured = {"tp_tune_a": {"us": 6.1, "spread_pct": 3}, "native": {"us": 27.2, "spread_pct": 2}}
    path = table(tmp_path / "t.json", [entry(["tp_tune_a", "native"], 1, 2, measured=measured), entry(["native"], 2)])
    use(monkeypatch, path)
    text = str(ops.rms_norm.explain(torch.randn(1, 32), W, 1e-6))
    assert "chose tp_tune_a" in text
    assert (
        f"tuning: chosen by tuning table {path} (measured 2026-12-02 on {tuning.cpu_model()}, "
        f"{torch.backends.cpu.get_cpu_capability()}" in text
    )
    assert "tp_tune_a 6.1 µs ±3%, native 27.2 µs ±2% at T ∈ [1, 2))" in text
    assert "T ∈ [2, ∞)" in str(ops.rms_norm.explain(torch.randn(5, 32), W, 1e-6))
    result = run(tmp_path, "explain", "rms_norm", "--shape", "3x32", "--json", env={"VLLM_IR_TUNING": str(path)})
    assert result.returncode == 0, result.stderr
    assert "T ∈ [2, ∞)" in json.loads(result.stdout)["tuning"]


@pytest.mark.subprocess
def test_a_malformed_file_warns_naming_it_and_calls_use_the_other_layers(two_kernels, tmp_path, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    good = table(tmp_path / "good.json", [entry(["tp_tune_a"]), {"op": "rms_norm", "dtype": "float32"}])
    monkeypatch.setenv("VLLM_IR_TUNING", f"{bad}:{good}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tuning.reload()  # read again at the next call, as in a fresh process
        assert _chosen(4) == "tp_tune_a"  # the good table's good entry still applies
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert any(f"tuning table {bad} (VLLM_IR_TUNING): not valid JSON" in m for m in messages), messages
    assert any(f"tuning table {good} (VLLM_IR_TUNING), entry 1 (rms_norm): tokens None" in m for m in messages)
    result = run(tmp_path, "doctor", "--json", env={"VLLM_IR_TUNING": f"{bad}:{good}"})
    problems = [p["reason"] for p in json.loads(result.stdout)["problems"] if "tuning table" in p["reason"]]
    assert len([p for p in problems if str(bad) in p]) == 1 and "not valid JSON" in problems[0]
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"schema": "flashinfer.tune/3", "entries": []}))
    result = run(tmp_path, "doctor", env={"VLLM_IR_TUNING": str(foreign)})
    assert f"tuning table {foreign} (VLLM_IR_TUNING): schema is 'flashinfer.tune/3', not 'vllm-ir.tuning/1'" in (
        result.stdout
    )


@pytest.mark.subprocess
def test_a_table_measured_on_other_machine_facts_is_ignored_with_the_reason(two_kernels, tmp_path, monkeypatch):
    other = table(tmp_path / "other.json", [entry(["tp_tune_a"])], isa="SVE256")
    use(monkeypatch, other)
    assert _chosen(4) == "native"
    exp = ops.rms_norm.explain(torch.randn(4, 32), W, 1e-6)
    here = torch.backends.cpu.get_cpu_capability()
    assert exp.tuning == f"tuning entries ignored: {other} entry 0: measured on cpu SVE256, this machine has {here}"
    result = run(tmp_path, "doctor", "--json", env={"VLLM_IR_TUNING": str(other)})
    notes = [n["reason"] for n in json.loads(result.stdout)["not_for_this_machine"]]
    assert any("measured on cpu SVE256" in n and "entries are ignored here" in n for n in notes), notes
    # Another CPU model with the same ISA: the same compiled kernels, so the entry holds.
    use(monkeypatch, table(tmp_path / "same.json", [entry(["tp_tune_a"])], device="Some Other CPU"))
    assert _chosen(4) == "tp_tune_a"


def test_a_shipped_table_of_another_machine_is_a_quiet_note_and_a_site_table_warns(two_kernels, tmp_path, monkeypatch):
    """A provider ships tables for the machines it was measured on: elsewhere that is normal, so
    no warning at every start-up; a table the site named (VLLM_IR_TUNING) is a mistake worth one."""
    other = table(tmp_path / "other.json", [entry(["tp_tune_a"])], isa="SVE256")
    ships = tuning.Facts("cpu", {}, (("provider tp_tune_a (tp-tune-a 1.0)", str(other)),))
    for shipped, facts in ((True, ships), (False, tuning.Facts("cpu", {}, ()))):
        monkeypatch.delenv("VLLM_IR_TUNING", raising=False)
        if not shipped:
            monkeypatch.setenv("VLLM_IR_TUNING", str(other))
        with discovery_answering(tuning_facts=lambda facts=facts: facts):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                vllm_ir.reload_env()
                tuning.reload()
                assert _chosen(4) == "native"
            warned = [str(w.message) for w in caught if "entries are ignored here" in str(w.message)]
            assert len(warned) == (0 if shipped else 1), warned
            notes = [f.message for f in vllm_ir.settings.env.findings() if f.here_only]
            assert any(str(other) in n and "measured on cpu SVE256" in n for n in notes), notes


def test_an_entry_measured_with_another_provider_version_is_ignored(two_kernels, tmp_path, monkeypatch):
    with discovery_answering(tuning_facts=lambda: tuning.Facts("cpu", {"tp_tune_a": "2.0", "tp_tune_b": "1.0"}, ())):
        path = table(tmp_path / "t.json", [entry(["tp_tune_a"], 1, 8), entry(["tp_tune_b"], 8)],
                     providers={"tp_tune_a": "1.0", "tp_tune_b": "1.0"})  # fmt: skip
        use(monkeypatch, path)
        assert _chosen(4) == "native" and _chosen(16) == "tp_tune_b"
        assert (
            "measured with tp_tune_a 1.0, tp_tune_a 2.0 is installed"
            in ops.rms_norm.explain(torch.randn(4, 32), W, 1e-6).tuning
        )


def test_rotary_keeps_one_decision_across_token_counts():
    """1-D positions hold one index per token: the key leaves their length out (issue 33)."""
    op = ops.rotary_embedding

    def fp32(positions, query, key, head_size, cos_sin_cache, is_neox_style, rotary_dim=None):
        return query.dtype == torch.float32

    @op.register_impl("tp_rotary", supports_args=fp32)
    def rotary(positions, query, key, head_size, cos_sin_cache, is_neox_style, rotary_dim=None):
        return op.fn(positions, query, key, head_size, cos_sin_cache, is_neox_style, rotary_dim)

    vllm_ir.set_priority(rotary_embedding=["tp_rotary"])
    for t in (1, 2, 3, 5, 8):
        args = op.generate_inputs((t, 256), torch.float32, "cpu")
        assert args[0].shape == (t,)
        op(*args)
    assert len(op.decision_cache.decisions) == 1
    assert next(iter(op.decision_cache.decisions.values())).provider == "tp_rotary"


# -- compile ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("compile_test_providers")
def test_compile_chooses_by_the_range_of_a_static_token_count_and_keeps_one_choice_for_a_dynamic_one(
    tmp_path, monkeypatch
):
    per_range = [entry(["test_opaque"], 1, 8, mode="compile"), entry(["test_opaque_b"], 8, mode="compile")]
    use(monkeypatch, table(tmp_path / "t.json", per_range))

    def model(x: Tensor) -> Tensor:
        return ops.rms_norm(x, W, 1e-6)

    def ran(compiled, x: Tensor) -> tuple[int, int]:
        before = dict(KERNEL_CALLS)
        torch.testing.assert_close(compiled(x), ops.rms_norm.fn(x, W, 1e-6))
        return KERNEL_CALLS["rms_norm"] - before["rms_norm"], KERNEL_CALLS["rms_norm_b"] - before["rms_norm_b"]

    torch._dynamo.reset()
    static = vllm_ir.compile(model, dynamic=False)
    assert ran(static, torch.randn(4, 32)) == (1, 0)
    assert ran(static, torch.randn(16, 32)) == (0, 1)  # a new static count, lowered by its range
    torch._dynamo.reset()
    dynamic = vllm_ir.compile(model, dynamic=True)
    # The ranges disagree: one graph serves every T, so the defaults (native here) decide.
    assert ran(dynamic, torch.randn(4, 32)) == (0, 0) and ran(dynamic, torch.randn(16, 32)) == (0, 0)
    exp = ops.rms_norm.explain(torch.randn(4, 32), W, 1e-6, mode="compile")
    assert exp.chosen == "test_opaque" and "T ∈ [1, 8)" in exp.tuning
    # One order for every range: a dynamic token count takes it.
    use(monkeypatch, table(tmp_path / "one.json", [entry(["test_opaque_b"], 1, 8, mode="compile"),
                                                  entry(["test_opaque_b"], 8, mode="compile")]))  # fmt: skip
    torch._dynamo.reset()
    dynamic = vllm_ir.compile(model, dynamic=True)
    assert ran(dynamic, torch.randn(4, 32)) == (0, 1) and ran(dynamic, torch.randn(16, 32)) == (0, 1)
    torch._dynamo.reset()


@pytest.mark.usefixtures("compile_test_providers")
def test_a_table_change_changes_the_compile_cache_key(tmp_path, monkeypatch):
    before = cache.priority_fingerprint("compile")
    use(monkeypatch, table(tmp_path / "a.json", [entry(["test_opaque"], mode="compile")]))
    with_a = cache.priority_fingerprint("compile")
    use(monkeypatch, table(tmp_path / "b.json", [entry(["test_opaque_b"], mode="compile")]))
    with_b = cache.priority_fingerprint("compile")
    assert len({before, with_a, with_b}) == 3
    use(monkeypatch, table(tmp_path / "e.json", [entry(["test_opaque_b"], mode="eager")]))
    assert cache.priority_fingerprint("compile") == before  # an eager entry leaves compiled code alone


# -- vllm-ir tune's rules --------------------------------------------------------------------


def _row(provider: str, us: float, spread: float = 2.0, **extra: object) -> dict:
    q = us * spread / 200
    return {"provider": provider, "status": "ok", "median_us": us, "q1_us": us - q, "q3_us": us + q,
            "spread_pct": spread, "noisy": False, "op": "rms_norm", "dtype": "float32", "tokens": 16,
            "variant": "default", "dispatcher_picks": "native", **extra}  # fmt: skip


def test_tune_ranges_split_between_measured_counts_at_powers_of_two():
    assert tune.boundaries([1, 16, 256, 4096]) == [4, 64, 1024]
    assert tune.boundaries([1, 2]) == [2]
    assert tune.boundaries([3, 5]) == [4]


def test_a_provider_winning_only_inside_the_noise_does_not_displace_the_incumbent():
    order, note = tune.order_case([_row("native", 10.0, 20.0), _row("vllm_c", 9.5, 20.0)], "native")
    assert order == ["native"] and "native kept" in note  # vllm_c after native is unreachable
    order, _ = tune.order_case([_row("native", 10.0), _row("vllm_c", 5.0)], "native")
    assert order == ["vllm_c", "native"]
    order, note = tune.order_case([_row("native", 10.0), _row("vllm_c", 5.0, noisy=True)], "native")
    assert order is None and "not learned" in note
    wrong = _row("vllm_c", 1.0) | {"status": "wrong", "median_us": None}
    assert tune.order_case([_row("native", 10.0), wrong], "native")[0] == ["native"]


@pytest.mark.subprocess
def test_tune_writes_a_table_that_the_layer_reads(tmp_path):
    out = tmp_path / "t.json"
    args = ("tune", "rms_norm", "--providers", "native,aten", "--dtype", "float32", "--tokens", "1,64",
            "--hidden", "64", "--quick", "--rounds", "3", "--out", str(out),
            "--json", str(tmp_path / "f.json"))  # fmt: skip
    result = run(tmp_path, *args, env={"VLLM_IR_PROVIDERS": "aten"})
    busy = "the machine was busy" in result.stderr
    assert result.returncode == (2 if busy else 0), result.stderr
    assert ("rms_norm float32 T=1 [1, 8): " in result.stdout) and ("rms_norm float32 T=64 [8, ∞): " in result.stdout)
    if busy:
        assert not out.exists() and "--force" in result.stderr
        result = run(tmp_path, *args, "--force", env={"VLLM_IR_PROVIDERS": "aten"})
        assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    parsed, problems = tuning.read_table(str(out), "test")
    assert problems == [] and parsed is not None and doc["schema"] == tuning.SCHEMA
    assert doc["machine"]["isa"] == torch.backends.cpu.get_cpu_capability()
    for e in parsed.entries:
        assert e.providers[-1] == "native" and e.measured and e.hidden == 64
    learned = json.loads((tmp_path / "f.json").read_text())
    assert list(learned)[:2] == ["schema", "machine"] and learned["schema"] == "vllm-ir.tune/1"
    figures = learned["results"]  # what the table learned from
    assert {(r["provider"], r["tokens"]) for r in figures} == {(p, t) for p in ("native", "aten") for t in (1, 64)}
