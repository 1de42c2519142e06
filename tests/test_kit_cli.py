"""``pytest --vllm-ir-conformance`` as a vendor runs it: real pytest subprocesses, real provider distributions.

A run that verified nothing fails unless ``--vllm-ir-allow-skip``; a mistyped provider lists the
known ones; the summary's worst case includes failed cases; ``--vllm-ir-report`` writes JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plugin_dists import make_dist

ACME = """
import vllm_ir

@vllm_ir.ops.rms_norm.register_impl("tp_kit_acme", supported=vllm_ir.Unsupported("no Acme accelerator is visible"))
def rms_norm(x, weight, epsilon, variance_size=None):
    return vllm_ir.ops.rms_norm.fn(x, weight, epsilon, variance_size)
"""

WRONG = """
import vllm_ir

@vllm_ir.ops.rms_norm.register_impl("tp_kit_wrong")
def rms_norm(x, weight, epsilon, variance_size=None):
    return vllm_ir.ops.rms_norm.fn(x, weight, epsilon, variance_size) * 1.01
"""

PICKY = """
import torch
import vllm_ir

def fp32_only(x, weight, epsilon, variance_size=None):
    return x.dtype == torch.float32 or vllm_ir.Unsupported("only float32 here")

@vllm_ir.ops.rms_norm.register_impl("tp_kit_picky", supports_args=fp32_only)
def rms_norm(x, weight, epsilon, variance_size=None):
    return vllm_ir.ops.rms_norm.fn(x, weight, epsilon, variance_size)
"""

FAST = ("--vllm-ir-small", "--vllm-ir-examples", "2", "--vllm-ir-skip-compile")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("kit_site")
    make_dist(root, "tp-kit-acme", ACME)
    make_dist(root, "tp-kit-wrong", WRONG)
    make_dist(root, "tp-kit-picky", PICKY, version="2.5.0")
    return root


def kit(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_IR_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    env["VLLM_IR_PROVIDERS"] = "tp_kit_acme,tp_kit_wrong,tp_kit_picky"  # the repo's providers stay out: fast
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--vllm-ir-conformance", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=600,
    )


def test_a_provider_without_its_device_ran_nothing_and_fails(site, tmp_path):
    result = kit(site, tmp_path, "--vllm-ir-provider", "tp_kit_acme", *FAST)
    assert result.returncode == 1, result.stdout[-3000:]
    assert " skipped" in result.stdout.splitlines()[-1] and " passed" not in result.stdout.splitlines()[-1]
    assert "tp_kit_acme ran 0 case(s): 0 passed, 0 failed, " in result.stdout
    assert "provider 'tp_kit_acme' ran no case (this run verified nothing: FAILED)" in result.stdout
    assert "skipped because: tp_kit_acme is unsupported here: no Acme accelerator is visible" in result.stdout
    assert "pass --vllm-ir-allow-skip" in result.stdout


def test_allow_skip_accepts_a_run_that_verified_nothing(site, tmp_path):
    result = kit(site, tmp_path, "--vllm-ir-provider", "tp_kit_acme", "--vllm-ir-allow-skip", *FAST)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "provider 'tp_kit_acme' ran no case (allowed by --vllm-ir-allow-skip)" in result.stdout


def test_a_mistyped_provider_lists_the_known_ones(site, tmp_path):
    result = kit(site, tmp_path, "--vllm-ir-provider", "tp_kit_acm", *FAST)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert "--vllm-ir-provider 'tp_kit_acm': unknown provider; known providers: " in result.stderr
    assert "tp_kit_acme" in result.stderr and "did you mean 'tp_kit_acme'?" in result.stderr


def test_the_worst_case_line_includes_failed_cases(site, tmp_path):
    result = kit(site, tmp_path, "--vllm-ir-provider", "tp_kit_wrong", *FAST, "-k", "numerics and not property")
    assert result.returncode == 1
    (line,) = [line for line in result.stdout.splitlines() if "tp_kit_wrong rms_norm" in line and "worst case" in line]
    assert "worst case FAILED " in line and "x tolerance)" in line
    ratio = float(line.rsplit("(", 1)[1].split("x")[0])
    assert ratio > 1.0


def test_report_json_per_op(site, tmp_path):
    report = tmp_path / "out" / "report.json"
    report.parent.mkdir()
    result = kit(
        site, tmp_path, "--vllm-ir-provider", "tp_kit_picky", *FAST, "-k", "numerics and not property",
        "--vllm-ir-report", str(report),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    data = json.loads(report.read_text())
    import torch

    assert data["versions"]["torch"] == torch.__version__ and data["versions"]["vllm_ir"]
    picky = data["providers"]["tp_kit_picky"]
    assert (picky["distribution"], picky["version"], picky["status"]) == ("tp-kit-picky", "2.5.0", "loaded")
    rms = picky["ops"]["rms_norm"]
    assert rms["cases_run"] > 0 and rms["passed"] == rms["cases_run"] and rms["failed"] == 0
    assert rms["worst"]["failed"] is False and rms["worst"]["tolerance_ratio"] <= 1.0
    assert "float32" in rms["worst"]["case"]
    assert rms["declines"] and set(rms["declines"]) == {"only float32 here"}
    assert f"report written to {report}" in result.stdout


def test_report_records_failures_and_an_unwritable_report_is_a_usage_error(site, tmp_path):
    report = tmp_path / "r.json"
    kit(site, tmp_path, "--vllm-ir-provider", "tp_kit_wrong", *FAST, "-k", "numerics and not property",
        "--vllm-ir-report", str(report))  # fmt: skip
    rms = json.loads(report.read_text())["providers"]["tp_kit_wrong"]["ops"]["rms_norm"]
    assert rms["failed"] > 0 and rms["worst"]["failed"] is True
    assert all("x the tolerance" in f["message"] for f in rms["failures"] if f["check"] == "numerics")
    bad = kit(site, tmp_path, "--vllm-ir-provider", "tp_kit_wrong", "--vllm-ir-report", str(tmp_path / "no" / "r.json"))
    assert bad.returncode == pytest.ExitCode.USAGE_ERROR and "--vllm-ir-report: cannot write" in bad.stderr


def test_a_device_this_torch_lacks_ran_nothing_and_a_malformed_one_is_a_usage_error(site, tmp_path):
    report = tmp_path / "r.json"
    result = kit(site, tmp_path, "--vllm-ir-provider", "tp_kit_picky", "--vllm-ir-device", "cuda", *FAST,
                 "-k", "numerics and not property", "--vllm-ir-report", str(report))  # fmt: skip
    assert result.returncode == 1, result.stdout[-3000:]
    assert "tp_kit_picky ran 0 case(s)" in result.stdout
    assert "skipped because: device 'cuda' is not available to this torch" in result.stdout
    data = json.loads(report.read_text())
    assert data["device"] == "cuda" and data["providers"]["tp_kit_picky"]["ran_nothing"] is True
    bad = kit(site, tmp_path, "--vllm-ir-provider", "tp_kit_picky", "--vllm-ir-device", "cudaa", *FAST)
    assert bad.returncode == pytest.ExitCode.USAGE_ERROR and "--vllm-ir-device 'cudaa'" in bad.stderr


def test_under_xdist_the_tallies_and_report_are_the_serial_ones(site, tmp_path):
    """Vendors parallelise the kit with pytest-xdist: only workers collect, the controller tallies."""
    runs = {}
    for label, extra in (("serial", ()), ("xdist", ("-n", "2"))):
        report = tmp_path / f"{label}.json"
        result = kit(site, tmp_path, "--vllm-ir-provider", "tp_kit_picky", *FAST, *extra,
                     "-k", "numerics and not property", "--vllm-ir-report", str(report))  # fmt: skip
        assert result.returncode == 0, result.stdout[-3000:]
        runs[label] = json.loads(report.read_text())["providers"]["tp_kit_picky"]
    serial, parallel = runs["serial"], runs["xdist"]
    assert parallel["cases_run"] == serial["cases_run"] > 0
    assert parallel["ops"]["rms_norm"]["passed"] == serial["ops"]["rms_norm"]["passed"]
