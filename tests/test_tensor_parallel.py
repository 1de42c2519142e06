"""Tensor parallelism over torch.distributed: the collective IR ops and the tensor-parallel passes.

One run of two gloo ranks (processes started here, tests/tp_decoder.py, a free port, killed
on failure or after a deadline) compiles the tensor-parallel decoder with every pass setting
and reports, per rank: the error against the single-process model, the collectives of the
compiled graph, the fusions applied and rejected. It ends with rank 1 stalling and then
dying, which rank 0 must report as errors naming itself and the collective, within its
group's timeout. A few single-process checks (a one-rank group) cover the rest.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import vllm_ir
from vllm_ir.passes import AllReduceRmsNormFusion, SequenceParallelism, record_of, tensor_parallel_fusions
from vllm_ir.passes.fusion import FusionPass

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2
TOKENS = 8
DEADLINE_S = 300  # the whole two-rank run; a hang fails the tests instead of blocking them
ops = vllm_ir.ops


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp")
    results = _launch(out)
    if results is None:  # the free port was taken before rank 0 bound it: once more, on another
        results = _launch(tmp_path_factory.mktemp("tp_retry"))
    if results is None:
        pytest.fail("rank 0 could not bind a free port twice")
    return results


def _launch(out: Path) -> list[dict] | None:
    """Run the ranks; their results, or None when rank 0 found its port taken (a race with another process)."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "tests.tp_decoder", "--world", str(WORLD), "--port", str(port), "--out", str(out)]
    cmd += ["--tokens", str(TOKENS), "--inductor", "sequence_parallel", "--die"]
    logs = [open(out / f"log{r}.txt", "w") for r in range(WORLD)]
    procs = [
        subprocess.Popen([*cmd, "--rank", str(r)], cwd=ROOT, env=env, stdout=logs[r], stderr=subprocess.STDOUT)
        for r in range(WORLD)
    ]
    deadline = time.monotonic() + DEADLINE_S
    try:  # until all are done, one failed (its peers would wait for it), or the deadline
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    results = []
    for r in range(WORLD):
        path = out / f"rank{r}.json"
        log = (out / f"log{r}.txt").read_text()[-3000:]
        if r in hung and not failed:
            pytest.fail(f"rank {r} did not finish within {DEADLINE_S} s (killed); its log:\n{log}")
        if r in hung:
            continue  # killed because a peer failed: that peer's error is the one to show
        if not path.exists():
            pytest.fail(f"rank {r} wrote no result (exit code {procs[r].returncode}); its log:\n{log}")
        data = json.loads(path.read_text())
        if "error" in data:
            if "address already in use" in data["error"].lower():
                return None
            pytest.fail(f"rank {r} failed: {data['error']}\n{data['traceback']}")
        results.append(data)
    if len(results) != WORLD:
        pytest.fail(f"ranks {failed} failed without a result; killed their peers")
    return results


def _setting(ranks: list[dict], rank: int, name: str, tokens: int = TOKENS) -> dict:
    return ranks[rank]["settings"][f"{name}@{tokens}"]


SETTINGS = ["off", "sequence_parallel", "all_reduce_fusion", "all_reduce_fusion_forced"]


@pytest.mark.parametrize("rank", range(WORLD))
def test_every_rank_matches_the_single_process_model(ranks: list[dict], rank: int) -> None:
    for name in SETTINGS:
        s = _setting(ranks, rank, name)
        assert s["max_err"] < 1e-4, (name, s)
    assert _setting(ranks, rank, "sequence_parallel")["backend"] == "inductor"
    assert _setting(ranks, rank, "sequence_parallel", TOKENS + 1)["max_err"] < 1e-4


@pytest.mark.parametrize("rank", range(WORLD))
def test_collectives_of_each_pass_setting(ranks: list[dict], rank: int) -> None:
    # Two layers: attention and MLP outputs are all-reduced, each feeding a residual add + RMSNorm.
    assert _setting(ranks, rank, "off")["collectives"] == {"all_reduce": 4}
    sp = _setting(ranks, rank, "sequence_parallel")
    assert sp["collectives"] == {"reduce_scatter_tensor": 4, "all_gather_into_tensor": 4}
    # The residual stays sharded: sliced once (the first layer's input), then each norm reads
    # the previous one's shard; no residual is gathered.
    rows = TOKENS // WORLD
    assert len(sp["fusions"]) == 4 and sp["rejected"] == []
    assert f"rows {rank * rows}:{(rank + 1) * rows} of" in sp["fusions"][0]
    assert all("the previous layer's shard" in f and f"on {rows} of {TOKENS} tokens" in f for f in sp["fusions"][1:])
    forced = _setting(ranks, rank, "all_reduce_fusion_forced")
    assert len(forced["fusions"]) == 4 and all("all_reduce_fused_add_rms_norm" in f for f in forced["fusions"])
    assert forced["collectives"] == {"all_reduce": 4}  # the native fused op: all-reduce, then the norm
    assert len(forced["selected"]["all_reduce_fused_add_rms_norm"]) == 4
    assert "fused_add_rms_norm" not in forced["selected"]


@pytest.mark.parametrize("rank", range(WORLD))
def test_fallbacks_are_recorded_with_the_reason(ranks: list[dict], rank: int) -> None:
    plain = _setting(ranks, rank, "all_reduce_fusion")
    assert plain["fusions"] == [] and plain["collectives"] == {"all_reduce": 4}
    assert len(plain["rejected"]) == 4
    assert all("only the native all_reduce_fused_add_rms_norm would run" in r for r in plain["rejected"])
    odd = _setting(ranks, rank, "sequence_parallel", TOKENS + 1)
    assert odd["fusions"] == [] and odd["collectives"] == {"all_reduce": 4}
    assert len(odd["rejected"]) == 4
    assert all(f"token count {TOKENS + 1} does not divide by the world size {WORLD}" in r for r in odd["rejected"])


def test_a_stalled_or_dead_peer_is_an_error_naming_the_rank_and_the_collective(ranks: list[dict]) -> None:
    failures = ranks[0]["failures"]
    stalled, dead = failures["stalled peer, eager op"], failures["dead peer, compiled step"]
    for f in (stalled, dead):
        assert f["rank"] == 0, f
        assert "rank 0 of 2" in f["message"] and "did not complete" in f["message"], f
        assert f["seconds"] < 20, f  # the group's 3 s timeout, not a hang
    assert "all_reduce of all_reduce_fused_add_rms_norm [8, 64]" in stalled["message"]
    assert stalled["seconds"] >= 2.5  # it waited for the timeout
    assert "all_reduce x4 (compiled graph)" in dead["message"]
    assert ranks[1].get("left") or ranks[1]["settings"]


# -- single process: a one-rank group --------------------------------------------------------


@pytest.fixture(scope="module")
def one_rank():
    import torch.distributed as dist

    if dist.is_initialized():
        yield dist.group.WORLD
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _first_layer(group):
    """The all-reduced output becomes the residual and is normalized (no residual add)."""
    import torch.distributed._functional_collectives as funcol

    def fn(x: torch.Tensor, w: torch.Tensor, wn: torch.Tensor) -> torch.Tensor:
        h = funcol.all_reduce(x @ w, "sum", group)
        y = ops.rms_norm(h, wn, 1e-6)
        z, _ = ops.fused_add_rms_norm(funcol.all_reduce(y @ w, "sum", group), h, wn, 1e-6)
        return z + h

    return fn


def test_plain_norm_after_all_reduce(one_rank) -> None:
    fn = _first_layer(one_rank)
    x, w, wn = torch.randn(6, 16), torch.randn(16, 16) / 4, torch.rand(16) + 0.5
    expected = fn(x, w, wn)
    sp = vllm_ir.compile(
        fn, fusions=tensor_parallel_fusions(sequence_parallel=True), backend="aot_eager", dynamic=False
    )
    torch.testing.assert_close(sp(x, w, wn), expected)
    report = record_of(sp).graphs[-1]
    # Two candidates rewritten; the first's reduced tensor is also the residual and an output
    # (read in full by `z + h`): gathered once more.
    assert len(report.fusions) == 2
    assert report.collectives == {"reduce_scatter_tensor": 2, "all_gather_into_tensor": 3}
    ar = vllm_ir.compile(fn, fusions=tensor_parallel_fusions(all_reduce=True, force=True), backend="aot_eager")
    torch.testing.assert_close(ar(x, w, wn), expected)
    report = record_of(ar).graphs[-1]
    assert set(report.selected_impls) >= {"all_reduce_rms_norm", "all_reduce_fused_add_rms_norm"}
    assert report.collectives == {"all_reduce": 2}


def test_symbolic_token_count_is_rejected(one_rank) -> None:
    fn = _first_layer(one_rank)
    w, wn = torch.randn(16, 16) / 4, torch.rand(16) + 0.5
    sp = vllm_ir.compile(fn, fusions=tensor_parallel_fusions(sequence_parallel=True), backend="aot_eager", dynamic=True)
    x = torch.randn(6, 16)
    torch.testing.assert_close(sp(x, w, wn), fn(x, w, wn))
    report = record_of(sp).graphs[-1]
    assert report.fusions == [] and report.collectives == {"all_reduce": 2}
    assert len(report.fusions_rejected) == 2 and all("is symbolic" in r for r in report.fusions_rejected)


def test_eager_collective_ops_are_their_composition(one_rank) -> None:
    x, r, wn = torch.randn(3, 32), torch.randn(3, 32), torch.rand(32)
    name = one_rank.group_name
    torch.testing.assert_close(
        ops.all_reduce_fused_add_rms_norm(x, r, wn, 1e-6, name), ops.fused_add_rms_norm.fn(x, r, wn, 1e-6)
    )
    normed, reduced = ops.all_reduce_rms_norm(x, wn, 1e-6, name)
    torch.testing.assert_close(normed, ops.rms_norm.fn(x, wn, 1e-6))
    torch.testing.assert_close(reduced, x)


def test_cache_key_follows_the_rank_and_the_options(one_rank, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    base = FusionPass(tensor_parallel_fusions(sequence_parallel=True)).uuid()
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    assert FusionPass(tensor_parallel_fusions(sequence_parallel=True)).uuid() != base
    assert FusionPass([AllReduceRmsNormFusion()]).uuid() != FusionPass([AllReduceRmsNormFusion(force=True)]).uuid()
    assert SequenceParallelism().uuid_parts() == (1, 1)


def test_bad_group_name_is_a_clear_error(one_rank) -> None:
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"op 'all_reduce_rms_norm' \(native\): group_name 'no_such_group'"):
        ops.all_reduce_rms_norm(x, None, 1e-6, "no_such_group")


def test_collective_errors_renames_only_collective_failures(one_rank) -> None:
    from vllm_ir.integrations.distributed import CollectiveError, collective_errors

    with pytest.raises(CollectiveError, match=r"rank 0 of 1 in process group .*: collective all_reduce x2 did not"):
        with collective_errors(one_rank, "all_reduce x2"):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    with pytest.raises(KeyError), collective_errors(one_rank, "all_reduce x2"):
        raise KeyError("not a collective")


def test_reduced_tensor_read_before_the_norm_is_left_alone(one_rank) -> None:
    import torch.distributed._functional_collectives as funcol

    def fn(x: torch.Tensor, wn: torch.Tensor) -> torch.Tensor:
        h = funcol.all_reduce(x, "sum", one_rank)
        early = h * 2
        return ops.rms_norm(h, wn, 1e-6) + early

    x, wn = torch.randn(4, 16), torch.rand(16) + 0.5
    compiled = vllm_ir.compile(
        fn, fusions=tensor_parallel_fusions(sequence_parallel=True, all_reduce=True, force=True), backend="aot_eager"
    )
    torch.testing.assert_close(compiled(x, wn), fn(x, wn))
    report = record_of(compiled).graphs[-1]
    assert report.fusions == [] and report.collectives == {"all_reduce": 1}
    assert len(report.fusions_rejected) == 2 and all("is read before the norm" in r for r in report.fusions_rejected)


def test_dynamo_traces_the_collective_ops(one_rank) -> None:
    name = one_rank.group_name

    def fn(x: torch.Tensor, r: torch.Tensor, wn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, r2 = ops.all_reduce_fused_add_rms_norm(x, r, wn, 1e-6, name)
        z, _ = ops.all_reduce_rms_norm(y, wn, 1e-6, name)
        return z, r2

    compiled = vllm_ir.compile(fn, backend="aot_eager", fullgraph=True)
    x, r, wn = torch.randn(3, 32), torch.randn(3, 32), torch.rand(32)
    for got, want in zip(compiled(x, r, wn), fn(x, r, wn), strict=True):
        torch.testing.assert_close(got, want)
    report = record_of(compiled).graphs[-1]
    assert set(report.selected_impls) == {"all_reduce_fused_add_rms_norm", "all_reduce_rms_norm"}
    assert report.collectives == {"all_reduce": 2}
