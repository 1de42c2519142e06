"""``vllm-ir bench --plot``: the summary heat map first, per-op panels on request, one colour per
provider in every figure, the machine in the title, noise marked, % of copy_ only out of cache.

The reports are hand-built from `vllm_ir.tools.bench.Result` rows (the JSON schema bench writes), so
each test decides which figures are noisy or out of cache; one test runs the real command.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import asdict
from importlib.util import find_spec

import pytest

from tests.python_child import run_python
from tests.test_cli import run
from vllm_ir.tools import bench, model_bench

needs_matplotlib = pytest.mark.skipif(
    find_spec("matplotlib") is None, reason="matplotlib is not installed (pip install -e '.[dev]' installs it)"
)

MACHINE = {
    "platform": "cpu",
    "device": "Test CPU 9000",
    "isa": "AVX512",
    "cpus": 2,
    "torch": "2.99.0+cpu",
    "providers": {"aten": "1.2.3", "vllm_c": "4.5.6"},
    "vllm_ir": "7.8.9",
    "python": "3.11.7",
    "os": "Linux",
    "arch": "x86_64",
}


def row(op, provider, tokens, us, *, spread=0.02, picks="vllm_c", moved=None, noisy=False, variant="default"):
    """One result as bench reports it: quartiles ``spread`` of the median either side."""
    moved = moved if moved is not None else tokens * 4096 * 4 * 2
    r = bench.Result(op, "float32", tokens, 4096, provider, "ok", median_us=us, dispatcher_picks=picks)
    r.q1_us, r.q3_us = us * (1 - spread), us * (1 + spread)
    r.iqr_us, r.spread_pct, r.rounds, r.noisy, r.variant = r.q3_us - r.q1_us, 200 * spread, 5, noisy, variant
    r.bytes_moved, r.gbps = moved, moved / us / 1e3
    r.pct_of_copy = 100 * r.gbps / 20.0
    return asdict(r)


def report(rows, *, llc=32 * 2**20):
    """A bench ``--json`` document around ``rows``."""
    doc = {
        "schema": "vllm-ir.bench/1",
        "machine": MACHINE,
        "machine_summary": "x86_64 Linux, 2 cpus, torch 2.99.0+cpu (cpu), 2 threads, python 3.11.7",
        "date": "2026-12-04T01:30:00Z",
        "device": "cpu",
        "last_level_cache_bytes": llc,
        "threads": 2,
        "copy_bandwidth_gbps": 20.0,
        "copy_bandwidth_q1_gbps": 19.0,
        "copy_bandwidth_q3_gbps": 21.0,
        "copy_bandwidth_spread_pct": 10.0,
        "copy_bandwidth_noisy": False,
        "rounds": 5,
        "repeats_per_round": 8,
        "noise_limit_pct": 10.0,
        "hidden": 4096,
        "not_measured": [],
        "results": rows,
    }
    doc["winners"] = bench.winner_table(doc)
    return doc


def providers_drawn(fig):
    """provider -> the set of colours its artists carry in ``fig`` (lines, and the heat map's name badges)."""
    from matplotlib.colors import to_hex

    colours: dict[str, set[str]] = {}
    for artist in fig.findobj(lambda a: (a.get_gid() or "").startswith("provider:")):
        name = artist.get_gid().removeprefix("provider:")
        colour = artist.get_bbox_patch().get_facecolor() if hasattr(artist, "get_bbox_patch") else artist.get_color()
        colours.setdefault(name, set()).add(to_hex(colour))
    return colours


def hatched_cells(ax):
    return sorted((p.get_x() + 0.5, p.get_y() + 0.5) for p in ax.patches if p.get_gid() == "uncertain")


@needs_matplotlib
def test_a_provider_keeps_one_colour_in_every_figure_whoever_else_is_shown():
    one = report(
        [row("rms_norm", p, t, us) for t in (1, 16) for p, us in (("native", 10.0), ("vllm_c", 4.0), ("tp_zeta", 6.0))]
    )
    other = report(
        [
            row("rms_norm", p, t, us, picks="tp_alpha")
            for t in (1, 16)
            for p, us in (("native", 10.0), ("aten", 8.0), ("tp_alpha", 3.0), ("tp_zeta", 5.0), ("vllm_c", 4.0))
        ]
    )
    drawn = [providers_drawn(fig) for doc in (one, other) for fig in bench.figures(doc, detail=True)]
    assert set(drawn[1]) == {"native", "vllm_c", "tp_zeta"} and set(drawn[3]) == set(drawn[1]) | {"aten", "tp_alpha"}
    for name in ("native", "vllm_c", "tp_zeta", "aten", "tp_alpha"):
        colours = set().union(*(d.get(name, set()) for d in drawn))
        assert colours == {bench.provider_color(name)}, (name, colours)
    assert bench.provider_color("vllm_c") == bench.PROVIDER_COLORS["vllm_c"]
    assert bench.provider_color("tp_zeta") != bench.provider_color("tp_alpha")  # from the name, not the order
    assert len({bench.provider_color(p) for p in drawn[3]}) == len(drawn[3])


@needs_matplotlib
def test_the_summary_heat_map_comes_first_and_per_op_panels_only_on_request(tmp_path):
    doc = report(
        [
            row(op, p, t, us)
            for op in ("rms_norm", "silu_and_mul")
            for t in (1, 16, 256)
            for p, us in (("native", 10.0), ("vllm_c", 4.0))
        ]
    )
    (summary,) = bench.figures(doc)
    (heat_map,) = [ax for ax in summary.axes if ax.images]
    assert not [ax for ax in summary.axes if ax.lines]
    assert [t.get_text() for t in heat_map.get_yticklabels()] == ["rms_norm float32", "silu_and_mul float32"]
    assert [t.get_text() for t in heat_map.get_xticklabels()] == ["1", "16", "256"]
    assert "2.50x" in {t.get_text() for t in heat_map.texts}  # native 10 us / vllm_c 4 us
    first, detail = bench.figures(doc, detail=True)
    assert [ax for ax in first.axes if ax.images] and not [ax for ax in first.axes if ax.lines]
    panels = [ax for ax in detail.axes if ax.get_visible() and ax.lines]
    assert [ax.get_title() for ax in panels] == ["rms_norm float32", "silu_and_mul float32"]
    summary_png, detail_png = tmp_path / "s.png", tmp_path / "d.png"
    assert bench.plot(doc, str(summary_png)) == f"plot written to {summary_png}"
    assert summary_png.read_bytes()[:4] == b"\x89PNG" and not detail_png.exists()
    bench.plot(doc, str(summary_png), str(detail_png))
    assert detail_png.read_bytes()[:4] == b"\x89PNG"


@needs_matplotlib
def test_the_title_names_machine_date_and_versions():
    doc = report([row("rms_norm", p, 4, us) for p, us in (("native", 10.0), ("vllm_c", 4.0))])
    for fig in bench.figures(doc, detail=True):
        title = fig.get_suptitle()
        for fact in (
            "Test CPU 9000",
            "AVX512, 2 cpus, 2 threads",
            "2026-12-04 01:30:00 UTC",
            "vllm-ir 7.8.9",
            "torch 2.99.0+cpu",
            "aten 1.2.3",
            "vllm_c 4.5.6",
            "hidden 4096",
        ):
            assert fact in title, (fact, title)


@needs_matplotlib
def test_a_speed_up_that_noise_could_explain_is_hatched():
    descheduled = row("rms_norm", "vllm_c", 64, 4.0)
    descheduled["descheduled"] = True  # most rounds off the CPU: the time is the scheduler's
    rows = [
        row("rms_norm", "native", 1, 10.0, spread=0.1),
        row("rms_norm", "vllm_c", 1, 9.0, spread=0.1),  # IQRs 9-11 and 8.1-9.9 overlap
        row("rms_norm", "native", 16, 10.0),
        row("rms_norm", "vllm_c", 16, 4.0, noisy=True),  # far apart, but a figure stayed wider than the noise limit
        row("rms_norm", "native", 64, 10.0),
        descheduled,
        row("rms_norm", "native", 256, 10.0),
        row("rms_norm", "vllm_c", 256, 4.0),
    ]
    cells = bench.speed_ups(report(rows))
    assert [cells[("rms_norm", "float32", t)].chosen.uncertain for t in (1, 16, 64, 256)] == [True, True, True, False]
    (summary,) = bench.figures(report(rows))
    (heat_map,) = [ax for ax in summary.axes if ax.images]
    assert hatched_cells(heat_map) == [(0.0, 0.0), (1.0, 0.0), (2.0, 0.0)]  # (column, row): all but 256 tokens
    assert {"1.11x", "2.50x"} <= {t.get_text() for t in heat_map.texts}
    assert "Hatched: noise could explain it (the interquartile ranges overlap" in summary.get_supxlabel()
    (detail,) = bench.figures(report(rows), detail=True)[1:]
    hollow = detail.findobj(lambda a: a.get_gid() == "descheduled")
    assert [list(line.get_xdata()) for line in hollow] == [[64]]  # the per-op panel draws it hollow


@needs_matplotlib
def test_a_faster_provider_than_the_dispatchers_choice_is_named_in_its_cell():
    rows = [row("rms_norm", p, t, us) for t in (1, 16) for p, us in (("native", 10.0), ("vllm_c", 4.0))]
    rows += [row("rms_norm", "aten", 1, 3.9), row("rms_norm", "aten", 16, 2.0)]  # 3.9: within vllm_c's spread
    (summary,) = bench.figures(report(rows))
    (heat_map,) = [ax for ax in summary.axes if ax.images]
    notes = sorted((t.get_position()[0], t.get_text()) for t in heat_map.texts if t.get_gid() == "fastest")
    assert notes == [(0, "fastest: aten 2.56x?"), (1, "fastest: aten 5.00x")]
    assert set(providers_drawn(summary)) == {"vllm_c"}  # the badge names the dispatcher's choice


@needs_matplotlib
def test_share_of_copy_is_written_only_where_the_working_set_exceeds_the_cache():
    rows = [
        row("rms_norm", p, t, us, moved=moved)
        for t, moved in ((1, 2**10), (4096, 2**27))
        for p, us in (("native", 10.0), ("vllm_c", 4.0))
    ]
    (detail,) = bench.figures(report(rows, llc=32 * 2**20), detail=True)[1:]
    shares = [t for ax in detail.axes for t in ax.texts if t.get_text().endswith("%")]
    assert sorted(t.xy[0] for t in shares) == [4096, 4096]  # the 1 KiB working set fits in the 32 MiB cache
    assert "32 MiB last-level cache" in detail.get_supxlabel()
    (unknown,) = bench.figures(report(rows, llc=None), detail=True)[1:]
    assert not [t for ax in unknown.axes for t in ax.texts if t.get_text().endswith("%")]
    assert "Last-level cache size unknown" in unknown.get_supxlabel()


def test_the_last_level_cache_is_read_from_the_machine_or_said_unknown():
    import torch

    size = bench.last_level_cache_bytes(torch.device("cpu"))
    assert size is None or size >= 2**16
    assert bench.last_level_cache_bytes(torch.device("meta")) is None


def test_without_matplotlib_the_plot_says_so_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    png = tmp_path / "p.png"
    doc = report([row("rms_norm", "native", 1, 10.0)])
    message = bench.plot(doc, str(png), str(tmp_path / "d.png"))
    assert message.startswith("--plot: matplotlib is not installed (pip install matplotlib)") and not png.exists()
    assert "matplotlib is not installed" in model_bench.plot({}, str(png)) and not png.exists()


def test_table_columns_never_run_into_each_other():
    """A long winner name once ran into the figure beside it: ``(0.3, 2%)softcap_fast?``."""
    rows = [
        row("rms_norm", p, 1, us, spread=0.3, picks="softcap_fast")
        for p, us in (("native", 10.0), ("softcap_fast", 9.9))
    ]
    doc = report(rows)
    table = bench.format_report({**doc, "machine": doc["machine_summary"]}).splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("dtype"))
    columns = [re.split(r" {2,}", line.strip()) for line in table[header : header + 2]]
    assert columns[0] == ["dtype", "tokens", "native", "softcap_fast", "winner", "dispatch"]
    assert len(columns[1]) == 6 and columns[1][-2:] == ["softcap_fast?", "softcap_fast"], columns[1]


def test_the_table_gives_a_share_of_copy_only_beyond_the_last_level_cache():
    """As in the plot: an in-cache call against a DRAM ``copy_`` once read 1830%."""
    rows = [row("rms_norm", "native", t, 10.0 * t) for t in (1, 4096)]
    doc = report(rows, llc=4 * 4096 * 4096)  # between the two calls' bytes
    moved = {r["tokens"]: r["bytes_moved"] for r in doc["results"]}
    assert moved[1] < doc["last_level_cache_bytes"] < moved[4096]
    text = bench.format_report({**doc, "machine": doc["machine_summary"]})
    lines = {line.split()[1]: line for line in text.splitlines() if line.startswith("float32")}
    assert re.search(r"\([\d.]+\)", lines["1"]) and "%)" not in lines["1"]
    assert re.search(r"\([\d.]+, \d+%\)", lines["4096"])
    assert "% of copy_ where the call moves more than the 64 MiB last-level cache" in text
    unknown = bench.format_report({**report(rows, llc=None), "machine": doc["machine_summary"]})
    assert "%)" not in unknown and "last-level cache size unknown" in unknown


def test_bench_model_says_whether_the_difference_is_within_noise():
    stock = {"median_us": 100.0, "q1_us": 95.0, "q3_us": 105.0}
    within = model_bench.verdict({"median_us": 104.0, "q1_us": 99.0, "q3_us": 110.0}, stock)
    assert "1.040x" in within and "within noise (the interquartile ranges overlap)" in within
    slower = model_bench.verdict({"median_us": 120.0, "q1_us": 110.0, "q3_us": 125.0}, stock)
    assert "slower, beyond noise (the interquartile ranges do not overlap)" in slower
    assert "faster, beyond noise" in model_bench.verdict({"median_us": 50.0, "q1_us": 49.0, "q3_us": 51.0}, stock)
    assert "OVER" not in within + slower and "bound" not in within + slower


PROFILE = """
import torch
from vllm_ir.tools import model_bench

layer, x = torch.nn.Linear(8, 8), torch.randn(2, 8)
print(model_bench.profile_step(layer, lambda: layer(x))["norm_act_share"])
"""


@pytest.mark.subprocess
def test_bench_model_profiling_keeps_kinetos_usdt_lines_off_stderr():
    """Torch's Kineto printed ``USDT: ... profiler_start`` / ``profiler_stop`` on every profile."""
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    result = run_python(["-c", PROFILE], env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "USDT" not in result.stderr and "profiler_start" not in result.stderr, result.stderr


@needs_matplotlib
@pytest.mark.subprocess
def test_bench_plot_and_plot_detail_from_the_command_line(tmp_path):
    summary, detail, out = tmp_path / "s.png", tmp_path / "d.png", tmp_path / "r.json"
    result = run(
        tmp_path,
        "bench",
        "rms_norm",
        "--providers",
        "native,aten",
        "--dtype",
        "float32",
        "--tokens",
        "1,8",
        "--hidden",
        "64",
        "--quick",
        "--rounds",
        "1",
        "--json",
        str(out),
        "--plot",
        str(summary),
        "--plot-detail",
        str(detail),
    )
    assert result.returncode == 0, result.stderr
    assert f"plot written to {summary} and {detail}" in result.stdout
    assert summary.read_bytes()[:4] == b"\x89PNG" and detail.read_bytes()[:4] == b"\x89PNG"
    doc = json.loads(out.read_text())
    assert doc["date"].endswith("Z") and "last_level_cache_bytes" in doc
    assert all(r["bytes_moved"] > 0 for r in doc["results"] if r["status"] == "ok")
    refused = run(tmp_path, "bench", "--model", "qwen3", "--plot-detail", str(detail))
    assert refused.returncode == 2 and "per-op panels are for op benchmarks" in refused.stderr
