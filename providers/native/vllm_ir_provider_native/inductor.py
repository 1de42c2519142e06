"""Provider ``inductor``: each op's native function, compiled once by Inductor for eager callers.

In eager mode the native decomposition of RMSNorm runs as ~8 separate kernels; Inductor
fuses it into one. Compiled with ``dynamic=True`` so new batch sizes do not recompile.
Under an outer ``torch.compile`` (or any tracing) the implementation *is* the plain native
function: the outer Inductor fuses it anyway, and compiling inside a compile is not allowed.

The fused add + RMSNorm stays functional: Inductor 2.13's CPU backend fails to compile the
in-place form (input mutation after a reduction raises ``InductorError: KeyError: 'buf1'``).

Activations are compiled over a flattened view (rows for the gated ops, one dimension for the
elementwise ones): every rank and row stride is then the same compiled code, so an op costs one
compile per dtype (and per size 0/1 specialization) instead of one per layout.

Each compile emulates eager's precision casts (Inductor's ``emulate_precision_casts``): a
fused kernel otherwise skips the roundings the op spells out, e.g. the bf16 product of an fp32
x and a bf16 weight (one bf16 step off native, 600x the fp32 tolerance).

float64 is declined: native computes it in float32, and Inductor's fused float32 reduction
rounds differently (~1e-7), far beyond the float64 tolerance; native itself is the right kernel
for a reference dtype. Everything else native accepts, the compiled native function accepts.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import shutil
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import vllm_ir
from vllm_ir import Provider
from vllm_ir.ir.declarations.activation import ELEMENTWISE_OPS, GATED_OPS

PROVIDER = "inductor"


def _availability() -> bool | vllm_ir.Unsupported:
    if torch.cuda.is_available():
        try:
            import triton  # noqa: F401
        except ImportError:
            return vllm_ir.Unsupported("Inductor needs Triton for GPU code and triton is not installed")
        return True
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None and shutil.which("c++") is None:
        return vllm_ir.Unsupported(f"Inductor's CPU backend needs a C++ compiler ({compiler} not found)")
    return True


SUPPORTED = _availability()
#: The registration surface: unavailable without a compiler for Inductor's back-end.
INDUCTOR = Provider(PROVIDER, available=SUPPORTED)


@functools.cache
def compiled(op_name: str, signature: tuple, generation: int = 0) -> Callable[..., Any]:
    """The op's native function compiled for one call signature (shapes stay dynamic).

    Dynamo counts recompilations per code object, and every dtype, weight presence, rank,
    size-0/1 dimension or strided layout is a recompilation: a fresh code object per such
    signature keeps each one within Dynamo's limit instead of failing after eight variants.
    Dynamo specializes on more than a signature can name (a view's base, row strides): when
    one code object reaches the limit, generation ``n + 1`` is a fresh one (see `_run`).
    """
    fn = vllm_ir.ops.__getattr__(op_name).fn
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{len(_signatures)}")
    _signatures.add((op_name, signature, generation))
    clone = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    # emulate_precision_casts: round where the op rounds (vLLM's ``x.to(weight.dtype) * weight``
    # for an fp32 x and a bf16 weight rounds the product to bf16); fused, Inductor skips it.
    return torch.compile(clone, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True})


_signatures: set[tuple] = set()


def _signature(args: tuple) -> tuple:
    """What Dynamo specializes on even with ``dynamic=True``: grad mode, dtypes, ranks, sizes 0
    and 1, layout, views, ``requires_grad``, and the value of a string or bool parameter."""
    return (torch.is_grad_enabled(), *(_fact(a) for a in args))


def _fact(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        shape = tuple(min(s, 2) for s in a.shape)
        return (a.dtype, a.device.type, shape, a.is_contiguous(), a._is_view(), a.requires_grad)
    return a if a is None or isinstance(a, (str, bool)) else type(a)


def _tracing() -> bool:
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def _run(op_name: str, *args: Any) -> Any:
    if _tracing():
        return vllm_ir.ops.__getattr__(op_name).fn(*args)
    signature = _signature(args)
    for generation in itertools.count():
        fresh = (op_name, signature, generation) not in _signatures
        try:
            return compiled(op_name, signature, generation)(*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            if fresh:  # not a full code object: the limit itself forbids this compile
                raise
            # this generation holds Dynamo's limit of variants: the next one compiles it


def _not_float64(x: Tensor) -> bool | vllm_ir.Unsupported:
    if x.dtype == torch.float64:
        return vllm_ir.Unsupported(
            "float64: native computes it in float32 and Inductor's fused reduction rounds differently "
            "(~1e-7, beyond the float64 tolerance)"
        )
    return True


def _gated_supports(x: Tensor) -> bool | vllm_ir.Unsupported:
    if x.dim() == 0:
        return vllm_ir.Unsupported("x is 0-d (a gated activation splits the last dimension)")
    return _not_float64(x)


def _register(op: vllm_ir.IrOp, flatten: Callable[[Tensor], Tensor] | None = None, **options: Any) -> None:
    """``op``'s native function compiled, over ``flatten(x)`` where given (shaped back to x's
    leading dimensions), for all of the op's parameters (its own names and defaults)."""
    name, gated = op.name, op in GATED_OPS

    def run(*args: Any) -> Any:
        if flatten is None:
            return _run(name, *args)
        x = args[0]
        out = _run(name, flatten(x), *args[1:])
        return out.reshape(*x.shape[:-1], out.shape[-1]) if gated else out.reshape(x.shape)

    run.__signature__ = inspect.signature(op.fn)  # type: ignore[attr-defined]
    run.__name__ = run.__qualname__ = name
    INDUCTOR.register(op, run, **options)


for _op in (vllm_ir.ops.rms_norm, vllm_ir.ops.fused_add_rms_norm):
    _register(_op, supports=_not_float64)
# Activations over rows (gated) or one flat dimension (elementwise): one compile per dtype.
for _op in GATED_OPS:
    _register(_op, lambda x: x.reshape(-1, x.shape[-1]), supports=_gated_supports, batch_invariant=True)
for _op in ELEMENTWISE_OPS:
    _register(_op, lambda x: x.reshape(-1), supports=_not_float64, batch_invariant=True)
