"""Tensor-parallel decoder over gloo: time per step and bytes moved by collectives, per pass setting.

Starts ``--world`` ranks (processes running tests/tp_decoder.py) on this machine; each
compiles the decoder once per pass setting and times its steps (median and quartiles; the
ranks are lined up by a barrier before each step). Bytes: per rank and step, on paper from the
collectives of the compiled graph and the shapes (ring algorithms: an all-reduce sends
2(w-1)/w of the tensor, a reduce-scatter or an all-gather (w-1)/w), and measured -- what the
rank wrote to its sockets (``wchar`` of /proc/self/io; gloo writes with writev), less what
the barriers alone write. The ratios compare each setting with ``off`` in the same run; the settings take turns
(``--steps`` steps each, ``--rounds`` times) so that load on the machine hits them alike.

It then prints the on-paper figures per layer and token for a 70B-class model (Llama-3-70B
shapes) at 8 ranks, which the two-rank CPU run cannot show.

    OMP_NUM_THREADS=1 CI=1 .venv/bin/python benchmarks/tensor_parallel.py

Figures on this shared 2-core machine are taken under load; both ranks share the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(args: argparse.Namespace) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix="vllm_ir_tp_bench_"))
    cmd = [sys.executable, "-m", "tests.tp_decoder", "--world", str(args.world), "--port", str(_free_port())]
    cmd += ["--out", str(out), "--tokens", str(args.tokens), "--bench", str(args.steps), "--indivisible", "0"]
    cmd += ["--rounds", str(args.rounds)]
    cmd += ["--hidden", str(args.hidden), "--heads", str(args.heads), "--head-dim", str(args.head_dim)]
    cmd += ["--intermediate", str(args.intermediate), "--layers", str(args.layers)]
    if args.backend == "inductor":
        cmd += ["--inductor", "off", "sequence_parallel", "all_reduce_fusion", "all_reduce_fusion_forced"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [
        subprocess.Popen([*cmd, "--rank", str(r)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for r in range(args.world)
    ]
    deadline = time.monotonic() + args.deadline
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for r, p in enumerate(procs):
        path = out / f"rank{r}.json"
        if not path.exists():
            err = p.stderr.read().decode(errors="replace")[-2000:] if p.stderr else ""
            raise SystemExit(f"rank {r} wrote no result (exit {p.returncode}):\n{err}")
        data = json.loads(path.read_text())
        if "error" in data:
            raise SystemExit(f"rank {r} failed: {data['error']}\n{data['traceback']}")
        results.append(data)
    return results


def report(results: list[dict], args: argparse.Namespace) -> None:
    settings = list(results[0]["settings"])
    base = {r["rank"]: r["settings"][settings[0]]["step_us"] for r in results}
    print(
        f"{args.world} ranks (gloo, this machine), tokens {args.tokens}, hidden {args.hidden}, heads {args.heads}x"
        f"{args.head_dim}, intermediate {args.intermediate}, {args.layers} layers, fp32, backend {args.backend}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {args.rounds} rounds x {args.steps} steps"
    )
    header = f"{'setting':<28}{'rank':>5}{'step us':>10}{'q1-q3 us':>16}{'vs off':>8}"
    print(f"{header}{'paper B/step':>14}{'sent B/step':>13}  collectives")
    for name in settings:
        for r in results:
            s = r["settings"][name]
            ratio = s["step_us"] / base[r["rank"]]
            sent = s.get("sent_bytes")
            sent_text = f"{sent:>13,.0f}" if sent is not None else f"{'n/a':>13}"
            kinds = ", ".join(f"{k} x{n}" for k, n in s["collectives"].items())
            spread = f"{s['step_q1_us']:.0f}-{s['step_q3_us']:.0f}"
            row = f"{name:<28}{r['rank']:>5}{s['step_us']:>10.0f}{spread:>16}{ratio:>8.2f}"
            print(f"{row}{s['bytes']:>14,}{sent_text}  {kinds}")


def on_paper(world: int = 8, hidden: int = 8192, intermediate: int = 28672, itemsize: int = 2) -> None:
    """Bytes per decoder layer and token, one rank, for the passes at ``world`` ranks (Llama-3-70B shapes, bf16)."""
    row = hidden * itemsize  # one token's hidden state
    ring_ar = 2 * (world - 1) * row / world
    rs = ag = (world - 1) * row / world
    one_shot = (world - 1) * row  # one-shot all-reduce: every rank sends its row to each peer
    norm_io = 4 * row  # fused_add_rms_norm reads x and residual, writes out and residual
    saved_norm = 2 * norm_io * (world - 1) / world
    lines = [
        f"On paper: {world} ranks, hidden {hidden}, intermediate {intermediate}, bf16; "
        "per decoder layer (2 all-reduces) and token, one rank",
        f"  off:               all-reduce (ring) sends {2 * ring_ar:,.0f} B; "
        f"the 2 add+RMSNorm move {2 * norm_io:,.0f} B of memory",
        f"  sequence parallel: reduce-scatter + all-gather send {2 * (rs + ag):,.0f} B (the same); "
        f"the 2 add+RMSNorm run on 1/{world} of the tokens: {2 * norm_io / world:,.0f} B of memory "
        f"(saves {saved_norm:,.0f} B); the residual between layers is {row // world:,} B, not {row:,} B",
        f"  all-reduce fusion: the norm takes the reduced row inside the all-reduce kernel: saves writing and "
        f"re-reading it ({2 * 2 * row:,.0f} B of memory) and 2 launches; one-shot sends {2 * one_shot:,.0f} B "
        f"(for latency-bound small batches), two-shot {2 * (rs + ag):,.0f} B",
    ]
    print("\n" + "\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="steps per setting and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the settings take turns within each")
    parser.add_argument("--backend", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--deadline", type=float, default=900.0, help="seconds before the ranks are killed")
    args = parser.parse_args()
    report(run_ranks(args), args)
    on_paper()
    return 0


if __name__ == "__main__":
    sys.exit(main())
