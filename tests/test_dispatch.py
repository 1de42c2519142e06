"""Which implementation runs, why others were skipped, and that cached decisions stay correct."""

from __future__ import annotations

import warnings

import pytest
import torch

import vllm_ir
from tests.ops_for_tests import rms_norm_impl, x_w
from vllm_ir import FallbackError, FallbackWarning, PredicateError, Unsupported

op = vllm_ir.ops.rms_norm


def _bf16_only(x, weight, epsilon, variance_size=None):
    if x.dtype != torch.bfloat16:
        return Unsupported(f"dtype {x.dtype} is not bfloat16")
    return True


def test_first_accepting_provider_in_priority_runs():
    a = rms_norm_impl("prov_a", supports_args=_bf16_only)
    b = rms_norm_impl("prov_b")
    vllm_ir.set_priority(rms_norm=["prov_a", "prov_b"])
    x, w, eps = x_w()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        op(x, w, eps)
    op(x.bfloat16(), w.bfloat16(), eps)
    assert a.calls == ["prov_a"] and b.calls == ["prov_b"]


def test_unsupported_provider_is_dropped_with_its_reason():
    rms_norm_impl("absent_hw", supported=Unsupported("no such accelerator here"))
    vllm_ir.set_priority(rms_norm=["absent_hw"])
    assert [e.provider for e in op.get_priority()] == ["native"]
    verdicts = {v.provider: v for v in op.explain(*x_w()).verdicts}
    assert verdicts["absent_hw"].status == "unsupported"
    assert verdicts["absent_hw"].reason == "no such accelerator here"


def test_explain_reports_each_verdict():
    rms_norm_impl("picky", supports_args=_bf16_only)
    rms_norm_impl("broad")
    rms_norm_impl("late")
    vllm_ir.set_priority(rms_norm=["picky", "broad", "late"])
    exp = op.explain(*x_w())
    got = [(v.provider, v.status, v.reason) for v in exp.verdicts]
    assert got == [
        ("picky", "declined", "dtype torch.float32 is not bfloat16"),
        ("broad", "chosen", None),
        ("late", "unreachable", "after 'broad', which accepts every call"),
        ("native", "unreachable", "after 'broad', which accepts every call"),
    ]
    assert exp.chosen == "broad"
    assert "dtype torch.float32 is not bfloat16" in str(exp)


def _raising(x, weight, epsilon, variance_size=None):
    raise KeyError("hidden size table")


@pytest.mark.parametrize(
    ("predicate", "problem"),
    [
        (lambda x, weight, epsilon, variance_size=None: None, "supports_args returned NoneType None"),
        (_raising, "supports_args raised KeyError: 'hidden size table'"),
    ],
    ids=["returns-none", "raises"],
)
def test_broken_predicate_skips_its_provider_with_the_error_as_reason(predicate, problem):
    sloppy = rms_norm_impl("sloppy", supports_args=predicate)
    vllm_ir.set_priority(rms_norm=["sloppy"])
    x, w, eps = x_w()
    with pytest.warns(vllm_ir.ProviderWarning, match=f"op 'rms_norm', provider 'sloppy': {problem}"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)
            out = op(x, w, eps)
    torch.testing.assert_close(out, op.fn(x, w, eps))
    assert sloppy.calls == []
    verdicts = {v.provider: v for v in op.explain(x, w, eps).verdicts}
    assert verdicts["sloppy"].status == "declined" and problem in verdicts["sloppy"].reason
    assert list(vllm_ir.ir.dispatch.selection.predicate_errors()) == [("rms_norm", "sloppy")]
    assert problem in vllm_ir.ir.dispatch.selection.predicate_errors()["rms_norm", "sloppy"]
    assert any(problem in r for r in vllm_ir.dispatch_stats()["rms_norm"]["sloppy"])
    with warnings.catch_warnings():  # shown once
        warnings.simplefilter("error", vllm_ir.ProviderWarning)
        warnings.simplefilter("ignore", FallbackWarning)
        op(x[:, :7].contiguous(), w[:7], eps)


def test_broken_predicate_raises_under_fallback_error(monkeypatch):
    rms_norm_impl("sloppy", supports_args=_raising)
    vllm_ir.set_priority(rms_norm=["sloppy"])
    monkeypatch.setenv("VLLM_IR_FALLBACK", "error")
    vllm_ir.reload_env()
    with pytest.raises(PredicateError, match="op 'rms_norm', provider 'sloppy': supports_args raised KeyError") as info:
        op(*x_w())
    assert isinstance(info.value.__cause__, KeyError)


def test_decisions_are_cached_per_signature():
    seen = []

    def counting(x, weight, epsilon, variance_size=None):
        seen.append(x.dtype)
        return True

    rms_norm_impl("counted", supports_args=counting)
    vllm_ir.set_priority(rms_norm=["counted"])
    x, w, eps = x_w()
    for tokens in (1, 2, 3, 8):
        op(torch.randn(tokens, 16), w, eps)
    assert seen == [torch.float32]  # batch size is not part of the key
    op(x.double(), w.double(), eps)
    op(x.t(), None, eps)  # non-contiguous, no weight
    op(x[None], w, eps)  # one more dimension
    op(x, w, 1e-5)  # another scalar value
    assert len(seen) == 5


def test_cache_invalidated_by_priority_change_and_late_registration():
    x, w, eps = x_w()
    op(x, w, eps)
    late = rms_norm_impl("late_comer")
    op(x, w, eps)
    assert late.calls == []  # registered, but not in the priority
    vllm_ir.set_priority(rms_norm=["late_comer"])
    op(x, w, eps)
    assert late.calls == ["late_comer"]
    vllm_ir.clear_priority()
    op(x, w, eps)
    assert late.calls == ["late_comer"]


def test_uncacheable_predicate_runs_every_call():
    asked = []

    def by_value(x, weight, epsilon, variance_size=None):
        asked.append(1)
        return bool(x.shape[0] % 2)  # looks at the batch: must opt out of caching

    impl = rms_norm_impl("by_value", supports_args=by_value, cacheable=False)
    vllm_ir.set_priority(rms_norm=["by_value"])
    _, w, eps = x_w()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        for tokens in (1, 2, 3):
            op(torch.randn(tokens, 16), w, eps)
    assert len(asked) == 3
    assert impl.calls == ["by_value", "by_value"]


def test_skips_are_counted_and_warned_once():
    rms_norm_impl("picky", supports_args=_bf16_only)
    vllm_ir.set_priority(rms_norm=["picky"])
    x, w, eps = x_w()
    with pytest.warns(FallbackWarning, match="provider 'picky' declined the call .dtype torch.float32"):
        op(x, w, eps)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        op(x, w, eps)
        op(torch.randn(7, 16), w, eps)
    assert vllm_ir.dispatch_stats() == {"rms_norm": {"picky": {"dtype torch.float32 is not bfloat16": 3}}}
    vllm_ir.set_priority(rms_norm=["picky", "native"])  # invalidation keeps the counts
    assert vllm_ir.dispatch_stats()["rms_norm"]["picky"]["dtype torch.float32 is not bfloat16"] == 3


def test_fallback_policy_error_raises(monkeypatch):
    rms_norm_impl("picky", supports_args=_bf16_only)
    vllm_ir.set_priority(rms_norm=["picky"])
    monkeypatch.setenv("VLLM_IR_FALLBACK", "error")
    vllm_ir.reload_env()
    x, w, eps = x_w()
    for _ in range(2):  # raised on every call, not only the first
        with pytest.raises(FallbackError, match="provider 'picky' declined the call"):
            op(x, w, eps)
    op(x.bfloat16(), w.bfloat16(), eps)


def test_fallback_policy_allow_is_silent(monkeypatch):
    rms_norm_impl("picky", supports_args=_bf16_only)
    vllm_ir.set_priority(rms_norm=["picky"])
    monkeypatch.setenv("VLLM_IR_FALLBACK", "allow")
    vllm_ir.reload_env()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        op(*x_w())


def test_batch_invariant_mode_selects_only_batch_invariant_impls(monkeypatch):
    fast = rms_norm_impl("fast")
    steady = rms_norm_impl("steady", batch_invariant=True)
    vllm_ir.set_priority(rms_norm=["fast", "steady"])
    x, w, eps = x_w()
    op(x, w, eps)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    vllm_ir.reload_env()
    op(x, w, eps)
    assert fast.calls == ["fast"] and steady.calls == ["steady"]
    assert {v.provider: v.status for v in op.explain(x, w, eps).verdicts}["fast"] == "not batch-invariant"


def test_wrong_argument_type_names_op_and_parameter():
    with pytest.raises(TypeError, match="op 'rms_norm': argument 'x' must be a Tensor, got list"):
        op([1.0, 2.0], None, 1e-6)


def test_wrong_shape_reaches_the_kernel_error():
    x, _, eps = x_w()
    with pytest.raises(RuntimeError, match="size of tensor"):
        op(x, torch.ones(3), eps)


def test_keyword_arguments_and_defaults_work():
    x, w, eps = x_w()
    torch.testing.assert_close(op(x, weight=w, epsilon=eps), op.fn(x, w, eps))
    torch.testing.assert_close(op(x, w, eps, variance_size=8), op.fn(x, w, eps, 8))


def test_calls_under_tracing_record_one_ir_node():
    from torch.fx.experimental.proxy_tensor import make_fx

    rms_norm_impl("traced_away")
    vllm_ir.set_priority(rms_norm=["traced_away"])
    x, w, eps = x_w()
    gm = make_fx(lambda x, w: op(x, w, eps))(x, w)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.vllm_ir.rms_norm.default]


def test_looking_an_overload_up_again_keeps_the_object_graphs_and_patterns_hold():
    """The dispatcher and the passes' patterns hold ``torch.ops.vllm_ir.<op>.default``; asking
    for it again (a second entry point, a test) must not replace it with a new object."""
    from vllm_ir.ir import torch_library

    held = torch.ops.vllm_ir.rms_norm.default
    assert torch_library.overload("rms_norm") is held
    assert torch_library.overload("rms_norm") is held
    assert torch.ops.vllm_ir.rms_norm.default is held


def test_the_torch_op_kernel_caches_its_decisions_and_follows_priority_changes():
    """A graph that kept the IR node, or a direct torch.ops call, runs the op's kernel: it
    decides like eager dispatch, caches per signature, and forgets on any priority change."""
    asked = []

    def counting(x, weight, epsilon, variance_size=None):
        asked.append(variance_size)
        return variance_size is None or Unsupported("no variance_size")

    picky = rms_norm_impl("picky_kernel", supports_args=counting)
    vllm_ir.set_priority(rms_norm=["picky_kernel"])
    x, w, eps = x_w()
    torch_op = torch.ops.vllm_ir.rms_norm.default
    for _ in range(3):
        torch.testing.assert_close(torch_op(x, w, eps), op.fn(x, w, eps))
    assert asked == [None] and picky.calls == ["picky_kernel"] * 3
    torch_op(x, w, eps, 8)  # the trailing default the dispatcher leaves out is part of the key
    assert asked == [None, 8] and picky.calls == ["picky_kernel"] * 3
    vllm_ir.set_priority(rms_norm=["native"])
    torch_op(x, w, eps)
    assert picky.calls == ["picky_kernel"] * 3


def test_the_torch_op_kernel_applies_no_fallback_policy(monkeypatch):
    # The policy belongs to eager calls and to lowering at compile time; a compiled graph
    # that kept the node must not start raising at run time.
    monkeypatch.setenv("VLLM_IR_FALLBACK", "error")
    vllm_ir.reload_env()
    rms_norm_impl("bf16_kernel", supports_args=_bf16_only)
    vllm_ir.set_priority(rms_norm=["bf16_kernel"])
    x, w, eps = x_w()
    torch.testing.assert_close(torch.ops.vllm_ir.rms_norm.default(x, w, eps), op.fn(x, w, eps))
    with pytest.raises(FallbackError):
        op(x, w, eps)
