"""vllm_c's norms on calls too large for the last-level cache, where the CPU kernels store their
outputs non-temporally (csrc/cpu/layernorm.cpp): the values must still be native's, bit for
bit, for bf16/fp16 x with an fp32 weight (the Hugging Face case) as for the other weight kinds,
on rows whose outputs are vector-aligned (streamed) and not (plain stores), with a tail after
the last whole step, and in every compiled CPU variant that streams (AVX2, AVX512)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import vllm_ir

provider = pytest.importorskip("vllm_ir_provider_vllm_c", reason="the vllm_c provider is not installed")
needs_kernels = pytest.mark.skipif(
    not provider.STATUS.loaded, reason=f"vllm_c kernels not usable: {provider.STATUS.reason}"
)

EPS = 1e-6
#: 4100: a tail of 4 after the last whole step, and rows 8200 bytes apart in bf16/fp16, so that
#: every other row's output is 64-byte aligned (streamed) and the others are not.
HIDDEN = 4100


def last_level_cache_bytes() -> int:
    """What the kernels' torch side reads (the largest cache sysfs lists for CPU 0, else 32 MiB)."""
    sizes = []
    for index in range(8):
        path = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size")
        if path.exists():
            text = path.read_text().strip()
            scale = {"K": 2**10, "M": 2**20}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KM")) * scale)
    return max(sizes, default=32 * 2**20)


def rows_beyond_cache(activations: int, hidden: int, dtype: torch.dtype) -> int:
    """Rows for a call whose `activations` tensors (inputs and outputs) exceed the cache twice over."""
    per_row = activations * hidden * torch.empty((), dtype=dtype).element_size()
    return 2 * last_level_cache_bytes() // per_row + 1


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    view = torch.int16 if got.element_size() == 2 else torch.int32
    return got.dtype == want.dtype and torch.equal(got.view(view), want.view(view))


def misaligned_like(x: torch.Tensor) -> torch.Tensor:
    """An empty tensor like x whose data starts one element past a fresh allocation's start."""
    flat = torch.empty(x.numel() + 1, dtype=x.dtype)
    return flat[1:].view(x.shape)


def _inputs(rows: int, dtype: torch.dtype, weight_dtype: torch.dtype | None):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    residual = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    w = None if weight_dtype is None else (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(weight_dtype)
    return x, residual, w


CASES = [
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
    (torch.float16, None),
]


@needs_kernels
@pytest.mark.parametrize(("dtype", "weight_dtype"), CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_rms_norm_beyond_the_cache_gives_natives_bits(dtype, weight_dtype):
    x, _, w = _inputs(rows_beyond_cache(2, HIDDEN, dtype), dtype, weight_dtype)
    want = vllm_ir.ops.rms_norm.fn(x, w, EPS)
    for out in (torch.empty_like(x), misaligned_like(x)):
        torch.ops.vllm_ir_c.rms_norm(out, x, w, EPS)
        assert same_bits(out, want), out.data_ptr() % 64


@needs_kernels
@pytest.mark.parametrize(("dtype", "weight_dtype"), CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_fused_add_rms_norm_out_beyond_the_cache_gives_natives_bits(dtype, weight_dtype):
    x, residual, w = _inputs(rows_beyond_cache(4, HIDDEN, dtype), dtype, weight_dtype)
    want_out, want_residual = vllm_ir.ops.fused_add_rms_norm.fn(x, residual, w, EPS)
    # Both outputs aligned; one of them not (the row is then stored plainly).
    for out, residual_out in ((torch.empty_like(x), torch.empty_like(x)), (torch.empty_like(x), misaligned_like(x))):
        torch.ops.vllm_ir_c.fused_add_rms_norm_out(out, residual_out, x, residual, w, EPS)
        assert same_bits(out, want_out) and same_bits(residual_out, want_residual)
    # In place (never streamed) at the same size, through dispatch.
    with vllm_ir.priority(fused_add_rms_norm=["vllm_c"]):
        got_out, got_residual = vllm_ir.ops.fused_add_rms_norm.maybe_inplace(x, residual, w, EPS)
    assert same_bits(got_out, want_out) and same_bits(got_residual, want_residual)


_VARIANT_CHECK = """
import sys, torch, vllm_ir, vllm_ir_provider_vllm_c as p
sys.path.insert(0, sys.argv[1])
import test_vllm_c_mixed_norms as t
print(p.cpu_capability())
for dtype, weight_dtype in t.CASES[:3]:
    x, residual, w = t._inputs(t.rows_beyond_cache(4, t.HIDDEN, dtype), dtype, weight_dtype)
    out, residual_out = torch.empty_like(x), t.misaligned_like(x)
    torch.ops.vllm_ir_c.rms_norm(out, x, w, t.EPS)
    assert t.same_bits(out, vllm_ir.ops.rms_norm.fn(x, w, t.EPS)), dtype
    out = torch.empty_like(x)
    torch.ops.vllm_ir_c.fused_add_rms_norm_out(out, residual_out, x, residual, w, t.EPS)
    want = vllm_ir.ops.fused_add_rms_norm.fn(x, residual, w, t.EPS)
    assert t.same_bits(out, want[0]) and t.same_bits(residual_out, want[1]), dtype
print("ok")
"""


@needs_kernels
@pytest.mark.subprocess
@pytest.mark.parametrize("variant", ["AVX2", "AVX512"])
def test_every_streaming_cpu_variant_gives_natives_bits(variant):
    """The other x86 variants stream through their own intrinsics; AVX512_BF16 runs in-process."""
    from tests.test_provider_vllm_c import verdict_in_variant

    assert verdict_in_variant(variant, _VARIANT_CHECK, str(Path(__file__).parent), timeout=300) == "ok"


#: Row lengths for the in-cache kernels, which run pass 2 of a row inside pass 1 of the next,
#: group by group of 32 values: no whole group (scalars, or whole 8-lane vectors only), whole
#: groups with 1-3 vectors and a scalar tail after them, and the bench's hidden size.
INTERLEAVED_LENGTHS = (3, 8, 31, 32, 33, 32 * 5 + 8 * 3 + 5, 4096)


def check_interleaved_rows(threads: int) -> None:
    """Many rows per task (one thread and two), rows at a stride (not contiguous), each weight
    kind, out of place and in place: native's bits for every row, the first and last of a task
    (which are not interleaved with a neighbour on one side) included."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for hidden in INTERLEAVED_LENGTHS:
            for dtype, weight_dtype in CASES:
                g = torch.Generator().manual_seed(hidden)
                rows = max(9, 3 * 16384 // hidden)  # at least 3 tasks' worth of rows at 2 threads
                wide = (4 * torch.randn(rows, hidden + 5, generator=g)).to(dtype)
                x = wide[:, :hidden]  # row stride hidden + 5
                residual = torch.randn(rows, hidden, generator=g).to(dtype)
                w = None if weight_dtype is None else torch.randn(hidden, generator=g).to(weight_dtype)
                where = (threads, hidden, dtype, weight_dtype)
                out = torch.empty(rows, hidden, dtype=dtype)
                torch.ops.vllm_ir_c.rms_norm(out, x, w, EPS)
                assert same_bits(out, vllm_ir.ops.rms_norm.fn(x, w, EPS)), where
                want_out, want_residual = vllm_ir.ops.fused_add_rms_norm.fn(x, residual, w, EPS)
                out, residual_out = torch.empty_like(out), torch.empty_like(out)
                torch.ops.vllm_ir_c.fused_add_rms_norm_out(out, residual_out, x, residual, w, EPS)
                assert same_bits(out, want_out) and same_bits(residual_out, want_residual), where
                xi, ri = x.clone(), residual.clone()
                torch.ops.vllm_ir_c.fused_add_rms_norm(xi, ri, w, EPS)
                assert same_bits(xi, want_out) and same_bits(ri, want_residual), where
    finally:
        torch.set_num_threads(before)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_interleaved_rows_in_cache_give_natives_bits(threads):
    check_interleaved_rows(threads)


_INTERLEAVED_CHECK = """
import sys, vllm_ir_provider_vllm_c as p
sys.path.insert(0, sys.argv[1])
import test_vllm_c_mixed_norms as t
print(p.cpu_capability())
t.check_interleaved_rows(1)
t.check_interleaved_rows(2)
print("ok")
"""


@needs_kernels
@pytest.mark.subprocess
@pytest.mark.parametrize("variant", ["DEFAULT", "AVX2", "AVX512"])
def test_every_cpu_variant_interleaves_rows_with_natives_bits(variant):
    """Each variant's vector width makes a group of 32 values 1, 2 or 4 steps (AVX512, AVX2, DEFAULT)."""
    from tests.test_provider_vllm_c import verdict_in_variant

    assert verdict_in_variant(variant, _INTERLEAVED_CHECK, str(Path(__file__).parent), timeout=300) == "ok"
