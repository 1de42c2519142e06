"""Builds the optional ``vllm_ir_provider_vllm_c._C`` extension (the ``vllm_ir_c`` torch ops).

Metadata lives in pyproject.toml; this file only describes the extension. Build it against
the torch that is installed::

    MAX_JOBS=2 pip install --no-build-isolation -e providers/vllm_c

- Sources are found, not listed: one file per op (family) and device, each registering its own
  schema and kernels (see csrc/torch_bindings.cpp), so adding an op changes nothing here.
- CPU kernels: every ``csrc/cpu/*.cpp`` is compiled once per CPU capability (DEFAULT, and on
  x86-64 also AVX2 and AVX512 with the flags ATen uses for its own kernels, and AVX512_BF16);
  each compilation fills its capability's slot of the ops' dispatch stubs
  (csrc/cpu/dispatch_stub.h) and the library runs the variant torch itself runs
  (``torch.backends.cpu.get_cpu_capability()``), AVX512_BF16 where the CPU has it.
- CUDA kernels: every ``csrc/cuda/*.cu``, added only when torch is a CUDA build *and* a CUDA
  toolkit is found (``VLLM_IR_C_CUDA=0`` skips them).
- A failed build does not fail the install: the package is installed without the extension
  and ``_build_info.py`` records why, which the provider reports as its unsupported reason.
  ``VLLM_IR_C_STRICT_BUILD=1`` re-raises instead (for CI of the kernels themselves).
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import traceback
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
PACKAGE = "vllm_ir_provider_vllm_c"
EXTENSION = f"{PACKAGE}._C"
BINDINGS = "csrc/torch_bindings.cpp"


def _sources(pattern: str) -> list[str]:
    return [str(p.relative_to(HERE)) for p in sorted(HERE.glob(pattern))]


CPU_SOURCES = _sources("csrc/cpu/*.cpp")  # compiled once per CPU capability
CUDA_SOURCES = _sources("csrc/cuda/*.cu")
DEPENDS = _sources("csrc/**/*.h")

# The flags ATen compiles its own per-capability kernels with (cmake/Codegen.cmake), plus
# AVX512_BF16: AVX512 with the bf16 conversion instructions (chosen at run time by cpuid).
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
CPU_CAPABILITY_FLAGS: dict[str, list[str]] = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": _AVX512,
    "AVX512_BF16": [*_AVX512, "-mavx512bf16"],
}
# Which ATen vector implementation each variant compiles against.
CPU_CAPABILITY_VEC = {"DEFAULT": "DEFAULT", "AVX2": "AVX2", "AVX512": "AVX512", "AVX512_BF16": "AVX512"}
# -g0: Python's own CFLAGS carry -g, which would make the library 7 MB of debug info; the
# -Wno-* silence torch's headers (torch builds with the same flags). -ffp-contract=off: the
# kernels round where native PyTorch rounds, and GCC would otherwise fuse a*b+c (intrinsics
# included) into one FMA that rounds once; kernels fuse explicitly (at::vec::fmadd) where wanted.
CXX_FLAGS = ["-O3", "-g0", "-Wno-maybe-uninitialized", "-Wno-unknown-pragmas", "-ffp-contract=off"]
NVCC_FLAGS = ["-O3", "--expt-relaxed-constexpr"]

try:
    import torch
    from torch.utils import cpp_extension

    TORCH_ERROR = None
except ImportError as e:  # the install must still succeed; the provider reports this
    torch = None
    cpp_extension = None
    TORCH_ERROR = (
        f"torch was not importable when the package was built ({e}); "
        "install torch first, then pip install --no-build-isolation"
    )


def cpu_capabilities() -> list[str]:
    """Extra capability variants to compile: x86-64 with a GCC-style compiler only."""
    if platform.machine().lower() not in ("x86_64", "amd64") or sys.platform == "win32":
        return []
    wanted = os.environ.get("VLLM_IR_C_CPU_CAPABILITIES")
    names = list(CPU_CAPABILITY_FLAGS) if wanted is None else [c.strip().upper() for c in wanted.split(",")]
    return [c for c in names if c in CPU_CAPABILITY_FLAGS]


def openmp_flags() -> list[str]:
    """at::parallel_for is OpenMP in such torch builds and runs serially unless compiled with -fopenmp.

    Linking with -fopenmp records libgomp.so.1, the soname of the copy torch ships, so the
    loader reuses torch's OpenMP runtime instead of loading a second one.
    """
    if torch is None or sys.platform in ("win32", "darwin") or not torch.backends.openmp.is_available():
        return []
    return ["-fopenmp"]


def build_cuda() -> bool:
    """CUDA kernels with a CUDA torch and an nvcc to compile them (torch guesses CUDA_HOME even
    where the toolkit is absent, e.g. a CUDA wheel on a CPU-only machine: check the compiler)."""
    if torch is None or os.environ.get("VLLM_IR_C_CUDA", "1") == "0":
        return False
    home = cpp_extension.CUDA_HOME
    return torch.version.cuda is not None and home is not None and os.path.exists(os.path.join(home, "bin", "nvcc"))


def extensions() -> list[Extension]:
    if torch is None:
        return [Extension(EXTENSION, sources=[BINDINGS], optional=True)]
    macros: list[tuple[str, str | None]] = []  # VLLM_IR_C_HAVE_<variant> is added as each variant compiles
    args = {"cxx": [*CXX_FLAGS, *openmp_flags()], "nvcc": list(NVCC_FLAGS)}
    options = {"define_macros": macros, "extra_compile_args": args, "extra_link_args": openmp_flags()}
    if build_cuda():
        ext = cpp_extension.CUDAExtension(EXTENSION, sources=[BINDINGS, *CUDA_SOURCES], **options)
    else:
        ext = cpp_extension.CppExtension(EXTENSION, sources=[BINDINGS], **options)
    ext.depends = DEPENDS
    ext.optional = True  # setuptools then tolerates a missing output when copying in place
    return [ext]


_Base = cpp_extension.BuildExtension if cpp_extension is not None else build_ext


class OptionalBuildExtension(_Base):
    """torch's BuildExtension, plus per-capability CPU kernels and a build that may fail.

    Whatever happens, ``_build_info.py`` is written next to the extension: the torch
    version it was built against, whether CUDA kernels are in, and the error if any.
    """

    def run(self) -> None:
        self._error: str | None = TORCH_ERROR
        self._capabilities: list[str] = []
        try:
            if TORCH_ERROR is None:
                super().run()
        except Exception as e:
            self._fail(e)
        finally:
            self._write_build_info()

    def build_extensions(self) -> None:
        try:
            compiler = self.compiler.compiler_so[0] if getattr(self.compiler, "compiler_so", None) else None
            if compiler is not None and shutil.which(compiler) is None:
                raise RuntimeError(f"no C++ compiler: {compiler!r} not found (set CC/CXX or install g++)")
            super().build_extensions()
        except Exception as e:
            self._fail(e)

    def build_extension(self, ext: Extension) -> None:
        try:
            ext.extra_objects = [*ext.extra_objects, *self._compile_cpu_kernels(ext)]
            super().build_extension(ext)
        except Exception as e:
            self._fail(e)

    def _compile_cpu_kernels(self, ext: Extension) -> list[str]:
        """Object files of the CPU sources, one set per capability, each in its own namespace.

        The ISA variants compile first: a variant the compiler cannot target (say, an old GCC
        without -mavx512bf16) is left out with a warning and the library runs the next best
        one. DEFAULT, which must compile, comes last with a ``VLLM_IR_C_HAVE_<variant>`` macro
        per variant that did: it holds the torch side, whose dispatch stubs read those slots.
        """
        args = ext.extra_compile_args
        cxx = list(args["cxx"] if isinstance(args, dict) else args)
        objects = []
        for capability in [*cpu_capabilities(), "DEFAULT"]:
            have = [(f"VLLM_IR_C_HAVE_{c}", None) for c in self._capabilities]
            try:
                objects += self.compiler.compile(
                    CPU_SOURCES,
                    output_dir=os.path.join(self.build_temp, capability.lower()),
                    macros=[
                        ("CPU_CAPABILITY", capability),
                        (f"CPU_CAPABILITY_{CPU_CAPABILITY_VEC[capability]}", None),
                        *(have if capability == "DEFAULT" else []),
                    ],
                    include_dirs=ext.include_dirs,
                    extra_postargs={"cxx": cxx + CPU_CAPABILITY_FLAGS.get(capability, []), "nvcc": []},
                    depends=ext.depends,
                )
            except Exception as e:
                if capability == "DEFAULT":
                    raise
                print(f"WARNING: {EXTENSION}: skipping the {capability} CPU kernels ({e})", file=sys.stderr)
                continue
            if capability != "DEFAULT":
                self._capabilities.append(capability)
        ext.define_macros.extend(have)  # torch_bindings.cpp chooses among the same variants
        self._capabilities.insert(0, "DEFAULT")
        return objects

    def _fail(self, error: BaseException) -> None:
        if os.environ.get("VLLM_IR_C_STRICT_BUILD") == "1":
            raise error
        if self._error is None:
            lines = str(error).strip().splitlines()
            self._error = f"{type(error).__name__}: {lines[-1] if lines else 'no message'} (see the pip build log)"
        print(
            f"WARNING: building {EXTENSION} failed; the package installs without its kernels and the "
            f"provider reports: {self._error}",
            file=sys.stderr,
        )
        traceback.print_exc()

    def _write_build_info(self) -> None:
        info = {
            "TORCH_VERSION": torch.__version__ if torch is not None else None,
            "CUDA_KERNELS": self._error is None and build_cuda(),
            "CPU_CAPABILITIES": tuple(self._capabilities) if self._error is None else (),
            "BUILD_ERROR": self._error,
        }
        text = '"""Written by setup.py when the extension was built; do not edit."""\n\n' + "".join(
            f"{k} = {v!r}\n" for k, v in info.items()
        )
        targets = {os.path.join(self.build_lib, PACKAGE)}
        if self.inplace:
            targets.add(self.get_finalized_command("build_py").get_package_dir(PACKAGE))
        for directory in targets:
            os.makedirs(directory, exist_ok=True)
            Path(directory, "_build_info.py").write_text(text)


class BuildPyWithoutBuildInfo(build_py):
    """Leaves out a ``_build_info.py`` left in the source tree by an editable build: the one in
    a wheel must describe the extension built with it (OptionalBuildExtension writes it)."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if not (m[0] == PACKAGE and m[1] == "_build_info")]


setup(
    ext_modules=extensions(),
    cmdclass={"build_ext": OptionalBuildExtension, "build_py": BuildPyWithoutBuildInfo},
)
