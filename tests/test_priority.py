"""Priority layers: defaults < environment < set_priority < scoped priority()."""

from __future__ import annotations

import threading

import pytest
import torch

import vllm_ir
from tests.ops_for_tests import discovery_answering, rms_norm_impl
from vllm_ir import PriorityError, PriorityLayer

op = vllm_ir.ops.rms_norm


def _providers(mode="eager"):
    return [(e.provider, e.layer) for e in op.get_priority(mode)]


@pytest.fixture
def three():
    for name in ("p_env", "p_global", "p_scoped"):
        rms_norm_impl(name, supports_args=lambda x, weight, epsilon, variance_size=None: True)


def test_core_default_is_native():
    assert _providers() == [("native", PriorityLayer.DEFAULT)]


def test_layers_stack_in_order(monkeypatch, three):
    monkeypatch.setenv("VLLM_IR_OP_PRIORITY", "rms_norm=p_env")
    vllm_ir.reload_env()
    vllm_ir.set_priority(rms_norm=["p_global"])
    with vllm_ir.priority(rms_norm=["p_scoped"]):
        assert _providers() == [
            ("p_scoped", PriorityLayer.SCOPED),
            ("p_global", PriorityLayer.GLOBAL),
            ("p_env", PriorityLayer.ENV),
            ("native", PriorityLayer.DEFAULT),
        ]
    assert [p for p, _ in _providers()] == ["p_global", "p_env", "native"]


def test_defaults_source_feeds_the_lowest_layer_per_mode(three):
    with discovery_answering(
        defaults=lambda mode: {"rms_norm": [("p_env", "platform test")]} if mode == "eager" else {}
    ):
        assert op.get_priority("eager")[0].source == "platform test"
        assert _providers("compile") == [("native", PriorityLayer.DEFAULT)]
        vllm_ir.set_priority(rms_norm=["p_global"])
        assert [p for p, _ in _providers()] == ["p_global", "p_env", "native"]
        assert [p for p, _ in _providers("compile")] == ["p_global", "native"]


def test_the_core_learns_from_discovery_only_through_the_connected_discovery(three, monkeypatch):
    """Defaults, known names and absence reasons all come from `registry.connect_discovery`;
    connecting another drops every decision made from the first, and reconnecting restores it."""
    import torch

    x, w = torch.randn(2, 32), torch.randn(32)
    before = op.dispatch(x, w, 1e-6).provider
    answers = {
        "defaults": lambda mode: {"rms_norm": [("p_gone", "test"), ("p_env", "test")]},
        "absence_reason": lambda p: "plugin 'p_gone' failed: test" if p == "p_gone" else None,
        "known_names": lambda: ["p_env2"],
    }
    with discovery_answering(**answers):
        assert op.dispatch(x, w, 1e-6).provider == "p_env"
        (gone,) = [v for v in op.explain(x, w, 1e-6).verdicts if v.provider == "p_gone"]
        assert "plugin 'p_gone' failed: test" in gone.reason
        monkeypatch.setenv("VLLM_IR_OP_PRIORITY", "rms_norm=p_env2")
        vllm_ir.reload_env()  # a provider discovery knows (not here): a note, not a typo of p_env
    assert op.dispatch(x, w, 1e-6).provider == before
    with pytest.raises(vllm_ir.ConfigError, match="p_env2"):
        vllm_ir.reload_env()
    monkeypatch.delenv("VLLM_IR_OP_PRIORITY")
    vllm_ir.reload_env()


def test_duplicates_keep_first_occurrence(three):
    vllm_ir.set_priority(rms_norm=["p_global", "p_env"])
    with vllm_ir.priority(rms_norm=["p_env"]):
        assert _providers() == [
            ("p_env", PriorityLayer.SCOPED),
            ("p_global", PriorityLayer.GLOBAL),
            ("native", PriorityLayer.DEFAULT),
        ]


def test_native_early_makes_the_rest_unreachable(three):
    vllm_ir.set_priority(rms_norm=["native", "p_global"])
    assert [p for p, _ in _providers()] == ["native"]


def test_scoped_priority_nests_and_restores_on_exception(three):
    with vllm_ir.priority(rms_norm=["p_global"]):
        with pytest.raises(RuntimeError):
            with vllm_ir.priority(rms_norm=["p_scoped"]):
                assert [p for p, _ in _providers()][:2] == ["p_scoped", "p_global"]
                raise RuntimeError("boom")
        assert [p for p, _ in _providers()] == ["p_global", "native"]
    assert [p for p, _ in _providers()] == ["native"]


def test_scoped_priority_is_per_thread():
    a = rms_norm_impl("thread_a")
    b = rms_norm_impl("thread_b")
    import torch

    x, w = torch.randn(2, 8), torch.ones(8)
    barrier = threading.Barrier(2)
    errors = []

    def worker(provider):
        try:
            with vllm_ir.priority(rms_norm=[provider]):
                barrier.wait()
                for _ in range(50):
                    vllm_ir.ops.rms_norm(x, w, 1e-6)
                barrier.wait()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(p,)) for p in ("thread_a", "thread_b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert a.calls == ["thread_a"] * 50 and b.calls == ["thread_b"] * 50


def test_unknown_provider_lists_known_ones():
    with pytest.raises(
        PriorityError, match=r"unknown provider 'nope' for op 'rms_norm'; known providers of rms_norm: .*native"
    ):
        vllm_ir.set_priority(rms_norm=["nope"])
    with pytest.raises(PriorityError, match="unknown provider"):
        with vllm_ir.priority(rms_norm=["nope"]):
            pass


def test_unknown_op_lists_known_ones():
    with pytest.raises(
        PriorityError, match=r"unknown op 'rms_nrom'; known ops: (\w+, )*fused_add_rms_norm, (\w+, )*rms_norm"
    ):
        vllm_ir.set_priority(rms_nrom=["native"])


def test_string_instead_of_list_is_refused():
    with pytest.raises(PriorityError, match="must be a list of provider names"):
        vllm_ir.set_priority(rms_norm="native")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("rms_norm=;x", "op 'rms_norm' has an empty provider name"),
        ("rms_norm", "'rms_norm' is not of the form op=provider"),
        ("=native", "is not of the form op=provider"),
        ("rms_norm=native,,native", "empty provider name"),
        ("rms_norm=native;rms_norm=native", "op 'rms_norm' is given twice"),
        ("rms_norm=natve", "unknown provider 'natve' for op 'rms_norm'.*did you mean 'native'"),
        ("bogus_op=native", "unknown op 'bogus_op'"),
    ],
)
def test_env_priority_errors_name_the_variable(monkeypatch, spec, message):
    monkeypatch.setenv("VLLM_IR_OP_PRIORITY", spec)
    with pytest.raises(PriorityError, match=message) as info:
        vllm_ir.reload_env()
    assert "VLLM_IR_OP_PRIORITY" in str(info.value)


def test_env_priority_may_name_a_provider_of_other_machines(monkeypatch):
    """No provider list lives in the core: a name that is no near miss of one discovery knows is
    taken for a provider installed elsewhere (a shared setting), a note and the next provider."""
    monkeypatch.setenv("VLLM_IR_OP_PRIORITY", "rms_norm=acme_kernels,native")
    from vllm_ir.settings import env

    vllm_ir.reload_env()  # no ConfigError
    (note,) = [f for f in env.findings() if "acme_kernels" in f.message]
    assert note.here_only and "has no implementation of 'rms_norm' installed here" in note.message
    x, w = torch.randn(2, 8), torch.ones(8)
    assert op.dispatch(x, w, 1e-6).provider == "native"
    assert [v.provider for v in op.explain(x, w, 1e-6).verdicts][:2] == ["acme_kernels", "native"]


def test_env_priority_parses_whitespace_and_several_ops(monkeypatch, three):
    monkeypatch.setenv("VLLM_IR_OP_PRIORITY", " rms_norm = p_env , native ; fused_add_rms_norm=native ;")
    vllm_ir.reload_env()
    assert op.get_priority()[0] == vllm_ir.PriorityEntry("p_env", PriorityLayer.ENV, "VLLM_IR_OP_PRIORITY")


@pytest.mark.parametrize(("var", "value"), [("VLLM_IR_FALLBACK", "loud"), ("VLLM_BATCH_INVARIANT", "maybe")])
def test_bad_policy_values_are_refused(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(PriorityError, match=var):
        vllm_ir.reload_env()


def test_set_priority_none_clears_one_op(three):
    vllm_ir.set_priority(rms_norm=["p_global"])
    vllm_ir.set_priority(rms_norm=None)
    assert [p for p, _ in _providers()] == ["native"]
