"""vLLM itself as a client of vllm-ir providers: the ``vllm.general_plugins`` bridge, against real vLLM.

Every check runs in a separate virtual environment holding vLLM 0.33.0 (installed without its
dependencies, plus ``regex``, all that ``import vllm.ir`` and vLLM's plugin loader need): vLLM's
IR and vllm-ir cannot be checked inside the test process, whose torch library has no vLLM ops.

Two set-ups, one test body (`bridge_env`):
- default (in the suite): ``build/vllm-bridge/venv``, created once and reused by later runs. It
  holds vLLM and regex; a ``.pth`` adds this checkout's ``.venv`` (torch 2.13.0 CPU, vllm-ir and
  its providers, installed editable by scripts/setup.sh). vLLM's wheel (336 MB) is downloaded
  once into ``build/wheelhouse``.
- ``VLLM_IR_TEST_VLLM_WHEELS=1``: the issue's full form, a fresh venv with the pinned torch,
  vLLM, and our wheels built by scripts/build_wheels.sh (minutes; opt-in).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.plugin_dists import make_dist

REPO = Path(__file__).resolve().parents[1]
VLLM = "vllm==0.33.0"
TORCH = "torch==2.13.0"
BUILD = REPO / "build"
WHEELHOUSE = BUILD / "wheelhouse"
#: "1": the fresh venv from our wheels (rebuilt); "reuse": the last one built, when there is one.
FULL = os.environ.get("VLLM_IR_TEST_VLLM_WHEELS") in ("1", "reuse")
CPU_PROVIDERS = ("vllm_ir_aten", "vllm_ir_inductor", "vllm_ir_vllm_c")


def sh(
    *cmd: object, env: dict | None = None, check: bool = True, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    # The suite's own settings (autoload off, Triton's interpreter) must not leak into vLLM's process.
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "TRITON_", "PYTHON"))}
    result = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, env={**clean, **(env or {})}, cwd=cwd or BUILD
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, cmd))} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result


def _wheelhouse(py: Path) -> None:
    wanted = ("vllm-0.33.0-", "regex-")
    if not all(any(w.name.startswith(p) for w in WHEELHOUSE.glob("*.whl")) for p in wanted):
        sh(py, "-m", "pip", "download", "-q", "--no-deps", "-d", WHEELHOUSE, VLLM, "regex")


def _pip_install(py: Path, *what: str) -> None:
    sh(py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--find-links", WHEELHOUSE, *what)


def _fast_env() -> Path:
    """build/vllm-bridge/venv: vLLM + regex, and this checkout's .venv through a .pth (cached)."""
    root = BUILD / "vllm-bridge"
    py = root / "venv" / "bin" / "python"
    stamp = root / "ready"
    dev_site = next((REPO / ".venv" / "lib").glob("python3.*/site-packages"))
    if stamp.exists() and stamp.read_text() == f"{VLLM} {dev_site}\n" and py.exists():
        return py
    sh(sys.executable, "-m", "venv", "--clear", root / "venv")
    _wheelhouse(py)
    _pip_install(py, VLLM, "regex")
    (site,) = (root / "venv" / "lib").glob("python3.*/site-packages")
    # addsitedir, not a plain path: .venv's editable installs are .pth files themselves.
    (site / "zz_vllm_ir_dev.pth").write_text(f"import site; site.addsitedir({str(dev_site)!r})\n")
    stamp.write_text(f"{VLLM} {dev_site}\n")
    return py


def _full_env() -> Path:
    """A fresh venv from our wheels, the pinned torch and vLLM, as tests/test_wheels.py builds one."""
    root = BUILD / "vllm-bridge-wheels"
    wheels = root / "wheels"
    py = root / "venv" / "bin" / "python"
    if os.environ.get("VLLM_IR_TEST_VLLM_WHEELS") == "reuse" and (root / "ready").exists():
        return py
    sh("rm", "-rf", root)
    sh("bash", REPO / "scripts" / "build_wheels.sh", wheels, env={"PYTHON": sys.executable})
    sh(sys.executable, "-m", "venv", root / "venv")
    sh(py, "-m", "pip", "install", "-q", TORCH)
    _wheelhouse(py)
    deps = root / "deps"
    sh(py, "-m", "pip", "download", "-q", "-d", deps, "pluggy>=1.5", "packaging>=23")
    links = ["--find-links", wheels, "--find-links", deps, "--find-links", WHEELHOUSE]
    # Every provider but triton (its 286 MB dependency adds nothing here: it is unsupported on CPU).
    providers = ("native", "vllm-c", "aiter", "xpu-kernels", "oink", "flashinfer")
    ours = ["vllm-ir", *(f"vllm-ir-provider-{p}" for p in providers)]
    sh(py, "-m", "pip", "install", "-q", "--no-index", *links, *ours, "regex")
    _pip_install(py, VLLM)  # last: pip would otherwise report its deliberately missing requirements
    (root / "ready").write_text(VLLM + "\n")
    return py


@pytest.fixture(scope="session")
def bridge_python() -> Path:
    BUILD.mkdir(exist_ok=True)
    return _full_env() if FULL else _fast_env()


def run_script(py: Path, source: str, env: dict | None = None) -> dict:
    """Run ``source`` under vLLM's plugin loader in the bridge venv; it prints one JSON line last."""
    out = sh(py, "-c", textwrap.dedent(PRELUDE) + textwrap.dedent(source), env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


# Every script: vLLM's IR, recorders around our kernels, then vLLM's own plugin loader.
PRELUDE = """
import json, logging, sys
import torch
import vllm, vllm.ir
from vllm.ir.op import IrOp

logs = []
class Keep(logging.Handler):
    def emit(self, record):
        logs.append((record.name, record.levelname, record.getMessage()))
bridge_log = logging.getLogger("vllm.vllm_ir_bridge")
bridge_log.addHandler(Keep()); bridge_log.setLevel(logging.DEBUG)

def as_tuple(v):
    return v if isinstance(v, tuple) else (v,)

CALLS = []
def record_kernels():
    import vllm_ir
    vllm_ir.load_providers()
    for op in vllm_ir.ops:
        for name, impl in op.impls.items():
            for attr in ("fn", "inplace_fn"):
                kernel = getattr(impl, attr)
                if name != "native" and kernel is not None:
                    def rec(*a, _k=kernel, _tag=(op.name, name, attr)):
                        CALLS.append(_tag)
                        return _k(*a)
                    setattr(impl, attr, rec)
"""


MAIN = """
record_kernels()
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm_ir.integrations import vllm as vllm_bridge
from vllm_ir.ir import torch_library
out = {"state": vllm_bridge.state.to_json(), "namespace": torch_library.NAMESPACE, "cases": [], "impls": {}}
# The bridge only registers: vLLM's priorities are untouched until vLLM's config sets them.
out["priority_after_load"] = {n: o.get_priority() for n, o in IrOp.registry.items()}
# Same semantics where bridged: vLLM's native function and ours agree bit for bit.
import vllm_ir
same = []
for name in ("rms_norm", "fused_add_rms_norm"):
    op = IrOp.registry[name]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        torch.manual_seed(1)
        args = op.generate_inputs(num_tokens=9, hidden_size=80, dtype=dtype)
        w = args[-2]
        # weight of x's dtype, none, variance_size, an fp32 weight, a bf16 weight (vLLM applies
        # the weight in its own dtype and returns x's)
        for variant in (args, args[:-2] + (None, args[-1]), args + (40,), args[:-2] + (w.float(), args[-1]),
                        args[:-2] + (w.bfloat16(), args[-1])):
            a, b = op.impls["native"].impl_fn(*variant), getattr(vllm_ir.ops, name).fn(*variant)
            same.append(all(torch.equal(u, v) for u, v in zip(as_tuple(a), as_tuple(b))))
out["natives_equal"] = same
# vllm-ir's own ops keep working beside vLLM's, from their own torch namespace.
x, w, eps = IrOp.registry["rms_norm"].generate_inputs(num_tokens=3, hidden_size=64, dtype=torch.float32)
with vllm_ir.priority(rms_norm=["vllm_c"]):
    ours = [vllm_ir.ops.rms_norm.dispatch(x, w, eps).provider,
            torch.allclose(vllm_ir.ops.rms_norm(x, w, eps), torch.ops.vllm_ir_core.rms_norm(x, w, eps), atol=1e-6)]
with IrOp.registry["rms_norm"].set_priority(["native"]):  # vLLM's op, in vLLM's namespace
    out["ours"] = ours + [torch.equal(torch.ops.vllm_ir.rms_norm(x, w, eps), IrOp.registry["rms_norm"](x, w, eps))]
for name in ("rms_norm", "fused_add_rms_norm"):
    op = IrOp.registry[name]
    out["impls"][name] = {p: [i.supported, i.inplace] for p, i in op.impls.items()}
for name in ("rms_norm", "fused_add_rms_norm"):
    op = IrOp.registry[name]
    native = op.impls["native"].impl_fn
    for provider in CPU_PROVIDERS:
        for dtype, weight_dtype in ((torch.float32, None), (torch.bfloat16, None), (torch.float16, None),
                                    (torch.bfloat16, torch.float32), (torch.float16, torch.float32)):
            for tokens, hidden in ((1, 64), (7, 96)):
                if provider == "vllm_ir_inductor" and (dtype == torch.float16 or tokens == 1):
                    continue  # each is one more Inductor compile (seconds); fp32/bf16 cover it
                torch.manual_seed(0)
                args = op.generate_inputs(num_tokens=tokens, hidden_size=hidden, dtype=dtype)
                if weight_dtype is not None:  # the Hugging Face case: 16-bit x, fp32 weight
                    args = args[:-2] + (args[-2].to(weight_dtype), args[-1])
                want = native(*args)
                del CALLS[:]
                with op.set_priority([provider, "native"]):
                    chosen = op.dispatch(*args).provider
                    got = op(*args)
                tol = op.get_tolerance(dtype)
                ok = True
                for g, w in zip(as_tuple(got), as_tuple(want)):
                    ok = ok and g.dtype == w.dtype and torch.allclose(g.float(), w.float(), **tol)
                out["cases"].append([name, provider, f"{dtype}/{weight_dtype}", tokens, chosen, ok,
                                     [list(c) for c in CALLS]])
# vLLM's donating overload runs the in-place kernel on the donated tensors.
op = IrOp.registry["fused_add_rms_norm"]
x, r, w, eps = op.generate_inputs(num_tokens=3, hidden_size=64, dtype=torch.float32)
want = op.impls["native"].impl_fn(x, r, w, eps)
with op.set_priority(["vllm_ir_vllm_c", "native"]):
    y, res = op.maybe_inplace(x, r, w, eps)
out["inplace"] = [y.data_ptr() == x.data_ptr(), res.data_ptr() == r.data_ptr(),
                  torch.allclose(y, want[0], **op.get_tolerance(torch.float32))]
# Mixed weight dtype: the same semantics as vLLM's, so every CPU provider takes it.
op = IrOp.registry["rms_norm"]
x, w, eps = op.generate_inputs(num_tokens=2, hidden_size=64, dtype=torch.bfloat16)
out["mixed"] = []
for provider in CPU_PROVIDERS:
    with op.set_priority([provider, "native"]):
        out["mixed"].append(op.dispatch(x, w.float(), eps).provider)
with op.set_priority(["vllm_ir_aiter", "native"]):  # unsupported here: dropped by vLLM's own filter
    out["unsupported_priority"] = op.get_priority()
out["records"] = {r.name: [r.status.value, r.reason] for r in vllm_ir.provider_records()}
out["logs"] = logs
print(json.dumps(out))
"""


@pytest.mark.subprocess
def test_vllm_plugin_loader_activates_the_bridge_and_our_kernels_match_vllm_native(bridge_python, tmp_path):
    # A broken vllm-ir provider installed beside the good ones: vLLM and the bridge carry on.
    make_dist(tmp_path, "broken-kernels", "raise ImportError('libbroken.so: cannot open shared object file')\n",
              entry="broken")  # fmt: skip
    out = run_script(bridge_python, f"CPU_PROVIDERS = {CPU_PROVIDERS!r}\n" + MAIN, env={"PYTHONPATH": str(tmp_path)})
    state = out["state"]
    assert state["status"] == "active" and state["vllm_version"] == "0.33.0", state
    # vLLM's IR owns the vllm_ir torch namespace; ours moved aside so both live in one process.
    assert out["namespace"] == "vllm_ir_core"
    for name in ("rms_norm", "fused_add_rms_norm"):
        assert set(CPU_PROVIDERS) <= set(state["registered"][name]), state
        impls = out["impls"][name]
        assert all(impls[p][0] for p in CPU_PROVIDERS), impls  # supported here
        assert impls["vllm_ir_aiter"][0] is False and impls["vllm_ir_xpu_kernels"][0] is False  # registered, off
    # vllm_c registers both forms of fused_add_rms_norm: vLLM gets the in-place one, flagged so.
    assert out["impls"]["fused_add_rms_norm"]["vllm_ir_vllm_c"][1] is True
    assert out["impls"]["rms_norm"]["vllm_ir_vllm_c"][1] is False
    assert "gelu_and_mul_sparse" not in state["skipped"]  # bridged: tested by test_vllm_gelu_and_mul_sparse_*
    assert out["priority_after_load"] == {"rms_norm": [], "fused_add_rms_norm": [], "gelu_and_mul_sparse": []}
    assert out["natives_equal"] == [True] * 30
    assert out["ours"] == ["vllm_c", True, True]
    # aten and vllm_c: 5 dtype/weight pairs x 2 shapes; inductor: 3 pairs x 1 shape; two ops
    assert len(out["cases"]) == 2 * (2 * 5 * 2 + 3)
    for name, provider, dtype, tokens, chosen, ok, calls in out["cases"]:
        case = (name, provider, dtype, tokens)
        assert ok, case  # within vLLM's own tolerance for the dtype, output dtype equal
        ours = provider.removeprefix("vllm_ir_")
        if name == "fused_add_rms_norm" and ours == "aten" and not dtype.startswith("torch.float32"):
            assert chosen == "native" and not calls, case  # aten declines 16-bit x (its fp32 sum is not in place)
            continue
        assert chosen == provider, case
        assert calls and all(c[0] == name and c[1] == ours for c in calls), (case, calls)
        if name == "fused_add_rms_norm" and ours == "vllm_c":
            assert calls == [[name, ours, "inplace_fn"]], calls  # functional call: vLLM cloned, then in place
    assert out["inplace"] == [True, True, True]
    assert out["mixed"] == list(CPU_PROVIDERS)  # bf16 x with an fp32 weight: no decline
    declined = [msg for _, level, msg in out["logs"] if level == "DEBUG" and "declines" in msg]
    assert not [m for m in declined if "weight dtype" in m], declined
    assert out["unsupported_priority"] == ["native"]
    assert any("not supported here" in msg for _, level, msg in out["logs"] if level == "DEBUG")
    broken = out["records"]["broken"]
    assert broken[0] == "failed" and "libbroken.so" in broken[1], broken
    assert any(level == "WARNING" and "'broken' not bridged" in msg for _, level, msg in out["logs"])


SPARSE = """
record_kernels()
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm_ir.integrations import vllm as vllm_bridge
import vllm_ir
op = IrOp.registry["gelu_and_mul_sparse"]
native = op.impls["native"].impl_fn
out = {"registered": vllm_bridge.state.registered.get("gelu_and_mul_sparse"), "natives_equal": [], "cases": []}
# vLLM's generator (tanh; Gemma 3n's multiplier), the erf form, another sparsity, a 3-D batch,
# an odd width and a row slice of a wider buffer.
def calls():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for tokens, hidden in ((1, 64), (9, 80), (5, 199)):
            torch.manual_seed(tokens)
            x, m, approximate = op.generate_inputs(num_tokens=tokens, hidden_size=hidden, dtype=dtype)
            yield x, m, approximate
            yield x, m, "none"
            yield x, 0.6744897501960817, approximate
        yield x.reshape(5, 1, -1), m, approximate
        yield torch.randn(4, 3 * 160, dtype=dtype)[:, :320], m, "none"
for args in calls():
    out["natives_equal"].append(torch.equal(native(*args), vllm_ir.ops.gelu_and_mul_sparse.fn(*args)))
for provider in ("vllm_ir_vllm_c",):
    for args in calls():
        want = native(*args)
        del CALLS[:]
        with op.set_priority([provider, "native"]):
            chosen = op.dispatch(*args).provider
            got = op(*args)
        both_nan = got.isnan() & want.isnan()
        exact = torch.equal(got[~both_nan], want[~both_nan])
        close = got.dtype == want.dtype and torch.allclose(got.float(), want.float(), **op.get_tolerance(want.dtype))
        out["cases"].append([provider, str(args[0].dtype), list(args[0].shape), args[2], chosen, exact, close,
                             [list(c) for c in CALLS]])
print(json.dumps(out))
"""


@pytest.mark.subprocess
def test_vllm_gelu_and_mul_sparse_runs_our_providers_with_vllm_native_semantics(bridge_python):
    """vLLM 0.33's third IR op: our declaration is vLLM's native function bit for bit, and
    ``vllm.ir.ops.gelu_and_mul_sparse`` with a bridged provider first runs our kernel (16-bit:
    native's bits; fp32: within vLLM's tolerance)."""
    out = run_script(bridge_python, SPARSE)
    assert {"vllm_ir_vllm_c", "vllm_ir_triton"} <= set(out["registered"]), out["registered"]
    assert out["natives_equal"] == [True] * 33
    assert len(out["cases"]) == 33
    for provider, dtype, shape, approximate, chosen, exact, close, calls in out["cases"]:
        case = (provider, dtype, shape, approximate)
        assert chosen == provider, case
        assert calls == [["gelu_and_mul_sparse", "vllm_c", "fn"]], (case, calls)
        assert close, case
        if dtype != "torch.float32":
            assert exact, case


COMPILE = """
record_kernels()
from vllm.plugins import load_general_plugins
load_general_plugins()
import torch._inductor.config as inductor_config
from torch import fx
from torch._inductor.pattern_matcher import CallFunctionVarArgs, PatternMatcherPass, register_graph_pattern
from torch._inductor.custom_graph_pass import CustomGraphPass

op = IrOp.registry["rms_norm"]
lowered = []

class Lowering(CustomGraphPass):
    # vLLM's VllmIRLoweringPass, step for step: match every vllm_ir node, dispatch on its fake
    # values, trace the chosen implementation's func_impl_fn in (vLLM's own pass needs VllmConfig,
    # i.e. pydantic, transformers and the rest of vLLM's dependencies).
    def __init__(self):
        self.patterns = PatternMatcherPass()
        register_graph_pattern(CallFunctionVarArgs([o.torch_op for o in IrOp.registry.values()]),
                               pass_dict=self.patterns)(self.lower)
    def lower(self, match, *args, **kwargs):
        node = match.nodes[0]
        ir_op = IrOp.registry[node.target._opname]
        impl = ir_op.dispatch(*fx.map_arg(node.args, lambda a: a.meta["val"]))
        lowered.append(impl.provider)
        bound = ir_op._py_signature.bind(*node.args)
        bound.apply_defaults()
        match.replace_by_example(impl.func_impl_fn, bound.args, run_functional_passes=False)
    def __call__(self, graph):
        self.patterns.apply(graph)
    def uuid(self):
        return None

def f(x, w):
    return vllm.ir.ops.rms_norm(x * 2, w, 1e-5) + 1

torch.manual_seed(0)
x, w, eps = op.generate_inputs(num_tokens=5, hidden_size=64, dtype=torch.float32)
with op.set_priority(["native"]):
    want = f(x, w)
out = {}
for provider, mode in [("vllm_ir_vllm_c", "opaque")] + [(p, "lowered") for p in CPU_PROVIDERS]:
    torch._dynamo.reset()
    del CALLS[:], lowered[:]
    options = {"post_grad_custom_post_pass": Lowering()} if mode == "lowered" else {}
    with op.set_priority([provider, "native"]), inductor_config.patch(**options):
        got = torch.compile(f, backend="inductor", fullgraph=True)(x, w)
    out[f"{provider}/{mode}"] = [torch.allclose(got, want, **op.get_tolerance(torch.float32)),
                                 sorted({c[1] for c in CALLS}), lowered[:]]
print(json.dumps(out))
"""


@pytest.mark.subprocess
def test_torch_compile_of_a_vllm_op_runs_our_kernel(bridge_python):
    out = run_script(bridge_python, f"CPU_PROVIDERS = {CPU_PROVIDERS!r}\n" + COMPILE, env={"CI": "1"})
    # Opaque: Inductor keeps vLLM's op and calls it, whose dispatch runs our kernel.
    assert out["vllm_ir_vllm_c/opaque"] == [True, ["vllm_c"], []], out
    # Lowered as vLLM lowers: our kernel traced into the graph at lowering time.
    assert out["vllm_ir_vllm_c/lowered"] == [True, ["vllm_c"], ["vllm_ir_vllm_c"]], out
    for provider in ("vllm_ir_aten", "vllm_ir_inductor"):  # inductor: its native code, as under any tracing
        assert out[f"{provider}/lowered"] == [True, [provider.removeprefix("vllm_ir_")], [provider]], out


VERSION = """
vllm.__version__ = "0.34.0"  # a release the bridge was not tested with
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm_ir.integrations import vllm as vllm_bridge
op = IrOp.registry["rms_norm"]
x, w, eps = op.generate_inputs(num_tokens=2, hidden_size=32, dtype=torch.float32)
op.set_default(["native"])
ok = torch.allclose(op(x, w, eps), op.impls["native"].impl_fn(x, w, eps))
print(json.dumps({"state": vllm_bridge.state.to_json(), "impls": sorted(op.impls), "ok": ok, "logs": logs}))
"""


@pytest.mark.subprocess
def test_untested_vllm_version_is_refused_whole(bridge_python):
    out = run_script(bridge_python, VERSION)
    assert out["state"]["status"] == "refused" and out["state"]["registered"] == {}
    assert "0.34.0" in out["state"]["reason"] and ">=0.33.0,<0.34" in out["state"]["reason"]
    assert out["impls"] == ["native"] and out["ok"]
    assert any(level == "WARNING" and "outside the range" in msg for _, level, msg in out["logs"])


@pytest.mark.subprocess
def test_cli_reports_the_bridge(bridge_python):
    listed = json.loads(sh(bridge_python, "-m", "vllm_ir", "providers", "list", "--json").stdout)["vllm_bridge"]
    assert listed["status"] == "ready" and listed["vllm_version"] == "0.33.0", listed
    assert "vllm_ir_vllm_c" in listed["registered"]["rms_norm"]


# Fast, in this process (no vLLM here): what providers list / doctor say in each situation.


def test_describe_without_vllm():
    from vllm_ir.integrations import vllm as vllm_bridge

    assert vllm_bridge.describe()["status"] == "vllm not installed"


@pytest.mark.parametrize(
    ("version", "plugins", "status"),
    [
        ("0.33.0", None, "ready"),
        ("0.33.2", "vllm_ir,other", "ready"),
        ("0.33.0", "lora_filesystem_resolver", "disabled by VLLM_PLUGINS"),
        ("0.34.0", None, "refused"),
        ("0.32.1", None, "refused"),
    ],
)
def test_describe_with_vllm(monkeypatch, version, plugins, status):
    from vllm_ir.integrations import vllm as vllm_bridge
    from vllm_ir.tools import cli

    monkeypatch.setattr(vllm_bridge.metadata, "version", lambda name: version)
    if plugins is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", plugins)
    described = vllm_bridge.describe()
    assert described["status"] == status and described["vllm_version"] == version
    text = cli._describe_bridge(described)
    assert text.startswith(f"vLLM bridge: {status} (vLLM {version}; tested vllm>=0.33.0,<0.34)"), text
    if status == "refused":
        assert f"vLLM {version} is outside the range" in described["reason"] and not described["registered"]
        problems = cli._doctor_report()["problems"]
        assert any(p["setting"] == "vllm_bridge" and version in p["fix"] for p in problems), problems


def test_bridged_names_are_valid_vllm_provider_names():
    import re

    import vllm_ir
    from vllm_ir.integrations import vllm as vllm_bridge

    vllm_ir.load_provider("vllm_c")
    names = vllm_bridge.planned()["rms_norm"]
    assert "vllm_ir_vllm_c" in names
    assert all(re.fullmatch(r"[a-z_][a-z0-9_]*", n) for n in names)


@pytest.mark.parametrize(
    ("files", "namespace"),
    [({"vllm/ir/op.py", "vllm/__init__.py"}, "vllm_ir_core"), ({"vllm/__init__.py"}, "vllm_ir"), (set(), "vllm_ir")],
)
def test_torch_namespace_moves_aside_only_where_vllm_ir_is_installed(tmp_path, monkeypatch, files, namespace):
    from vllm_ir.ir import torch_library

    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert torch_library.choose_namespace() == namespace
    assert "vllm" not in sys.modules  # found, not imported
