// The layernorm family (rms_norm, fused_add_rms_norm): kernel arguments shared by
// cpu/layernorm.cpp and cuda/layernorm.cu, and the torch side both devices run around their
// kernels (argument checks, staging awkward layouts, filling the arguments).
#pragma once

#include "kernel_common.h"

namespace vllm_ir_c {

// The weight is applied as vLLM 0.33 does: y = the row normalized in fp32; with a weight,
// y = y.to(weight dtype) * weight; out = y.to(dtype). A weight of `dtype` therefore rounds twice
// (y, then the product), an fp32 weight once (an fp32 multiply).

// out[r] = rms_norm(input[r], weight), for every row r.
struct RmsNormArgs {
  c10::ScalarType dtype;
  bool fp32_weight;  // weight is float32 while dtype is not: one fp32 multiply, one rounding
  void* out;
  RowLayout out_rows;
  const void* input;
  RowLayout input_rows;
  const void* weight;  // [hidden] in `dtype` or float32, or nullptr
  int64_t rows;
  int64_t hidden;
  float epsilon;
  // CPU: write `out` with non-temporal (cache-bypassing) stores, set where the call's activations
  // do not fit in the last-level cache (see stream_outputs); the CUDA kernels ignore it.
  bool stream_out = false;
  // CPU: the call's activations fit in the last-level cache; its rows then run interleaved
  // (cpu/layernorm.cpp). The CUDA kernels ignore it.
  bool in_cache = false;
};

// For every row r, with s = input[r] + residual[r] in fp32:
// residual_out[r] = s rounded to `dtype`; out[r] = rms_norm(s, weight) (of the fp32 s).
// In place when `out` is `input` and `residual_out` is `residual` (then with the same layouts);
// otherwise the outputs overlap neither input nor each other.
struct FusedAddRmsNormArgs {
  c10::ScalarType dtype;
  bool fp32_weight;  // as RmsNormArgs
  void* out;
  RowLayout out_rows;
  void* residual_out;
  RowLayout residual_out_rows;
  const void* input;
  RowLayout input_rows;
  const void* residual;
  RowLayout residual_rows;
  const void* weight;  // [hidden] in `dtype` or float32, or nullptr
  int64_t rows;
  int64_t hidden;
  float epsilon;
  bool stream_out = false;  // as RmsNormArgs, for `out` and `residual_out`; never in place
  bool in_cache = false;    // as RmsNormArgs (in place too)
};

}  // namespace vllm_ir_c

#if VLLM_IR_C_TORCH_SIDE

#include <ATen/MemoryOverlap.h>

#include <optional>

#include "ops_common.h"

namespace vllm_ir_c {

// Checks common to the family; returns the weight as a contiguous tensor (or nullopt).
inline std::optional<at::Tensor> check_norm_inputs(const char* op, const at::Tensor& input,
                                                   const std::optional<at::Tensor>& weight) {
  TORCH_CHECK(input.dim() >= 1, op, ": input must have at least one dimension");
  TORCH_CHECK(is_supported_dtype(input.scalar_type()), op, ": unsupported dtype ", input.scalar_type(),
              " (float32, bfloat16 and float16 are supported)");
  if (!weight.has_value()) {
    return std::nullopt;
  }
  const at::Tensor& w = *weight;
  TORCH_CHECK(w.dim() == 1 && w.size(0) == input.size(-1), op, ": weight must have shape [", input.size(-1),
              "], got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == input.scalar_type() || w.scalar_type() == at::kFloat, op, ": weight is ",
              w.scalar_type(), ", input is ", input.scalar_type(),
              " (the kernels take a weight of the input's dtype or float32)");
  TORCH_CHECK(w.device() == input.device(), op, ": weight is on ", w.device(), ", input on ", input.device());
  return w.contiguous();
}

// Whether `weight` is a float32 weight of a narrower input (RmsNormArgs::fp32_weight).
inline bool fp32_weight(const at::Tensor& input, const std::optional<at::Tensor>& weight) {
  return weight.has_value() && weight->scalar_type() != input.scalar_type();
}

// out <- rms_norm(input, weight): builds the kernel arguments, staging awkward layouts, runs
// `kernel`, and copies staged results back.
template <typename Kernel>
void run_rms_norm(const char* op, at::Tensor& out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                  double epsilon, Kernel&& kernel) {
  const auto w = check_norm_inputs(op, input, weight);
  check_activation(op, "out", out, input);
  if (input.numel() == 0) {
    return;
  }
  const at::Tensor x = staged(input);
  at::Tensor y = output_buffer(out);
  RmsNormArgs args{input.scalar_type(),
                   fp32_weight(input, w),
                   y.mutable_data_ptr(),
                   row_layout(y),
                   x.const_data_ptr(),
                   row_layout(x),
                   data_or_null(w),
                   input.numel() / input.size(-1),
                   input.size(-1),
                   static_cast<float>(epsilon)};
  kernel(args);
  unstage(out, y);
}

// The fused op in either form: in place (`out` is `input`, `residual_out` is `residual`) or
// into two other tensors, which must overlap neither input nor each other.
template <typename Kernel>
void run_fused_add_rms_norm(const char* op, at::Tensor& out, at::Tensor& residual_out, const at::Tensor& input,
                            const at::Tensor& residual, const std::optional<at::Tensor>& weight, double epsilon,
                            Kernel&& kernel) {
  const auto w = check_norm_inputs(op, input, weight);
  check_activation(op, "residual", residual, input);
  const bool in_place = out.is_same(input) && residual_out.is_same(residual);
  if (in_place) {
    TORCH_CHECK(!input.is_same(residual), op, ": input and residual must be different tensors");
  } else {
    check_activation(op, "out", out, input);
    check_activation(op, "residual_out", residual_out, input);
    for (const at::Tensor* source : {&input, &residual}) {
      at::assert_no_overlap(out, *source);
      at::assert_no_overlap(residual_out, *source);
    }
    at::assert_no_overlap(out, residual_out);
  }
  if (input.numel() == 0) {
    return;
  }
  const at::Tensor x = staged(input);
  const at::Tensor r = staged(residual);
  // In place, a staged activation is also where the result goes (and is copied back from).
  at::Tensor y = in_place ? x : output_buffer(out);
  at::Tensor s = in_place ? r : output_buffer(residual_out);
  FusedAddRmsNormArgs args{input.scalar_type(),
                           fp32_weight(input, w),
                           y.mutable_data_ptr(),
                           row_layout(y),
                           s.mutable_data_ptr(),
                           row_layout(s),
                           x.const_data_ptr(),
                           row_layout(x),
                           r.const_data_ptr(),
                           row_layout(r),
                           data_or_null(w),
                           input.numel() / input.size(-1),
                           input.size(-1),
                           static_cast<float>(epsilon)};
  kernel(args);
  unstage(out, y);
  unstage(residual_out, s);
}

}  // namespace vllm_ir_c

#endif  // VLLM_IR_C_TORCH_SIDE
