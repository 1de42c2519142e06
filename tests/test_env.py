"""Environment variables are read by one parser; what it cannot read is said, never silently misread.

Real test-built distributions (tests/plugin_dists.py) and real subprocess runs of the CLI.
Contract: an explicit request (`vllm_ir.reload_env`, ``vllm-ir doctor``) raises or lists a
malformed value; an implicit read (discovery, an op call) ignores just that value with one
`vllm_ir.ConfigWarning`, so an op call never fails because of the environment.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import warnings

import pytest
import torch

import vllm_ir
from tests.plugin_dists import GOOD_IMPL, isolated_site, make_dist
from tests.python_child import run_python
from tests.test_cli import run
from vllm_ir import ConfigError, ConfigWarning, ProviderStatus
from vllm_ir.settings import env


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_IR_FAST_LOOKUP", raising=False)  # isolated_site unsets the plugin variables
    env.forget_warnings()
    yield from isolated_site(tmp_path, monkeypatch)
    env.forget_warnings()


def _records():
    return {r.name: r for r in vllm_ir.provider_records()}


def _config_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, ConfigWarning)]


# ---------------------------------------------------------------------------------------
# The parser


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", True), ("true", True), ("YES", True), (" on ", True), ("0", False), ("off", False), ("No", False)],
)
def test_booleans_accept_the_usual_spellings(value, expected):
    assert env.parse_bool("VLLM_IR_STRICT_PLUGINS", value) is expected


def test_a_malformed_boolean_names_the_variable_and_the_accepted_values():
    with pytest.raises(ConfigError) as info:
        env.parse_bool("VLLM_IR_STRICT_PLUGINS", "maybe")
    assert str(info.value) == (
        "VLLM_IR_STRICT_PLUGINS='maybe' is not a boolean; accepted values: 1, true, yes, on "
        "(or 0, false, no, off; any case)"
    )
    assert info.value.setting == "VLLM_IR_STRICT_PLUGINS" and info.value.fix


def test_a_list_separated_by_semicolons_is_an_error_that_shows_the_right_form():
    assert env.parse_names("VLLM_IR_PROVIDERS", " aten , vllm_c,") == ("aten", "vllm_c")
    with pytest.raises(ConfigError, match=r"VLLM_IR_PROVIDERS='aten; vllm_c': 'aten; vllm_c' is not a provider name"):
        env.parse_names("VLLM_IR_PROVIDERS", "aten; vllm_c")
    try:
        env.parse_names("VLLM_IR_PROVIDERS", "aten; vllm_c")
    except ConfigError as exc:
        assert exc.fix == "write VLLM_IR_PROVIDERS=aten,vllm_c"


# ---------------------------------------------------------------------------------------
# Plugin variables (read at discovery, which never raises)


def test_allow_list_with_semicolons_is_ignored_with_a_warning_not_blocking_everything(site, monkeypatch):
    make_dist(site, "tp-env-a", GOOD_IMPL.format(provider="tp_env_a"))
    make_dist(site, "tp-env-b", GOOD_IMPL.format(provider="tp_env_b"))
    monkeypatch.setenv("VLLM_IR_PROVIDERS", "tp_env_a; tp_env_b")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = _records()
    assert records["tp_env_a"].status is ProviderStatus.LOADED
    assert records["tp_env_b"].status is ProviderStatus.LOADED
    (message,) = [m for m in _config_warnings(caught) if "VLLM_IR_PROVIDERS" in m]
    assert "'tp_env_a; tp_env_b' is not a provider name" in message
    assert "VLLM_IR_PROVIDERS is ignored" in message and "fix: write VLLM_IR_PROVIDERS=tp_env_a,tp_env_b" in message


@pytest.mark.parametrize(
    ("var", "consequence"),
    [("VLLM_IR_PROVIDERS", "it allows nothing"), ("VLLM_IR_DISABLE_PROVIDERS", "there is nothing to disable")],
)
def test_unknown_names_in_allow_and_deny_lists_are_reported(site, monkeypatch, var, consequence):
    make_dist(site, "tp-env-a", GOOD_IMPL.format(provider="tp_env_a"))
    monkeypatch.setenv(var, "tp_env_a,tp_env_aa")
    with pytest.warns(ConfigWarning) as caught:
        _records()
    (message,) = [m for m in _config_warnings(caught) if var in m]
    assert f"{var} names 'tp_env_aa', which is no known provider (installed providers: " in message
    assert "tp_env_a" in message and consequence in message


def test_strict_plugins_on_means_on(site, monkeypatch):
    make_dist(site, "tp-env-broken", "import tp_env_missing_library\n")
    monkeypatch.setenv("VLLM_IR_STRICT_PLUGINS", "on")
    with pytest.raises(vllm_ir.PluginError, match="tp_env_missing_library"):
        vllm_ir.load_providers()


def test_strict_plugins_malformed_is_reported_and_off(site, monkeypatch):
    make_dist(site, "tp-env-broken", "import tp_env_missing_library\n")
    monkeypatch.setenv("VLLM_IR_STRICT_PLUGINS", "sometimes")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _records()["tp_env_broken"].status is ProviderStatus.FAILED
    assert any("VLLM_IR_STRICT_PLUGINS='sometimes' is not a boolean" in m for m in _config_warnings(caught))
    assert any("VLLM_IR_STRICT_PLUGINS='sometimes'" in f.message for f in env.findings())


@pytest.mark.parametrize(("value", "compiled"), [("false", False), ("off", False), ("1", True), ("maybe", True)])
@pytest.mark.subprocess
def test_fast_lookup_reads_booleans(value, compiled):
    code = "from vllm_ir.ir.dispatch import fast_lookup; print(fast_lookup.available(), fast_lookup.describe())"
    result = subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        capture_output=True,
        text=True,
        env={**_clean_environ(), "VLLM_IR_FAST_LOOKUP": value},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    from vllm_ir.ir.dispatch import fast_lookup

    if compiled and not fast_lookup.available():
        pytest.skip(f"the extension is not built here: {fast_lookup.unavailable_reason}")
    assert result.stdout.startswith(str(compiled)), result.stdout
    if not compiled:
        assert f"turned off by VLLM_IR_FAST_LOOKUP={value}" in result.stdout
    assert ("VLLM_IR_FAST_LOOKUP='maybe' is not a boolean" in result.stderr) == (value == "maybe")


def _clean_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_IR_", "VLLM_BATCH"))}


# ---------------------------------------------------------------------------------------
# Priority and policy variables: explicit reads raise, op calls never do


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        ("VLLM_IR_FALLBACK", "loud", "VLLM_IR_FALLBACK='loud' is not accepted; accepted values: allow, warn, error"),
        ("VLLM_BATCH_INVARIANT", "maybe", "VLLM_BATCH_INVARIANT='maybe' is not a boolean; accepted values: 1, true"),
        ("VLLM_IR_OP_PRIORITY", "rms_norm=native;;x", "VLLM_IR_OP_PRIORITY: 'x' is not of the form op=provider"),
    ],
)
def test_malformed_values_raise_on_reload_but_op_calls_keep_working(monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=message):
        vllm_ir.reload_env()
    x, w = torch.randn(3, 8), torch.ones(8)
    torch.testing.assert_close(vllm_ir.ops.rms_norm(x, w, 1e-6), vllm_ir.ops.rms_norm.fn(x, w, 1e-6))
    assert vllm_ir.ops.rms_norm.explain(x, w, 1e-6).chosen == "native"


def test_a_bad_priority_entry_is_dropped_and_the_good_ones_kept(monkeypatch):
    from tests.ops_for_tests import rms_norm_impl

    rms_norm_impl("p_env_good", supports_args=lambda x, weight, epsilon, variance_size=None: True)
    monkeypatch.setenv("VLLM_IR_OP_PRIORITY", "rms_norm=p_env_good;fused_add_rms_norm=p_env_god")
    with pytest.raises(ConfigError, match="unknown provider 'p_env_god' for op 'fused_add_rms_norm'"):
        vllm_ir.reload_env()
    assert vllm_ir.ops.rms_norm.get_priority()[0].provider == "p_env_good"
    assert [e.provider for e in vllm_ir.ops.fused_add_rms_norm.get_priority()] == ["native"]


def test_batch_invariant_yes_is_on(monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "yes")
    assert vllm_ir.reload_env().batch_invariant is True


IMPLICIT = """
import warnings, torch, vllm_ir
warnings.simplefilter("always")
x, w = torch.randn(3, 8), torch.ones(8)
for _ in range(3):
    vllm_ir.ops.rms_norm(x, w, 1e-6)
print("chosen", vllm_ir.ops.rms_norm.dispatch(x, w, 1e-6).provider)
"""


@pytest.mark.subprocess
def test_op_calls_with_a_malformed_environment_warn_once_and_run():
    result = run_python(
        ["-c", IMPLICIT],
        timeout=120,
        env={
            **_clean_environ(),
            "VLLM_IR_DISABLE_PLUGIN_AUTOLOAD": "1",
            "VLLM_IR_FALLBACK": "errror",
            "VLLM_IR_OP_PRIORITY": "rms_norm=natve",
        },
    )
    assert result.returncode == 0, result.stderr
    assert "chosen native" in result.stdout
    warned = [line for line in result.stderr.splitlines() if "ConfigWarning" in line]
    assert len(warned) == 2, result.stderr  # once each, not once per call
    assert any("VLLM_IR_FALLBACK='errror'" in line and "did you mean 'error'?" in line for line in warned)
    assert any("unknown provider 'natve'" in line and "did you mean 'native'?" in line for line in warned)


@pytest.mark.skipif(
    importlib.util.find_spec("vllm_ir_provider_triton") is None, reason="providers/triton_kernels is not installed"
)
@pytest.mark.subprocess
def test_a_provider_absent_here_is_a_warning_once_and_a_note_in_doctor():
    """``rms_norm=triton`` on a CPU machine: kept (shown as unsupported), said once, not a problem."""
    environ = {k: v for k, v in _clean_environ().items() if k != "TRITON_INTERPRET"}  # Triton unsupported here
    environ["VLLM_IR_OP_PRIORITY"] = "rms_norm=triton"
    result = run_python(["-c", IMPLICIT], env=environ)
    assert result.returncode == 0, result.stderr
    (warned,) = [
        line for line in result.stderr.splitlines() if "ConfigWarning" in line and "VLLM_IR_OP_PRIORITY" in line
    ]
    assert "VLLM_IR_OP_PRIORITY: provider 'triton' for op 'rms_norm' is unsupported here" in warned
    doctor = run_python(["-m", "vllm_ir", "doctor", "--json"], env=environ)
    report = json.loads(doctor.stdout)
    assert not [p for p in report["problems"] if p["setting"] == "VLLM_IR_OP_PRIORITY"]
    (note,) = [n for n in report["not_for_this_machine"] if n["setting"] == "VLLM_IR_OP_PRIORITY"]
    assert "provider 'triton' for op 'rms_norm' is unsupported here" in note["reason"]


@pytest.mark.subprocess
def test_doctor_lists_every_bad_setting_with_its_fix(tmp_path):
    result = run(
        tmp_path,
        "doctor",
        "--json",
        env={
            "VLLM_IR_PROVIDERS": "aten; vllm_c",
            "VLLM_IR_STRICT_PLUGINS": "maybe",
            "VLLM_IR_FALLBACK": "loud",
            "VLLM_BATCH_INVARIANT": "perhaps",
            "VLLM_IR_OP_PRIORITY": "rms_norm=natve",
            "VLLM_IR_FALLBAK": "error",
        },
    )
    assert result.returncode == 1, result.stderr  # doctor exits 1 when it lists problems
    problems = {p["setting"]: p for p in json.loads(result.stdout)["problems"] if p["status"] == "bad setting"}
    assert set(problems) == {
        "VLLM_IR_PROVIDERS",
        "VLLM_IR_STRICT_PLUGINS",
        "VLLM_IR_FALLBACK",
        "VLLM_BATCH_INVARIANT",
        "VLLM_IR_OP_PRIORITY",
        "VLLM_IR_FALLBAK",
    }
    assert problems["VLLM_IR_PROVIDERS"]["fix"] == "write VLLM_IR_PROVIDERS=aten,vllm_c"
    assert "accepted values: allow, warn, error" in problems["VLLM_IR_FALLBACK"]["reason"]
    assert "did you mean 'VLLM_IR_FALLBACK'?" in problems["VLLM_IR_FALLBAK"]["reason"]
    assert all(p["fix"] for p in problems.values())
    text = run(tmp_path, "doctor", env={"VLLM_IR_FALLBACK": "loud"}).stdout
    assert "bad setting: VLLM_IR_FALLBACK='loud' is not accepted" in text and "fix: set VLLM_IR_FALLBACK" in text


# ---------------------------------------------------------------------------------------
# One exception hierarchy


#: Modules that define the errors vllm-ir raises (vllm_ir.passes' are imported lazily: Inductor).
def _modules_defining_errors() -> list[str]:
    """Every vllm_ir module whose source defines an exception class (found by reading the tree,
    so a module added or moved is covered without editing this list)."""
    core = pathlib.Path(vllm_ir.__file__).parent
    found = []
    for path in sorted(core.rglob("*.py")):
        if re.search(r"^class \w+\([^)]*(Error|Exception)\b", path.read_text(), re.M):
            rel = path.relative_to(core).with_suffix("")
            found.append(".".join(("vllm_ir", *rel.parts)).removesuffix(".__init__"))
    return found


#: Errors still outside `VllmIrError` (none).
OUTSIDE: set[str] = set()


def test_every_error_of_vllm_ir_is_a_vllm_ir_error():
    found = {}
    names = _modules_defining_errors()
    assert {"vllm_ir.errors", "vllm_ir.tools.arguments", "vllm_ir.ir.collectives"} <= set(names)
    for name in names:
        module = importlib.import_module(name)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, Exception) and not issubclass(value, Warning):
                if value.__module__.startswith("vllm_ir"):
                    found[f"{value.__module__}.{value.__qualname__}"] = value
    outside = {n for n, cls in found.items() if not issubclass(cls, vllm_ir.VllmIrError)}
    assert outside == OUTSIDE  # shrink OUTSIDE when one moves under VllmIrError
    assert "vllm_ir.errors.ConfigError" in found
    # The builtin bases stay: code that catches ValueError (or PriorityError) keeps catching them.
    assert issubclass(ConfigError, ValueError) and issubclass(ConfigError, vllm_ir.PriorityError)
    assert env.ConfigError is ConfigError and env.ConfigWarning is ConfigWarning is vllm_ir.errors.ConfigWarning
    error = ConfigError("bad value", setting="VLLM_IR_X", fix="unset it")
    assert (str(error), error.setting, error.fix) == ("bad value", "VLLM_IR_X", "unset it")


def test_a_provider_of_other_machines_is_a_note_and_a_near_miss_a_typo():
    """No provider names in the core: a name discovery does not know is a typo only when it is a
    near miss of one it does (a shared setting may name a third-party provider absent here)."""
    installed = ["aten", "inductor", "native", "vllm_c"]
    notes = env.unknown_names("VLLM_IR_PROVIDERS", ["acme_kernels", "aiter"], installed, what="w", consequence="c")
    assert [(f.here_only, "not installed here" in f.message) for f in notes] == [(True, True), (True, True)]
    (typo,) = env.unknown_names("VLLM_IR_PROVIDERS", ["vlm_c"], installed, what="w", consequence="c")
    assert (
        not typo.here_only and "which is no known provider" in typo.message and "did you mean 'vllm_c'?" in typo.message
    )


def test_a_third_party_provider_in_a_deny_list_is_not_a_typo(site, monkeypatch):
    make_dist(site, "tp-env-a", GOOD_IMPL.format(provider="tp_env_a"))
    monkeypatch.setenv("VLLM_IR_DISABLE_PROVIDERS", "acme_kernels")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _records()
    (message,) = [m for m in _config_warnings(caught) if "VLLM_IR_DISABLE_PROVIDERS" in m]
    assert "names 'acme_kernels', which is not installed here" in message
    (finding,) = [f for f in env.findings() if "acme_kernels" in f.message]
    assert finding.here_only  # doctor: "not for this machine", not a problem


@pytest.mark.subprocess
def test_doctor_knows_the_variables_plugins_declare():
    """VLLM_IR_C_TABLES (vllm_c) and VLLM_IR_OOT_PLATFORM (the OOT example) are declared by their
    plugins, so doctor does not take them for misspellings of vllm-ir's own variables."""
    records = {r.name for r in vllm_ir.provider_records()}
    if not {"vllm_c", "oot_example"} <= records:
        pytest.skip("providers/vllm_c and examples/oot_platform are installed by scripts/setup.sh")
    environ = {**_clean_environ(), "VLLM_IR_C_TABLES": "1", "VLLM_IR_OOT_PLATFORM": "0", "VLLM_IR_FALBACK": "warn"}
    doctor = run_python(["-m", "vllm_ir", "doctor", "--json"], env=environ)
    settings = {p["setting"] for p in json.loads(doctor.stdout)["problems"]}
    assert "VLLM_IR_FALBACK" in settings  # a real misspelling still is one
    assert not settings & {"VLLM_IR_C_TABLES", "VLLM_IR_OOT_PLATFORM"}


def test_dispatch_settings_check_syntax_and_leave_names_to_the_core():
    """`vllm_ir.settings.dispatch` reads every dispatch setting in one place, below the IR core:
    it keeps well-formed entries whatever they name and reports each malformed one."""
    from vllm_ir.settings import dispatch

    read = dispatch.read(
        {"VLLM_IR_OP_PRIORITY": "no_such_op=acme;bad;x=", "VLLM_IR_FALLBACK": "sometimes", "VLLM_IR_REFERENCE": "1"}
    )
    assert read.env_priority == {
        "no_such_op": dispatch.PriorityList(("acme",), "VLLM_IR_OP_PRIORITY", "no_such_op=acme")
    }
    assert read.fallback == "warn" and read.reference is True
    messages = [f.message for f in read.findings]
    assert any("'bad' is not of the form op=provider" in m and "the entry 'bad' is ignored" in m for m in messages)
    assert any("op 'x' has an empty provider name" in m for m in messages)
    assert any(m.startswith("VLLM_IR_FALLBACK") and "so the policy is 'warn'" in m for m in messages)


def test_warnings_point_at_the_callers_line(monkeypatch):
    """A settings warning and a fallback warning name the user's file and line, not a frame of
    vllm_ir (whichever folder of the package raised it)."""
    import torch

    from tests.ops_for_tests import rms_norm_impl
    from vllm_ir.ir import priority as priority_module

    rms_norm_impl("p_declines", supports_args=lambda x, weight, epsilon, variance_size=None: False)
    x, w = torch.randn(2, 8), torch.ones(8)
    monkeypatch.setenv("VLLM_IR_FALLBACK", "sometimes")
    monkeypatch.setattr(priority_module, "_settings", None)  # read again on the next call
    env.forget_warnings()
    vllm_ir.reset_dispatch_stats()
    with warnings.catch_warnings(record=True) as caught, vllm_ir.priority(rms_norm=["p_declines"]):
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        vllm_ir.ops.rms_norm(x, w, 1e-6)
    kinds = {type(c.message).__name__: (c.filename, c.lineno) for c in caught}
    assert kinds.get("ConfigWarning") == (__file__, line), kinds
    assert kinds.get("FallbackWarning") == (__file__, line), kinds
