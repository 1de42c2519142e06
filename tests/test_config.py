"""Site policy without packaging: ``VLLM_IR_CONFIG=site.toml``, and ``VLLM_IR_PLATFORM`` to pick a claimant.

Real TOML files, real test-built distributions (tests/plugin_dists.py) and real CLI runs.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch

import vllm_ir
from tests.plugin_dists import GOOD_IMPL, isolated_site, make_dist
from tests.test_cli import run
from vllm_ir import ConfigError, ConfigWarning, PriorityLayer, ProviderStatus
from vllm_ir.settings import config, env

VARS = ("VLLM_IR_PLATFORM", "VLLM_IR_CONFIG")


@pytest.fixture
def site(tmp_path, monkeypatch):
    env.forget_warnings()
    yield from isolated_site(tmp_path, monkeypatch)  # unsets VARS too
    for var in VARS:  # before the conftest's reload_env, which would raise on a bad file
        os.environ.pop(var, None)
    config.reset()
    env.forget_warnings()


def _write(site, text: str, name: str = "site.toml") -> str:
    path = site / name
    path.write_text(textwrap.dedent(text).lstrip())
    return str(path)


def _use(monkeypatch, path: str) -> None:
    monkeypatch.setenv("VLLM_IR_CONFIG", path)
    vllm_ir.reload_env()


def _entries(op, mode="eager"):
    return [(e.provider, e.layer, e.source) for e in op.get_priority(mode)]


# ---------------------------------------------------------------------------------------
# Priorities per mode, as a layer between the defaults and the environment


def test_config_priorities_per_mode_are_a_layer_with_the_file_as_origin(site, monkeypatch):
    make_dist(site, "tp-cfg-a", GOOD_IMPL.format(provider="tp_cfg_a"))
    make_dist(site, "tp-cfg-b", GOOD_IMPL.format(provider="tp_cfg_b"))
    path = _write(
        site,
        """
        [priority]
        rms_norm = ["tp_cfg_a", "native"]

        [priority.compile]
        rms_norm = ["tp_cfg_b"]
        """,
    )
    _use(monkeypatch, path)
    source = f"config {path}"
    assert _entries(vllm_ir.ops.rms_norm)[0] == ("tp_cfg_a", PriorityLayer.CONFIG, source)
    assert _entries(vllm_ir.ops.rms_norm, "compile")[0] == ("tp_cfg_b", PriorityLayer.CONFIG, source)
    x, w = torch.randn(2, 8), torch.ones(8)
    assert vllm_ir.ops.rms_norm.dispatch(x, w, 1e-6).provider == "tp_cfg_a"
    # The environment overrides the site for one run; the config stays below it.
    monkeypatch.setenv("VLLM_IR_OP_PRIORITY", "rms_norm=tp_cfg_b")
    vllm_ir.reload_env()
    resolved = vllm_ir.ir.priority.resolve(vllm_ir.ops.rms_norm).entries  # unreachable ones included
    assert [(r.entry.provider, r.entry.layer) for r in resolved][:2] == [
        ("tp_cfg_b", PriorityLayer.ENV),
        ("tp_cfg_a", PriorityLayer.CONFIG),
    ]
    assert PriorityLayer.DEFAULT < PriorityLayer.CONFIG < PriorityLayer.ENV


@pytest.mark.subprocess
def test_ops_and_explain_show_the_config_origin(site):
    make_dist(site, "tp-cfg-a", GOOD_IMPL.format(provider="tp_cfg_a"))
    path = _write(site, '[priority.eager]\nrms_norm = ["tp_cfg_a"]\n')
    cli_env = {"VLLM_IR_CONFIG": path, "VLLM_IR_PROVIDERS": "tp_cfg_a"}
    explained = json.loads(run(site, "explain", "rms_norm", "--shape", "4x8", "--json", env=cli_env).stdout)
    assert explained["chosen"] == "tp_cfg_a"
    assert explained["verdicts"][0] == {
        "provider": "tp_cfg_a",
        "status": "chosen",
        "reason": None,
        "layer": "config",
        "source": f"config {path}",
    }
    ops = json.loads(run(site, "ops", "--json", env=cli_env).stdout)
    assert ops["config"] == path
    rms = next(o for o in ops["ops"] if o["name"] == "rms_norm")
    assert rms["priority"]["eager"][0] == {"provider": "tp_cfg_a", "layer": "config", "source": f"config {path}"}
    assert rms["priority"]["compile"][0]["layer"] != "config"  # [priority.eager] only
    text = run(site, "ops", "rms_norm", "--wide", env=cli_env).stdout  # one op in full: every origin
    assert f"tp_cfg_a [config {path}]" in text


# ---------------------------------------------------------------------------------------
# Disabled providers, platform, fallback policy


def test_disable_providers_and_fallback_from_the_file(site, monkeypatch):
    make_dist(site, "tp-cfg-a", GOOD_IMPL.format(provider="tp_cfg_a"))
    make_dist(site, "tp-cfg-off", GOOD_IMPL.format(provider="tp_cfg_off"))
    path = _write(site, 'fallback = "error"\ndisable_providers = ["tp_cfg_off"]\n')
    _use(monkeypatch, path)
    records = {r.name: r for r in vllm_ir.provider_records()}
    assert records["tp_cfg_off"].status is ProviderStatus.BLOCKED
    assert records["tp_cfg_off"].reason == f"listed in config {path}, key disable_providers"
    assert records["tp_cfg_a"].status is ProviderStatus.LOADED
    assert vllm_ir.ir.priority.settings().fallback == "error"
    monkeypatch.setenv("VLLM_IR_FALLBACK", "allow")  # the variable wins over the file
    assert vllm_ir.reload_env().fallback == "allow"


# ---------------------------------------------------------------------------------------
# Errors name the file, the line and the key


def test_errors_name_file_line_and_key(site, monkeypatch):
    path = _write(
        site,
        """
        fallback = "warn"
        fallbak = "error"

        [priority.eager]
        rms_norm = ["natve"]
        """,
    )
    x, w = torch.randn(2, 8), torch.ones(8)
    without_config = [e.provider for e in vllm_ir.ops.rms_norm.get_priority()]
    monkeypatch.setenv("VLLM_IR_CONFIG", path)
    with pytest.raises(ConfigError) as info:
        vllm_ir.reload_env()
    lines = str(info.value).splitlines()
    assert lines[0].startswith(f"config {path}, line 2, key fallbak: unknown key; did you mean 'fallback'?")
    assert lines[1].startswith(f"config {path}, line 5, key priority.eager.rms_norm: unknown provider 'natve'")
    known = lines[1].partition("known providers of rms_norm: ")[2].partition(";")[0].split(", ")
    assert "native" in known and "did you mean 'native'?" in lines[1]
    # Implicitly read, the good keys apply and the bad ones are ignored with a warning: the
    # misspelt priority leaves rms_norm's list as it was (whatever providers the suite loaded).
    assert [e.provider for e in vllm_ir.ops.rms_norm.get_priority()] == without_config
    assert vllm_ir.ops.rms_norm.dispatch(x, w, 1e-6).provider == without_config[0]
    assert vllm_ir.ir.priority.settings().fallback == "warn"


def test_a_misspelt_mode_table_says_did_you_mean(tmp_path):
    path = _write(tmp_path, '[priority.eagr]\nrms_norm = ["aten"]\n[priority.sometimes]\nrms_norm = ["aten"]\n')
    eagr, sometimes = config.load({"VLLM_IR_CONFIG": path}).findings
    assert eagr.message.startswith(f"config {path}, line 1, key priority.eagr: [priority.eagr] is not a mode")
    assert "did you mean 'eager'?" in eagr.message and eagr.fix == "rename the table [priority.eager]"
    assert "did you mean" not in sometimes.message
    assert "accepted: [priority.eager], [priority.compile]" in sometimes.message


@pytest.mark.parametrize(
    ("value", "fix"),
    [('"aten"', '["aten"]'), ('"vllm_c, native"', '["vllm_c", "native"]'), ("[]", '["native"]'), ("3", '["native"]')],
)
def test_a_priority_that_is_not_a_list_gets_a_fix_with_its_own_names(tmp_path, value, fix):
    path = _write(tmp_path, f"[priority]\nrms_norm = {value}\n[priority.compile]\nfused_add_rms_norm = {value}\n")
    both, compile_only = config.load({"VLLM_IR_CONFIG": path}).findings
    assert both.fix == f"write rms_norm = {fix}" and compile_only.fix == f"write fused_add_rms_norm = {fix}"
    assert "must be a non-empty list of provider names" in both.message


def test_invalid_toml_names_the_line_and_the_file_is_ignored(site, monkeypatch):
    path = _write(site, 'fallback = "error"\n[priority\nrms_norm = ["native"]\n')
    monkeypatch.setenv("VLLM_IR_CONFIG", path)
    with pytest.raises(ConfigError, match=rf"config {path}, line 2: not valid TOML"):
        vllm_ir.reload_env()
    assert vllm_ir.ir.priority.settings().fallback == "warn"  # the whole file is ignored


def test_a_missing_file_is_reported_not_raised_at_import(site, monkeypatch):
    monkeypatch.setenv("VLLM_IR_CONFIG", str(site / "nowhere.toml"))
    config.reset()
    with pytest.warns(ConfigWarning, match="VLLM_IR_CONFIG=.*nowhere.toml.: cannot read"):
        vllm_ir.provider_records()


@pytest.mark.subprocess
def test_doctor_lists_config_problems(site):
    path = _write(site, 'batch_invariant = "yes"\n')
    report = json.loads(run(site, "doctor", "--json", env={"VLLM_IR_CONFIG": path}).stdout)
    assert report["config"] == path
    (problem,) = [p for p in report["problems"] if p["status"] == "bad setting"]
    assert problem["setting"] == f"config {path}, line 1, key batch_invariant"
    assert "must be true or false, not 'yes'" in problem["reason"] and problem["fix"]


# ---------------------------------------------------------------------------------------
# Two plugins claiming the platform: both stay loaded; VLLM_IR_PLATFORM chooses

CLAIM = """
import vllm_ir
from torch import Tensor

@vllm_ir.hookimpl
def vllm_ir_platform():
    return vllm_ir.Platform({name!r}, "cpu")

@vllm_ir.ops.rms_norm.register_impl({provider!r})
def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    return vllm_ir.ops.rms_norm.fn(x, weight, epsilon, variance_size)
"""


@pytest.fixture
def two_claims(site):
    make_dist(site, "tp-claim-x", CLAIM.format(name="plat_x", provider="tp_claim_x"))
    make_dist(site, "tp-claim-y", CLAIM.format(name="plat_y", provider="tp_claim_y"))
    return site


def test_two_claims_keep_both_plugins_and_their_kernels_and_say_how_to_choose(two_claims):
    with pytest.warns(ConfigWarning) as caught:
        platform = vllm_ir.current_platform()
    assert platform.name == "cpu" and platform.claimed_by is None
    records = {r.name: r for r in vllm_ir.provider_records()}
    for name in ("tp_claim_x", "tp_claim_y"):
        assert records[name].status is ProviderStatus.LOADED
        assert name in vllm_ir.ops.rms_norm.impls
    (message,) = [str(w.message) for w in caught if "claim the platform" in str(w.message)]
    assert "plugins 'tp_claim_x' and 'tp_claim_y' all claim the platform" in message
    assert "VLLM_IR_PLATFORM=<tp_claim_x|tp_claim_y|builtin>" in message


@pytest.mark.parametrize(("choice", "expected"), [("tp_claim_y", "plat_y"), ("plat_x", "plat_x"), ("builtin", "cpu")])
def test_vllm_ir_platform_picks_a_claimant_or_builtin(two_claims, monkeypatch, choice, expected):
    monkeypatch.setenv("VLLM_IR_PLATFORM", choice)
    platform = vllm_ir.current_platform()
    assert platform.name == expected
    assert {r.name: r.status for r in vllm_ir.provider_records()}["tp_claim_x"] is ProviderStatus.LOADED
    assert not [f for f in env.findings() if "claim" in f.message]


def test_an_unknown_platform_choice_lists_the_claimants(two_claims, monkeypatch):
    monkeypatch.setenv("VLLM_IR_PLATFORM", "tp_claim_z")
    with pytest.warns(ConfigWarning) as caught:
        assert vllm_ir.current_platform().name == "cpu"
    messages = [str(w.message) for w in caught]
    assert any(
        "VLLM_IR_PLATFORM='tp_claim_z': no plugin claims the platform under that name "
        "(accepted: builtin, tp_claim_x, tp_claim_y)" in m
        for m in messages
    ), messages


def test_the_config_file_can_choose_the_platform(two_claims, monkeypatch):
    path = _write(two_claims, 'platform = "tp_claim_x"\n')
    _use(monkeypatch, path)
    vllm_ir.plugins.discovery.reset_for_tests()
    assert vllm_ir.current_platform().claimed_by == "tp_claim_x"


@pytest.mark.subprocess
def test_doctor_shows_the_claims_and_the_fix(two_claims):
    report = json.loads(run(two_claims, "doctor", "--json").stdout)
    assert report["platform"]["name"] == "cpu"
    assert report["platform"]["claims"] == {"tp_claim_x": "plat_x", "tp_claim_y": "plat_y"}
    (problem,) = [p for p in report["problems"] if "claim the platform" in p["reason"]]
    assert problem["setting"] == "VLLM_IR_PLATFORM" and "VLLM_IR_PLATFORM=<" in problem["fix"]
    chosen = json.loads(run(two_claims, "doctor", "--json", env={"VLLM_IR_PLATFORM": "tp_claim_y"}).stdout)
    assert chosen["platform"]["name"] == "plat_y" and chosen["platform"]["claimed_by"] == "tp_claim_y"
    assert not [p for p in chosen["problems"] if "claim" in p["reason"]]
