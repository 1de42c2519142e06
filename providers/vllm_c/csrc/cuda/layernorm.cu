// The layernorm family on CUDA (rms_norm; fused residual-add + rms_norm in place and into
// other tensors): one thread block per row, and the torch side (CUDA registrations; the
// schemas are defined by cpu/layernorm.cpp).
//
// Same numerics as the CPU kernels and the native op (vLLM 0.33's): fp32 accumulation, the row
// normalized in fp32, then the weight applied in its own dtype (a weight of the input dtype
// multiplies the value rounded to that dtype, rounded again; an fp32 weight the fp32 value,
// rounded once), and the fused op normalizing the fp32 sum rather than the rounded residual it
// stores. An fp32 weight with a 16-bit input is read one element at a time (it stays in L1/L2). Rows are read
// twice (sum of squares, then scale); the second read hits L1/L2. Rows whose pointers and
// strides allow it are moved in 16-byte packs.

#include "../layernorm.h"
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
#include <initializer_list>
#include <utility>

namespace vllm_ir_c {
namespace {

using namespace cuda_common;

// The weight of one element: none, of T (`same`), or fp32 (`w_fp32` is not null).
template <typename T>
__device__ T weighted(float normed, bool has_weight, T same, const float* w_fp32, int64_t c) {
  if (!has_weight) {
    return static_cast<T>(normed);
  }
  if (w_fp32 != nullptr) {
    return static_cast<T>(normed * w_fp32[c]);  // vLLM: y.to(float32) * weight, then .to(T)
  }
  // vLLM: y.to(T) * weight (an fp32 product of T values, rounded to T)
  return static_cast<T>(static_cast<float>(static_cast<T>(normed)) * static_cast<float>(same));
}

template <typename T, int kPack>
__global__ void rms_norm_kernel(RmsNormArgs a) {
  using P = Pack<T, kPack>;
  const int64_t row = blockIdx.x;
  const P* x = reinterpret_cast<const P*>(static_cast<const T*>(a.input) + a.input_rows.offset(row));
  P* out = reinterpret_cast<P*>(static_cast<T*>(a.out) + a.out_rows.offset(row));
  const bool has_weight = a.weight != nullptr;
  const P* w = a.fp32_weight ? nullptr : static_cast<const P*>(a.weight);
  const float* w_fp32 = a.fp32_weight ? static_cast<const float*>(a.weight) : nullptr;
  const int64_t packs = a.hidden / kPack;

  float partial = 0.0f;
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const P p = x[i];
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      const float v = static_cast<float>(p.v[k]);
      partial += v * v;
    }
  }
  const float scale = block_inverse_rms(partial, a.hidden, a.epsilon);

  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const P p = x[i];
    P wp;
    if (w != nullptr) {
      wp = w[i];
    }
    P y;
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      y.v[k] = weighted(static_cast<float>(p.v[k]) * scale, has_weight, wp.v[k], w_fp32, i * kPack + k);
    }
    out[i] = y;
  }
}

// In place (`out` is `input`, `residual_out` is `residual`) or into other tensors: each pack
// is read before the same pack of the outputs is written, so aliasing them is safe.
template <typename T, int kPack>
__global__ void fused_add_rms_norm_kernel(FusedAddRmsNormArgs a) {
  using P = Pack<T, kPack>;
  const int64_t row = blockIdx.x;
  const P* x = reinterpret_cast<const P*>(static_cast<const T*>(a.input) + a.input_rows.offset(row));
  const P* residual = reinterpret_cast<const P*>(static_cast<const T*>(a.residual) + a.residual_rows.offset(row));
  P* out = reinterpret_cast<P*>(static_cast<T*>(a.out) + a.out_rows.offset(row));
  P* residual_out = reinterpret_cast<P*>(static_cast<T*>(a.residual_out) + a.residual_out_rows.offset(row));
  const bool has_weight = a.weight != nullptr;
  const P* w = a.fp32_weight ? nullptr : static_cast<const P*>(a.weight);
  const float* w_fp32 = a.fp32_weight ? static_cast<const float*>(a.weight) : nullptr;
  const int64_t packs = a.hidden / kPack;

  // Pass 1 only reads: pass 2 recomputes the fp32 sum from both rows, since the stored
  // residual is rounded and the norm must not be.
  float partial = 0.0f;
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const P xp = x[i];
    const P rp = residual[i];
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      const float s = static_cast<float>(xp.v[k]) + static_cast<float>(rp.v[k]);
      partial += s * s;
    }
  }
  const float scale = block_inverse_rms(partial, a.hidden, a.epsilon);

  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const P xp = x[i];
    const P rp = residual[i];
    P wp;
    if (w != nullptr) {
      wp = w[i];
    }
    P sum;
    P y;
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      const float s = static_cast<float>(xp.v[k]) + static_cast<float>(rp.v[k]);
      sum.v[k] = static_cast<T>(s);
      y.v[k] = weighted(s * scale, has_weight, wp.v[k], w_fp32, i * kPack + k);
    }
    residual_out[i] = sum;
    out[i] = y;
  }
}

// 16-byte packs when every row start and the weight allow it, else one element at a time.
template <typename T>
bool can_vectorize(int64_t hidden, const void* weight, std::initializer_list<std::pair<const void*, RowLayout>> rows) {
  if (hidden % kVecPack<T> != 0 || (weight != nullptr && !aligned(weight, 16))) {
    return false;
  }
  return std::all_of(rows.begin(), rows.end(),
                     [](const auto& r) { return rows_aligned(r.first, r.second, sizeof(T), 16); });
}

// Many rows: small blocks keep several resident per SM; few rows: wide blocks per row.
dim3 block_for(int64_t rows, int64_t packs) {
  const int64_t max_threads = rows < 256 ? 1024 : 256;
  const int64_t threads = std::min(max_threads, (packs + kWarp - 1) / kWarp * kWarp);
  return dim3(static_cast<unsigned>(std::max<int64_t>(threads, kWarp)));
}

cudaError_t launch_rms_norm_kernel(const RmsNormArgs& args, cudaStream_t stream) {
  if (args.rows == 0 || args.hidden == 0) {
    return cudaSuccess;
  }
  if (args.rows > INT32_MAX) {
    return cudaErrorInvalidConfiguration;
  }
  const dim3 grid(static_cast<unsigned>(args.rows));
  VLLM_IR_C_DISPATCH_FLOATING_TYPES(args.dtype, "vllm_ir_c::rms_norm (cuda)", [&] {
    if (can_vectorize<scalar_t>(args.hidden, args.weight, {{args.out, args.out_rows}, {args.input, args.input_rows}})) {
      constexpr int kPack = kVecPack<scalar_t>;
      rms_norm_kernel<scalar_t, kPack><<<grid, block_for(args.rows, args.hidden / kPack), 0, stream>>>(args);
    } else {
      rms_norm_kernel<scalar_t, 1><<<grid, block_for(args.rows, args.hidden), 0, stream>>>(args);
    }
  });
  return cudaGetLastError();
}

cudaError_t launch_fused_add_rms_norm_kernel(const FusedAddRmsNormArgs& args, cudaStream_t stream) {
  if (args.rows == 0 || args.hidden == 0) {
    return cudaSuccess;
  }
  if (args.rows > INT32_MAX) {
    return cudaErrorInvalidConfiguration;
  }
  const dim3 grid(static_cast<unsigned>(args.rows));
  VLLM_IR_C_DISPATCH_FLOATING_TYPES(args.dtype, "vllm_ir_c::fused_add_rms_norm (cuda)", [&] {
    if (can_vectorize<scalar_t>(args.hidden, args.weight,
                                {{args.out, args.out_rows},
                                 {args.residual_out, args.residual_out_rows},
                                 {args.input, args.input_rows},
                                 {args.residual, args.residual_rows}})) {
      constexpr int kPack = kVecPack<scalar_t>;
      fused_add_rms_norm_kernel<scalar_t, kPack>
          <<<grid, block_for(args.rows, args.hidden / kPack), 0, stream>>>(args);
    } else {
      fused_add_rms_norm_kernel<scalar_t, 1><<<grid, block_for(args.rows, args.hidden), 0, stream>>>(args);
    }
  });
  return cudaGetLastError();
}

void rms_norm_cuda(at::Tensor& out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                   double epsilon) {
  const c10::cuda::CUDAGuard guard(input.device());
  run_rms_norm("vllm_ir_c::rms_norm", out, input, weight, epsilon, [](const RmsNormArgs& args) {
    C10_CUDA_CHECK(launch_rms_norm_kernel(args, c10::cuda::getCurrentCUDAStream()));
  });
}

void run_fused_add_rms_norm_kernel(const FusedAddRmsNormArgs& args) {
  C10_CUDA_CHECK(launch_fused_add_rms_norm_kernel(args, c10::cuda::getCurrentCUDAStream()));
}

void fused_add_rms_norm_cuda(at::Tensor& input, at::Tensor& residual, const std::optional<at::Tensor>& weight,
                             double epsilon) {
  const c10::cuda::CUDAGuard guard(input.device());
  run_fused_add_rms_norm("vllm_ir_c::fused_add_rms_norm", input, residual, input, residual, weight, epsilon,
                         run_fused_add_rms_norm_kernel);
}

void fused_add_rms_norm_out_cuda(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& input,
                                 const at::Tensor& residual, const std::optional<at::Tensor>& weight,
                                 double epsilon) {
  const c10::cuda::CUDAGuard guard(input.device());
  run_fused_add_rms_norm("vllm_ir_c::fused_add_rms_norm_out", out, residual_out, input, residual, weight, epsilon,
                         run_fused_add_rms_norm_kernel);
}

}  // namespace
}  // namespace vllm_ir_c

TORCH_LIBRARY_IMPL(vllm_ir_c, CUDA, m) {
  m.impl("rms_norm", &vllm_ir_c::rms_norm_cuda);
  m.impl("fused_add_rms_norm", &vllm_ir_c::fused_add_rms_norm_cuda);
  m.impl("fused_add_rms_norm_out", &vllm_ir_c::fused_add_rms_norm_out_cuda);
}
