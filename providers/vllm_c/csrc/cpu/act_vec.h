// Activation math shared by the per-capability CPU kernels (cpu/activation.cpp and the fused
// activation + quant kernel in cpu/fused_quant.cpp): ATen's vector and scalar forms, and the
// split between them ATen's loops use, so that every kernel built on these rounds like native.
//
// Included by csrc/cpu/*.cpp inside no namespace; every capability's compilation gets its own
// copy of these inline functions (see dispatch_stub.h).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/Version.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "float_vec.h"

namespace vllm_ir_c {
namespace CPU_CAPABILITY {
namespace act_vec {

using fVec = at::vec::Vectorized<float>;

// ATen's vectorized loop runs its vector form while two Vectorized<T> fit (per row of a
// strided gate): the remainder, shorter than that, takes its scalar form. Two Vectorized<T>
// of the capability ATen itself runs at, which need not be this kernel's: a wheel built with
// fewer variants, VLLM_IR_C_CPU_CAPABILITY or ATEN_CPU_CAPABILITY make them differ (an AVX2
// kernel under AVX512 ATen once ran the vector form on rows of 16 floats that ATen computes
// in scalar form). A multiple of this kernel's step where ATen's vectors are the wider ones;
// else a kernel's last vector step may be partial.
template <typename T>
inline int64_t aten_step() {
  static const int64_t bytes = [] {
    const std::string aten = at::get_cpu_capability();
    if (aten == "AVX512") {
      return int64_t{64};
    }
#if defined(__x86_64__) || defined(_M_X64)
    return int64_t{32};  // ATen's AVX2 vectors and its generic ones (vec_base) below AVX512
#else
    return static_cast<int64_t>(sizeof(at::vec::Vectorized<float>));  // only DEFAULT is built here
#endif
  }();
  return 2 * bytes / static_cast<int64_t>(sizeof(T));
}

inline fVec silu(const fVec& x) {
  return x / (fVec(1.0f) + x.neg().exp());
}
inline float silu(float x) {
  return x / (1.0f + std::exp(-x));
}

// silu as a functor, vector and scalar forms (one type for every kernel: table16's table of it
// is then one per process).
struct Silu {
  fVec operator()(const fVec& x) const {
    return silu(x);
  }
  float operator()(float x) const {
    return silu(x);
  }
};

// Asks for step i of a halves-layout gated row's gate and up (`row` and `row + d`; none when
// `row` is null). The gated steps are compute-bound (lookups or math): asking for the next row
// meanwhile made bf16 silu / gelu at [4096, 8192] ~7% faster and fatrelu ~25%.
template <typename T>
inline void prefetch_halves_step(const T* row, int64_t d, int64_t i) {
  if (row != nullptr) {
    float_vec::prefetch_step<false>(row + i);
    float_vec::prefetch_step<false>(row + d + i);
  }
}

}  // namespace act_vec
}  // namespace CPU_CAPABILITY
}  // namespace vllm_ir_c
