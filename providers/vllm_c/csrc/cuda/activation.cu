// The activation family on CUDA: the gated ops (one thread block per row, threads striding
// over the row's d outputs; gelu_and_mul_sparse's block also reduces the row's statistics)
// and the elementwise ones (a grid-stride loop over dense memory), and the torch side (CUDA
// registrations; the schemas are defined by cpu/activation.cpp).
//
// Same numerics as the CPU kernels and the op declarations: fp32 math; the gated ops round
// the activation to the input dtype, then the product (swigluoai and gelu_and_mul_sparse:
// every step, as native computes it in x's dtype); gelu_new and gelu_fast round every step
// of vLLM's native expression as torch's CUDA ops do; quick_gelu and relu2 round once.
// CUDA's expf, erff and tanhf are not ATen's CPU functions, so results are within the ops'
// tolerances of native, not bit-identical. Rows whose pointers and strides allow it are
// moved in 16-byte packs.

#include "../activation.h"
#include "cuda_common.h"

#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

namespace vllm_ir_c {
namespace {

using namespace cuda_common;

__device__ __forceinline__ float silu(float x) {
  return x / (1.0f + expf(-x));
}

__device__ __forceinline__ float sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}

// ---------------------------------------------------------------------------------------
// gated activations: fp32 act of the gate (before its rounding to T)

struct SiluAct {
  __device__ float operator()(float x) const {
    return silu(x);
  }
};

struct GeluErfAct {
  __device__ float operator()(float x) const {
    return x * 0.5f * (1.0f + erff(x * static_cast<float>(M_SQRT1_2)));
  }
};

struct GeluTanhAct {
  __device__ float operator()(float x) const {
    const float beta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);
    const float kappa = static_cast<float>(0.044715);
    const float inner = beta * (x + kappa * (x * x * x));
    return 0.5f * x * (1.0f + tanhf(inner));
  }
};

// F.threshold(x, threshold, 0): x <= threshold becomes 0; NaN stays.
struct FatreluAct {
  float threshold;
  __device__ float operator()(float x) const {
    return x <= threshold ? 0.0f : x;
  }
};

// out[r, i] = round(round(act(gate)) * up): gate and up are the halves of a row.
template <typename T, int kPack, typename Act>
__global__ void act_and_mul_kernel(GatedArgs a, Act act, bool gate_first) {
  using P = Pack<T, kPack>;
  const int64_t row = blockIdx.x;
  const T* in = static_cast<const T*>(a.input) + a.input_rows.offset(row);
  const P* gate = reinterpret_cast<const P*>(gate_first ? in : in + a.d);
  const P* up = reinterpret_cast<const P*>(gate_first ? in + a.d : in);
  P* out = reinterpret_cast<P*>(static_cast<T*>(a.out) + a.out_rows.offset(row));
  const int64_t packs = a.d / kPack;
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const P g = gate[i];
    const P u = up[i];
    P y;
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      const float activated = round_to<T>(act(static_cast<float>(g.v[k])));
      y.v[k] = static_cast<T>(activated * static_cast<float>(u.v[k]));
    }
    out[i] = y;
  }
}

// GPT-OSS's clamped SwiGLU on interleaved (gate, up) pairs, each step rounded to T.
template <typename T>
__global__ void swigluoai_and_mul_kernel(GatedArgs a) {
  const int64_t row = blockIdx.x;
  const T* in = static_cast<const T*>(a.input) + a.input_rows.offset(row);
  T* out = static_cast<T*>(a.out) + a.out_rows.offset(row);
  const float alpha = a.p0;
  const float limit = a.p1;
  for (int64_t i = threadIdx.x; i < a.d; i += blockDim.x) {
    const float gf = static_cast<float>(in[2 * i]);
    const float uf = static_cast<float>(in[2 * i + 1]);
    // fminf/fmaxf would drop a NaN: clamp keeps it, like native.
    const float g = round_to<T>(isnan(gf) ? gf : fminf(gf, limit));
    const float u = round_to<T>(isnan(uf) ? uf : fminf(fmaxf(uf, -limit), limit));
    const float glu = round_to<T>(g * round_to<T>(sigmoid(round_to<T>(g * alpha))));
    out[i] = static_cast<T>(round_to<T>(u + 1.0f) * glu);
  }
}

// gelu_and_mul_sparse: one block per row. The gate's mean (an fp32 block sum / d) and its
// population std (fp32 squared deviations from that mean), each rounded to T as native's
// mean and std are; cutoff = round(mean + round(std * std_multiplier)); then
// round(round(gelu(relu(round(gate - cutoff)))) * up). The gate is read three times (L2 holds it).
template <typename T, typename Act>
__global__ void gelu_and_mul_sparse_kernel(SparseGeluArgs a, Act act) {
  const int64_t row = blockIdx.x;
  const T* gate = static_cast<const T*>(a.input) + a.input_rows.offset(row);
  const T* up = gate + a.d;
  T* out = static_cast<T*>(a.out) + a.out_rows.offset(row);
  const float d = static_cast<float>(a.d);
  __shared__ float mean;
  __shared__ float cutoff;
  float partial = 0.0f;
  for (int64_t i = threadIdx.x; i < a.d; i += blockDim.x) {
    partial += static_cast<float>(gate[i]);
  }
  const float total = block_sum(partial);
  if (threadIdx.x == 0) {
    mean = total / d;
  }
  __syncthreads();  // also: every thread is past block_sum's reads before it runs again
  float squares = 0.0f;
  for (int64_t i = threadIdx.x; i < a.d; i += blockDim.x) {
    const float centered = static_cast<float>(gate[i]) - mean;
    squares += centered * centered;
  }
  const float total_squares = block_sum(squares);
  if (threadIdx.x == 0) {
    const float std = round_to<T>(sqrtf(total_squares / d));
    cutoff = round_to<T>(round_to<T>(mean) + round_to<T>(std * a.std_multiplier));
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < a.d; i += blockDim.x) {
    float s = round_to<T>(static_cast<float>(gate[i]) - cutoff);
    s = isnan(s) ? s : fmaxf(s, 0.0f);  // relu keeps NaN
    out[i] = static_cast<T>(round_to<T>(act(s)) * static_cast<float>(up[i]));
  }
}

// ---------------------------------------------------------------------------------------
// elementwise activations: fp32 math, rounded once

// 0.5 * x * (1 + tanh(u)) from u, each step rounded to T as torch's ops round it.
template <typename T>
__device__ __forceinline__ float half_x_one_plus_tanh(float x, float u) {
  return round_to<T>(0.5f * x) * round_to<T>(1.0f + round_to<T>(tanhf(u)));
}

// vLLM's NewGELU.forward_native: 0.5 * x * (1 + tanh(c * (x + 0.044715 * pow(x, 3.0)))), in
// x's dtype. torch's CUDA pow(x, 3.0) is base * base * base in the dtype: for 16-bit T, x * x
// is rounded before its product with x (the CPU's fp16 pow rounds the cube once).
template <typename T>
struct GeluNewFn {
  __device__ float operator()(float x) const {
    const float c = static_cast<float>(0.7978845608028654);  // sqrt(2 / pi)
    const float kappa = static_cast<float>(0.044715);
    const float cube = round_to<T>(round_to<T>(x * x) * x);
    const float u = round_to<T>(c * round_to<T>(x + round_to<T>(kappa * cube)));
    return half_x_one_plus_tanh<T>(x, u);
  }
};

// vLLM's FastGELU.forward_native: 0.5 * x * (1 + tanh(x * 0.7978845608 * (1 + 0.044715 * x * x))).
template <typename T>
struct GeluFastFn {
  __device__ float operator()(float x) const {
    const float c = static_cast<float>(0.7978845608);
    const float kappa = static_cast<float>(0.044715);
    const float e = round_to<T>(1.0f + round_to<T>(round_to<T>(kappa * x) * x));
    return half_x_one_plus_tanh<T>(x, round_to<T>(round_to<T>(x * c) * e));
  }
};

struct QuickGeluFn {
  __device__ float operator()(float x) const {
    return x * sigmoid(static_cast<float>(1.702) * x);
  }
};

struct Relu2Fn {
  __device__ float operator()(float x) const {
    const float r = isnan(x) ? x : fmaxf(x, 0.0f);
    return r * r;
  }
};

template <typename T, int kPack, typename Fn>
__global__ void elementwise_kernel(ElementwiseArgs a, Fn fn) {
  using P = Pack<T, kPack>;
  const P* in = static_cast<const P*>(a.input);
  P* out = static_cast<P*>(a.out);
  const int64_t packs = a.n / kPack;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < packs; i += stride) {
    const P x = in[i];
    P y;
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      y.v[k] = static_cast<T>(fn(static_cast<float>(x.v[k])));
    }
    out[i] = y;
  }
}

// ---------------------------------------------------------------------------------------
// launches

constexpr int kThreads = 256;

template <typename T, typename Act>
void launch_act_and_mul(const GatedArgs& a, Act act, bool gate_first, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.rows));
  // The up half starts d elements after the gate: packs need d itself to be a whole number of them.
  const bool packed = a.d % kVecPack<T> == 0 && rows_aligned(a.input, a.input_rows, sizeof(T), 16) &&
                      rows_aligned(a.out, a.out_rows, sizeof(T), 16);
  const int64_t work = packed ? a.d / kVecPack<T> : a.d;
  const dim3 block(static_cast<unsigned>(std::clamp<int64_t>((work + 31) / 32 * 32, 32, 1024)));
  if (packed) {
    act_and_mul_kernel<T, kVecPack<T>><<<grid, block, 0, stream>>>(a, act, gate_first);
  } else {
    act_and_mul_kernel<T, 1><<<grid, block, 0, stream>>>(a, act, gate_first);
  }
}

cudaError_t launch_gated(const GatedArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.d == 0) {
    return cudaSuccess;
  }
  if (a.rows > INT32_MAX) {
    return cudaErrorInvalidConfiguration;
  }
  VLLM_IR_C_DISPATCH_FLOATING_TYPES(a.dtype, "vllm_ir_c gated activation (cuda)", [&] {
    switch (a.kind) {
      case GatedKind::kSiluAndMul:
        return launch_act_and_mul<scalar_t>(a, SiluAct{}, true, stream);
      case GatedKind::kMulAndSilu:
        return launch_act_and_mul<scalar_t>(a, SiluAct{}, false, stream);
      case GatedKind::kGeluAndMul:
        return launch_act_and_mul<scalar_t>(a, GeluErfAct{}, true, stream);
      case GatedKind::kGeluTanhAndMul:
        return launch_act_and_mul<scalar_t>(a, GeluTanhAct{}, true, stream);
      case GatedKind::kFatreluAndMul:
        return launch_act_and_mul<scalar_t>(a, FatreluAct{a.p0}, true, stream);
      case GatedKind::kSwigluoaiAndMul: {
        const dim3 block(static_cast<unsigned>(std::clamp<int64_t>((a.d + 31) / 32 * 32, 32, 1024)));
        swigluoai_and_mul_kernel<scalar_t><<<dim3(static_cast<unsigned>(a.rows)), block, 0, stream>>>(a);
        return;
      }
    }
  });
  return cudaGetLastError();
}

cudaError_t launch_sparse_gelu(const SparseGeluArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.d == 0) {
    return cudaSuccess;
  }
  if (a.rows > INT32_MAX) {
    return cudaErrorInvalidConfiguration;
  }
  const dim3 grid(static_cast<unsigned>(a.rows));
  const dim3 block(static_cast<unsigned>(threads_for(a.d, 1024)));
  VLLM_IR_C_DISPATCH_FLOATING_TYPES(a.dtype, "vllm_ir_c gelu_and_mul_sparse (cuda)", [&] {
    if (a.tanh) {
      gelu_and_mul_sparse_kernel<scalar_t><<<grid, block, 0, stream>>>(a, GeluTanhAct{});
    } else {
      gelu_and_mul_sparse_kernel<scalar_t><<<grid, block, 0, stream>>>(a, GeluErfAct{});
    }
  });
  return cudaGetLastError();
}

template <typename T, typename Fn>
void launch_elementwise_fn(const ElementwiseArgs& a, Fn fn, cudaStream_t stream) {
  const bool packed = a.n % kVecPack<T> == 0 && aligned(a.input, 16) && aligned(a.out, 16);
  const int64_t work = packed ? a.n / kVecPack<T> : a.n;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((work + kThreads - 1) / kThreads, 65535)));
  if (packed) {
    elementwise_kernel<T, kVecPack<T>><<<grid, kThreads, 0, stream>>>(a, fn);
  } else {
    elementwise_kernel<T, 1><<<grid, kThreads, 0, stream>>>(a, fn);
  }
}

cudaError_t launch_elementwise(const ElementwiseArgs& a, cudaStream_t stream) {
  if (a.n == 0) {
    return cudaSuccess;
  }
  VLLM_IR_C_DISPATCH_FLOATING_TYPES(a.dtype, "vllm_ir_c elementwise activation (cuda)", [&] {
    switch (a.kind) {
      case ElementwiseKind::kGeluNew:
        return launch_elementwise_fn<scalar_t>(a, GeluNewFn<scalar_t>{}, stream);
      case ElementwiseKind::kGeluFast:
        return launch_elementwise_fn<scalar_t>(a, GeluFastFn<scalar_t>{}, stream);
      case ElementwiseKind::kQuickGelu:
        return launch_elementwise_fn<scalar_t>(a, QuickGeluFn{}, stream);
      case ElementwiseKind::kRelu2:
        return launch_elementwise_fn<scalar_t>(a, Relu2Fn{}, stream);
    }
  });
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------
// torch side

void run_gated_kernel(const GatedArgs& args) {
  C10_CUDA_CHECK(launch_gated(args, c10::cuda::getCurrentCUDAStream()));
}

void run_elementwise_kernel(const ElementwiseArgs& args) {
  C10_CUDA_CHECK(launch_elementwise(args, c10::cuda::getCurrentCUDAStream()));
}

void gated_cuda(const char* op, at::Tensor& out, const at::Tensor& input, GatedKind kind, double p0 = 0.0,
                double p1 = 0.0) {
  const c10::cuda::CUDAGuard guard(input.device());
  run_gated(op, out, input, kind, p0, p1, run_gated_kernel);
}

void silu_and_mul_cuda(at::Tensor& out, const at::Tensor& input) {
  gated_cuda("vllm_ir_c::silu_and_mul", out, input, GatedKind::kSiluAndMul);
}

void mul_and_silu_cuda(at::Tensor& out, const at::Tensor& input) {
  gated_cuda("vllm_ir_c::mul_and_silu", out, input, GatedKind::kMulAndSilu);
}

void gelu_and_mul_cuda(at::Tensor& out, const at::Tensor& input, const std::string& approximate) {
  constexpr const char* op = "vllm_ir_c::gelu_and_mul";
  gated_cuda(op, out, input, gelu_kind(op, approximate));
}

void fatrelu_and_mul_cuda(at::Tensor& out, const at::Tensor& input, double threshold) {
  gated_cuda("vllm_ir_c::fatrelu_and_mul", out, input, GatedKind::kFatreluAndMul, threshold);
}

void swigluoai_and_mul_cuda(at::Tensor& out, const at::Tensor& input, double alpha, double limit) {
  gated_cuda("vllm_ir_c::swigluoai_and_mul", out, input, GatedKind::kSwigluoaiAndMul, alpha, limit);
}

void run_sparse_gelu_kernel(const SparseGeluArgs& args) {
  C10_CUDA_CHECK(launch_sparse_gelu(args, c10::cuda::getCurrentCUDAStream()));
}

// The kernel computes its rows' means itself (no ATen mean: one launch).
void gelu_and_mul_sparse_cuda(at::Tensor& out, const at::Tensor& input, double std_multiplier,
                              const std::string& approximate) {
  const c10::cuda::CUDAGuard guard(input.device());
  run_sparse_gelu(out, input, std_multiplier, approximate, [](const at::Tensor&) { return at::Tensor(); },
                  run_sparse_gelu_kernel);
}

void elementwise_cuda(const char* op, at::Tensor& out, const at::Tensor& input, ElementwiseKind kind) {
  const c10::cuda::CUDAGuard guard(input.device());
  run_elementwise(op, out, input, kind, run_elementwise_kernel);
}

void gelu_new_cuda(at::Tensor& out, const at::Tensor& input) {
  elementwise_cuda("vllm_ir_c::gelu_new", out, input, ElementwiseKind::kGeluNew);
}

void gelu_fast_cuda(at::Tensor& out, const at::Tensor& input) {
  elementwise_cuda("vllm_ir_c::gelu_fast", out, input, ElementwiseKind::kGeluFast);
}

void quick_gelu_cuda(at::Tensor& out, const at::Tensor& input) {
  elementwise_cuda("vllm_ir_c::quick_gelu", out, input, ElementwiseKind::kQuickGelu);
}

void relu2_cuda(at::Tensor& out, const at::Tensor& input) {
  elementwise_cuda("vllm_ir_c::relu2", out, input, ElementwiseKind::kRelu2);
}

}  // namespace
}  // namespace vllm_ir_c

TORCH_LIBRARY_IMPL(vllm_ir_c, CUDA, m) {
  m.impl("silu_and_mul", &vllm_ir_c::silu_and_mul_cuda);
  m.impl("mul_and_silu", &vllm_ir_c::mul_and_silu_cuda);
  m.impl("gelu_and_mul", &vllm_ir_c::gelu_and_mul_cuda);
  m.impl("fatrelu_and_mul", &vllm_ir_c::fatrelu_and_mul_cuda);
  m.impl("swigluoai_and_mul", &vllm_ir_c::swigluoai_and_mul_cuda);
  m.impl("gelu_and_mul_sparse", &vllm_ir_c::gelu_and_mul_sparse_cuda);
  m.impl("gelu_new", &vllm_ir_c::gelu_new_cuda);
  m.impl("gelu_fast", &vllm_ir_c::gelu_fast_cuda);
  m.impl("quick_gelu", &vllm_ir_c::quick_gelu_cuda);
  m.impl("relu2", &vllm_ir_c::relu2_cuda);
}
