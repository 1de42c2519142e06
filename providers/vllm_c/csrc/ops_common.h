// Tensor-side helpers shared by every op's CPU and CUDA implementations: layouts, staging,
// argument checks. Not for the per-ISA CPU kernel compilations (see kernel_common.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <optional>

#include "kernel_common.h"

namespace vllm_ir_c {

inline bool is_supported_dtype(c10::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// The kernels walk rows with unit stride along the last dimension and at most
// RowLayout::kMaxBatchDims non-trivial batch dimensions. Other layouts run on a contiguous
// copy, so a direct torch.ops.vllm_ir_c call is correct whatever its layout (vllm-ir's
// predicates decline such layouts with a reason, and its cache keys on every stride).
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

inline const void* data_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr() : nullptr;
}

// Where a kernel writes `out`: `out` itself, or a contiguous buffer when its layout needs
// staging (copy it back with `unstage`).
inline at::Tensor output_buffer(const at::Tensor& out) {
  return needs_staging(out) ? at::empty_like(out, at::MemoryFormat::Contiguous) : out;
}

inline void unstage(at::Tensor& out, const at::Tensor& buffer) {
  if (!buffer.is_same(out)) {
    out.copy_(buffer);
  }
}

}  // namespace vllm_ir_c
