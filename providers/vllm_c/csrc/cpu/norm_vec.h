// RMSNorm building blocks for the per-capability CPU kernels: the fp32 sum of squares of a row,
// the inverse RMS from it, the weight widened to fp32, and how the weight is applied. Shared by cpu/layernorm.cpp and
// cpu/fused_quant.cpp so that the fused norm+quant kernels normalize rounding for rounding like
// the norm kernels (and so like native).
//
// Included by csrc/cpu/*.cpp inside no namespace; every capability's compilation gets its own
// copy of these inline functions (see dispatch_stub.h).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "float_vec.h"

namespace vllm_ir_c {
namespace CPU_CAPABILITY {
namespace norm_vec {

using fVec = at::vec::Vectorized<float>;
using float_vec::kStep;
using float_vec::load_float;
using float_vec::store_float;

// How the weight enters, vLLM's `y.to(weight.dtype) * weight` then `.to(x.dtype)` on the
// normalized fp32 row y: no weight (y rounded to T once); a weight of T (y rounded to T, the
// product rounded to T again); an fp32 weight (one fp32 multiply, one rounding to T; for an
// fp32 T the two are the same).
enum class WeightKind { kNone, kSame, kFp32 };

// The normalized step (y0, y1: fp32) weighted as `kKind` says, as fp32 values; the caller's
// store (or round_float<T>) makes the last rounding to T. `w` is the weight in fp32 (a weight
// of T widened exactly, see Fp32Weight) at this step.
template <typename T, WeightKind kKind>
inline std::tuple<fVec, fVec> weighted(const fVec& y0, const fVec& y1, const float* w) {
  if constexpr (kKind == WeightKind::kNone) {
    return {y0, y1};
  } else if constexpr (kKind == WeightKind::kSame) {
    auto [n0, n1] = float_vec::round_float<T>(y0, y1);
    return {n0 * fVec::loadu(w), n1 * fVec::loadu(w + fVec::size())};
  } else {
    return {y0 * fVec::loadu(w), y1 * fVec::loadu(w + fVec::size())};
  }
}

// One element: the same, rounded to T.
template <typename T, WeightKind kKind>
inline T weighted(float y, const float* w, int64_t d) {
  if constexpr (kKind == WeightKind::kNone) {
    return static_cast<T>(y);
  } else if constexpr (kKind == WeightKind::kSame) {
    return static_cast<T>(static_cast<float>(static_cast<T>(y)) * w[d]);
  } else {
    return static_cast<T>(y * w[d]);
  }
}

inline float inverse_rms(float sum_of_squares, int64_t hidden, float epsilon) {
  // Same operations as native: mean, + epsilon, rsqrt (all fp32).
  return 1.0f / std::sqrt(sum_of_squares / static_cast<float>(hidden) + epsilon);
}

// The sum of squares of a row in fp32, added in exactly the order torch's CPU sum adds the
// squared row (vLLM's native takes `x.pow(2).mean(-1)`, and ATen's CPU mean is the sum divided
// by n; the sum is ATen's cascade_sum, native/cpu/SumKernel.cpp), so that the inverse RMS and
// with it every output has native's bits. For a contiguous row of n >= 8 fp32 values:
// - ATen's sum runs on 8-float vectors (on x86 with AVX2 and AVX512 alike, and on the generic
//   32-byte vectors: measured, tests/test_provider_vllm_c.py): the first 8 * (n / 8) values
//   are n / 8 vectors, the rest a scalar tail;
// - the vectors are added 4 at a time into 4 partial sums (a "group" of 32 values, one lane
//   per position) in a cascade of 4 levels: after every 2^p groups (p = 4 below 2^20 groups)
//   level 0 is added into level 1 and cleared, and so on up while the group count is a
//   multiple of the level's span; at the end the upper levels are added into level 0;
// - the 1-3 vectors after the last whole group go into partial 0, one after another, then
//   partial 0 += partial 1, += partial 2, += partial 3 (lane by lane);
// - the scalar tail is summed from 0 in order, then partial 0's 8 lanes are added one by one.
// A row of fewer than 8 values takes the same scheme with scalars for vectors. Every value is
// squared and rounded before it is added (the squares are a tensor in native; no FMA: the
// build is -ffp-contract=off). A group's lanes are independent, so our vectors, of whatever
// width, compute ATen's 8-lane sums exactly: a group is whole kStep loads.
//
// A lone row of at least ATen's grain size (32768) values under more than one thread is summed
// by ATen's two-pass reduction: split into one chunk per thread (divup(n, chunks) values each),
// each chunk summed as a row of its own, then the per-thread sums (zero where a thread had no
// chunk) summed as a row. `RowSplit` carries that decision from the entry point, which runs
// outside any parallel region (as ATen decides it).
constexpr int64_t kAtenLanes = 8;
constexpr int64_t kAtenGroup = 4 * kAtenLanes;
// at::internal::GRAIN_SIZE (ATen/TensorIterator.h, a Tensor API header: the torch side of
// cpu/layernorm.cpp asserts the two agree).
constexpr int64_t kAtenGrainSize = 32768;
static_assert(kAtenGroup % kStep == 0, "a group of ATen's partial sums is whole steps");

struct RowSplit {
  int64_t chunks = 1;   // 1: the row is summed whole
  int64_t threads = 1;  // the per-thread sums' count (ATen's thread count) when chunks > 1
};

// How ATen splits each of `rows` rows of n values: only a lone row is ever split.
inline RowSplit aten_row_split(int64_t rows, int64_t n) {
  RowSplit split;
  const int64_t threads = at::get_num_threads();
  if (rows == 1 && n >= kAtenGrainSize && threads > 1 && !at::in_parallel_region()) {
    split.threads = threads;
    split.chunks = std::min<int64_t>(threads, (n + kAtenGrainSize - 1) / kAtenGrainSize);
  }
  return split;
}

// Work to interleave with a row's sum (see sum_of_squares_beside): none.
struct NoSideWork {
  void operator()(int64_t /*group*/) const {}
};

// The whole groups of a row of n values (those whose sums aten_group_sums adds).
inline int64_t whole_groups(int64_t n) {
  return n < kAtenLanes ? 0 : n / kAtenLanes / 4;
}

// The kAtenGroup partial-sum lanes of `groups` whole groups into p: add_step(d, a0, a1) adds
// the kStep values from element d into a0, a1; side(g) runs after group g's adds.
template <typename AddStep, typename Side = NoSideWork>
inline void aten_group_sums(int64_t groups, const AddStep& add_step, float* p, const Side& side = {}) {
  constexpr int64_t kSteps = kAtenGroup / kStep;  // loads per group
  constexpr int64_t kVecs = 2 * kSteps;           // fp32 vectors per group
  constexpr int kLevels = 4;
  int64_t ceil_log2 = 1;  // ATen's utils::CeilLog2 (1 for 0, 1, 2)
  while ((int64_t{1} << ceil_log2) < groups) {
    ++ceil_log2;
  }
  const int64_t power = std::max<int64_t>(4, ceil_log2 / kLevels);
  const int64_t span = int64_t{1} << power;
  const int64_t mask = span - 1;
  // Level 0 apart from the others, indexed only by constants: it stays in registers (one
  // array of all levels, indexed by the level in the cascade, measured 2.5x slower in cache).
  fVec level0[kVecs];
  fVec upper[kLevels - 1][kVecs];
  for (int64_t k = 0; k < kVecs; ++k) {
    level0[k] = fVec(0.0f);
    for (auto& level : upper) {
      level[k] = fVec(0.0f);
    }
  }
  const auto add_group = [&](int64_t g) {
    for (int64_t s = 0; s < kSteps; ++s) {
      add_step(g * kAtenGroup + s * kStep, level0[2 * s], level0[2 * s + 1]);
    }
    side(g);
  };
  int64_t i = 0;
  while (i + span <= groups) {
    for (int64_t j = 0; j < span; ++j, ++i) {
      add_group(i);
    }
    for (int64_t k = 0; k < kVecs; ++k) {  // level 1 += level 0, level 0 cleared
      upper[0][k] = upper[0][k] + level0[k];
      level0[k] = fVec(0.0f);
    }
    for (int level = 2; level < kLevels && (i & (mask << ((level - 1) * power))) == 0; ++level) {
      for (int64_t k = 0; k < kVecs; ++k) {
        upper[level - 1][k] = upper[level - 1][k] + upper[level - 2][k];
        upper[level - 2][k] = fVec(0.0f);
      }
    }
  }
  for (; i < groups; ++i) {
    add_group(i);
  }
  for (int64_t k = 0; k < kVecs; ++k) {
    for (const auto& level : upper) {
      level0[k] = level0[k] + level[k];
    }
    level0[k].store(p + k * fVec::size());
  }
}

// ATen's sum of a row of n values (unsplit): value(d) is element d, add_step and side as above.
template <typename AddStep, typename Value, typename Side = NoSideWork>
inline float aten_row_sum(int64_t n, const AddStep& add_step, const Value& value, const Side& side = {}) {
  if (n < kAtenLanes) {  // scalars: 4 partial sums, the rest into partial 0, then the partials
    float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int64_t quads = n / 4;
    for (int64_t i = 0; i < quads; ++i) {
      for (int64_t k = 0; k < 4; ++k) {
        p[k] += value(4 * i + k);
      }
    }
    for (int64_t i = 4 * quads; i < n; ++i) {
      p[0] += value(i);
    }
    return ((p[0] + p[1]) + p[2]) + p[3];
  }
  const int64_t vectors = n / kAtenLanes;
  const int64_t groups = whole_groups(n);
  alignas(64) float p[kAtenGroup];
  aten_group_sums(groups, add_step, p, side);
  for (int64_t v = 4 * groups; v < vectors; ++v) {
    for (int64_t l = 0; l < kAtenLanes; ++l) {
      p[l] += value(v * kAtenLanes + l);
    }
  }
  for (int64_t l = 0; l < kAtenLanes; ++l) {
    p[l] = ((p[l] + p[kAtenLanes + l]) + p[2 * kAtenLanes + l]) + p[3 * kAtenLanes + l];
  }
  float total = 0.0f;
  for (int64_t d = vectors * kAtenLanes; d < n; ++d) {
    total += value(d);
  }
  for (int64_t l = 0; l < kAtenLanes; ++l) {
    total += p[l];
  }
  return total;
}

// The squares of a row's values from element `base` for aten_row_sum: add_step and value.
template <typename Load, typename Scalar>
inline auto squares_from(const Load& load, const Scalar& scalar, int64_t base) {
  const auto add_step = [&load, base](int64_t d, fVec& a0, fVec& a1) {
    auto [v0, v1] = load(base + d);
    a0 = a0 + v0 * v0;
    a1 = a1 + v1 * v1;
  };
  const auto value = [&scalar, base](int64_t d) {
    const float v = scalar(base + d);
    return v * v;
  };
  return std::make_pair(add_step, value);
}

// The sum of squares of a row of n values: load(d) gives the kStep values from element d as
// two fp32 vectors, scalar(d) element d (both the fp32 values native squares: x, or x +
// residual); `split` as aten_row_split gave it for the call.
template <typename Load, typename Scalar>
inline float sum_of_squares(int64_t n, const Load& load, const Scalar& scalar, const RowSplit& split = {}) {
  if (split.chunks <= 1) {
    auto [add_step, value] = squares_from(load, scalar, 0);
    return aten_row_sum(n, add_step, value);
  }
  const int64_t chunk = (n + split.chunks - 1) / split.chunks;
  std::vector<float> sums(static_cast<size_t>(split.threads), 0.0f);
  for (int64_t t = 0; t < split.chunks && t * chunk < n; ++t) {
    auto [add_step, value] = squares_from(load, scalar, t * chunk);
    sums[t] = 0.0f + aten_row_sum(std::min(chunk, n - t * chunk), add_step, value);
  }
  const auto add_sums = [&](int64_t d, fVec& a0, fVec& a1) {
    a0 = a0 + fVec::loadu(sums.data() + d);
    a1 = a1 + fVec::loadu(sums.data() + d + fVec::size());
  };
  return aten_row_sum(split.threads, add_sums, [&](int64_t d) { return sums[d]; });
}

// The same sum of an unsplit row, with side(g) run after the adds of each whole group g (the
// groups' elements [g * kAtenGroup, (g + 1) * kAtenGroup) for g < whole_groups(n)): work on
// another row interleaved with this row's reduction. The sum's add chains wait on the adder's
// latency; independent work (the previous row's normalization) fills those cycles, and the
// adds happen in the same order, so the sum is the same.
template <typename Load, typename Scalar, typename Side>
inline float sum_of_squares_beside(int64_t n, const Load& load, const Scalar& scalar, const Side& side) {
  auto [add_step, value] = squares_from(load, scalar, 0);
  return aten_row_sum(n, add_step, value, side);
}

// The weight in fp32. A bf16/fp16 weight is widened once per chunk of rows (exactly: every
// bf16/fp16 value is an fp32 value), so native's T * T product is fp32 math on these.
template <typename T>
class Fp32Weight {
 public:
  Fp32Weight(const void* weight, int64_t n) {
    if constexpr (std::is_same_v<T, float>) {
      data_ = static_cast<const float*>(weight);
    } else if (weight != nullptr) {
      const T* w = static_cast<const T*>(weight);
      buffer_.resize(n);
      int64_t d = 0;
      for (; d + kStep <= n; d += kStep) {
        auto [w0, w1] = load_float(w + d);
        store_float(buffer_.data() + d, w0, w1);
      }
      for (; d < n; ++d) {
        buffer_[d] = static_cast<float>(w[d]);
      }
      data_ = buffer_.data();
    }
  }
  const float* data() const {
    return data_;
  }

 private:
  std::vector<float> buffer_;
  const float* data_ = nullptr;
};

// Pass 1 of a row waits on memory, pass 2 on arithmetic. Pass 2 therefore prefetches the
// next row's step (for writing where it will be written, which saves the later ownership
// request) so that the two overlap (float_vec::prefetch_step).
using float_vec::prefetch_step;

}  // namespace norm_vec
}  // namespace CPU_CAPABILITY
}  // namespace vllm_ir_c
