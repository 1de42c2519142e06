"""A tensor-parallel Llama-style decoder over torch.distributed, and the per-rank worker that runs it.

Written by hand, no external model code: attention (QKV column-parallel by heads, causal
attention on this rank's heads, output projection row-parallel) and a SwiGLU MLP (gate/up
column-parallel, down row-parallel); each row-parallel projection ends in a functional
all-reduce (``torch.distributed._functional_collectives``), followed by the residual add +
RMSNorm (`vllm_ir.ops.fused_add_rms_norm`) -- the pattern the tensor-parallel passes match.
`reference_forward` is the same model on one process with the full weights.

Used by tests/test_tensor_parallel.py and benchmarks/tensor_parallel.py, which start one
process per rank: ``python -m tests.tp_decoder --rank R --world W --port P --out DIR
[--bench N] [--die]``. Each rank writes ``DIR/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import vllm_ir

ops = vllm_ir.ops
EPS = 1e-6


@dataclass(frozen=True)
class Shapes:
    hidden: int = 64
    heads: int = 4
    head_dim: int = 16
    intermediate: int = 128
    layers: int = 2


def full_weights(shapes: Shapes, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """The unsharded weights, identical on every rank (one seed)."""
    g = torch.Generator().manual_seed(seed)
    h, q, i = shapes.hidden, shapes.heads * shapes.head_dim, shapes.intermediate

    def rand(*shape: int, scale: float) -> Tensor:
        return (scale * torch.randn(shape, generator=g)).to(dtype)

    w: dict[str, Tensor] = {}
    for layer in range(shapes.layers):
        p = f"l{layer}."
        w[p + "in_norm"] = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
        w[p + "qkv"] = rand(3 * q, h, scale=1 / math.sqrt(h))  # rows: q, k, v, each by head
        w[p + "o"] = rand(h, q, scale=1 / math.sqrt(q))
        w[p + "post_norm"] = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
        w[p + "gate_up"] = rand(2 * i, h, scale=1 / math.sqrt(h))  # rows: gate, up
        w[p + "down"] = rand(h, i, scale=1 / math.sqrt(i))
    w["final_norm"] = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    return w


def shard_weights(w: dict[str, Tensor], shapes: Shapes, rank: int, world: int) -> dict[str, Tensor]:
    """This rank's slices: column-parallel (output rows) for qkv and gate_up, row-parallel
    (input columns) for o and down; norms replicated."""
    if shapes.heads % world or shapes.intermediate % world:
        raise ValueError(f"heads {shapes.heads} and intermediate {shapes.intermediate} must divide by world {world}")
    q, i = shapes.heads * shapes.head_dim, shapes.intermediate
    qs, is_ = q // world, i // world
    out: dict[str, Tensor] = {}
    for name, t in w.items():
        kind = name.split(".")[-1]
        if kind == "qkv":
            out[name] = torch.cat([t[j * q + rank * qs : j * q + (rank + 1) * qs] for j in range(3)]).contiguous()
        elif kind == "gate_up":
            out[name] = torch.cat([t[j * i + rank * is_ : j * i + (rank + 1) * is_] for j in range(2)]).contiguous()
        elif kind == "o":
            out[name] = t[:, rank * qs : (rank + 1) * qs].contiguous()
        elif kind == "down":
            out[name] = t[:, rank * is_ : (rank + 1) * is_].contiguous()
        else:
            out[name] = t.clone()
    return out


def _attention(x: Tensor, qkv_w: Tensor, o_w: Tensor, head_dim: int) -> Tensor:
    """Causal self-attention on the heads of ``qkv_w``; returns the output projection (a partial
    sum when ``o_w`` holds only this rank's input columns)."""
    tokens = x.shape[0]
    qkv = x @ qkv_w.t()
    q, k, v = qkv.chunk(3, dim=-1)
    heads = q.shape[-1] // head_dim
    q, k, v = (t.reshape(tokens, heads, head_dim).transpose(0, 1) for t in (q, k, v))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return a.transpose(0, 1).reshape(tokens, heads * head_dim) @ o_w.t()


def _mlp(x: Tensor, gate_up_w: Tensor, down_w: Tensor) -> Tensor:
    return ops.silu_and_mul(x @ gate_up_w.t()) @ down_w.t()


def decoder_forward(h: Tensor, w: dict[str, Tensor], shapes: Shapes, group: Any | None) -> Tensor:
    """The decoder; ``group`` None runs it on one process (no collective), else over ``group``
    with sharded weights (each row-parallel output all-reduced)."""
    import torch.distributed._functional_collectives as funcol

    def reduce(t: Tensor) -> Tensor:
        return t if group is None else funcol.all_reduce(t, "sum", group)

    residual = h
    x = ops.rms_norm(h, w["l0.in_norm"], EPS)
    for layer in range(shapes.layers):
        p = f"l{layer}."
        if layer:
            x, residual = ops.fused_add_rms_norm(h, residual, w[p + "in_norm"], EPS)
        attn = reduce(_attention(x, w[p + "qkv"], w[p + "o"], shapes.head_dim))
        x, residual = ops.fused_add_rms_norm(attn, residual, w[p + "post_norm"], EPS)
        h = reduce(_mlp(x, w[p + "gate_up"], w[p + "down"]))
    out, _ = ops.fused_add_rms_norm(h, residual, w["final_norm"], EPS)
    return out


def reference_forward(h: Tensor, w: dict[str, Tensor], shapes: Shapes) -> Tensor:
    """The single-process model with the full weights, eager."""
    return decoder_forward(h, w, shapes, None)


#: Pass settings: name -> (fusions arguments, backend). ``fusions`` None: the default fusions.
SETTINGS: dict[str, dict[str, Any]] = {
    "off": {},
    "sequence_parallel": {"sequence_parallel": True},
    "all_reduce_fusion": {"all_reduce": True},
    "all_reduce_fusion_forced": {"all_reduce": True, "force": True},
}


def compile_step(shapes: Shapes, w: dict[str, Tensor], group: Any, setting: str, backend: str) -> Any:
    from vllm_ir.passes import tensor_parallel_fusions

    fusions = tensor_parallel_fusions(**SETTINGS[setting])

    def step(h: Tensor) -> Tensor:
        return decoder_forward(h, w, shapes, group)

    # A code object of its own: Dynamo caches compiled frames per code object, and the
    # benchmark keeps one compiled step per setting alive.
    step.__code__ = step.__code__.replace(co_name=f"step_{setting}")
    return vllm_ir.compile(step, fusions=fusions, backend=backend, dynamic=False)


def bytes_moved(counts: dict[str, int], tokens: int, hidden: int, world: int, itemsize: int) -> int:
    """Bytes one rank sends in a step with ``counts`` collectives of [tokens, hidden] (ring algorithms):
    all-reduce 2(w-1)/w of the tensor, reduce-scatter and all-gather (w-1)/w each."""
    full = tokens * hidden * itemsize
    per = {"all_reduce": 2 * (world - 1) * full // world}
    per["reduce_scatter_tensor"] = per["all_gather_into_tensor"] = (world - 1) * full // world
    return sum(per.get(kind, 0) * n for kind, n in counts.items())


def _run(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from vllm_ir.passes import record_of

    rank, world = args.rank, args.world
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    torch.manual_seed(0)
    shapes = Shapes(args.hidden, args.heads, args.head_dim, args.intermediate, args.layers)
    full = full_weights(shapes)
    mine = shard_weights(full, shapes, rank, world)
    group = dist.group.WORLD
    result: dict[str, Any] = {"rank": rank, "settings": {}}
    timed: list[tuple[dict[str, Any], Any, Tensor]] = []
    cases = [(s, args.tokens) for s in args.settings] + [("sequence_parallel", args.tokens + 1)] * args.indivisible
    for setting, tokens in cases:
        h = torch.randn(tokens, shapes.hidden, generator=torch.Generator().manual_seed(tokens))
        expected = reference_forward(h, full, shapes)
        backend = "inductor" if setting in args.inductor else "aot_eager"
        start = time.perf_counter()
        compiled = compile_step(shapes, mine, group, setting, backend)
        with torch.no_grad():
            out = compiled(h)
        compile_s = time.perf_counter() - start
        report = record_of(compiled).graphs[-1]
        entry = {
            "tokens": tokens,
            "backend": backend,
            "max_err": (out - expected).abs().max().item(),
            "collectives": report.collectives,
            "fusions": report.fusions,
            "rejected": report.fusions_rejected,
            "selected": report.selected_impls,
            "compile_s": compile_s,
        }
        result["settings"][f"{setting}@{tokens}"] = entry
        if args.bench:
            entry["bytes"] = bytes_moved(report.collectives, tokens, shapes.hidden, world, h.element_size())
            timed.append((entry, compiled, h))
        else:
            torch._dynamo.reset()
    if timed:
        _bench(timed, args.bench, args.rounds)
    if args.die:
        result["failures"] = _peer_failures(args, shapes, full, mine, result)
    return result


def _sent_bytes() -> int | None:
    """Bytes this process has written through write()/writev() (gloo's sockets use writev),
    from /proc/self/io; None where that file is missing."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _bench(timed: list[tuple[dict[str, Any], Any, Tensor]], steps: int, rounds: int) -> None:
    """Per setting: the median time of one step (ranks lined up by a barrier before each) and
    the bytes this rank sent per step, measured, less what the barriers alone send. Settings
    take turns, ``steps`` steps each, for ``rounds`` rounds: load on the machine hits them alike."""
    import torch.distributed as dist

    times: list[list[float]] = [[] for _ in timed]
    sent: list[list[float]] = [[] for _ in timed]
    with torch.no_grad():
        for _, compiled, h in timed:
            compiled(h)  # warm
        for _ in range(rounds):
            for i, (_, compiled, h) in enumerate(timed):
                before = _sent_bytes()
                for _ in range(steps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    compiled(h)
                    times[i].append(time.perf_counter() - t0)
                after = _sent_bytes()
                for _ in range(steps):
                    dist.barrier()
                barriers = _sent_bytes()
                if before is not None and after is not None and barriers is not None:
                    sent[i].append(((after - before) - (barriers - after)) / steps)
    for i, (entry, _, _) in enumerate(timed):
        ordered = sorted(times[i])
        entry["step_us"] = ordered[len(ordered) // 2] * 1e6
        entry["step_q1_us"] = ordered[len(ordered) // 4] * 1e6
        entry["step_q3_us"] = ordered[(3 * len(ordered)) // 4] * 1e6
        if sent[i]:
            entry["sent_bytes"] = sorted(sent[i])[len(sent[i]) // 2]


def _peer_failures(
    args: argparse.Namespace, shapes: Shapes, full: dict[str, Tensor], mine: dict[str, Tensor], result: dict[str, Any]
) -> dict[str, Any]:
    """Rank 1 first stalls (alive, never calling the collective), then dies; rank 0 calls
    collectives on a group with a 3 s timeout and must fail each time, naming itself and them."""
    import torch.distributed as dist

    from vllm_ir.integrations.distributed import CollectiveError, collective_errors, describe_collectives

    short = dist.new_group(list(range(args.world)), timeout=datetime.timedelta(seconds=3))
    dist.barrier()
    synced = time.monotonic()
    if args.rank != 0:
        time.sleep(7)  # stuck well past rank 0's 3 s timeout (even if rank 0 is slow to get there) ...
        _write(args, {**result, "left": True})
        os._exit(0)  # ... then gone without a word
    x = torch.randn(args.tokens, shapes.hidden)
    res = torch.randn(args.tokens, shapes.hidden)
    failures: dict[str, Any] = {}

    def attempt(name: str, fn: Any) -> None:
        start = time.perf_counter()
        try:
            fn()
        except CollectiveError as exc:
            failures[name] = {"message": str(exc), "rank": exc.rank, "seconds": time.perf_counter() - start}
        except Exception as exc:  # not renamed: the test shows what came instead
            failures[name] = {"message": f"{type(exc).__name__}: {exc}", "rank": None, "seconds": 0.0}
        else:
            failures[name] = {"message": "no error", "rank": None, "seconds": 0.0}

    attempt(
        "stalled peer, eager op",
        lambda: ops.all_reduce_fused_add_rms_norm(x, res, full["final_norm"], EPS, short.group_name),
    )
    time.sleep(max(0.0, synced + 8.0 - time.monotonic()))  # rank 1 has exited by now
    compiled = compile_step(shapes, mine, short, "off", "aot_eager")

    def run_compiled() -> None:
        with torch.no_grad(), collective_errors(short, lambda: describe_collectives(compiled)):
            compiled(x)

    attempt("dead peer, compiled step", run_compiled)
    return failures


def _write(args: argparse.Namespace, result: dict[str, Any]) -> None:
    path = Path(args.out) / f"rank{args.rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS))
    default = Shapes()
    parser.add_argument("--hidden", type=int, default=default.hidden)
    parser.add_argument("--heads", type=int, default=default.heads)
    parser.add_argument("--head-dim", type=int, default=default.head_dim)
    parser.add_argument("--intermediate", type=int, default=default.intermediate)
    parser.add_argument("--layers", type=int, default=default.layers)
    parser.add_argument("--inductor", nargs="*", default=[], help="settings compiled with Inductor (else aot_eager)")
    parser.add_argument("--indivisible", type=int, default=1, help="also compile sequence_parallel at tokens + 1")
    parser.add_argument("--timeout", type=float, default=120.0, help="the process group's timeout (s)")
    parser.add_argument("--bench", type=int, default=0, help="time N steps per setting and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of --bench steps, settings taking turns")
    parser.add_argument("--die", action="store_true", help="end with rank 1 dying before a collective")
    args = parser.parse_args(argv)
    try:
        result = _run(args)
    except BaseException as exc:
        result = {"rank": args.rank, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        _write(args, result)
        return 1
    _write(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
