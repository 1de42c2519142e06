// RMSNorm building blocks for the per-capability CPU kernels: the fp32 sum of squares of a row,
// the inverse RMS from it, the weight widened to fp32, and how the weight is applied. Shared by cpu/layernorm.cpp and
// cpu/fused_quant.cpp so that the fused norm+quant kernels normalize rounding for rounding like
// the norm kernels (and so like native).
//
// Included by csrc/cpu/*.cpp inside no namespace; every capability's compilation gets its own
// copy of these inline functions (see dispatch_stub.h).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <tuple>
#include <type_traits>
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

// Sum of squares over a row in fp32: load(d) gives step d as two fp32 vectors, scalar(d) one
// element of the tail.
// Four accumulators keep the FMAs independent (one chain would wait on FMA latency).
template <typename Load, typename Scalar>
inline float sum_of_squares(int64_t n, const Load& load, const Scalar& scalar) {
  fVec acc0(0.0f);
  fVec acc1(0.0f);
  fVec acc2(0.0f);
  fVec acc3(0.0f);
  int64_t d = 0;
  for (; d + 2 * kStep <= n; d += 2 * kStep) {
    auto [v0, v1] = load(d);
    auto [v2, v3] = load(d + kStep);
    acc0 = at::vec::fmadd(v0, v0, acc0);
    acc1 = at::vec::fmadd(v1, v1, acc1);
    acc2 = at::vec::fmadd(v2, v2, acc2);
    acc3 = at::vec::fmadd(v3, v3, acc3);
  }
  if (d + kStep <= n) {
    auto [v0, v1] = load(d);
    acc0 = at::vec::fmadd(v0, v0, acc0);
    acc1 = at::vec::fmadd(v1, v1, acc1);
    d += kStep;
  }
  float sum = at::vec::vec_reduce_all<float>(std::plus<fVec>(), (acc0 + acc1) + (acc2 + acc3));
  for (; d < n; ++d) {
    const float v = scalar(d);
    sum += v * v;
  }
  return sum;
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
