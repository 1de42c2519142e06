"""``vllm-ir bench --model NAME``: a transformers model, stock vs `kernelize`d, eager and compiled.

The model is a named real architecture (its transformers class) with random weights at a size
given by ``--layers`` / ``--hidden`` (heads of 64 channels, or 128 from hidden 2048; a quarter
as many KV heads; Llama's 8/3 MLP ratio, rounded to 64; vocabulary 32000). Two steps are timed,
batch 1: prefill (one forward over a ``--tokens``-long prompt, no cache) and decode (one token
on a cache of the prompt, cropped back after every step so each sample does the same work).

Variants take turns in rounds (`vllm_ir.tools.bench.measure_rounds`), so a burst of load hits all
of them alike; figures are medians over rounds with their interquartile range. Compiled
variants use ``torch.compile(..., options=vllm_ir.inductor_options())`` for both models.

The share of step time in norms, activations and residual adds is measured with the torch
profiler in eager: the self time of every op that runs inside a decoder layer (or the final
norm) but outside its attention module, matmuls excluded, over the whole step's self time.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import vllm_ir

#: Architecture name -> (config class, model class) in transformers.
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
}
VOCAB = 32000
#: Profiler ops that are matrix multiplies (their time is not norm/activation time).
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
_LAYER, _ATTENTION = "vllm-ir bench: layer", "vllm-ir bench: attention"


def build(name: str, hidden: int, layers: int, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """A random-weight model of architecture ``name`` (see the module docstring for its shape)."""
    import transformers

    config_name, model_name = MODELS[name]
    head_dim = 128 if hidden >= 2048 else 64
    if hidden % head_dim:
        raise ValueError(f"--hidden {hidden} is not a multiple of the head size {head_dim}")
    heads = hidden // head_dim
    kv_heads = max(h for h in range(1, max(1, heads // 4) + 1) if heads % h == 0)
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=max(64, 64 * round(hidden * 8 / 3 / 64)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
    )
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).eval().to(dtype)


def step_functions(model: nn.Module, prompt: int) -> dict[str, Callable[[], object]]:
    """``{"prefill": ..., "decode": ...}`` for ``model`` (see the module docstring)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, prompt), generator=g)
    next_id = torch.randint(0, VOCAB, (1, 1), generator=g)
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache

    def prefill() -> object:
        with torch.no_grad():
            return model(ids, use_cache=False).logits

    def decode() -> object:
        with torch.no_grad():
            logits = model(next_id, cache=cache, use_cache=True).logits
        cache.crop(-1)  # back to the prompt: every sample decodes the same position
        return logits

    return {"prefill": prefill, "decode": decode}


@contextlib.contextmanager
def _labelled(model: nn.Module) -> Iterator[None]:
    """Profiler ranges around each decoder layer (and the final norm) and each attention module."""
    handles, open_ranges = [], []

    def enter(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            rf = torch.autograd.profiler.record_function(name)
            rf.__enter__()
            open_ranges.append(rf)

        return hook

    def leave(*_: Any) -> None:
        open_ranges.pop().__exit__(None, None, None)

    inner = getattr(model, "model", model)
    targets = [(layer, _LAYER) for layer in getattr(inner, "layers", [])]
    targets += [(layer.self_attn, _ATTENTION) for layer in getattr(inner, "layers", []) if hasattr(layer, "self_attn")]
    if isinstance(getattr(inner, "norm", None), nn.Module):
        targets.append((inner.norm, _LAYER))
    for module, name in targets:
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def profile_step(model: nn.Module, fn: Callable[[], object], steps: int = 3) -> dict[str, Any]:
    """Norm/activation/residual share of ``fn``'s self time, and its top ops, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    # Torch's Kineto prints "USDT: ... profiler_start/profiler_stop" to stderr on every profile,
    # at a level above ERROR: only a level above all of them (6) keeps them off the terminal.
    # Kineto reads it at its first profile in the process; a level the user set is kept.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    fn()
    with _labelled(model), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    events = prof.events()
    total = sum(e.self_cpu_time_total for e in events)
    inside = 0.0

    def walk(event: Any, in_layer: bool) -> None:
        nonlocal inside
        if event.name == _ATTENTION:
            return
        in_layer = in_layer or event.name == _LAYER
        if in_layer and event.name not in MATMULS:
            inside += event.self_cpu_time_total
        for child in event.cpu_children:
            walk(child, in_layer)

    for event in events:
        if event.cpu_parent is None:
            walk(event, False)
    by_op: dict[str, float] = {}
    for e in events:
        if not e.name.startswith("vllm-ir bench"):
            by_op[e.name] = by_op.get(e.name, 0.0) + e.self_cpu_time_total
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:6]
    return {
        "norm_act_share": inside / total if total else float("nan"),
        "top_ops": [(name, t / total) for name, t in top],
    }


def run(
    name: str,
    *,
    hidden: int,
    layers: int,
    prompt: int,
    dtype: torch.dtype,
    compiled: bool,
    repeats: int,
    rounds: int,
) -> dict[str, Any]:
    """Measure every variant's prefill and decode; return the report (see `format_report`)."""
    from vllm_ir.integrations.transformers import kernelize
    from vllm_ir.tools import bench
    from vllm_ir.tools.timing import machine_summary

    stock = build(name, hidden, layers, dtype)
    models = {"stock eager": stock, "vllm-ir eager": copy.deepcopy(stock)}
    kernel_report = kernelize(models["vllm-ir eager"])
    if compiled:
        for label, rewrite in (("stock compiled", False), ("vllm-ir compiled", True)):
            model = copy.deepcopy(stock)
            if rewrite:
                kernelize(model)
            model.compile(options=vllm_ir.inductor_options())
            models[label] = model
    fns = {}
    for label, model in models.items():
        for step, fn in step_functions(model, prompt).items():
            fns[f"{label} / {step}"] = fn
    check = {step: fns[f"stock eager / {step}"]() for step in ("prefill", "decode")}
    # Random-weight logits through every layer: loose bounds that still catch a wrong rewrite.
    tolerance = 1e-3 if dtype == torch.float32 else 5e-2
    for key, fn in fns.items():  # also the compiles, before any timing
        out = fn()
        ref = check[key.rsplit(" / ", 1)[1]]
        if not torch.allclose(out.float(), ref.float(), atol=tolerance, rtol=tolerance):
            raise RuntimeError(f"{key}: logits differ from the stock model's (max diff {(out - ref).abs().max():.3g})")
    spreads = bench.measure_rounds(fns, torch.device("cpu"), repeats=repeats, rounds=rounds)
    shares = {}
    for label in ("stock eager", "vllm-ir eager"):
        for step in ("prefill", "decode"):
            shares[f"{label} / {step}"] = profile_step(models[label], fns[f"{label} / {step}"])
    return {
        "model": name,
        "hidden": hidden,
        "layers": layers,
        "prompt": prompt,
        "dtype": str(dtype).removeprefix("torch."),
        "machine": machine_summary(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "rewritten": len(kernel_report.rewritten),
        "times": {k: {"median_us": s.median, "q1_us": s.q1, "q3_us": s.q3} for k, s in spreads.items()},
        "profile": shares,
    }


def format_report(report: dict[str, Any]) -> str:
    t = report["times"]
    lines = [
        f"vllm-ir bench --model {report['model']}: {report['layers']} layers, hidden {report['hidden']}, "
        f"prompt {report['prompt']} tokens, {report['dtype']}, {report['rewritten']} modules rewritten",
        report["machine"],
        "",
        f"{'step':<8} {'variant':<18} {'median ms':>10} {'IQR ms':>14} {'vs stock':>9}",
    ]
    for step in ("prefill", "decode"):
        for label in ("stock eager", "vllm-ir eager", "stock compiled", "vllm-ir compiled"):
            r = t.get(f"{label} / {step}")
            if r is None:
                continue
            base = t[f"{label.replace('vllm-ir', 'stock')} / {step}"]["median_us"]
            iqr = f"{r['q1_us'] / 1e3:.2f}-{r['q3_us'] / 1e3:.2f}"
            lines.append(
                f"{step:<8} {label:<18} {r['median_us'] / 1e3:>10.2f} {iqr:>14} {r['median_us'] / base:>8.3f}x"
            )
    lines += ["", "share of eager step time in norms, activations and residual adds (torch profiler):"]
    for key, p in report["profile"].items():
        ops = ", ".join(f"{name} {share:.0%}" for name, share in p["top_ops"][:4])
        lines.append(f"  {key:<24} {p['norm_act_share']:6.1%}   top ops: {ops}")
    for step in ("prefill", "decode"):
        lines.append(f"{step}: {verdict(t[f'vllm-ir eager / {step}'], t[f'stock eager / {step}'])}")
    return "\n".join(lines)


def verdict(ours: dict[str, float], stock: dict[str, float]) -> str:
    """The time ratio in plain words, and whether the interquartile ranges say it is more than noise."""
    from vllm_ir.tools.bench import iqrs_overlap

    ratio = ours["median_us"] / stock["median_us"]
    if iqrs_overlap(ours, stock):
        return f"vllm-ir eager takes {ratio:.3f}x stock eager's time: within noise (the interquartile ranges overlap)"
    faster = "faster" if ratio < 1 else "slower"
    return (
        f"vllm-ir eager takes {ratio:.3f}x stock eager's time: {faster}, beyond noise "
        "(the interquartile ranges do not overlap)"
    )


def plot(report: dict[str, Any], path: str) -> str:
    """Step times per variant, bars at the median with the interquartile range; returns what was
    written, or why nothing was (matplotlib is optional)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return f"--plot: matplotlib is not installed (pip install matplotlib); {path} not written"

    from vllm_ir.tools import bench

    labels = ["stock eager", "vllm-ir eager", "stock compiled", "vllm-ir compiled"]
    fig = Figure(figsize=(10, 4.4), layout="constrained")
    what = f"--model {report['model']}, {report['layers']} layers, {report['dtype']}, bars: median and IQR"
    fig.suptitle(bench._title(report, what), fontsize=9)
    axes = fig.subplots(1, 2)
    for ax, step in zip(axes, ("prefill", "decode"), strict=True):
        present = [label for label in labels if f"{label} / {step}" in report["times"]]
        times = [report["times"][f"{label} / {step}"] for label in present]
        values = [t["median_us"] / 1e3 for t in times]
        spread = [
            [v - t["q1_us"] / 1e3 for v, t in zip(values, times, strict=True)],
            [t["q3_us"] / 1e3 - v for v, t in zip(values, times, strict=True)],
        ]
        colors = {"stock eager": "#999", "vllm-ir eager": "#37a", "stock compiled": "#bbb", "vllm-ir compiled": "#59c"}
        ax.bar(range(len(present)), values, yerr=spread, capsize=4, color=[colors[label] for label in present])
        ax.set_xticks(range(len(present)), present, rotation=20)
        ax.set_ylabel("ms per step (median)")
        ax.set_title(f"{report['model']} {step} ({report['prompt']}-token prompt)")
    fig.savefig(path)
    return f"plot written to {path}"


def main(args: Any) -> int:
    from vllm_ir.tools import bench
    from vllm_ir.tools.arguments import UsageError, check_writable

    if args.model not in MODELS:
        raise UsageError(f"argument --model: unknown model {args.model!r}; choose from {', '.join(MODELS)}")
    try:
        import vllm_ir.integrations.transformers
    except ImportError as exc:
        print(f"vllm-ir bench: error: --model needs transformers: {exc}", file=sys.stderr)
        return 1
    if args.ops or args.providers is not None:
        raise UsageError("argument --model: measures whole models; it takes no op names or --providers")
    if getattr(args, "plot_detail", None):
        raise UsageError("argument --plot-detail: per-op panels are for op benchmarks; with --model, use --plot")
    for argument, path in (("--json", args.json_file), ("--plot", args.plot)):
        if path:
            check_writable(argument, path)
    tokens = args.tokens or [128]
    if len(tokens) != 1:
        raise UsageError("argument --tokens: with --model, one prompt length (e.g. --tokens 128)")
    vllm_ir.load_providers()
    repeats, rounds = (3, 3) if args.quick else (5, 5)
    report = run(
        args.model,
        hidden=args.hidden or 1024,
        layers=args.layers,
        prompt=tokens[0],
        dtype=(args.dtype or [torch.float32])[0],
        compiled=not args.no_compile,
        repeats=repeats,
        rounds=args.rounds or rounds,
    )
    print(format_report(report))
    document = bench.json_report(report, "bench-model")
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(document, f, indent=2)
    if args.plot:
        print(plot(document, args.plot))
    return 0
