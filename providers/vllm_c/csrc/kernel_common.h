// Plain-data building blocks shared by every op's kernels: row layouts and the dtype switch.
//
// This header is included by the per-ISA CPU kernel compilations and by nvcc, so it must not
// pull in the Tensor API (see cpu/dispatch_stub.h); ops_common.h has the Tensor-side helpers.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/macros/Macros.h>

#include <cstdint>

// 1 where the Tensor API may be used: everywhere but the per-ISA CPU kernel compilations
// (cpu/*.cpp are compiled once per CPU capability; only the DEFAULT one, baseline ISA,
// holds an op's schema, argument checks and torch registrations).
#if !defined(CPU_CAPABILITY) || defined(CPU_CAPABILITY_DEFAULT)
#define VLLM_IR_C_TORCH_SIDE 1
#else
#define VLLM_IR_C_TORCH_SIDE 0
#endif

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

}  // namespace vllm_ir_c

// The floating dtypes the kernels support; the one dtype switch of every kernel entry.
#define VLLM_IR_C_DISPATCH_FLOATING_TYPES(TYPE, NAME, ...)            \
  AT_DISPATCH_SWITCH(                                                 \
      TYPE,                                                           \
      NAME,                                                           \
      AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__)            \
          AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__)     \
              AT_DISPATCH_CASE(at::ScalarType::Half, __VA_ARGS__))
