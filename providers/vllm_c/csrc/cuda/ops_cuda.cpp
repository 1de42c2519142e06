// CUDA implementations of the vllm_ir_c ops (compiled only where torch and the toolkit have CUDA).

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../ops_common.h"
#include "rms_norm_kernels.h"

namespace vllm_ir_c {
namespace {

void rms_norm_cuda(at::Tensor& out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                   double epsilon) {
  const c10::cuda::CUDAGuard guard(input.device());
  run_rms_norm("vllm_ir_c::rms_norm", out, input, weight, epsilon, [](const RmsNormArgs& args) {
    C10_CUDA_CHECK(cuda::launch_rms_norm(args, c10::cuda::getCurrentCUDAStream()));
  });
}

void fused_add_rms_norm_cuda(at::Tensor& input, at::Tensor& residual, const std::optional<at::Tensor>& weight,
                             double epsilon) {
  const c10::cuda::CUDAGuard guard(input.device());
  run_fused_add_rms_norm("vllm_ir_c::fused_add_rms_norm", input, residual, weight, epsilon,
                         [](const FusedAddRmsNormArgs& args) {
                           C10_CUDA_CHECK(cuda::launch_fused_add_rms_norm(args, c10::cuda::getCurrentCUDAStream()));
                         });
}

}  // namespace
}  // namespace vllm_ir_c

TORCH_LIBRARY_IMPL(vllm_ir_c, CUDA, m) {
  m.impl("rms_norm", &vllm_ir_c::rms_norm_cuda);
  m.impl("fused_add_rms_norm", &vllm_ir_c::fused_add_rms_norm_cuda);
}
