// Argument checks and layout handling shared by the CPU and CUDA op implementations.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <optional>

#include "rms_norm.h"

namespace vllm_ir_c {

inline bool is_supported_dtype(c10::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// The kernels walk rows with unit stride along the last dimension and at most
// RowLayout::kMaxBatchDims non-trivial batch dimensions. Other layouts run on a contiguous
// copy: the vllm-ir dispatch cache keys on is_contiguous(), not on strides, so a decision
// made for a row-strided tensor may be reused for a transposed one and must stay correct.
inline bool needs_staging(const at::Tensor& t) {
  if (t.size(-1) > 1 && t.stride(-1) != 1) {
    return true;
  }
  int64_t batch_dims = 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    batch_dims += t.size(d) != 1;
  }
  return batch_dims > RowLayout::kMaxBatchDims;
}

inline at::Tensor staged(const at::Tensor& t) {
  return needs_staging(t) ? t.contiguous() : t;
}

inline RowLayout row_layout(const at::Tensor& t) {
  RowLayout layout;
  // Size-1 dims never move the row index: drop them, then see whether the rest collapse.
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if (t.size(d) != 1) {
      TORCH_INTERNAL_ASSERT(layout.batch_dims < RowLayout::kMaxBatchDims);
      layout.sizes[layout.batch_dims] = t.size(d);
      layout.strides[layout.batch_dims] = t.stride(d);
      ++layout.batch_dims;
    }
  }
  if (layout.batch_dims == 0) {
    layout.row_stride = 0;
    return layout;
  }
  bool collapses = true;
  for (int32_t d = 0; d + 1 < layout.batch_dims; ++d) {
    collapses = collapses && layout.strides[d] == layout.strides[d + 1] * layout.sizes[d + 1];
  }
  layout.row_stride = collapses ? layout.strides[layout.batch_dims - 1] : -1;
  return layout;
}

inline void check_activation(const char* op, const char* name, const at::Tensor& t, const at::Tensor& input) {
  TORCH_CHECK(t.sizes() == input.sizes(), op, ": ", name, " has shape ", t.sizes(), ", input has ", input.sizes());
  TORCH_CHECK(t.scalar_type() == input.scalar_type(), op, ": ", name, " is ", t.scalar_type(), ", input is ",
              input.scalar_type());
  TORCH_CHECK(t.device() == input.device(), op, ": ", name, " is on ", t.device(), ", input on ", input.device());
}

// Checks common to both ops; returns the weight as a contiguous tensor (or nullopt).
inline std::optional<at::Tensor> check_inputs(const char* op, const at::Tensor& input,
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
  TORCH_CHECK(w.scalar_type() == input.scalar_type(), op, ": weight is ", w.scalar_type(), ", input is ",
              input.scalar_type(), " (the kernels multiply in the input dtype)");
  TORCH_CHECK(w.device() == input.device(), op, ": weight is on ", w.device(), ", input on ", input.device());
  return w.contiguous();
}

inline const void* data_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr() : nullptr;
}

// Builds the kernel arguments for out <- rms_norm(input), staging awkward layouts, runs
// `kernel`, and copies staged results back.
template <typename Kernel>
void run_rms_norm(const char* op, at::Tensor& out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                  double epsilon, Kernel&& kernel) {
  const auto w = check_inputs(op, input, weight);
  check_activation(op, "out", out, input);
  if (input.numel() == 0) {
    return;
  }
  const at::Tensor x = staged(input);
  at::Tensor y = needs_staging(out) ? at::empty_like(out, at::MemoryFormat::Contiguous) : out;
  RmsNormArgs args{input.scalar_type(),
                   y.mutable_data_ptr(),
                   row_layout(y),
                   x.const_data_ptr(),
                   row_layout(x),
                   data_or_null(w),
                   input.numel() / input.size(-1),
                   input.size(-1),
                   static_cast<float>(epsilon)};
  kernel(args);
  if (!y.is_same(out)) {
    out.copy_(y);
  }
}

// Builds the kernel arguments for the in-place fused op, staging awkward layouts.
template <typename Kernel>
void run_fused_add_rms_norm(const char* op, at::Tensor& input, at::Tensor& residual,
                            const std::optional<at::Tensor>& weight, double epsilon, Kernel&& kernel) {
  const auto w = check_inputs(op, input, weight);
  check_activation(op, "residual", residual, input);
  TORCH_CHECK(!input.is_same(residual), op, ": input and residual must be different tensors");
  if (input.numel() == 0) {
    return;
  }
  at::Tensor x = staged(input);
  at::Tensor r = staged(residual);
  FusedAddRmsNormArgs args{input.scalar_type(),
                           x.mutable_data_ptr(),
                           row_layout(x),
                           r.mutable_data_ptr(),
                           row_layout(r),
                           data_or_null(w),
                           input.numel() / input.size(-1),
                           input.size(-1),
                           static_cast<float>(epsilon)};
  kernel(args);
  if (!x.is_same(input)) {
    input.copy_(x);
  }
  if (!r.is_same(residual)) {
    residual.copy_(r);
  }
}

}  // namespace vllm_ir_c
