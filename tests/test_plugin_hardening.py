"""A misbehaving plugin fails alone, visibly, and leaves every op call and command working.

Real test-built distributions with entry points (tests/plugin_dists.py), no mocks: malformed
hook results, an op declared by a plugin that then fails, ``sys.exit`` and Ctrl-C at import,
unknown names in hooks, and the debug log of discovery.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

import vllm_ir
from tests.plugin_dists import GOOD_IMPL, isolated_site, make_dist
from vllm_ir import ProviderStatus
from vllm_ir.ir import registry
from vllm_ir.plugins import discovery as plugins
from vllm_ir.tools import cli


@pytest.fixture
def site(tmp_path, monkeypatch):
    yield from isolated_site(tmp_path, monkeypatch)


def _record(name):
    return {r.name: r for r in vllm_ir.provider_records()}[name]


def _x():
    return torch.randn(3, 8), torch.ones(8), 1e-6


def _everything_else_works(failed_provider):
    """Op calls, explain (as text too) and priorities work, and the failed provider is gone."""
    rms = vllm_ir.ops.rms_norm
    assert failed_provider not in rms.impls
    torch.testing.assert_close(rms(*_x()[:1], torch.ones(8), 1e-6).shape, torch.Size([3, 8]))
    explanation = rms.explain(*_x())
    assert failed_provider not in {v.provider for v in explanation.verdicts}
    assert str(explanation).startswith("rms_norm (eager): chose ")
    with vllm_ir.priority(rms_norm=["native"]):
        assert rms.dispatch(*_x()).provider == "native"


# ---------------------------------------------------------------------------------------
# Malformed hook results

DEFAULTS_RETURNING = """
import vllm_ir

class RaisingTable(dict):
    def items(self):
        raise RuntimeError("table not ready")

def raising_list():
    yield "tp_bad"
    raise RuntimeError("list not ready")

@vllm_ir.hookimpl
def vllm_ir_default_priority(platform, mode):
    return {result}
"""


@pytest.mark.parametrize(
    ("result", "reason"),
    [
        (
            '{"rms_norm": [["tp_bad"]]}',
            "vllm_ir_default_priority, op 'rms_norm': provider list ['tp_bad'] is not a string",
        ),
        ('{"rms_norm": [3]}', "vllm_ir_default_priority, op 'rms_norm': provider int 3 is not a string"),
        ('{"rms_norm": raising_list()}', "op 'rms_norm': reading the result raised RuntimeError: list not ready"),
        ("RaisingTable(rms_norm=['tp_bad'])", "reading the result raised RuntimeError: table not ready"),
        ('{"rms_norm": "tp_bad"}', "op 'rms_norm': expected a list of provider names, got str 'tp_bad'"),
        ('["tp_bad"]', "vllm_ir_default_priority returned list ['tp_bad']; expected a dict"),
        ('{"rms_norm": ["tp bad"]}', "'tp bad' is not a provider name (an identifier)"),
        ('{"rms_norm": ["Tp_Bad"]}', "'Tp_Bad' is not a provider name (an identifier); provider names match"),
        ('{7: ["tp_bad"]}', "vllm_ir_default_priority: op name int 7 is not a string"),
    ],
    ids=[
        "unhashable",
        "int",
        "raising-iterable",
        "raising-mapping",
        "string",
        "list",
        "not-identifier",
        "not-lowercase",
        "op-int",
    ],
)
def test_malformed_default_priority_fails_that_plugin_only(site, result, reason):
    make_dist(site, "tp-bad", GOOD_IMPL.format(provider="tp_bad") + DEFAULTS_RETURNING.format(result=result))
    make_dist(site, "tp-fine", GOOD_IMPL.format(provider="tp_fine"))
    with pytest.warns(RuntimeWarning, match="tp_bad"):
        record = _record("tp_bad")
    assert record.status is ProviderStatus.FAILED
    assert reason in record.reason
    assert _record("tp_fine").status is ProviderStatus.LOADED
    _everything_else_works("tp_bad")


ADJUST_RETURNING = """
import vllm_ir

@vllm_ir.hookimpl
def vllm_ir_adjust_priority(op_name, priority, platform, mode):
    return {result} if op_name == "rms_norm" else None
"""


@pytest.mark.parametrize(
    ("result", "reason"),
    [
        ("3", "vllm_ir_adjust_priority, op 'rms_norm': expected a list of provider names, got int 3"),
        ('"native"', "vllm_ir_adjust_priority, op 'rms_norm': expected a list of provider names, got str 'native'"),
        ("[None, *priority]", "vllm_ir_adjust_priority, op 'rms_norm': provider NoneType None is not a string"),
        # A typo in a site policy: "atenn" for "aten".
        ('["atenn", *priority]', "vllm_ir_adjust_priority, op 'rms_norm': added unknown provider 'atenn'; known"),
    ],
    ids=["int", "string", "none-entry", "typo"],
)
def test_malformed_or_unknown_adjusted_priority_fails_the_policy(site, result, reason):
    make_dist(site, "tp-fine", GOOD_IMPL.format(provider="tp_fine"))
    make_dist(site, "tp-policy", ADJUST_RETURNING.format(result=result))
    with pytest.warns(RuntimeWarning, match="tp_policy"):
        record = _record("tp_policy")
    assert record.status is ProviderStatus.FAILED
    assert reason in record.reason
    entries = [r.entry for r in vllm_ir.ir.priority.resolve(vllm_ir.ops.rms_norm).entries]
    assert not any("tp_policy" in e.source for e in entries)  # its contribution is dropped
    assert _record("tp_fine").status is ProviderStatus.LOADED
    _everything_else_works("tp_policy")


def test_default_priority_naming_an_unknown_op_fails_the_plugin(site):
    source = GOOD_IMPL.format(provider="tp_typo") + DEFAULTS_RETURNING.format(result='{"rms_nrom": ["tp_typo"]}')
    make_dist(site, "tp-typo", source)
    with pytest.warns(RuntimeWarning, match="tp_typo"):
        record = _record("tp_typo")
    assert record.status is ProviderStatus.FAILED
    assert "vllm_ir_default_priority: unknown op 'rms_nrom'; known ops: " in record.reason
    _everything_else_works("tp_typo")


def test_default_priority_may_name_a_provider_that_is_not_installed(site):
    """Like a platform's seeds: an optional provider is shown as not installed, not an error."""
    source = GOOD_IMPL.format(provider="tp_opt") + DEFAULTS_RETURNING.format(result='{"rms_norm": ["tp_absent"]}')
    make_dist(site, "tp-opt", source)
    assert _record("tp_opt").status is ProviderStatus.LOADED
    verdicts = {v.provider: v.status for v in vllm_ir.ops.rms_norm.explain(*_x()).verdicts}
    assert verdicts["tp_absent"] == "not installed"


PLATFORM_RETURNING = """
import vllm_ir

@vllm_ir.hookimpl
def vllm_ir_platform():
    return {result}
"""


@pytest.mark.parametrize(
    ("result", "reason"),
    [
        ('"cuda"', "vllm_ir_platform returned str 'cuda'; expected a vllm_ir.Platform or None"),
        (
            'vllm_ir.Platform("tp_plat", "cpu", {"eager": {"rms_norm": [1]}})',
            "platform 'tp_plat' default_priority('eager'), op 'rms_norm': provider int 1 is not a string",
        ),
    ],
    ids=["string", "bad-defaults"],
)
def test_malformed_platform_claim_fails_the_plugin_and_detection_is_used(site, result, reason):
    make_dist(site, "tp-plat", GOOD_IMPL.format(provider="tp_plat") + PLATFORM_RETURNING.format(result=result))
    with pytest.warns(RuntimeWarning, match="tp_plat"):
        record = _record("tp_plat")
    assert record.status is ProviderStatus.FAILED
    assert reason in record.reason
    assert vllm_ir.current_platform().name == "cpu"
    _everything_else_works("tp_plat")


# ---------------------------------------------------------------------------------------
# An op declared by a plugin that fails

DECLARES_OP = """
import vllm_ir
from torch import Tensor

@vllm_ir.register_op
def tp_plugin_op(x: Tensor) -> Tensor:
    return x * 2

@tp_plugin_op.register_impl("tp_opdecl")
def tp_plugin_op_fast(x: Tensor) -> Tensor:
    return x + x
"""

HOOK_RAISES = """
@vllm_ir.hookimpl
def vllm_ir_default_priority(platform, mode):
    raise RuntimeError("kernels missing")
"""


@pytest.mark.parametrize(
    ("tail", "reason"),
    [
        ("raise RuntimeError('kernels missing')\n", "import of tp_opdecl failed: RuntimeError: kernels missing"),
        (HOOK_RAISES, "hook vllm_ir_default_priority raised RuntimeError: kernels missing"),
    ],
    ids=["import", "hook"],
)
def test_op_declared_by_a_failing_plugin_is_removed_completely(site, tail, reason):
    make_dist(site, "tp-opdecl", DECLARES_OP + tail)
    make_dist(site, "tp-fine", GOOD_IMPL.format(provider="tp_fine"))
    with pytest.warns(RuntimeWarning, match="tp_opdecl"):
        record = _record("tp_opdecl")
    assert record.status is ProviderStatus.FAILED
    assert record.reason == reason
    assert (record.ops, record.implementations) == ([], {})
    assert "tp_plugin_op" not in vllm_ir.ops
    assert not hasattr(torch.ops.vllm_ir, "tp_plugin_op")  # its torch.library definition too
    assert _record("tp_fine").status is ProviderStatus.LOADED
    vllm_ir.set_priority(rms_norm=["tp_fine"])
    _everything_else_works("tp_opdecl")

    # The name is free again, in the registry and in torch.ops.
    def tp_plugin_op(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    try:
        op = vllm_ir.register_op(tp_plugin_op)
        torch.testing.assert_close(torch.ops.vllm_ir.tp_plugin_op(torch.ones(2)), torch.full((2,), 3.0))
        torch.testing.assert_close(op(torch.ones(2)), torch.full((2,), 3.0))
    finally:
        registry.remove_op("tp_plugin_op")


def test_plugin_that_declares_an_op_records_it_apart_from_its_implementations(site, capsys):
    make_dist(site, "tp-opdecl", DECLARES_OP)
    record = _record("tp_opdecl")
    assert record.status is ProviderStatus.LOADED
    assert record.ops == ["tp_plugin_op"]
    assert record.implementations == {"tp_opdecl": ["tp_plugin_op"]}
    assert cli.main(["providers", "list", "--wide"]) == 0  # one line per provider, whatever the terminal
    assert "declares tp_plugin_op; tp_opdecl: tp_plugin_op" in capsys.readouterr().out
    torch.testing.assert_close(vllm_ir.ops.tp_plugin_op(torch.ones(2)), torch.full((2,), 2.0))
    plugins.reset_for_tests()  # withdraws the op with the plugin
    assert "tp_plugin_op" not in vllm_ir.ops


# ---------------------------------------------------------------------------------------
# sys.exit and Ctrl-C


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("import sys\nsys.exit(3)\n", "import of tp_exit failed: SystemExit: the plugin called sys.exit(3)"),
        (
            "import sys\nimport vllm_ir\n\n@vllm_ir.hookimpl\ndef vllm_ir_default_priority(platform, mode):\n"
            "    sys.exit()\n",
            "hook vllm_ir_default_priority raised SystemExit: the plugin called sys.exit(None)",
        ),
        (
            "import sys\nimport vllm_ir\n\n@vllm_ir.hookimpl\ndef vllm_ir_platform():\n    raise SystemExit('no')\n",
            "hook vllm_ir_platform raised SystemExit: the plugin called sys.exit('no')",
        ),
    ],
    ids=["import", "default-hook", "platform-hook"],
)
def test_sys_exit_in_a_plugin_is_that_plugin_failing(site, source, reason):
    make_dist(site, "tp-exit", GOOD_IMPL.format(provider="tp_exit") + source)
    make_dist(site, "tp-fine", GOOD_IMPL.format(provider="tp_fine"))
    with pytest.warns(RuntimeWarning, match="tp_exit"):
        record = _record("tp_exit")
    assert record.status is ProviderStatus.FAILED
    assert record.reason == reason
    assert _record("tp_fine").status is ProviderStatus.LOADED
    _everything_else_works("tp_exit")


def test_ctrl_c_during_a_plugin_import_propagates_and_discovery_resumes(site):
    make_dist(site, "tp-ctrlc", GOOD_IMPL.format(provider="tp_ctrlc") + "\nraise KeyboardInterrupt\n")
    make_dist(site, "tp-zlater", GOOD_IMPL.format(provider="tp_zlater"))
    with pytest.raises(KeyboardInterrupt):
        vllm_ir.load_providers()
    assert "tp_ctrlc" not in vllm_ir.ops.rms_norm.impls  # its registration is withdrawn
    records = {r.name: r for r in vllm_ir.provider_records()}  # the next call loads the rest
    assert records["tp_ctrlc"].status is ProviderStatus.FAILED
    assert records["tp_ctrlc"].reason == "import of tp_ctrlc was interrupted (KeyboardInterrupt)"
    assert records["tp_zlater"].status is ProviderStatus.LOADED
    _everything_else_works("tp_ctrlc")


def test_ctrl_c_during_a_plugin_import_names_the_plugin(site, capsys, caplog):
    """The interrupt still propagates (Ctrl-C must work), with a note naming the plugin; the CLI's
    one line says which plugin's import was interrupted."""
    make_dist(site, "tp-ctrlc", GOOD_IMPL.format(provider="tp_ctrlc") + "\nraise KeyboardInterrupt\n")
    note = "interrupted while importing plugin 'tp_ctrlc' (distribution tp-ctrlc 1.0.0)"
    with caplog.at_level(logging.WARNING, logger="vllm_ir"), pytest.raises(KeyboardInterrupt) as raised:
        vllm_ir.load_providers()
    assert raised.value.__notes__ == [note]
    assert note in caplog.text
    plugins.reset_for_tests()
    assert cli.main(["providers", "list"]) == 130
    assert capsys.readouterr().err == f"vllm-ir providers list: {note}\n"


def test_ctrl_c_outside_a_plugin_import_is_a_plain_interrupt(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_doctor", interrupted)
    assert cli.main(["doctor"]) == 130
    assert capsys.readouterr().err == "vllm-ir doctor: interrupted\n"


# ---------------------------------------------------------------------------------------
# One status everywhere


def _cli_json(capsys, *argv, status=0):
    assert cli.main([*argv, "--json"]) == status
    return json.loads(capsys.readouterr().out)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_doctor_and_providers_list_report_the_same_status(site, capsys):
    """A hook runs lazily; both commands run it first, so neither says "loaded" for a broken plugin."""
    make_dist(site, "tp-lazyfail", GOOD_IMPL.format(provider="tp_lazyfail") + HOOK_RAISES)
    doctor = _cli_json(capsys, "doctor", status=1)  # it lists a problem
    plugins.reset_for_tests()
    listed = {r["name"]: r for r in _cli_json(capsys, "providers", "list")["providers"]}
    assert doctor["providers"]["tp_lazyfail"] == listed["tp_lazyfail"]["status"] == "failed"
    problem = next(p for p in doctor["problems"] if p["provider"] == "tp_lazyfail")
    assert problem["reason"] == listed["tp_lazyfail"]["reason"]
    assert problem["reason"] == "hook vllm_ir_default_priority raised RuntimeError: kernels missing"
    plugins.reset_for_tests()
    assert cli.main(["doctor"]) == 1
    text = capsys.readouterr().out
    assert "tp_lazyfail (failed)" in text and "problems: none" not in text


# ---------------------------------------------------------------------------------------
# Debug log

LOGGED = (
    GOOD_IMPL.format(provider="tp_logged")
    + """
@vllm_ir.hookimpl
def vllm_ir_default_priority(platform, mode):
    return {"rms_norm": ["tp_logged"]}
"""
)


def test_discovery_logs_every_step_at_debug(site, caplog):
    make_dist(site, "tp-logged", LOGGED)
    make_dist(site, "tp-log-broken", "raise ImportError('libvendor.so not found')\n")
    with caplog.at_level(logging.DEBUG, logger="vllm_ir.plugins"), pytest.warns(RuntimeWarning):
        vllm_ir.provider_records()
    messages = [r.getMessage() for r in caplog.records if r.name == "vllm_ir.plugins" and r.levelno == logging.DEBUG]

    def logged(fragment):
        return any(fragment in m for m in messages)

    assert logged("found entry point tp_logged = tp_logged (tp-logged 1.0.0)")
    assert logged("found entry point tp_log_broken = tp_log_broken (tp-log-broken 1.0.0)")
    assert logged(
        "loaded provider 'tp_logged' (tp-logged 1.0.0): loaded; implementations: tp_logged: rms_norm; "
        "ops declared: none; hooks: vllm_ir_default_priority"
    )
    assert logged(
        "provider 'tp_log_broken' failed: import of tp_log_broken failed: ImportError: libvendor.so not found"
    )
    assert logged("platform: cpu")
    assert logged("default priorities (eager): ") and logged("rms_norm: tp_logged [provider tp_logged]")
    assert logged("default priorities (compile): ")


def test_discovery_is_silent_at_default_log_level(site, caplog):
    make_dist(site, "tp-quiet", GOOD_IMPL.format(provider="tp_quiet"))
    vllm_ir.provider_records()
    assert not [r for r in caplog.records if r.name.startswith("vllm_ir")]


# ---------------------------------------------------------------------------------------
# explain names the failed plugin and its reason


@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::vllm_ir.ConfigWarning")
@pytest.mark.parametrize("entry", ["tp_boom", "tp_boom_plugin"], ids=["same_name", "other_entry_point_name"])
def test_explain_says_a_listed_provider_s_plugin_failed_and_why(site, monkeypatch, capsys, entry):
    """Not "no implementation is registered": the plugin's status and reason, the same text as
    ``providers list`` (one source: the provider record), in the Python explain and the CLI's."""
    source = GOOD_IMPL.format(provider="tp_boom") + "\nraise RuntimeError('kernels missing')\n"
    make_dist(site, "tp-boom", source, entry=entry)
    monkeypatch.setenv("VLLM_IR_OP_PRIORITY", "rms_norm=tp_boom,native")
    vllm_ir.reload_env()
    record = _record(entry)
    assert record.status is ProviderStatus.FAILED
    assert record.reason == "import of tp_boom failed: RuntimeError: kernels missing"
    expected = f"plugin {entry!r} (tp-boom 1.0.0) failed: {record.reason}"
    explanation = vllm_ir.ops.rms_norm.explain(*_x())
    verdict = next(v for v in explanation.verdicts if v.provider == "tp_boom")
    assert (verdict.status, verdict.reason) == ("not installed", expected)
    assert expected in str(explanation)
    assert explanation.chosen == "native"
    listed = {r["name"]: r for r in _cli_json(capsys, "providers", "list")["providers"]}
    shown = _cli_json(capsys, "explain", "rms_norm", "--shape", "2x8")
    cli_verdict = next(v for v in shown["verdicts"] if v["provider"] == "tp_boom")
    assert cli_verdict["reason"] == expected == f"plugin {entry!r} (tp-boom 1.0.0) failed: {listed[entry]['reason']}"


@pytest.mark.filterwarnings("ignore::vllm_ir.ConfigWarning")
def test_explain_of_a_provider_no_plugin_offers_keeps_the_plain_reason(site, monkeypatch):
    make_dist(site, "tp-fine", GOOD_IMPL.format(provider="tp_fine"))  # loaded; implements rms_norm only
    monkeypatch.setenv("VLLM_IR_OP_PRIORITY", "fused_add_rms_norm=tp_fine,native")
    vllm_ir.reload_env()
    verdict = vllm_ir.ops.fused_add_rms_norm.explain(torch.randn(3, 8), torch.randn(3, 8), None, 1e-6).verdicts[0]
    assert (verdict.provider, verdict.reason) == (
        "tp_fine",
        "no 'tp_fine' implementation of fused_add_rms_norm is registered",
    )


@pytest.mark.parametrize(
    "line",
    [
        "vllm-ir>=0.1,<0.2",
        "vllm_ir >= 0.1",
        "VLLM.IR (>=0.1, <0.2)",
        "vllm-ir",
        "vllm-ir>=99",
        "vllm-ir>=0.1; python_version >= '3'",
        "vllm-ir>=99; extra == 'test'",
        "vllm-ir[extra]>=99",
        "vllm-ir>=zz",
        "vllm-irx>=99",
        "torch>=2.6",
        "not a requirement !!",
    ],
)
def test_core_requirement_reads_as_packaging_does(line):
    """The light path (no ``packaging.requirements`` at start-up) agrees with packaging's full grammar."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    try:
        req = Requirement(line)
    except InvalidRequirement:
        expected = None
    else:
        marker_holds = not req.marker or req.marker.evaluate({"extra": ""})
        applies = canonicalize_name(req.name) == "vllm-ir" and marker_holds
        expected = str(req.specifier) if applies else None
    got = plugins._core_specifier(line)
    assert (None if got is None else str(got)) == expected


@pytest.mark.parametrize(
    "spec",
    [">=0.1,<0.2", ">= 0.1", "<0.1", "==0.1", "==0.1.0", "!=0.1", ">0.1", "<=0.1.0", ">=0.1.1,!=0.2", "", "~=0.1",
     "==0.*", ">=0.1a1", ">1!0.1"],
)  # fmt: skip
@pytest.mark.parametrize("version", ["0.1.0", "0.1", "0.1.1", "0.2.0", "0.0.9", "1.0", "0.1.0rc1", "0.1.0.post1"])
def test_core_specifier_contains_as_packaging_does(spec, version):
    """The plain-specifier fast path answers as packaging's SpecifierSet for every installed version."""
    from packaging.specifiers import SpecifierSet

    got = plugins._core_specifier(f"vllm-ir{spec}")
    assert str(got) == str(SpecifierSet(spec))
    assert got.contains(version, prereleases=True) == SpecifierSet(spec).contains(version, prereleases=True)
