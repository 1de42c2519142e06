"""Dispatch you can trust: aliased donations, tracing with torch.fx, calls that need autograd.

The key facts themselves are covered by tests/test_fast_lookup.py (every fact a predicate may
read, both paths against an uncached decision); raising predicates by tests/test_dispatch.py.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

import vllm_ir
from vllm_ir.ir.dispatch import donation as aliasing
from vllm_ir.ir.dispatch import fast_lookup

op = vllm_ir.ops.fused_add_rms_norm
EPS = 1e-6


#: The in-place kernels of fused_add_rms_norm that run here (triton's would need the interpreter).
INPLACE_PROVIDERS = ("aten", "vllm_c")


def _inplace_providers() -> tuple[str, ...]:
    return INPLACE_PROVIDERS


for _provider in INPLACE_PROVIDERS:  # at import, so the per-test registry snapshot keeps them
    vllm_ir.load_provider(_provider)


@pytest.fixture(autouse=True)
def _usable(request):
    provider = request.node.callspec.params.get("provider") if hasattr(request.node, "callspec") else None
    if provider is not None:
        impl = op.impls.get(provider)
        if impl is None or not impl.supported:
            pytest.skip(f"{provider} is not usable here")
        assert impl.has_inplace_kernel


def _aliased_calls():
    """(name, factory) of maybe_inplace calls whose donated inputs overlap something."""
    h = 16

    def same_tensor():
        x = torch.randn(4, h)
        return x, x, torch.randn(h)

    def overlapping_rows():
        buf = torch.randn(5, h)
        return buf[1:], buf[:4], torch.randn(h)

    def overlapping_columns():
        buf = torch.randn(4, h + 4)
        return buf[:, 4:], buf[:, :h], torch.randn(h)

    def expanded_activation():
        return torch.randn(1, h).expand(4, h), torch.randn(4, h), torch.randn(h)

    def expanded_residual():
        return torch.randn(4, h), torch.randn(1, h).expand(4, h), torch.randn(h)

    def weight_views_activation():
        x = torch.randn(4, h)
        return x, torch.randn(4, h), x[0]

    def weight_views_residual():
        r = torch.randn(4, h)
        return torch.randn(4, h), r, r[2]

    return [
        (f.__name__, f)
        for f in (
            same_tensor,
            overlapping_rows,
            overlapping_columns,
            expanded_activation,
            expanded_residual,
            weight_views_activation,
            weight_views_residual,
        )
    ]


@pytest.mark.parametrize("provider", _inplace_providers())
@pytest.mark.parametrize(("case", "make"), _aliased_calls(), ids=[c for c, _ in _aliased_calls()])
def test_maybe_inplace_with_overlapping_inputs_gives_the_functional_answer(provider, case, make):
    x, r, w = make()
    expected = op.fn(x.clone(), r.clone(), w.clone(), EPS)
    with vllm_ir.priority(fused_add_rms_norm=[provider]), torch.inference_mode():
        assert op.cached_dispatch(x, r, w, EPS).provider == provider
        out, res = op.maybe_inplace(x, r, w, EPS)
    torch.testing.assert_close(out, expected[0], atol=1e-5, rtol=1.3e-6)
    torch.testing.assert_close(res, expected[1], atol=1e-5, rtol=1.3e-6)


@pytest.mark.parametrize("provider", _inplace_providers())
def test_maybe_inplace_without_overlap_still_runs_in_place(provider):
    x, r, w = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)
    rows = torch.randn(4, 32)[:, :16]  # padded rows of their own storage: no overlap
    for xx, rr in ((x, r), (rows, r)):
        with vllm_ir.priority(fused_add_rms_norm=[provider]), torch.inference_mode():
            out, res = op.maybe_inplace(xx, rr, w, EPS)
        assert out.data_ptr() == xx.data_ptr() and res.data_ptr() == rr.data_ptr()


def _overlap_grid():
    base = torch.randn(6, 32)
    t3 = torch.randn(2, 3, 8)
    tensors = {
        "a": base[:4, :16],
        "rows_shift": base[1:5, :16],
        "cols_disjoint_interleaved": base[:4, 16:],
        "cols_shift": base[:4, 8:24],
        "other": torch.randn(4, 16),
        "expanded": torch.randn(1, 16).expand(4, 16),
        "row_of_a": base[0, :16],
        "transposed": torch.randn(16, 4).t(),
        "empty": base[:0, :16],
        "zero_stride_size1": torch.randn(1, 16).expand(1, 16),
        "heads": t3,
        "heads_view": t3.view(2, 24),
        "permuted": t3.permute(1, 0, 2),
        "scalar": torch.tensor(1.0),
        "meta": torch.empty(4, 16, device="meta"),
    }
    for (n1, a), (n2, b) in itertools.product(tensors.items(), repeat=2):
        yield f"{n1}-{n2}", (a, b, None, EPS)


@pytest.mark.skipif(
    not fast_lookup.available(), reason=f"vllm_ir.ir.dispatch._fast_lookup: {fast_lookup.unavailable_reason}"
)
def test_compiled_overlap_check_agrees_with_the_python_reference():
    compiled, donated_mask, tensor_mask = fast_lookup.donation_conflict_checker(op)
    answers = set()
    for name, args in _overlap_grid():
        expected = aliasing.donation_conflict(op.activation_indices, op.tensor_param_indices, args)
        got = compiled(donated_mask, tensor_mask, *args)
        assert got == expected, name
        answers.add(expected)
    assert {None, (0, 0), (0, 1), (1, 1)} <= answers  # the grid reaches every kind of answer


def test_python_overlap_check_answers():
    def conflict(a, b, w=None):
        return aliasing.donation_conflict((0, 1), (0, 1, 2), (a, b, w, EPS))

    base = torch.randn(6, 32)
    assert conflict(base[:4, :16], torch.randn(4, 16)) is None
    assert conflict(base[:4, :16], base[1:5, :16]) == (0, 1)
    assert conflict(torch.randn(1, 16).expand(4, 16), torch.randn(4, 16)) == (0, 0)
    x = torch.randn(4, 16)
    assert conflict(x, torch.randn(4, 16), x[0]) == (0, 2)
    assert conflict(torch.randn(16, 4).t(), torch.randn(4, 16)) is None  # a transpose does not overlap itself


# -- torch.fx.symbolic_trace -----------------------------------------------------------


def _norm_fn(x, w):
    return vllm_ir.ops.rms_norm(x, w, EPS) * 2


@pytest.mark.parametrize("warm", [False, True], ids=["cold-cache", "after-an-eager-call"])
def test_symbolic_trace_records_one_ir_node(warm):
    x, w = torch.randn(3, 16), torch.randn(16)
    if warm:
        with torch.no_grad():
            _norm_fn(x, w)
    gm = torch.fx.symbolic_trace(_norm_fn)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.vllm_ir.rms_norm.default) == 1, gm.graph
    assert len(targets) == 2, gm.graph  # the IR node and the multiply: no traced kernel
    torch.testing.assert_close(gm(x, w), _norm_fn(x, w))


# -- autograd routing --------------------------------------------------------------------


@pytest.mark.compile
def test_calls_that_need_grad_get_a_grad_fn_and_others_do_not():
    x, w = torch.randn(3, 16, requires_grad=True), torch.randn(16)
    for provider in [p for p, i in vllm_ir.ops.rms_norm.impls.items() if i.supported]:
        with vllm_ir.priority(rms_norm=[provider]):
            y = vllm_ir.ops.rms_norm(x, w, EPS)
            assert y.grad_fn is not None, provider
            with torch.no_grad():
                assert vllm_ir.ops.rms_norm(x, w, EPS).grad_fn is None
            with torch.inference_mode():
                assert vllm_ir.ops.rms_norm(x.detach(), w, EPS).grad_fn is None


# -- key facts that relate arguments ----------------------------------------------------


def _same_tokens_only(x, x_residual, weight, epsilon, variance_size=None):
    return x.shape[0] == x_residual.shape[0] or vllm_ir.Unsupported("broadcast residual")


def _fused(x, x_residual, weight, epsilon, variance_size=None):
    return op.fn(x, x_residual, weight, epsilon, variance_size)


def _hidden_64_only(x, weight, epsilon, variance_size=None):
    return x.shape[-1] == 64 or vllm_ir.Unsupported("hidden size is not 64")


def _python_cached_dispatch(ir_op):
    """``ir_op.cached_dispatch`` as generated without the compiled lookup (same cache dicts)."""
    from vllm_ir.ir import torch_library
    from vllm_ir.ir.dispatch import entry_points as dispatch

    overload = torch_library.overload(ir_op.name)
    which = dispatch.build_entry_points(ir_op, ir_op.decision_cache, overload, overload, None).which
    return lambda *args: which(ir_op, *args)


@pytest.mark.parametrize("path", ["compiled", "python"])
def test_a_broadcast_residual_is_not_the_call_its_full_size_twin_was(path):
    op.register_impl("same_tokens", supports_args=_same_tokens_only)(_fused)
    cached = op.cached_dispatch if path == "compiled" else _python_cached_dispatch(op)
    w = torch.randn(8)
    with vllm_ir.priority(fused_add_rms_norm=["same_tokens"]), torch.no_grad():
        for t in (3, 1, 5):
            full, broadcast = (torch.randn(t, 8), torch.randn(t, 8)), (torch.randn(t, 8), torch.randn(1, 8))
            for args in (full, broadcast, full):
                expected = op.dispatch(*args, w, EPS).provider
                assert cached(*args, w, EPS).provider == expected, (t, [a.shape for a in args])


@pytest.mark.parametrize("path", ["compiled", "python"])
def test_a_1d_activation_keeps_its_hidden_size_in_the_key(path):
    rms = vllm_ir.ops.rms_norm
    cached = rms.cached_dispatch if path == "compiled" else _python_cached_dispatch(rms)
    rms.register_impl("hidden64", supports_args=_hidden_64_only)(
        lambda x, weight, epsilon, variance_size=None: rms.fn(x, weight, epsilon, variance_size)
    )
    with vllm_ir.priority(rms_norm=["hidden64"]), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", vllm_ir.FallbackWarning)
        for h in (64, 65, 64):
            x = torch.randn(h)
            assert cached(x, None, EPS).provider == rms.dispatch(x, None, EPS).provider


def test_gradients_under_torch_func_transforms_are_natives():
    rms = vllm_ir.ops.rms_norm
    x, w = torch.randn(3, 16), torch.randn(16)

    def loss(fn, x):
        return fn(x, w, EPS).square().sum()

    expected = torch.func.grad(lambda x: loss(rms.fn, x))(x)
    torch.testing.assert_close(torch.func.grad(lambda x: loss(rms, x))(x), expected)
