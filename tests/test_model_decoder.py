"""A model-shaped check of the op catalogue: a Llama-style decoder (RMSNorm, a fused qkv
projection with RoPE applied in place on its q/k column slices, causal attention, fused
add + RMSNorm, a SwiGLU MLP) run eager and compiled with each provider first for every op it
implements, against the same model on native.

The conformance kit checks each op alone; this checks that they compose: donated slices of
one projection, the residual stream through in-place norms, and lowering of every node.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import vllm_ir
from tests.compile_models import compile_with_passes, passes_always_run
from vllm_ir.ir.declarations.rotary import build_cos_sin_cache

ops = vllm_ir.ops


@pytest.fixture(autouse=True)
def _passes_run_at_every_compile():
    """The records asserted below exist only where the passes ran: no Inductor graph-cache hits."""
    with passes_always_run():
        yield


#: The ops the decoder calls.
MODEL_OPS = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul")

for _module in ("vllm_ir_provider_native.aten", "vllm_ir_provider_native.inductor", "vllm_ir_provider_vllm_c"):
    if importlib.util.find_spec(_module.split(".")[0]) is not None:
        importlib.import_module(_module)
if importlib.util.find_spec("vllm_ir_provider_triton") is not None and importlib.util.find_spec("triton"):
    import vllm_ir_provider_triton  # noqa: F401  (TRITON_INTERPRET=1 from conftest)


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_size: int, rot: int, intermediate: int, g):
        super().__init__()
        self.heads, self.kv_heads, self.head_size, self.rot = heads, kv_heads, head_size, rot

        def w(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=g) / shape[-1] ** 0.5)

        self.input_norm = nn.Parameter(1.0 + 0.1 * torch.randn(hidden, generator=g))
        self.post_norm = nn.Parameter(1.0 + 0.1 * torch.randn(hidden, generator=g))
        self.qkv = w((heads + 2 * kv_heads) * head_size, hidden)
        self.o_proj = w(hidden, heads * head_size)
        self.gate_up = w(2 * intermediate, hidden)
        self.down = w(hidden, intermediate)

    def forward(self, model: Decoder, positions: Tensor, x: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        if residual is None:
            residual, h = x, model.call("rms_norm", x, self.input_norm, 1e-6)
        else:
            h, residual = model.call("fused_add_rms_norm", x, residual, self.input_norm, 1e-6, inplace=True)
        qkv = h @ self.qkv.t()
        q_size, kv_size = self.heads * self.head_size, self.kv_heads * self.head_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = model.call(
            "rotary_embedding", positions, q, k, self.head_size, model.cos_sin_cache, True, self.rot, inplace=True
        )
        t = x.shape[0]
        q = q.reshape(t, self.heads, self.head_size).transpose(0, 1)
        k = (
            k.reshape(t, self.kv_heads, self.head_size)
            .transpose(0, 1)
            .repeat_interleave(self.heads // self.kv_heads, 0)
        )
        v = (
            v.reshape(t, self.kv_heads, self.head_size)
            .transpose(0, 1)
            .repeat_interleave(self.heads // self.kv_heads, 0)
        )
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(t, -1)
        h, residual = model.call(
            "fused_add_rms_norm", attn @ self.o_proj.t(), residual, self.post_norm, 1e-6, inplace=True
        )
        return model.call("silu_and_mul", h @ self.gate_up.t()) @ self.down.t(), residual


class Decoder(nn.Module):
    """Decoder layers and a final add + RMSNorm; ``chosen`` records (op, provider) per eager call.

    The first layer's residual is the input itself, donated to the in-place norm as vLLM's
    models do: the caller hands ``x`` over.
    """

    def __init__(
        self, hidden: int = 128, heads: int = 4, kv_heads: int = 2, head_size: int = 32, rot: int = 16, layers: int = 1
    ):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        shape = (hidden, heads, kv_heads, head_size, rot, 2 * hidden)
        self.layers = nn.ModuleList(Layer(*shape, g) for _ in range(layers))
        self.norm = nn.Parameter(1.0 + 0.1 * torch.randn(hidden, generator=g))
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(64, rot, torch.float32))
        self.chosen: list[tuple[str, str]] | None = None

    def call(self, op_name: str, *args, inplace: bool = False):
        op = getattr(ops, op_name)
        if self.chosen is not None and not torch.compiler.is_compiling():
            self.chosen.append((op_name, op.dispatch(*args).provider))
        return op.maybe_inplace(*args) if inplace else op(*args)

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        residual = None
        for layer in self.layers:
            x, residual = layer(self, positions, x, residual)
        x, _ = self.call("fused_add_rms_norm", x, residual, self.norm, 1e-6, inplace=True)
        return x


def _implemented(provider: str) -> list[str]:
    return [n for n in MODEL_OPS if provider in getattr(ops, n).impls and getattr(ops, n).impls[provider].is_supported]


def _param(provider: str, *, compiled: bool) -> pytest.param:
    reason = None
    if not _implemented(provider):
        reason = f"{provider} implements none of the decoder's ops here"
    elif compiled and provider == "triton":
        reason = "torch.compile over Triton kernels needs a GPU (fake tensors have no data for the interpreter)"
    return pytest.param(provider, marks=pytest.mark.skipif(reason is not None, reason=reason or ""))


PROVIDERS = ("aten", "inductor", "vllm_c", "triton")


def _inputs(t: int = 7) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (t,), generator=g), torch.randn(t, 128, generator=g)


def _native_output(model: Decoder, positions: Tensor, x: Tensor) -> Tensor:
    with vllm_ir.priority(**{n: ["native"] for n in MODEL_OPS}), torch.no_grad():
        return model(positions, x.clone())


@pytest.mark.parametrize("provider", [_param(p, compiled=False) for p in PROVIDERS])
def test_eager_decoder_matches_native(provider):
    model = Decoder().eval()
    positions, x = _inputs()
    expected = _native_output(model, positions, x)
    ran = _implemented(provider)
    model.chosen = []
    with vllm_ir.priority(**{n: [provider] for n in ran}), torch.no_grad():
        out = model(positions, x.clone())
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    providers_used = {op: {p for o, p in model.chosen if o == op} for op in ran}
    assert all(used == {provider} for used in providers_used.values()), providers_used


@pytest.mark.parametrize("provider", [_param(p, compiled=True) for p in ("native", *PROVIDERS)])
def test_compiled_decoder_matches_native(provider):
    model = Decoder().eval()
    positions, x = _inputs()
    expected = _native_output(model, positions, x)
    ran = _implemented(provider) if provider != "native" else list(MODEL_OPS)
    with vllm_ir.priority(**{n: [provider] for n in ran}), torch.no_grad():
        compiled, record = compile_with_passes(model)
        out = compiled(positions, x.clone())
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    lowered: dict[str, set[str]] = {}
    for graph in record.graphs:
        for op_name, by_node in graph.selected_impls.items():
            lowered.setdefault(op_name, set()).update(by_node.values())
    assert {op: lowered.get(op) for op in ran} == {op: {provider} for op in ran}, lowered
