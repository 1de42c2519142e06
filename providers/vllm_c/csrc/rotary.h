// Rotary position embedding: kernel arguments shared by cpu/rotary.cpp and cuda/rotary.cu, and
// the torch side both devices run around their kernels (argument checks, the [T, heads,
// head_size] view of query and key, staging layouts that have none).
#pragma once

#include "kernel_common.h"

namespace vllm_ir_c {

// One tensor to rotate in place: element (t, h, i) is at data + t * token_stride +
// h * head_stride + i (unit stride along the head).
struct RotaryTarget {
  void* data;  // nullptr: absent (key=None)
  int64_t token_stride;
  int64_t head_stride;
  int64_t heads;
};

// For every token t, head h of query and key, and i < rotary_dim / 2, with
// cos = cache[positions[t], i], sin = cache[positions[t], rotary_dim / 2 + i]:
//   neox:  (x[i], x[i + r/2])  <- (x1*cos - x2*sin, x2*cos + x1*sin)
//   gpt-j: (x[2i], x[2i + 1])  <- the same,
// each product rounded to `dtype`, then the sum (the op declaration's rounding points).
struct RotaryArgs {
  c10::ScalarType dtype;  // of query, key and the cache
  const int64_t* positions;  // [tokens], contiguous
  const void* cache;  // [max_position, rotary_dim], unit stride along a row
  int64_t cache_stride;  // between rows
  int64_t max_position;
  RotaryTarget query;
  RotaryTarget key;
  int64_t tokens;
  int64_t rotary_dim;
  bool neox;
};

}  // namespace vllm_ir_c

#if VLLM_IR_C_TORCH_SIDE

#include <ATen/TensorUtils.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "ops_common.h"

namespace vllm_ir_c {

// `x` as [tokens, heads, head_size] with unit stride along the head, sharing x's memory when a
// view exists (at::detail::computeStride, as Tensor::view decides), else a contiguous copy
// that `finish_rotary` writes back.
struct RotaryView {
  at::Tensor original;
  at::Tensor view;
  bool staged = false;
};

inline RotaryView rotary_view(const char* op, const char* name, const at::Tensor& x, int64_t tokens,
                              int64_t head_size) {
  TORCH_CHECK(x.dim() >= 2, op, ": ", name, " must be [tokens, heads * head_size] or [..., heads, head_size], got ",
              x.sizes());
  TORCH_CHECK(x.numel() % (tokens * head_size) == 0, op, ": ", name, " of shape ", x.sizes(),
              " is not [", tokens, " tokens (positions has ", tokens, "), heads, ", head_size, "]");
  const at::DimVector shape{tokens, x.numel() / (tokens * head_size), head_size};
  const auto strides = at::detail::computeStride(x.sizes(), x.strides(), shape);
  if (strides.has_value() && ((*strides)[2] == 1 || head_size == 1)) {
    return {x, x.as_strided(shape, *strides), false};
  }
  return {x, x.reshape(shape).contiguous(), true};
}

inline RotaryTarget rotary_target(const RotaryView& v) {
  return {v.view.mutable_data_ptr(), v.view.stride(0), v.view.stride(1), v.view.size(1)};
}

inline void finish_rotary(RotaryView& v) {
  if (v.staged) {
    v.original.copy_(v.view.view(v.original.sizes()));
  }
}

// Rotates query (and key) in place: checks, views, runs `kernel(args)`, writes staged copies back.
template <typename Kernel>
void run_rotary(const char* op, const at::Tensor& positions, at::Tensor& query, std::optional<at::Tensor>& key,
                int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox, int64_t rotary_dim,
                Kernel&& kernel) {
  TORCH_CHECK(is_supported_dtype(query.scalar_type()), op, ": unsupported dtype ", query.scalar_type(),
              " (float32, bfloat16 and float16 are supported)");
  TORCH_CHECK(positions.scalar_type() == at::kLong, op, ": positions must be int64, got ", positions.scalar_type());
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == rotary_dim, op,
              ": cos_sin_cache must be [max_position, rotary_dim=", rotary_dim, "], got ", cos_sin_cache.sizes());
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim >= 0 && rotary_dim <= head_size && head_size > 0, op,
              ": rotary_dim must be even and within head_size, got rotary_dim=", rotary_dim,
              " head_size=", head_size);
  TORCH_CHECK(cos_sin_cache.scalar_type() == query.scalar_type(), op, ": cos_sin_cache is ",
              cos_sin_cache.scalar_type(), ", query is ", query.scalar_type());
  for (const at::Tensor* t : {&positions, &cos_sin_cache}) {
    TORCH_CHECK(t->device() == query.device(), op, ": all tensors must be on ", query.device(), ", got ", t->device());
  }
  if (key.has_value()) {
    TORCH_CHECK(key->scalar_type() == query.scalar_type() && key->device() == query.device(), op,
                ": key must have query's dtype and device");
  }
  const int64_t tokens = positions.numel();
  if (tokens == 0 || rotary_dim == 0) {
    return;
  }
  RotaryView q = rotary_view(op, "query", query, tokens, head_size);
  std::optional<RotaryView> k;
  if (key.has_value()) {
    k = rotary_view(op, "key", *key, tokens, head_size);
  }
  const at::Tensor pos = positions.reshape({-1}).contiguous();
  const at::Tensor cache = cos_sin_cache.stride(1) == 1 ? cos_sin_cache : cos_sin_cache.contiguous();
  RotaryArgs args{query.scalar_type(),
                  pos.const_data_ptr<int64_t>(),
                  cache.const_data_ptr(),
                  cache.stride(0),
                  cache.size(0),
                  rotary_target(q),
                  k.has_value() ? rotary_target(*k) : RotaryTarget{nullptr, 0, 0, 0},
                  tokens,
                  rotary_dim,
                  is_neox};
  kernel(args);
  finish_rotary(q);
  if (k.has_value()) {
    finish_rotary(*k);
  }
}

}  // namespace vllm_ir_c

#endif  // VLLM_IR_C_TORCH_SIDE
