// CUDA RMSNorm launchers: raw pointers and a stream in, a CUDA error code out.
//
// Kept free of the Tensor API and of c10/cuda so that nvcc can compile rms_norm_kernels.cu
// against any torch's headers (the compile check in tests/test_provider_vllm_c.py runs it
// here, where torch is a CPU build); ops_cuda.cpp does the torch side.
#pragma once

#include <cuda_runtime_api.h>

#include "../rms_norm.h"

namespace vllm_ir_c::cuda {

cudaError_t launch_rms_norm(const RmsNormArgs& args, cudaStream_t stream);
cudaError_t launch_fused_add_rms_norm(const FusedAddRmsNormArgs& args, cudaStream_t stream);

}  // namespace vllm_ir_c::cuda
