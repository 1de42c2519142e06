"""Every shared op against vLLM 0.33.0's own reference code, as a vLLM user would check it.

vLLM cannot be imported into the suite's process (its ``vllm_ir`` torch library and ours
collide, and its dependencies are not installed), so one child process in the bridge test's
venv (``build/vllm-bridge/venv``: vLLM 0.33.0 without dependencies, this checkout's ``.venv``
through a ``.pth``; see tests/test_vllm_bridge.py) runs the whole comparison and prints one
JSON line. Where vLLM cannot be installed (no wheel, no index), the tests skip with the reason.

vLLM's references, all importable on CPU without vLLM's dependencies:

- ``vllm.ir.ops``: ``rms_norm``, ``fused_add_rms_norm``, ``gelu_and_mul_sparse`` (native);
- ``vllm.model_executor.layers.activation``: the activations' ``forward_native``;
- ``QuantFP8.forward_native`` (``input_quant_fp8``): static, dynamic and group FP8 quant, and
  the fused norm/SwiGLU + quant ops as vLLM's unfused pair (its norm, then its QuantFP8);
- ``RotaryEmbedding.forward_static`` (``rotary_embedding.base``) for ``rotary_embedding``.

Each op runs on our native and every CPU provider that implements it (``aten``, ``inductor``,
``vllm_c``; not ``triton``: its interpreter is too slow) over dtypes x weight dtypes x odd
hidden sizes x non-contiguous inputs x special values. vLLM's float8_e4m3fnuz bound (224) is
ROCm's: on CPU its QuantFP8 quantizes to e4m3fn only, so only e4m3fn is compared. The
collectives (``all_reduce_*``) have no vLLM function to compare with on one CPU process.

Ops vLLM declares (its IR ops) must show no difference on any provider; the others either show
none or their difference is listed in `DOCUMENTED` (per op and provider: the dtypes and
outputs it may touch, and why). None of those is one of vLLM's IR ops, the only ops the bridge
(core/integrations/vllm.py) routes to our providers: vLLM's own layers keep computing them.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from tests.test_vllm_bridge import BUILD, sh

VLLM_IR_OPS = ("rms_norm", "fused_add_rms_norm", "gelu_and_mul_sparse")
CPU_PROVIDERS = ("native", "aten", "inductor", "vllm_c")
GROUP_QUANT_RECIPROCAL = (
    "vLLM's native group quant divides by the scale (x / s); vllm-ir multiplies by its reciprocal, as vLLM's "
    "static and per-token native and every vllm-ir kernel do (the vllm_c table path is built on the reciprocal): "
    "one fp8 step on 0.052% of bf16 codes, 0.006% of fp16, none of fp32 ([512, 4096] N(0, 1), groups of 128); "
    "the conformance kit's dequantized comparison allows 0.2%. UE8M0 scales are powers of two: no difference."
)
NOT_A_VLLM_IR_OP = " Not one of vLLM's IR ops: vLLM's layer calls its own function and the bridge never routes it here."


class Documented(NamedTuple):
    """A difference from vLLM's function that is vllm-ir's declared semantics or an open item."""

    dtypes: tuple[str, ...]  # the dtypes (as labelled: float32, bfloat16, float16) it may differ in
    outputs: tuple[int, ...]  # the outputs that may differ (the others must match)
    reason: str
    #: The ATen CPU capabilities (torch.backends.cpu.get_cpu_capability()) where the difference is
    #: known to show, for one that comes from ATen's vector math; empty: on every capability.
    capabilities: tuple[str, ...] = ()


#: (op, provider) -> where and why its output may differ from vLLM's function (none of vLLM's IR
#: ops may be here). The test below checks every entry still differs somewhere (the comparison's
#: inputs are seeded).
DOCUMENTED: dict[tuple[str, str], Documented] = {
    **{
        (op, p): Documented(("bfloat16", "float16"), (0,), GROUP_QUANT_RECIPROCAL)
        for op in ("dynamic_group_quant_fp8", "rms_norm_group_fp8_quant")  # silu_and_mul_group: none in this grid
        for p in ("native", "vllm_c")
    },
    **{
        ("quick_gelu", p): Documented(
            ("bfloat16", "float16"),
            (0,),
            "vllm-ir's quick_gelu is x * sigmoid(1.702 x) in fp32, rounded once to x's dtype; vLLM's forward_native "
            "rounds 1.702 x, the sigmoid and the product to x's dtype one after another (one 16-bit step on "
            "about a third of the elements; fp32 identical)." + NOT_A_VLLM_IR_OP,
        )
        for p in ("native", "vllm_c")
    },
    **{
        (op, p): Documented(
            ("float32",),
            (0,),
            "fp32: vLLM's expression op by op; aten runs F.gelu(approximate='tanh') for both (its one fused "
            "formula) and vllm_c its own fp32 vector form: a few fp32 ulp (at most 4.8e-7 here); "
            "16-bit results are vLLM's bits (tests/test_provider_vllm_c.py checks every 16-bit value)."
            + NOT_A_VLLM_IR_OP,
        )
        for op in ("gelu_new", "gelu_fast")
        for p in ("aten", "vllm_c")
    },
    ("swigluoai_and_mul", "vllm_c"): Documented(
        ("float32",),
        (0,),
        "open: fp32 rows of 17 interleaved pairs, where ATen's strided loops take their scalar exp and the "
        "interleaved kernel its vector one: 1 fp32 ulp on 2-3 of 85 elements; every other width and dtype "
        "matches. AVX-512 only: with AVX2's vector exp (a CI machine without AVX-512) every element matches."
        + NOT_A_VLLM_IR_OP,
        capabilities=("AVX512",),
    ),
}
#: (op, input variant) -> why vllm-ir computes a call vLLM's function refuses.
EXTENSIONS: dict[tuple[str, str], str] = {
    ("dynamic_quant_fp8", "per_tensor_scale_ub"): "vLLM's QuantFP8 takes scale_ub with per-token scales only "
    "(it asserts); vllm-ir bounds the per-tensor absmax by it too",
}
#: Inductor's compiled kernels persist here: the comparison's few Inductor cases compile once per checkout.
CHILD_ENV = {"TORCHINDUCTOR_CACHE_DIR": str(BUILD / "vllm-reference-inductor-cache")}

CHILD = r'''
import json, math, sys, time, traceback, types
import torch
import torch.nn.functional as F

out = {"unavailable": {}, "results": [], "errors": [], "seconds": 0.0, "provider_seconds": {}}
t_start = time.perf_counter()
import ast, os
import vllm, vllm.ir
from vllm.ir.op import IrOp
from typing import ClassVar, NamedTuple

import vllm_ir
vllm_ir.load_providers()
torch.manual_seed(0)  # the same inputs every run: a documented difference that vanishes is seen
E4M3 = torch.float8_e4m3fn
ns = types.SimpleNamespace
SITE = os.path.dirname(vllm.__file__)

def from_vllm_source(relpath, wanted, g):
    """Execute, from vLLM's installed ``relpath``, the top-level definitions and assignments
    named in ``wanted`` and the methods ``Class.method`` in it (decorators dropped: they are
    called with an explicit self) in namespace ``g``; methods land in g as ``Class.method``.
    The module itself cannot be imported: its package imports need vLLM's dependencies."""
    path = os.path.join(SITE, relpath)
    source = open(path).read()
    tree = ast.parse(source, path)
    missing = set(wanted)
    for node in tree.body:
        nodes = []
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in wanted:
            nodes, key = [node], node.name
        elif isinstance(node, (ast.Assign, ast.Expr)):
            text = ast.get_source_segment(source, node) or ""
            key = max((w for w in wanted if text.startswith(w + " ")), key=len, default=None)
            nodes = [node] if key else []
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                key = f"{node.name}.{item.name}" if isinstance(item, ast.FunctionDef) else None
                if key in wanted:
                    item.decorator_list = []
                    exec(compile(ast.fix_missing_locations(ast.Module([item], [])), path, "exec"), g)
                    g[key] = g.pop(item.name)
                    missing.discard(key)
            continue
        for n in nodes:
            exec(compile(ast.fix_missing_locations(ast.Module([n], [])), path, "exec"), g)
            missing.discard(key)
    if missing:
        raise LookupError(f"{relpath}: not found: {sorted(missing)}")
    return g

vref = {}
def vir(name):
    return IrOp.registry[name].impls["native"].impl_fn
vref["rms_norm"] = vir("rms_norm")
vref["fused_add_rms_norm"] = vir("fused_add_rms_norm")
vref["gelu_and_mul_sparse"] = vir("gelu_and_mul_sparse")

try:
    A = from_vllm_source("model_executor/layers/activation.py", [
        "SiluAndMul.forward_native", "MulAndSilu.forward_native", "GeluAndMul.forward_native",
        "FatreluAndMul.forward_native", "SwigluOAIAndMul.forward_native", "NewGELU.forward_native",
        "FastGELU.forward_native", "QuickGELU.forward_native", "ReLUSquaredActivation.forward_native"],
        {"torch": torch, "F": F, "math": math, "current_platform": ns(is_rocm=lambda: False)})
    vref["silu_and_mul"] = lambda x: A["SiluAndMul.forward_native"](x)  # a staticmethod
    vref["mul_and_silu"] = lambda x: A["MulAndSilu.forward_native"](None, x)
    vref["gelu_and_mul"] = lambda x, approximate="none": A["GeluAndMul.forward_native"](ns(approximate=approximate), x)
    vref["fatrelu_and_mul"] = lambda x, threshold=0.0: A["FatreluAndMul.forward_native"](ns(threshold=threshold), x)
    vref["swigluoai_and_mul"] = lambda x, alpha=1.702, limit=7.0: A["SwigluOAIAndMul.forward_native"](
        ns(alpha=alpha, limit=limit), x)
    vref["gelu_new"] = lambda x: A["NewGELU.forward_native"](None, x)
    vref["gelu_fast"] = lambda x: A["FastGELU.forward_native"](None, x)
    vref["quick_gelu"] = lambda x: A["QuickGELU.forward_native"](None, x)
    vref["relu2"] = lambda x: A["ReLUSquaredActivation.forward_native"](None, x)
except Exception as exc:
    out["unavailable"]["activation"] = f"{type(exc).__name__}: {exc}"

try:
    finfo = torch.finfo(E4M3)  # vLLM's get_fp8_min_max() off ROCm; fp8_dtype() is e4m3fn
    Q = from_vllm_source("model_executor/layers/quantization/utils/quant_utils.py", [
        "_GroupShape", "GroupShape", "GroupShape.PER_TENSOR", "GroupShape.PER_TOKEN", "GroupShape.PER_CHANNEL",
        "group_broadcast", "prep_scale_for_group_broadcast", "_normalize_quant_group_shape"],
        {"torch": torch, "ClassVar": ClassVar, "NamedTuple": NamedTuple})
    Q.update(torch=torch, F=F, _FP8_DTYPE=E4M3, _FP8_MIN=finfo.min, _FP8_MAX=finfo.max)
    from_vllm_source("model_executor/layers/quantization/input_quant_fp8.py", [
        "_FP8_MIN_SCALING_FACTOR", "QuantFP8.forward_native", "QuantFP8._quantize_group_native"], Q)
    GroupShape = Q["GroupShape"]

    def quant_fp8(static, group_shape, x, scale=None, scale_ub=None, num_token_padding=None,
                  group_size=None, column_major=False, use_ue8m0=False):
        """vLLM's QuantFP8(static, group_shape, ...).forward_native(x, scale, scale_ub)."""
        self = ns(static=static, group_shape=group_shape, is_group_quant=group_size is not None,
                  group_size=group_size, num_token_padding=num_token_padding,
                  column_major_scales=column_major, use_ue8m0=use_ue8m0)
        self._quantize_group_native = lambda x: Q["QuantFP8._quantize_group_native"](self, x)
        return Q["QuantFP8.forward_native"](self, x, scale, scale_ub)

    def static_shape(scale):
        if scale.numel() == 1:
            return GroupShape.PER_TENSOR
        return GroupShape.PER_TOKEN if scale.shape[-1] == 1 else GroupShape.PER_CHANNEL

    def v_static(x, scale, fp8_dtype, num_token_padding=None):
        return quant_fp8(True, static_shape(scale), x, scale, num_token_padding=num_token_padding)[0]

    def v_dynamic(x, per_token, fp8_dtype, scale_ub=None, num_token_padding=None):
        shape = GroupShape.PER_TOKEN if per_token else GroupShape.PER_TENSOR
        return quant_fp8(False, shape, x, None, scale_ub, num_token_padding)

    def v_group(x, group_size, column_major, use_ue8m0, fp8_dtype):
        return quant_fp8(False, GroupShape(1, group_size), x, group_size=group_size, column_major=column_major,
                         use_ue8m0=use_ue8m0)

    def v_norm(x, x_residual, weight, epsilon):
        if x_residual is None:
            return vref["rms_norm"](x, weight, epsilon), None
        return vref["fused_add_rms_norm"](x, x_residual, weight, epsilon)

    def v_fused_static(x, r, w, eps, s, f):
        y, res = vref["fused_add_rms_norm"](x, r, w, eps)
        return v_static(y, s, f), res

    def v_norm_dynamic(x, r, w, eps, f, ub=None):
        y, res = v_norm(x, r, w, eps)
        return (*v_dynamic(y, True, f, ub), res)

    def v_norm_group(x, r, w, eps, g, cm, ue, f):
        y, res = v_norm(x, r, w, eps)
        return (*v_group(y, g, cm, ue, f), res)

    vref["static_quant_fp8"] = v_static
    vref["dynamic_quant_fp8"] = v_dynamic
    vref["dynamic_group_quant_fp8"] = v_group
    vref["rms_norm_static_fp8_quant"] = lambda x, w, eps, s, f: v_static(vref["rms_norm"](x, w, eps), s, f)
    vref["fused_add_rms_norm_static_fp8_quant"] = v_fused_static
    vref["rms_norm_dynamic_per_token_fp8_quant"] = v_norm_dynamic
    vref["rms_norm_group_fp8_quant"] = v_norm_group
    if "silu_and_mul" in vref:
        vref["silu_and_mul_static_fp8_quant"] = lambda x, s, f: v_static(vref["silu_and_mul"](x), s, f)
        vref["silu_and_mul_group_fp8_quant"] = lambda x, g, cm, ue, f: v_group(vref["silu_and_mul"](x), g, cm, ue, f)
except Exception as exc:
    out["unavailable"]["quant"] = f"{type(exc).__name__}: {exc}"

try:
    R = from_vllm_source("model_executor/layers/rotary_embedding/common.py", ["ApplyRotaryEmb.forward_static"],
                         {"torch": torch})
    B = from_vllm_source("model_executor/layers/rotary_embedding/base.py", ["RotaryEmbedding.forward_static"],
                         {"torch": torch, "ApplyRotaryEmb": ns(forward_static=R["ApplyRotaryEmb.forward_static"])})

    def v_rope(positions, query, key, head_size, cos_sin_cache, is_neox_style, rotary_dim=None):
        """RotaryEmbedding.forward_native: the cache in query's dtype (_match_cos_sin_cache_dtype)."""
        rot = cos_sin_cache.shape[-1] if rotary_dim is None else rotary_dim
        return B["RotaryEmbedding.forward_static"](positions, query, key, head_size, rot,
                                                   cos_sin_cache.to(query.dtype), is_neox_style)
    vref["rotary_embedding"] = v_rope
except Exception as exc:
    out["unavailable"]["rotary"] = f"{type(exc).__name__}: {exc}"

# -- inputs ------------------------------------------------------------------------------------
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SPECIAL = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-30, -3e-38, 6e4, -6e4, 1e-7])

def strided(x):
    """x's values in a view whose rows are not contiguous (every other column of a wider tensor)."""
    wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    wide[..., ::2] = x
    return wide[..., ::2]

def special(x):
    x = x.clone()
    flat = x.view(-1)
    flat[: min(flat.numel(), SPECIAL.numel())] = SPECIAL[: flat.numel()].to(x.dtype)
    return x

def variants(x):
    """(label, x) for the plain, the strided and the special-valued input."""
    return [("plain", x), ("strided", strided(x)), ("special", special(x))]

def gen(name, shape, dtype, **options):
    return getattr(vllm_ir.ops, name).generate_inputs(shape, dtype, "cpu", **options)

def cases(name):
    """(label, args) for op ``name``: dtypes x odd hidden sizes x its variants x layouts x values."""
    op = getattr(vllm_ir.ops, name)
    hidden_sizes = (17, 96) if name not in ("dynamic_group_quant_fp8", "rms_norm_group_fp8_quant",
                                            "silu_and_mul_group_fp8_quant") else (96, 80)
    options = [("default", {})] + list(op.input_variants.items())
    for dtype in DTYPES:
        for hidden in hidden_sizes:
            for variant, opts in options:
                if opts.get("fp8_dtype") not in (None, E4M3):
                    continue  # vLLM's CPU QuantFP8 quantizes to e4m3fn only
                shape = (5, hidden)
                if name == "rotary_embedding":
                    shape = (5, 64 if hidden == 96 else 128)
                try:
                    args = gen(name, shape, dtype, **opts)
                except Exception as exc:
                    out["errors"].append(f"{name} {variant} {dtype} {hidden}: generate_inputs: {exc}")
                    continue
                base = f"{str(dtype)[6:]}/{hidden}/{variant}"
                yield base, args
                # layouts and values of the activation (first tensor argument named x..., or query)
                idx = 1 if name == "rotary_embedding" else 0
                for label, x in variants(args[idx])[1:]:
                    new = list(args)
                    new[idx] = x
                    if name == "rotary_embedding" and label == "strided" and args[2] is not None:
                        new[2] = strided(args[2])
                    yield f"{base}/{label}", tuple(new)

def same_layout_copy(a):
    """A copy with a's exact strides (``clone`` makes a gapped view contiguous, and torch's CPU
    kernels may round differently on another layout)."""
    if not isinstance(a, torch.Tensor):
        return a
    return torch.empty_strided(a.size(), a.stride(), dtype=a.dtype).copy_(a)

def as_tuple(v):
    return v if isinstance(v, tuple) else (v,)

def differ(a, b):
    """(number of differing elements, max abs difference) of two outputs; fp8 by bytes."""
    if a is None or b is None:
        return (0 if a is None and b is None else -1), 0.0
    if a.shape != b.shape or a.dtype != b.dtype:
        return -1, float("inf")
    if a.element_size() == 1 and a.dtype != torch.uint8:
        # bytes, except that NaN is NaN whatever its sign bit (torch's max() and amax() differ there)
        d = (a.view(torch.uint8) != b.view(torch.uint8)) & ~(a.float().isnan() & b.float().isnan())
        n = int(d.sum())
        return n, (float((a.float() - b.float()).abs()[d].nan_to_num(0).max()) if n else 0.0)
    a64, b64 = a.double(), b.double()
    d = (a64 != b64) & ~(a64.isnan() & b64.isnan())
    n = int(d.sum())
    return n, (float((a64 - b64).abs()[d].nan_to_num(float("inf")).max()) if n else 0.0)

PROVIDERS = sys.argv[1].split(",")
INDUCTOR_OPS = ("rms_norm", "fused_add_rms_norm", "gelu_and_mul_sparse")
INDUCTOR_CASES = ("bfloat16/96/fp32_weight", "bfloat16/96/erf")
for op in vllm_ir.ops:
    name = op.name
    if name not in vref:
        continue
    impls = {p: op.impls[p] for p in PROVIDERS if p in op.impls and op.impls[p].is_supported}
    for label, args in cases(name):
        try:
            want = as_tuple(vref[name](*[same_layout_copy(a) for a in args]))
        except Exception as exc:
            want, verr = None, f"{type(exc).__name__}: {exc}"
        for provider, impl in impls.items():
            if provider == "inductor" and (name not in INDUCTOR_OPS or label not in INDUCTOR_CASES):
                continue  # every Inductor case is a compile (about a second): vLLM's IR ops, a few cases
            entry = [name, provider, label]
            verdict = True if impl.supports_args is None else impl.supports_args(*args)
            if not verdict:
                out["results"].append(entry + ["declined", getattr(verdict, "reason", "declined")])
                continue
            t0 = time.perf_counter()
            try:
                got = as_tuple(impl.fn(*[same_layout_copy(a) for a in args]))
            except Exception as exc:
                status = "both raise" if want is None else "raises"
                out["results"].append(entry + [status, f"{type(exc).__name__}: {str(exc)[:200]}"])
                continue
            out["provider_seconds"][provider] = out["provider_seconds"].get(provider, 0.0) + time.perf_counter() - t0
            if want is None:
                out["results"].append(entry + ["vllm raises", verr[:200]])
                continue
            x = args[1] if name == "rotary_embedding" else args[0]
            rows = x.shape[0] if x.dim() == 2 else None
            total, worst, where = 0, 0.0, []
            for i, (g, w) in enumerate(zip(got, want)):
                if rows is not None and g is not None and g.dim() == 2 and g.element_size() == 1 and g.shape[0] > rows:
                    g, w = g[:rows], w[:rows]  # padding rows are unspecified
                n, m = differ(g, w)
                if n:
                    total += n if n > 0 else 1
                    worst = max(worst, m)
                    where.append(i)
            out["results"].append(entry + ["ok" if total == 0 else "differs", [total, worst, where]])
out["seconds"] = time.perf_counter() - t_start
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def comparison() -> dict:
    from tests.test_vllm_bridge import _fast_env

    BUILD.mkdir(exist_ok=True)
    try:
        py = _fast_env()
    except AssertionError as exc:  # no wheel and no index: vLLM cannot be installed here
        pytest.skip(f"vllm==0.33.0 is not installable here: {str(exc).splitlines()[-1][:300]}")
    result = sh(py, "-c", textwrap.dedent(CHILD), ",".join(CPU_PROVIDERS), env=CHILD_ENV, check=False)
    if result.returncode != 0:
        raise AssertionError(f"the comparison process failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _report(rows: list) -> str:
    return "\n".join(f"  {op} on {p}, {label}: {status} {detail}" for op, p, label, status, detail in rows)


@pytest.mark.subprocess
def test_vllm_references_are_importable_without_vllms_dependencies(comparison):
    assert comparison["unavailable"] == {}, comparison["unavailable"]
    assert comparison["errors"] == [], comparison["errors"]


def test_the_ops_vllm_declares_compute_what_vllm_computes_on_every_cpu_provider(comparison):
    """Every call a provider takes gives vLLM's bits; a call it declines (a weight of a third dtype,
    a strided last dimension, variance_size: the reason is recorded) runs native there, which
    takes every call and must match everywhere."""
    rows = [r for r in comparison["results"] if r[0] in VLLM_IR_OPS]
    assert {r[0] for r in rows} == set(VLLM_IR_OPS)
    assert {r[1] for r in rows} == set(CPU_PROVIDERS), {r[1] for r in rows}
    bad = [r for r in rows if r[3] not in ("ok", "both raise", "declined") or (r[1] == "native" and r[3] != "ok")]
    assert not bad, f"{len(bad)} of {len(rows)} cases differ from vLLM 0.33.0:\n{_report(bad)}"
    ran = {(r[0], r[1]) for r in rows if r[3] == "ok"}  # every provider's kernels ran, not only declined
    assert {(r[0], r[1]) for r in rows} == ran, ran


@pytest.mark.subprocess
def test_every_other_shared_op_matches_vllm_or_documents_why(comparison):
    rows = [r for r in comparison["results"] if r[0] not in VLLM_IR_OPS]
    compared = {r[0] for r in rows}
    expected = {
        "silu_and_mul", "mul_and_silu", "gelu_and_mul", "fatrelu_and_mul", "swigluoai_and_mul", "gelu_new",
        "gelu_fast", "quick_gelu", "relu2", "static_quant_fp8", "dynamic_quant_fp8", "dynamic_group_quant_fp8",
        "rms_norm_static_fp8_quant", "fused_add_rms_norm_static_fp8_quant", "rms_norm_dynamic_per_token_fp8_quant",
        "rms_norm_group_fp8_quant", "silu_and_mul_static_fp8_quant", "silu_and_mul_group_fp8_quant",
        "rotary_embedding",
    }  # fmt: skip
    assert expected <= compared, expected - compared
    bad = [r for r in rows if r[3] not in ("ok", "both raise", "declined") and not _explained(r)]
    assert not bad, f"{len(bad)} of {len(rows)} cases differ from vLLM 0.33.0:\n{_report(bad)}"


def _explained(row: list) -> bool:
    op, provider, label, status, detail = row
    if status == "vllm raises":
        return any(op == o and f"/{variant}" in label for o, variant in EXTENSIONS)
    entry = DOCUMENTED.get((op, provider))
    return (
        status == "differs" and entry is not None and label.split("/")[0] in entry.dtypes
        and set(detail[2]) <= set(entry.outputs)
    )  # fmt: skip


def test_the_comparison_stays_fast(comparison):
    assert comparison["seconds"] < 50, comparison["seconds"]


def test_documented_differences_and_extensions_are_real(comparison):
    """An entry whose op now matches vLLM everywhere must go."""
    rows = comparison["results"]
    assert not {op for op, _ in DOCUMENTED} & set(VLLM_IR_OPS), "vLLM's IR ops must match, not be documented"
    capability = torch.backends.cpu.get_cpu_capability()
    for (op, provider), entry in DOCUMENTED.items():
        if entry.capabilities and capability not in entry.capabilities:
            continue  # allowed here, but not expected: ATen's vector math differs per capability
        assert any(r[0] == op and r[1] == provider and r[3] == "differs" for r in rows), (
            f"{op} on {provider} matches vLLM now: drop {entry.reason!r}"
        )
    for (op, variant), why in EXTENSIONS.items():
        assert any(r[0] == op and f"/{variant}" in r[2] and r[3] == "vllm raises" for r in rows), why


if __name__ == "__main__":  # a readable report: python -m tests.test_vllm_reference
    from tests.test_vllm_bridge import _fast_env

    py = _fast_env()
    res = sh(py, "-c", textwrap.dedent(CHILD), ",".join(CPU_PROVIDERS), env=CHILD_ENV, check=False)
    data = json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else None
    if data is None:
        print(res.stderr[-5000:])
    else:
        from collections import Counter

        print(f"{data['seconds']:.1f} s ({data['provider_seconds']})")
        print(f"unavailable: {data['unavailable']}; errors: {data['errors']}")
        summary = Counter((r[0], r[1], r[3]) for r in data["results"])
        for key in sorted(summary):
            print(*key, summary[key])
        for r in data["results"]:
            if r[3] not in ("ok", "declined", "both raise"):
                print("  ", *r)
    Path("/tmp/vllm_reference.json").write_text(json.dumps(data))
