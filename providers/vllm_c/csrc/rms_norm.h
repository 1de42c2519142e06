// Arguments shared by the CPU and CUDA RMSNorm kernels.
//
// Plain data only: this header is included by the per-ISA CPU translation units and by
// nvcc, so it must not pull in the Tensor API (see cpu/rms_norm_kernels.cpp).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/macros/Macros.h>

#include <cstdint>

namespace vllm_ir_c {

// Where the rows of a [..., hidden] tensor with unit stride along hidden live:
// row r starts `offset(r)` elements after the data pointer. Batch dimensions that
// collapse to one stride (contiguous tensors, slices of a wider last dimension) take
// the fast path; others (e.g. a slice along a middle dimension) are unravelled per row.
struct RowLayout {
  static constexpr int kMaxBatchDims = 6;

  // Stride between consecutive rows when the batch dims collapse, else -1.
  int64_t row_stride = 0;
  int32_t batch_dims = 0;
  int64_t sizes[kMaxBatchDims] = {};
  int64_t strides[kMaxBatchDims] = {};

  C10_HOST_DEVICE int64_t offset(int64_t row) const {
    if (row_stride >= 0) {
      return row * row_stride;
    }
    int64_t off = 0;
    for (int32_t d = batch_dims - 1; d >= 0; --d) {
      off += (row % sizes[d]) * strides[d];
      row /= sizes[d];
    }
    return off;
  }
};

// out[r] = rms_norm(input[r]) * weight, for every row r.
struct RmsNormArgs {
  c10::ScalarType dtype;
  void* out;
  RowLayout out_rows;
  const void* input;
  RowLayout input_rows;
  const void* weight;  // [hidden] in `dtype`, or nullptr
  int64_t rows;
  int64_t hidden;
  float epsilon;
};

// residual[r] = input[r] + residual[r]; input[r] = rms_norm(that sum, in fp32) * weight.
struct FusedAddRmsNormArgs {
  c10::ScalarType dtype;
  void* input;
  RowLayout input_rows;
  void* residual;
  RowLayout residual_rows;
  const void* weight;  // [hidden] in `dtype`, or nullptr
  int64_t rows;
  int64_t hidden;
  float epsilon;
};

}  // namespace vllm_ir_c

// The dtypes the kernels support; the one dispatch point of every kernel entry.
#define VLLM_IR_C_DISPATCH_FLOATING_TYPES(TYPE, NAME, ...)            \
  AT_DISPATCH_SWITCH(                                                 \
      TYPE,                                                           \
      NAME,                                                           \
      AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__)            \
          AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__)     \
              AT_DISPATCH_CASE(at::ScalarType::Half, __VA_ARGS__))
