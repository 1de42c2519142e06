"""The vllm-ir CLI in a real subprocess, with a broken provider installed beside the good ones."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plugin_dists import GOOD_IMPL, make_dist


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("site")
    make_dist(root, "tp-cli-good", GOOD_IMPL.format(provider="tp_cli_good"))
    make_dist(root, "tp-cli-broken", "import tp_missing_vendor_library\n")
    make_dist(root, "tp-cli-raising-predicate", RAISING_PREDICATE)
    return root


RAISING_PREDICATE = """
import vllm_ir

def supports(x, weight, epsilon, variance_size=None):
    return {4096: True}[x.shape[-1]]  # a lookup table that forgot most hidden sizes

@vllm_ir.ops.rms_norm.register_impl("tp_cli_picky", supports_args=supports)
def rms_norm(x, weight, epsilon, variance_size=None):
    return vllm_ir.ops.rms_norm.fn(x, weight, epsilon, variance_size)
"""


def run(site: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_IR_")}
    full_env["PYTHONPATH"] = os.pathsep.join([str(site), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "vllm_ir", *args], capture_output=True, text=True, env=full_env, timeout=120
    )


def test_help_works_with_a_broken_provider_installed(site):
    script = shutil.which("vllm-ir", path=str(Path(sys.executable).parent))
    assert script is not None, "console script vllm-ir is not installed"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_IR_")}
    env["PYTHONPATH"] = str(site)
    result = subprocess.run([script, "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0
    assert "providers" in result.stdout and "explain" in result.stdout


def test_providers_list_json_reports_status_and_reason(site):
    result = run(site, "providers", "list", "--json")
    assert result.returncode == 0, result.stderr
    records = {r["name"]: r for r in json.loads(result.stdout)["providers"]}
    assert records["tp_cli_good"]["status"] == "loaded"
    assert records["tp_cli_good"]["implementations"] == {"tp_cli_good": ["rms_norm"]}
    assert records["tp_cli_good"]["distribution"] == "tp-cli-good"
    broken = records["tp_cli_broken"]
    assert broken["status"] == "failed"
    assert "ModuleNotFoundError" in broken["reason"] and "tp_missing_vendor_library" in broken["reason"]
    assert set(broken) == {"name", "distribution", "version", "entry_point", "status", "reason", "implementations"}


def test_providers_list_text_table_and_blocked(site):
    result = run(site, "providers", "list", env={"VLLM_IR_DISABLE_PROVIDERS": "tp_cli_broken"})
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[2:]}
    assert "blocked" in lines["tp_cli_broken"] and "VLLM_IR_DISABLE_PROVIDERS" in lines["tp_cli_broken"]
    assert "loaded" in lines["tp_cli_good"]


def test_explain_ops_and_doctor_json(site):
    result = run(
        site,
        "explain",
        "rms_norm",
        "--shape",
        "16x64",
        "--dtype",
        "bfloat16",
        "--json",
        env={"VLLM_IR_OP_PRIORITY": "rms_norm=tp_cli_good"},
    )
    assert result.returncode == 0, result.stderr
    exp = json.loads(result.stdout)
    assert exp["chosen"] == "tp_cli_good" and exp["shape"] == [16, 64] and exp["dtype"] == "bfloat16"
    assert exp["verdicts"][0] == {
        "provider": "tp_cli_good",
        "status": "chosen",
        "reason": None,
        "layer": "env",
        "source": "VLLM_IR_OP_PRIORITY",
    }

    ops = json.loads(run(site, "ops", "--json").stdout)["ops"]
    rms = next(o for o in ops if o["name"] == "rms_norm")
    assert rms["signature"].startswith("rms_norm(Tensor x, Tensor? weight, float epsilon")
    assert {i["provider"] for i in rms["implementations"]} >= {"native", "tp_cli_good"}
    assert rms["priority"]["compile"][-1] == {"provider": "native", "layer": "default", "source": "always last"}

    doctor = json.loads(run(site, "doctor", "--json").stdout)
    assert doctor["torch"]["build"] == "cpu" and doctor["platform"]["name"] == "cpu"
    problem = next(p for p in doctor["problems"] if p["provider"] == "tp_cli_broken")
    assert problem["status"] == "failed" and "VLLM_IR_STRICT_PLUGINS=1" in problem["fix"]


def _errors(result: subprocess.CompletedProcess) -> list[str]:
    """stderr without the one-line warnings (the site's broken provider warns)."""
    return [line for line in result.stderr.splitlines() if not line.startswith("vllm-ir: warning:")]


def test_errors_go_to_stderr_with_nonzero_exit(site):
    unknown = run(site, "explain", "no_such_op")
    assert unknown.returncode == 2  # a usage error: the argument names no op
    (error,) = _errors(unknown)
    assert error.startswith("vllm-ir explain: error: argument op: unknown op 'no_such_op'; known ops:")
    assert unknown.stdout == ""
    bad_shape = run(site, "explain", "rms_norm", "--shape", "16xabc")
    assert bad_shape.returncode == 2 and "invalid shape '16xabc'" in bad_shape.stderr
    assert len(_errors(bad_shape)) == 1


def test_a_malformed_environment_is_a_one_line_warning_not_a_failure(site):
    bad_env = run(site, "ops", env={"VLLM_IR_OP_PRIORITY": "rms_norm=;x"})
    assert bad_env.returncode == 0, bad_env.stderr
    assert "Traceback" not in bad_env.stderr and _errors(bad_env) == []
    empty, not_an_entry = [line for line in bad_env.stderr.splitlines() if "VLLM_IR_OP_PRIORITY" in line]
    assert empty.startswith("vllm-ir: warning: VLLM_IR_OP_PRIORITY: op 'rms_norm' has an empty provider name")
    assert "the entry 'rms_norm=' is ignored" in empty
    assert "'x' is not of the form op=provider" in not_an_entry and "the entry 'x' is ignored" in not_an_entry


def test_doctor_reports_a_predicate_that_raises(site):
    result = run(site, "doctor", "--json")
    assert result.returncode == 0, result.stderr
    problems = [p for p in json.loads(result.stdout)["problems"] if p["status"] == "predicate error"]
    assert [p["provider"] for p in problems] == ["tp_cli_picky"]
    assert "op rms_norm: supports_args raised KeyError: 64" in problems[0]["reason"]
    text = run(site, "doctor").stdout
    assert "tp_cli_picky: predicate error: op rms_norm: supports_args raised KeyError: 64" in text


UNSUPPORTED_HERE = """
import vllm_ir

@vllm_ir.ops.rms_norm.register_impl("tp_cli_acme", supported=vllm_ir.Unsupported("no Acme accelerator is visible"))
def rms_norm(x, weight, epsilon, variance_size=None):
    return vllm_ir.ops.rms_norm.fn(x, weight, epsilon, variance_size)
"""


def test_doctor_separates_not_for_this_machine_from_problems(site, tmp_path):
    make_dist(tmp_path, "tp-cli-acme", UNSUPPORTED_HERE)
    both = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(site), os.environ.get("PYTHONPATH", "")])}
    result = run(site, "doctor", "--json", env=both)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    problems = {p["provider"] for p in report["problems"]}
    elsewhere = {n["provider"]: n for n in report["not_for_this_machine"]}
    assert "tp_cli_broken" in problems and "tp_cli_acme" not in problems
    assert elsewhere["tp_cli_acme"]["status"] == "unsupported here"
    assert elsewhere["tp_cli_acme"]["reason"] == "no Acme accelerator is visible"
    text = run(site, "doctor", env=both).stdout
    problems_part, _, elsewhere_part = text.partition("not for this machine (expected here, nothing to fix):")
    problems_part = problems_part.partition("\nproblems:")[2]
    assert "tp_cli_broken: failed" in problems_part and "tp_cli_acme" not in problems_part
    assert "tp_cli_acme: unsupported here: no Acme accelerator is visible" in elsewhere_part
