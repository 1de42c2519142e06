"""``inductor_options`` / ``compile``: our passes chain with the user's instead of replacing them."""

from __future__ import annotations

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

import vllm_ir
from tests.compile_models import passes_always_run
from vllm_ir import passes
from vllm_ir.passes.nodes import ir_nodes, is_maybe_inplace

ops = vllm_ir.ops
EPS = 1e-6


class Spy(CustomGraphPass):
    """A user pass that records what it saw."""

    def __init__(self, name: str, uid: str | None = "v1"):
        self.name, self.uid = name, uid
        self.seen: list[dict[str, int]] = []

    def __call__(self, graph: fx.Graph) -> None:
        nodes = list(ir_nodes(graph))
        self.seen.append({"ir": len(nodes), "maybe_inplace": sum(map(is_maybe_inplace, nodes))})

    def uuid(self) -> str | None:
        return None if self.uid is None else f"{self.name}:{self.uid}"


def test_user_passes_from_options_and_config_run_with_ours_in_order():
    pre, pre_post_grad, post = Spy("pre"), Spy("post_grad_pre"), Spy("post")
    from_config = Spy("config_post")
    w = torch.randn(16)

    with torch._inductor.config.patch(post_grad_custom_post_pass=from_config), passes_always_run():
        torch._dynamo.reset()

        @passes.compile(
            mode="default",
            options={"pre_grad_custom_pass": pre, "post_grad_custom_pre_pass": pre_post_grad},
        )
        def model(x, r):
            return ops.fused_add_rms_norm.maybe_inplace(x * 2, r, w, EPS)

        chain = passes.inductor_options(post_grad_custom_post_pass=post)["post_grad_custom_post_pass"]
        x, r = torch.randn(4, 16), torch.randn(4, 16)
        out = model(x, r.clone())

    expected = ops.fused_add_rms_norm.fn(x * 2, r, w, EPS)
    for a, b in zip(out, expected, strict=True):
        torch.testing.assert_close(a, b)
    assert pre.seen == [{"ir": 1, "maybe_inplace": 0}]  # after our functionalization
    assert pre_post_grad.seen == [{"ir": 1, "maybe_inplace": 0}]  # IR ops still there
    assert from_config.seen == [{"ir": 0, "maybe_inplace": 0}]  # after lowering
    assert [type(p).__name__ for p in chain.passes] == ["IrPipelinePass", "Spy"]
    record = passes.record_of(model)
    assert len(record.graphs) == 1 and record.pass_seconds > 0


def test_chained_uuid_combines_user_uuids_and_is_none_without_one():
    def post_uuid(user_pass) -> object:
        return passes.inductor_options(post_grad_custom_post_pass=user_pass)["post_grad_custom_post_pass"].uuid()

    v1, v1_again, v2 = post_uuid(Spy("p", "v1")), post_uuid(Spy("p", "v1")), post_uuid(Spy("p", "v2"))
    assert v1 == v1_again != v2
    assert post_uuid(None) not in (v1, v2)
    assert post_uuid(Spy("p", None)) is None  # Inductor then bypasses its cache, as for the pass alone
    assert post_uuid(lambda graph: None) is None
    pre = passes.inductor_options(pre_grad_custom_pass=[Spy("a"), Spy("b")])["pre_grad_custom_pass"]
    assert [type(p).__name__ for p in pre.passes] == ["FunctionalizeInplacePass", "Spy", "Spy"]


def test_options_keep_every_other_inductor_option():
    options = passes.inductor_options(max_autotune=False, **{"cpp.simdlen": None})
    assert options["max_autotune"] is False and options["cpp.simdlen"] is None
