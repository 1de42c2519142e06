// The FP8 quantization family on CUDA (static_quant_fp8, dynamic_quant_fp8 per-token and
// per-tensor, dynamic_group_quant_fp8) and its torch side (CUDA registrations; the schemas are
// defined by cpu/quant.cpp).
//
// Same numerics as the CPU kernels and the op declarations, from csrc/quant.h: the fp32
// reciprocal of the scale (IEEE division), clamp, c10's round-to-nearest-even encoding, and
// NaN-propagating maxima; so results are bit-identical to native's. Maxima of non-negative
// floats are order-independent: the per-tensor absmax combines blocks with atomicMax on the
// float's bits (NaN's bits are above every finite value's and inf's).
//
// static: one block per row, threads stride over columns. dynamic per-token: one block per
// row, absmax by block reduction, then the row is quantized (its second read hits L2).
// group: one warp per group, a block per row walking its groups eight warps at a time.

#include "../quant.h"
#include "cuda_common.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/zeros.h>
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
__device__ float load_float(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

template <Fp8Format kFormat, typename T>
__global__ void static_quant_kernel(StaticQuantArgs a) {
  const int64_t r = blockIdx.x;
  const T* x = static_cast<const T*>(a.input) + a.input_rows.offset(r);
  uint8_t* out = a.out + r * a.hidden;
  const float* srow = a.scale + (r / a.row_group) * a.scale_row_stride;
  const float bound = fp8_bound(kFormat);
  const bool per_column = a.col_group < a.hidden;
  const float row_inv = per_column ? 0.0f : 1.0f / srow[0];
  for (int64_t c = threadIdx.x; c < a.hidden; c += blockDim.x) {
    const float inv = per_column ? 1.0f / srow[(c / a.col_group) * a.scale_col_stride] : row_inv;
    out[c] = quantize_fp8<kFormat>(load_float(x, c) * inv, bound);
  }
}

template <Fp8Format kFormat, typename T>
__global__ void dynamic_per_token_kernel(DynamicQuantArgs a) {
  const int64_t r = blockIdx.x;
  const T* x = static_cast<const T*>(a.input) + a.input_rows.offset(r);
  uint8_t* out = a.out + r * a.hidden;
  float m = 0.0f;
  for (int64_t c = threadIdx.x; c < a.hidden; c += blockDim.x) {
    m = nan_max(m, fabsf(load_float(x, c)));
  }
  const float scale = dynamic_scale(block_max(m), a.scale_ub, kFormat);
  if (threadIdx.x == 0) {
    a.scale[r] = scale;
  }
  const float inv = 1.0f / scale;
  const float bound = fp8_bound(kFormat);
  for (int64_t c = threadIdx.x; c < a.hidden; c += blockDim.x) {
    out[c] = quantize_fp8<kFormat>(load_float(x, c) * inv, bound);
  }
}

// *result (zeroed before) = max(*result, absmax of the block's rows), as float bits.
template <typename T>
__global__ void absmax_kernel(AbsmaxArgs a) {
  float m = 0.0f;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const T* x = static_cast<const T*>(a.input) + a.input_rows.offset(r);
    for (int64_t c = threadIdx.x; c < a.hidden; c += blockDim.x) {
      m = nan_max(m, fabsf(load_float(x, c)));
    }
  }
  m = block_max(m);
  if (threadIdx.x == 0) {
    // Non-negative floats (and NaN with its sign cleared) order like their bits.
    atomicMax(reinterpret_cast<unsigned int*>(a.result), float_bits(m) & 0x7FFFFFFFu);
  }
}

template <Fp8Format kFormat>
__global__ void per_tensor_scale_kernel(const float* absmax, const float* scale_ub, float* scale) {
  *scale = dynamic_scale(*absmax, scale_ub, kFormat);
}

template <Fp8Format kFormat, typename T>
__global__ void group_quant_kernel(GroupQuantArgs a) {
  const int64_t r = blockIdx.x;
  const T* x = static_cast<const T*>(a.input) + a.input_rows.offset(r);
  uint8_t* out = a.out + r * a.hidden;
  float* scales = a.scales + a.scale_rows.offset(r);
  const int lane = threadIdx.x % kWarp;
  const int warps = blockDim.x / kWarp;
  const int64_t groups = (a.hidden + a.group_size - 1) / a.group_size;
  const float bound = fp8_bound(kFormat);
  for (int64_t k = threadIdx.x / kWarp; k < groups; k += warps) {
    const int64_t begin = k * a.group_size;
    const int64_t end = min(begin + a.group_size, a.hidden);
    float m = 0.0f;
    for (int64_t c = begin + lane; c < end; c += kWarp) {
      m = nan_max(m, fabsf(load_float(x, c)));
    }
    const float s = group_scale(warp_max(m), a.use_ue8m0, kFormat);
    if (lane == 0) {
      scales[k * a.scale_group_stride] = s;
    }
    const float inv = 1.0f / s;
    for (int64_t c = begin + lane; c < end; c += kWarp) {
      out[c] = quantize_fp8<kFormat>(load_float(x, c) * inv, bound);
    }
  }
}

void static_quant_fp8_cuda(at::Tensor& out, const at::Tensor& input, const at::Tensor& scale) {
  const c10::cuda::CUDAGuard guard(input.device());
  run_static_quant("vllm_ir_c::static_quant_fp8", out, input, scale, [](const StaticQuantArgs& a) {
    const auto stream = c10::cuda::getCurrentCUDAStream();
    VLLM_IR_C_CUDA_FP8_DISPATCH(a, "static_quant_fp8", static_quant_kernel<F, scalar_t><<<a.rows, threads_for(a.hidden), 0, stream>>>(a));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void dynamic_quant_fp8_cuda(at::Tensor& out, at::Tensor& scale, const at::Tensor& input,
                            const std::optional<at::Tensor>& scale_ub, bool per_token) {
  constexpr const char* op = "vllm_ir_c::dynamic_quant_fp8";
  const c10::cuda::CUDAGuard guard(input.device());
  check_quant_io(op, out, input);
  check_float_scale(op, "scale", scale, input);
  TORCH_CHECK(scale.is_contiguous(), op, ": scale must be contiguous");
  const float* ub = ub_or_null(op, scale_ub, input);
  const Fp8Format format = fp8_format(op, out);
  const int64_t hidden = input.size(-1);
  const int64_t rows = hidden == 0 ? 0 : input.numel() / hidden;
  TORCH_CHECK(scale.numel() == (per_token ? rows : 1), op, ": scale has ", scale.numel(), " elements, expected ",
              per_token ? rows : 1);
  const at::Tensor x = staged(input);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (per_token) {
    if (rows == 0 || hidden == 0) {
      return;
    }
    DynamicQuantArgs a{input.scalar_type(), format, static_cast<uint8_t*>(out.mutable_data_ptr()),
                       scale.mutable_data_ptr<float>(), x.const_data_ptr(), row_layout(x), rows, hidden, ub};
    VLLM_IR_C_CUDA_FP8_DISPATCH(a, "dynamic_quant_fp8",
                                  dynamic_per_token_kernel<F, scalar_t><<<rows, threads_for(hidden), 0, stream>>>(a));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  at::Tensor absmax = at::zeros({1}, input.options().dtype(at::kFloat));
  if (input.numel() > 0) {
    AbsmaxArgs m{input.scalar_type(), x.const_data_ptr(), row_layout(x), rows, hidden, absmax.mutable_data_ptr<float>()};
    const int blocks = static_cast<int>(std::min<int64_t>(rows, 1024));
    VLLM_IR_C_DISPATCH_FLOATING_TYPES(m.dtype, "dynamic_quant_fp8", [&] {
      absmax_kernel<scalar_t><<<blocks, threads_for(hidden), 0, stream>>>(m);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (format == Fp8Format::E4M3FNUZ) {
    per_tensor_scale_kernel<Fp8Format::E4M3FNUZ><<<1, 1, 0, stream>>>(absmax.const_data_ptr<float>(), ub,
                                                                     scale.mutable_data_ptr<float>());
  } else {
    per_tensor_scale_kernel<Fp8Format::E4M3FN><<<1, 1, 0, stream>>>(absmax.const_data_ptr<float>(), ub,
                                                                   scale.mutable_data_ptr<float>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (input.numel() > 0) {
    const StaticQuantArgs a = static_quant_args(op, out, x, scale, input);
    VLLM_IR_C_CUDA_FP8_DISPATCH(a, "dynamic_quant_fp8",
                                  static_quant_kernel<F, scalar_t><<<a.rows, threads_for(a.hidden), 0, stream>>>(a));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void dynamic_group_quant_fp8_cuda(at::Tensor& out, at::Tensor& scales, const at::Tensor& input, int64_t group_size,
                                  bool use_ue8m0) {
  const c10::cuda::CUDAGuard guard(input.device());
  run_group_quant("vllm_ir_c::dynamic_group_quant_fp8", out, scales, input, group_size, use_ue8m0,
                  [](const GroupQuantArgs& a) {
                    const auto stream = c10::cuda::getCurrentCUDAStream();
                    VLLM_IR_C_CUDA_FP8_DISPATCH(
                        a, "dynamic_group_quant_fp8",
                        group_quant_kernel<F, scalar_t><<<a.rows, 8 * kWarp, 0, stream>>>(a));
                    C10_CUDA_KERNEL_LAUNCH_CHECK();
                  });
}

}  // namespace
}  // namespace vllm_ir_c

TORCH_LIBRARY_IMPL(vllm_ir_c, CUDA, m) {
  m.impl("static_quant_fp8", &vllm_ir_c::static_quant_fp8_cuda);
  m.impl("dynamic_quant_fp8", &vllm_ir_c::dynamic_quant_fp8_cuda);
  m.impl("dynamic_group_quant_fp8", &vllm_ir_c::dynamic_group_quant_fp8_cuda);
}
