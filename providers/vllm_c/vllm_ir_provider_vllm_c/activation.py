"""The activation family (csrc/cpu/activation.cpp, csrc/cuda/activation.cu): the gated ops
``silu_and_mul``, ``mul_and_silu``, ``gelu_and_mul``, ``fatrelu_and_mul``, ``swigluoai_and_mul``,
``gelu_and_mul_sparse`` and the elementwise ``gelu_new``, ``gelu_fast``, ``quick_gelu``, ``relu2``.

Each implementation wraps one ``torch.ops.vllm_ir_c`` op writing a fresh output. The predicates
say why a call is declined; they read dtypes, devices, the number of dimensions, the last
dimension and its stride, never the batch size or values. The C++ ops accept every layout
(awkward ones run on a contiguous copy); the gated predicates decline a non-unit stride along
the last dimension so that ``explain`` says what would be slow about it.

Numerics (checked by the conformance kit): the CPU kernels of ``silu_and_mul``,
``mul_and_silu``, ``fatrelu_and_mul`` and ``relu2`` are bit-identical to native (``exact``; the
two silu ops only where the running variant and ATen's compute exp alike, see `EXP_BASED`).
``gelu_and_mul`` is too wherever native runs ATen's gelu kernel, but native hands a contiguous
gate (a single row) to oneDNN, whose erf differs in the last bits; ``swigluoai_and_mul`` rounds
like native but its sigmoid's scalar/vector split follows the row, not native's flattened
tensor; ``quick_gelu`` uses Sleef's exp, and fp32 ``gelu_new`` / ``gelu_fast`` an exp-based
tanh, where native's torch.tanh is MKL's (all within the ops' tolerances). 16-bit ``gelu_new``
and ``gelu_fast`` round every step as vLLM's native does and give its bits for every bf16 and
fp16 value (tested). ``gelu_and_mul_sparse`` takes its row means from ATen's own mean and its
std in double as ATen's does: native's bits in 16-bit dtypes wherever the gelu is (not claimed
``exact``: fp32 and native's oneDNN erf differ in the last bits). With CUDA kernels built,
nothing is claimed exact: CUDA's expf/erff/tanhf are not ATen's CPU functions.

``table_path()`` says how the AVX512 kernels read their 16-bit activation tables on this
machine (computed or looked-up values, fixed by CPU vendor or ``VLLM_IR_C_TABLES``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_ir import Unsupported
from vllm_ir.ir.declarations.activation import check_approximate

from ._extension import DEVICES, PROVIDER, STATUS, VLLM_C, dtype_and_device_verdict, torch_op

GATED = ("silu_and_mul", "mul_and_silu", "gelu_and_mul", "fatrelu_and_mul", "swigluoai_and_mul")
#: Gated ops normalizing the gate by its row's statistics (their own kernel, csrc SparseGeluArgs).
ROW_STATISTIC_GATED = ("gelu_and_mul_sparse",)
ELEMENTWISE = ("gelu_new", "gelu_fast", "quick_gelu", "relu2")
#: Bit-identical to native on CPU over the whole conformance grid (see the module docstring).
EXACT_ON_CPU = ("silu_and_mul", "mul_and_silu", "fatrelu_and_mul", "relu2")
#: Where vllm_c goes first in eager mode. CPU: benchmarks/activation_cpu.py (OMP_NUM_THREADS=2,
#: --stat p10, the 2 shared cores under heavy load; bf16 and fp32, hidden 4096, T in 1, 16,
#: 256, 4096): the kernel ran ahead of native eager at every T for every op (1.2-2x for the
#: gated silu/gelu ops at T=16-256, up to 43x for the tanh GELUs, whose native is a chain of
#: tensor ops) and ahead of Inductor-compiled native at every T (closest: silu_and_mul bf16
#: T=256, 325 vs 360 us); the one inversion in the full run (swigluoai bf16 T=16) was another
#: tenant's preemption and re-measured 38 vs 136 (native) and 364 us (compiled). Dispatch
#: (``op()``) adds the same ~5 us to whichever provider runs. CUDA (an H200, torch 2.11,
#: benchmarks/vllm_c_cuda_check.py, hidden 4096, T 1-16384, bf16 and fp32): the kernels ran
#: 2.7-19x faster than native eager at every T for every op (T=1: 6-9 us against 20-120 us;
#: T=16384 bf16: 65-233 us against 339-1619 us).
#: gelu_and_mul_sparse (CPU, OMP_NUM_THREADS=2, vllm_ir.tools.timing.interleaved_rounds, 5 paired
#: rounds, hidden 4096): ahead of native at every T measured, bf16 T=1/16/256 1.71/1.87/1.88x,
#: fp32 1.65/2.41/2.66x (T=256 bf16: 3390 vs 6290 us). CUDA: not measured (no GPU here).
EAGER_FIRST = {"cpu": (*GATED, *ROW_STATISTIC_GATED, *ELEMENTWISE), "cuda": (*GATED, *ELEMENTWISE)}


#: Exact only where the running variant calls the exp ATen's running kernels call: Sleef's in
#: ATen's x86 vector builds (AVX2 and AVX-512 alike), the C library's in its DEFAULT one. A
#: library built without vector variants (``VLLM_IR_C_CPU_CAPABILITIES=""``, a compiler that
#: cannot target them) runs DEFAULT beside a vector ATen: within tolerance, not bit-identical.
EXP_BASED = ("silu_and_mul", "mul_and_silu")
_VECTOR_VARIANTS = ("AVX2", "AVX512", "AVX512_BF16")


def same_exp_as_aten() -> bool:
    """Whether the running kernel variant and ATen's are on the same side (vector or DEFAULT)."""
    if not STATUS.loaded:
        return True
    ours, aten = torch.ops.vllm_ir_c.cpu_capability(), torch.backends.cpu.get_cpu_capability()
    return (ours in _VECTOR_VARIANTS) == (aten in _VECTOR_VARIANTS)


def _exact(name: str) -> bool:
    return DEVICES == ("cpu",) and name in EXACT_ON_CPU and (name not in EXP_BASED or same_exp_as_aten())


def elementwise_verdict(x: Tensor) -> bool | Unsupported:
    return dtype_and_device_verdict(x, DEVICES)


def gated_verdict(x: Tensor) -> bool | Unsupported:
    verdict = dtype_and_device_verdict(x, DEVICES)
    if not verdict:
        return verdict
    if x.dim() == 0:
        return Unsupported("x is 0-d (gated ops split the last dimension)")
    if x.shape[-1] % 2:
        return Unsupported(f"last dimension {x.shape[-1]} is odd (gate and up halves differ in size)")
    if x.stride(-1) != 1 and x.size(-1) != 1:
        return Unsupported(f"x has stride {x.stride(-1)} along the last dimension (the kernels need 1)")
    return True


# A library built before gelu_and_mul_sparse existed (an install not rebuilt): that one op is
# unsupported, saying so, and the rest work.
SPARSE_BUILT = not STATUS.loaded or hasattr(torch.ops.vllm_ir_c, "gelu_and_mul_sparse")
_kernels = {
    name: torch_op(STATUS, name) for name in (*GATED, *(ROW_STATISTIC_GATED if SPARSE_BUILT else ()), *ELEMENTWISE)
}


def _run_gated(name: str, x: Tensor, *scalars: object) -> Tensor:
    """The op's kernel writing x's gated result (half its last dimension) into a fresh tensor."""
    out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
    _kernels[name](out, x, *scalars)
    return out


# Every kernel computes each output element from its own inputs in a fixed way: results never
# depend on the batch, on CPU or CUDA.
def _gated(name: str):
    return VLLM_C.impl(name, supports=gated_verdict, batch_invariant=True, exact=_exact(name))


@_gated("silu_and_mul")
def silu_and_mul(x):
    return _run_gated("silu_and_mul", x)


@_gated("mul_and_silu")
def mul_and_silu(x):
    return _run_gated("mul_and_silu", x)


@_gated("gelu_and_mul")
def gelu_and_mul(x, approximate="none"):
    # A bad `approximate` is no reason to fall back (no predicate declines it): native would
    # raise too. The kernel says so.
    check_approximate(approximate, f"gelu_and_mul (provider {PROVIDER})")
    return _run_gated("gelu_and_mul", x, approximate)


@_gated("fatrelu_and_mul")
def fatrelu_and_mul(x, threshold=0.0):
    return _run_gated("fatrelu_and_mul", x, threshold)


@_gated("swigluoai_and_mul")
def swigluoai_and_mul(x, alpha=1.702, limit=7.0):
    return _run_gated("swigluoai_and_mul", x, alpha, limit)


@VLLM_C.impl(
    "gelu_and_mul_sparse",
    supports=gated_verdict,
    batch_invariant=True,
    supported=SPARSE_BUILT
    or Unsupported("the vllm_c library predates gelu_and_mul_sparse: rebuild it (pip install -e providers/vllm_c)"),
)
def gelu_and_mul_sparse(x, std_multiplier, approximate="none"):
    check_approximate(approximate, f"gelu_and_mul_sparse (provider {PROVIDER})")
    return _run_gated("gelu_and_mul_sparse", x, float(std_multiplier), approximate)


def _elementwise(name: str) -> None:
    """One elementwise op: x -> a fresh tensor with x's layout (dense) or contiguous."""
    kernel = _kernels[name]

    def impl(x):
        out = torch.empty_like(x)
        kernel(out, x)
        return out

    impl.__name__ = impl.__qualname__ = name
    VLLM_C.register(name, impl, supports=elementwise_verdict, batch_invariant=True, exact=_exact(name))


for _name in ELEMENTWISE:
    _elementwise(_name)


def table_path() -> str | None:
    """How the CPU kernels read their 16-bit activation tables in this process, and why:
    ``"lookup: ..."`` / ``"computed: ..."`` (AVX512: fixed by CPU vendor, or ``VLLM_IR_C_TABLES``),
    ``"off: ..."`` (``VLLM_IR_C_TABLES=0``), ``"none: ..."`` (below AVX512 every element is
    computed). None without the extension. The bits are the same whichever it is."""
    if not STATUS.loaded or not hasattr(torch.ops.vllm_ir_c, "table_path"):
        return None
    return str(torch.ops.vllm_ir_c.table_path())
