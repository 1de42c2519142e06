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
#include <array>
#include <climits>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../quant.h"
#include "table16.h"

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

#if defined(CPU_CAPABILITY_AVX512)
// Whether this CPU has AVX512-VBMI (byte permutes), asked once. The AVX512 capabilities do not
// imply it, so the functions using it carry their own target attribute.
inline bool cpu_has_avx512_vbmi() {
  static const bool has = __builtin_cpu_supports("avx512vbmi");
  return has;
}

// bf16 rows quantized by a shared scale reciprocal through tables of 128 entries.
//
// For x = 1.m * 2^(E-127) (7 mantissa bits), fl(x * inv) = 2^(E-E0) * fl(1.m * 2^(E0-127) * inv)
// while both products are normal floats, and an fp8 code in the normal range moves by 8 per
// binade: code(x) = code(1.m * 2^(E0-127) * inv) + 8 * (E - E0). So the codes of the 128
// mantissas at one reference binade E0 (where fp8 rounding is plain round-to-nearest-even)
// give every lane's code by table lookups and adds. What the shift cannot give is recognised
// per lane: above the bound the code saturates (min with the bound's code 0x7E); far below the
// smallest subnormal it is zero; the band where fp8 subnormals live (codes -24..7 by the
// shift), and inf/NaN, take the float path for that step. Bytes identical to quantize_row's.
//
// Two steppers: 64 lanes in bytes with AVX512-VBMI's two-table byte permutes, else 32 lanes in
// 16-bit words with AVX512BW's word permutes.
template <Fp8Format kFormat>
class Bf16Fp8Table {
 public:
  // The tables for inv; false (use quantize_row) when inv is not in [2^-60, 2^60]: the shift
  // argument needs the reference products normal and zero/subnormal inputs far below fp8's range.
  bool build(float inv) {
    if (!tables_for(inv, thread_slots(), tables_)) {
      return false;
    }
    words_built_ = false;  // quantize_words builds them when a row needs them
    inv_ = inv;
    return true;
  }

  // out[0:n] = the fp8 codes of fl(float(src[i]) * inv), as quantize_row<kFormat> writes them;
  // prefetches next[0:n] (if set) on the way.
  void quantize(const c10::BFloat16* src, uint8_t* out, int64_t n, float bound, const c10::BFloat16* next) {
    int64_t i = cpu_has_avx512_vbmi() ? quantize_bytes(src, out, n, bound, next) : 0;
    if (n - i >= 32) {
      if (!words_built_) {
        build_words();
      }
      i += quantize_words(src + i, out + i, n - i, bound);
    }
    if (i < n) {
      quantize_row<kFormat, c10::BFloat16>(src + i, out + i, n - i, inv_, nullptr, bound);
    }
  }

  // One row of dynamic_group_quant_fp8 where the CPU has AVX512-VBMI: for group k (g elements,
  // the last maybe fewer), scales[k * scale_stride] = group_scale(absmax[k]) and the group's
  // codes by 1 / that scale, through tables from the thread's caches (two lookups per group).
  // The scales come first, so that no group waits on its two divisions (absmax is overwritten
  // with the reciprocals); one function, so that the steps' constants stay in registers. A group
  // with a lane for the float path is redone whole after its steps (one test per group, no
  // float path inside the step loop: one thread, [256, 4096], 70-71.5 -> 66-67.6 us). The
  // encoding (compute-bound) prefetches the row `next` (if set), whose absmax pass (bound by
  // its loads) then finds it in cache: group quant at [4096, 4096] ran 1.2-1.4x faster so.
  __attribute__((target("avx512vbmi"))) static void quantize_groups(const c10::BFloat16* src, uint8_t* out,
                                                                    int64_t n, int64_t g, float* absmax,
                                                                    float* scales, int64_t scale_stride,
                                                                    bool use_ue8m0, float bound,
                                                                    const c10::BFloat16* next = nullptr) {
    const int64_t groups = (n + g - 1) / g;
    for (int64_t k = 0; k < groups; ++k) {
      const float s = group_scale(absmax[k], use_ue8m0, kFormat);
      scales[k * scale_stride] = s;
      absmax[k] = 1.0f / s;
    }
    const Slots slots = thread_slots();
    const ByteStep step;
    for (int64_t c = 0, k = 0; c < n; c += g, ++k) {
      const int64_t len = std::min(g, n - c);
      const float inv = absmax[k];
      int64_t i = 0;
      Tables t;
      if (tables_for(inv, slots, t)) {
        __mmask64 float_path = 0;
        for (; i + 64 <= len; i += 64) {
          if (next != nullptr) {
            prefetch_step(next + c + i);
          }
          float_path |= step(t.mantissa, t.binade, src + c + i, out + c + i);
        }
        if (float_path != 0) {
          i = 0;  // rare (fp8 subnormals, inf, NaN): the whole group again
        }
      }
      if (i < len) {
        redo_by_float(src + c + i, out + c + i, len - i, inv, bound);
      }
    }
  }

  // max |src[0:n]| (NaN if any is NaN) from the bits: bf16 magnitudes order like integers, NaN
  // above inf. No widening.
  static float absmax(const c10::BFloat16* src, int64_t n) {
    const uint16_t* w16 = reinterpret_cast<const uint16_t*>(src);
    const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
    __m512i m0 = _mm512_setzero_si512();
    __m512i m1 = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {  // two chains: the loads, not max's latency, set the pace
      m0 = _mm512_max_epu16(m0, _mm512_and_si512(_mm512_loadu_si512(w16 + i), magnitude));
      m1 = _mm512_max_epu16(m1, _mm512_and_si512(_mm512_loadu_si512(w16 + i + 32), magnitude));
    }
    __m512i m = _mm512_max_epu16(m0, m1);
    __m256i h = _mm256_max_epu16(_mm512_castsi512_si256(m), _mm512_extracti64x4_epi64(m, 1));
    __m128i q = _mm_max_epu16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    // phminposuw finds the minimum of 8 words: of the complements, that is the maximum.
    q = _mm_minpos_epu16(_mm_xor_si128(q, _mm_set1_epi16(-1)));
    uint16_t result = static_cast<uint16_t>(~_mm_extract_epi16(q, 0));
    for (; i < n; ++i) {
      result = std::max<uint16_t>(result, w16[i] & 0x7FFF);
    }
    return bits_float(static_cast<uint32_t>(result) << 16);
  }

 private:
  static constexpr int kOr = 0xF8;  // ternary logic: a | (b & c), the sign bit into a code

  // A scale reciprocal's tables, for the byte stepper.
  //
  // Bytes, with E = 2h + b (h: the high byte's low 7 bits, b: the low byte's top bit):
  // code = mantissa[m] + 8b + binade[h], saturating. mantissa is 0..16 (+8b: 0..24); binade
  // entries beyond int8 clip safely (the sum stays <= -25 or >= 126), and h = 127 (E = 254,
  // 255: inf, NaN) is sent to the float path by landing in the band.
  struct Tables {
    __m512i mantissa[2];  // mantissas 0..63, 64..127
    __m512i binade[2];    // h = 0..63, 64..127
    int32_t words_from;   // word tables: code = mantissa[m] + words_from + 8E
  };

  // The fp8 codes of fl(1.m * 8 * inv) for the 128 mantissas m, inv = 1.mantissa: products in
  // [8, 32), normal and below both bounds, where the code is the float's bits rounded to nearest
  // even at 3 mantissa bits, rebiased (encode_bytes does the same there; the tests compare every
  // bf16 value with torch's cast); kept as code0 (m = 0, the smallest) and each minus code0.
  struct alignas(64) MantissaCodes {
    uint8_t from_code0[128];
    int32_t code0;
    uint32_t tag;  // mantissa + 1; 0: empty
  };

  // binade[h] = offset + 16h narrowed with saturation (|offset| < 2^11).
  struct alignas(64) BinadeCodes {
    uint8_t binade[128];
    int32_t offset;  // INT32_MIN: empty
  };

  // Tables kept per thread, direct-mapped. The scales of group and per-token quant come from
  // bf16 absmaxes, whose reciprocals take 128 mantissas per format (a slot each: their top 10
  // bits differ, where a multiplicative hash put 128 of them in 115 slots and the colliding
  // pairs rebuilt each other's tables), and a tensor's groups share a few binades, hence a few
  // offsets (apart in 128 slots by their low bits): a group's tables are two lookups instead of
  // about 90 vector instructions.
  struct Caches {
    static constexpr int kMantissaSlotBits = 10;
    static constexpr int kBinadeSlots = 128;
    std::vector<MantissaCodes> mantissa = std::vector<MantissaCodes>(size_t{1} << kMantissaSlotBits, MantissaCodes{});
    std::vector<BinadeCodes> binade = std::vector<BinadeCodes>(kBinadeSlots, BinadeCodes{{}, INT32_MIN});
  };

  // The calling thread's caches as plain pointers, taken once per call: reached through the
  // thread-local object in the loops, each lookup became a __tls_get_addr call (and its
  // vzeroupper, which dropped the step's constants from their registers).
  struct Slots {
    MantissaCodes* mantissa;
    BinadeCodes* binade;
  };

  static Slots thread_slots() {
    thread_local Caches caches;
    return {caches.mantissa.data(), caches.binade.data()};
  }

  // The reference binade E0 puts 1.m * 2^(E0-127) * inv in [8, 32): the codes there depend on
  // inv's mantissa alone, the binade table on code(m = 0) - 8 * E0 alone.
  static bool tables_for(float inv, const Slots& slots, Tables& t) {
    const int32_t inv_exp = static_cast<int32_t>(float_bits(inv) >> 23) - 127;  // the sign bit makes it large
    if (!(inv > 0.0f) || inv_exp < -60 || inv_exp > 60) {
      return false;
    }
    const int32_t e0 = 127 + 3 - inv_exp;
    const MantissaCodes& codes = mantissa_codes(slots, float_bits(inv) & 0x7FFFFF);
    t.mantissa[0] = _mm512_load_si512(codes.from_code0);
    t.mantissa[1] = _mm512_load_si512(codes.from_code0 + 64);
    const int32_t offset = codes.code0 - 8 * e0;
    const BinadeCodes& binade = binade_codes(slots, offset);
    t.binade[0] = _mm512_load_si512(binade.binade);
    t.binade[1] = _mm512_load_si512(binade.binade + 64);
    t.words_from = offset;
    return true;
  }

  static const MantissaCodes& mantissa_codes(const Slots& slots, uint32_t mantissa) {
    MantissaCodes& entry = slots.mantissa[mantissa >> (23 - Caches::kMantissaSlotBits)];
    if (C10_LIKELY(entry.tag == mantissa + 1)) {
      return entry;
    }
    constexpr int32_t kRebias = (127 - (kFormat == Fp8Format::E4M3FNUZ ? 8 : 7)) << 3;
    const __m512 vinv = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int32_t>((127u << 23) | mantissa)));
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    alignas(64) uint8_t codes[128];
    for (int32_t k = 0; k < 8; ++k) {  // mantissas 16k..16k+15
      const __m512i x = _mm512_or_si512(_mm512_set1_epi32((130 << 23) | (k << 20)), _mm512_slli_epi32(lane, 16));
      const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(x), vinv));
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(1));
      const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFFF)));
      const __m512i code = _mm512_sub_epi32(_mm512_srli_epi32(rounded, 20), _mm512_set1_epi32(kRebias));
      _mm_store_si128(reinterpret_cast<__m128i*>(codes + 16 * k), _mm512_cvtepi32_epi8(code));
    }
    entry.code0 = codes[0];
    const __m512i base = _mm512_set1_epi8(static_cast<char>(entry.code0));
    _mm512_store_si512(entry.from_code0, _mm512_sub_epi8(_mm512_load_si512(codes), base));
    _mm512_store_si512(entry.from_code0 + 64, _mm512_sub_epi8(_mm512_load_si512(codes + 64), base));
    entry.tag = mantissa + 1;
    return entry;
  }

  static const BinadeCodes& binade_codes(const Slots& slots, int32_t offset) {
    BinadeCodes& entry = slots.binade[static_cast<uint32_t>(offset) % Caches::kBinadeSlots];
    if (C10_LIKELY(entry.offset == offset)) {
      return entry;
    }
    const __m512i sixteen_h = _mm512_slli_epi16(
        _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8,
                         7, 6, 5, 4, 3, 2, 1, 0),
        4);
    const __m512i voffset = _mm512_set1_epi16(static_cast<int16_t>(offset));
    for (int32_t q = 0; q < 4; ++q) {
      const __m512i quarter = _mm512_set1_epi16(static_cast<int16_t>(512 * q));  // h = 32q..32q+31
      __m512i v = _mm512_add_epi16(_mm512_add_epi16(sixteen_h, quarter), voffset);
      if (q == 3) {
        v = _mm512_mask_mov_epi16(v, __mmask32{1u} << 31, _mm512_set1_epi16(-24));  // h = 127
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(entry.binade + 32 * q), _mm512_cvtsepi16_epi8(v));
    }
    entry.offset = offset;
    return entry;
  }

  // The 128 bytes (two cache lines) of a step of 64 bf16 lanes, into L1.
  static void prefetch_step(const c10::BFloat16* p) {
    _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + 32), _MM_HINT_T0);
  }

  // One step of 64 lanes by the byte tables; returns the lanes whose code falls in the band
  // that needs the float path (their bytes are wrong: the caller redoes the step or its group).
  // Writing regardless keeps the step loops free of the float path, whose registers otherwise
  // evict the step's constants (GCC re-broadcast them per group).
  struct ByteStep {
    __m512i low_bytes = _mm512_loadu_si512(kEvenBytes.data());
    __m512i high_bytes = _mm512_add_epi8(low_bytes, _mm512_set1_epi8(1));
    __m512i eight = _mm512_set1_epi8(8);
    __m512i band_lo = _mm512_set1_epi8(24);
    __m512i band = _mm512_set1_epi8(32);
    __m512i top = _mm512_set1_epi8(0x7E);
    __m512i sign_bit = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512i zero = _mm512_setzero_si512();

    __attribute__((target("avx512vbmi"), always_inline)) __mmask64 operator()(const __m512i* mantissa,
                                                                        const __m512i* binade,
                                                                        const c10::BFloat16* src,
                                                                        uint8_t* out) const {
      const __m512i w0 = _mm512_loadu_si512(src);
      const __m512i w1 = _mm512_loadu_si512(src + 32);
      const __m512i lo = _mm512_permutex2var_epi8(w0, low_bytes, w1);   // b << 7 | m
      const __m512i hi = _mm512_permutex2var_epi8(w0, high_bytes, w1);  // sign << 7 | h
      __m512i mant = _mm512_permutex2var_epi8(mantissa[0], lo, mantissa[1]);
      mant = _mm512_mask_add_epi8(mant, _mm512_movepi8_mask(lo), mant, eight);
      const __m512i c = _mm512_adds_epi8(mant, _mm512_permutex2var_epi8(binade[0], hi, binade[1]));
      const __mmask64 float_path = _mm512_cmplt_epu8_mask(_mm512_add_epi8(c, band_lo), band);
      const __m512i code = _mm512_min_epi8(_mm512_max_epi8(c, zero), top);
      __m512i signed_code = _mm512_ternarylogic_epi32(code, hi, sign_bit, kOr);
      if constexpr (kFormat == Fp8Format::E4M3FNUZ) {
        signed_code = _mm512_mask_mov_epi8(signed_code, _mm512_cmpeq_epi8_mask(code, zero), zero);  // no -0
      }
      _mm512_storeu_si512(out, signed_code);
      return float_path;
    }
  };

  // quantize_row, out of line: the step loops' rare float path.
  __attribute__((noinline)) static void redo_by_float(const c10::BFloat16* src, uint8_t* out, int64_t n, float inv,
                                                      float bound) {
    quantize_row<kFormat, c10::BFloat16>(src, out, n, inv, nullptr, bound);
  }

  // Byte indices 0, 2, ..., 126: the low bytes of 64 words held in two registers.
  static constexpr std::array<uint8_t, 64> kEvenBytes = [] {
    std::array<uint8_t, 64> even{};
    for (int32_t j = 0; j < 64; ++j) {
      even[j] = static_cast<uint8_t>(2 * j);
    }
    return even;
  }();

  // Whole steps of 64 lanes; returns how many elements it wrote.
  __attribute__((target("avx512vbmi"))) int64_t quantize_bytes(const c10::BFloat16* src, uint8_t* out, int64_t n,
                                                               float bound, const c10::BFloat16* next) const {
    const ByteStep step;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
      if (next != nullptr) {
        prefetch_step(next + i);
      }
      if (step(tables_.mantissa, tables_.binade, src + i, out + i) != 0) {
        redo_by_float(src + i, out + i, 64, inv_, bound);
      }
    }
    return i;
  }

  // Words: code = word_table[m] + 8E, the codes at the reference binade (byte tables' mantissa
  // part + code0) minus 8 * E0.
  void build_words() {
    const __m512i from = _mm512_set1_epi16(static_cast<int16_t>(tables_.words_from));
    const __m512i* mantissa = tables_.mantissa;
    word_table_[0] = _mm512_add_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(mantissa[0])), from);
    word_table_[1] = _mm512_add_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(mantissa[0], 1)), from);
    word_table_[2] = _mm512_add_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(mantissa[1])), from);
    word_table_[3] = _mm512_add_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(mantissa[1], 1)), from);
    words_built_ = true;
  }

  // Whole steps of 32 lanes; returns how many elements it wrote.
  int64_t quantize_words(const c10::BFloat16* src, uint8_t* out, int64_t n, float bound) const {
    const __m512i mantissa_hi = _mm512_set1_epi16(0x40);
    const __m512i exponent8 = _mm512_set1_epi16(0x7F8);
    const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
    const __m512i special = _mm512_set1_epi16(0x7F80);  // inf and NaN from here up
    const __m512i band_lo = _mm512_set1_epi16(24);
    const __m512i band = _mm512_set1_epi16(32);
    const __m512i top = _mm512_set1_epi16(0x7E);
    const __m512i sign_bit = _mm512_set1_epi16(0x80);
    const __m512i zero = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
      const __m512i w = _mm512_loadu_si512(src + i);
      const __m512i low = _mm512_permutex2var_epi16(word_table_[0], w, word_table_[1]);
      const __m512i high = _mm512_permutex2var_epi16(word_table_[2], w, word_table_[3]);
      const __m512i t = _mm512_mask_mov_epi16(low, _mm512_test_epi16_mask(w, mantissa_hi), high);
      const __m512i c = _mm512_add_epi16(t, _mm512_and_si512(_mm512_srli_epi16(w, 4), exponent8));
      if ((_mm512_cmplt_epu16_mask(_mm512_add_epi16(c, band_lo), band) |
           _mm512_cmpge_epu16_mask(_mm512_and_si512(w, magnitude), special)) != 0) {
        quantize_row<kFormat, c10::BFloat16>(src + i, out + i, 32, inv_, nullptr, bound);
        continue;
      }
      const __m512i code = _mm512_min_epi16(_mm512_max_epi16(c, zero), top);
      __m512i signed_code = _mm512_ternarylogic_epi32(code, _mm512_srli_epi16(w, 8), sign_bit, kOr);
      if constexpr (kFormat == Fp8Format::E4M3FNUZ) {
        signed_code = _mm512_mask_mov_epi16(signed_code, _mm512_cmpeq_epi16_mask(code, zero), zero);  // no -0
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi16_epi8(signed_code));
    }
    return i;
  }

  Tables tables_;  // for inv_, from build()
  __m512i word_table_[4];
  bool words_built_ = false;
  float inv_ = 0.0f;
};
#endif

// quantize_row for runs of values sharing one scale (a row, a group): bf16 runs of at least
// kMinRow go through a Bf16Fp8Table (rebuilt when inv changes) where AVX512 is compiled and
// VLLM_IR_C_TABLES is not 0, the rest through quantize_row. The same bytes either way.
template <Fp8Format kFormat, typename T>
class RowQuantizer {
 public:
  // Below this a table (about 30 vector instructions to set up, a cache miss 60 more) costs
  // more than it saves.
  static constexpr int64_t kMinRow = 64;

  // Whether rows of n elements may go through the table (if inv allows it).
  static bool by_table(int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
    return std::is_same_v<T, c10::BFloat16> && n >= kMinRow && table16::tables_enabled();
#else
    return false;
#endif
  }

  // `next` (optional): a row of n that the caller reads next, prefetched on the table path.
  void operator()(const T* src, uint8_t* out, int64_t n, float inv, float bound, const T* next = nullptr) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (by_table(n)) {
        if (!(inv == built_for_)) {  // NaN never matches: build() declines it again
          usable_ = table_.build(inv);
          built_for_ = inv;
        }
        if (usable_) {
          table_.quantize(src, out, n, bound, next);
          return;
        }
      }
    }
#endif
    quantize_row<kFormat, T>(src, out, n, inv, nullptr, bound);
  }

 private:
#if defined(CPU_CAPABILITY_AVX512)
  Bf16Fp8Table<kFormat> table_;
  float built_for_ = 0.0f;  // build(0) declines: usable_ stays false until a real inv
  bool usable_ = false;
#endif
};

// max |src[0:n]| (NaN if any is NaN), the widening-free way for bf16 where AVX512 is compiled.
template <typename T>
inline float row_absmax(const T* src, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return Bf16Fp8Table<Fp8Format::E4M3FN>::absmax(src, n);
  }
#endif
  return widen_absmax<T>(src, nullptr, n);
}

// Group quant of an fp32 row whose group absmaxes are known: for group k of g elements (the
// last maybe fewer), scales[k * scale_stride] = group_scale(absmax[k]) and its codes, as
// dynamic_group_quant_fp8 defines them (the float path: the group quant kernel's widened rows,
// the fused kernels' fp32 y).
template <Fp8Format kFormat>
inline void quantize_fp32_groups(const float* row, uint8_t* out, int64_t n, int64_t g, const float* absmax,
                                 float* scales, int64_t scale_stride, bool use_ue8m0, float bound) {
  for (int64_t c = 0, k = 0; c < n; c += g, ++k) {
    const float s = group_scale(absmax[k], use_ue8m0, kFormat);
    scales[k * scale_stride] = s;
    quantize_row<kFormat, float>(row + c, out + c, std::min(g, n - c), 1.0f / s, nullptr, bound);
  }
}

// Group quant of one row, its absmaxes taken without widening: for group k of g elements (the
// last maybe fewer), scales[k * scale_stride] = group_scale(its absmax) and its codes, as
// dynamic_group_quant_fp8 defines them; bf16 groups by table where RowQuantizer takes them
// (all of a row's groups in one call with AVX512-VBMI, prefetching the row `next` if set).
// absmax: scratch for the row's groups.
template <Fp8Format kFormat, typename T>
inline void quantize_row_groups(const T* x, uint8_t* out, int64_t n, int64_t g, float* absmax, float* scales,
                                int64_t scale_stride, bool use_ue8m0, float bound,
                                RowQuantizer<kFormat, T>& quantize_by, const T* next = nullptr) {
  for (int64_t c = 0, k = 0; c < n; c += g, ++k) {
    absmax[k] = row_absmax<T>(x + c, std::min(g, n - c));
  }
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (RowQuantizer<kFormat, T>::by_table(g) && cpu_has_avx512_vbmi()) {
      Bf16Fp8Table<kFormat>::quantize_groups(x, out, n, g, absmax, scales, scale_stride, use_ue8m0, bound, next);
      return;
    }
  }
#endif
  for (int64_t c = 0, k = 0; c < n; c += g, ++k) {
    const float s = group_scale(absmax[k], use_ue8m0, kFormat);
    scales[k * scale_stride] = s;
    quantize_by(x + c, out + c, std::min(g, n - c), 1.0f / s, bound);
  }
}

}  // namespace fp8_vec
}  // namespace CPU_CAPABILITY
}  // namespace vllm_ir_c
