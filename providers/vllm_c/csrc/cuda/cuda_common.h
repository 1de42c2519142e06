// Helpers shared by the csrc/cuda/*.cu kernels: rounding to a dtype, vector packs and their
// alignment checks, and warp/block reductions. Each .cu includes this inside no namespace; the
// helpers are inline, so every translation unit gets its own copy (no relocatable device code).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../quant.h"  // nan_max

// One switch over (input dtype, fp8 format) for a launch: F and scalar_t are set where
// __VA_ARGS__ runs. ARGS has `dtype` and `format` (kernel_common.h's dtype switch).
#define VLLM_IR_C_CUDA_FP8_DISPATCH(ARGS, NAME, ...)           \
  VLLM_IR_C_DISPATCH_FLOATING_TYPES(ARGS.dtype, NAME, [&] {     \
    if (ARGS.format == Fp8Format::E4M3FNUZ) {                  \
      constexpr Fp8Format F = Fp8Format::E4M3FNUZ;             \
      __VA_ARGS__;                                             \
    } else {                                                   \
      constexpr Fp8Format F = Fp8Format::E4M3FN;               \
      __VA_ARGS__;                                             \
    }                                                          \
  })

namespace vllm_ir_c {
namespace cuda_common {

constexpr int kWarp = 32;

// Elements of T in one 16-byte vector load or store.
template <typename T>
constexpr int kVecPack = 16 / sizeof(T);

// Whether `p` is a multiple of `bytes`.
inline bool aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

// Whether every row of `rows` over `data` starts on a multiple of `bytes`.
inline bool rows_aligned(const void* data, const RowLayout& rows, int64_t elem_bytes, int64_t bytes) {
  if (!aligned(data, bytes)) {
    return false;
  }
  if (rows.row_stride >= 0) {
    return rows.row_stride * elem_bytes % bytes == 0;
  }
  for (int32_t d = 0; d < rows.batch_dims; ++d) {
    if (rows.strides[d] * elem_bytes % bytes != 0) {
      return false;
    }
  }
  return true;
}

// Threads for a block that walks a row of `hidden` elements: whole warps, at most `max_threads`.
inline int threads_for(int64_t hidden, int64_t max_threads = 256) {
  const int64_t whole_warps = std::max<int64_t>(1, (hidden + kWarp - 1) / kWarp) * kWarp;
  return static_cast<int>(std::min(max_threads, whole_warps));
}

// The dtype's rounding of an fp32 value, back in fp32.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// N elements of T loaded or stored as one aligned vector.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;
}

// NaN-propagating maximum over the warp.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) {
    v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  return v;
}

// Sum over the block; the result is valid in thread 0. blockDim.x is a multiple of 32.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[kWarp];
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  v = warp_sum(v);
  if (lane == 0) {
    warp_sums[warp] = v;
  }
  __syncthreads();
  if (warp == 0) {
    v = warp_sum(lane < static_cast<int>(blockDim.x / kWarp) ? warp_sums[lane] : 0.0f);
  }
  return v;
}

// Broadcasts 1 / sqrt(mean + epsilon) of the block's partial sums of squares.
__device__ __forceinline__ float block_inverse_rms(float partial, int64_t hidden, float epsilon) {
  __shared__ float scale;
  const float total = block_sum(partial);
  if (threadIdx.x == 0) {
    // Same operations as native: mean, + epsilon, rsqrt (IEEE division and sqrt).
    scale = 1.0f / sqrtf(total / static_cast<float>(hidden) + epsilon);
  }
  __syncthreads();
  return scale;
}

// NaN-propagating maximum over the block, broadcast to every thread. blockDim.x is a multiple of 32.
__device__ __forceinline__ float block_max(float v) {
  __shared__ float warp_maxima[kWarp];
  __shared__ float result;
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  v = warp_max(v);
  if (lane == 0) {
    warp_maxima[warp] = v;
  }
  __syncthreads();
  if (warp == 0) {
    v = warp_max(lane < static_cast<int>(blockDim.x / kWarp) ? warp_maxima[lane] : 0.0f);
    if (lane == 0) {
      result = v;
    }
  }
  __syncthreads();
  return result;
}

}  // namespace cuda_common
}  // namespace vllm_ir_c
