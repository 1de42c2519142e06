// The activation family: kernel arguments shared by cpu/activation.cpp and cuda/activation.cu,
// and the torch side both devices run around their kernels (argument checks, staging awkward
// layouts, filling the arguments).
//
// Gated ops map a row [.., 2d] to [.., d]: the activation of the gate times the up value.
// Elementwise ops map every element independently and keep the shape.
#pragma once

#include <cstdint>

#include "kernel_common.h"

namespace vllm_ir_c {

// Which gated activation; the numerics of each are those of its op declaration
// (vllm_ir/ir/declarations/activation.py), rounding point for rounding point.
enum class GatedKind : int32_t {
  kSiluAndMul,        // silu(x[:d]) * x[d:]
  kMulAndSilu,        // x[:d] * silu(x[d:])
  kGeluAndMul,        // gelu_erf(x[:d]) * x[d:]
  kGeluTanhAndMul,    // gelu_tanh(x[:d]) * x[d:]
  kFatreluAndMul,     // (x[:d] <= p0 ? 0 : x[:d]) * x[d:]
  kSwigluoaiAndMul,   // interleaved: gate x[0::2], up x[1::2]; p0 = alpha, p1 = limit
};

// out[r, :d] = act(input[r]) for every row r (input rows are 2d wide, unit stride).
struct GatedArgs {
  c10::ScalarType dtype;
  GatedKind kind;
  void* out;
  RowLayout out_rows;
  const void* input;
  RowLayout input_rows;
  int64_t rows;
  int64_t d;
  float p0;  // fatrelu: threshold; swigluoai: alpha
  float p1;  // swigluoai: limit
};

// gelu_and_mul_sparse (vLLM's Gaussian-sparsified GeGLU, Gemma 3n) on rows [.., 2d] -> [.., d]:
//   cutoff_r = round(mean_r + round(round(std_r) * std_multiplier)),
//   out[r, i] = round(round(gelu(relu(round(gate_i - cutoff_r)))) * up_i),
// every rounding to the input dtype, std_r the population std of the row's gate. `means`
// (one value of the input dtype per row, dense) is the row's mean as native computes it
// (ATen's own mean, run by the torch side); null: the kernel sums in fp32 itself (CUDA).
struct SparseGeluArgs {
  c10::ScalarType dtype;
  bool tanh;  // approximate="tanh", else the erf form
  void* out;
  RowLayout out_rows;
  const void* input;
  RowLayout input_rows;
  int64_t rows;
  int64_t d;
  const void* means;
  float std_multiplier;
  // CPU only: write the sparse gate, relu(gate - cutoff) in x's dtype, instead of the product
  // (the torch side then applies ATen's own gelu and multiply, see cpu/activation.cpp).
  bool gate_only = false;
};

enum class ElementwiseKind : int32_t {
  kGeluNew,    // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  kGeluFast,   // 0.5 x (1 + tanh(0.7978845608 x (1 + 0.044715 x^2)))
  kQuickGelu,  // x sigmoid(1.702 x)
  kRelu2,      // relu(x)^2
};

// out[i] = f(input[i]) for i < n: both dense with the same strides, walked in memory order.
struct ElementwiseArgs {
  c10::ScalarType dtype;
  ElementwiseKind kind;
  void* out;
  const void* input;
  int64_t n;
};

}  // namespace vllm_ir_c

#if VLLM_IR_C_TORCH_SIDE

#include <ATen/MemoryOverlap.h>

#include <string>

#include "ops_common.h"

namespace vllm_ir_c {

inline void check_activation_dtype(const char* op, const at::Tensor& input, const at::Tensor& out) {
  TORCH_CHECK(is_supported_dtype(input.scalar_type()), op, ": unsupported dtype ", input.scalar_type(),
              " (float32, bfloat16 and float16 are supported)");
  TORCH_CHECK(out.scalar_type() == input.scalar_type(), op, ": out is ", out.scalar_type(), ", input is ",
              input.scalar_type());
  TORCH_CHECK(out.device() == input.device(), op, ": out is on ", out.device(), ", input on ", input.device());
}

// out <- the gated activation of input: checks, stages awkward layouts, runs `kernel`, copies
// a staged result back.
template <typename Kernel>
void run_gated(const char* op, at::Tensor& out, const at::Tensor& input, GatedKind kind, double p0, double p1,
               Kernel&& kernel) {
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) % 2 == 0, op, ": input must end in an even dimension, got ",
              input.sizes());
  check_activation_dtype(op, input, out);
  auto expected = input.sizes().vec();
  expected.back() /= 2;
  TORCH_CHECK(out.sizes() == at::IntArrayRef(expected), op, ": out has shape ", out.sizes(), ", expected ",
              at::IntArrayRef(expected));
  at::assert_no_overlap(out, input);
  if (out.numel() == 0) {
    return;
  }
  const at::Tensor x = staged(input);
  at::Tensor y = output_buffer(out);
  GatedArgs args{input.scalar_type(),
                 kind,
                 y.mutable_data_ptr(),
                 row_layout(y),
                 x.const_data_ptr(),
                 row_layout(x),
                 out.numel() / out.size(-1),
                 out.size(-1),
                 static_cast<float>(p0),
                 static_cast<float>(p1)};
  kernel(args);
  unstage(out, y);
}

// out <- gelu_and_mul_sparse(input, std_multiplier, approximate): the checks of run_gated,
// then `kernel` on filled arguments whose `means` are `means_of(x)` (x: the staged input).
template <typename Means, typename Kernel>
void run_sparse_gelu(at::Tensor& out, const at::Tensor& input, double std_multiplier, const std::string& approximate,
                     Means&& means_of, Kernel&& kernel) {
  constexpr const char* op = "vllm_ir_c::gelu_and_mul_sparse";
  TORCH_CHECK_VALUE(approximate == "none" || approximate == "tanh", op,
                    ": approximate must be 'none' or 'tanh', not '", approximate, "'");
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) % 2 == 0, op, ": input must end in an even dimension, got ",
              input.sizes());
  check_activation_dtype(op, input, out);
  auto expected = input.sizes().vec();
  expected.back() /= 2;
  TORCH_CHECK(out.sizes() == at::IntArrayRef(expected), op, ": out has shape ", out.sizes(), ", expected ",
              at::IntArrayRef(expected));
  at::assert_no_overlap(out, input);
  if (out.numel() == 0) {
    return;
  }
  const at::Tensor x = staged(input);
  at::Tensor y = output_buffer(out);
  const at::Tensor means = means_of(x);
  SparseGeluArgs args{input.scalar_type(),
                      approximate == "tanh",
                      y.mutable_data_ptr(),
                      row_layout(y),
                      x.const_data_ptr(),
                      row_layout(x),
                      out.numel() / out.size(-1),
                      out.size(-1),
                      means.defined() ? means.const_data_ptr() : nullptr,
                      static_cast<float>(std_multiplier)};
  kernel(args);
  unstage(out, y);
}

// The gelu_and_mul variant `approximate` names, or an error naming the op.
inline GatedKind gelu_kind(const char* op, const std::string& approximate) {
  TORCH_CHECK_VALUE(approximate == "none" || approximate == "tanh", op,
                    ": approximate must be 'none' or 'tanh', not '", approximate, "'");
  return approximate == "tanh" ? GatedKind::kGeluTanhAndMul : GatedKind::kGeluAndMul;
}

// Runs an elementwise kernel over dense memory: `input` and `out` as they are when both are
// dense with the same strides (the common case: out = empty_like(input)), else over a
// contiguous copy of input into a contiguous buffer copied back to out.
template <typename Kernel>
void run_elementwise(const char* op, at::Tensor& out, const at::Tensor& input, ElementwiseKind kind,
                     Kernel&& kernel) {
  check_activation_dtype(op, input, out);
  TORCH_CHECK(out.sizes() == input.sizes(), op, ": out has shape ", out.sizes(), ", input has ", input.sizes());
  at::assert_no_partial_overlap(out, input);
  if (out.numel() == 0) {
    return;
  }
  const bool direct = input.is_non_overlapping_and_dense() && out.is_non_overlapping_and_dense() &&
                      input.strides() == out.strides();
  const at::Tensor x = direct ? input : input.contiguous();
  at::Tensor y = direct || out.is_contiguous() ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
  kernel(ElementwiseArgs{input.scalar_type(), kind, y.mutable_data_ptr(), x.const_data_ptr(), out.numel()});
  unstage(out, y);
}

}  // namespace vllm_ir_c

#endif  // VLLM_IR_C_TORCH_SIDE
