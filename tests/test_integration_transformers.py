"""`vllm_ir.integrations.transformers` on real transformers models (tiny, random weights, no hub).

Each family's stock model gives the reference logits and greedy tokens once (module-level
cache); the kernelized copy must match them with each provider forced first (eager) and
compiled (``torch.compile(..., options=vllm_ir.inductor_options())``) for two families.

Test-time choices (the budget is 90 s): the eager sweep runs native, aten and vllm_c on all five
families; the `inductor` provider (which compiles a kernel per shape in eager) runs on Llama's
logits only, and only with ``-m slow``; compiled generation runs on Qwen3 (Llama-form norms, q/k norms on
``[..., heads, head_dim]``, SwiGLU, fused residual) and compiled logits on Gemma ((1 + w)
norms, GeGLU), both with vllm_c first. Mistral and Qwen2 share Llama's code (their modules
are recognised by identical bytecode), which the eager sweep checks. Triton is left out: its
kernels run only in the interpreter here, ~ms per launch, too slow for 32-token generation.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import json

import pytest
import torch
from torch import nn

import vllm_ir

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("vllm_ir.integrations.transformers")

for _module in ("vllm_ir_provider_native.aten", "vllm_ir_provider_native.inductor", "vllm_ir_provider_vllm_c"):
    if importlib.util.find_spec(_module.split(".")[0]) is not None:
        importlib.import_module(_module)

OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "gelu_and_mul")
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
}
NEW_TOKENS = 32
#: The ops' float32 tolerances (OPS.md), applied to the logits.
FP32 = {"atol": 1e-5, "rtol": 1.3e-6}


def build(family: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A 2-layer, hidden-64, vocab-128 model with random weights (norm weights perturbed too)."""
    config_name, model_name = FAMILIES[family]
    config = getattr(transformers, config_name)(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # norm weights: ones (Llama) or zeros (Gemma) at init
                param.add_(0.2 * torch.randn(param.shape, generator=g))
    return model.to(dtype)


PROMPT = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(2))


def generate(model: nn.Module) -> torch.Tensor:
    return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)


@functools.cache
def reference(family: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """(stock model, its logits, its greedy tokens), computed once per family."""
    model = build(family)
    with torch.no_grad():
        return model, model(PROMPT).logits, generate(model)


def kernelized(family: str, **options) -> nn.Module:
    model = copy.deepcopy(reference(family)[0])
    hf.kernelize(model, **options)
    return model


def forced(provider: str) -> dict[str, list[str]]:
    """The priority that puts ``provider`` first for every op of ours it implements."""
    implemented = OPS if provider == "native" else vllm_ir.ops_implemented_by(provider)
    return {op: [provider] for op in OPS if op in implemented}


def providers_that_ran() -> dict[str, set[str]]:
    return {
        op: {d.provider for d in getattr(vllm_ir.ops, op).decision_cache.decisions.values() if d.calls} for op in OPS
    }


@pytest.fixture
def no_fallback(monkeypatch):
    """A forced provider that declines must fail the test, not silently run native."""
    monkeypatch.setenv("VLLM_IR_FALLBACK", "error")
    vllm_ir.reload_env()


def _available(provider: str) -> bool:
    return provider == "native" or any(provider in getattr(vllm_ir.ops, op).impls for op in OPS)


SWEEP = [pytest.param(f, p, id=f"{f}-{p}") for f in FAMILIES for p in ("native", "aten", "vllm_c")]
# The inductor provider compiles one kernel per op and shape in eager: 25-40 s cold here, so it
# runs with -m slow (the conformance kit covers its kernels in the default run).
SWEEP.append(pytest.param("llama", "inductor", id="llama-inductor", marks=pytest.mark.slow))


@pytest.mark.parametrize(("family", "provider"), SWEEP)
def test_eager_logits_and_greedy_tokens_match_stock(family, provider, no_fallback):
    if not _available(provider):
        pytest.skip(f"provider {provider} is not installed")
    _, logits, tokens = reference(family)
    model = kernelized(family)
    with torch.no_grad(), vllm_ir.priority(**forced(provider)):
        torch.testing.assert_close(model(PROMPT).logits, logits, **FP32)
        if provider != "inductor":  # it compiles a kernel per shape: the decode shapes would double its cost
            assert torch.equal(generate(model), tokens)
    if provider != "native":
        ran = providers_that_ran()
        for op in forced(provider):
            if ran[op]:  # each family calls either silu_and_mul or gelu_and_mul
                assert ran[op] == {provider}, (op, ran[op])
        assert ran["rms_norm"] and ran["fused_add_rms_norm"]


def test_compiled_greedy_tokens_match_stock_qwen3():
    _, _, tokens = reference("qwen3")
    model = kernelized("qwen3")
    model.compile(dynamic=True, options=vllm_ir.inductor_options())
    with torch.no_grad(), vllm_ir.priority(**forced("vllm_c" if _available("vllm_c") else "native")):
        assert torch.equal(generate(model), tokens)
    torch._dynamo.reset()


def test_compiled_logits_match_stock_gemma():
    _, logits, _ = reference("gemma")
    model = kernelized("gemma")
    model.compile(options=vllm_ir.inductor_options())
    with torch.no_grad(), vllm_ir.priority(**forced("vllm_c" if _available("vllm_c") else "native")):
        torch.testing.assert_close(model(PROMPT).logits, logits, **FP32)
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_bf16_unfused_is_bit_identical_and_fused_is_within_tolerance(family):
    """Norms and the merged MLP change no bit on native; the fused residual normalizes the
    unrounded float32 sum (the op's semantics), a bf16-rounding difference."""
    stock = build(family, torch.bfloat16)
    with torch.no_grad(), vllm_ir.priority(**forced("native")):
        expected = stock(PROMPT).logits
        unfused = copy.deepcopy(stock)
        report = hf.kernelize(unfused, fuse_residual=False)
        assert all("fuse_residual=False" in why for path, why in report.skipped.items() if path.endswith(("0", "1")))
        assert torch.equal(unfused(PROMPT).logits, expected)
        fused = copy.deepcopy(stock)
        hf.kernelize(fused)
        torch.testing.assert_close(fused(PROMPT).logits, expected, atol=0.05, rtol=0.05)


def build_gemma3n(dtype: torch.dtype) -> nn.Module:
    """A 2-layer Gemma 3n text model: layer 0 sparsifies its MLP's gate (0.95), layer 1 does not."""
    config = transformers.Gemma3nTextConfig(
        vocab_size=128,
        vocab_size_per_layer_input=128,
        hidden_size=64,
        hidden_size_per_layer_input=16,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        laurel_rank=8,
        num_kv_shared_layers=0,
        sliding_window=16,
        activation_sparsity_pattern=[0.95, 0.0],
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    return transformers.Gemma3nForCausalLM(config).eval().to(dtype)


@pytest.mark.parametrize("provider", ["native", "vllm_c"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemma3n_sparse_mlp_runs_gelu_and_mul_sparse_with_hf_numbers(provider, dtype, no_fallback):
    """Gemma 3n's _gaussian_topk + GELU is vLLM's gelu_and_mul_sparse (Gemma 3n rounds its
    multiplier to the activations' dtype: passed so rounded): stock logits bit for bit on native
    and in bf16 on vllm_c; fp32 vllm_c within the ops' tolerance."""
    if not _available(provider):
        pytest.skip(f"provider {provider} is not installed")
    stock = build_gemma3n(dtype)
    model = copy.deepcopy(stock)
    report = hf.kernelize(model)
    assert report.rewritten["model.layers.0.mlp"] == "merged gate_up projection + gelu_and_mul_sparse(tanh)"
    assert report.rewritten["model.layers.1.mlp"] == "merged gate_up projection + gelu_and_mul(tanh)"
    with torch.no_grad():
        expected = stock(PROMPT).logits
        with vllm_ir.priority(gelu_and_mul_sparse=[provider], gelu_and_mul=[provider]):
            got = model(PROMPT).logits
    if provider != "native":
        ran = {d.provider for d in vllm_ir.ops.gelu_and_mul_sparse.decision_cache.decisions.values() if d.calls}
        assert ran == {provider}, ran
    if provider == "vllm_c" and dtype == torch.float32:
        torch.testing.assert_close(got, expected, **FP32)
    else:
        assert torch.equal(got, expected)
    assert hf.undo(model)
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, expected)


@pytest.mark.parametrize("provider", ["native", "aten", "vllm_c"])
def test_llama_norm_with_an_fp32_weight_on_bf16_activations_keeps_hf_numbers(provider):
    """LlamaRMSNorm rounds to the input dtype *before* its weight multiply (and promotes: an fp32
    weight gives fp32), where the op multiplies in the weight's dtype and returns x's (vLLM's
    semantics): kernelize keeps Llama's numbers, bit for bit, for both the norm and the fused
    residual form (the latter against the unrounded float32 sum, as the op normalizes it)."""
    if not _available(provider):
        pytest.skip(f"provider {provider} is not installed")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    stock = LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        stock.weight.add_(0.2 * torch.randn(64, generator=torch.Generator().manual_seed(3)))
    model = nn.ModuleDict({"norm": copy.deepcopy(stock)})
    assert hf.kernelize(model).rewritten == {"norm": "rms_norm"}
    norm = model["norm"]
    # Small integers: sums of squares exact in any order, so vllm_c's order gives the same bits.
    x = torch.randint(-8, 9, (5, 64), generator=torch.Generator().manual_seed(4)).bfloat16()
    residual = torch.randint(-8, 9, (5, 64), generator=torch.Generator().manual_seed(5)).bfloat16()
    with torch.no_grad(), vllm_ir.priority(**{op: [provider] for op in ("rms_norm", "fused_add_rms_norm")}):
        expected = stock(x)
        got = norm(x)
        assert got.dtype == expected.dtype == torch.float32
        assert torch.equal(got, expected)
        out, total = getattr(norm, hf._ADD_NORM)(x, residual)
    total32 = x.float() + residual.float()
    assert torch.equal(total, total32.bfloat16())
    normed = total32 * torch.rsqrt(total32.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert out.dtype == torch.float32 and torch.equal(out, stock.weight * normed.bfloat16())


def test_report_names_every_rewrite_and_what_it_left():
    model = kernelized("qwen3")
    report = hf.kernelize(model)  # the second call: the first call's report, nothing changed
    layers = ("model.layers.0", "model.layers.1")
    expected = {"model.norm": "rms_norm"}
    for layer in layers:
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            expected[f"{layer}.{norm}"] = "rms_norm"
        expected[f"{layer}.mlp"] = "merged gate_up projection + silu_and_mul"
        expected[layer] = "residual add + post_attention_layernorm as fused_add_rms_norm"
    assert report.rewritten == expected
    assert list(report.skipped) == ["model.rotary_emb"] and "rotary" in report.skipped["model.rotary_emb"]
    assert report.unrecognised == {}
    assert "13 rewritten" in str(report)
    gemma = hf.kernelize(copy.deepcopy(reference("gemma")[0]))
    assert gemma.rewritten["model.norm"] == "rms_norm (float32, weight 1 + w)"
    assert gemma.rewritten["model.layers.0.mlp"] == "merged gate_up projection + gelu_and_mul(tanh)"
    attention = {f"model.layers.{i}.self_attn": "GemmaAttention" for i in (0, 1)}
    assert gemma.unrecognised == attention


def test_second_call_is_a_no_op_and_undo_restores_the_stock_model():
    stock, logits, _ = reference("llama")
    model = copy.deepcopy(stock)
    first = hf.kernelize(model)
    forwards = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    gate = model.model.layers[0].mlp.gate_proj.weight
    assert hf.kernelize(model) is first
    assert {name: m.__dict__.get("forward") for name, m in model.named_modules()} == forwards
    assert gate.untyped_storage().data_ptr() == model.model.layers[0].mlp.up_proj.weight.untyped_storage().data_ptr()

    clone = copy.deepcopy(model)  # a copy of a kernelized model is kernelized, and undone on its own
    with torch.no_grad():
        torch.testing.assert_close(clone(PROMPT).logits, logits, **FP32)
    assert hf.undo(clone) is True and "forward" not in clone.model.norm.__dict__
    assert "forward" in model.model.norm.__dict__

    assert hf.undo(model) is True and hf.undo(model) is False
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert all(not k.startswith("_vllm_ir") for m in model.modules() for k in m.__dict__)
    mlp = model.model.layers[0].mlp
    assert mlp.gate_proj.weight is gate  # the same Parameter, now with its own storage
    assert gate.untyped_storage().data_ptr() != mlp.up_proj.weight.untyped_storage().data_ptr()
    state, stock_state = model.state_dict(), stock.state_dict()
    assert list(state) == list(stock_state) and all(torch.equal(state[k], stock_state[k]) for k in state)
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, logits)
    assert hf.kernelize(model).rewritten == first.rewritten  # it can be kernelized again


def test_nothing_is_patched_globally():
    stock, logits, _ = reference("llama")
    classes = {type(m): type(m).__dict__.get("forward") for m in stock.modules()}
    other = copy.deepcopy(stock)
    hf.kernelize(copy.deepcopy(stock))
    assert {type(m): type(m).__dict__.get("forward") for m in stock.modules()} == classes
    assert all("forward" not in m.__dict__ for m in other.modules())
    vllm_ir.reset_dispatch_stats()
    with torch.no_grad():
        assert torch.equal(other(PROMPT).logits, logits)
    assert providers_that_ran() == {op: set() for op in OPS}  # the stock instance called no IR op


def test_unrecognised_modules_are_listed_and_left_working():
    model = copy.deepcopy(reference("llama")[0])

    class ScaledNorm(type(model.model.norm)):
        def forward(self, hidden_states):  # not the stock code: must be left alone
            return 2.0 * super().forward(hidden_states)

    layer0, layer1 = model.model.layers
    layer0.mlp.act_fn = nn.ReLU()
    old = layer1.post_attention_layernorm
    layer1.post_attention_layernorm = ScaledNorm(64, eps=old.variance_epsilon)
    layer1.post_attention_layernorm.weight = old.weight
    layer1.mlp.gate_proj.register_forward_hook(lambda *args: None)
    model.model.norm = nn.LayerNorm(64)
    stock = copy.deepcopy(model)

    report = hf.kernelize(model)
    assert report.unrecognised["model.norm"] == "LayerNorm"
    assert report.unrecognised["model.layers.1.post_attention_layernorm"].endswith(".ScaledNorm")
    assert "no gated vllm-ir op" in report.skipped["model.layers.0.mlp"]
    assert "hooks" in report.skipped["model.layers.1.mlp"]
    assert "post_attention_layernorm was not rewritten" in report.skipped["model.layers.1"]
    assert report.rewritten["model.layers.0"].startswith("residual add")
    with torch.no_grad():
        torch.testing.assert_close(model(PROMPT).logits, stock(PROMPT).logits, **FP32)


def test_weights_changed_after_kernelize_are_followed_in_eager():
    """New weights loaded in place reach the merged MLP and Gemma's cached 1 + w; ``.double()``
    replaces the parameters, and the rewrite re-merges."""
    model = kernelized("gemma")
    fresh = build("gemma")
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(1.5)
        model.load_state_dict(fresh.state_dict())
        torch.testing.assert_close(model(PROMPT).logits, fresh(PROMPT).logits, **FP32)
        model.double()
        fresh.double()
        torch.testing.assert_close(model(PROMPT).logits, fresh(PROMPT).logits, atol=1e-10, rtol=1e-10)


def test_gradients_reach_the_parameters():
    stock = copy.deepcopy(reference("gemma")[0])
    model = copy.deepcopy(stock)
    hf.kernelize(model)
    for m in (stock, model):
        m(PROMPT).logits.square().sum().backward()
    for (name, a), b in zip(stock.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_bench_model_times_stock_and_kernelized_steps(tmp_path, capsys):
    from vllm_ir.tools import cli

    out = tmp_path / "model.json"
    argv = ["bench", "--model", "qwen3", "--layers", "1", "--hidden", "64", "--tokens", "4", "--quick", "--rounds", "1"]
    assert cli.main([*argv, "--no-compile", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report)[:2] == ["schema", "machine"] and report["schema"] == "vllm-ir.bench-model/1"
    assert report["machine"]["torch"] == torch.__version__ and report["machine_summary"]
    variants = {f"{v} eager / {s}" for v in ("stock", "vllm-ir") for s in ("prefill", "decode")}
    assert set(report["times"]) == variants == set(report["profile"])
    assert all(t["median_us"] > 0 for t in report["times"].values())
    assert all(0 < p["norm_act_share"] < 1 for p in report["profile"].values())
    assert "share of eager step time in norms" in capsys.readouterr().out
    assert cli.main(["bench", "--model", "gpt9"]) == 2
    assert "unknown model 'gpt9'" in capsys.readouterr().err
