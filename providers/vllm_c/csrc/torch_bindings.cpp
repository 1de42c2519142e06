// The vllm_ir_c torch library's shared parts: the library itself, the CPU capability every
// dispatch stub runs, and the Python module stub.
//
// Ops live in their own files and register themselves (TORCH_LIBRARY_FRAGMENT for the schema,
// TORCH_LIBRARY_IMPL per device): csrc/cpu/<op>.cpp, csrc/cuda/<op>.cu, with their fake
// kernels and vllm-ir implementations in vllm_ir_provider_vllm_c/<op>.py. Nothing here names
// an op. The ops live in their own namespace (torch.ops.vllm_ir_c) so that they never collide
// with vLLM's torch.ops._C.

#include <ATen/Version.h>
#include <Python.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>
#include <utility>

#include "cpu/dispatch_stub.h"

namespace vllm_ir_c {
namespace {

// The rank of a capability name (any case), or -1.
int capability_rank(std::string name) {
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::toupper(c); });
  for (const auto& [rank, variant] : {std::pair{0, "DEFAULT"}, {1, "AVX2"}, {2, "AVX512"}, {3, "AVX512_BF16"}}) {
    if (name == variant) {
      return rank;
    }
  }
  return -1;
}

// The most capable compiled variant that torch itself would run here (so ATEN_CPU_CAPABILITY=avx2
// selects the AVX2 kernels too), capped by VLLM_IR_C_CPU_CAPABILITY if set (tests use it to
// exercise every variant on one machine).
CpuCapability select_cpu_capability() {
  int limit = capability_rank(at::get_cpu_capability());
#ifdef VLLM_IR_C_HAVE_AVX512_BF16
  if (limit == 2 && __builtin_cpu_supports("avx512bf16")) {
    limit = 3;
  }
#endif
  if (const char* cap = std::getenv("VLLM_IR_C_CPU_CAPABILITY"); cap != nullptr && capability_rank(cap) >= 0) {
    limit = std::min(limit, capability_rank(cap));
  }
#ifdef VLLM_IR_C_HAVE_AVX512_BF16
  if (limit >= 3) {
    return CpuCapability::AVX512_BF16;
  }
#endif
#ifdef VLLM_IR_C_HAVE_AVX512
  if (limit >= 2) {
    return CpuCapability::AVX512;
  }
#endif
#ifdef VLLM_IR_C_HAVE_AVX2
  if (limit >= 1) {
    return CpuCapability::AVX2;
  }
#endif
  return CpuCapability::DEFAULT;
}

std::string cpu_capability() {
  return cpu_capability_name(cpu_capability_in_use());
}

}  // namespace

CpuCapability cpu_capability_in_use() {
  static const CpuCapability capability = select_cpu_capability();
  return capability;
}

const char* cpu_capability_name(CpuCapability capability) {
  switch (capability) {
    case CpuCapability::AVX2:
      return "AVX2";
    case CpuCapability::AVX512:
      return "AVX512";
    case CpuCapability::AVX512_BF16:
      return "AVX512_BF16";
    case CpuCapability::DEFAULT:
      break;
  }
  return "DEFAULT";
}

}  // namespace vllm_ir_c

TORCH_LIBRARY(vllm_ir_c, m) {
  // Which compiled CPU variant the kernels run (DEFAULT, AVX2, AVX512, AVX512_BF16): for
  // benchmarks and bug reports.
  m.def("cpu_capability() -> str", &vllm_ir_c::cpu_capability);
}

// Importing vllm_ir_provider_vllm_c._C loads the library and runs every file's registrations.
PyMODINIT_FUNC PyInit__C() {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "vllm_ir_c torch ops (see torch.ops.vllm_ir_c)", -1,
                               nullptr};
  return PyModule_Create(&module);
}
