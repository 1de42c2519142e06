"""An FP8 Llama-style decoder compiled with the vllm-ir pipeline: QuantFusion on vs off, side by side.

The model (bf16, weights shared by every variant): per layer, RMSNorm (fused add + RMSNorm
after the first) -> FP8 quant -> QKV projection -> causal attention (SDPA, no rotary) -> FP8
quant -> O projection -> fused add + RMSNorm -> FP8 quant -> gate/up projection ->
``silu_and_mul`` -> FP8 quant -> down projection; a final fused add + RMSNorm. Activations
are quantized to float8_e4m3fn before every projection, then dequantized (``q * scale`` in
fp32, rounded to bf16) and multiplied by bf16 weights: the matmuls are bf16 matmuls on
dequantized values (no FP8 GEMM on this CPU), which is what a CPU run of an FP8 checkpoint
with activation quantization computes. ``--quant`` picks the activation quantization:

- ``static``: per-tensor static scales (fixed: 8 / 448, so values up to 8 in magnitude are not clamped);
  the attention output gets per-token dynamic quant (nothing to fuse it with);
- ``group``: per-token groups of 128 (``dynamic_group_quant_fp8``, DeepSeek-V3 style) everywhere.

Variants, each ``torch.compile``-d with the vllm-ir passes (Inductor, static shapes):

- ``unfused``: the ``vllm_c`` priority in compile mode for the norms, ``silu_and_mul`` and the
  quant ops, the fused ops left to ``native``: QuantFusion rejects every pair ("only the
  native ... would run"), each norm and quant runs its own vllm_c kernel;
- ``fused``: the same plus ``vllm_c`` first for the fused ops: QuantFusion rewrites each
  norm / add+norm / silu_and_mul + quant pair (3 per layer) into one fused vllm_c kernel;
- ``native``: the default compile priority (native everywhere): Inductor generates and fuses
  the norm and quant code itself (for reference).

Prints median ms per forward for T in ``--tokens`` and the ratios unfused / fused and
native / fused (> 1: fused is faster), all measured in one run in interleaved rounds (each
variant's best round's median; the ratios are the median over rounds of the two variants
timed back to back, which this VM's memory phases do not skew), plus the largest
difference of the fused output from the unfused one relative to the output's scale.
Use the same ``OMP_NUM_THREADS`` for runs that are compared.

``--profile`` also prints, per T, two bounds on what fusion can gain: the unfused model's
matmul share (torch.profiler, self CPU time of ``aten::mm`` and attention's ``aten::bmm``;
fusion can at most remove the rest, so ``1 / share``), and the tighter one from the pairs
QuantFusion replaces: the unfused ``vllm_c`` kernels of one forward's norm / add+norm /
silu_and_mul + quant pairs, timed alone at the model's shapes (interleaved with the model).
Were each fused kernel free, a forward would save that time and no more.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/fp8_decoder.py [--quant static group] [--tokens 1 16 256]
        [--layers 2] [--hidden 1024] [--intermediate 2816] [--heads 8] [--rounds 15] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vllm_ir
from tests.compile_models import compile_with_passes, passes_always_run
from vllm_ir.ir.declarations.fused_quant import FUSED_QUANT_OPS
from vllm_ir.tools.timing import best_of, interleaved_rounds, machine_summary, median_ratio

ops = vllm_ir.ops
FP8 = torch.float8_e4m3fn
EPS = 1e-6
GROUP = 128
STATIC_SCALE = 8.0 / 448.0
UNFUSED_OPS = (
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "static_quant_fp8",
    "dynamic_quant_fp8",
    "dynamic_group_quant_fp8",
)
FUSED_OPS = tuple(op.name for op in FUSED_QUANT_OPS)
PRIORITIES: dict[str, dict[str, list[str]] | None] = {
    "unfused": {**{op: ["vllm_c"] for op in UNFUSED_OPS}, **{op: ["native"] for op in FUSED_OPS}},
    "fused": {op: ["vllm_c"] for op in UNFUSED_OPS + FUSED_OPS},
    "native": None,
}


class Fp8Decoder(torch.nn.Module):
    """The decoder stack described in the module docstring (bf16, FP8 activations)."""

    def __init__(self, layers: int, hidden: int, intermediate: int, heads: int, quant: str, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def weight(fan_in: int, fan_out: int) -> Tensor:
            return (torch.randn(fan_in, fan_out, generator=g) / math.sqrt(fan_in)).bfloat16()

        def norm_weight() -> Tensor:
            return (1 + 0.1 * torch.randn(hidden, generator=g)).bfloat16()

        self.quant, self.heads = quant, heads
        self.layers = [
            {
                "input_norm": norm_weight(),
                "qkv": weight(hidden, 3 * hidden),
                "o": weight(hidden, hidden),
                "post_norm": norm_weight(),
                "gate_up": weight(hidden, 2 * intermediate),
                "down": weight(intermediate, hidden),
            }
            for _ in range(layers)
        ]
        self.final_norm = norm_weight()
        self.scale = torch.tensor([STATIC_SCALE])

    def _project(self, y: Tensor, w: Tensor, *, fusable: bool = True) -> Tensor:
        """FP8-quantize y (as the mode says), dequantize, multiply by w in bf16."""
        if self.quant == "group":
            q, s = ops.dynamic_group_quant_fp8(y, GROUP, False, False, FP8)
            deq = (q.float().unflatten(-1, (-1, GROUP)) * s.unsqueeze(-1)).flatten(-2)
        elif fusable:
            q = ops.static_quant_fp8(y, self.scale, FP8)
            deq = q.float() * self.scale
        else:
            q, s = ops.dynamic_quant_fp8(y, True, FP8)
            deq = q.float() * s
        return deq.bfloat16() @ w

    def _attention(self, qkv: Tensor) -> Tensor:
        t = qkv.shape[0]
        q, k, v = qkv.view(t, 3, self.heads, -1).permute(1, 2, 0, 3).unbind(0)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(0, 1).reshape(t, -1)

    def forward(self, x: Tensor) -> Tensor:
        h, residual = x, None
        for layer in self.layers:
            if residual is None:
                y, residual = ops.rms_norm(h, layer["input_norm"], EPS), h
            else:
                y, residual = ops.fused_add_rms_norm(h, residual, layer["input_norm"], EPS)
            attn = self._attention(self._project(y, layer["qkv"]))
            o = self._project(attn, layer["o"], fusable=False)
            y, residual = ops.fused_add_rms_norm(o, residual, layer["post_norm"], EPS)
            h = self._project(ops.silu_and_mul(self._project(y, layer["gate_up"])), layer["down"])
        return ops.fused_add_rms_norm(h, residual, self.final_norm, EPS)[0]


def _compiled(model: Fp8Decoder, x: Tensor, variant: str):
    """The model compiled under the variant's priority (which lowering reads at compile time)."""
    priority = PRIORITIES[variant]
    with vllm_ir.priority(**priority) if priority else contextlib.nullcontext():
        compiled, record = compile_with_passes(model.forward)
        out = compiled(x)
    (report,) = record.graphs
    fused = [f for f in report.fusions if f.startswith("quant:")]
    return compiled, out, len(fused), len(report.fusions_rejected)


MATMULS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")


def matmul_share(fn, x: Tensor, calls: int = 5) -> float:
    """The share of ``fn(x)``'s self CPU time spent in matmuls (the profiler's own events)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn(x)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn(x)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return sum(e.self_cpu_time_total for e in events if e.key in MATMULS) / total


def fusable_pairs(model: Fp8Decoder, t: int, hidden: int, intermediate: int) -> Callable[[], None]:
    """One forward's norm / add+norm / silu_and_mul + quant pairs as the unfused model runs them
    (vllm_c kernels, preallocated outputs): what QuantFusion replaces, per layer."""
    c = torch.ops.vllm_ir_c
    g = torch.Generator().manual_seed(t)
    x, r = (torch.randn(t, hidden, generator=g).bfloat16() for _ in range(2))
    gate_up = torch.randn(t, 2 * intermediate, generator=g).bfloat16()
    y, r_out, act = torch.empty_like(x), torch.empty_like(x), torch.empty(t, intermediate, dtype=torch.bfloat16)
    q, q_act = torch.empty(t, hidden, dtype=FP8), torch.empty(t, intermediate, dtype=FP8)
    scales = {n: torch.empty(t, math.ceil(n / GROUP)) for n in (hidden, intermediate)}

    def quant(out: Tensor, src: Tensor) -> None:
        if model.quant == "group":
            c.dynamic_group_quant_fp8(out, scales[src.shape[-1]], src, GROUP, False)
        else:
            c.static_quant_fp8(out, src, model.scale)

    def forward_pairs() -> None:
        for i, layer in enumerate(model.layers):
            if i == 0:
                c.rms_norm(y, x, layer["input_norm"], EPS)
            else:
                c.fused_add_rms_norm_out(y, r_out, x, r, layer["input_norm"], EPS)
            quant(q, y)
            c.fused_add_rms_norm_out(y, r_out, x, r, layer["post_norm"], EPS)
            quant(q, y)
            c.silu_and_mul(act, gate_up)
            quant(q_act, act)

    return forward_pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", nargs="+", default=["static", "group"], choices=["static", "group"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 256])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--profile", action="store_true", help="print the unfused model's matmul share")
    args = parser.parse_args()

    import vllm_ir_provider_vllm_c

    if not vllm_ir_provider_vllm_c.STATUS.loaded:
        raise SystemExit(f"vllm_c is not available: {vllm_ir_provider_vllm_c.STATUS.reason}")
    print(machine_summary())
    print(
        f"torch threads {torch.get_num_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), "
        f"vllm_c CPU variant {vllm_ir_provider_vllm_c.cpu_capability()}"
    )
    print(
        f"{args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, {args.heads} heads, bf16; "
        f"median ms per forward (best of {args.rounds} interleaved rounds)"
    )
    header = f"{'quant':>6} {'T':>4} {'unfused':>8} {'fused':>8} {'native':>8} | {'unf/fus':>7} {'nat/fus':>7}"
    print(header + f" | {'fusions':>7} {'max rel diff':>12}")
    variants = tuple(PRIORITIES)
    with passes_always_run():
        for quant in args.quant:
            model = Fp8Decoder(args.layers, args.hidden, args.intermediate, args.heads, quant)
            for t in args.tokens:
                x = torch.randn(t, args.hidden, generator=torch.Generator().manual_seed(t)).bfloat16()
                compiled, outs, fusions = {}, {}, {}
                for v in variants:
                    compiled[v], outs[v], fusions[v], _ = _compiled(model, x, v)
                assert fusions["unfused"] == 0 and fusions["native"] == 0, fusions
                # Few calls per round, many rounds: a busy spell of another tenant then spoils
                # some rounds of every variant rather than all of one variant's calls.
                repeats = max(3, min(20, 1024 // t))
                fns = {v: (lambda fn=compiled[v], x=x: fn(x)) for v in variants}
                if args.profile:
                    fns["pairs"] = fusable_pairs(model, t, args.hidden, args.intermediate)
                times = interleaved_rounds(fns, rounds=args.rounds, repeats=repeats)
                best = {v: us / 1000 for v, us in best_of(times).items()}
                ref = outs["unfused"].float()
                diff = (outs["fused"].float() - ref).abs().max().item() / ref.abs().max().item()
                print(
                    f"{quant:>6} {t:>4} {best['unfused']:8.3f} {best['fused']:8.3f} {best['native']:8.3f} | "
                    f"{median_ratio(times, 'unfused', 'fused'):7.3f} {median_ratio(times, 'native', 'fused'):7.3f} | "
                    f"{fusions['fused']:>7} {diff:12.2e}"
                )
                if args.profile:
                    share = matmul_share(compiled["unfused"], x)
                    saved = median_ratio(times, "pairs", "unfused")
                    print(
                        f"{'':>11} unfused: matmuls {100 * share:.1f}% of self CPU time, so no fusion of "
                        f"the rest can make it more than {1 / share:.3f}x faster; the fusable pairs' "
                        f"vllm_c kernels take {best['pairs']:.3f} ms ({100 * saved:.1f}% of a forward): "
                        f"free fused kernels would make it {1 / (1 - saved):.3f}x faster"
                    )


if __name__ == "__main__":
    main()
