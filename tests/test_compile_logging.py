"""The passes log their decisions on the ``vllm_ir.passes`` logger at DEBUG, and nothing above.

One compile of a small function covers every kind of message: a lowering that skips a
provider (with its reason), a lowering to the first choice, a ``maybe_inplace`` with donated
graph inputs, a fusion, clones removed and kept. Each message must agree with the record.
"""

from __future__ import annotations

import logging

import pytest
import torch

import vllm_ir
from vllm_ir.passes.entry import POST_POST, PRE_GRAD

ops = vllm_ir.ops
EPS = 1e-6
LOGGER = "vllm_ir.passes"

pytestmark = pytest.mark.usefixtures("compile_test_providers_passes_forced")


def model(x, r, w):
    a = ops.rms_norm(x, None, EPS)  # test_opaque declines (no weight): native
    b = ops.rms_norm(a, w, EPS)  # test_opaque
    _, res = ops.fused_add_rms_norm.maybe_inplace(x, r, w, EPS)  # donates graph inputs x and r
    out2, res2 = ops.fused_add_rms_norm(b, res, w, EPS)  # b is used below: its clone stays
    s = b + out2
    return s, ops.rms_norm(s, w, EPS), res2  # add + rms_norm with the sum used: fused


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


@pytest.mark.filterwarnings("ignore::vllm_ir.FallbackWarning")
def test_a_compile_logs_lowering_donations_fusions_and_clone_decisions(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    g = torch.Generator().manual_seed(0)
    x, r, w = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g), torch.randn(16, generator=g)
    torch._dynamo.reset()
    with vllm_ir.priority(rms_norm=["test_opaque"], fused_add_rms_norm=["test_inplace"]):
        compiled = vllm_ir.compile(model)
        compiled(x.clone(), r.clone(), w)
    record = vllm_ir.passes.record_of(compiled)
    messages = _messages(caplog)
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r.name == LOGGER)

    # Lowering: one message per selection, naming node, op and provider; skips with reasons.
    selected = [(op, node, p) for op, nodes in record.selected_impls.items() for node, p in nodes.items()]
    assert {p for _op, _node, p in selected} == {"native", "test_opaque", "test_inplace"}
    for op, node, provider in selected:
        chose = [m for m in messages if m.startswith(f"lowering {node} ({op}): chose {provider!r}")]
        assert len(chose) == 1, (node, messages)
        skipped = "test_opaque: needs a weight and no variance_size" if provider == "native" else "none"
        assert chose[0].endswith(f"skipped providers: {skipped}")

    # Functionalization and donations.
    (report,) = record.functionalized
    (node,) = report.rewritten
    (message,) = [m for m in messages if m.startswith(f"functionalize {node}:")]
    assert "fused_add_rms_norm.maybe_inplace -> fused_add_rms_norm.default" in message
    assert "x = graph input L['x'] (donated)" in message
    assert "x_residual = graph input L['r'] (donated)" in message

    # Fusion.
    (graph,) = record.graphs
    assert graph.fusions and all(f"fusion {f}" in messages for f in graph.fusions)

    # Clone cleanup: every decision, removed and kept, with its reason.
    assert graph.clones_removed and graph.clones_kept
    for c in graph.clones:
        verdict = "removed" if c.removed else "kept"
        line = f"clone cleanup: {verdict} {c.node} (argument {c.param} of {c.op} node {c.ir_node}): {c.reason}"
        assert line in messages


def test_the_cache_uuid_is_logged_once_per_value_and_only_at_debug(caplog):
    options = vllm_ir.inductor_options()
    pre, post = options[PRE_GRAD], options[POST_POST]

    caplog.set_level(logging.INFO, logger=LOGGER)
    post.uuid()
    assert _messages(caplog) == []  # silent unless DEBUG is asked for

    caplog.set_level(logging.DEBUG, logger=LOGGER)
    post._logged_uuid = None  # a fresh chain, as far as logging goes
    uid = post.uuid()
    assert post.uuid() == uid  # Inductor asks several times per compile
    assert pre.uuid()
    with vllm_ir.priority(rms_norm=["test_opaque"]):
        changed = post.uuid()
    assert changed != uid
    messages = [m for m in _messages(caplog) if m.startswith("compile cache uuid")]
    assert [m.split(" (from ")[0] for m in messages] == [
        f"compile cache uuid of {POST_POST}: {uid}",
        f"compile cache uuid of {PRE_GRAD}: {pre.uuid()}",
        f"compile cache uuid of {POST_POST}: {changed}",
    ]
    assert "IrPipelinePass=" in messages[0] and "FunctionalizeInplacePass=" in messages[1]
