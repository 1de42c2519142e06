// RMSNorm / SwiGLU + per-group FP8 quant on CUDA (rms_norm_group_fp8_quant with or without
// residual, silu_and_mul_group_fp8_quant) and their torch side (CUDA registrations; the
// schemas are defined by cpu/fused_quant.cpp).
//
// Same numerics as the CPU kernels and the op declarations (csrc/fused_quant.h): the row's
// fp32 sum of squares, 1 / sqrt(mean + epsilon), the weight applied as vLLM 0.33 does (a
// weight of the input dtype multiplies the normalized value rounded to that dtype; an fp32
// weight the fp32 value), y rounded to the input dtype, then each group's scale
// (group_scale: quant.h's group quant) and codes (quantize_fp8). SwiGLU rounds silu(gate) and
// the product to the input dtype, as silu_and_mul does.
//
// Simple launch shape: one block per row. The norm kernel reduces the row's sum of squares
// over the block, then each warp takes a group: one read of the group for its absmax, a
// second (from L1/L2) that writes the new residual and the codes. The residual is written
// only in that second read, by the lane that read it, so residual_out may be residual.

#include "../fused_quant.h"
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

template <typename T, Fp8Format kFormat, bool kResidual>
__global__ void rms_norm_group_quant_kernel(RmsNormQuantArgs a) {
  const int64_t r = blockIdx.x;
  const int64_t n = a.hidden;
  const T* x = static_cast<const T*>(a.input) + a.input_rows.offset(r);
  const T* res = kResidual ? static_cast<const T*>(a.residual) + a.residual_rows.offset(r) : nullptr;
  T* res_out = kResidual ? static_cast<T*>(a.residual_out) + a.residual_out_rows.offset(r) : nullptr;
  uint8_t* out = a.out + r * n;
  auto sum_at = [&](int64_t c) {
    float v = static_cast<float>(x[c]);
    if constexpr (kResidual) {
      v += static_cast<float>(res[c]);
    }
    return v;
  };
  float partial = 0.0f;
  for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
    const float v = sum_at(c);
    partial += v * v;
  }
  const float inv_rms = block_inverse_rms(partial, n, a.epsilon);
  const T* w_same = static_cast<const T*>(a.weight);
  const float* w_fp32 = static_cast<const float*>(a.weight);
  auto y_of = [&](float v, int64_t c) {
    const float normed = v * inv_rms;
    if (a.weight == nullptr) {
      return round_to<T>(normed);
    }
    return a.fp32_weight ? round_to<T>(normed * w_fp32[c])
                         : round_to<T>(round_to<T>(normed) * static_cast<float>(w_same[c]));
  };
  const GroupScales& g = a.group;
  float* scales = g.scales + g.rows.offset(r);
  const int lane = threadIdx.x % kWarp;
  const int warps = blockDim.x / kWarp;
  const int64_t groups = (n + g.size - 1) / g.size;
  const float bound = fp8_bound(kFormat);
  for (int64_t k = threadIdx.x / kWarp; k < groups; k += warps) {
    const int64_t begin = k * g.size;
    const int64_t end = min(begin + g.size, n);
    float m = 0.0f;
    for (int64_t c = begin + lane; c < end; c += kWarp) {
      m = nan_max(m, fabsf(y_of(sum_at(c), c)));
    }
    const float s = group_scale(warp_max(m), g.use_ue8m0, kFormat);
    if (lane == 0) {
      scales[k * g.group_stride] = s;
    }
    const float inv = 1.0f / s;
    for (int64_t c = begin + lane; c < end; c += kWarp) {
      const float v = sum_at(c);
      if constexpr (kResidual) {
        res_out[c] = static_cast<T>(v);
      }
      out[c] = quantize_fp8<kFormat>(y_of(v, c) * inv, bound);
    }
  }
}

template <typename T, Fp8Format kFormat>
__global__ void silu_and_mul_group_quant_kernel(SiluMulQuantArgs a) {
  const int64_t r = blockIdx.x;
  const int64_t d = a.d;
  const T* gate = static_cast<const T*>(a.input) + a.input_rows.offset(r);
  const T* up = gate + d;
  uint8_t* out = a.out + r * d;
  auto y_of = [&](int64_t c) {
    const float g = static_cast<float>(gate[c]);
    return round_to<T>(round_to<T>(g / (1.0f + expf(-g))) * static_cast<float>(up[c]));
  };
  const GroupScales& g = a.group;
  float* scales = g.scales + g.rows.offset(r);
  const int lane = threadIdx.x % kWarp;
  const int warps = blockDim.x / kWarp;
  const int64_t groups = (d + g.size - 1) / g.size;
  const float bound = fp8_bound(kFormat);
  for (int64_t k = threadIdx.x / kWarp; k < groups; k += warps) {
    const int64_t begin = k * g.size;
    const int64_t end = min(begin + g.size, d);
    float m = 0.0f;
    for (int64_t c = begin + lane; c < end; c += kWarp) {
      m = nan_max(m, fabsf(y_of(c)));
    }
    const float s = group_scale(warp_max(m), g.use_ue8m0, kFormat);
    if (lane == 0) {
      scales[k * g.group_stride] = s;
    }
    const float inv = 1.0f / s;
    for (int64_t c = begin + lane; c < end; c += kWarp) {
      out[c] = quantize_fp8<kFormat>(y_of(c) * inv, bound);
    }
  }
}

void rms_norm_group_fp8_quant_cuda(at::Tensor& out, at::Tensor& scales, const std::optional<at::Tensor>& residual_out,
                                   const at::Tensor& input, const std::optional<at::Tensor>& residual,
                                   const std::optional<at::Tensor>& weight, int64_t group_size, bool use_ue8m0,
                                   double epsilon) {
  const c10::cuda::CUDAGuard guard(input.device());
  auto kernel = [](const RmsNormQuantArgs& a) {
    const auto stream = c10::cuda::getCurrentCUDAStream();
    const int threads = threads_for(a.hidden);
    if (a.residual != nullptr) {
      VLLM_IR_C_CUDA_FP8_DISPATCH(a, "rms_norm_group_fp8_quant",
                                    rms_norm_group_quant_kernel<scalar_t, F, true><<<a.rows, threads, 0, stream>>>(a));
    } else {
      VLLM_IR_C_CUDA_FP8_DISPATCH(a, "rms_norm_group_fp8_quant",
                                    rms_norm_group_quant_kernel<scalar_t, F, false><<<a.rows, threads, 0, stream>>>(a));
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  run_rms_norm_quant("vllm_ir_c::rms_norm_group_fp8_quant", out, scales, residual_out, input, residual, weight,
                     std::nullopt, std::nullopt, epsilon, kernel, group_size, use_ue8m0);
}

void silu_and_mul_group_fp8_quant_cuda(at::Tensor& out, at::Tensor& scales, const at::Tensor& input,
                                       int64_t group_size, bool use_ue8m0) {
  const c10::cuda::CUDAGuard guard(input.device());
  auto kernel = [](const SiluMulQuantArgs& a) {
    const auto stream = c10::cuda::getCurrentCUDAStream();
    VLLM_IR_C_CUDA_FP8_DISPATCH(
        a, "silu_and_mul_group_fp8_quant",
        silu_and_mul_group_quant_kernel<scalar_t, F><<<a.rows, threads_for(a.d), 0, stream>>>(a));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  run_silu_and_mul_quant("vllm_ir_c::silu_and_mul_group_fp8_quant", out, input, std::nullopt, kernel, scales,
                         group_size, use_ue8m0);
}

}  // namespace
}  // namespace vllm_ir_c

TORCH_LIBRARY_IMPL(vllm_ir_c, CUDA, m) {
  m.impl("rms_norm_group_fp8_quant", &vllm_ir_c::rms_norm_group_fp8_quant_cuda);
  m.impl("silu_and_mul_group_fp8_quant", &vllm_ir_c::silu_and_mul_group_fp8_quant_cuda);
}
