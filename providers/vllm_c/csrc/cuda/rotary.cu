// Rotary position embedding on CUDA, in place on query and key (rotary.h has the arguments;
// the schema is defined by cpu/rotary.cpp): one thread block per token, its threads striding
// over (head, channel pair) of query then key, as vLLM's kernel does.
//
// Same numerics as the CPU kernel and the native op: cos and sin in the dtype, each product
// rounded to the dtype, then the sum (fp32 arithmetic between the roundings, no contraction).

#include "../rotary.h"
#include "cuda_common.h"

#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace vllm_ir_c {
namespace {

using namespace cuda_common;

template <typename T>
__device__ __forceinline__ void rotate_pair(T* x1p, T* x2p, float c, float s) {
  const float x1 = static_cast<float>(*x1p), x2 = static_cast<float>(*x2p);
  // __fmul_rn/__fadd_rn: rounded separately, never fused into an FMA.
  const float x1c = round_to<T>(__fmul_rn(x1, c)), x2s = round_to<T>(__fmul_rn(x2, s));
  const float x2c = round_to<T>(__fmul_rn(x2, c)), x1s = round_to<T>(__fmul_rn(x1, s));
  *x1p = static_cast<T>(__fsub_rn(x1c, x2s));
  *x2p = static_cast<T>(__fadd_rn(x2c, x1s));
}

template <typename T, bool kNeox>
__global__ void rotary_embedding_kernel(const RotaryArgs args) {
  const int64_t t = blockIdx.x;
  int64_t p = args.positions[t];
  CUDA_KERNEL_ASSERT(p >= -args.max_position && p < args.max_position);
  p = p < 0 ? p + args.max_position : p;
  const T* cos = static_cast<const T*>(args.cache) + p * args.cache_stride;
  const int64_t half = args.rotary_dim / 2;
  const T* sin = cos + half;
  const int64_t q_pairs = args.query.heads * half;
  const int64_t pairs = q_pairs + (args.key.data != nullptr ? args.key.heads * half : 0);
  for (int64_t j = threadIdx.x; j < pairs; j += blockDim.x) {
    const bool is_query = j < q_pairs;
    const RotaryTarget& target = is_query ? args.query : args.key;
    const int64_t local = is_query ? j : j - q_pairs;
    const int64_t h = local / half, i = local % half;
    T* x = static_cast<T*>(target.data) + t * target.token_stride + h * target.head_stride;
    const float c = static_cast<float>(cos[i]), s = static_cast<float>(sin[i]);
    if constexpr (kNeox) {
      rotate_pair(x + i, x + half + i, c, s);
    } else {
      rotate_pair(x + 2 * i, x + 2 * i + 1, c, s);
    }
  }
}

cudaError_t launch_rotary_embedding_kernel(const RotaryArgs& args, cudaStream_t stream) {
  if (args.tokens == 0 || args.rotary_dim == 0) {
    return cudaSuccess;
  }
  if (args.tokens > INT32_MAX) {
    return cudaErrorInvalidConfiguration;
  }
  const int64_t heads = args.query.heads + (args.key.data != nullptr ? args.key.heads : 0);
  const int64_t pairs = heads * (args.rotary_dim / 2);
  const dim3 grid(static_cast<unsigned>(args.tokens));
  const dim3 block(static_cast<unsigned>(std::min<int64_t>(512, std::max<int64_t>(32, (pairs + 31) / 32 * 32))));
  VLLM_IR_C_DISPATCH_FLOATING_TYPES(args.dtype, "vllm_ir_c::rotary_embedding (cuda)", [&] {
    if (args.neox) {
      rotary_embedding_kernel<scalar_t, true><<<grid, block, 0, stream>>>(args);
    } else {
      rotary_embedding_kernel<scalar_t, false><<<grid, block, 0, stream>>>(args);
    }
  });
  return cudaGetLastError();
}

void rotary_embedding_cuda(const at::Tensor& positions, at::Tensor& query, std::optional<at::Tensor> key,
                           int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox, int64_t rotary_dim) {
  const c10::cuda::CUDAGuard guard(query.device());
  run_rotary("vllm_ir_c::rotary_embedding", positions, query, key, head_size, cos_sin_cache, is_neox, rotary_dim,
             [](const RotaryArgs& args) {
               C10_CUDA_CHECK(launch_rotary_embedding_kernel(args, c10::cuda::getCurrentCUDAStream()));
             });
}

}  // namespace
}  // namespace vllm_ir_c

TORCH_LIBRARY_IMPL(vllm_ir_c, CUDA, m) {
  m.impl("rotary_embedding", &vllm_ir_c::rotary_embedding_cuda);
}
