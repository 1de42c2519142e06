"""The vllm-ir CLI in a child interpreter, with a broken provider installed beside the good ones.

Each call is a new process (forked from a warm interpreter, see tests/python_child.py): discovery,
entry points and settings are read from scratch, as a user's shell call reads them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vllm_ir
from tests.plugin_dists import GOOD_IMPL, make_dist
from tests.python_child import run_python


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
    return run_python(["-m", "vllm_ir", *args], env=full_env, timeout=120)


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
    result = run(site, "providers", "list", "--wide", env={"VLLM_IR_DISABLE_PROVIDERS": "tp_cli_broken"})
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
    assert result.returncode == 1, result.stderr  # problems listed
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
    assert result.returncode == 1, result.stderr  # tp_cli_broken failed
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


# ---------------------------------------------------------------------------------------
# For people: tables fit the terminal, one op at a time, every provider in explain

MULTILINE_FAILURE = 'raise RuntimeError("kernels missing\\n  looked in /opt/acme\\n  and in /usr/lib")\n'


def _with(site: Path, extra: Path) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(extra), str(site), os.environ.get("PYTHONPATH", "")])}


def test_tables_fit_the_terminal_and_wide_does_not_wrap(site, tmp_path):
    """Tables wrap their cells within COLUMNS; prose lines (notes, the tuning line) are left to the terminal."""
    make_dist(tmp_path, "tp-cli-multiline", MULTILINE_FAILURE)
    env = {**_with(site, tmp_path), "COLUMNS": "80"}
    tables = {
        ("providers", "list"): lambda out: out.partition("\n(--wide")[0].splitlines(),
        ("ops",): lambda out: out.partition("\n(vllm-ir ops NAME")[0].splitlines(),
        ("ops", "rms_norm"): lambda out: out.partition("\n  priority (eager)")[0].splitlines()[1:],
        ("explain", "rms_norm"): lambda out: out.partition("\n  tuning:")[0].splitlines()[1:],
    }
    for verb, table_of in tables.items():
        result = run(site, *verb, env=env)
        assert result.returncode == 0, result.stderr
        lines = table_of(result.stdout)
        assert len(lines) > 3 and [line for line in lines if len(line) > 80] == [], (verb, lines)
    narrow = run(site, "providers", "list", env={**env, "COLUMNS": "60"}).stdout.partition("\n(--wide")[0]
    assert max(len(line) for line in narrow.splitlines()) <= 60
    wide = run(site, "providers", "list", "--wide", env=env).stdout
    assert max(len(line) for line in wide.splitlines()) > 80  # every implemented op listed, on one line
    assert "(--wide" not in wide


def test_a_multi_line_reason_is_one_line_in_the_table_and_whole_in_json(site, tmp_path):
    make_dist(tmp_path, "tp-cli-multiline", MULTILINE_FAILURE)
    env = _with(site, tmp_path)
    text = run(site, "providers", "list", "--wide", env=env).stdout
    (row,) = [line for line in text.splitlines() if line.startswith("tp_cli_multiline")]
    assert "RuntimeError: kernels missing (+2 more lines: --json)" in row
    assert "looked in /opt/acme" not in text
    records = {r["name"]: r for r in json.loads(run(site, "providers", "--json", env=env).stdout)["providers"]}
    assert records["tp_cli_multiline"]["reason"].endswith("kernels missing\n  looked in /opt/acme\n  and in /usr/lib")


def test_providers_alone_means_providers_list(site):
    alone, listed = run(site, "providers", "--wide"), run(site, "providers", "list", "--wide")
    assert alone.returncode == listed.returncode == 0, alone.stderr
    assert alone.stdout == listed.stdout and "entry point" in alone.stdout
    assert json.loads(run(site, "providers", "--json").stdout)["providers"]
    bad = run(site, "providers", "lst")
    assert bad.returncode == 2
    assert "vllm-ir providers: error: argument command: invalid choice: 'lst'" in bad.stderr
    assert "providers_" not in bad.stderr  # no internal name


def test_ops_is_a_compact_list_and_ops_name_shows_one_op(site):
    listing = run(site, "ops", "--wide")
    assert listing.returncode == 0, listing.stderr
    names = [o["name"] for o in json.loads(run(site, "ops", "--json").stdout)["ops"]]
    rows = listing.stdout.splitlines()
    assert rows[0].split() == ["op", "supported", "here", "eager", "priority"]
    assert [r.split()[0] for r in rows[2 : 2 + len(names)]] == names  # one line per op
    assert len(rows) == len(names) + 3  # header, rule, ops, the hint
    one = run(site, "ops", "rms_norm")
    assert one.returncode == 0, one.stderr
    assert one.stdout.startswith("rms_norm(Tensor x, Tensor? weight, float epsilon")
    assert "priority (eager): " in one.stdout and "priority (compile): " in one.stdout
    assert "silu_and_mul" not in one.stdout
    assert [o["name"] for o in json.loads(run(site, "ops", "rms_norm", "--json").stdout)["ops"]] == ["rms_norm"]
    unknown = run(site, "ops", "rms_nrom")
    assert unknown.returncode == 2 and "argument names: unknown op 'rms_nrom'" in unknown.stderr
    assert "did you mean 'rms_norm'?" in unknown.stderr


def test_explain_lists_every_installed_provider(site):
    ops = json.loads(run(site, "ops", "--json").stdout)["ops"]
    installed = {i["provider"] for i in next(o for o in ops if o["name"] == "rms_norm")["implementations"]}
    exp = json.loads(run(site, "explain", "rms_norm", "--json").stdout)
    verdicts = {v["provider"]: v for v in exp["verdicts"]}
    assert set(verdicts) == installed and {"native", "aten", "inductor", "tp_cli_good"} <= installed
    for name in ("aten", "inductor", "tp_cli_good"):  # installed, named by no priority layer
        assert verdicts[name]["status"] == "not in priority" and verdicts[name]["layer"] is None
        assert "it would accept this call" in verdicts[name]["reason"]
        assert f"VLLM_IR_OP_PRIORITY=rms_norm={name}" in verdicts[name]["reason"]
    text = run(site, "explain", "rms_norm", "--wide").stdout
    assert any(line.split()[:4] == ["aten", "not", "in", "priority"] for line in text.splitlines())


# ---------------------------------------------------------------------------------------
# For CI: exit codes, JSON documents, pipes

QUIET = {"VLLM_IR_DISABLE_PLUGIN_AUTOLOAD": "1"}  # the core alone: no provider problems


def test_doctor_exit_status_gates_ci(site, tmp_path):
    assert run(site, "doctor").returncode == 1  # tp_cli_broken failed: a problem
    clean = run(tmp_path, "doctor", env=QUIET)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "problems: none" in clean.stdout and "exit status" not in clean.stdout
    absent = {**QUIET, "VLLM_IR_OP_PRIORITY": "rms_norm=vllm_c"}  # a known provider not installed here: a warning
    assert run(tmp_path, "doctor", env=absent).returncode == 0
    strict = run(tmp_path, "doctor", "--strict", env=absent)
    assert strict.returncode == 1 and "exit status 1: --strict, and settings warned about" in strict.stdout
    assert run(tmp_path, "doctor", "--strict", env=QUIET).returncode == 0
    failing = run(site, "doctor", "--json")
    assert failing.returncode == 1 and json.loads(failing.stdout)["problems"]
    epilog = run(tmp_path, "doctor", "--help", env=QUIET).stdout
    assert "exit status (for CI):" in epilog and "0    no problem listed" in epilog and "--strict" in epilog


def test_an_invalid_log_level_is_a_warning_a_problem_and_a_listed_setting(tmp_path):
    result = run(tmp_path, "doctor", "--json", env={**QUIET, "VLLM_IR_LOG_LEVEL": "verbose"})
    assert result.returncode == 1
    assert "VLLM_IR_LOG_LEVEL='verbose' is not a log level; accepted: CRITICAL, ERROR, WARNING" in result.stderr
    report = json.loads(result.stdout)
    assert report["settings"]["VLLM_IR_LOG_LEVEL"] == "verbose"
    (problem,) = [p for p in report["problems"] if p["setting"] == "VLLM_IR_LOG_LEVEL"]
    assert problem["status"] == "bad setting" and problem["fix"] == "set VLLM_IR_LOG_LEVEL=DEBUG or unset it"
    fine = json.loads(run(tmp_path, "doctor", "--json", env={**QUIET, "VLLM_IR_LOG_LEVEL": "error"}).stdout)
    assert fine["settings"]["VLLM_IR_LOG_LEVEL"] == "error" and not fine["problems"]


SET_PRIORITY_ABSENT = """
import json, warnings
import vllm_ir
from vllm_ir.tools.cli import main

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    vllm_ir.set_priority(rms_norm=["tp_cli_acme", "native"])
print(json.dumps([str(w.message) for w in caught if w.category is vllm_ir.ConfigWarning]))
main(["doctor", "--json"])
"""


def test_set_priority_naming_a_provider_unsupported_here_warns_as_the_environment_does(site, tmp_path):
    make_dist(tmp_path, "tp-cli-acme", UNSUPPORTED_HERE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_IR_")}
    env["PYTHONPATH"] = _with(site, tmp_path)["PYTHONPATH"]
    code = run_python(["-c", SET_PRIORITY_ABSENT], env=env)
    warned_line, *doctor = code.stdout.splitlines()
    (warned,) = json.loads(warned_line)
    expected = "provider 'tp_cli_acme' for op 'rms_norm' is unsupported here (no Acme accelerator is visible)"
    assert warned.startswith(f"set_priority: {expected}; calls use the next provider")
    notes = json.loads("\n".join(doctor))["not_for_this_machine"]
    assert any(n["setting"] == "set_priority" and expected in n["reason"] for n in notes)
    from_env = run(
        site, "doctor", "--json", env={**_with(site, tmp_path), "VLLM_IR_OP_PRIORITY": "rms_norm=tp_cli_acme"}
    )
    notes = json.loads(from_env.stdout)["not_for_this_machine"]
    assert any(n["reason"].startswith(f"VLLM_IR_OP_PRIORITY: {expected}") for n in notes)  # the same words


MACHINE_KEYS = {"platform", "device", "isa", "torch", "providers", "vllm_ir", "python", "os", "arch"}


@pytest.mark.parametrize(
    ("verb", "schema"),
    [
        (["providers"], "providers"),
        (["providers", "list"], "providers"),
        (["ops"], "ops"),
        (["ops", "rms_norm"], "ops"),
        (["explain", "rms_norm"], "explain"),
        (["doctor"], "doctor"),
    ],
)
def test_every_json_document_has_a_schema_and_the_machine(site, verb, schema):
    doc = json.loads(run(site, *verb, "--json").stdout)
    assert list(doc)[:2] == ["schema", "machine"]
    assert doc["schema"] == f"vllm-ir.{schema}/1"
    machine = doc["machine"]
    assert set(machine) >= MACHINE_KEYS, set(machine) ^ MACHINE_KEYS
    assert machine["platform"] == "cpu" and machine["isa"] and machine["vllm_ir"]
    assert machine["providers"].get("tp_cli_good") == "1.0.0"  # each loaded provider's version


def test_json_options_are_documented_in_help(tmp_path):
    for verb in ("ops", "explain", "doctor", "providers"):
        assert "schema vllm-ir." in run(tmp_path, verb, "--help", env=QUIET).stdout
    bench = " ".join(run(tmp_path, "bench", "--help", env=QUIET).stdout.split())
    assert "--json FILE write every figure to FILE (schema vllm-ir.bench/1" in bench and "takes a file" in bench


@pytest.mark.parametrize("verb", [["doctor"], ["ops"], ["providers"]])
def test_a_closed_pipe_exits_quietly(tmp_path, verb):
    """``vllm-ir doctor | head -3``: the reader goes away; no traceback, the shell's status for it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_IR_")}
    env.update(QUIET)
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_ir", *verb], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    proc.stdout.close()  # the reader is gone before the first write
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr and "Exception ignored" not in stderr, stderr


# ---------------------------------------------------------------------------------------
# explain --shape is the input's shape, and answers as a real call does

REAL_CALLS = [
    ("silu_and_mul", (16, 4097), lambda x: (x,)),  # an odd gated width: vllm_c declines
    ("silu_and_mul", (16, 4096), lambda x: (x,)),
    ("mul_and_silu", (3, 7), lambda x: (x,)),
    ("gelu_and_mul", (2, 3, 64), lambda x: (x, "none")),
    ("gelu_new", (5, 33), lambda x: (x,)),
    ("rms_norm", (16, 4096), lambda x: (x, torch.ones(x.shape[-1], dtype=x.dtype), 1e-6)),
    ("rms_norm", (4, 7), lambda x: (x, torch.ones(x.shape[-1], dtype=x.dtype), 1e-6)),
    ("fused_add_rms_norm", (8, 64), lambda x: (x, torch.randn_like(x), torch.ones(x.shape[-1], dtype=x.dtype), 1e-6)),
]


@pytest.mark.parametrize("dtype", ["float32", "bf16"])
@pytest.mark.parametrize(
    ("op_name", "shape", "make_args"), REAL_CALLS, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else None
)
def test_explain_shape_is_the_input_shape_and_answers_as_a_real_call(capsys, op_name, shape, make_args, dtype):
    from vllm_ir.tools import cli

    text = "x".join(map(str, shape))
    assert cli.main(["explain", op_name, "--shape", text, "--dtype", dtype, "--device", "cpu", "--json"]) == 0
    exp = json.loads(capsys.readouterr().out)
    assert exp["shape"] == list(shape) and exp["shape_of"] == "x"
    torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    x = torch.randn(shape).to(torch_dtype)
    real = getattr(vllm_ir.ops, op_name).dispatch(*make_args(x)).provider
    assert exp["chosen"] == real, exp["verdicts"]


def test_a_gated_op_with_an_odd_width_is_declined_as_in_a_real_call(capsys):
    from vllm_ir.tools import cli

    assert cli.main(["explain", "silu_and_mul", "--shape", "16x4097", "--json"]) == 0
    verdicts = {v["provider"]: v for v in json.loads(capsys.readouterr().out)["verdicts"]}
    if "vllm_c" in verdicts and verdicts["vllm_c"]["status"] != "not in priority":
        assert verdicts["vllm_c"]["status"] == "declined" and "4097" in verdicts["vllm_c"]["reason"]


@pytest.mark.parametrize(
    ("text", "dtype"),
    [("bf16", "bfloat16"), ("BF16", "bfloat16"), ("fp16", "float16"), ("half", "float16"), ("fp32", "float32"),
     ("float", "float32"), ("torch.bfloat16", "bfloat16"), ("float64", "float64")],
)  # fmt: skip
def test_dtype_aliases_are_accepted_wherever_dtype_is(text, dtype):
    from vllm_ir.tools import arguments, cli

    assert arguments.parse_dtype(text) is getattr(torch, dtype)
    assert arguments.parse_dtypes(f"{text},fp32") == list(dict.fromkeys([getattr(torch, dtype), torch.float32]))
    for verb in (["explain", "rms_norm"], ["bench", "rms_norm"], ["tune"]):
        assert cli.build_parser().parse_args([*verb, "--dtype", text]).dtype in (
            getattr(torch, dtype),
            [getattr(torch, dtype)],
        )


def test_mode_and_shape_have_help(tmp_path):
    text = " ".join(run(tmp_path, "explain", "--help", env=QUIET).stdout.split())
    assert "--mode {eager,compile} the dispatch to explain: eager" in text
    assert "shape of the op's first input (x; rotary_embedding: query)" in text
