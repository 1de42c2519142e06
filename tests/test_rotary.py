"""rotary_embedding: the (Tensor, Tensor?) return through every path, RoPE properties per
provider, and an attention projection compiled with vllm-ir's pipeline per provider.

The conformance kit (tests/test_conformance_*.py) covers numerics, predicates, the decision
cache and overload semantics; this file has what is specific to the op.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
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


ROPE = ops.rotary_embedding

if importlib.util.find_spec("vllm_ir_provider_vllm_c") is not None:
    import vllm_ir_provider_vllm_c  # noqa: F401  (registers vllm_c's implementations)
if importlib.util.find_spec("vllm_ir_provider_triton") is not None and importlib.util.find_spec("triton"):
    import vllm_ir_provider_triton  # noqa: F401  (TRITON_INTERPRET=1 from conftest: the interpreter runs it)


def _runnable(provider: str) -> bool:
    impl = ROPE.impls.get(provider)
    return impl is not None and impl.is_supported


PROVIDERS = [
    pytest.param(p, marks=pytest.mark.skipif(not _runnable(p), reason=f"{p} cannot run rotary_embedding here"))
    for p in ("native", "vllm_c", "triton")
]


def _run(provider: str, *args, inplace: bool = False):
    with vllm_ir.priority(rotary_embedding=[provider]):
        assert ROPE.dispatch(*args).provider == provider, ROPE.explain(*args)
        return ROPE.maybe_inplace(*args) if inplace else ROPE(*args)


def _clones(args):
    return tuple(a.clone() if isinstance(a, Tensor) else a for a in args)


# ---------------------------------------------------------------------------------------
# the signature: an optional key comes back as None, through every path


def test_schema_returns_an_optional_key():
    assert [str(r.type) for r in ROPE.torch_op.default._schema.returns] == ["Tensor", "Optional[Tensor]"]
    args = list(ROPE.generate_inputs((3, 64), torch.float32, with_key=False))
    q, k = ROPE(*args)
    assert k is None and q.shape == args[1].shape
    q2, k2 = ROPE.torch_op.default(*args)
    assert k2 is None and torch.equal(q, q2)
    q3, k3 = ROPE.maybe_inplace(*_clones(args))
    assert k3 is None and torch.equal(q, q3)


def test_autograd_is_natives_vjp_with_and_without_key():
    positions, query, key, *rest = ROPE.generate_inputs((4, 128), torch.float32)
    for with_key in (True, False):
        q = query.clone().requires_grad_()
        k = key.clone().requires_grad_() if with_key else None
        out_q, out_k = ROPE(positions, q, k, *rest)
        assert (out_k is None) == (not with_key)
        loss = out_q.square().sum() + (out_k.sum() if out_k is not None else 0)
        loss.backward()
        q_ref = query.clone().requires_grad_()
        k_ref = key.clone().requires_grad_() if with_key else None
        ref_q, ref_k = ROPE.fn(positions, q_ref, k_ref, *rest)
        (ref_q.square().sum() + (ref_k.sum() if ref_k is not None else 0)).backward()
        torch.testing.assert_close(q.grad, q_ref.grad)
        if with_key:
            torch.testing.assert_close(k.grad, k_ref.grad)


def test_a_bad_cache_is_a_clear_error():
    positions, query, key, head_size, cache, neox, _rot = ROPE.generate_inputs((2, 64), torch.float32)
    with pytest.raises(ValueError, match=r"rotary_embedding: cos_sin_cache of shape .* rotary_dim=32"):
        ROPE(positions, query, key, head_size, cache, neox, 32)


# ---------------------------------------------------------------------------------------
# properties, per provider


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_zero_angle_is_the_identity(provider, neox, dtype):
    positions, query, key, head_size, cache, _neox, rot = ROPE.generate_inputs((5, 256), dtype)
    zero = torch.zeros_like(positions)
    q, k = _run(provider, zero, query, key, head_size, cache, neox, rot)
    assert torch.equal(q, query) and torch.equal(k, key)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_partial_rotary_passes_the_tail_through(provider, neox):
    args = list(ROPE.generate_inputs((4, 256), torch.bfloat16, partial=True, layout="heads", is_neox_style=neox))
    _positions, query, key, head_size, _cache, _neox, rot = args
    assert rot < head_size
    q, k = _run(provider, *args)
    assert torch.equal(q[..., rot:], query[..., rot:]) and torch.equal(k[..., rot:], key[..., rot:])
    assert not torch.equal(q[..., :rot], query[..., :rot])
    expected_q, expected_k = ROPE.fn(*args)
    atol, rtol = ROPE.tolerance(torch.bfloat16)
    torch.testing.assert_close(q, expected_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(k, expected_k, atol=atol, rtol=rtol)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("inplace", [False, True], ids=["default", "maybe_inplace"])
def test_query_only_equals_the_query_of_the_full_call(provider, inplace):
    args = ROPE.generate_inputs((6, 128), torch.float16, layout="qkv")
    q_full, _k = _run(provider, *_clones(args), inplace=inplace)
    query_only = list(_clones(args))
    query_only[2] = None
    q_only, k_none = _run(provider, *query_only, inplace=inplace)
    assert k_none is None and torch.equal(q_only, q_full)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("which", ["query", "key"])
def test_a_token_count_unlike_positions_raises_before_anything_is_rotated(provider, which):
    """positions has 4 tokens, query (or key) 5: no result (native raises); a kernel says which
    tensor, and leaves the donated tensors as they were (the check precedes every launch)."""
    positions, query, key, head_size, cache, neox, rot = ROPE.generate_inputs((4, 128), torch.float32)
    if which == "query":
        query = torch.randn(5, query.shape[1])
    else:
        key = torch.randn(5, key.shape[1])
    before = (query.clone(), key.clone())
    with pytest.raises((ValueError, RuntimeError)) as raised:
        _run(provider, positions, query, key, head_size, cache, neox, rot, inplace=True)
    if provider != "native":
        assert f"{which} of shape [5, 128] is not [4 tokens" in str(raised.value)
    assert torch.equal(query, before[0]) and torch.equal(key, before[1])


@pytest.mark.parametrize("provider", PROVIDERS)
def test_maybe_inplace_rotates_slices_of_a_wider_tensor_in_place(provider):
    """[T, heads, head_size] views with a padded head stride (vLLM's sliced layout): rotated where they are."""
    args = ROPE.generate_inputs((3, 256), torch.float32, layout="sliced")
    query, key = args[1], args[2]
    assert not query.is_contiguous()
    expected = ROPE.fn(*args)
    base_q = query._base.clone()
    q, k = _run(provider, *args, inplace=True)
    torch.testing.assert_close(q, expected[0])
    torch.testing.assert_close(k, expected[1])
    if provider != "native":  # an in-place kernel wrote the views; their padding is untouched
        assert q.data_ptr() == query.data_ptr() and k.data_ptr() == key.data_ptr()
        torch.testing.assert_close(query, expected[0])
        assert torch.equal(query._base[..., 128:], base_q[..., 128:])


# ---------------------------------------------------------------------------------------
# compiled: an attention projection calling maybe_inplace, per provider


class AttentionProjection(nn.Module):
    """q/k/v projections and RoPE on q and k, as a Llama attention layer starts."""

    def __init__(self, hidden: int = 256, heads: int = 4, kv_heads: int = 2, head_size: int = 64, rot: int = 64):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.head_size, self.rot = head_size, rot
        self.q_proj = nn.Parameter(torch.randn(heads * head_size, hidden, generator=g) / hidden**0.5)
        self.k_proj = nn.Parameter(torch.randn(kv_heads * head_size, hidden, generator=g) / hidden**0.5)
        self.v_proj = nn.Parameter(torch.randn(kv_heads * head_size, hidden, generator=g) / hidden**0.5)
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(64, rot, torch.float32))

    def forward(self, positions: Tensor, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = x @ self.q_proj.t(), x @ self.k_proj.t(), x @ self.v_proj.t()
        q, k = ops.rotary_embedding.maybe_inplace(positions, q, k, self.head_size, self.cos_sin_cache, True, self.rot)
        return q * 0.125, k, v


class DonatingCaller(nn.Module):
    """Donates graph inputs it was handed, then a query-only call on a value it computed."""

    def forward(self, positions: Tensor, q: Tensor, k: Tensor, cache: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q2, k2 = ops.rotary_embedding.maybe_inplace(positions, q, k, 64, cache, False, 32)
        q3, none = ops.rotary_embedding.maybe_inplace(positions, q2 * 2, None, 64, cache, True, 32)
        assert none is None
        return q2, k2, q3


COMPILE_PROVIDERS = [
    pytest.param("native"),
    pytest.param(
        "vllm_c", marks=pytest.mark.skipif(not _runnable("vllm_c"), reason="vllm_c cannot run rotary_embedding here")
    ),
]


@pytest.mark.parametrize("provider", COMPILE_PROVIDERS)
def test_compiled_attention_projection_matches_native(provider):
    torch.manual_seed(0)
    model = AttentionProjection()
    positions = torch.randint(0, 64, (5,))
    x = torch.randn(5, 256)
    x_before, cache_before = x.clone(), model.cos_sin_cache.clone()
    with torch.no_grad():
        ops_fn = ROPE.fn
        q, k, v = x @ model.q_proj.t(), x @ model.k_proj.t(), x @ model.v_proj.t()
        rq, rk = ops_fn(positions, q, k, 64, model.cos_sin_cache, True, 64)
        expected = (rq * 0.125, rk, v)
        with vllm_ir.priority(rotary_embedding=[provider]):
            compiled, record = compile_with_passes(model)
            out = compiled(positions, x)
    for a, b in zip(out, expected, strict=True):
        torch.testing.assert_close(a, b)
    assert torch.equal(x, x_before) and torch.equal(model.cos_sin_cache, cache_before)
    selected = [p for graph in record.graphs for p in graph.selected_impls.get("rotary_embedding", {}).values()]
    assert selected == [provider]


@pytest.mark.parametrize("provider", COMPILE_PROVIDERS)
def test_compiled_donation_of_graph_inputs_and_a_query_only_call(provider):
    g = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 64, (3,), generator=g)
    q, k = torch.randn(3, 2, 64, generator=g), torch.randn(3, 1, 64, generator=g)
    cache = build_cos_sin_cache(64, 32, torch.float32)
    q2, k2 = ROPE.fn(positions, q, k, 64, cache, False, 32)
    q3, _ = ROPE.fn(positions, q2 * 2, None, 64, cache, True, 32)
    cache_before, positions_before = cache.clone(), positions.clone()
    with vllm_ir.priority(rotary_embedding=[provider]):
        compiled, record = compile_with_passes(DonatingCaller())
        out = compiled(positions, q.clone(), k.clone(), cache)
    for a, b in zip(out, (q2, k2, q3), strict=True):
        torch.testing.assert_close(a, b)
    assert torch.equal(cache, cache_before) and torch.equal(positions, positions_before)
    selected = [p for graph in record.graphs for p in graph.selected_impls.get("rotary_embedding", {}).values()]
    assert selected == [provider, provider]


class FusedQkvProjection(nn.Module):
    """One qkv projection split into column slices; q and k rotated in place where they are."""

    def __init__(self, hidden: int = 128, heads: int = 2, kv_heads: int = 1, head_size: int = 64):
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.sizes = [heads * head_size, kv_heads * head_size, kv_heads * head_size]
        self.qkv = nn.Parameter(torch.randn(sum(self.sizes), hidden, generator=g) / hidden**0.5)
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(64, head_size, torch.float32))

    def forward(self, positions: Tensor, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = (x @ self.qkv.t()).split(self.sizes, dim=-1)
        q, k = ops.rotary_embedding.maybe_inplace(positions, q, k, 64, self.cos_sin_cache, True, 64)
        return q, k, v


def test_disjoint_rows_tells_column_slices_apart():
    from vllm_ir.ir.dispatch.donation import disjoint_rows, precise_donation_conflict

    qkv = torch.zeros(4, 12)
    q, k, v = qkv.split([6, 3, 3], dim=-1)
    assert disjoint_rows(q, k) and disjoint_rows(k, q) and disjoint_rows(q, v)
    assert not disjoint_rows(qkv[:, :7], k)  # overlapping columns
    assert not disjoint_rows(qkv[:, :6], qkv.t()[:6])  # other strides: not proven
    assert not disjoint_rows(q, qkv[1:, :3])  # the same columns, other rows
    args = ROPE.generate_inputs((3, 128), torch.float32, layout="qkv")
    assert precise_donation_conflict(ROPE.activation_indices, ROPE.tensor_param_indices, args) is None
    same = list(args)
    same[2] = args[1]
    assert precise_donation_conflict(ROPE.activation_indices, ROPE.tensor_param_indices, same) is not None


@pytest.mark.parametrize("provider", COMPILE_PROVIDERS)
def test_compiled_qkv_slices_are_donated_together(provider):
    """q and k split from one projection share a storage but no element: donation is accepted."""
    model = FusedQkvProjection()
    positions = torch.randint(0, 64, (4,), generator=torch.Generator().manual_seed(3))
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        q, k, v = (x @ model.qkv.t()).split(model.sizes, dim=-1)
        eq, ek = ROPE.fn(positions, q, k, 64, model.cos_sin_cache, True, 64)
        with vllm_ir.priority(rotary_embedding=[provider]):
            compiled, record = compile_with_passes(model)
            out = compiled(positions, x)
    for a, b in zip(out, (eq, ek, v), strict=True):
        torch.testing.assert_close(a, b)
    selected = [p for graph in record.graphs for p in graph.selected_impls.get("rotary_embedding", {}).values()]
    assert selected == [provider]
