"""A small Llama-style decoder written with vllm-ir ops, and kernels for compile tests.

Shared by the compile tests and ``benchmarks/compile_pipeline.py``. The same module runs
with vllm-ir ops (``use_ir=True``) or as plain torch code (the ops' native functions
called directly), so compiled IR and compiled plain torch can be compared.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import vllm_ir

ops = vllm_ir.ops

# ---------------------------------------------------------------------------------------
# Opaque kernels: torch custom ops, as a C++ extension would register them. Their Python
# bodies run at run time, so the call counters show which kernel a compiled graph runs.

KERNEL_CALLS: dict[str, int] = {"rms_norm": 0, "rms_norm_b": 0, "fused_add_rms_norm_": 0}


@torch.library.custom_op("vllm_ir_test::rms_norm", mutates_args=())
def rms_norm_kernel(x: Tensor, weight: Tensor, epsilon: float) -> Tensor:
    KERNEL_CALLS["rms_norm"] += 1
    return ops.rms_norm.fn(x, weight, epsilon)


@rms_norm_kernel.register_fake
def _(x: Tensor, weight: Tensor, epsilon: float) -> Tensor:
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("vllm_ir_test::rms_norm_b", mutates_args=())
def rms_norm_kernel_b(x: Tensor, weight: Tensor, epsilon: float) -> Tensor:
    """A second opaque RMSNorm kernel: switching between the two needs no C++ compile at all."""
    KERNEL_CALLS["rms_norm_b"] += 1
    return ops.rms_norm.fn(x, weight, epsilon)


@rms_norm_kernel_b.register_fake
def _(x: Tensor, weight: Tensor, epsilon: float) -> Tensor:
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("vllm_ir_test::fused_add_rms_norm_", mutates_args=("x", "x_residual"))
def fused_add_rms_norm_kernel(x: Tensor, x_residual: Tensor, weight: Tensor, epsilon: float) -> None:
    """In place: ``x_residual += x``; ``x = rms_norm(x_residual) * weight`` (fp32 math)."""
    KERNEL_CALLS["fused_add_rms_norm_"] += 1
    out, residual = ops.fused_add_rms_norm.fn(x, x_residual, weight, epsilon)
    x_residual.copy_(residual)
    x.copy_(out)


@fused_add_rms_norm_kernel.register_fake
def _(x: Tensor, x_residual: Tensor, weight: Tensor, epsilon: float) -> None:
    return None


def _weighted(x, weight, epsilon, variance_size=None):
    if weight is None or variance_size is not None:
        return vllm_ir.Unsupported("needs a weight and no variance_size")
    return True


def opaque_rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    return torch.ops.vllm_ir_test.rms_norm(x, weight, epsilon)


def opaque_rms_norm_b(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    return torch.ops.vllm_ir_test.rms_norm_b(x, weight, epsilon)


def inplace_fused_add_rms_norm(
    x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> tuple[Tensor, Tensor]:
    torch.ops.vllm_ir_test.fused_add_rms_norm_(x, x_residual, weight, epsilon)
    return x, x_residual


def _same_dtype(x, x_residual, weight, epsilon, variance_size=None):
    if weight is None or variance_size is not None or x.dtype != weight.dtype:
        return vllm_ir.Unsupported("needs a weight of x's dtype and no variance_size")
    return True


#: provider name -> (op, function, registration options)
TEST_PROVIDERS = {
    "test_opaque": ("rms_norm", opaque_rms_norm, {"supports_args": _weighted}),
    "test_opaque_b": ("rms_norm", opaque_rms_norm_b, {"supports_args": _weighted}),
    "test_inplace": ("fused_add_rms_norm", inplace_fused_add_rms_norm, {"supports_args": _same_dtype, "inplace": True}),
}


# More kernel styles, registered only by the tests that name them (`MORE_TEST_PROVIDERS`).


@torch.library.custom_op("vllm_ir_test::rms_norm_out", mutates_args=("out",))
def rms_norm_out_kernel(out: Tensor, x: Tensor, weight: Tensor, epsilon: float) -> None:
    """Triton style: the caller allocates the output, the kernel writes it (``out`` is ``(a!)``)."""
    out.copy_(ops.rms_norm.fn(x, weight, epsilon))


@rms_norm_out_kernel.register_fake
def _(out: Tensor, x: Tensor, weight: Tensor, epsilon: float) -> None:
    return None


@torch.library.custom_op("vllm_ir_test::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm_pair_kernel(
    x: Tensor, x_residual: Tensor, weight: Tensor, epsilon: float
) -> tuple[Tensor, Tensor]:
    """Opaque and functional, with two fresh outputs (one multi-output node in the graph)."""
    out, residual = ops.fused_add_rms_norm.fn(x, x_residual, weight, epsilon)
    return out.clone(), residual.clone()


@fused_add_rms_norm_pair_kernel.register_fake
def _(x: Tensor, x_residual: Tensor, weight: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("vllm_ir_test::add_residual_", mutates_args=("x_residual",))
def add_residual_kernel(x: Tensor, x_residual: Tensor) -> None:
    """``x_residual += x``: writes the residual, only reads ``x``."""
    x_residual.add_(x)


@add_residual_kernel.register_fake
def _(x: Tensor, x_residual: Tensor) -> None:
    return None


def triton_style_rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    out = torch.empty_like(x)
    torch.ops.vllm_ir_test.rms_norm_out(out, x, weight, epsilon)
    return out


def opaque_fused_add_rms_norm(
    x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> tuple[Tensor, Tensor]:
    return torch.ops.vllm_ir_test.fused_add_rms_norm(x, x_residual, weight, epsilon)


def residual_inplace_fused_add_rms_norm(
    x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> tuple[Tensor, Tensor]:
    """In place on the residual only: ``x`` is read, never written (its clone is read-only)."""
    torch.ops.vllm_ir_test.add_residual_(x, x_residual)
    return torch.ops.vllm_ir_test.rms_norm(x_residual, weight, epsilon), x_residual


#: More test kernels (same form as `TEST_PROVIDERS`), for `register_test_providers(MORE_TEST_PROVIDERS)`.
MORE_TEST_PROVIDERS = {
    "test_triton_style": ("rms_norm", triton_style_rms_norm, {"supports_args": _weighted}),
    "test_opaque_fused": ("fused_add_rms_norm", opaque_fused_add_rms_norm, {"supports_args": _same_dtype}),
    "test_residual_inplace": (
        "fused_add_rms_norm",
        residual_inplace_fused_add_rms_norm,
        {"supports_args": _same_dtype, "inplace": True},
    ),
}


def register_test_providers(providers: dict | None = None) -> None:
    """Register ``providers`` (default: `TEST_PROVIDERS`)."""
    for provider, (op_name, fn, options) in (TEST_PROVIDERS if providers is None else providers).items():
        op = getattr(ops, op_name)
        if provider not in op.impls:
            op.register_impl(provider, **options)(fn)


def unregister_test_providers(providers: dict | None = None) -> None:
    for provider, (op_name, _fn, _options) in (TEST_PROVIDERS if providers is None else providers).items():
        getattr(ops, op_name).remove_impl(provider)


def load_installed_provider(name: str) -> str | None:
    """Make an installed provider's implementations registered; None, or why it cannot be.

    Plugin autoload is off in the tests. A provider imported earlier and withdrawn since (by
    `clean_state`) cannot register again in this process: that is reported, not hidden.
    """
    if any(name in op.impls for op in ops):
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the reason is returned instead
            vllm_ir.load_provider(name)
    except vllm_ir.VllmIrError as exc:
        return f"provider {name!r} cannot be loaded: {exc}"
    if any(name in op.impls for op in ops):
        return None
    record = next((r for r in vllm_ir.provider_records() if r.name == name), None)
    if record is not None and record.reason:
        return f"provider {name!r} is {record.status.value}: {record.reason}"
    return f"provider {name!r} registered nothing (imported and withdrawn earlier in this process?)"


@contextlib.contextmanager
def test_providers() -> Iterator[None]:
    """The opaque and in-place test kernels registered, first in both ops' priorities."""
    register_test_providers()
    try:
        with vllm_ir.priority(rms_norm=["test_opaque"], fused_add_rms_norm=["test_inplace"]):
            yield
    finally:
        unregister_test_providers()


# ---------------------------------------------------------------------------------------
# The model


class Diagonal(nn.Module):
    """A matmul-free stand-in for ``nn.Linear``: per-channel scales, widening by repetition and
    narrowing by summing groups (``out`` and ``in`` must divide one another)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(out_features))

    def forward(self, x: Tensor) -> Tensor:
        if self.out_features >= self.in_features:
            x = x.repeat(1, self.out_features // self.in_features)
        else:
            x = x.view(-1, self.out_features, self.in_features // self.out_features).sum(-1)
        return x * self.weight


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer; a per-token gated projection stands in for attention.

    ``linear=False`` swaps the projections for `Diagonal` scales: the IR ops' share of the
    step then dominates instead of the GEMMs'.
    """

    def __init__(self, hidden: int, intermediate: int, use_ir: bool, eps: float = 1e-6, linear: bool = True):
        super().__init__()
        self.use_ir = use_ir
        self.eps = eps
        self.input_norm = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.post_norm = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        proj = (lambda i, o: nn.Linear(i, o, bias=False)) if linear else Diagonal
        self.qkv = proj(hidden, 3 * hidden)
        self.o_proj = proj(hidden, hidden)
        self.gate_up = proj(hidden, 2 * intermediate)
        self.down = proj(intermediate, hidden)

    def _rms_norm(self, x: Tensor, w: Tensor) -> Tensor:
        return ops.rms_norm(x, w, self.eps) if self.use_ir else ops.rms_norm.fn(x, w, self.eps)

    def _add_norm(self, x: Tensor, residual: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        if self.use_ir:
            return ops.fused_add_rms_norm.maybe_inplace(x, residual, w, self.eps)
        return ops.fused_add_rms_norm.fn(x, residual, w, self.eps)

    def forward(self, x: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        if residual is None:
            residual = x
            h = self._rms_norm(x, self.input_norm)
        else:
            h, residual = self._add_norm(x, residual, self.input_norm)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        h = self.o_proj(v * torch.sigmoid(q + k))
        h, residual = self._add_norm(h, residual, self.post_norm)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up), residual


class Decoder(nn.Module):
    """``layers`` decoder layers and a final add + RMSNorm."""

    def __init__(
        self, hidden: int = 64, intermediate: int = 128, layers: int = 2, use_ir: bool = True, linear: bool = True
    ):
        super().__init__()
        self.use_ir = use_ir
        self.layers = nn.ModuleList(DecoderLayer(hidden, intermediate, use_ir, linear=linear) for _ in range(layers))
        self.norm = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))

    def forward(self, x: Tensor) -> Tensor:
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual)
        if self.use_ir:
            x, _ = ops.fused_add_rms_norm.maybe_inplace(x, residual, self.norm, 1e-6)
        else:
            x, _ = ops.fused_add_rms_norm.fn(x, residual, self.norm, 1e-6)
        return x


def make_decoder(
    *,
    hidden: int = 64,
    intermediate: int = 128,
    layers: int = 2,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    linear: bool = True,
) -> tuple[Decoder, Decoder]:
    """The IR model and a plain-torch twin with the same weights, both in eval mode and ``dtype``."""
    torch.manual_seed(seed)
    ir = Decoder(hidden, intermediate, layers, use_ir=True, linear=linear).to(dtype).eval()
    plain = Decoder(hidden, intermediate, layers, use_ir=False, linear=linear).to(dtype).eval()
    plain.load_state_dict(ir.state_dict())
    return ir, plain


def count_ir_nodes(code: str) -> int:
    return code.count("torch.ops.vllm_ir.")


# ---------------------------------------------------------------------------------------
# Measuring


def compile_with_passes(fn, **options):
    """``torch.compile`` with vllm-ir's passes from a fresh Dynamo state, and their record."""
    torch._dynamo.reset()
    opts = vllm_ir.inductor_options(**options)
    return torch.compile(fn, options=opts), vllm_ir.passes.record_of(opts)


@contextlib.contextmanager
def passes_always_run() -> Iterator[None]:
    """Turn off Inductor's FX graph and AOTAutograd caches, so every compile runs the passes.

    Kernels compiled by the C++ backend are still cached on disk, which keeps re-runs fast.
    """
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def peak_bytes(fn) -> int:
    """Peak of CPU memory allocated while ``fn()`` runs, from the profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()
        peak = max(peak, current)
    return peak
