// The vllm_ir_c torch library: op schemas, CPU implementations, and the Python module stub.
//
// The ops live in their own namespace (torch.ops.vllm_ir_c) so that they never collide with
// vLLM's torch.ops._C. Fake (meta) implementations are registered from Python
// (vllm_ir_provider_vllm_c/_extension.py); the CUDA implementations are in cuda/ops_cuda.cpp.

#include <ATen/Version.h>
#include <Python.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>
#include <utility>

#include "cpu/rms_norm_kernels.h"
#include "ops_common.h"

namespace vllm_ir_c {
namespace {

struct CpuKernels {
  void (*rms_norm)(const RmsNormArgs&);
  void (*fused_add_rms_norm)(const FusedAddRmsNormArgs&);
  const char* capability;
};

// Variants from least to most capable; AVX512_BF16 adds the bf16 conversion instructions.
int variant_rank(std::string name) {
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
CpuKernels select_cpu_kernels() {
  int limit = variant_rank(at::get_cpu_capability());
#ifdef VLLM_IR_C_HAVE_AVX512_BF16
  if (limit == 2 && __builtin_cpu_supports("avx512bf16")) {
    limit = 3;
  }
#endif
  if (const char* cap = std::getenv("VLLM_IR_C_CPU_CAPABILITY"); cap != nullptr && variant_rank(cap) >= 0) {
    limit = std::min(limit, variant_rank(cap));
  }
#ifdef VLLM_IR_C_HAVE_AVX512_BF16
  if (limit >= 3) {
    return {&AVX512_BF16::rms_norm_kernel, &AVX512_BF16::fused_add_rms_norm_kernel, "AVX512_BF16"};
  }
#endif
#ifdef VLLM_IR_C_HAVE_AVX512
  if (limit >= 2) {
    return {&AVX512::rms_norm_kernel, &AVX512::fused_add_rms_norm_kernel, "AVX512"};
  }
#endif
#ifdef VLLM_IR_C_HAVE_AVX2
  if (limit >= 1) {
    return {&AVX2::rms_norm_kernel, &AVX2::fused_add_rms_norm_kernel, "AVX2"};
  }
#endif
  return {&DEFAULT::rms_norm_kernel, &DEFAULT::fused_add_rms_norm_kernel, "DEFAULT"};
}

const CpuKernels& cpu_kernels() {
  static const CpuKernels kernels = select_cpu_kernels();
  return kernels;
}

void rms_norm_cpu(at::Tensor& out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                  double epsilon) {
  run_rms_norm("vllm_ir_c::rms_norm", out, input, weight, epsilon, cpu_kernels().rms_norm);
}

void fused_add_rms_norm_cpu(at::Tensor& input, at::Tensor& residual, const std::optional<at::Tensor>& weight,
                            double epsilon) {
  run_fused_add_rms_norm("vllm_ir_c::fused_add_rms_norm", input, residual, weight, epsilon,
                         cpu_kernels().fused_add_rms_norm);
}

std::string cpu_capability() {
  return cpu_kernels().capability;
}

}  // namespace
}  // namespace vllm_ir_c

TORCH_LIBRARY(vllm_ir_c, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor? weight, float epsilon) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor? weight, float epsilon) -> ()");
  // Which compiled CPU variant runs (DEFAULT, AVX2, AVX512, AVX512_BF16): for benchmarks and bug reports.
  m.def("cpu_capability() -> str", &vllm_ir_c::cpu_capability);
}

TORCH_LIBRARY_IMPL(vllm_ir_c, CPU, m) {
  m.impl("rms_norm", &vllm_ir_c::rms_norm_cpu);
  m.impl("fused_add_rms_norm", &vllm_ir_c::fused_add_rms_norm_cpu);
}

// Importing vllm_ir_provider_vllm_c._C loads the library and runs the registrations above.
PyMODINIT_FUNC PyInit__C() {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "vllm_ir_c torch ops (see torch.ops.vllm_ir_c)", -1,
                               nullptr};
  return PyModule_Create(&module);
}
