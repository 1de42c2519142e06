// fp32 views of bf16 / fp16 / fp32 memory for the per-capability CPU kernels: a step is one
// Vectorized<bf16> (two fp32 vectors; for fp32 data, two Vectorized<float>), widened on load
// and rounded to nearest even on store, bit for bit like c10::BFloat16 / c10::Half (so like
// native PyTorch).
//
// Included by csrc/cpu/*.cpp inside their capability's namespace only: every capability's
// compilation gets its own copy of these inline functions (see dispatch_stub.h).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <tuple>
#include <type_traits>

namespace vllm_ir_c {
namespace CPU_CAPABILITY {
namespace float_vec {

using fVec = at::vec::Vectorized<float>;

// Elements per step: two fp32 vectors, one Vectorized<bf16/fp16>.
constexpr int64_t kStep = 2 * fVec::size();

template <typename T>
inline std::tuple<fVec, fVec> widen(const at::vec::Vectorized<T>& v) {
  return at::vec::convert_to_float<T>(v);
}

template <typename T>
inline at::vec::Vectorized<T> narrow(const fVec& a, const fVec& b) {
  return at::vec::convert_from_float<T>(a, b);
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// With AVX512-BF16, ATen's emulated bf16 conversions (about 20 vector instructions per 32
// elements each way) dominate memory-bound kernels; these take 2 to 4.

template <>
inline std::tuple<fVec, fVec> widen<c10::BFloat16>(const at::vec::Vectorized<c10::BFloat16>& v) {
  // Each bf16 becomes the high half of an fp32 lane: one masked word permute per 16 lanes.
  const __m512i low_half = _mm512_set_epi32(0xF0000, 0xE0000, 0xD0000, 0xC0000, 0xB0000, 0xA0000, 0x90000, 0x80000,
                                            0x70000, 0x60000, 0x50000, 0x40000, 0x30000, 0x20000, 0x10000, 0);
  const __m512i high_half = _mm512_add_epi32(low_half, _mm512_set1_epi32(16 << 16));
  constexpr __mmask32 kHighWords = 0xAAAAAAAAu;
  return {_mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(kHighWords, low_half, v)),
          _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(kHighWords, high_half, v))};
}

template <>
inline at::vec::Vectorized<c10::BFloat16> narrow<c10::BFloat16>(const fVec& a, const fVec& b) {
  // vcvtne2ps2bf16 rounds to nearest even like c10, but flushes denormals to zero and keeps
  // NaN payloads where c10 keeps denormals and writes 0xffff: such vectors take ATen's path.
  constexpr int kNaNOrDenormal = 0x01 | 0x20 | 0x80;  // vfpclassps: QNaN | denormal | SNaN
  const __mmask16 special = _mm512_fpclass_ps_mask(a, kNaNOrDenormal) | _mm512_fpclass_ps_mask(b, kNaNOrDenormal);
  if (C10_LIKELY(special == 0)) {
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
  }
  return at::vec::convert_from_float<c10::BFloat16>(a, b);
}
#endif

// One step of `p` (kStep elements) as two fp32 vectors.
template <typename T>
inline std::tuple<fVec, fVec> load_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return {fVec::loadu(p), fVec::loadu(p + fVec::size())};
  } else {
    static_assert(at::vec::Vectorized<T>::size() == kStep);
    return widen<T>(at::vec::Vectorized<T>::loadu(p));
  }
}

// The first `count` (< kStep) elements of `p`, the other lanes zero.
template <typename T>
inline std::tuple<fVec, fVec> load_float(const T* p, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    const int64_t first = count < fVec::size() ? count : fVec::size();
    return {fVec::loadu(p, first), count > fVec::size() ? fVec::loadu(p + fVec::size(), count - fVec::size())
                                                         : fVec(0.0f)};
  } else {
    return widen<T>(at::vec::Vectorized<T>::loadu(p, count));
  }
}

template <typename T>
inline void store_float(T* p, const fVec& a, const fVec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(p);
    b.store(p + fVec::size());
  } else {
    narrow<T>(a, b).store(p);
  }
}

// The first `count` (< kStep) lanes.
template <typename T>
inline void store_float(T* p, const fVec& a, const fVec& b, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(p, count < fVec::size() ? count : fVec::size());
    if (count > fVec::size()) {
      b.store(p + fVec::size(), count - fVec::size());
    }
  } else {
    narrow<T>(a, b).store(p, count);
  }
}

// fp32 values rounded to T's precision (native's `.to(dtype)`, or an op's result dtype).
template <typename T>
inline std::tuple<fVec, fVec> round_float(const fVec& a, const fVec& b) {
  if constexpr (std::is_same_v<T, float>) {
    return {a, b};
  } else {
    return widen<T>(narrow<T>(a, b));
  }
}

// Asks for step `p` (kStep elements) ahead of its use, for reading or for writing (which saves
// the later ownership request). Compute-bound loops ask for the next row's steps so that
// memory works meanwhile; lines already cached cost next to nothing. kLocality is
// __builtin_prefetch's: 3 (the default) brings the lines into L1, 2 into L2 only, for loops
// whose own working set fills L1 (the norms' streamed rows: a row and an fp32 weight).
template <bool kForWrite, int kLocality = 3, typename T>
inline void prefetch_step(const T* p) {
#if defined(__GNUC__) || defined(__clang__)
  constexpr int64_t kLine = 64;
  for (int64_t b = 0; b < kStep * static_cast<int64_t>(sizeof(T)); b += kLine) {
    __builtin_prefetch(reinterpret_cast<const char*>(p) + b, kForWrite ? 1 : 0, kLocality);
  }
#endif
}

}  // namespace float_vec
}  // namespace CPU_CAPABILITY
}  // namespace vllm_ir_c
