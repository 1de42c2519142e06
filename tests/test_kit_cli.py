"""``pytest --vllm-ir-conformance`` as a vendor runs it: pytest in child interpreters, real provider distributions.

A run that verified nothing fails unless ``--vllm-ir-allow-skip``; a mistyped provider lists the
known ones; the summary's worst case includes failed cases; ``--vllm-ir-report`` writes JSON.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.plugin_dists import make_dist
from tests.python_child import run_python

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

#: One deliberately broken provider per kind of wrong result, plus a false batch-invariance claim.
BROKEN = {
    "tp_kit_none": """
        @vllm_ir.ops.rms_norm.register_impl("tp_kit_none")
        def rms_norm(x, weight, epsilon, variance_size=None):
            ...  # the README's provider example before its body is written
    """,
    "tp_kit_arity": """
        @vllm_ir.ops.fused_add_rms_norm.register_impl("tp_kit_arity")
        def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None):
            return vllm_ir.ops.fused_add_rms_norm.fn(x, x_residual, weight, epsilon, variance_size)[0]
    """,
    "tp_kit_dtype": """
        @vllm_ir.ops.rms_norm.register_impl("tp_kit_dtype")
        def rms_norm(x, weight, epsilon, variance_size=None):
            return vllm_ir.ops.rms_norm.fn(x, weight, epsilon, variance_size).float()
    """,
    "tp_kit_shape": """
        @vllm_ir.ops.rms_norm.register_impl("tp_kit_shape")
        def rms_norm(x, weight, epsilon, variance_size=None):
            return vllm_ir.ops.rms_norm.fn(x, weight, epsilon, variance_size).unsqueeze(0)
    """,
    "tp_kit_alias": """
        @vllm_ir.ops.rms_norm.register_impl("tp_kit_alias")
        def rms_norm(x, weight, epsilon, variance_size=None):
            return x.copy_(vllm_ir.ops.rms_norm.fn(x, weight, epsilon, variance_size))
    """,
    "tp_kit_variant": """
        @vllm_ir.ops.rms_norm.register_impl("tp_kit_variant", batch_invariant=True)
        def rms_norm(x, weight, epsilon, variance_size=None):
            # Small batches another way: within tolerance, but a row's bits depend on the batch size.
            out = vllm_ir.ops.rms_norm.fn(x, weight, epsilon, variance_size)
            small = x.dim() > 1 and x.shape[0] < 8
            if small and out.dtype in (torch.float32, torch.float64):
                return torch.nextafter(out, torch.full_like(out, float("inf")))  # one ulp up
            return out
    """,
}

FAST = ("--vllm-ir-small", "--vllm-ir-examples", "2", "--vllm-ir-skip-compile")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("kit_site")
    make_dist(root, "tp-kit-acme", ACME)
    make_dist(root, "tp-kit-wrong", WRONG)
    make_dist(root, "tp-kit-picky", PICKY, version="2.5.0")
    for name, body in BROKEN.items():
        make_dist(root, name.replace("_", "-"), "import torch\nimport vllm_ir\n" + textwrap.dedent(body))
    make_dist(root, "tp-kit-entry", ACME.replace("tp_kit_acme", "tp_kit_entry_provider"), entry="tp_kit_entry")
    return root


def kit(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_IR_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    # The repo's providers stay out: fast.
    env["VLLM_IR_PROVIDERS"] = ",".join(["tp_kit_acme", "tp_kit_wrong", "tp_kit_picky", "tp_kit_entry", *BROKEN])
    return run_python(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--vllm-ir-conformance", *args], env=env, cwd=cwd, timeout=600
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


EXPECTED = {
    "tp_kit_none": ("rms_norm numerics", "the kernel returned None; native returns "),
    "tp_kit_arity": ("fused_add_rms_norm numerics", "the kernel returned 1 output(s), native returns 2"),
    "tp_kit_dtype": ("rms_norm numerics", "the output is float32["),
    "tp_kit_shape": ("rms_norm numerics", "native's is "),
    "tp_kit_alias": ("rms_norm numerics", "shares memory with argument 'x' where op(...) owes a fresh tensor"),
    "tp_kit_variant": ("rms_norm batch_invariance", "differs between a 37-token batch and"),
}


@pytest.fixture(scope="module")
def broken_run(site, tmp_path_factory) -> subprocess.CompletedProcess:
    """One kit run over every broken provider (numerics and batch invariance only)."""
    providers = [arg for name in BROKEN for arg in ("--vllm-ir-provider", name)]
    where = tmp_path_factory.mktemp("broken")
    return kit(site, where, *providers, *FAST, "-k", "numerics and not property or batch_invariance")


@pytest.mark.parametrize("provider", sorted(EXPECTED))
def test_each_kind_of_wrong_result_fails_with_op_provider_and_what(broken_run, provider):
    what, message = EXPECTED[provider]
    assert broken_run.returncode == 1
    summary = broken_run.stdout[broken_run.stdout.index("vllm-ir conformance") :].splitlines()
    blocks = {}  # (op check, provider) -> the failure's message lines, then its re-run line
    for i, line in enumerate(summary):
        if line.startswith("    ") and not line.startswith("     ") and line.strip().endswith(":"):
            end = next(j for j in range(i + 1, len(summary)) if summary[j].strip().startswith("re-run:"))
            blocks[(line.strip().split(":")[0], summary[end].split("--vllm-ir-provider ")[1].split()[0])] = (
                " ".join(s.strip() for s in summary[i + 1 : end]),
                summary[end].strip(),
            )
    text, rerun = blocks[(what, provider)]
    assert message in text and f"provider {provider!r}" in text, text
    assert rerun.startswith("re-run: pytest --vllm-ir-conformance --vllm-ir-provider " + provider)


def test_the_summary_fits_a_screen_and_tracebacks_are_off(broken_run):
    out = broken_run.stdout
    summary = out[out.index("vllm-ir conformance") :].splitlines()
    # Per provider: the worst-case line, its counts line, and two lines per failing (op, check).
    assert len(summary) <= 10 * len(BROKEN), "\n".join(summary)
    assert "Traceback" not in out and "def rms_norm" not in out  # --tb=no unless asked for
    assert all(len(line) <= 200 for line in summary if not line.strip().startswith("re-run:"))


def test_a_re_run_command_runs_exactly_that_case(site, broken_run, tmp_path):
    lines = broken_run.stdout.splitlines()
    (command,) = [line.split("re-run: ", 1)[1] for line in lines if "re-run:" in line and "tp_kit_variant" in line]
    argv = shlex.split(command)
    assert argv[0] == "pytest"
    result = kit(site, tmp_path, *argv[2:])  # kit() adds pytest and --vllm-ir-conformance
    assert result.returncode == 1, result.stdout[-3000:]
    assert "1 failed" in result.stdout.splitlines()[-1] and "passed" not in result.stdout.splitlines()[-1]


def test_an_entry_point_name_is_not_a_provider_name(site, tmp_path):
    result = kit(site, tmp_path, "--vllm-ir-provider", "tp_kit_entry", *FAST)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert "'tp_kit_entry': that is the entry point of tp-kit-entry, not a provider name" in result.stderr
    assert "tp_kit_entry_provider" in result.stderr


def test_property_cases_are_seeded_and_the_seed_is_printed(site, tmp_path):
    runs = [
        kit(
            site,
            tmp_path,
            "--vllm-ir-provider",
            "tp_kit_picky",
            "--vllm-ir-small",
            "--vllm-ir-examples",
            "3",
            "--vllm-ir-skip-compile",
            "-k",
            "numerics_property",
            *extra,
        )
        for extra in ((), ("--vllm-ir-explore",))
    ]
    assert all(r.returncode == 0 for r in runs), runs[0].stdout[-2000:]
    assert "property-based cases: seed 0 (the default; --vllm-ir-seed 0 replays them)" in runs[0].stdout
    assert "drawn by --vllm-ir-explore" in runs[1].stdout
