"""``vllm-ir bench`` end to end in a subprocess: validates before timing, reports, exits nonzero on a wrong kernel."""

from __future__ import annotations

import json

from tests.plugin_dists import make_dist
from tests.test_cli import run
from vllm_ir import ops

OFF_BY_A_LOT = """
import vllm_ir
from torch import Tensor

@vllm_ir.ops.rms_norm.register_impl("tp_wrong")
def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    return vllm_ir.ops.rms_norm.fn(x, weight, epsilon, variance_size) * 1.01
"""


def test_bench_reports_figures_winner_and_dispatch(tmp_path):
    out = tmp_path / "bench.json"
    result = run(
        tmp_path,
        "bench", "rms_norm", "fused_add_rms_norm", "--providers", "native,aten", "--dtype", "float32",
        "--tokens", "1,4", "--hidden", "64", "--quick", "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert list(report)[:3] == ["schema", "machine", "machine_summary"] and report["schema"] == "vllm-ir.bench/1"
    assert {"platform", "device", "isa", "torch", "providers", "vllm_ir", "python"} <= set(report["machine"])
    assert report["machine"]["providers"]["aten"] and report["machine_summary"].startswith(report["machine"]["arch"])
    assert report["copy_bandwidth_gbps"] > 0
    rows = report["results"]
    names = ("rms_norm", "fused_add_rms_norm")
    cases = [(op, v) for op in names for v in ("default", *getattr(ops, op).benchmark_variants)]
    assert {(r["op"], r["variant"], r["provider"], r["tokens"]) for r in rows} == {
        (op, v, p, t) for op, v in cases for p in ("native", "aten") for t in (1, 4)
    }
    assert all(r["status"] == "ok" and r["median_us"] > 0 and r["gbps"] > 0 for r in rows)
    assert "rms_norm [tokens, 64]" in result.stdout and "winner" in result.stdout
    assert f"[1/{len(cases) * 4}] rms_norm float32 [1, 64]" in result.stderr  # progress


def test_wrong_kernel_is_reported_not_timed_and_fails_the_run(tmp_path):
    make_dist(tmp_path, "tp-wrong", OFF_BY_A_LOT)
    result = run(tmp_path, "bench", "rms_norm", "--providers", "native,tp_wrong", "--dtype", "float32",
                 "--tokens", "2", "--hidden", "32", "--quick", "--json", str(tmp_path / "r.json"))  # fmt: skip
    assert result.returncode == 1
    assert "failed correctness" in result.stderr
    rows = {r["provider"]: r for r in json.loads((tmp_path / "r.json").read_text())["results"]}
    assert rows["tp_wrong"]["status"] == "wrong" and rows["tp_wrong"]["median_us"] is None
    assert "x the tolerance" in rows["tp_wrong"]["detail"]
    assert rows["native"]["status"] == "ok"
    assert "tp_wrong: wrong:" in result.stdout


def test_plot_writes_a_png_or_says_why(tmp_path):
    png = tmp_path / "bw.png"
    result = run(tmp_path, "bench", "rms_norm", "--providers", "native", "--dtype", "float32",
                 "--tokens", "1,8", "--hidden", "64", "--quick", "--plot", str(png))  # fmt: skip
    assert result.returncode == 0, result.stderr
    if "matplotlib is not installed" in result.stdout:
        assert not png.exists()
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


ONE_STEP_SCALES = """
import torch
import vllm_ir
from torch import Tensor

@vllm_ir.ops.silu_and_mul_group_fp8_quant.register_impl("tp_step")
def silu_and_mul_group_fp8_quant(
    x: Tensor, group_size: int, column_major: bool, use_ue8m0: bool, fp8_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    q, scales = vllm_ir.ops.silu_and_mul_group_fp8_quant.fn(x, group_size, column_major, use_ue8m0, fp8_dtype)
    return q, scales * (1 + torch.finfo(x.dtype).eps / 2)  # the absmax one bf16 step away: allowed
"""


def test_bench_judges_scales_as_the_kit_does(tmp_path):
    """A dynamic scale is the absmax of values rounded to x's dtype: one step of that dtype is
    within the op's scale tolerance in the kit, and so in bench (it once compared scales at the
    float32 tolerance and called such a kernel WRONG)."""
    make_dist(tmp_path, "tp-step", ONE_STEP_SCALES)
    out = tmp_path / "r.json"
    result = run(tmp_path, "bench", "silu_and_mul_group_fp8_quant", "--providers", "native,tp_step",
                 "--dtype", "bfloat16", "--tokens", "2", "--hidden", "256", "--quick", "--json", str(out))  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = {r["provider"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["tp_step"]["status"] == "ok", rows["tp_step"]
