"""Every distribution as a real wheel, installed the way users install it (not editable).

Builds all wheels with scripts/build_wheels.sh into a folder outside the repository, makes
a fresh virtual environment (torch 2.13.0 from local disk, no CUDA download), installs from
the wheel folder only, and checks discovery, eager dispatch, the conformance kit and
uninstalling. About two minutes on two cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"
DISTS = {
    "vllm-ir": "vllm_ir",
    "vllm-ir-provider-native": "vllm_ir_provider_native",
    "vllm-ir-provider-vllm-c": "vllm_ir_provider_vllm_c",
    "vllm-ir-provider-triton": "vllm_ir_provider_triton",
    "vllm-ir-provider-aiter": "vllm_ir_provider_aiter",
    "vllm-ir-provider-xpu-kernels": "vllm_ir_provider_xpu_kernels",
    "vllm-ir-provider-oink": "vllm_ir_provider_oink",
    "vllm-ir-provider-flashinfer": "vllm_ir_provider_flashinfer",
    "vllm-ir-example-oot-platform": "vllm_ir_oot_platform",
}


def sh(
    *cmd: str | Path, cwd: Path | None = None, env: dict | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_IR_", "TRITON_", "PYTHON"))}
    result = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, env={**clean, **(env or {})}
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, cmd))} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    # vllm_c's portable DEFAULT kernels only (no ISA variant): the variants are object files
    # inside the same library, so the wheel's contents and behaviour are the same with all four,
    # which take three times the build time (every variant is built and checked on the editable
    # build in tests/test_provider_vllm_c.py).
    sh(
        "bash",
        REPO / "scripts" / "build_wheels.sh",
        out,
        env={"PYTHON": sys.executable, "VLLM_IR_C_CPU_CAPABILITIES": ""},
    )
    return out


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheels) -> Path:
    root = tmp_path_factory.mktemp("fresh")
    env_dir = root / "venv"
    sh(sys.executable, "-m", "venv", env_dir)
    py = env_dir / "bin" / "python"
    # --no-compile throughout: pip byte-compiles every module it installs (torch's thousands), a
    # minute of CPU; an interpreter compiles what it imports on its own.
    sh(py, "-m", "pip", "install", "-q", "--no-compile", TORCH, "pytest", "hypothesis")
    deps = root / "deps"
    sh(py, "-m", "pip", "download", "-q", "-d", deps, "pluggy>=1.5", "packaging>=23", "triton")
    # The core is not named: installing a provider must pull it from the wheel folder.
    sh(py, "-m", "pip", "install", "-q", "--no-compile", "--no-index", "--find-links", wheels, "--find-links", deps,
       "vllm-ir-provider-native")  # fmt: skip
    assert "vllm-ir" in sh(py, "-m", "pip", "list").stdout
    others = [name for name in DISTS if name not in ("vllm-ir", "vllm-ir-provider-native")]
    sh(py, "-m", "pip", "install", "-q", "--no-compile", "--no-index", "--find-links", wheels, "--find-links", deps,
       *others)  # fmt: skip
    return env_dir


def test_wheels_hold_only_what_belongs(wheels):
    found = {w.name.split("-")[0]: w for w in wheels.glob("*.whl")}
    assert set(found) == {d.replace("-", "_") for d in DISTS}
    for dist, package in DISTS.items():
        names = zipfile.ZipFile(found[dist.replace("-", "_")]).namelist()
        payload = [n for n in names if ".dist-info/" not in n]
        assert payload and all(n.startswith(package + "/") for n in payload), (dist, payload)
        assert not any("/tests/" in n or "/build/" in n or n.endswith(".pyc") for n in names), dist
        assert any(n.endswith("entry_points.txt") for n in names), dist
        # Compiled parts: vllm_c's kernels and the core's eager lookup, both built for this torch.
        assert any(n.endswith(".so") for n in names) == (dist in ("vllm-ir", "vllm-ir-provider-vllm-c")), dist
    vllm_c = zipfile.ZipFile(found["vllm_ir_provider_vllm_c"]).namelist()
    assert any(n.startswith("vllm_ir_provider_vllm_c/tuning/") and n.endswith(".json") for n in vllm_c)  # tables
    core = zipfile.ZipFile(found["vllm_ir"])
    assert "vllm_ir/py.typed" in core.namelist()
    assert any(n.startswith("vllm_ir/ir/dispatch/_fast_lookup.") and n.endswith(".so") for n in core.namelist())
    meta = core.read(next(n for n in core.namelist() if n.endswith("METADATA"))).decode()
    assert "Requires-Python: >=3.10" in meta and "License-Expression: Apache-2.0" in meta
    entry_points = core.read(next(n for n in core.namelist() if n.endswith("entry_points.txt"))).decode()
    assert (
        "vllm-ir = vllm_ir.tools.cli:main" in entry_points and "vllm_ir = vllm_ir.testing.pytest_plugin" in entry_points
    )
    native = zipfile.ZipFile(found["vllm_ir_provider_native"])
    native_meta = native.read(next(n for n in native.namelist() if n.endswith("METADATA"))).decode()
    assert "Requires-Dist: vllm-ir<0.2,>=0.1" in native_meta


@pytest.mark.parametrize(("project", "sources_dir"), [(".", "core"), ("providers/vllm_c", "csrc")])
def test_sdists_carry_every_compiled_source(project, sources_dir, tmp_path):
    # setup.py names only the sources this machine builds (no CUDA here; none without torch):
    # MANIFEST.in must ship the rest, or a wheel built from the sdist silently lacks them.
    # From a clean copy: an egg-info left by an editable install would list the files itself.
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("*.egg-info", "build", "*.so", "__pycache__", ".*", "providers", "examples")
    shutil.copytree(REPO / project, source, ignore=ignore)
    sh(sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", tmp_path, source,
       env={"VLLM_IR_BUILD_EXTENSION": "0", "VLLM_IR_C_CUDA": "0"})  # fmt: skip
    (sdist,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        shipped = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    compiled = {".cpp", ".cu", ".h", ".cuh"}
    sources = {
        str(p.relative_to(REPO / project)) for p in (REPO / project / sources_dir).rglob("*") if p.suffix in compiled
    }
    assert sources and sources <= shipped, sorted(sources - shipped)


def test_installed_from_wheels_not_editable(venv):
    py = venv / "bin" / "python"
    where = sh(
        py, "-c", "import vllm_ir, vllm_ir_provider_native as n; print(vllm_ir.__file__); print(n.__file__)", cwd=venv
    )
    for path in where.stdout.split():
        assert path.startswith(str(venv)), path


def test_providers_list_and_eager_dispatch_per_provider(venv):
    cli = venv / "bin" / "vllm-ir"
    records = {r["name"]: r for r in json.loads(sh(cli, "providers", "list", "--json", cwd=venv).stdout)["providers"]}
    assert {n: r["status"] for n, r in records.items()} == {
        "aten": "loaded",
        "inductor": "loaded",
        "vllm_c": "loaded",
        "triton": "unsupported here",
        "aiter": "unsupported here",
        "xpu_kernels": "unsupported here",
        "oink": "unsupported here",
        "flashinfer": "unsupported here",
        "oot_example": "unsupported here",
    }
    lookup = json.loads(sh(cli, "doctor", "--json", cwd=venv).stdout)["eager_lookup"]
    assert lookup["compiled"], lookup["detail"]
    script = """
import torch, vllm_ir
for provider in ("aten", "inductor", "vllm_c"):
    for op in (op for op in vllm_ir.ops if provider in op.impls):
        args = op.generate_inputs((4, 256), torch.float32)
        with vllm_ir.priority(**{op.name: [provider]}):
            assert op.dispatch(*args).provider == provider
            got = op(*args)
        want = op.fn(*args)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
print("ok")
"""
    assert sh(venv / "bin" / "python", "-c", script, cwd=venv).stdout.strip() == "ok"


#: rms_norm, fused_add_rms_norm, silu_and_mul, static_quant_fp8 with all their variants (``-k``
#: matches substrings: the fused quant ops that contain these names are left out, not
#: static_quant_fp8's group_1x16 / group_2x32 scale variants).
ONE_OP_OF_EACH_KIND = (
    "(rms_norm or silu_and_mul or static_quant_fp8)"
    " and not (group_fp8 or group_quant or dynamic or rms_norm_static or silu_and_mul_static)"
)


def test_conformance_kit_from_the_installed_wheels(venv, tmp_path):
    empty = tmp_path  # run from a folder with no tests: the kit's suite is all that is collected
    # The kit's plugin, its suite and both providers' kernels from the wheels, on one op of each
    # kind (norm, in place, gated, quant); every op's kit runs on the editable install.
    result = sh(
        venv / "bin" / "python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
        "--vllm-ir-conformance", "--vllm-ir-provider", "aten", "--vllm-ir-provider", "vllm_c",
        "--vllm-ir-examples", "5", "-k", ONE_OP_OF_EACH_KIND,
        cwd=empty, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "vllm-ir conformance" in result.stdout and " passed" in result.stdout


def test_uninstalling_a_provider_removes_it(venv):
    sh(venv / "bin" / "python", "-m", "pip", "uninstall", "-y", "-q", "vllm-ir-provider-aiter")
    listed = json.loads(sh(venv / "bin" / "vllm-ir", "providers", "list", "--json", cwd=venv).stdout)["providers"]
    assert "aiter" not in {r["name"] for r in listed}
