// Activation math shared by the per-capability CPU kernels (cpu/activation.cpp and the fused
// activation + quant kernel in cpu/fused_quant.cpp): ATen's vector and scalar forms, and the
// split between them ATen's loops use, so that every kernel built on these rounds like native.
//
// Included by csrc/cpu/*.cpp inside no namespace; every capability's compilation gets its own
// copy of these inline functions (see dispatch_stub.h).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstdint>

namespace vllm_ir_c {
namespace CPU_CAPABILITY {
namespace act_vec {

using fVec = at::vec::Vectorized<float>;

// ATen's vectorized loop runs its vector form while two Vectorized<T> fit (per row of a
// strided gate): the remainder, shorter than this, takes its scalar form.
template <typename T>
constexpr int64_t kAtenStep = 2 * at::vec::Vectorized<T>::size();

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

}  // namespace act_vec
}  // namespace CPU_CAPABILITY
}  // namespace vllm_ir_c
