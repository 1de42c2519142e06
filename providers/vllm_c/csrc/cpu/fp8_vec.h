// fp8 encoding of fp32 vectors for the per-capability CPU kernels: quant.h's quantize_fp8 lane
// by lane, the bytes narrowed in registers, and the row loops built on it (absmax with an
// optional fp32 copy, quantize a row by a scale's reciprocal). Shared by cpu/quant.cpp and
// cpu/fused_quant.cpp so that a fused kernel encodes exactly like the quant kernels.
//
// Included by csrc/cpu/*.cpp inside no namespace; every capability's compilation gets its own
// copy of these inline functions (see dispatch_stub.h).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../quant.h"

namespace vllm_ir_c {
namespace CPU_CAPABILITY {
namespace fp8_vec {

using fVec = at::vec::Vectorized<float>;
using iVec = at::vec::Vectorized<int32_t>;

// quantize_fp8 (quant.h) on a vector: the same operations, lane by lane, as codes in int32 lanes.
template <Fp8Format kFormat>
inline iVec encode(const fVec& v, const fVec& bound) {
  using E = Fp8Encoding<kFormat>;
  const fVec clamped = at::vec::clamp(v, fVec(0.0f) - bound, bound);
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  // ATen's clamp is max then min there, which return a NaN operand as is: NaN lanes stay NaN.
  const iVec bits = at::vec::cast<int32_t>(clamped);
#else
  // The generic clamp may turn NaN into a bound: NaN lanes (with their sign) come from v.
  const iVec in_bits = at::vec::cast<int32_t>(v);
  const iVec bits = iVec::blendv(at::vec::cast<int32_t>(clamped), in_bits,
                                 (in_bits & iVec(0x7FFFFFFF)) > iVec(0x7F800000));
#endif
  const iVec mag = bits & iVec(0x7FFFFFFF);
  const iVec nan = mag > iVec(0x7F800000);
  const iVec c = at::vec::maximum(mag & iVec(0x7F800000), iVec(E::kMinNormal)) + iVec(E::kShift);
  const iVec steps = at::vec::cast<int32_t>(at::vec::cast<float>(mag) + at::vec::cast<float>(c)) - c;
  const iVec code = steps + (c >> iVec(20)) - iVec(E::kOffset);
  const iVec sign = (bits >> iVec(24)) & iVec(0x80);
  if constexpr (kFormat == Fp8Format::E4M3FNUZ) {
    const iVec signed_code = iVec::blendv(code | sign, iVec(0), code == iVec(0));
    return iVec::blendv(signed_code, iVec(0x80), nan);
  } else {
    return iVec::blendv(code, iVec(0x7F), nan) | sign;
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// encode() in AVX512 intrinsics, with what at::vec does not expose: compare masks, masked moves
// and a ternary-logic merge of the sign (about a quarter fewer instructions per vector).
template <Fp8Format kFormat>
inline __m128i encode_bytes(const __m512 v, const __m512 bound) {
  using E = Fp8Encoding<kFormat>;
  // max(a, b) and min(a, b) return b when either is NaN: NaN lanes stay NaN, with their sign.
  const __m512 clamped = _mm512_min_ps(bound, _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), bound), v));
  const __m512i bits = _mm512_castps_si512(clamped);
  const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32(0x7F800000));
  const __m512i c = _mm512_add_epi32(
      _mm512_max_epi32(_mm512_and_si512(mag, _mm512_set1_epi32(0x7F800000)), _mm512_set1_epi32(E::kMinNormal)),
      _mm512_set1_epi32(E::kShift));
  const __m512i sum = _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(mag), _mm512_castsi512_ps(c)));
  __m512i code = _mm512_add_epi32(_mm512_sub_epi32(sum, c),
                                  _mm512_sub_epi32(_mm512_srli_epi32(c, 20), _mm512_set1_epi32(E::kOffset)));
  const __m512i high = _mm512_srli_epi32(bits, 24);  // the sign at bit 7
  const __m512i sign_bit = _mm512_set1_epi32(0x80);
  if constexpr (kFormat == Fp8Format::E4M3FNUZ) {
    const __mmask16 zero = _mm512_cmpeq_epi32_mask(code, _mm512_setzero_si512());
    code = _mm512_ternarylogic_epi32(code, high, sign_bit, 0xF8);  // code | (high & 0x80)
    code = _mm512_mask_mov_epi32(code, zero, _mm512_setzero_si512());
    code = _mm512_mask_mov_epi32(code, nan, sign_bit);
  } else {
    code = _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(0x7F));
    code = _mm512_ternarylogic_epi32(code, high, sign_bit, 0xF8);
  }
  return _mm512_cvtepi32_epi8(code);
}

// The fp8 codes of v's lanes, stored as bytes at dst.
template <Fp8Format kFormat>
inline void encode_store(const fVec& v, const fVec& bound, uint8_t* dst) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), encode_bytes<kFormat>(v, bound));
}
#else
// Narrows codes (0..255 in int32 lanes) to bytes at dst.
inline void store_bytes(const iVec& codes, uint8_t* dst) {
#if defined(CPU_CAPABILITY_AVX2)
  const __m256i v = codes;
  const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packus_epi16(words, words));
#else
  int32_t lanes[iVec::size()];
  codes.store(lanes);
  for (int64_t j = 0; j < iVec::size(); ++j) {
    dst[j] = static_cast<uint8_t>(lanes[j]);
  }
#endif
}

// The fp8 codes of v's lanes, stored as bytes at dst.
template <Fp8Format kFormat>
inline void encode_store(const fVec& v, const fVec& bound, uint8_t* dst) {
  store_bytes(encode<kFormat>(v, bound), dst);
}
#endif

// The magnitude bits of v: non-negative floats (NaN above inf) order like these integers, so
// their integer maximum is the NaN-propagating float maximum, one instruction per vector.
inline iVec magnitude_bits(const fVec& v) {
  return at::vec::cast<int32_t>(v) & iVec(0x7FFFFFFF);
}

inline float float_of_bits(int32_t b) {
  return bits_float(static_cast<uint32_t>(b));
}

// dst[0:n] = float(src[0:n]) (unless dst is null); returns max |src| (NaN if any is NaN).
template <typename T>
inline float widen_absmax(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  iVec m(0);
  if constexpr (std::is_same_v<T, float>) {
    for (; i + fVec::size() <= n; i += fVec::size()) {
      const fVec a = fVec::loadu(src + i);
      if (dst != nullptr) {
        a.store(dst + i);
      }
      m = at::vec::maximum(m, magnitude_bits(a));
    }
  } else {
    using Vec = at::vec::Vectorized<T>;
    for (; i + Vec::size() <= n; i += Vec::size()) {
      auto [a, b] = at::vec::convert_to_float<T>(Vec::loadu(src + i));
      if (dst != nullptr) {
        a.store(dst + i);
        b.store(dst + i + fVec::size());
      }
      m = at::vec::maximum(m, at::vec::maximum(magnitude_bits(a), magnitude_bits(b)));
    }
  }
  // Reduced as floats (ATen's shuffle-based reduction) with the integer maximum.
  const float lanes_max = at::vec::vec_reduce_all<float>(
      [](fVec& x, fVec& y) {
        return at::vec::cast<float>(at::vec::maximum(at::vec::cast<int32_t>(x), at::vec::cast<int32_t>(y)));
      },
      at::vec::cast<float>(m));
  int32_t result = static_cast<int32_t>(float_bits(lanes_max));
  for (; i < n; ++i) {
    const float v = static_cast<float>(src[i]);
    if (dst != nullptr) {
      dst[i] = v;
    }
    result = std::max(result, static_cast<int32_t>(float_bits(v) & 0x7FFFFFFFu));
  }
  return float_of_bits(result);
}

// out[0:n] = quantize(float(src[0:n]) * inv) (inv per element where inv_row is set), one
// vector at a time: widened, scaled, encoded and narrowed in registers.
template <Fp8Format kFormat, typename T>
inline void quantize_row(const T* src, uint8_t* out, int64_t n, float inv, const float* inv_row, float bound) {
  static_assert(iVec::size() == fVec::size());
  const fVec vinv(inv);
  const fVec vbound(bound);
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + fVec::size() <= n; i += fVec::size()) {
      const fVec s = inv_row ? fVec::loadu(inv_row + i) : vinv;
      encode_store<kFormat>(fVec::loadu(src + i) * s, vbound, out + i);
    }
  } else {
    using Vec = at::vec::Vectorized<T>;
    for (; i + Vec::size() <= n; i += Vec::size()) {
      auto [a, b] = at::vec::convert_to_float<T>(Vec::loadu(src + i));
      const fVec sa = inv_row ? fVec::loadu(inv_row + i) : vinv;
      const fVec sb = inv_row ? fVec::loadu(inv_row + i + fVec::size()) : vinv;
      encode_store<kFormat>(a * sa, vbound, out + i);
      encode_store<kFormat>(b * sb, vbound, out + i + fVec::size());
    }
  }
  for (; i < n; ++i) {
    out[i] = quantize_fp8<kFormat>(static_cast<float>(src[i]) * (inv_row ? inv_row[i] : inv), bound);
  }
}

}  // namespace fp8_vec
}  // namespace CPU_CAPABILITY
}  // namespace vllm_ir_c
