"""Misusing the CLI gets one line on stderr naming the argument and the accepted values, never a traceback.

Exit code 2 for a usage error (including an argument this machine cannot honour), 1 for a
failure. Child interpreters, as tests/test_cli.py runs them.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.plugin_dists import make_dist
from tests.test_cli import run

QUIET = {"VLLM_IR_DISABLE_PLUGIN_AUTOLOAD": "1"}  # the core alone: fast, no provider warnings
SMALL = ("--dtype", "float32", "--tokens", "2", "--hidden", "32", "--quick")


def _one_error(result, exit_code: int) -> str:
    assert result.returncode == exit_code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if not line.startswith("vllm-ir: warning:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("verb", [("explain", "rms_norm"), ("bench", "rms_norm", *SMALL)])
def test_cuda_device_on_a_cpu_torch(tmp_path, verb):
    line = _one_error(run(tmp_path, *verb, "--device", "cuda", env=QUIET), 2)
    assert f"vllm-ir {verb[0]}: error: argument --device: 'cuda' is not available here" in line
    assert "accepted here: cpu" in line


@pytest.mark.parametrize("verb", [("explain", "rms_norm"), ("bench", "rms_norm", *SMALL)])
def test_unknown_device(tmp_path, verb):
    line = _one_error(run(tmp_path, *verb, "--device", "bogus", env=QUIET), 2)
    assert "argument --device: unknown device 'bogus'; accepted here: cpu" in line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("bench", "rms_norm", "--tokens", "-4", "--hidden", "32"), "argument --tokens: expected comma-separated"),
        (("bench", "rms_norm", "--tokens", "0", "--hidden", "32"), "argument --tokens: expected comma-separated"),
        (("bench", "rms_norm", "--tokens", "2", "--hidden", "-1"), "argument --hidden: expected an integer between 1"),
        (("explain", "rms_norm", "--shape=-1x8"), "argument --shape: invalid shape '-1x8'"),
        (("explain", "rms_norm", "--shape", "99999999999x8"), "argument --shape: invalid shape"),
    ],
)
def test_negative_or_out_of_range_sizes(tmp_path, args, message):
    assert message in _one_error(run(tmp_path, *args, env=QUIET), 2)


@pytest.mark.parametrize(
    ("args", "argument"),
    [
        (("explain", "rms_norm", "--shape", "100000000x100000"), "argument --shape"),
        (
            ("bench", "rms_norm", "--tokens", "100000000", "--hidden", "100000", "--dtype", "float32"),
            "arguments --tokens",
        ),
    ],
)
def test_huge_sizes_are_refused_before_allocating(tmp_path, args, argument):
    line = _one_error(run(tmp_path, *args, env=QUIET), 2)
    assert f"{argument}" in line and "needs about" in line and "free; choose smaller sizes" in line


@pytest.mark.parametrize(
    ("dtype", "message"),
    [
        ("bogus", "argument --dtype: unknown dtype 'bogus'; accepted: float32, bfloat16, float16, float64"),
        ("int32", "argument --dtype: 'int32' is not a floating-point dtype the ops take; accepted: float32"),
        ("float32,bogus", "argument --dtype: unknown dtype 'bogus'"),
    ],
)
def test_bench_bad_dtype(tmp_path, dtype, message):
    assert message in _one_error(run(tmp_path, "bench", "rms_norm", "--dtype", dtype, env=QUIET), 2)


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_unwritable_output_fails_before_measuring(tmp_path, option):
    start = time.monotonic()
    result = run(tmp_path, "bench", *SMALL, option, str(tmp_path / "no" / "such" / "dir" / "out"), env=QUIET)
    line = _one_error(result, 2)
    assert f"argument {option}: cannot write" in line and "does not exist" in line
    assert "[1/" not in result.stderr and result.stdout == ""  # nothing was measured
    assert time.monotonic() - start < 60
    directory = run(tmp_path, "bench", *SMALL, option, str(tmp_path), env=QUIET)
    assert f"argument {option}: {tmp_path} is a directory" in _one_error(directory, 2)


def test_unknown_provider_is_a_usage_error_listing_the_known_ones(tmp_path):
    line = _one_error(run(tmp_path, "bench", "rms_norm", *SMALL, "--providers", "natve", env=QUIET), 2)
    assert "argument --providers: unknown provider 'natve'; known providers of rms_norm: native" in line
    assert "did you mean 'native'?" in line


def test_unknown_op_is_a_usage_error(tmp_path):
    line = _one_error(run(tmp_path, "bench", "rms_nrom", *SMALL, env=QUIET), 2)
    assert "argument ops: unknown op 'rms_nrom'; known ops: " in line and "did you mean 'rms_norm'?" in line


UNSUPPORTED = """
import vllm_ir

@vllm_ir.ops.rms_norm.register_impl("tp_bench_acme", supported=vllm_ir.Unsupported("no Acme accelerator is visible"))
def rms_norm(x, weight, epsilon, variance_size=None):
    return vllm_ir.ops.rms_norm.fn(x, weight, epsilon, variance_size)
"""


def test_a_provider_that_cannot_run_here_measures_nothing_and_fails(tmp_path):
    make_dist(tmp_path, "tp-bench-acme", UNSUPPORTED)
    env = {"VLLM_IR_PROVIDERS": "tp_bench_acme"}
    line = _one_error(run(tmp_path, "bench", "rms_norm", *SMALL, "--providers", "tp_bench_acme", env=env), 1)
    assert line == (
        "vllm-ir bench: error: nothing to measure: tp_bench_acme is unsupported here (no Acme accelerator is visible)"
    )
    both = run(tmp_path, "bench", "rms_norm", *SMALL, "--providers", "native,tp_bench_acme", env=env)
    assert both.returncode == 0, both.stderr
    assert "vllm-ir bench: note: not measured: tp_bench_acme is unsupported here" in both.stderr
    assert "not measured: tp_bench_acme is unsupported here" in both.stdout


def test_argparse_errors_are_one_line_too(tmp_path):
    line = _one_error(run(tmp_path, "explain", "rms_norm", "--mode", "sometimes", env=QUIET), 2)
    assert line.startswith("vllm-ir explain: error: argument --mode: invalid choice: 'sometimes'")
    assert _one_error(run(tmp_path, "frobnicate", env=QUIET), 2).startswith("vllm-ir: error: argument verb:")
