"""Provider discovery through real entry points of throw-away distributions (no mocks)."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import vllm_ir
from tests.plugin_dists import GOOD_IMPL, isolated_site, make_dist
from vllm_ir import PluginError, ProviderStatus
from vllm_ir.plugins import discovery as plugins

HOOKS = """
import vllm_ir

@vllm_ir.hookimpl
def vllm_ir_default_priority(platform, mode):
    return {{"rms_norm": [{provider!r}]}}
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path for distributions, and discovery reset before and after."""
    yield from isolated_site(tmp_path, monkeypatch)


def _record(name):
    return {r.name: r for r in vllm_ir.provider_records()}[name]


def _ours(providers):
    """Only this test's providers (the repo's installed providers load too and may add defaults)."""
    return [p for p in providers if p.startswith("tp_") or p == "native"]


def _x():
    return torch.randn(3, 8), torch.ones(8), 1e-6


def test_good_provider_loads_registers_and_contributes_defaults(site):
    make_dist(site, "tp-good", GOOD_IMPL.format(provider="tp_good") + HOOKS.format(provider="tp_good"))
    record = _record("tp_good")
    assert record.status is ProviderStatus.LOADED
    assert (record.distribution, record.version) == ("tp-good", "1.0.0")
    assert record.implementations == {"tp_good": ["rms_norm"]}
    entries = {r.entry.provider: r.entry for r in vllm_ir.ir.priority.resolve(vllm_ir.ops.rms_norm).entries}
    assert entries["tp_good"].source == "provider tp_good"
    with vllm_ir.priority(rms_norm=["tp_good"]):
        vllm_ir.ops.rms_norm(*_x())
    assert sys.modules["tp_good"].CALLS == ["tp_good"]
    assert vllm_ir.ops.rms_norm.impls["tp_good"].origin == "tp-good 1.0.0"


def test_discovery_is_lazy_and_happens_once(site):
    make_dist(site, "tp-lazy", GOOD_IMPL.format(provider="tp_lazy"))
    assert "tp_lazy" not in sys.modules
    vllm_ir.ops.rms_norm(*_x())  # first dispatch discovers
    assert "tp_lazy" in sys.modules
    make_dist(site, "tp-later", GOOD_IMPL.format(provider="tp_later"))
    importlib.invalidate_caches()
    vllm_ir.load_providers()
    assert "tp_later" not in {r.name for r in vllm_ir.provider_records()}


def test_failing_import_is_recorded_and_partial_registrations_removed(site):
    make_dist(site, "tp-boom", GOOD_IMPL.format(provider="tp_boom") + "\nraise RuntimeError('no driver found')\n")
    make_dist(site, "tp-fine", GOOD_IMPL.format(provider="tp_fine"))
    with pytest.warns(RuntimeWarning, match="tp_boom"):
        vllm_ir.load_providers()
    record = _record("tp_boom")
    assert record.status is ProviderStatus.FAILED
    assert "import of tp_boom failed: RuntimeError: no driver found" in record.reason
    assert "tp_boom" not in vllm_ir.ops.rms_norm.impls
    assert _record("tp_fine").status is ProviderStatus.LOADED
    vllm_ir.ops.rms_norm(*_x())


def test_raising_hook_is_recorded_and_provider_withdrawn(site):
    source = (
        GOOD_IMPL.format(provider="tp_hook")
        + """
@vllm_ir.hookimpl
def vllm_ir_default_priority(platform, mode):
    raise KeyError("bad table")
"""
    )
    make_dist(site, "tp-hook", source)
    with pytest.warns(RuntimeWarning, match="tp_hook"):
        assert _ours(e.provider for e in vllm_ir.ops.rms_norm.get_priority()) == ["native"]
    record = _record("tp_hook")
    assert record.status is ProviderStatus.FAILED
    assert record.reason == "hook vllm_ir_default_priority raised KeyError: 'bad table'"
    assert "tp_hook" not in vllm_ir.ops.rms_norm.impls


def test_incompatible_core_requirement_is_not_imported(site):
    make_dist(site, "tp-old", GOOD_IMPL.format(provider="tp_old"), requires=("vllm-ir<0.1", "torch"))
    with pytest.warns(RuntimeWarning):
        record = _record("tp_old")
    assert record.status is ProviderStatus.INCOMPATIBLE
    assert record.reason == f"requires vllm-ir<0.1 but {vllm_ir.__version__} is installed"
    assert "tp_old" not in sys.modules


def test_bad_signature_registration_fails_the_provider_only(site):
    source = (
        GOOD_IMPL.format(provider="tp_sig")
        + """
@vllm_ir.ops.fused_add_rms_norm.register_impl("tp_sig")
def fused(x: Tensor, residual: Tensor, weight: Tensor | None, epsilon: float) -> tuple[Tensor, Tensor]:
    return x, residual
"""
    )
    make_dist(site, "tp-sig", source)
    with pytest.warns(RuntimeWarning):
        record = _record("tp_sig")
    assert record.status is ProviderStatus.FAILED
    assert "RegistrationError" in record.reason and "signature does not match" in record.reason
    assert "tp_sig" not in vllm_ir.ops.rms_norm.impls  # its earlier, valid registration is withdrawn too


def test_duplicate_provider_name_fails_the_second(site):
    make_dist(site, "tp-first", GOOD_IMPL.format(provider="tp_same"), entry="tp_a", module="tp_first")
    make_dist(site, "tp-second", GOOD_IMPL.format(provider="tp_same"), entry="tp_b", module="tp_second")
    with pytest.warns(RuntimeWarning):
        records = {r.name: r for r in vllm_ir.provider_records()}
    assert records["tp_a"].status is ProviderStatus.LOADED
    assert records["tp_b"].status is ProviderStatus.FAILED
    assert "already has an implementation" in records["tp_b"].reason and "tp-first" in records["tp_b"].reason
    assert vllm_ir.ops.rms_norm.impls["tp_same"].origin == "tp-first 1.0.0"


CLAIM = """
import vllm_ir

@vllm_ir.hookimpl
def vllm_ir_platform():
    return vllm_ir.Platform({name!r}, "cpu")
"""


def test_one_platform_claim_wins_two_are_reported_and_both_stay_loaded(site):
    make_dist(site, "tp-claim-a", CLAIM.format(name="plat_a"))
    assert vllm_ir.current_platform().name == "plat_a"
    assert vllm_ir.current_platform().claimed_by == "tp_claim_a"
    plugins.reset_for_tests()
    make_dist(site, "tp-claim-b", CLAIM.format(name="plat_b"))
    importlib.invalidate_caches()
    with pytest.warns(vllm_ir.ConfigWarning, match="'tp_claim_a' and 'tp_claim_b' all claim the platform"):
        assert vllm_ir.current_platform().name == "cpu"
    for name in ("tp_claim_a", "tp_claim_b"):
        assert _record(name).status is ProviderStatus.LOADED


def test_allow_and_deny_lists_block(site, monkeypatch):
    make_dist(site, "tp-allowed", GOOD_IMPL.format(provider="tp_allowed"))
    make_dist(site, "tp-denied", GOOD_IMPL.format(provider="tp_denied"))
    monkeypatch.setenv("VLLM_IR_DISABLE_PROVIDERS", "tp_denied")
    assert _record("tp_denied").status is ProviderStatus.BLOCKED
    assert _record("tp_denied").reason == "listed in VLLM_IR_DISABLE_PROVIDERS"
    assert _record("tp_allowed").status is ProviderStatus.LOADED
    plugins.reset_for_tests()
    monkeypatch.delenv("VLLM_IR_DISABLE_PROVIDERS")
    monkeypatch.setenv("VLLM_IR_PROVIDERS", "tp_denied")
    assert _record("tp_allowed").status is ProviderStatus.BLOCKED
    assert _record("tp_allowed").reason == "not in VLLM_IR_PROVIDERS=tp_denied"
    assert "tp_allowed" not in vllm_ir.ops.rms_norm.impls


def test_autoload_off_then_explicit_load(site, monkeypatch):
    make_dist(site, "tp-manual", GOOD_IMPL.format(provider="tp_manual"))
    monkeypatch.setenv("VLLM_IR_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert _record("tp_manual").status is ProviderStatus.NOT_LOADED
    assert "tp_manual" not in vllm_ir.ops.rms_norm.impls
    assert vllm_ir.load_provider("tp_manual").status is ProviderStatus.LOADED
    assert "tp_manual" in vllm_ir.ops.rms_norm.impls
    with pytest.raises(PluginError, match="no provider entry point named 'nope'"):
        vllm_ir.load_provider("nope")


def test_strict_mode_raises(site, monkeypatch):
    make_dist(site, "tp-strict", "raise ImportError('missing libfoo.so')\n")
    monkeypatch.setenv("VLLM_IR_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match=r"provider 'tp_strict' \(tp-strict 1.0.0\): import of tp_strict failed"):
        vllm_ir.load_providers()


ORDERED = (
    """
import vllm_ir

@vllm_ir.hookimpl({opts})
def vllm_ir_default_priority(platform, mode):
    return {{"rms_norm": [{provider!r}]}}
"""
    + GOOD_IMPL
)


def test_default_merge_order_follows_pluggy_tryfirst_trylast(site):
    make_dist(site, "tp-last", ORDERED.format(opts="trylast=True", provider="tp_last"))
    make_dist(site, "tp-first", ORDERED.format(opts="tryfirst=True", provider="tp_first"))
    make_dist(site, "tp-mid", ORDERED.format(opts="", provider="tp_mid"))
    assert [e.provider for e in vllm_ir.ops.rms_norm.get_priority()][:1] == ["tp_first"]
    providers = [e.provider for e in vllm_ir.ops.rms_norm.get_priority()]
    # every implementation accepts all calls, so only the first is reachable; look at the full list
    resolved = _ours(r.entry.provider for r in vllm_ir.ir.priority.resolve(vllm_ir.ops.rms_norm).entries)
    assert resolved == ["tp_first", "tp_mid", "tp_last", "native"]
    assert providers == ["tp_first"]


def test_adjust_priority_hook_reorders_and_keeps_origin(site):
    make_dist(site, "tp-fast", GOOD_IMPL.format(provider="tp_fast") + HOOKS.format(provider="tp_fast"))
    make_dist(site, "tp-safe", GOOD_IMPL.format(provider="tp_safe") + HOOKS.format(provider="tp_safe"))
    policy = """
import vllm_ir

@vllm_ir.hookimpl
def vllm_ir_adjust_priority(op_name, priority, platform, mode):
    if "tp_safe" in priority:  # site policy: demote tp_safe below everything else
        return [p for p in priority if p != "tp_safe"] + ["tp_safe"]
    return None
"""
    make_dist(site, "tp-policy", policy)
    entries = {r.entry.provider: r.entry.source for r in vllm_ir.ir.priority.resolve(vllm_ir.ops.rms_norm).entries}
    assert _ours(entries) == ["tp_fast", "tp_safe", "native"]
    assert entries["tp_safe"] == "provider tp_safe, moved by tp_policy"


def test_user_priority_still_overrides_plugin_defaults(site):
    make_dist(site, "tp-dflt", GOOD_IMPL.format(provider="tp_dflt") + HOOKS.format(provider="tp_dflt"))
    vllm_ir.load_providers()
    vllm_ir.set_priority(rms_norm=["native"])
    assert vllm_ir.ops.rms_norm.dispatch(*_x()).provider == "native"


def test_explicit_load_first_does_not_prevent_autoload(site):
    make_dist(site, "tp-one", GOOD_IMPL.format(provider="tp_one"))
    make_dist(site, "tp-two", GOOD_IMPL.format(provider="tp_two"))
    vllm_ir.load_provider("tp_one")
    assert _record("tp_two").status is ProviderStatus.LOADED


VARIABLES_HOOK = """
import vllm_ir

@vllm_ir.hookimpl
def vllm_ir_environment_variables():
    return {value}
"""


def test_plugins_declare_their_environment_variables(site):
    make_dist(
        site,
        "tp-vars",
        GOOD_IMPL.format(provider="tp_vars") + VARIABLES_HOOK.format(value='{"TP_VARS_MODE": "a or b"}'),
    )
    make_dist(
        site, "tp-badvars", GOOD_IMPL.format(provider="tp_badvars") + VARIABLES_HOOK.format(value='{"lower": "x"}')
    )
    declared = plugins.provider_variables()
    assert declared["TP_VARS_MODE"] == ("tp_vars", "a or b")
    assert "lower" not in declared
    (problem,) = [f for f in vllm_ir.settings.env.findings() if "tp_badvars" in f.message]
    assert "'lower' is not a variable name" in problem.message and "its variables are not listed" in problem.message
    assert _record("tp_badvars").status is ProviderStatus.LOADED  # display only: the plugin keeps working
    # The in-repo plugins declare what their READMEs document.
    if "vllm_c" in {r.name for r in vllm_ir.provider_records()}:
        assert declared["VLLM_IR_C_TABLES"][0] == "vllm_c"
    if "oot_example" in {r.name for r in vllm_ir.provider_records()}:
        assert declared["VLLM_IR_OOT_PLATFORM"][0] == "oot_example"


@pytest.mark.parametrize(
    ("result", "message"),
    [
        ("not a dict", "expected a dict"),
        ({"VLLM_IR_X": "two\nlines"}, "is not one line"),
        ({"VLLM_IR_X": 3}, "is not one line"),
        ({3: "x"}, "is not a variable name"),
    ],
)
def test_environment_variables_hook_results_are_checked(result, message):
    with pytest.raises(vllm_ir.plugins.hookspecs.HookResultError, match=message):
        vllm_ir.plugins.hookspecs.check_environment_variables(result)
    assert vllm_ir.plugins.hookspecs.check_environment_variables(None) == {}
    assert vllm_ir.plugins.hookspecs.check_environment_variables({"VLLM_IR_X": " one line "}) == {
        "VLLM_IR_X": "one line"
    }
