"""The conformance kit over the pure-PyTorch providers (aten, inductor) from providers/native."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

import vllm_ir

if importlib.util.find_spec("vllm_ir_provider_native") is None:
    pytest.skip("providers/native is not installed (scripts/setup.sh installs it)", allow_module_level=True)

from vllm_ir.testing import conformance_tests

globals().update(conformance_tests("aten"))

# Each dtype x input variant x layout is one Inductor compile (1-4 s here): fp32 exercises
# every compiled variant; bf16/fp16 go through the same generated code with other casts.
# Under torch.compile the inductor provider *is* the native function (compiling inside a
# compile is not allowed), so its compiled check would only repeat native's at 10-100 s an op.
globals().update(
    conformance_tests(
        "inductor",
        dtypes=(torch.float32,),
        examples=5,
        compiled="under torch.compile the inductor provider runs the native function itself",
        # Every token count of the check is another Inductor compile (~10 s an op here).
        batch_invariance="Inductor compiles per batch size: pytest --vllm-ir-conformance "
        "--vllm-ir-provider inductor -k batch_invariance checks it (minutes)",
    )
)


def _load(provider: str) -> None:
    from vllm_ir.testing import provider_impls

    provider_impls(provider)  # loads the entry point


@pytest.mark.parametrize("provider", ["aten", "inductor"])
@pytest.mark.parametrize("op_name", ["rms_norm", "fused_add_rms_norm"])
def test_float64_is_declined_with_the_reason(provider, op_name):
    # native computes float64 in float32 (tests/test_numerics.py): no float64 kernel can match it to 1e-10.
    _load(provider)
    op = getattr(vllm_ir.ops, op_name)
    args = op.generate_inputs((3, 64), torch.float64)
    with vllm_ir.priority(**{op_name: [provider]}):
        assert op.dispatch(*args).provider == "native"
        (verdict, *_) = op.explain(*args).verdicts
    assert verdict.provider == provider and "float64" in verdict.reason and "float32" in verdict.reason


def test_aten_declines_a_weight_on_another_device_so_native_raises_as_it_would():
    _load("aten")
    op = vllm_ir.ops.fused_add_rms_norm
    x, residual, weight, eps, _ = op.generate_inputs((3, 64), torch.float32)
    with vllm_ir.priority(fused_add_rms_norm=["aten"]):
        (verdict, *_) = op.explain(x, residual, weight.to("meta"), eps).verdicts
        assert verdict.status == "declined" and verdict.reason == "weight is on meta, x on cpu"
        with pytest.raises(RuntimeError), warnings.catch_warnings():
            warnings.simplefilter("ignore", vllm_ir.FallbackWarning)
            op(x, residual, weight.to("meta"), eps)


@pytest.mark.compile
@pytest.mark.subprocess
def test_inductor_takes_a_fresh_code_object_when_dynamo_reaches_its_recompile_limit():
    """Dynamo specializes on strides and views beyond the provider's signature; a full code
    object must not turn the provider's next variant into a hard failure (fullgraph=True)."""
    _load("inductor")
    op = vllm_ir.ops.gelu_and_mul
    layouts = [torch.randn(4, 32)[:, :16], torch.randn(16, 4).t(), torch.randn(4, 48)[:, 8:24]]
    with torch._dynamo.config.patch(recompile_limit=1), vllm_ir.priority(gelu_and_mul=["inductor"]):
        for x in layouts + layouts:
            assert op.dispatch(x, "none").provider == "inductor"
            torch.testing.assert_close(op(x, "none"), op.fn(x, "none"))


def test_inductor_with_a_zero_recompile_limit_raises_instead_of_compiling_forever():
    """A fresh code object that hits the limit is the limit forbidding compiles, not a full one.

    The op is new, so its first compile is certainly a fresh code object's."""
    from vllm_ir_provider_native import inductor

    from tests.conftest import unique

    @vllm_ir.register_op(name=unique("twice"))
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    with torch._dynamo.config.patch(recompile_limit=0), pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        inductor._run(twice.name, torch.randn(3, 8))
