// Rotary position embedding on CPU, in place on query and key (rotary.h has the arguments).
//
// Compiled once per CPU capability (cpu/dispatch_stub.h): at::vec::Vectorized over the rotated
// channels of one head with a scalar tail, at::parallel_for over (token, head) pairs. Each
// block holds 2 * Vectorized<float>::size() channel pairs (one Vectorized<T> of bf16/fp16).
// Numerics follow the op declaration (core/ir/declarations/rotary.py): fp32 arithmetic with
// each product and each sum rounded to the dtype, like native's arithmetic in x's dtype.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "../rotary.h"
#include "dispatch_stub.h"
#include "float_vec.h"

namespace vllm_ir_c {

VLLM_IR_C_DECLARE_DISPATCH(void (*)(const RotaryArgs&), rotary_embedding_stub);

namespace CPU_CAPABILITY {
namespace {

using fVec = at::vec::Vectorized<float>;
using Pair = std::pair<fVec, fVec>;

// Channels per block: two fp32 vectors, i.e. one Vectorized<T> of a 16-bit dtype.
constexpr int64_t kBlock = 2 * fVec::size();
// Fewer rotated elements than this per task are not worth a parallel region.
constexpr int64_t kMinElementsPerTask = 16384;

// Loads widen and stores round through float_vec.h: with AVX512-BF16 that is an instruction or
// two per vector where ATen's emulated bf16 narrowing takes about twenty (bf16 rope at
// [4096, 32 x 128], rotary_dim 128, two threads: 4.97 -> 3.49 ms).
template <typename T>
Pair load_block(const T* p) {
  const auto [a, b] = float_vec::load_float(p);
  return {a, b};
}

template <typename T>
void store_block(T* p, const Pair& v) {
  float_vec::store_float(p, v.first, v.second);
}

// fp32 values rounded to bf16 precision (to nearest, ties to even) on their bits, staying
// fp32: fewer instructions than packing to bf16 and back. The values here are bf16 inputs,
// their products and sums: a NaN among them is quiet with its payload in the upper half,
// which this rounding keeps a NaN; a finite value rounds to infinity exactly where bf16 does.
fVec round_to_bf16(const fVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  // bits + 0x7FFF, or + 0x8000 where the kept part is odd: a test into a mask and a masked add
  // for the shift, mask and add (bf16 rope at [256, 32 x 128]: 104-105 -> 97-99 us).
  const __m512i bits = _mm512_castps_si512(v);
  const __mmask16 odd = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x10000));
  const __m512i sum = _mm512_mask_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd, bits,
                                            _mm512_set1_epi32(0x8000));
  return _mm512_castsi512_ps(_mm512_and_si512(sum, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
#else
  using iVec = at::vec::Vectorized<int32_t>;
  const iVec bits = at::vec::cast<int32_t>(v);
  const iVec lsb = (bits >> iVec(16)) & iVec(1);
  return at::vec::cast<float>((bits + iVec(0x7FFF) + lsb) & iVec(static_cast<int32_t>(0xFFFF0000u)));
#endif
}

// fp32 values rounded to T's precision.
template <typename T>
Pair rounded(const fVec& a, const fVec& b) {
  if constexpr (std::is_same_v<T, float>) {
    return {a, b};
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return {round_to_bf16(a), round_to_bf16(b)};
  } else {
    const auto [x, y] = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a, b));
    return {x, y};
  }
}

// (x1*cos - x2*sin, x2*cos + x1*sin) with the products and the results rounded to T.
template <typename T>
std::pair<Pair, Pair> rotate(const Pair& x1, const Pair& x2, const Pair& c, const Pair& s) {
  const Pair x1c = rounded<T>(x1.first * c.first, x1.second * c.second);
  const Pair x2s = rounded<T>(x2.first * s.first, x2.second * s.second);
  const Pair x2c = rounded<T>(x2.first * c.first, x2.second * c.second);
  const Pair x1s = rounded<T>(x1.first * s.first, x1.second * s.second);
  return {{x1c.first - x2s.first, x1c.second - x2s.second}, {x2c.first + x1s.first, x2c.second + x1s.second}};
}

template <typename T>
void rotate_scalar(T& a, T& b, float c, float s) {
  const float x1 = static_cast<float>(a), x2 = static_cast<float>(b);
  const float x1c = static_cast<float>(static_cast<T>(x1 * c)), x2s = static_cast<float>(static_cast<T>(x2 * s));
  const float x2c = static_cast<float>(static_cast<T>(x2 * c)), x1s = static_cast<float>(static_cast<T>(x1 * s));
  a = static_cast<T>(x1c - x2s);
  b = static_cast<T>(x2c + x1s);
}

template <typename T>
void rotate_head_neox(T* x, const T* cos, const T* sin, int64_t half) {
  int64_t i = 0;
  for (; i + kBlock <= half; i += kBlock) {
    auto [o1, o2] = rotate<T>(load_block(x + i), load_block(x + half + i), load_block(cos + i), load_block(sin + i));
    // Results are stored as T, which is the second rounding of each output.
    store_block(x + i, o1);
    store_block(x + half + i, o2);
  }
  for (; i < half; ++i) {
    rotate_scalar(x[i], x[half + i], static_cast<float>(cos[i]), static_cast<float>(sin[i]));
  }
}

template <typename T>
void rotate_head_gptj(T* x, const T* cos, const T* sin, int64_t half) {
  int64_t i = 0;
  for (; i + kBlock <= half; i += kBlock) {
    // 2 * kBlock interleaved channels: pairs i .. i + kBlock.
    const Pair lo = load_block(x + 2 * i), hi = load_block(x + 2 * i + kBlock);
    const auto [e0, o0] = at::vec::deinterleave2(lo.first, lo.second);
    const auto [e1, o1] = at::vec::deinterleave2(hi.first, hi.second);
    auto [r1, r2] = rotate<T>({e0, e1}, {o0, o1}, load_block(cos + i), load_block(sin + i));
    const auto [a0, a1] = at::vec::interleave2(r1.first, r2.first);
    const auto [b0, b1] = at::vec::interleave2(r1.second, r2.second);
    store_block(x + 2 * i, {a0, a1});
    store_block(x + 2 * i + kBlock, {b0, b1});
  }
  for (; i < half; ++i) {
    rotate_scalar(x[2 * i], x[2 * i + 1], static_cast<float>(cos[i]), static_cast<float>(sin[i]));
  }
}

template <typename T>
void rotary_rows(const RotaryArgs& a) {
  const T* cache = static_cast<const T*>(a.cache);
  const int64_t half = a.rotary_dim / 2;
  const int64_t heads = a.query.heads + (a.key.data != nullptr ? a.key.heads : 0);
  const int64_t items = a.tokens * heads;
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(a.rotary_dim, 1));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / heads;
      int64_t h = item % heads;
      const RotaryTarget* target = &a.query;
      if (h >= a.query.heads) {
        h -= a.query.heads;
        target = &a.key;
      }
      T* x = static_cast<T*>(target->data) + t * target->token_stride + h * target->head_stride;
      const int64_t p = a.positions[t];
      const T* cos = cache + (p < 0 ? p + a.max_position : p) * a.cache_stride;
      if (a.neox) {
        rotate_head_neox(x, cos, cos + half, half);
      } else {
        rotate_head_gptj(x, cos, cos + half, half);
      }
    }
  });
}

void rotary_embedding_kernel(const RotaryArgs& a) {
  VLLM_IR_C_DISPATCH_FLOATING_TYPES(a.dtype, "rotary_embedding", [&] { rotary_rows<scalar_t>(a); });
}

}  // namespace
}  // namespace CPU_CAPABILITY

VLLM_IR_C_REGISTER_DISPATCH(rotary_embedding_stub, &CPU_CAPABILITY::rotary_embedding_kernel);

}  // namespace vllm_ir_c

#if VLLM_IR_C_TORCH_SIDE

#include <torch/library.h>

namespace vllm_ir_c {
namespace {

void rotary_embedding_cpu(const at::Tensor& positions, at::Tensor& query, std::optional<at::Tensor> key,
                          int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox, int64_t rotary_dim) {
  constexpr const char* op = "vllm_ir_c::rotary_embedding";
  run_rotary(op, positions, query, key, head_size, cos_sin_cache, is_neox, rotary_dim, [&](const RotaryArgs& args) {
    // Native indexes the cache (a negative position counts from its end) and raises on a
    // position out of range; so do we, before writing anything.
    for (int64_t t = 0; t < args.tokens; ++t) {
      TORCH_CHECK(args.positions[t] >= -args.max_position && args.positions[t] < args.max_position, op, ": position ",
                  args.positions[t], " of token ", t, " is outside the cache's ", args.max_position, " rows");
    }
    rotary_embedding_stub(args);
  });
}

}  // namespace
}  // namespace vllm_ir_c

TORCH_LIBRARY_FRAGMENT(vllm_ir_c, m) {
  // In place on query and key (either may be a strided view, e.g. slices of one qkv tensor).
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
      "Tensor cos_sin_cache, bool is_neox, int rotary_dim) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_ir_c, CPU, m) {
  m.impl("rotary_embedding", &vllm_ir_c::rotary_embedding_cpu);
}

#endif  // VLLM_IR_C_TORCH_SIDE
